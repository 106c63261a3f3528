// A mixture-of-experts feed-forward (qwen3_moe's Qwen3MoeSparseMoeBlock): a router picks k of E
// SwiGLU experts per token and the output is their routing-weighted sum,
//
//   p = softmax(xn·W_gᵀ) (stat precision),  top-k of p (renormalised when norm_topk_prob) = w,
//   out[t] = Σ_j w[t, j] · down_e(silu(gate_e(xn[t])) · up_e(xn[t])),  e = the j-th expert of t.
//
// The experts run as grouped work over a permutation of the (token, slot) pairs sorted by expert,
// each expert's rows one contiguous block: gather, per-expert projections (Linears, so FSDP, export
// and FLOP counts see every expert), weighted sum back per token. Backward also carries the
// routing weights' gradient through the top-k and the softmax into the router, and the
// load-balancing loss's gradient when the step has one (model/router_aux_loss.h). LoRA reaches the
// experts as PEFT's target_parameters do, per fused tensor (model/expert_lora.h).
//
// gpt_oss (MoeGating): the router has a bias and k logits' softmax weighs the experts (the top-k of
// the full softmax renormalised, which is the same thing); each expert has one biased projection
// whose output interleaves gate and up, and the clamped SwiGLU in place of silu(gate)·up,
//
//   gu = xn·W_guᵀ + b_gu [2I],  act = (clamp(gu[1::2], ±limit) + 1) · g · σ(alpha·g),  g = min(gu[0::2], limit),
//   out[t] = Σ_j w[t, j] · (act·W_downᵀ + b_down).
// LoRA does not reach those experts (their fused tensors are [E, in, out], which PEFT's
// target_parameters wrap in a layout of their own); their attention projections take LoRA as usual.
//
// glm4_moe (MoeGating::sigmoid_router): qwen3_moe's experts behind transformers' Glm4MoeTopkRouter,
//
//   s = σ(xn·W_gᵀ) (stat precision),  c = s + b  (b: mlp.gate.e_score_correction_bias, a buffer),
//   candidates: the experts of the topk_group groups (of n_group) whose two best c sum highest,
//   the k candidates of largest c; w = their s (renormalised when norm_topk_prob) · routed_scaling_factor.
// b moves the choice only: the weights' gradient reaches W_g through s, never b.
#pragma once

#include <string>
#include <vector>

#include "model/block.h"
#include "model/expert_lora.h"

namespace spindle {

class MixtureOfExperts final : public FeedForward {
 public:
  // Parameters "<prefix>mlp.gate.weight" [E, H] (the router) and, per expert e,
  // "<prefix>mlp.experts.<e>.{gate,up}_proj.weight" [I, H] and "….down_proj.weight" [H, I].
  // gpt_oss: "<prefix>mlp.router.{weight [E, H], bias [E]}" and per expert
  // "<prefix>mlp.experts.<e>.gate_up_proj.{weight [2I, H], bias [2I]}", "….down_proj.{weight [H, I], bias [H]}"
  // (read from and written to the fused tensors of MoeGating).
  // glm4_moe: qwen3_moe's, and the buffer "<prefix>mlp.gate.e_score_correction_bias" [E] after the router.
  MixtureOfExperts(ParameterSink& sink, const ModelConfig& config, const std::string& layer_prefix);

  FeedForwardKind kind() const override { return FeedForwardKind::MixtureOfExperts; }
  void allocate(Backend& backend, DType dtype, int64_t tokens, ActivationNeeds needs,
                FeedForwardActivations& a) const override;
  void forward(const LayerContext& ctx, const Tensor& xn, FeedForwardActivations& a, Tensor& out) const override;
  void backward(const LayerContext& ctx, const Tensor& xn, const FeedForwardActivations& a, const Tensor& dout,
                Tensor& dxn) const override;
  std::vector<Parameter*> parameters() const override;
  std::vector<Linear*> linears() override;
  // gate_up_proj's and down_proj's, adapted once ModelWeights attaches a pair.
  std::vector<ExpertLora*> expert_loras() override {
    if (gating_.gpt_oss_experts) return {};
    return {&gate_up_lora_, &down_lora_};
  }

 private:
  // out [N, H] (overwritten) = down_e(act) on each expert's block of routed rows (with down_proj's
  // LoRA term; then xs [N, r] = s·act·A_eᵀ, which its backward reads).
  void run_down(Backend& backend, Stream stream, const MoeActivations& a, const Tensor& act, Tensor& y,
                std::vector<LinearActivations>& down, Tensor& xs) const;
  // Whether every expert projection is a plain dense matrix (no LoRA, no bias, not quantised):
  // then the experts run as the backend's grouped GEMMs, sized by the offsets on the device, and
  // the offsets are never read on the host. Otherwise each expert is its own Linear.
  bool grouped_experts() const;
  // gpt_oss's experts (MoeGating::gpt_oss_experts): one biased gate_up and down Linear each, and
  // their fused checkpoint tensors.
  void add_gpt_oss_experts(ParameterSink& sink, const std::string& mlp_prefix, double share);
  // The routing weights' gradient d_weight [T, k] (and the load-balancing loss's) through top-k and
  // softmax into the router, whose input gradient goes to dxn [T, H] (overwritten), then the routed
  // rows' input gradients dx [N, H] added back per token.
  void route_backward(const LayerContext& ctx, const Tensor& xn, const MoeActivations& a, const Tensor& d_weight,
                      const Tensor& dx, Tensor& dxn) const;

  int64_t experts_, top_k_, width_, hidden_;
  bool normalize_;
  MoeGating gating_;
  Linear router_;                       // [E, H]
  Parameter* correction_bias_ = nullptr;  // [E] stat dtype, sigmoid_router only (a buffer)
  SigmoidRouting sigmoid_routing() const;
  std::vector<Linear> gate_, up_, down_;  // [E] each: [I, H], [I, H], [H, I]; gpt_oss: gate and up empty
  std::vector<Linear> gate_up_;           // gpt_oss: [E] each [2I, H], gate and up rows interleaved
  // LoRA on the fused tensors as PEFT's target_parameters adapt them: gate_up_proj [E, 2I, H] (one
  // A_e for the gate and up rows) and down_proj [E, H, I], applied as grouped GEMMs on either path.
  ExpertLora gate_up_lora_, down_lora_;
};

}  // namespace spindle
