#include "model/blocks/shared_expert_moe.h"

namespace spindle {

SharedExpertMoe::SharedExpertMoe(ParameterSink& sink, const ModelConfig& c, const std::string& layer_prefix)
    : hidden_(c.hidden_size),
      gated_(!c.moe.shared_expert_ungated),
      routed_(sink, c, layer_prefix),
      shared_(sink, c, layer_prefix, c.moe.shared_expert_intermediate_size,
              gated_ ? "mlp.shared_expert" : "mlp.shared_experts") {
  if (gated_)
    gate_ = sink.add_linear({"shared_expert_gate", layer_prefix + "mlp.shared_expert_gate", 1, c.hidden_size, false});
}

std::vector<Parameter*> SharedExpertMoe::parameters() const {
  std::vector<Parameter*> out = routed_.parameters();
  for (Parameter* p : shared_.parameters()) out.push_back(p);
  if (gated_) append_parameters(out, gate_);
  return out;
}

std::vector<Linear*> SharedExpertMoe::linears() {
  std::vector<Linear*> out = routed_.linears();
  for (Linear* lin : shared_.linears()) out.push_back(lin);
  if (gated_) out.push_back(&gate_);
  return out;
}

void SharedExpertMoe::allocate(Backend& be, DType dt, int64_t t, ActivationNeeds needs,
                               FeedForwardActivations& f) const {
  routed_.allocate(be, dt, t, needs, f);
  shared_.allocate(be, dt, t, needs, f);
  SharedExpertGateActivations& a = f.shared_gate;
  if (gated_ && needs.intermediates && !(a.logit.defined() && a.logit.dim(0) == t)) {
    a.logit = be.empty(Shape{t, 1}, dt);
    gate_.allocate(be, a.gate, t, dt);
  }
}

void SharedExpertMoe::forward(const LayerContext& ctx, const Tensor& xn, FeedForwardActivations& f,
                              Tensor& out) const {
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  routed_.forward(ctx, xn, f, out);
  Tensor shared = be.empty(Shape{ctx.tokens(), hidden_}, ctx.dtype);  // [T, H] the shared expert's output
  shared_.forward(ctx, xn, f, shared);
  if (!gated_) {
    be.axpy(st, 1.0, shared, out);
    return;
  }
  gate_.forward(be, st, xn, f.shared_gate.logit, f.shared_gate.gate);
  be.shared_expert_gate_forward(st, shared, f.shared_gate.logit, out);
}

void SharedExpertMoe::backward(const LayerContext& ctx, const Tensor& xn, const FeedForwardActivations& f,
                               const Tensor& dout, Tensor& dxn) const {
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const Shape hidden{ctx.tokens(), hidden_};
  routed_.backward(ctx, xn, f, dout, dxn);
  if (!gated_) {
    Tensor dx_shared = be.empty(hidden, ctx.dtype);
    shared_.backward(ctx, xn, f, dout, dx_shared);
    be.axpy(st, 1.0, dx_shared, dxn);
    return;
  }
  // The shared expert's output again (one down projection) rather than kept: the gate's gradient
  // needs it, and a [T, H] per layer is more than the record otherwise holds for it.
  Tensor shared = be.empty(hidden, ctx.dtype);
  shared_.recompute_output(ctx, f, shared);
  Tensor d_shared = be.empty(hidden, ctx.dtype), d_logit = be.empty(Shape{ctx.tokens(), 1}, ctx.dtype);
  be.shared_expert_gate_backward(st, shared, f.shared_gate.logit, dout, d_shared, d_logit);
  shared = Tensor();
  Tensor dx_shared = be.empty(hidden, ctx.dtype);
  shared_.backward(ctx, xn, f, d_shared, dx_shared);
  be.axpy(st, 1.0, dx_shared, dxn);
  gate_.backward(be, st, xn, d_logit, f.shared_gate.gate, &dxn, true);
}

}  // namespace spindle
