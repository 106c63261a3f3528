// Softmax self-attention: q/k/v projections, optional per-head RMSNorm on q and k (qwen3; with
// 1 + w in qwen3_5), RoPE (on the first rotary_dim dims of each head: partial in qwen3_5), attention
// through the layer's AttentionStrategy (local, Ulysses or ring), optionally gated per element by
// σ(gate) with the gate from q_proj (qwen3_5), output projection.
#pragma once

#include <string>

#include "model/block.h"

namespace spindle {

class SelfAttention final : public Mixer {
 public:
  // Parameters "<prefix>self_attn.{q,k,v,o}_proj.{weight,bias}" (or "qkv_proj" for q, k and v with
  // fused_qkv), "<prefix>self_attn.{q,k}_norm.weight" and "<prefix>self_attn.sinks"; layer `layer`'s
  // attention spec (ModelConfig::attention_spec).
  SelfAttention(ParameterSink& sink, const ModelConfig& config, int64_t layer, const std::string& layer_prefix);

  MixerKind kind() const override { return MixerKind::SelfAttention; }
  void allocate(Backend& backend, DType dtype, int64_t tokens, ActivationNeeds needs,
                MixerActivations& a) const override;
  void forward(const LayerContext& ctx, const Tensor& xn, MixerActivations& a, Tensor& out,
               bool run_core) const override;
  void backward(const LayerContext& ctx, const Tensor& xn, const MixerActivations& a, const Tensor& dout,
                Tensor& dxn) const override;
  void use_kept_core(MixerActivations& view, const MixerActivations& kept) const override;
  bool allocates_dxn() const override { return true; }
  std::vector<Parameter*> parameters() const override;
  std::vector<Linear*> linears() override;

  // Multiply-adds of QKᵀ and PV per visible (query, key) pair, times 2: the forward's FLOPs per pair.
  static double forward_flops_per_pair(const ModelConfig& config);

 private:
  // RoPE on x [T, heads, D] (sign −1: the inverse, i.e. the backward).
  void rotate(const LayerContext& ctx, Tensor& x, int sign) const;
  // o_proj's input [T, Hq, D]: the attention output, times σ(gate) with the output gate.
  Tensor output_projection_input(const LayerContext& ctx, const SelfAttentionActivations& a) const;
  // The attention strategy's call: the layer's logits and sinks (with their gradient in backward).
  AttentionCall call(bool backward) const;

  int64_t heads_, kv_heads_, head_dim_, rotary_dim_;
  double norm_eps_;
  bool zero_centered_norm_;  // q/k norms multiply by 1 + w
  bool output_gate_;         // q_proj also gives each head's output gate
  bool fused_qkv_;           // q, k and v from one projection, qkv_ (phi3); q_, k_, v_ unused
  Linear q_, k_, v_, o_;
  Linear qkv_;  // [Hq·D + 2·Hkv·D, H] (fused_qkv_)
  Parameter* q_norm_ = nullptr;  // [D] (qk_norm)
  Parameter* k_norm_ = nullptr;  // [D] (qk_norm)
  AttentionSpec spec_;
  double rope_attention_factor_;  // cos and sin scaled by it (YaRN's, LongRoPE's attention factor; 1 otherwise)
  Parameter* sinks_ = nullptr;    // [Hq] (spec_.sinks)
};

}  // namespace spindle
