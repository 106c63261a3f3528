#include "model/decoder.h"

#include <cmath>

#include "core/error.h"
#include "loss/lm_head_loss.h"

namespace spindle {

namespace {

// y = a·bᵀ·alpha + beta·y (+ bias)
void gemm_maybe_bias(Backend& be, Stream st, const Tensor& a, const Tensor& b, Tensor& y, double alpha, double beta,
                     const Parameter* bias) {
  if (bias) be.gemm_bias(st, a, false, b, true, y, alpha, beta, bias->value);
  else be.gemm(st, a, false, b, true, y, alpha, beta);
}

// In BF16 the rank-r product of a LoRA projection goes first and the large GEMM adds onto it: adding
// a rank-r product to a finished y would read and write all of y once more (and round y twice
// more), while the large GEMM reads y for a fraction of that (H200, Qwen2.5-1.5B at 32k: 20 ms
// less GEMM time per step, the bias pass gone). F32 and F64, the reference precisions, keep PEFT's
// order — base, bias, then the LoRA term — so they match its rounding.
bool lora_term_first(const Tensor& y) { return y.dtype() == DType::BF16; }

// Where a parameter's gradient goes: its grad when trainable, nowhere (null) when frozen.
Tensor* trainable_grad(Parameter& p) { return p.trainable ? &p.grad : nullptr; }

// y[T, out] = x·Wᵀ (+ b) (+ s·(x·Aᵀ)·Bᵀ); xa [T, r] is kept for backward.
void linear_forward(Backend& be, Stream st, const Linear& lin, const Tensor& x, Tensor& y, Tensor& xa) {
  if (lin.lora_a && lora_term_first(y)) {
    be.gemm(st, x, false, lin.lora_a->value, true, xa, 1.0, 0.0);
    gemm_maybe_bias(be, st, xa, lin.lora_b->value, y, lin.lora_scaling, 0.0, lin.bias);
    be.gemm(st, x, false, lin.weight->value, true, y, 1.0, 1.0);
    return;
  }
  gemm_maybe_bias(be, st, x, lin.weight->value, y, 1.0, 0.0, lin.bias);
  if (lin.lora_a) {
    be.gemm(st, x, false, lin.lora_a->value, true, xa, 1.0, 0.0);
    be.gemm(st, xa, false, lin.lora_b->value, true, y, lin.lora_scaling, 1.0);
  }
}

// Gradients of the projection: parameter grads accumulate when trainable; dx = or += dy·W (+ LoRA),
// in BF16 the rank-r term first (as in the forward).
void linear_backward(Backend& be, Stream st, const Linear& lin, const Tensor& x, const Tensor& dy, const Tensor& xa,
                     Tensor* dx, bool accumulate_dx) {
  if (lin.weight->trainable) be.gemm(st, dy, true, x, false, lin.weight->grad, 1.0, 1.0);
  if (lin.bias && lin.bias->trainable) be.bias_backward(st, dy, lin.bias->grad);
  const bool lora_first = lin.lora_a && dx && lora_term_first(*dx);
  if (dx && !lora_first) be.gemm(st, dy, false, lin.weight->value, false, *dx, 1.0, accumulate_dx ? 1.0 : 0.0);
  if (lin.lora_a) {
    const double s = lin.lora_scaling;
    Tensor dxa = be.empty(xa.shape(), xa.dtype());
    be.lora_b_backward(st, dy, lin.lora_b->value, xa, s, dxa, trainable_grad(*lin.lora_b));  // dxa, dB += s·dyᵀ·xa
    if (lin.lora_a->trainable) be.gemm(st, dxa, true, x, false, lin.lora_a->grad, 1.0, 1.0);  // dA += dxaᵀ·x
    if (dx) {
      const bool onto = !lora_first || accumulate_dx;
      be.gemm(st, dxa, false, lin.lora_a->value, false, *dx, 1.0, onto ? 1.0 : 0.0);  // dx (+)= dxa·A
    }
  }
  if (lora_first) be.gemm(st, dy, false, lin.weight->value, false, *dx, 1.0, 1.0);  // dx += dy·W
}

AttentionMask self_mask(const MicroBatch& b) {
  return {b.doc_ids, b.positions, b.doc_ids, b.positions, b.one_causal_document};
}

}  // namespace

void LocalAttention::forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                             const Tensor& v, double scale, Tensor& out, Tensor& lse) {
  backend.attention_forward(stream, q, k, v, self_mask(batch), scale, out, lse);
}

void LocalAttention::backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                              const Tensor& lse, double scale, Tensor& dq, Tensor& dk, Tensor& dv) {
  backend.attention_backward(stream, q, k, v, out, dout, lse, self_mask(batch), scale, dq, dk, dv, false);
}

RecomputeMode parse_recompute_mode(const std::string& value, const std::string& option) {
  if (value == "none") return RecomputeMode::None;
  if (value == "all") return RecomputeMode::All;
  if (value == "keep-attention") return RecomputeMode::KeepAttention;
  fail("{} must be none, all or keep-attention, got \"{}\" (none: fastest, most memory; all: least memory; "
       "keep-attention: in between, see docs/usage.md)",
       option, value);
}

const char* recompute_mode_name(RecomputeMode mode) {
  switch (mode) {
    case RecomputeMode::None: return "none";
    case RecomputeMode::All: return "all";
    case RecomputeMode::KeepAttention: return "keep-attention";
  }
  return "?";
}

void check_recompute_layers(RecomputeMode mode, int64_t recompute_layers) {
  if (recompute_layers < -1) fail("--recompute-layers must be -1 (all layers) or >= 0, got {}", recompute_layers);
  if (recompute_layers >= 0 && mode == RecomputeMode::None)
    fail("--recompute-layers {} needs --recompute all or keep-attention (with none no layer is recomputed)",
         recompute_layers);
}

DecoderOptions recompute_options(RecomputeMode mode, int64_t num_layers, int64_t recompute_layers) {
  check_recompute_layers(mode, recompute_layers);
  if (recompute_layers > num_layers)
    fail("--recompute-layers {} but the model has {} layers (at most {}; -1: all)", recompute_layers, num_layers,
         num_layers);
  DecoderOptions options;
  if (mode != RecomputeMode::None) {
    const int64_t n = recompute_layers < 0 ? num_layers : recompute_layers;
    options.recompute.assign(static_cast<size_t>(num_layers), false);
    for (int64_t l = 0; l < n; ++l) options.recompute[static_cast<size_t>(l)] = true;
  }
  options.keep_attention = mode == RecomputeMode::KeepAttention;
  return options;
}

Decoder::Decoder(Backend& backend, ModelWeights& weights, DecoderOptions options)
    : backend_(backend), weights_(weights), options_(std::move(options)), stream_(backend.default_stream()),
      attention_(&local_attention_) {
  const ModelConfig& c = weights_.config;
  if (!options_.recompute.empty() && static_cast<int64_t>(options_.recompute.size()) != c.num_layers)
    fail("recompute policy names {} layers but the model has {}", options_.recompute.size(), c.num_layers);
  std::vector<float> inv = rope_inverse_frequencies(c);
  inv_freq_ = backend_.empty(Shape{static_cast<int64_t>(inv.size())}, DType::F32);
  backend_.copy_from_host(stream_, inv.data(), inv_freq_);
}

void Decoder::allocate(LayerActivations& a, int64_t t, bool intermediates, bool attention) {
  const ModelConfig& c = weights_.config;
  const DType dt = weights_.dtype, st = stat_dtype(dt);
  auto& be = backend_;
  if (!a.x_in.defined() || a.x_in.dim(0) != t) a.x_in = be.empty(Shape{t, c.hidden_size}, dt);
  if (attention && (!a.attn.defined() || a.attn.dim(0) != t)) {
    a.attn = be.empty(Shape{t, c.num_heads, c.head_dim}, dt);
    a.lse = be.empty(Shape{c.num_heads, t}, st);
  }
  if (!intermediates) return;
  if (a.xn1.defined() && a.xn1.dim(0) == t) return;
  a.xn1 = be.empty(Shape{t, c.hidden_size}, dt);
  a.rstd1 = be.empty(Shape{t}, st);
  if (c.qk_norm) {
    a.q_raw = be.empty(Shape{t, c.num_heads, c.head_dim}, dt);
    a.k_raw = be.empty(Shape{t, c.num_kv_heads, c.head_dim}, dt);
    a.q_rstd = be.empty(Shape{t * c.num_heads}, st);
    a.k_rstd = be.empty(Shape{t * c.num_kv_heads}, st);
  }
  a.q = be.empty(Shape{t, c.num_heads, c.head_dim}, dt);
  a.k = be.empty(Shape{t, c.num_kv_heads, c.head_dim}, dt);
  a.v = be.empty(Shape{t, c.num_kv_heads, c.head_dim}, dt);
  a.x_mid = be.empty(Shape{t, c.hidden_size}, dt);
  a.xn2 = be.empty(Shape{t, c.hidden_size}, dt);
  a.rstd2 = be.empty(Shape{t}, st);
  a.gate = be.empty(Shape{t, c.intermediate_size}, dt);
  a.up = be.empty(Shape{t, c.intermediate_size}, dt);
  if (weights_.lora.rank)
    for (Tensor& xa : a.lora_xa) xa = be.empty(Shape{t, weights_.lora.rank}, dt);
}

LayerActivations Decoder::scratch_view(LayerActivations& scratch, const LayerActivations& layer, int64_t t,
                                       bool kept_attention) {
  scratch.x_in = layer.x_in;  // first, so the scratch allocates no input of its own
  allocate(scratch, t, true, !kept_attention);
  // The scratch set holds the MLP product too: its backward follows the recompute at once.
  const ModelConfig& c = weights_.config;
  if (!scratch.act.defined() || scratch.act.dim(0) != t)
    scratch.act = backend_.empty(Shape{t, c.intermediate_size}, weights_.dtype);
  // A copy of the handles: the scratch itself never refers to a layer's kept attention output, so
  // a later layer can never overwrite it.
  LayerActivations view = scratch;
  if (kept_attention) {
    view.attn = layer.attn;
    view.lse = layer.lse;
  }
  return view;
}


// x_out = x_mid + down(silu(gate(n2)) · up(n2)),  x_mid = x_in + o(attention(rope(q(n1)), rope(k(n1)), v(n1)))
void Decoder::forward_layer(int64_t l, const MicroBatch& batch, LayerActivations& a, Tensor& x_out,
                            bool run_attention) {
  const ModelConfig& c = weights_.config;
  const LayerWeights& w = weights_.layers[l];
  auto& be = backend_;
  const Stream st = stream_;
  const int64_t t = batch.num_tokens;
  Tensor flat_q = a.q.reshape(Shape{t, c.q_dim()}), flat_k = a.k.reshape(Shape{t, c.kv_dim()}),
         flat_v = a.v.reshape(Shape{t, c.kv_dim()});

  be.rmsnorm_forward(st, a.x_in, w.input_norm->value, c.rms_norm_eps, a.xn1, a.rstd1);
  if (c.qk_norm) {
    Tensor raw_q = a.q_raw.reshape(Shape{t, c.q_dim()}), raw_k = a.k_raw.reshape(Shape{t, c.kv_dim()});
    linear_forward(be, st, w.q, a.xn1, raw_q, a.lora_xa[0]);
    linear_forward(be, st, w.k, a.xn1, raw_k, a.lora_xa[1]);
    Tensor qr = a.q_raw.reshape(Shape{t * c.num_heads, c.head_dim}), qn = a.q.reshape(qr.shape());
    Tensor kr = a.k_raw.reshape(Shape{t * c.num_kv_heads, c.head_dim}), kn = a.k.reshape(kr.shape());
    be.rmsnorm_forward(st, qr, w.q_norm->value, c.rms_norm_eps, qn, a.q_rstd);
    be.rmsnorm_forward(st, kr, w.k_norm->value, c.rms_norm_eps, kn, a.k_rstd);
  } else {
    linear_forward(be, st, w.q, a.xn1, flat_q, a.lora_xa[0]);
    linear_forward(be, st, w.k, a.xn1, flat_k, a.lora_xa[1]);
  }
  linear_forward(be, st, w.v, a.xn1, flat_v, a.lora_xa[2]);
  be.rope(st, a.q, batch.positions, inv_freq_, 1.0, +1);
  be.rope(st, a.k, batch.positions, inv_freq_, 1.0, +1);
  if (run_attention) {
    attention_->forward(be, st, batch, a.q, a.k, a.v, 1.0 / std::sqrt(static_cast<double>(c.head_dim)), a.attn, a.lse);
  } else {
    // Kept from the forward pass, which computed it from the same q, k, v as this recompute.
    SPINDLE_CHECK(a.attn.defined() && a.attn.shape() == a.q.shape() && a.lse.defined() && a.lse.dim(1) == t,
                  "layer {}: no kept attention output for {} tokens", l, t);
  }

  Tensor flat_attn = a.attn.reshape(Shape{t, c.q_dim()});
  linear_forward(be, st, w.o, flat_attn, a.x_mid, a.lora_xa[3]);
  be.axpy(st, 1.0, a.x_in, a.x_mid);

  be.rmsnorm_forward(st, a.x_mid, w.post_norm->value, c.rms_norm_eps, a.xn2, a.rstd2);
  linear_forward(be, st, w.gate, a.xn2, a.gate, a.lora_xa[4]);
  linear_forward(be, st, w.up, a.xn2, a.up, a.lora_xa[5]);
  // A kept layer does not keep act (see LayerActivations): it lives until the down projection.
  Tensor act = a.act.defined() ? a.act : be.empty(a.gate.shape(), a.gate.dtype());
  be.swiglu_forward(st, a.gate, a.up, act);
  linear_forward(be, st, w.down, act, x_out, a.lora_xa[6]);
  be.axpy(st, 1.0, a.x_mid, x_out);
}

// d_res holds ∂L/∂x_out on entry and ∂L/∂x_in on exit (the residual path carries it through).
void Decoder::backward_layer(int64_t l, const MicroBatch& batch, const LayerActivations& a, Tensor& d_res,
                             bool need_input_grad) {
  const ModelConfig& c = weights_.config;
  const LayerWeights& w = weights_.layers[l];
  auto& be = backend_;
  const Stream st = stream_;
  const int64_t t = batch.num_tokens;
  const DType dt = weights_.dtype;

  // MLP (a kept layer's act again from its gate and up: the same kernel on the same inputs)
  Tensor act = a.act;
  if (!act.defined()) {
    act = be.empty(a.gate.shape(), dt);
    be.swiglu_forward(st, a.gate, a.up, act);
  }
  Tensor d_act = be.empty(Shape{t, c.intermediate_size}, dt);
  linear_backward(be, st, w.down, act, d_res, a.lora_xa[6], &d_act, false);
  Tensor d_gate = be.empty(d_act.shape(), dt), d_up = be.empty(d_act.shape(), dt);
  be.swiglu_backward(st, a.gate, a.up, d_act, d_gate, d_up);
  Tensor d_xn2 = be.empty(Shape{t, c.hidden_size}, dt);
  linear_backward(be, st, w.gate, a.xn2, d_gate, a.lora_xa[4], &d_xn2, false);
  linear_backward(be, st, w.up, a.xn2, d_up, a.lora_xa[5], &d_xn2, true);
  be.rmsnorm_backward(st, a.x_mid, w.post_norm->value, a.rstd2, d_xn2, d_res, trainable_grad(*w.post_norm), true);

  // attention
  Tensor d_attn = be.empty(Shape{t, c.num_heads, c.head_dim}, dt);
  Tensor d_attn_flat = d_attn.reshape(Shape{t, c.q_dim()});
  linear_backward(be, st, w.o, a.attn.reshape(Shape{t, c.q_dim()}), d_res, a.lora_xa[3], &d_attn_flat, false);
  Tensor dq = be.empty(a.q.shape(), dt), dk = be.empty(a.k.shape(), dt), dv = be.empty(a.v.shape(), dt);
  attention_->backward(be, st, batch, a.q, a.k, a.v, a.attn, d_attn, a.lse,
                       1.0 / std::sqrt(static_cast<double>(c.head_dim)), dq, dk, dv);
  be.rope(st, dq, batch.positions, inv_freq_, 1.0, -1);
  be.rope(st, dk, batch.positions, inv_freq_, 1.0, -1);
  if (c.qk_norm) {
    Tensor dq_raw = be.empty(a.q.shape(), dt), dk_raw = be.empty(a.k.shape(), dt);
    const Shape qs{t * c.num_heads, c.head_dim}, ks{t * c.num_kv_heads, c.head_dim};
    Tensor dq_raw_rows = dq_raw.reshape(qs), dk_raw_rows = dk_raw.reshape(ks);
    be.rmsnorm_backward(st, a.q_raw.reshape(qs), w.q_norm->value, a.q_rstd, dq.reshape(qs), dq_raw_rows,
                        trainable_grad(*w.q_norm), false);
    be.rmsnorm_backward(st, a.k_raw.reshape(ks), w.k_norm->value, a.k_rstd, dk.reshape(ks), dk_raw_rows,
                        trainable_grad(*w.k_norm), false);
    dq = dq_raw;
    dk = dk_raw;
  }
  Tensor d_xn1 = be.empty(Shape{t, c.hidden_size}, dt);
  linear_backward(be, st, w.q, a.xn1, dq.reshape(Shape{t, c.q_dim()}), a.lora_xa[0], &d_xn1, false);
  linear_backward(be, st, w.k, a.xn1, dk.reshape(Shape{t, c.kv_dim()}), a.lora_xa[1], &d_xn1, true);
  linear_backward(be, st, w.v, a.xn1, dv.reshape(Shape{t, c.kv_dim()}), a.lora_xa[2], &d_xn1, true);
  if (need_input_grad || w.input_norm->trainable)
    be.rmsnorm_backward(st, a.x_in, w.input_norm->value, a.rstd1, d_xn1, d_res, trainable_grad(*w.input_norm), true);
}

// Forward through every layer: returns the last layer's output [T, H]. With keep, each layer's
// activations (or, for recomputed layers, only its input) are left in acts for backward.
Tensor Decoder::forward(const MicroBatch& batch, bool keep, std::vector<LayerActivations>& acts) {
  const ModelConfig& c = weights_.config;
  auto& be = backend_;
  const Stream st = stream_;
  const int64_t t = batch.num_tokens, layers = c.num_layers;
  auto recompute = [&](int64_t l) { return !keep || (!options_.recompute.empty() && options_.recompute[l]); };
  auto keeps_attention = [&](int64_t l) { return keep && options_.keep_attention && recompute(l); };
  // Kept layers own their activations; recomputed layers keep only their input (and, with
  // keep_attention, their attention output) and run in a shared scratch set (also used for every
  // layer when nothing is kept).
  acts.assign(layers, LayerActivations());
  LayerActivations scratch;
  Tensor x_final = be.empty(Shape{t, c.hidden_size}, weights_.dtype);
  auto allocate_layer = [&](int64_t l) { allocate(acts[l], t, !recompute(l), !recompute(l) || keeps_attention(l)); };
  if (layers) allocate_layer(0);
  before_forward(ParameterUnit::embedding());
  be.embedding_forward(st, batch.input_ids, weights_.embed->value, layers ? acts[0].x_in : x_final);
  after_forward(ParameterUnit::embedding());
  for (int64_t l = 0; l < layers; ++l) {
    if (l + 1 < layers) allocate_layer(l + 1);
    LayerActivations view;
    LayerActivations* a = &acts[l];
    if (recompute(l)) {
      view = scratch_view(scratch, acts[l], t, keeps_attention(l));  // attention lands in acts[l] when kept
      a = &view;
    }
    Tensor& out = l + 1 < layers ? acts[l + 1].x_in : x_final;
    before_forward(ParameterUnit::layer_unit(l));
    forward_layer(l, batch, *a, out);
    after_forward(ParameterUnit::layer_unit(l));
    if (!keep) acts[l].x_in = Tensor();  // evaluation keeps nothing behind it
  }
  return x_final;
}

void Decoder::logits(const MicroBatch& batch, const Tensor& rows, Tensor& out) {
  const ModelConfig& c = weights_.config;
  const int64_t n = rows.numel();
  SPINDLE_CHECK(out.rank() == 2 && out.dim(0) == n && out.dim(1) == c.vocab_size, "logits out {}", out.describe());
  std::vector<LayerActivations> acts;
  Tensor x_final = forward(batch, false, acts);
  Tensor h = backend_.empty(Shape{n, c.hidden_size}, weights_.dtype), hn = backend_.empty(h.shape(), weights_.dtype);
  Tensor rstd = backend_.empty(Shape{n}, stat_dtype(weights_.dtype));
  backend_.gather_rows(stream_, x_final, rows, h);
  before_forward(ParameterUnit::head());
  backend_.rmsnorm_forward(stream_, h, weights_.final_norm->value, c.rms_norm_eps, hn, rstd);
  backend_.gemm(stream_, hn, false, weights_.lm_head->value, true, out, 1.0, 0.0);
  after_forward(ParameterUnit::head());
}

void Decoder::hooks_without_tokens(bool backward) {
  const int64_t layers = weights_.config.num_layers;
  before_forward(ParameterUnit::embedding());
  after_forward(ParameterUnit::embedding());
  for (int64_t l = 0; l < layers; ++l) {
    before_forward(ParameterUnit::layer_unit(l));
    after_forward(ParameterUnit::layer_unit(l));
  }
  if (!backward) {
    before_forward(ParameterUnit::head());
    after_forward(ParameterUnit::head());
    return;
  }
  before_backward(ParameterUnit::head());
  after_backward(ParameterUnit::head());
  for (int64_t l = layers - 1; l >= 0; --l) {
    before_backward(ParameterUnit::layer_unit(l));
    after_backward(ParameterUnit::layer_unit(l));
  }
  if (weights_.embed->trainable) {
    before_backward(ParameterUnit::embedding());
    after_backward(ParameterUnit::embedding());
  }
}

void Decoder::step(const MicroBatch& batch, double loss_scale, Tensor& loss_sum, bool backward, Tensor* token_ce) {
  const ModelConfig& c = weights_.config;
  auto& be = backend_;
  const Stream st = stream_;
  const int64_t t = batch.num_tokens, n = batch.num_selected, layers = c.num_layers;
  const DType dt = weights_.dtype;
  if (t == 0) {
    if (hooks_) hooks_without_tokens(backward);
    return;
  }
  auto recompute = [&](int64_t l) { return !backward || (!options_.recompute.empty() && options_.recompute[l]); };
  // Layers whose attention output forward() kept (see forward): their recompute skips attention.
  auto keeps_attention = [&](int64_t l) { return backward && options_.keep_attention && recompute(l); };
  std::vector<LayerActivations> acts;
  LayerActivations scratch;
  Tensor x_final = forward(batch, backward, acts);

  // Final norm and loss on the selected positions only.
  const DType sd = stat_dtype(dt);
  Tensor h = be.empty(Shape{n, c.hidden_size}, dt), hn = be.empty(Shape{n, c.hidden_size}, dt);
  Tensor rstd = be.empty(Shape{n}, sd);
  // Training fuses the head's forward and backward, so it gets one backward window.
  const ParameterUnit head = ParameterUnit::head();
  if (backward) before_backward(head);
  else before_forward(head);
  if (n) {
    be.gather_rows(st, x_final, batch.selected, h);
    be.rmsnorm_forward(st, h, weights_.final_norm->value, c.rms_norm_eps, hn, rstd);
  }
  Tensor dhn;
  if (backward) dhn = be.empty(Shape{n, c.hidden_size}, dt);
  LmHeadLossArgs loss;
  loss.hidden = &hn;
  loss.weight = &weights_.lm_head->value;
  loss.targets = &batch.targets;
  loss.weights = &batch.weights;
  loss.loss_scale = loss_scale;
  loss.chunk_rows = lm_head_chunk_rows(c.vocab_size, dt, options_.logits_budget_bytes);
  loss.loss_sum = &loss_sum;
  loss.token_ce = token_ce;
  loss.dhidden = backward ? &dhn : nullptr;
  loss.dweight = backward && weights_.lm_head->trainable ? &weights_.lm_head->grad : nullptr;
  lm_head_cross_entropy(be, st, loss);
  if (!backward) {
    after_forward(head);
    return;
  }

  // Backward.
  Tensor d_res = be.zeros(Shape{t, c.hidden_size}, dt);
  if (n) {
    Tensor dh = be.empty(h.shape(), dt);
    be.rmsnorm_backward(st, h, weights_.final_norm->value, rstd, dhn, dh, trainable_grad(*weights_.final_norm), false);
    be.scatter_add_rows(st, dh, batch.selected, d_res);
  }
  after_backward(head);
  for (int64_t l = layers - 1; l >= 0; --l) {
    before_backward(ParameterUnit::layer_unit(l));
    LayerActivations view;
    const LayerActivations* a = &acts[l];
    if (recompute(l)) {
      const bool kept = keeps_attention(l);
      view = scratch_view(scratch, acts[l], t, kept);
      Tensor discard = be.empty(Shape{t, c.hidden_size}, dt);
      forward_layer(l, batch, view, discard, /*run_attention=*/!kept);
      a = &view;
    }
    backward_layer(l, batch, *a, d_res, l > 0 || weights_.embed->trainable);
    after_backward(ParameterUnit::layer_unit(l));
    // This layer's saved inputs are done with: free them before the next layer's recompute
    // allocates (stream-ordered, so the backward above has read them first).
    view = LayerActivations();
    acts[l] = LayerActivations();
  }
  if (weights_.embed->trainable) {
    before_backward(ParameterUnit::embedding());
    be.embedding_backward(st, batch.input_ids, d_res, weights_.embed->grad);
    after_backward(ParameterUnit::embedding());
  }
}

}  // namespace spindle
