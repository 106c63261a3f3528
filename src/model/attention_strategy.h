// How softmax attention sees the sequence. The local strategy attends over the micro-batch it
// holds; sequence-parallel strategies (Ulysses, ring; parallel/sp_attention.h) exchange heads or
// key blocks between ranks.
#pragma once

#include "backend/backend.h"
#include "model/batch.h"

namespace spindle {

class DeltaNetSequence;

// What one layer's softmax attention computes besides q, k and v: its logits (scale, soft-cap,
// window) and, for a family with sinks, the layer's sink logits (Backend::attention_sink_forward).
struct AttentionCall {
  AttentionLogits logits;
  Tensor sinks;                  // [Hq] one logit per query head; undefined: no sinks
  Tensor* sinks_grad = nullptr;  // backward adds ∂L/∂sinks here ([Hq]); null: the sinks are frozen
};

// backward must depend on its arguments only, never on state left by a forward call: the decoder
// calls forward for every layer before any backward, calls it again for a recomputed layer, and
// not again for a layer that keeps its attention output (DecoderOptions::keep_attention), so the
// forward call before a layer's backward may be another layer's or another micro-batch's.
class AttentionStrategy {
 public:
  virtual ~AttentionStrategy() = default;
  // q [T, Hq, D], k/v [T, Hkv, D] -> out [T, Hq, D], lse [Hq, T] (the sinks in it)
  virtual void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                       const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) = 0;
  // dq, dk, dv overwritten; ∂L/∂sinks added to call.sinks_grad.
  virtual void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                        const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse,
                        const AttentionCall& call, Tensor& dq, Tensor& dk, Tensor& dv) = 0;
  // How gated DeltaNet layers see the same sharded sequence (model/deltanet_sequence.h); null: the
  // whole sequence is local and the mixer runs it itself.
  virtual DeltaNetSequence* deltanet() { return nullptr; }
};

class LocalAttention final : public AttentionStrategy {
 public:
  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
               const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse, const AttentionCall& call,
                Tensor& dq, Tensor& dk, Tensor& dv) override;
};

// The sinks of a call merged into a finished out/lse (forward), and their gradient (backward): what
// every strategy does once a row's key blocks are all merged. No-ops without sinks.
void merge_attention_sinks(Backend& backend, Stream stream, const AttentionCall& call, Tensor& out, Tensor& lse);
void attention_sinks_backward(Backend& backend, Stream stream, const AttentionCall& call, const Tensor& out,
                              const Tensor& dout, const Tensor& lse);

}  // namespace spindle
