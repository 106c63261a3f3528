// The decoder's explicit forward and backward (no autograd): embedding, N × (RMSNorm, attention
// with RoPE, RMSNorm, SwiGLU MLP) with residuals, final RMSNorm, and the fused LM-head loss over the
// supervised positions only. Every buffer is named with its shape in LayerActivations.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/batch.h"
#include "model/recompute.h"
#include "model/weights.h"

namespace spindle {

// How attention sees the sequence. The local strategy attends over the micro-batch it holds;
// sequence-parallel strategies (Ulysses, ring) exchange heads or key blocks between ranks.
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
};

class LocalAttention final : public AttentionStrategy {
 public:
  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
               const Tensor& v, double scale, Tensor& out, Tensor& lse) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse, double scale, Tensor& dq,
                Tensor& dk, Tensor& dv) override;
};

// The groups of parameters the decoder uses together, in the order it uses them:
//  - Embedding: embed (the token table).
//  - Layer l: every parameter of layers[l] (norms, projections, biases, LoRA A/B).
//  - Head: final_norm and lm_head. With tied embeddings lm_head is the embed Parameter, which then
//    belongs to two units and is used twice per pass.
struct ParameterUnit {
  enum class Kind { Embedding, Layer, Head };
  Kind kind = Kind::Embedding;
  int64_t layer = -1;  // Layer only
  static ParameterUnit embedding() { return {Kind::Embedding, -1}; }
  static ParameterUnit layer_unit(int64_t l) { return {Kind::Layer, l}; }
  static ParameterUnit head() { return {Kind::Head, -1}; }
  bool operator==(const ParameterUnit&) const = default;
};

// Called by the Decoder around every use of a unit's parameters, so parameters can live elsewhere
// (FSDP: sharded over ranks) and be materialised only while in use. The contract:
//  - Parameter::value of a unit is read only between before_forward and after_forward, or between
//    before_backward and after_backward of that unit; Parameter::grad of its trainable parameters
//    is written (+=) only inside the backward window.
//  - step(backward = true): forward windows for the embedding and each layer in order; then one
//    backward window for the head (its forward and backward are fused: the loss computes the
//    lm_head gradient chunk by chunk); then backward windows for layers L-1 … 0 (a recomputed
//    layer re-runs its forward inside its backward window); then, only when embed is trainable, a
//    backward window for the embedding, which reads no value (a scatter-add of dout into rows).
//  - step(backward = false) and logits(): forward windows only, the head's last.
//  - Every rank makes the same sequence of calls whatever its data, even with no token at all, so
//    hooks may run collectives.
// Windows never overlap: each after_* comes before the next before_*.
class ParameterHooks {
 public:
  virtual ~ParameterHooks() = default;
  virtual void before_forward(const ParameterUnit& unit) = 0;
  virtual void after_forward(const ParameterUnit& unit) = 0;
  virtual void before_backward(const ParameterUnit& unit) = 0;
  virtual void after_backward(const ParameterUnit& unit) = 0;
};

struct DecoderOptions {
  // Layers whose activations are recomputed in backward instead of kept (checkpointing): only the
  // layer input is stored. Empty means keep everything.
  std::vector<bool> recompute;
  // Recomputed layers also keep their attention output and LSE from the forward pass, so their
  // recompute rebuilds norms, projections, RoPE'd q/k/v and the MLP but does not run the attention
  // forward again (the O(T²) part); the attention backward then reads the recomputed q, k, v with
  // the kept out and lse. Costs T·Hq·D activation-dtype + Hq·T stat-dtype elements per recomputed
  // layer (LayerActivations::attn, lse). Ignored for layers that are not recomputed.
  bool keep_attention = false;
  // Upper bound of the logits chunk of the fused LM-head loss. 256 MiB is 883 rows of Qwen2.5's
  // 151936-word vocabulary in bf16: the chunk's two GEMMs ran at 620 TFLOP/s with 64 MiB (220
  // rows) on an H200, against ~780 for large ones.
  size_t logits_budget_bytes = size_t{256} << 20;
};

// Options that apply a --recompute mode to the first `recompute_layers` of `num_layers` layers
// (-1: all of them); the others keep every activation, trading memory for the recompute's time
// (--recompute-layers). Other fields at their defaults.
DecoderOptions recompute_options(RecomputeMode mode, int64_t num_layers, int64_t recompute_layers = -1);

// Saved activations of one layer (T tokens, H hidden, Hq/Hkv heads of D, F MLP width, r LoRA rank).
// What a step holds per layer between forward and backward (b = bytes of the activation dtype,
// s = bytes of the stat dtype: 4, or 8 for F64 models):
//   kept layer:                   every tensor below but act, which backward recomputes from gate
//                                 and up (one elementwise pass for T·F·b less per layer);
//   recomputed layer:             x_in only, T·H·b; the rest lives in one scratch set shared by
//                                 all recomputed layers, refilled in backward;
//   recomputed, keep_attention:   x_in, attn and lse, T·H·b + T·Hq·D·b + Hq·T·s.
// A layer's tensors are allocated in forward just before the layer runs and released in backward
// once the layer below no longer needs them.
struct LayerActivations {
  Tensor x_in;                // [T, H]   layer input (the residual stream), always kept
  Tensor xn1, rstd1;          // [T, H], [T]      input RMSNorm
  Tensor q_raw, k_raw;        // [T, Hq, D], [T, Hkv, D] projections before q/k norm (qwen3 only)
  Tensor q_rstd, k_rstd;      // [T·Hq], [T·Hkv]  (qwen3 only)
  Tensor q, k, v;             // [T, Hq, D], [T, Hkv, D], [T, Hkv, D] attention inputs (normed, rotated)
  Tensor attn, lse;           // [T, Hq, D], [Hq, T]
  Tensor x_mid;               // [T, H]   x_in + o_proj(attn)
  Tensor xn2, rstd2;          // [T, H], [T]      post-attention RMSNorm
  Tensor gate, up, act;       // [T, F] each; act = silu(gate)·up (only in the recompute scratch set)
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
  // nullptr (the default): parameters are always resident and nothing is called.
  void set_parameter_hooks(ParameterHooks* hooks) { hooks_ = hooks; }
  const ModelWeights& weights() const { return weights_; }

 private:
  Tensor forward(const MicroBatch& batch, bool keep, std::vector<LayerActivations>& acts);
  // With run_attention = false, a.attn and a.lse already hold this layer's attention output (kept
  // from the forward pass) and the attention strategy is not called.
  void forward_layer(int64_t layer, const MicroBatch& batch, LayerActivations& a, Tensor& x_out,
                     bool run_attention = true);
  void backward_layer(int64_t layer, const MicroBatch& batch, const LayerActivations& a, Tensor& d_res,
                      bool need_input_grad);
  // x_in always; attn and lse when `attention`; every other tensor when `intermediates`. Tensors
  // already allocated for `tokens` are kept.
  void allocate(LayerActivations& a, int64_t tokens, bool intermediates, bool attention);
  // The tensors a recomputed layer runs in: the shared scratch set (allocated on first use) with
  // the layer's kept x_in, and its kept attn and lse when kept_attention.
  LayerActivations scratch_view(LayerActivations& scratch, const LayerActivations& layer, int64_t tokens,
                                bool kept_attention);
  // The hook calls of one step without any compute: a rank with no token keeps the collectives
  // of its peers' hooks matched.
  void hooks_without_tokens(bool backward);
  void before_forward(const ParameterUnit& u) { if (hooks_) hooks_->before_forward(u); }
  void after_forward(const ParameterUnit& u) { if (hooks_) hooks_->after_forward(u); }
  void before_backward(const ParameterUnit& u) { if (hooks_) hooks_->before_backward(u); }
  void after_backward(const ParameterUnit& u) { if (hooks_) hooks_->after_backward(u); }

  Backend& backend_;
  ModelWeights& weights_;
  DecoderOptions options_;
  Stream stream_;
  LocalAttention local_attention_;
  AttentionStrategy* attention_;
  ParameterHooks* hooks_ = nullptr;
  Tensor inv_freq_;  // F32 [D/2]
};

}  // namespace spindle
