// The dense gated MLP: out = down(act(gate(xn)) · up(xn)), act silu (SwiGLU) or GELU-tanh (GeGLU, Gemma).
//
// Token tiling (SwigluActivations::tile_tokens > 0, --mlp-tile-tokens): every op of the MLP acts on
// each token's row alone, so forward and backward can walk the tokens in tiles of N rows with only
// one tile's [N, F] intermediates live: at 512k tokens of Qwen2.5-7B an untiled [T, F] tensor is
// 18.5 GiB and the backward holds several. A tiled MLP keeps nothing but its input xn (which the
// layer keeps anyway); the backward recomputes each tile's gate and up (and the LoRA intermediates,
// the down projection's x·Aᵀ included) from xn, writes the tile's rows of dxn and accumulates the
// parameter gradients tile by tile. Per row it runs the untiled kernels on the same inputs; only
// the order in which the weight gradients sum over tokens changes.
#pragma once

#include <string>

#include "model/block.h"

namespace spindle {

class SwigluMlp final : public FeedForward {
 public:
  // Parameters "<prefix><module>.{gate,up,down}_proj.weight" (gate_up_proj for gate and up with
  // fused_gate_up), intermediate width `width`; `module` is "mlp" for a layer's MLP,
  // "mlp.shared_expert" for a MoE layer's shared expert.
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
  std::vector<Linear*> linears() override;

 private:
  void forward_tiled(const LayerContext& ctx, const Tensor& xn, int64_t tile, Tensor& out) const;
  void backward_tiled(const LayerContext& ctx, const Tensor& xn, int64_t tile, const Tensor& dout,
                      Tensor& dxn) const;

  // act(gate)·up into out, and its backward, for the configured activation.
  void activate(Backend& be, Stream st, const Tensor& gate, const Tensor& up, Tensor& out) const;
  void activate_backward(Backend& be, Stream st, const Tensor& gate, const Tensor& up, const Tensor& dout,
                         Tensor& dgate, Tensor& dup) const;

  // gate and up [N, F] of x [N, H] (their projections' records in `a`): from their own projections,
  // or from the fused one split (copy_columns). The backward writes dx (=) from their gradients.
  void allocate_gate_up(Backend& be, SwigluActivations& a, int64_t tokens, DType dtype) const;
  void gate_and_up(Backend& be, Stream st, const Tensor& x, Tensor& gate, Tensor& up, SwigluActivations& a) const;
  void gate_and_up_backward(Backend& be, Stream st, const Tensor& x, const Tensor& d_gate, const Tensor& d_up,
                            const SwigluActivations& a, Tensor& dx) const;

  int64_t width_;
  MlpActivation activation_;
  bool fused_;  // gate and up from one projection, gate_up_ (phi3); gate_, up_ unused
  Linear gate_, up_, down_;
  Linear gate_up_;  // [2F, H]: the gate's rows, then up's (fused_)
};

}  // namespace spindle
