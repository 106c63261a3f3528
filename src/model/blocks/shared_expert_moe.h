// A mixture of experts with a shared expert (qwen3_5_moe's Qwen3_5MoeSparseMoeBlock): the routed
// experts of MixtureOfExperts (router, top-k of E, always renormalised in this family) plus one
// SwiGLU MLP that every token passes through, scaled per token by a sigmoid gate,
//
//   out[t] = routed(xn)[t] + σ(xn[t]·w_sgᵀ) · shared(xn)[t],   w_sg = shared_expert_gate [1, H].
//
// glm4_moe (MoeConfig::shared_expert_ungated): transformers' Glm4MoeMoE, the shared experts one
// SwiGLU MLP "mlp.shared_experts" (moe_intermediate_size × n_shared_experts wide) added as it is,
//
//   out[t] = routed(xn)[t] + shared(xn)[t].
//
// Composed of the two blocks it adds up (each keeps its own record: FeedForwardActivations::moe
// and ::swiglu) and one Linear for the gate, so LoRA, FSDP, export and FLOP counts see the shared
// expert's projections and the gate like any other.
#pragma once

#include <string>
#include <vector>

#include "model/block.h"
#include "model/blocks/moe.h"
#include "model/blocks/swiglu_mlp.h"

namespace spindle {

class SharedExpertMoe final : public FeedForward {
 public:
  // Parameters as MixtureOfExperts (mlp.gate, mlp.experts.*), then
  // "<prefix>mlp.shared_expert.{gate,up,down}_proj.weight" of width shared_expert_intermediate_size
  // and "<prefix>mlp.shared_expert_gate.weight" [1, H], in transformers' order; ungated:
  // "<prefix>mlp.shared_experts.{gate,up,down}_proj.weight" and no gate.
  SharedExpertMoe(ParameterSink& sink, const ModelConfig& config, const std::string& layer_prefix);

  FeedForwardKind kind() const override { return FeedForwardKind::MixtureOfExperts; }
  void allocate(Backend& backend, DType dtype, int64_t tokens, ActivationNeeds needs,
                FeedForwardActivations& a) const override;
  void forward(const LayerContext& ctx, const Tensor& xn, FeedForwardActivations& a, Tensor& out) const override;
  void backward(const LayerContext& ctx, const Tensor& xn, const FeedForwardActivations& a, const Tensor& dout,
                Tensor& dxn) const override;
  std::vector<Parameter*> parameters() const override;
  std::vector<Linear*> linears() override;
  std::vector<ExpertLora*> expert_loras() override { return routed_.expert_loras(); }

 private:
  int64_t hidden_;
  bool gated_;  // qwen3_5_moe's σ(shared_expert_gate); glm4_moe's shared experts are ungated
  MixtureOfExperts routed_;
  SwigluMlp shared_;
  Linear gate_;  // [1, H] one logit per token (gated only)
};

}  // namespace spindle
