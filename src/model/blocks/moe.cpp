#include "model/blocks/moe.h"

#include <fmt/format.h>

#include "core/error.h"
#include "model/router_aux_loss.h"

namespace spindle {

namespace {

// Each expert's block of routed rows, on the host, for the per-expert Linear path (LoRA or
// quantised experts): it reads the E + 1 offsets once per layer call (a device→host copy). The
// grouped path (MixtureOfExperts::grouped_experts) passes the device offsets to the backend instead.
void read_expert_rows(Backend& be, Stream st, MoeActivations& a) {
  std::vector<int32_t> offsets(static_cast<size_t>(a.offsets.numel()));
  be.copy_to_host(st, a.offsets, offsets.data());
  a.expert_rows.assign(offsets.begin(), offsets.end());
}

// One projection's base weights [out, in] across the experts, and their gradients (an undefined
// Tensor for a frozen expert), for the grouped GEMMs.
std::vector<Tensor> expert_weights(const std::vector<Linear>& experts) {
  std::vector<Tensor> out;
  out.reserve(experts.size());
  for (const Linear& lin : experts) out.push_back(lin.weight->value);
  return out;
}
std::vector<Tensor> expert_weight_grads(const std::vector<Linear>& experts, bool& any) {
  std::vector<Tensor> out;
  out.reserve(experts.size());
  any = false;
  for (const Linear& lin : experts) {
    out.push_back(lin.weight->trainable ? lin.weight->grad : Tensor());
    any = any || lin.weight->trainable;
  }
  return out;
}

}  // namespace

MixtureOfExperts::MixtureOfExperts(ParameterSink& sink, const ModelConfig& c, const std::string& layer_prefix)
    : experts_(c.moe.num_experts),
      top_k_(c.moe.experts_per_token),
      width_(c.moe.expert_intermediate_size),
      hidden_(c.hidden_size),
      normalize_(c.moe.norm_topk_prob),
      gating_(c.moe.gating) {
  SPINDLE_CHECK(experts_ > 0 && top_k_ > 0 && top_k_ <= experts_ && width_ > 0, "MoE layer of {}: {} experts, k {}",
                layer_prefix, experts_, top_k_);
  const std::string pre = layer_prefix + "mlp.";
  const int64_t h = c.hidden_size;
  // Every token multiplies the router; an expert sees k/E of the tokens on average.
  const double share = static_cast<double>(top_k_) / static_cast<double>(experts_);
  if (gating_.gpt_oss_experts) {
    router_ = sink.add_linear({"router", pre + "router", experts_, h, gating_.router_bias, false});
    add_gpt_oss_experts(sink, pre, share);
    return;
  }
  router_ = sink.add_linear({"gate", pre + "gate", experts_, h, gating_.router_bias, false});
  if (gating_.sigmoid_router) correction_bias_ = &sink.add_buffer(pre + "gate.e_score_correction_bias", Shape{experts_});
  gate_.reserve(static_cast<size_t>(experts_));
  up_.reserve(static_cast<size_t>(experts_));
  down_.reserve(static_cast<size_t>(experts_));
  for (int64_t e = 0; e < experts_; ++e) {
    const std::string expert = fmt::format("{}experts.{}.", pre, e);
    gate_.push_back(sink.add_linear({"experts.gate_proj", expert + "gate_proj", width_, h, false, false, share}));
    up_.push_back(sink.add_linear({"experts.up_proj", expert + "up_proj", width_, h, false, false, share}));
    down_.push_back(sink.add_linear({"experts.down_proj", expert + "down_proj", h, width_, false, false, share}));
  }
  // transformers 5's layout of the same weights: every expert's gate then up rows, and every down.
  PackedTensor gate_up{pre + "experts.gate_up_proj", Shape{experts_, 2 * width_, h}, {}};
  PackedTensor down{pre + "experts.down_proj", Shape{experts_, h, width_}, {}};
  for (int64_t e = 0; e < experts_; ++e) {
    gate_up.parts.push_back(gate_[e].weight);
    gate_up.parts.push_back(up_[e].weight);
    down.parts.push_back(down_[e].weight);
  }
  sink.add_packed(std::move(gate_up));
  sink.add_packed(std::move(down));
  gate_up_lora_ = {.module = pre + "experts", .tensor = "gate_up_proj", .experts = experts_, .out = 2 * width_, .in = h};
  down_lora_ = {.module = pre + "experts", .tensor = "down_proj", .experts = experts_, .out = h, .in = width_};
}

void MixtureOfExperts::add_gpt_oss_experts(ParameterSink& sink, const std::string& pre, double share) {
  const int64_t h = hidden_;
  gate_up_.reserve(static_cast<size_t>(experts_));
  down_.reserve(static_cast<size_t>(experts_));
  for (int64_t e = 0; e < experts_; ++e) {
    const std::string expert = fmt::format("{}experts.{}.", pre, e);
    gate_up_.push_back(sink.add_linear({"experts.gate_up_proj", expert + "gate_up_proj", 2 * width_, h, true, false, share}));
    down_.push_back(sink.add_linear({"experts.down_proj", expert + "down_proj", h, width_, true, false, share}));
  }
  // transformers' GptOssExperts tensors: the weights [E, in, out] (each expert's matrix transposed),
  // the biases [E, out].
  PackedTensor gate_up{pre + "experts.gate_up_proj", Shape{experts_, h, 2 * width_}, {}, true};
  PackedTensor gate_up_bias{pre + "experts.gate_up_proj_bias", Shape{experts_, 2 * width_}, {}};
  PackedTensor down{pre + "experts.down_proj", Shape{experts_, width_, h}, {}, true};
  PackedTensor down_bias{pre + "experts.down_proj_bias", Shape{experts_, h}, {}};
  for (int64_t e = 0; e < experts_; ++e) {
    gate_up.parts.push_back(gate_up_[e].weight);
    gate_up_bias.parts.push_back(gate_up_[e].bias);
    down.parts.push_back(down_[e].weight);
    down_bias.parts.push_back(down_[e].bias);
  }
  for (PackedTensor* packed : {&gate_up, &gate_up_bias, &down, &down_bias}) sink.add_packed(std::move(*packed));
}

SigmoidRouting MixtureOfExperts::sigmoid_routing() const {
  return {.top_k = top_k_, .groups = gating_.n_group, .top_groups = gating_.topk_group, .normalize = normalize_,
          .scaling = gating_.routed_scaling_factor};
}

std::vector<Parameter*> MixtureOfExperts::parameters() const {
  std::vector<Parameter*> out;
  append_parameters(out, router_);
  if (correction_bias_) out.push_back(correction_bias_);
  for (const Linear& lin : gate_up_) append_parameters(out, lin);
  for (int64_t e = 0; e < experts_ && gate_up_.empty(); ++e)
    for (const Linear* lin : {&gate_[e], &up_[e]}) append_parameters(out, *lin);
  for (const Linear& lin : down_) append_parameters(out, lin);
  for (const ExpertLora* lora : {&gate_up_lora_, &down_lora_})
    for (Parameter* p : lora->parameters()) out.push_back(p);
  return out;
}

std::vector<Linear*> MixtureOfExperts::linears() {
  std::vector<Linear*> out{&router_};
  for (std::vector<Linear>* experts : {&gate_up_, &gate_, &up_, &down_})
    for (Linear& lin : *experts) out.push_back(&lin);
  return out;
}

void MixtureOfExperts::allocate(Backend& be, DType dt, int64_t t, ActivationNeeds needs,
                                FeedForwardActivations& f) const {
  MoeActivations& a = f.moe;
  const int64_t n = t * top_k_;
  if (needs.intermediates && !(a.probs.defined() && a.probs.dim(0) == t)) {
    const DType st = stat_dtype(dt);
    a.probs = be.empty(Shape{t, experts_}, st);
    a.topk_index = be.empty(Shape{t, top_k_}, DType::I32);
    a.topk_weight = be.empty(Shape{t, top_k_}, st);
    a.rows_token = be.empty(Shape{n}, DType::I32);
    a.row_of_slot = be.empty(Shape{n}, DType::I32);
    a.offsets = be.empty(Shape{experts_ + 1}, DType::I32);
    if (gating_.gpt_oss_experts) {
      a.gate_up = be.empty(Shape{n, 2 * width_}, dt);
    } else {
      a.gate = be.empty(Shape{n, width_}, dt);
      a.up = be.empty(Shape{n, width_}, dt);
    }
    router_.allocate(be, a.router, t, dt);
    // Per-expert LoRA intermediates depend on the routing: sized in forward.
    a.gate_proj.resize(static_cast<size_t>(experts_));
    a.up_proj.resize(static_cast<size_t>(experts_));
    a.down_proj.resize(static_cast<size_t>(experts_));
  }
  if (needs.product && !(a.act.defined() && a.act.dim(0) == n)) a.act = be.empty(Shape{n, width_}, dt);
}

bool MixtureOfExperts::grouped_experts() const {
  for (const std::vector<Linear>* experts : {&gate_up_, &gate_, &up_, &down_})
    for (const Linear& lin : *experts)
      if (lin.quantized() || !lin.weight || lin.lora_a || lin.bias) return false;
  return true;
}

void MixtureOfExperts::run_down(Backend& be, Stream st, const MoeActivations& a, const Tensor& act, Tensor& y,
                                std::vector<LinearActivations>& down, Tensor& xs) const {
  if (grouped_experts()) {
    be.moe_grouped_gemm(st, act, expert_weights(down_), true, a.offsets, y, false);
  } else {
    for (int64_t e = 0; e < experts_; ++e) {
      const int64_t begin = a.expert_rows[e], end = a.expert_rows[e + 1];
      if (begin == end) continue;
      down_[e].allocate(be, down[e], end - begin, y.dtype());
      Tensor ye = y.rows(begin, end);
      down_[e].forward(be, st, act.rows(begin, end), ye, down[e]);
    }
  }
  if (down_lora_.adapted()) {  // y += s·(act·A_eᵀ)·B_eᵀ
    xs = be.empty(Shape{act.dim(0), down_lora_.rank}, y.dtype());
    down_lora_.down_project(be, st, act, a.offsets, xs);
    down_lora_.up_project(be, st, xs, a.offsets, 0, hidden_, y);
  }
}

void MixtureOfExperts::forward(const LayerContext& ctx, const Tensor& xn, FeedForwardActivations& f,
                               Tensor& out) const {
  MoeActivations& a = f.moe;
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const DType dt = ctx.dtype;
  const int64_t t = ctx.tokens(), n = t * top_k_;
  // Router: logits in the activation dtype, softmax and top-k at the stat precision.
  Tensor logits = be.empty(Shape{t, experts_}, dt);
  router_.forward(be, st, xn, logits, a.router);
  if (gating_.sigmoid_router) {  // no load-balancing loss: router_aux_loss_coefficient refuses one
    be.moe_sigmoid_router_forward(st, logits, correction_bias_->value, sigmoid_routing(), a.probs, a.topk_index,
                                  a.topk_weight);
  } else {
    be.moe_router_forward(st, logits, top_k_, normalize_, a.probs, a.topk_index, a.topk_weight);
    if (ctx.router_aux && ctx.router_aux->collecting()) ctx.router_aux->add(st, a.probs, a.topk_index, ctx.batch.doc_ids);
  }
  be.moe_permute(st, a.topk_index, experts_, a.rows_token, a.row_of_slot, a.offsets);
  const bool grouped = grouped_experts();
  if (!grouped) read_expert_rows(be, st, a);

  Tensor x = be.empty(Shape{n, hidden_}, dt);  // [N, H] the routed rows' inputs
  be.gather_rows(st, xn, a.rows_token, x);
  if (gating_.gpt_oss_experts) {
    for (int64_t e = 0; e < experts_; ++e) {
      const int64_t begin = a.expert_rows[e], end = a.expert_rows[e + 1];
      if (begin == end) continue;
      Tensor gue = a.gate_up.rows(begin, end);
      gate_up_[e].allocate(be, a.gate_proj[e], end - begin, dt);
      gate_up_[e].forward(be, st, x.rows(begin, end), gue, a.gate_proj[e]);
    }
    Tensor act = a.act.defined() ? a.act : be.empty(Shape{n, width_}, dt);  // [N, I]
    be.clamped_swiglu_forward(st, a.gate_up, gating_.swiglu_alpha, gating_.swiglu_limit, act);
    Tensor y = be.empty(Shape{n, hidden_}, dt);  // [N, H] the experts' outputs before weighting
    Tensor down_xs;
    run_down(be, st, a, act, y, a.down_proj, down_xs);
    be.moe_combine(st, y, a.row_of_slot, a.topk_index, a.topk_weight, out);
    return;
  }
  if (grouped) {
    be.moe_grouped_gemm(st, x, expert_weights(gate_), true, a.offsets, a.gate, false);
    be.moe_grouped_gemm(st, x, expert_weights(up_), true, a.offsets, a.up, false);
  }
  for (int64_t e = 0; e < experts_ && !grouped; ++e) {
    const int64_t begin = a.expert_rows[e], end = a.expert_rows[e + 1];
    if (begin == end) continue;
    const Tensor xe = x.rows(begin, end);
    Tensor ge = a.gate.rows(begin, end), ue = a.up.rows(begin, end);
    gate_[e].allocate(be, a.gate_proj[e], end - begin, dt);
    up_[e].allocate(be, a.up_proj[e], end - begin, dt);
    gate_[e].forward(be, st, xe, ge, a.gate_proj[e]);
    up_[e].forward(be, st, xe, ue, a.up_proj[e]);
  }
  if (gate_up_lora_.adapted()) {  // gate, up += s·(x·A_eᵀ)·B_eᵀ: B_e's first I rows, then its last I
    Tensor xs = be.empty(Shape{n, gate_up_lora_.rank}, dt);  // [N, r]
    gate_up_lora_.down_project(be, st, x, a.offsets, xs);
    gate_up_lora_.up_project(be, st, xs, a.offsets, 0, width_, a.gate);
    gate_up_lora_.up_project(be, st, xs, a.offsets, width_, 2 * width_, a.up);
  }
  // A kept layer does not keep act (see MoeActivations): it lives until the down projections.
  Tensor act = a.act.defined() ? a.act : be.empty(a.gate.shape(), dt);
  be.swiglu_forward(st, a.gate, a.up, act);
  Tensor y = be.empty(Shape{n, hidden_}, dt);  // [N, H] the experts' outputs before weighting
  Tensor down_xs;                               // [N, r] down_proj's LoRA intermediate, if any
  run_down(be, st, a, act, y, a.down_proj, down_xs);
  be.moe_combine(st, y, a.row_of_slot, a.topk_index, a.topk_weight, out);
}

void MixtureOfExperts::backward(const LayerContext& ctx, const Tensor& xn, const FeedForwardActivations& f,
                                const Tensor& dout, Tensor& dxn) const {
  const MoeActivations& a = f.moe;
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const DType dt = ctx.dtype;
  const int64_t t = ctx.tokens(), n = t * top_k_;
  // act and the experts' outputs again, from the kept gate and up: the forward's kernels on the
  // same inputs, so they are the forward's values (the weights' gradient needs the outputs).
  Tensor act = a.act;
  if (!act.defined() && gating_.gpt_oss_experts) {
    act = be.empty(Shape{n, width_}, dt);
    be.clamped_swiglu_forward(st, a.gate_up, gating_.swiglu_alpha, gating_.swiglu_limit, act);
  } else if (!act.defined()) {
    act = be.empty(a.gate.shape(), dt);
    be.swiglu_forward(st, a.gate, a.up, act);
  }
  Tensor y = be.empty(Shape{n, hidden_}, dt);
  std::vector<LinearActivations> down(static_cast<size_t>(experts_));
  Tensor down_xs;  // [N, r] s·act·A_eᵀ of down_proj's LoRA, if any: its backward reads it
  run_down(be, st, a, act, y, down, down_xs);

  Tensor dy = be.empty(Shape{n, hidden_}, dt);
  Tensor d_weight = be.empty(Shape{t, top_k_}, stat_dtype(dt));
  be.moe_combine_backward(st, dout, y, a.row_of_slot, a.topk_weight, dy, d_weight);
  y = Tensor();
  Tensor d_act = be.empty(Shape{n, width_}, dt);
  const bool grouped = grouped_experts();
  bool trainable = false;
  if (grouped) {
    std::vector<Tensor> grads = expert_weight_grads(down_, trainable);
    if (trainable) be.moe_grouped_gemm_weight_grad(st, dy, act, a.offsets, grads);
    be.moe_grouped_gemm(st, dy, expert_weights(down_), false, a.offsets, d_act, false);
  }
  for (int64_t e = 0; e < experts_ && !grouped; ++e) {
    const int64_t begin = a.expert_rows[e], end = a.expert_rows[e + 1];
    if (begin == end) continue;
    Tensor de = d_act.rows(begin, end);
    down_[e].backward(be, st, act.rows(begin, end), dy.rows(begin, end), down[e], &de, false);
  }
  if (down_lora_.adapted()) down_lora_.backward(be, st, act, down_xs, a.offsets, {{&dy, 0, hidden_}}, &d_act);
  dy = Tensor();
  if (gating_.gpt_oss_experts) {
    Tensor d_gate_up = be.empty(a.gate_up.shape(), dt);  // [N, 2I]
    be.clamped_swiglu_backward(st, a.gate_up, d_act, gating_.swiglu_alpha, gating_.swiglu_limit, d_gate_up);
    d_act = Tensor();
    Tensor x = be.empty(Shape{n, hidden_}, dt);  // the routed rows' inputs, gathered again
    be.gather_rows(st, xn, a.rows_token, x);
    Tensor dx = be.empty(Shape{n, hidden_}, dt);
    for (int64_t e = 0; e < experts_; ++e) {
      const int64_t begin = a.expert_rows[e], end = a.expert_rows[e + 1];
      if (begin == end) continue;
      Tensor dxe = dx.rows(begin, end);
      gate_up_[e].backward(be, st, x.rows(begin, end), d_gate_up.rows(begin, end), a.gate_proj[e], &dxe, false);
    }
    route_backward(ctx, xn, a, d_weight, dx, dxn);
    return;
  }
  Tensor d_gate = be.empty(d_act.shape(), dt), d_up = be.empty(d_act.shape(), dt);
  be.swiglu_backward(st, a.gate, a.up, d_act, d_gate, d_up);
  d_act = Tensor();

  Tensor x = be.empty(Shape{n, hidden_}, dt);  // the routed rows' inputs, gathered again
  be.gather_rows(st, xn, a.rows_token, x);
  Tensor dx = be.empty(Shape{n, hidden_}, dt);
  if (grouped) {
    std::vector<Tensor> grads = expert_weight_grads(gate_, trainable);
    if (trainable) be.moe_grouped_gemm_weight_grad(st, d_gate, x, a.offsets, grads);
    be.moe_grouped_gemm(st, d_gate, expert_weights(gate_), false, a.offsets, dx, false);
    grads = expert_weight_grads(up_, trainable);
    if (trainable) be.moe_grouped_gemm_weight_grad(st, d_up, x, a.offsets, grads);
    be.moe_grouped_gemm(st, d_up, expert_weights(up_), false, a.offsets, dx, true);
  }
  for (int64_t e = 0; e < experts_ && !grouped; ++e) {
    const int64_t begin = a.expert_rows[e], end = a.expert_rows[e + 1];
    if (begin == end) continue;
    const Tensor xe = x.rows(begin, end);
    Tensor dxe = dx.rows(begin, end);
    gate_[e].backward(be, st, xe, d_gate.rows(begin, end), a.gate_proj[e], &dxe, false);
    up_[e].backward(be, st, xe, d_up.rows(begin, end), a.up_proj[e], &dxe, true);
  }
  if (gate_up_lora_.adapted()) {  // its intermediate again, as the other recomputed inputs
    Tensor xs = be.empty(Shape{n, gate_up_lora_.rank}, dt);  // [N, r]
    gate_up_lora_.down_project(be, st, x, a.offsets, xs);
    gate_up_lora_.backward(be, st, x, xs, a.offsets, {{&d_gate, 0, width_}, {&d_up, width_, 2 * width_}}, &dx);
  }

  route_backward(ctx, xn, a, d_weight, dx, dxn);
}

void MixtureOfExperts::route_backward(const LayerContext& ctx, const Tensor& xn, const MoeActivations& a,
                                      const Tensor& d_weight, const Tensor& dx, Tensor& dxn) const {
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const int64_t t = ctx.tokens();
  // Router: the routing weights' gradient (and the load-balancing loss's) through top-k and softmax.
  Tensor aux;
  if (ctx.router_aux && ctx.router_aux->ready()) aux = ctx.router_aux->probability_gradient();
  Tensor d_logits = be.empty(Shape{t, experts_}, ctx.dtype);
  if (gating_.sigmoid_router)
    be.moe_sigmoid_router_backward(st, a.probs, a.topk_index, d_weight, sigmoid_routing(), d_logits);
  else
    be.moe_router_backward(st, a.probs, a.topk_index, d_weight, normalize_, aux, ctx.batch.doc_ids, d_logits);
  router_.backward(be, st, xn, d_logits, a.router, &dxn, false);
  be.scatter_add_rows(st, dx, a.rows_token, dxn);
}

}  // namespace spindle
