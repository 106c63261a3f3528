// Gated DeltaNet, the linear-attention mixer of qwen3_5's "linear_attention" layers (transformers'
// Qwen3_5GatedDeltaNet): per token
//   q, k, v = split(silu(causal_conv1d(in_proj_qkv(xn))))      conv window restarting per document
//   q, k    = l2norm(q), l2norm(k)                              per key head
//   g       = −exp(A_log)·softplus(in_proj_a(xn) + dt_bias)      stat dtype, per value head
//   β       = σ(in_proj_b(xn))
//   core    = gated delta rule(q, k, v, g, β)                   state restarting per document
//   out     = out_proj(gated_rmsnorm(core, in_proj_z(xn)))      plain weight, times silu(z)
// qwen3_next stores q, k, v, z in one projection and b, a in another, rows grouped per key head
// (LinearAttentionConfig::fused_projections): the block runs each as one Linear (LoRA on it is
// PEFT's, one adapter over the fused rows) and regroups the outputs into the same q, k, v, z, b, a.
// Value head h reads key head h / (Hv/Hk). The casts follow transformers: projections, conv, q/k/v,
// β and the output in the activation dtype; g and the delta rule's state at the stat precision.
// The mixer's kept core (keep-attention recompute) is the delta rule's output.
#pragma once

#include <string>

#include "model/block.h"
#include "model/deltanet_sequence.h"

namespace spindle {

class GatedDeltaNet final : public Mixer {
 public:
  // Parameters "<prefix>linear_attn.{in_proj_qkv,in_proj_z,in_proj_b,in_proj_a,out_proj}.weight"
  // (fused: "{in_proj_qkvz,in_proj_ba,out_proj}.weight"), "<prefix>linear_attn.{conv1d.weight,dt_bias,
  // A_log,norm.weight}".
  GatedDeltaNet(ParameterSink& sink, const ModelConfig& config, const std::string& layer_prefix);

  MixerKind kind() const override { return MixerKind::GatedDeltaNet; }
  void allocate(Backend& backend, DType dtype, int64_t tokens, ActivationNeeds needs,
                MixerActivations& a) const override;
  void forward(const LayerContext& ctx, const Tensor& xn, MixerActivations& a, Tensor& out,
               bool run_core) const override;
  void backward(const LayerContext& ctx, const Tensor& xn, const MixerActivations& a, const Tensor& dout,
                Tensor& dxn) const override;
  void use_kept_core(MixerActivations& view, const MixerActivations& kept) const override;
  std::vector<Parameter*> parameters() const override;
  std::vector<Linear*> linears() override {
    if (fused_) return {&qkvz_, &ba_, &out_};
    return {&qkv_, &z_, &b_, &a_, &out_};
  }

 private:
  // The gated norm of the core and out_proj: out [T, H].
  void output(const LayerContext& ctx, GatedDeltaNetActivations& a, Tensor& out) const;
  // The input projections: xn [T, H] → a.qkv, a.z, a.b, a.a (through the fused pair when fused_).
  void projections(const LayerContext& ctx, const Tensor& xn, GatedDeltaNetActivations& a) const;
  // in_proj_qkv/z/b/a backward from their outputs' gradients into dxn [T, H] (overwritten).
  void projections_backward(const LayerContext& ctx, const Tensor& xn, const GatedDeltaNetActivations& a,
                            const Tensor& d_qkv, const Tensor& dz, const Tensor& db, const Tensor& da,
                            Tensor& dxn) const;
  // This layer's heads and parameters for a sequence-parallel DeltaNetSequence.
  DeltaNetHeads sequence_heads() const;

  int64_t key_heads_, value_heads_, key_dim_, value_dim_, chunk_size_;
  double norm_eps_;
  bool fused_;
  Linear qkvz_;  // fused_: [2·Hk·dk + 2·Hv·dv, H], per key head its q, k, then its r = Hv/Hk heads' v, z
  Linear ba_;    // fused_: [2·Hv, H], per key head its r heads' b, then their a
  Linear qkv_;  // [2·Hk·dk + Hv·dv, H]: q, k, v, each head-major
  Linear z_;    // [Hv·dv, H] the output norm's gate
  Linear b_;    // [Hv, H] β before σ
  Linear a_;    // [Hv, H] the decay's input
  Parameter* conv_ = nullptr;     // [2·Hk·dk + Hv·dv, 1, K] depthwise causal conv
  Parameter* dt_bias_ = nullptr;  // [Hv]
  Parameter* a_log_ = nullptr;    // [Hv]
  Parameter* norm_ = nullptr;     // [dv] gated RMSNorm weight (plain w, not 1 + w)
  Linear out_;                    // [H, Hv·dv]
};

}  // namespace spindle
