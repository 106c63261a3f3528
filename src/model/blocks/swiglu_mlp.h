// The dense SwiGLU MLP: out = down(silu(gate(xn)) · up(xn)).
#pragma once

#include <string>

#include "model/block.h"

namespace spindle {

class SwigluMlp final : public FeedForward {
 public:
  // Parameters "<prefix><module>.{gate,up,down}_proj.weight", intermediate width `width`; `module` is
  // "mlp" for a layer's MLP, "mlp.shared_expert" for a MoE layer's shared expert.
  SwigluMlp(ParameterSink& sink, const ModelConfig& config, const std::string& layer_prefix, int64_t width,
            const std::string& module = "mlp");

  FeedForwardKind kind() const override { return FeedForwardKind::SwiGLU; }
  void allocate(Backend& backend, DType dtype, int64_t tokens, ActivationNeeds needs,
                FeedForwardActivations& a) const override;
  void forward(const LayerContext& ctx, const Tensor& xn, FeedForwardActivations& a, Tensor& out) const override;
  void backward(const LayerContext& ctx, const Tensor& xn, const FeedForwardActivations& a, const Tensor& dout,
                Tensor& dxn) const override;
  std::vector<Parameter*> parameters() const override;
  // out [T, H] (overwritten) = the forward's output again, from the record's gate and up: the
  // forward's kernels on the same inputs (for a caller whose backward needs the output).
  void recompute_output(const LayerContext& ctx, const FeedForwardActivations& a, Tensor& out) const;
  std::vector<Linear*> linears() override { return {&gate_, &up_, &down_}; }

 private:
  int64_t width_;
  Linear gate_, up_, down_;
};

}  // namespace spindle
