#include "model/batch.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "core/error.h"

namespace spindle {

namespace {
Tensor upload_i32(Backend& backend, const std::vector<int32_t>& values) {
  Tensor t = backend.empty(Shape{static_cast<int64_t>(values.size())}, DType::I32);
  if (!values.empty()) backend.copy_from_host(backend.default_stream(), values.data(), t);
  return t;
}
}  // namespace

bool is_one_causal_document(const PackedRow& row) {
  const size_t n = row.doc_ids.size();
  if (n == 0 || row.positions.size() != n || row.doc_ids[0] < 0) return false;
  for (size_t i = 0; i < n; ++i)
    if (row.doc_ids[i] != row.doc_ids[0] || row.positions[i] != static_cast<int32_t>(i)) return false;
  return true;
}

std::vector<DocumentRun> document_runs(const PackedRow& tokens, const PackedRow& whole, int64_t first_token) {
  std::unordered_map<int32_t, int64_t> length;  // document id -> largest position + 1 in the whole row
  SPINDLE_CHECK(whole.positions.size() == whole.doc_ids.size(), "packed row arrays differ in length");
  for (size_t i = 0; i < whole.doc_ids.size(); ++i)
    if (whole.doc_ids[i] >= 0) {
      int64_t& n = length[whole.doc_ids[i]];
      n = std::max(n, static_cast<int64_t>(whole.positions[i]) + 1);
    }
  std::vector<DocumentRun> runs;
  const size_t n = tokens.doc_ids.size();
  for (size_t begin = 0; begin < n;) {
    size_t end = begin + 1;
    while (end < n && tokens.doc_ids[end] == tokens.doc_ids[begin]) ++end;
    const int32_t doc = tokens.doc_ids[begin];
    int64_t doc_length = 0;
    if (doc >= 0) {
      const auto it = length.find(doc);
      SPINDLE_CHECK(it != length.end(), "document {} of a shard is not in its row", doc);
      doc_length = it->second;
    }
    runs.push_back({first_token + static_cast<int64_t>(begin), first_token + static_cast<int64_t>(end), doc_length});
    begin = end;
  }
  return runs;
}

MicroBatch make_micro_batch(Backend& backend, const std::vector<PackedRow>& rows, DType model_dtype) {
  std::vector<int32_t> ids, positions, docs, selected, targets;
  std::vector<double> weights;
  std::vector<DocumentRun> runs;
  int32_t doc_offset = 0;
  int64_t num_items = 0;
  for (const PackedRow& row : rows) {
    const int64_t base = static_cast<int64_t>(ids.size());
    const size_t n = row.input_ids.size();
    if (row.positions.size() != n || row.doc_ids.size() != n || row.targets.size() != n || row.weights.size() != n)
      fail("packed row arrays differ in length ({} tokens)", n);
    for (const DocumentRun& run : document_runs(row, row, base)) runs.push_back(run);
    int32_t max_doc = -1;
    for (size_t i = 0; i < n; ++i) {
      ids.push_back(row.input_ids[i]);
      positions.push_back(row.positions[i]);
      docs.push_back(row.doc_ids[i] < 0 ? -1 : row.doc_ids[i] + doc_offset);
      max_doc = std::max(max_doc, row.doc_ids[i]);
      if (row.targets[i] == kIgnoreIndex) continue;
      ++num_items;
      if (row.weights[i] == 0.0f) continue;  // counted in the denominator, contributes nothing
      selected.push_back(static_cast<int32_t>(base + static_cast<int64_t>(i)));
      targets.push_back(row.targets[i]);
      weights.push_back(row.weights[i]);
    }
    doc_offset += max_doc + 1;
  }
  MicroBatch b;
  b.one_causal_document = rows.size() == 1 && is_one_causal_document(rows[0]);
  b.row_one_causal_document = b.one_causal_document;
  b.num_tokens = static_cast<int64_t>(ids.size());
  b.num_selected = static_cast<int64_t>(selected.size());
  b.num_items = num_items;
  b.document_runs = std::move(runs);
  b.input_ids = upload_i32(backend, ids);
  b.positions = upload_i32(backend, positions);
  b.doc_ids = upload_i32(backend, docs);
  b.selected = upload_i32(backend, selected);
  b.targets = upload_i32(backend, targets);
  const DType wd = stat_dtype(model_dtype);
  b.weights = backend.empty(Shape{b.num_selected}, wd);
  if (b.num_selected) {
    if (wd == DType::F64) {
      backend.copy_from_host(backend.default_stream(), weights.data(), b.weights);
    } else {
      std::vector<float> w(weights.begin(), weights.end());
      backend.copy_from_host(backend.default_stream(), w.data(), b.weights);
    }
  }
  return b;
}

}  // namespace spindle
