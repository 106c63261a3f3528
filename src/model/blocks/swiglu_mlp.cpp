#include "model/blocks/swiglu_mlp.h"

#include <algorithm>

#include "core/error.h"

namespace spindle {

namespace {

// The first n rows of a record allocated for a whole tile (the last tile may be shorter).
LinearActivations first_rows(const LinearActivations& a, int64_t n) {
  LinearActivations view;
  if (a.xa.defined()) view.xa = a.xa.rows(0, n);
  return view;
}

// The same of the projections' records of a tile (their LoRA intermediates; no tensor of the MLP's).
SwigluActivations first_rows(const SwigluActivations& a, int64_t n) {
  SwigluActivations view;
  view.gate_proj = first_rows(a.gate_proj, n);
  view.up_proj = first_rows(a.up_proj, n);
  view.gate_up_proj = first_rows(a.gate_up_proj, n);
  view.down_proj = first_rows(a.down_proj, n);
  return view;
}

}  // namespace

void SwigluMlp::activate(Backend& be, Stream st, const Tensor& gate, const Tensor& up, Tensor& out) const {
  if (activation_ == MlpActivation::GeluTanh) be.geglu_tanh_forward(st, gate, up, out);
  else be.swiglu_forward(st, gate, up, out);
}

void SwigluMlp::activate_backward(Backend& be, Stream st, const Tensor& gate, const Tensor& up, const Tensor& dout,
                                  Tensor& dgate, Tensor& dup) const {
  if (activation_ == MlpActivation::GeluTanh) be.geglu_tanh_backward(st, gate, up, dout, dgate, dup);
  else be.swiglu_backward(st, gate, up, dout, dgate, dup);
}

SwigluMlp::SwigluMlp(ParameterSink& sink, const ModelConfig& c, const std::string& layer_prefix, int64_t width,
                     const std::string& module)
    : width_(width), activation_(c.mlp_activation), fused_(c.fused_gate_up) {
  const std::string pre = layer_prefix + module + ".";
  const int64_t h = c.hidden_size;
  if (fused_) {
    gate_up_ = sink.add_linear({"gate_up_proj", pre + "gate_up_proj", 2 * width, h, false});
  } else {
    gate_ = sink.add_linear({"gate_proj", pre + "gate_proj", width, h, false});
    up_ = sink.add_linear({"up_proj", pre + "up_proj", width, h, false});
  }
  down_ = sink.add_linear({"down_proj", pre + "down_proj", h, width, false});
}

std::vector<Linear*> SwigluMlp::linears() {
  if (fused_) return {&gate_up_, &down_};
  return {&gate_, &up_, &down_};
}

std::vector<Parameter*> SwigluMlp::parameters() const {
  std::vector<Parameter*> out;
  for (const Linear* lin : const_cast<SwigluMlp*>(this)->linears()) append_parameters(out, *lin);
  return out;
}

void SwigluMlp::allocate_gate_up(Backend& be, SwigluActivations& a, int64_t t, DType dt) const {
  if (fused_) {
    gate_up_.allocate(be, a.gate_up_proj, t, dt);
  } else {
    gate_.allocate(be, a.gate_proj, t, dt);
    up_.allocate(be, a.up_proj, t, dt);
  }
}

void SwigluMlp::gate_and_up(Backend& be, Stream st, const Tensor& x, Tensor& gate, Tensor& up,
                            SwigluActivations& a) const {
  if (!fused_) {
    gate_.forward(be, st, x, gate, a.gate_proj);
    up_.forward(be, st, x, up, a.up_proj);
    return;
  }
  // [N, 2F]: per token the gate, then the up projection, split apart.
  Tensor both = be.empty(Shape{x.dim(0), 2 * width_}, gate.dtype());
  gate_up_.forward(be, st, x, both, a.gate_up_proj);
  be.copy_columns(st, both, 0, gate, 0, width_);
  be.copy_columns(st, both, width_, up, 0, width_);
}

void SwigluMlp::gate_and_up_backward(Backend& be, Stream st, const Tensor& x, const Tensor& d_gate, const Tensor& d_up,
                                     const SwigluActivations& a, Tensor& dx) const {
  if (!fused_) {
    gate_.backward(be, st, x, d_gate, a.gate_proj, &dx, false);
    up_.backward(be, st, x, d_up, a.up_proj, &dx, true);
    return;
  }
  Tensor both = be.empty(Shape{x.dim(0), 2 * width_}, d_gate.dtype());  // gate_up_proj's gradient
  be.copy_columns(st, d_gate, 0, both, 0, width_);
  be.copy_columns(st, d_up, 0, both, width_, width_);
  gate_up_.backward(be, st, x, both, a.gate_up_proj, &dx, false);
}

void SwigluMlp::allocate(Backend& be, DType dt, int64_t t, ActivationNeeds needs, FeedForwardActivations& f) const {
  SwigluActivations& a = f.swiglu;
  // Set every time: the recompute scratch set is shared by layers that may tile and that may not
  // (a MoE layer's shared expert). Tiled, forward and backward allocate one tile's buffers per call.
  a.tile_tokens = needs.mlp_tile_tokens;
  if (a.tile_tokens > 0) return;
  if (needs.intermediates && !(a.gate.defined() && a.gate.dim(0) == t)) {
    a.gate = be.empty(Shape{t, width_}, dt);
    a.up = be.empty(Shape{t, width_}, dt);
    allocate_gate_up(be, a, t, dt);
    down_.allocate(be, a.down_proj, t, dt);
  }
  if (needs.product && !(a.act.defined() && a.act.dim(0) == t)) a.act = be.empty(Shape{t, width_}, dt);
}

void SwigluMlp::forward(const LayerContext& ctx, const Tensor& xn, FeedForwardActivations& f, Tensor& out) const {
  SwigluActivations& a = f.swiglu;
  if (a.tile_tokens > 0) {
    forward_tiled(ctx, xn, a.tile_tokens, out);
    return;
  }
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  gate_and_up(be, st, xn, a.gate, a.up, a);
  // A kept layer does not keep act (see SwigluActivations): it lives until the down projection.
  Tensor act = a.act.defined() ? a.act : be.empty(a.gate.shape(), a.gate.dtype());
  activate(be, st, a.gate, a.up, act);
  down_.forward(be, st, act, out, a.down_proj);
}

void SwigluMlp::recompute_output(const LayerContext& ctx, const FeedForwardActivations& f, Tensor& out) const {
  const SwigluActivations& a = f.swiglu;
  SPINDLE_CHECK(a.tile_tokens == 0, "recompute_output reads the untiled record's gate and up; a tiled MLP keeps none");
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  Tensor act = a.act;
  if (!act.defined()) {
    act = be.empty(a.gate.shape(), ctx.dtype);
    activate(be, st, a.gate, a.up, act);
  }
  LinearActivations down;  // its LoRA intermediate again; the record's stays for backward
  down_.allocate(be, down, ctx.tokens(), ctx.dtype);
  down_.forward(be, st, act, out, down);
}

void SwigluMlp::backward(const LayerContext& ctx, const Tensor& xn, const FeedForwardActivations& f,
                         const Tensor& dout, Tensor& dxn) const {
  const SwigluActivations& a = f.swiglu;
  if (a.tile_tokens > 0) {
    backward_tiled(ctx, xn, a.tile_tokens, dout, dxn);
    return;
  }
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const DType dt = ctx.dtype;
  // A kept layer's act again from its gate and up: the same kernel on the same inputs.
  Tensor act = a.act;
  if (!act.defined()) {
    act = be.empty(a.gate.shape(), dt);
    activate(be, st, a.gate, a.up, act);
  }
  Tensor d_act = be.empty(Shape{ctx.tokens(), width_}, dt);
  down_.backward(be, st, act, dout, a.down_proj, &d_act, false);
  Tensor d_gate = be.empty(d_act.shape(), dt), d_up = be.empty(d_act.shape(), dt);
  activate_backward(be, st, a.gate, a.up, d_act, d_gate, d_up);
  gate_and_up_backward(be, st, xn, d_gate, d_up, a, dxn);
}

// Tiles of `tile` rows; the buffers are allocated once per call for the largest tile and the last
// (shorter) tile uses their first rows.
void SwigluMlp::forward_tiled(const LayerContext& ctx, const Tensor& xn, int64_t tile, Tensor& out) const {
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const DType dt = ctx.dtype;
  const int64_t t = xn.dim(0);
  if (t == 0) return;
  const int64_t n_max = std::min(tile, t);
  Tensor gate = be.empty(Shape{n_max, width_}, dt);  // [N, F]
  Tensor up = be.empty(Shape{n_max, width_}, dt);    // [N, F]
  Tensor act = be.empty(Shape{n_max, width_}, dt);   // [N, F] silu(gate)·up, the down projection's input
  SwigluActivations lora;                            // x·Aᵀ [N, r] of each projection, with LoRA; not kept
  allocate_gate_up(be, lora, n_max, dt);
  down_.allocate(be, lora.down_proj, n_max, dt);
  for (int64_t begin = 0; begin < t; begin += n_max) {
    const int64_t n = std::min(n_max, t - begin);
    const Tensor x = xn.rows(begin, begin + n);  // [n, H]
    Tensor y = out.rows(begin, begin + n);       // [n, H]
    Tensor g = gate.rows(0, n), u = up.rows(0, n), p = act.rows(0, n);
    SwigluActivations tl = first_rows(lora, n);
    gate_and_up(be, st, x, g, u, tl);
    activate(be, st, g, u, p);
    down_.forward(be, st, p, y, tl.down_proj);
  }
}

// Per tile: the forward again up to the down projection's input (gate, up, their product, and every
// LoRA intermediate), then the untiled backward's steps on the tile's rows. dxn's rows are each
// written by their own tile; parameter gradients accumulate (+=) over the tiles as over micro-batches.
void SwigluMlp::backward_tiled(const LayerContext& ctx, const Tensor& xn, int64_t tile, const Tensor& dout,
                               Tensor& dxn) const {
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const DType dt = ctx.dtype;
  const int64_t t = xn.dim(0);
  if (t == 0) return;
  const int64_t n_max = std::min(tile, t);
  Tensor gate = be.empty(Shape{n_max, width_}, dt);    // [N, F]
  Tensor up = be.empty(Shape{n_max, width_}, dt);      // [N, F]
  Tensor act = be.empty(Shape{n_max, width_}, dt);     // [N, F] silu(gate)·up; then ∂L/∂gate, once the
                                                       // down projection's backward has read the product
  Tensor d_act = be.empty(Shape{n_max, width_}, dt);   // [N, F] ∂L/∂act
  Tensor d_up = be.empty(Shape{n_max, width_}, dt);    // [N, F] ∂L/∂up
  SwigluActivations lora;                              // x·Aᵀ [N, r] of each projection, with LoRA
  allocate_gate_up(be, lora, n_max, dt);
  down_.allocate(be, lora.down_proj, n_max, dt);
  for (int64_t begin = 0; begin < t; begin += n_max) {
    const int64_t n = std::min(n_max, t - begin);
    const Tensor x = xn.rows(begin, begin + n);      // [n, H]
    const Tensor dy = dout.rows(begin, begin + n);   // [n, H]
    Tensor dx = dxn.rows(begin, begin + n);          // [n, H]
    Tensor g = gate.rows(0, n), u = up.rows(0, n), p = act.rows(0, n);
    Tensor dp = d_act.rows(0, n), du = d_up.rows(0, n);
    SwigluActivations tl = first_rows(lora, n);
    gate_and_up(be, st, x, g, u, tl);
    activate(be, st, g, u, p);
    down_.save_for_backward(be, st, p, tl.down_proj);
    down_.backward(be, st, p, dy, tl.down_proj, &dp, false);
    Tensor& dg = p;  // the product is dead from here: its rows take ∂L/∂gate
    activate_backward(be, st, g, u, dp, dg, du);
    gate_and_up_backward(be, st, x, dg, du, tl, dx);
  }
}

}  // namespace spindle
