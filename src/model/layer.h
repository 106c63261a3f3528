// A decoder layer: x_mid = x_in + mixer(norm₁(x_in)), x_out = x_mid + feed_forward(norm₂(x_mid)); with
// sandwich norms (Gemma) the mixer's and the feed-forward's outputs are normed too before they join
// the residual stream.
// The mixer and feed-forward are blocks (model/block.h) of the kinds the family's config gives
// this layer (ModelConfig::layer_kinds).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "model/block.h"

namespace spindle {

// Saved activations of one layer (sizes as in model/block.h). What a step holds per layer between
// forward and backward:
//   kept layer:                   every tensor (the SwiGLU product excepted: recomputed in backward);
//   recomputed layer:             x_in only; the rest lives in a scratch set of the layer's own
//                                 while it runs, in forward and again in backward (which releases
//                                 it as it goes);
//   recomputed, keep_attention:   x_in and the mixer's core (attention: attn and lse).
// A layer's tensors are allocated in forward just before the layer runs and released in backward
// once the layer below no longer needs them.
struct LayerActivations {
  Tensor x_in;          // [T, H]   layer input (the residual stream), always kept
  Tensor xn1, rstd1;    // [T, H], [T]   input RMSNorm
  Tensor x_mid;         // [T, H]   x_in + mixer(xn1)
  Tensor xn2, rstd2;    // [T, H], [T]   the feed-forward's input RMSNorm
  // Sandwich norms only: the mixer's and the feed-forward's outputs before their RMSNorms.
  Tensor mixer_out, mixer_out_rstd;  // [T, H], [T]
  Tensor ff_out, ff_out_rstd;        // [T, H], [T]
  MixerActivations mixer;
  FeedForwardActivations feed_forward;
};

class DecoderLayer {
 public:
  // Creates the layer's parameters through `sink`, in checkpoint order: input norm, mixer,
  // post norm, feed-forward.
  DecoderLayer(ParameterSink& sink, const ModelConfig& config, int64_t layer);

  int64_t index() const { return index_; }
  LayerKind kind() const { return {mixer_->kind(), feed_forward_->kind()}; }
  Mixer& mixer() { return *mixer_; }
  FeedForward& feed_forward() { return *feed_forward_; }

  // x_in always; the rest per `needs` (core: the mixer's kept output). Tensors already allocated
  // for `tokens` are kept.
  void allocate(Backend& backend, DType dtype, int64_t tokens, ActivationNeeds needs, LayerActivations& a) const;
  void forward(const LayerContext& ctx, LayerActivations& a, Tensor& x_out, bool run_core) const;
  // The forward again inside the backward of a recomputed layer: what backward reads, without the
  // output. A token-tiled MLP (SwigluActivations::tile_tokens) recomputes its own intermediates in
  // its backward, so the recompute stops at the feed-forward's input.
  void recompute(const LayerContext& ctx, LayerActivations& a, bool run_core) const;
  // d_res holds ∂L/∂x_out on entry and ∂L/∂x_in on exit (the residual path carries it through);
  // without need_input_grad the input norm's backward is skipped unless its weight trains. Releases
  // a's x_mid, xn2, rstd2 and feed-forward record once read, before the mixer's backward: what
  // they held is free at its peak unless the caller keeps other handles to them.
  void backward(const LayerContext& ctx, LayerActivations& a, Tensor& d_res, bool need_input_grad) const;

  // Every parameter of the layer, in creation order (LoRA pairs included once attached).
  std::vector<Parameter*> parameters() const;
  // Every projection, mixer first, in creation order; by PEFT module name (null when absent).
  std::vector<Linear*> linears();
  Linear* linear(const std::string& module);

 private:
  int64_t index_;
  int64_t hidden_;
  double norm_eps_;
  bool zero_centered_norm_;  // qwen3_5, Gemma: the norms multiply by 1 + w (model/norm.h)
  Parameter* input_norm_;    // [H] input_layernorm
  Parameter* ff_in_norm_;    // [H] post_attention_layernorm, or pre_feedforward_layernorm with sandwich norms
  Parameter* mixer_out_norm_ = nullptr;  // [H] sandwich norms: post_attention_layernorm
  Parameter* ff_out_norm_ = nullptr;     // [H] sandwich norms: post_feedforward_layernorm
  std::unique_ptr<Mixer> mixer_;
  std::unique_ptr<FeedForward> feed_forward_;

  // x_mid and xn2 (the feed-forward's input) from x_in: the forward's first half.
  void forward_to_feed_forward(const LayerContext& ctx, LayerActivations& a, bool run_core) const;
};

// The HF tensor prefix of layer `layer`: "model.layers.3." (the family's weight prefix).
std::string layer_prefix(const ModelConfig& config, int64_t layer);

// Parameter counts from the config alone (nothing allocated), from the same constructors that
// create the parameters, so counts follow every family and block.
struct ParameterCounts {
  int64_t total = 0;                // every parameter, tied embeddings once
  int64_t matmul = 0;               // weights of matrix products per token: projections + LM head;
                                    // routed experts only the k of E a token goes through
  std::vector<LinearSpec> linears;  // every projection of every layer, in order
  // LoRA parameters of rank r a token multiplies, on the projections named in `targets` (empty: all
  // LoRA may adapt): every pair of a projection; of the E pairs on a routed experts' fused tensor
  // ("experts", "experts.gate_up_proj", "experts.down_proj"), the k a token is routed through.
  int64_t lora(int64_t rank, const std::vector<std::string>& targets) const;
};
ParameterCounts count_parameters(const ModelConfig& config);

}  // namespace spindle
