// The decoder's explicit forward and backward (no autograd): embedding, N × (RMSNorm, attention
// with RoPE, RMSNorm, SwiGLU MLP) with residuals, final RMSNorm, and the fused LM-head loss over the
// supervised positions only. Every buffer is named with its shape in LayerActivations.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/batch.h"
#include "model/weights.h"

namespace spindle {

// How attention sees the sequence. The local strategy attends over the micro-batch it holds;
// sequence-parallel strategies (Ulysses, ring) exchange heads or key blocks between ranks.
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
};

class LocalAttention final : public AttentionStrategy {
 public:
  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
               const Tensor& v, double scale, Tensor& out, Tensor& lse) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse, double scale, Tensor& dq,
                Tensor& dk, Tensor& dv) override;
};

struct DecoderOptions {
  // Layers whose activations are recomputed in backward instead of kept (checkpointing): only the
  // layer input is stored. Empty means keep everything.
  std::vector<bool> recompute;
  // Upper bound of the logits chunk of the fused LM-head loss.
  size_t logits_budget_bytes = size_t{64} << 20;
};

// Saved activations of one layer (T tokens, H hidden, Hq/Hkv heads of D, F MLP width, r LoRA rank).
struct LayerActivations {
  Tensor x_in;                // [T, H]   layer input (the residual stream), always kept
  Tensor xn1, rstd1;          // [T, H], [T]      input RMSNorm
  Tensor q_raw, k_raw;        // [T, Hq, D], [T, Hkv, D] projections before q/k norm (qwen3 only)
  Tensor q_rstd, k_rstd;      // [T·Hq], [T·Hkv]  (qwen3 only)
  Tensor q, k, v;             // [T, Hq, D], [T, Hkv, D], [T, Hkv, D] attention inputs (normed, rotated)
  Tensor attn, lse;           // [T, Hq, D], [Hq, T]
  Tensor x_mid;               // [T, H]   x_in + o_proj(attn)
  Tensor xn2, rstd2;          // [T, H], [T]      post-attention RMSNorm
  Tensor gate, up, act;       // [T, F] each; act = silu(gate)·up
  Tensor lora_xa[7];          // [T, r] x·Aᵀ of each LoRA projection (q k v o gate up down)
};

class Decoder {
 public:
  Decoder(Backend& backend, ModelWeights& weights, DecoderOptions options = {});

  // One micro-batch: adds Σ weight·CE · loss_scale into loss_sum (one stat-dtype element). With
  // backward, accumulates the gradient of that sum into every trainable parameter's grad, so
  // micro-batches of one optimizer step simply add up when loss_scale = 1 / (global item count).
  // token_ce (optional, F32 [num_selected]) receives each selected target's unweighted CE.
  void step(const MicroBatch& batch, double loss_scale, Tensor& loss_sum, bool backward, Tensor* token_ce = nullptr);

  // Logits [n, V] at the token indices `rows` (I32 [n]) of the batch, forward only: for
  // generation and checks. Training never materialises logits (see step).
  void logits(const MicroBatch& batch, const Tensor& rows, Tensor& out);

  void set_attention(AttentionStrategy* attention) { attention_ = attention ? attention : &local_attention_; }
  const ModelWeights& weights() const { return weights_; }

 private:
  Tensor forward(const MicroBatch& batch, bool keep, std::vector<LayerActivations>& acts);
  void forward_layer(int64_t layer, const MicroBatch& batch, LayerActivations& a, Tensor& x_out);
  void backward_layer(int64_t layer, const MicroBatch& batch, const LayerActivations& a, Tensor& d_res,
                      bool need_input_grad);
  void allocate(LayerActivations& a, int64_t tokens, bool full);
  Tensor scratch_grad(const Parameter& p);  // a sink for gradients of frozen parameters

  Backend& backend_;
  ModelWeights& weights_;
  DecoderOptions options_;
  Stream stream_;
  LocalAttention local_attention_;
  AttentionStrategy* attention_;
  Tensor inv_freq_;  // F32 [D/2]
};

}  // namespace spindle
