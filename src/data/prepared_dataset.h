// The prepared dataset: documents tokenized once by `spindle prepare` and memory-mapped by
// training, which then packs them (any max_length / padding multiple) without re-tokenizing.
//
// File layout (little-endian, version 1; docs/formats.md "Datasets" has the full description):
//   [0, 64)          header: magic "SPNDLDOC", version, kind, counts, index offset, file size
//   [64, index)      one record per document: int32 input_ids[n], int32 labels[n] (HF alignment,
//                    -100 = not supervised), then float32 loss_scale[n] if the document has one
//   [index, end)     document index: {u64 record offset, u32 length, u32 flags} per document
// It is written under a temporary name and renamed when complete, so a file with the final name
// is always whole; the reader still checks every offset against the file size.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "data/document.h"
#include "data/jsonl_reader.h"
#include "data/packing.h"
#include "data/sample_encoder.h"

namespace spindle {

enum class DatasetKind : uint32_t {
  kDocuments = 0,        // one training document per sample
  kPreferencePairs = 1,  // documents 2i (chosen) and 2i+1 (rejected) form pair i
};
std::string_view dataset_kind_name(DatasetKind kind);

inline constexpr char kPreparedMagic[8] = {'S', 'P', 'N', 'D', 'L', 'D', 'O', 'C'};
inline constexpr uint32_t kPreparedVersion = 1;
inline constexpr const char* kPreparedDataFile = "dataset.bin";
inline constexpr const char* kPreparedInfoFile = "dataset.json";

// Appends documents to a new prepared file. Nothing appears under `path` until finish().
class PreparedDatasetWriter {
 public:
  PreparedDatasetWriter(std::filesystem::path path, DatasetKind kind);
  ~PreparedDatasetWriter();  // removes the temporary file unless finish() succeeded
  PreparedDatasetWriter(const PreparedDatasetWriter&) = delete;
  PreparedDatasetWriter& operator=(const PreparedDatasetWriter&) = delete;

  void add(const DocumentView& document);
  void finish();  // writes the index and header, flushes to disk, renames into place

  int64_t documents() const { return static_cast<int64_t>(index_.size()); }
  int64_t tokens() const { return tokens_; }
  int64_t bytes_written() const { return offset_; }

 private:
  void write(const void* data, size_t bytes);

  std::filesystem::path path_;
  std::filesystem::path temp_path_;
  DatasetKind kind_;
  std::FILE* file_ = nullptr;
  std::vector<char> stream_buffer_;
  struct IndexEntry {
    uint64_t offset;
    uint32_t length;
    uint32_t flags;
  };
  std::vector<IndexEntry> index_;  // 16 bytes per document: the only per-document memory
  int64_t tokens_ = 0;
  uint64_t offset_ = 0;
  bool finished_ = false;
};

// A prepared file, memory-mapped read-only. Copies share the mapping.
class PreparedDataset {
 public:
  // Throws Error naming the file when it is not a prepared dataset, is of another version, or is
  // truncated or inconsistent. `path` may be the file or the directory `spindle prepare` wrote.
  static PreparedDataset open(const std::filesystem::path& path);

  DatasetKind kind() const { return kind_; }
  int64_t num_documents() const { return num_documents_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t document_length(int64_t index) const;
  DocumentView document(int64_t index) const;  // views into the mapping
  const std::filesystem::path& path() const { return path_; }

 private:
  struct Mapping;
  std::shared_ptr<const Mapping> mapping_;
  std::filesystem::path path_;
  DatasetKind kind_ = DatasetKind::kDocuments;
  int64_t num_documents_ = 0;
  int64_t num_tokens_ = 0;
  const unsigned char* index_ = nullptr;
};

// Fits (over-length and no-target policies) and plans rows over every document of a prepared
// dataset; build the rows with build_row(plan, [&](i) { return dataset.document(i); }, ...).
std::vector<RowPlan> plan_prepared_rows(const PreparedDataset& dataset, const PackOptions& options,
                                        PackStats& stats);

// Preference data (pair i = documents 2i chosen, 2i+1 rejected) as groups of rows that hold whole
// pairs, so a pair never straddles two optimizer steps. The over-length and no-target policies
// apply to each side; a pair with a dropped side is left out (counted in pairs_dropped). A pair
// whose sides fit in max_length together shares one row: with packing, such pairs are packed as
// units (best-fit decreasing, as documents are), without packing each gets its own row (its sides
// are two documents of the row: they never attend to each other). A pair whose sides do not fit
// together is a group of two rows, chosen then rejected. Groups are in order of their first pair.
std::vector<std::vector<RowPlan>> plan_prepared_pairs(const PreparedDataset& dataset, const PackOptions& options,
                                                      PackStats& stats, int64_t& pairs_dropped);

struct PrepareOptions {
  std::filesystem::path data;        // the --data value: JSONL, Parquet or Arrow (dataset_files.h)
  std::filesystem::path output_dir;  // receives dataset.bin and dataset.json
  EncodeOptions encode;
  // max_length, over_length and drop_documents_without_targets apply while preparing; packing
  // itself happens when training reads the file.
  PackOptions fit;
  std::string tokenizer_description;  // recorded in dataset.json
};

struct PrepareReport {
  DatasetKind kind = DatasetKind::kDocuments;
  ReadStats read;
  PackStats fit;
  int64_t documents = 0;        // written
  int64_t tokens = 0;           // written
  int64_t pairs_dropped = 0;    // preference pairs left out because a side was dropped
  int64_t bytes_written = 0;
  double seconds = 0;
  std::filesystem::path file;
  std::string source_format = "JSONL";  // of the input: JSONL, Parquet or Arrow
  std::string summary() const;  // lines for the user
};

// Streams the dataset's samples (resolved as dataset_files.h says) through the encoder into
// output_dir: memory stays bounded by the longest line or table batch and document (plus 16 bytes
// per document), time is linear in the input size.
// `text_encoder` may be null for pre-tokenized data.
PrepareReport prepare_dataset(const PrepareOptions& options, const TextEncoder* text_encoder);

}  // namespace spindle
