// How a gated DeltaNet layer's sequence work sees the sequence: the causal conv, the gates and the
// delta rule, which run over the tokens of each document in order (blocks/gated_deltanet.h). On one
// device the mixer does this work itself. Under sequence parallelism each rank holds a shard of
// the sequence and the mixer hands the shard's projections to a DeltaNetSequence
// (parallel/sp_deltanet.h) that returns the shard's delta-rule output exactly as one device would
// compute it, with the matching gradients: by an all-to-all over heads (Ulysses), by passing the
// recurrent state from rank to rank (ring), or both.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "model/batch.h"

namespace spindle {

// The heads a call covers and their parameters. C = 2·Hk·dk + Hv·dv conv channels: q of the Hk key
// heads, then k, then v of the Hv value heads (head-major), as in_proj_qkv lays them out.
struct DeltaNetHeads {
  int64_t key_heads = 0, value_heads = 0, key_dim = 0, value_dim = 0;
  int64_t chunk_size = 64;
  double scale = 1.0;         // the delta rule's query scale, 1/√dk
  double l2norm_eps = 1e-6;   // q and k are L2-normed with this epsilon
  Tensor conv;                // [C, 1, K] depthwise conv weight of these channels
  Tensor a_log, dt_bias;      // [Hv]
  Tensor* conv_grad = nullptr;  // [C, 1, K] accumulated into; null: frozen
  Tensor* a_log_grad = nullptr;
  Tensor* dt_bias_grad = nullptr;

  int64_t key_width() const { return key_heads * key_dim; }
  int64_t value_width() const { return value_heads * value_dim; }
  int64_t channels() const { return 2 * key_width() + value_width(); }
};

// Like AttentionStrategy, backward depends on its arguments only (never on state a forward call
// left): the decoder may run other layers' forwards in between, or none for a kept core.
class DeltaNetSequence {
 public:
  virtual ~DeltaNetSequence() = default;
  // qkv [T, C] in_proj_qkv's output (the conv's input), a and b [T, Hv] in_proj_a/b's outputs →
  // core [T, Hv, dv] the delta rule's output, for this rank's T tokens.
  virtual void forward(Backend& backend, Stream stream, const MicroBatch& batch, const DeltaNetHeads& heads,
                       const Tensor& qkv, const Tensor& a, const Tensor& b, Tensor& core) = 0;
  // d_qkv [T, C], da and db [T, Hv] overwritten from d_core [T, Hv, dv]; the conv, A_log and dt_bias
  // gradients accumulate (the shares of this rank's tokens: the trainer sums them over the group).
  virtual void backward(Backend& backend, Stream stream, const MicroBatch& batch, const DeltaNetHeads& heads,
                        const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& d_core, Tensor& d_qkv,
                        Tensor& da, Tensor& db) = 0;
};

}  // namespace spindle
