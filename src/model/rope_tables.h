// The RoPE inverse-frequency tables a micro-batch is rotated with, for one RoPE setting of the model
// (the full-attention layers', or the sliding layers' own): one table over every token, or, for a
// scaling that depends on the sequence length (longrope, dynamic), each document rotated with the
// table of its own length (MicroBatch::document_runs).
//
// What "the length" is. transformers reads max(position_ids) + 1 in every forward: for one document
// run alone (one unpacked sequence, as its references and HF training with batch size one run) that
// is the document's length. spindle gives every document of a packed row what that document gets
// alone, so packing a row never changes a document's loss: its length is its largest position + 1 in
// the whole row, the same on every sequence-parallel rank whatever part of it a rank holds, never the
// length of a shard. (transformers fed a packed row with position_ids takes the longest document's
// length for all of them: a short document beside a long one then rotates with the long factors.)
// Dynamic NTK: transformers keeps the table of the longest sequence since the last one shorter than
// max_position_embeddings (its cache only grows, and resets on such a short sequence); spindle takes
// each document's own length, which is what transformers computes for it in a fresh model and
// whenever no longer sequence came before it since such a reset, and keeps every mesh identical to
// one device.
#pragma once

#include <cstdint>
#include <map>
#include <vector>

#include "backend/backend.h"
#include "model/batch.h"
#include "model/config.h"

namespace spindle {

// Tokens [begin, end) of a micro-batch and the table that rotates them.
struct RopeSpan {
  int64_t begin = 0, end = 0;
  Tensor inv_freq;  // F32 [rotary_dim/2]
};

class RopeTables {
 public:
  RopeTables(Backend& backend, Stream stream, const RopeConfig& rope, int64_t rotary_dim);

  // Spans covering the batch's tokens in order; neighbouring documents with one table share a span
  // (a setting that does not depend on the length: one span over every token).
  std::vector<RopeSpan> spans(const MicroBatch& batch);

 private:
  // The table of `key` (RopeConfig::table_key), made from `length` the first time.
  const Tensor& table(int64_t key, int64_t length);

  Backend& backend_;
  Stream stream_;
  RopeConfig rope_;
  int64_t rotary_dim_;
  std::map<int64_t, Tensor> tables_;  // by table key; key 0 always present
};

}  // namespace spindle
