#include "model/blocks/swiglu_mlp.h"

namespace spindle {

SwigluMlp::SwigluMlp(ParameterSink& sink, const ModelConfig& c, const std::string& layer_prefix, int64_t width,
                     const std::string& module)
    : width_(width) {
  const std::string pre = layer_prefix + module + ".";
  const int64_t h = c.hidden_size;
  gate_ = sink.add_linear({"gate_proj", pre + "gate_proj", width, h, false});
  up_ = sink.add_linear({"up_proj", pre + "up_proj", width, h, false});
  down_ = sink.add_linear({"down_proj", pre + "down_proj", h, width, false});
}

std::vector<Parameter*> SwigluMlp::parameters() const {
  std::vector<Parameter*> out;
  for (const Linear* lin : {&gate_, &up_, &down_}) append_parameters(out, *lin);
  return out;
}

void SwigluMlp::allocate(Backend& be, DType dt, int64_t t, ActivationNeeds needs, FeedForwardActivations& f) const {
  SwigluActivations& a = f.swiglu;
  if (needs.intermediates && !(a.gate.defined() && a.gate.dim(0) == t)) {
    a.gate = be.empty(Shape{t, width_}, dt);
    a.up = be.empty(Shape{t, width_}, dt);
    gate_.allocate(be, a.gate_proj, t, dt);
    up_.allocate(be, a.up_proj, t, dt);
    down_.allocate(be, a.down_proj, t, dt);
  }
  if (needs.product && !(a.act.defined() && a.act.dim(0) == t)) a.act = be.empty(Shape{t, width_}, dt);
}

void SwigluMlp::forward(const LayerContext& ctx, const Tensor& xn, FeedForwardActivations& f, Tensor& out) const {
  SwigluActivations& a = f.swiglu;
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  gate_.forward(be, st, xn, a.gate, a.gate_proj);
  up_.forward(be, st, xn, a.up, a.up_proj);
  // A kept layer does not keep act (see SwigluActivations): it lives until the down projection.
  Tensor act = a.act.defined() ? a.act : be.empty(a.gate.shape(), a.gate.dtype());
  be.swiglu_forward(st, a.gate, a.up, act);
  down_.forward(be, st, act, out, a.down_proj);
}

void SwigluMlp::recompute_output(const LayerContext& ctx, const FeedForwardActivations& f, Tensor& out) const {
  const SwigluActivations& a = f.swiglu;
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  Tensor act = a.act;
  if (!act.defined()) {
    act = be.empty(a.gate.shape(), ctx.dtype);
    be.swiglu_forward(st, a.gate, a.up, act);
  }
  LinearActivations down;  // its LoRA intermediate again; the record's stays for backward
  down_.allocate(be, down, ctx.tokens(), ctx.dtype);
  down_.forward(be, st, act, out, down);
}

void SwigluMlp::backward(const LayerContext& ctx, const Tensor& xn, const FeedForwardActivations& f,
                         const Tensor& dout, Tensor& dxn) const {
  const SwigluActivations& a = f.swiglu;
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const DType dt = ctx.dtype;
  // A kept layer's act again from its gate and up: the same kernel on the same inputs.
  Tensor act = a.act;
  if (!act.defined()) {
    act = be.empty(a.gate.shape(), dt);
    be.swiglu_forward(st, a.gate, a.up, act);
  }
  Tensor d_act = be.empty(Shape{ctx.tokens(), width_}, dt);
  down_.backward(be, st, act, dout, a.down_proj, &d_act, false);
  Tensor d_gate = be.empty(d_act.shape(), dt), d_up = be.empty(d_act.shape(), dt);
  be.swiglu_backward(st, a.gate, a.up, d_act, d_gate, d_up);
  gate_.backward(be, st, xn, d_gate, a.gate_proj, &dxn, false);
  up_.backward(be, st, xn, d_up, a.up_proj, &dxn, true);
}

}  // namespace spindle
