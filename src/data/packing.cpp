#include "data/packing.h"

#include <algorithm>
#include <numeric>
#include <set>
#include <utility>

#include "core/error.h"
#include "data/jsonl_reader.h"

namespace spindle {

DocumentView view_of(const Document& document) {
  return DocumentView{document.input_ids, document.labels, document.loss_scale};
}

OverLength parse_over_length(std::string_view name) {
  if (name == "truncate") return OverLength::kTruncate;
  if (name == "truncate-left") return OverLength::kTruncateLeft;
  if (name == "drop") return OverLength::kDrop;
  if (name == "error") return OverLength::kFail;
  fail("unknown over-length policy '{}'; use truncate, truncate-left, drop or error", name);
}

std::string_view over_length_name(OverLength policy) {
  switch (policy) {
    case OverLength::kTruncate: return "truncate";
    case OverLength::kTruncateLeft: return "truncate-left";
    case OverLength::kDrop: return "drop";
    case OverLength::kFail: return "error";
  }
  return "?";
}

void PackOptions::validate() const {
  if (max_length <= 0) fail("max_length must be positive (got {}); set --max-length", max_length);
  if (pad_to_multiple <= 0)
    fail("pad_to_multiple must be at least 1 (got {})", pad_to_multiple);
  if (max_length % pad_to_multiple != 0)
    fail("max_length {} is not a multiple of {} (the padding multiple the sequence-parallel layout "
         "needs); use --max-length {}",
         max_length, pad_to_multiple, max_length / pad_to_multiple * pad_to_multiple);
  if (window_tokens < 0) fail("window_tokens must be >= 0 (got {})", window_tokens);
}

void PackStats::add(const PackStats& o) {
  documents_seen += o.documents_seen;
  documents_packed += o.documents_packed;
  documents_truncated += o.documents_truncated;
  tokens_truncated += o.tokens_truncated;
  documents_dropped_over_length += o.documents_dropped_over_length;
  tokens_dropped_over_length += o.tokens_dropped_over_length;
  documents_without_targets += o.documents_without_targets;
  documents_dropped_without_targets += o.documents_dropped_without_targets;
  rows += o.rows;
  tokens += o.tokens;
  padding_tokens += o.padding_tokens;
  targets += o.targets;
}

std::string PackStats::summary() const {
  const int64_t slots = tokens + padding_tokens;
  std::string text = fmt::format(
      "{} documents ({} tokens, {} supervised targets) in {} rows; padding {:.2f}% of {} slots",
      with_thousands(documents_packed), with_thousands(tokens), with_thousands(targets),
      with_thousands(rows), slots ? 100.0 * static_cast<double>(padding_tokens) / slots : 0.0,
      with_thousands(slots));
  if (documents_truncated)
    text += fmt::format("\n  truncated {} over-long documents, cutting {} tokens",
                        with_thousands(documents_truncated), with_thousands(tokens_truncated));
  if (documents_dropped_over_length)
    text += fmt::format("\n  dropped {} over-long documents ({} tokens)",
                        with_thousands(documents_dropped_over_length),
                        with_thousands(tokens_dropped_over_length));
  if (documents_without_targets)
    text += fmt::format("\n  {} documents have no supervised target after shifting{}",
                        with_thousands(documents_without_targets),
                        documents_dropped_without_targets ? " (dropped)" : " (kept, weight 0)");
  return text;
}

std::optional<DocumentSlice> fit_document(int64_t index, const DocumentView& document,
                                          const PackOptions& options, PackStats& stats,
                                          std::string_view origin) {
  const int64_t n = document.length();
  if (n == 0) fail("{} is empty; every document needs at least one token", origin);
  if (static_cast<int64_t>(document.labels.size()) != n ||
      (!document.loss_scale.empty() && static_cast<int64_t>(document.loss_scale.size()) != n))
    fail("{}: input_ids ({}), labels ({}) and loss_scale ({}) must have the same length", origin, n,
         document.labels.size(), document.loss_scale.size());
  ++stats.documents_seen;

  DocumentSlice slice{index, 0, n};
  if (n > options.max_length) {
    switch (options.over_length) {
      case OverLength::kTruncate:
      case OverLength::kTruncateLeft:
        slice.length = options.max_length;
        if (options.over_length == OverLength::kTruncateLeft) slice.begin = n - options.max_length;
        ++stats.documents_truncated;
        stats.tokens_truncated += n - options.max_length;
        break;
      case OverLength::kDrop:
        ++stats.documents_dropped_over_length;
        stats.tokens_dropped_over_length += n;
        return std::nullopt;
      case OverLength::kFail:
        fail("{} has {} tokens, more than the maximum length {}; raise --max-length or choose "
             "--over-length truncate, truncate-left or drop",
             origin, n, options.max_length);
    }
  }

  // Position i predicts labels[i+1]: the first kept label is never a target.
  bool has_target = false;
  for (int64_t i = slice.begin + 1; i < slice.begin + slice.length && !has_target; ++i)
    has_target = document.labels[i] != kIgnoreIndex;
  if (!has_target) {
    ++stats.documents_without_targets;
    if (options.drop_documents_without_targets) {
      ++stats.documents_dropped_without_targets;
      return std::nullopt;
    }
  }
  return slice;
}

std::vector<RowPlan> plan_rows(std::vector<DocumentSlice> slices, const PackOptions& options) {
  options.validate();
  std::vector<RowPlan> rows;
  if (!options.packing) {
    rows.reserve(slices.size());
    for (const auto& slice : slices) rows.push_back(RowPlan{{slice}, slice.length});
    return rows;
  }

  std::stable_sort(slices.begin(), slices.end(), [](const DocumentSlice& a, const DocumentSlice& b) {
    return a.length != b.length ? a.length > b.length : a.document < b.document;
  });
  // Open rows keyed by (room left, row index): lower_bound finds the tightest fit, ties going to
  // the oldest row, so the result does not depend on anything but the input.
  std::set<std::pair<int64_t, int64_t>> open_rows;
  for (const auto& slice : slices) {
    SPINDLE_CHECK(slice.length <= options.max_length, "slice of {} tokens exceeds max_length {}",
                  slice.length, options.max_length);
    auto fit = open_rows.lower_bound({slice.length, -1});
    int64_t row;
    int64_t room;
    if (fit == open_rows.end()) {
      row = static_cast<int64_t>(rows.size());
      rows.emplace_back();
      room = options.max_length;
    } else {
      std::tie(room, row) = *fit;
      open_rows.erase(fit);
    }
    rows[row].slices.push_back(slice);
    rows[row].tokens += slice.length;
    room -= slice.length;
    if (room > 0) open_rows.insert({room, row});
  }

  for (auto& row : rows)
    std::sort(row.slices.begin(), row.slices.end(),
              [](const DocumentSlice& a, const DocumentSlice& b) { return a.document < b.document; });
  std::sort(rows.begin(), rows.end(), [](const RowPlan& a, const RowPlan& b) {
    return a.slices.front().document < b.slices.front().document;
  });
  return rows;
}

PackedRow build_row(const RowPlan& plan, const std::function<DocumentView(int64_t)>& document,
                    const PackOptions& options, PackStats& stats) {
  SPINDLE_CHECK(plan.tokens <= options.max_length, "row of {} tokens exceeds max_length {}",
                plan.tokens, options.max_length);
  const int64_t multiple = options.pad_to_multiple;
  const int64_t length = options.pad_to_max_length
                             ? options.max_length
                             : (plan.tokens + multiple - 1) / multiple * multiple;
  PackedRow row;
  row.input_ids.assign(length, options.pad_token_id);
  row.positions.assign(length, 0);
  row.doc_ids.assign(length, -1);
  row.targets.assign(length, kIgnoreIndex);
  row.weights.assign(length, 0.0f);

  int64_t offset = 0;
  int32_t doc_in_row = 0;
  for (const auto& slice : plan.slices) {
    const DocumentView view = document(slice.document);
    SPINDLE_CHECK(slice.begin + slice.length <= view.length(), "slice past the end of document {}",
                  slice.document);
    for (int64_t i = 0; i < slice.length; ++i) {
      const int64_t source = slice.begin + i;
      const int64_t at = offset + i;
      row.input_ids[at] = view.input_ids[source];
      row.positions[at] = static_cast<int32_t>(i);
      row.doc_ids[at] = doc_in_row;
      if (i + 1 < slice.length) {
        const int32_t target = view.labels[source + 1];
        if (target != kIgnoreIndex) {
          row.targets[at] = target;
          row.weights[at] = view.loss_scale.empty() ? 1.0f : view.loss_scale[source + 1];
          ++stats.targets;
        }
      }
    }
    offset += slice.length;
    ++doc_in_row;
  }
  stats.rows += 1;
  stats.documents_packed += static_cast<int64_t>(plan.slices.size());
  stats.tokens += plan.tokens;
  stats.padding_tokens += length - plan.tokens;
  return row;
}

std::vector<PackedRow> pack_documents(const std::vector<Document>& documents,
                                      const PackOptions& options, PackStats* stats) {
  options.validate();
  PackStats local;
  PackStats& counters = stats ? *stats : local;
  std::vector<DocumentSlice> slices;
  slices.reserve(documents.size());
  for (size_t i = 0; i < documents.size(); ++i) {
    auto slice = fit_document(static_cast<int64_t>(i), view_of(documents[i]), options, counters,
                              fmt::format("document {}", i));
    if (slice) slices.push_back(*slice);
  }
  auto plans = plan_rows(std::move(slices), options);
  std::vector<PackedRow> rows;
  rows.reserve(plans.size());
  auto lookup = [&](int64_t i) { return view_of(documents[i]); };
  for (const auto& plan : plans) rows.push_back(build_row(plan, lookup, options, counters));
  return rows;
}

StreamingPacker::StreamingPacker(PackOptions options, RowSink sink)
    : options_(std::move(options)), sink_(std::move(sink)) {
  options_.validate();
  window_tokens_ = options_.window_tokens > 0 ? options_.window_tokens : 64 * options_.max_length;
}

void StreamingPacker::add(Document document, std::string_view origin) {
  const int64_t index = static_cast<int64_t>(buffer_.size());
  std::string fallback;
  if (origin.empty()) {
    fallback = fmt::format("document {}", stats_.documents_seen);
    origin = fallback;
  }
  auto slice = fit_document(index, view_of(document), options_, stats_, origin);
  if (!slice) return;
  // Keep only the slice, so a truncated giant document does not hold its full size in the window.
  if (slice->begin != 0 || slice->length != static_cast<int64_t>(document.input_ids.size())) {
    auto keep = [&](auto& values) {
      if (values.empty()) return;
      values.erase(values.begin() + slice->begin + slice->length, values.end());
      values.erase(values.begin(), values.begin() + slice->begin);
    };
    keep(document.input_ids);
    keep(document.labels);
    keep(document.loss_scale);
    slice->begin = 0;
  }
  buffer_.push_back(std::move(document));
  slices_.push_back(*slice);
  buffered_tokens_ += slice->length;
  if (buffered_tokens_ >= window_tokens_) flush();
}

void StreamingPacker::flush() {
  if (slices_.empty()) return;
  auto plans = plan_rows(std::move(slices_), options_);
  auto lookup = [&](int64_t i) { return view_of(buffer_[i]); };
  for (const auto& plan : plans) sink_(build_row(plan, lookup, options_, stats_));
  buffer_.clear();
  slices_.clear();
  buffered_tokens_ = 0;
}

void StreamingPacker::finish() { flush(); }

}  // namespace spindle
