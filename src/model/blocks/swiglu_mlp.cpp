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
    : width_(width), activation_(c.mlp_activation) {
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
  // Set every time: the recompute scratch set is shared by layers that may tile and that may not
  // (a MoE layer's shared expert). Tiled, forward and backward allocate one tile's buffers per call.
  a.tile_tokens = needs.mlp_tile_tokens;
  if (a.tile_tokens > 0) return;
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
  if (a.tile_tokens > 0) {
    forward_tiled(ctx, xn, a.tile_tokens, out);
    return;
  }
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  gate_.forward(be, st, xn, a.gate, a.gate_proj);
  up_.forward(be, st, xn, a.up, a.up_proj);
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
  gate_.backward(be, st, xn, d_gate, a.gate_proj, &dxn, false);
  up_.backward(be, st, xn, d_up, a.up_proj, &dxn, true);
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
  LinearActivations gate_lora, up_lora, down_lora;   // x·Aᵀ [N, r] each, with LoRA; not kept
  gate_.allocate(be, gate_lora, n_max, dt);
  up_.allocate(be, up_lora, n_max, dt);
  down_.allocate(be, down_lora, n_max, dt);
  for (int64_t begin = 0; begin < t; begin += n_max) {
    const int64_t n = std::min(n_max, t - begin);
    const Tensor x = xn.rows(begin, begin + n);  // [n, H]
    Tensor y = out.rows(begin, begin + n);       // [n, H]
    Tensor g = gate.rows(0, n), u = up.rows(0, n), p = act.rows(0, n);
    LinearActivations gl = first_rows(gate_lora, n), ul = first_rows(up_lora, n), dl = first_rows(down_lora, n);
    gate_.forward(be, st, x, g, gl);
    up_.forward(be, st, x, u, ul);
    activate(be, st, g, u, p);
    down_.forward(be, st, p, y, dl);
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
  LinearActivations gate_lora, up_lora, down_lora;     // x·Aᵀ [N, r] each, with LoRA
  gate_.allocate(be, gate_lora, n_max, dt);
  up_.allocate(be, up_lora, n_max, dt);
  down_.allocate(be, down_lora, n_max, dt);
  for (int64_t begin = 0; begin < t; begin += n_max) {
    const int64_t n = std::min(n_max, t - begin);
    const Tensor x = xn.rows(begin, begin + n);      // [n, H]
    const Tensor dy = dout.rows(begin, begin + n);   // [n, H]
    Tensor dx = dxn.rows(begin, begin + n);          // [n, H]
    Tensor g = gate.rows(0, n), u = up.rows(0, n), p = act.rows(0, n);
    Tensor dp = d_act.rows(0, n), du = d_up.rows(0, n);
    LinearActivations gl = first_rows(gate_lora, n), ul = first_rows(up_lora, n), dl = first_rows(down_lora, n);
    gate_.forward(be, st, x, g, gl);
    up_.forward(be, st, x, u, ul);
    activate(be, st, g, u, p);
    down_.save_for_backward(be, st, p, dl);
    down_.backward(be, st, p, dy, dl, &dp, false);
    Tensor& dg = p;  // the product is dead from here: its rows take ∂L/∂gate
    activate_backward(be, st, g, u, dp, dg, du);
    gate_.backward(be, st, x, dg, gl, &dx, false);
    up_.backward(be, st, x, du, ul, &dx, true);
  }
}

}  // namespace spindle
