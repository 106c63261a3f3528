// One forward pass worth of tokens on the device: packed rows laid end to end.
#pragma once

#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "data/document.h"

namespace spindle {

// Consecutive tokens of one document (or of padding) in a micro-batch, with the length that document
// has in its whole row: its largest position + 1 over every token of the row, the same on every
// sequence-parallel rank whatever part of it a rank holds (for a document run alone, transformers'
// max(position_ids) + 1). A RoPE scaling that depends on the length (longrope, dynamic) rotates each
// run with its document's table (model/rope_tables.h).
struct DocumentRun {
  int64_t begin = 0, end = 0;  // token indices [begin, end) of the micro-batch
  int64_t length = 0;          // 0 for padding
};

struct MicroBatch {
  Tensor input_ids;  // I32 [T]
  Tensor positions;  // I32 [T] position inside the token's own document (RoPE and the mask)
  Tensor doc_ids;    // I32 [T] document id, unique across the micro-batch; padding −1
  Tensor selected;   // I32 [N] token indices whose target is supervised with nonzero weight
  Tensor targets;    // I32 [N] the token each selected position predicts
  Tensor weights;    // [N] stat dtype (F32, F64 for F64 models): loss weight of each target
  int64_t num_tokens = 0;
  int64_t num_selected = 0;
  int64_t num_items = 0;  // supervised targets (the denominator's share of this micro-batch)
  // Host-side facts for attention masks (AttentionMask::plain_causal): these tokens are one
  // document at positions 0 … T−1 (no padding); and, for a sequence-parallel shard, the same of
  // the whole row when the Ulysses all-to-all gathers it back in order (contiguous layout).
  bool one_causal_document = false;
  bool row_one_causal_document = false;
  std::vector<DocumentRun> document_runs;  // covering [0, num_tokens) in order
};

// The runs of `tokens` (a packed row, or a sequence-parallel shard of `whole`), each document's length
// taken from `whole`; token indices start at `first_token`.
std::vector<DocumentRun> document_runs(const PackedRow& tokens, const PackedRow& whole, int64_t first_token = 0);

// Whether a packed row is one document at positions 0 … n−1 with no padding.
bool is_one_causal_document(const PackedRow& row);

// Statistics (rstd, lse, loss, target weights) are F32, or F64 when the model computes in F64.
inline DType stat_dtype(DType model_dtype) { return model_dtype == DType::F64 ? DType::F64 : DType::F32; }

// Concatenates rows (document ids made unique across rows) and selects the supervised positions
// on the host, where the data already is; uploads the result.
MicroBatch make_micro_batch(Backend& backend, const std::vector<PackedRow>& rows, DType model_dtype);

}  // namespace spindle
