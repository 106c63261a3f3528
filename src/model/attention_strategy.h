// How softmax attention sees the sequence. The local strategy attends over the micro-batch it
// holds; sequence-parallel strategies (Ulysses, ring; parallel/sp_attention.h) exchange heads or
// key blocks between ranks.
#pragma once

#include "backend/backend.h"
#include "model/batch.h"

namespace spindle {

class DeltaNetSequence;

// backward must depend on its arguments only, never on state left by a forward call: the decoder
// calls forward for every layer before any backward, calls it again for a recomputed layer, and
// not again for a layer that keeps its attention output (DecoderOptions::keep_attention), so the
// forward call before a layer's backward may be another layer's or another micro-batch's.
class AttentionStrategy {
 public:
  virtual ~AttentionStrategy() = default;
  // q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D], lse [Hq, T]
  virtual void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                       const Tensor& v, double scale, Tensor& out, Tensor& lse) = 0;
  // dq, dk, dv overwritten.
  virtual void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse, double scale,
                        Tensor& dq, Tensor& dk, Tensor& dv) = 0;
  // How gated DeltaNet layers see the same sharded sequence (model/deltanet_sequence.h); null: the
  // whole sequence is local and the mixer runs it itself.
  virtual DeltaNetSequence* deltanet() { return nullptr; }
};

class LocalAttention final : public AttentionStrategy {
 public:
  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
               const Tensor& v, double scale, Tensor& out, Tensor& lse) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse, double scale, Tensor& dq,
                Tensor& dk, Tensor& dv) override;
};

}  // namespace spindle
