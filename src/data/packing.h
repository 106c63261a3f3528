// Packing documents into rows of at most max_length tokens, with targets shifted per document on
// the full row (docs/design.md §2.1 "shift before shard", §2.4 positions, §2.5 boundaries).
//
// For a document of n tokens placed at row offset o:
//   input_ids[o+i] = ids[i]        positions[o+i] = i        doc_ids[o+i] = its index in the row
//   targets[o+i]   = labels[i+1]   for i < n-1 (kIgnoreIndex at the last token)
//   weights[o+i]   = loss_scale[i+1] (1 without loss_scale) where targets[o+i] is supervised, else 0
// Padding (pad_token_id, position 0, doc_id -1, kIgnoreIndex, weight 0) fills each row to a
// multiple of pad_to_multiple. labels[0] of a document is never a target: nothing precedes it.
//
// Bin packing is best-fit decreasing over a window of documents: longest first (ties by dataset
// order), each into the open row with the least room that still fits it, else a new row. It is
// deterministic; inside a row documents keep dataset order, and rows are ordered by their first
// document.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/document.h"

namespace spindle {

// A document whose arrays live elsewhere (a Document, a memory-mapped prepared file).
struct DocumentView {
  std::span<const int32_t> input_ids;
  std::span<const int32_t> labels;
  std::span<const float> loss_scale;  // empty: 1 everywhere
  int64_t length() const { return static_cast<int64_t>(input_ids.size()); }
};
DocumentView view_of(const Document& document);

// What happens to a document longer than max_length.
enum class OverLength {
  kTruncate,      // keep the first max_length tokens
  kTruncateLeft,  // keep the last max_length tokens (the end of a conversation)
  kDrop,          // leave the document out
  kFail,          // stop with an error naming the document
};
OverLength parse_over_length(std::string_view name);  // "truncate", "truncate-left", "drop", "error"
std::string_view over_length_name(OverLength policy);

struct PackOptions {
  int64_t max_length = 0;        // tokens per row, padding included; required
  bool packing = true;           // false: one document per row
  int64_t pad_to_multiple = 1;   // rows are padded to a multiple of this (the SP layout's need)
  bool pad_to_max_length = false;  // pad every row to exactly max_length (fixed shapes)
  int32_t pad_token_id = 0;
  OverLength over_length = OverLength::kTruncate;
  // A document with no supervised target after shifting (and truncation) adds nothing to the loss;
  // it is always counted, and dropped unless this is false.
  bool drop_documents_without_targets = true;
  // StreamingPacker only: documents are buffered until they hold this many tokens, then packed.
  // 0 means 64 rows' worth. Larger windows pack tighter and use more memory.
  int64_t window_tokens = 0;

  void validate() const;  // throws Error naming the option to change
};

struct PackStats {
  int64_t documents_seen = 0;
  int64_t documents_packed = 0;
  int64_t documents_truncated = 0;
  int64_t tokens_truncated = 0;  // tokens cut from truncated documents
  int64_t documents_dropped_over_length = 0;
  int64_t tokens_dropped_over_length = 0;
  int64_t documents_without_targets = 0;          // counted whether dropped or kept
  int64_t documents_dropped_without_targets = 0;
  int64_t rows = 0;
  int64_t tokens = 0;          // document tokens placed in rows
  int64_t padding_tokens = 0;
  int64_t targets = 0;         // supervised targets in rows: Σ row.num_items()

  void add(const PackStats& other);
  // Lines for the user: what was packed, the padding share, and every truncation or drop.
  std::string summary() const;
};

// The part of one document that goes into a row, after the over-length policy.
struct DocumentSlice {
  int64_t document = 0;  // index in the caller's document sequence
  int64_t begin = 0;     // first kept token
  int64_t length = 0;    // kept tokens
};

struct RowPlan {
  std::vector<DocumentSlice> slices;  // in dataset order
  int64_t tokens = 0;                 // Σ slice lengths
};

// Applies the over-length and no-target policies to one document and counts it in stats:
// the slice to pack, or nullopt when dropped. `origin` names the document in errors
// ("train.jsonl:17", "document 3"). Throws Error under OverLength::kFail.
std::optional<DocumentSlice> fit_document(int64_t index, const DocumentView& document,
                                          const PackOptions& options, PackStats& stats,
                                          std::string_view origin);

// Assigns slices (each at most max_length long) to rows.
std::vector<RowPlan> plan_rows(std::vector<DocumentSlice> slices, const PackOptions& options);

// Lays out one planned row and counts it in stats; `document(i)` returns document i of the
// caller's sequence.
PackedRow build_row(const RowPlan& plan, const std::function<DocumentView(int64_t)>& document,
                    const PackOptions& options, PackStats& stats);

// Packs a whole in-memory dataset (one window: the tightest packing).
std::vector<PackedRow> pack_documents(const std::vector<Document>& documents,
                                      const PackOptions& options, PackStats* stats = nullptr);

// Packs an unbounded stream of documents in bounded memory: documents are buffered up to
// options.window_tokens, then packed and handed to the sink row by row.
class StreamingPacker {
 public:
  using RowSink = std::function<void(PackedRow&&)>;
  StreamingPacker(PackOptions options, RowSink sink);

  // `origin` names the document in errors; empty means "document <n>".
  void add(Document document, std::string_view origin = {});
  void finish();  // packs what is buffered; call once at the end
  const PackStats& stats() const { return stats_; }

 private:
  void flush();

  PackOptions options_;
  RowSink sink_;
  PackStats stats_;
  std::vector<Document> buffer_;
  std::vector<DocumentSlice> slices_;  // indices into buffer_
  int64_t buffered_tokens_ = 0;
  int64_t window_tokens_ = 0;
};

}  // namespace spindle
