#include "model/blocks/self_attention.h"

#include <cmath>

#include "core/error.h"
#include "model/norm.h"

namespace spindle {

SelfAttention::SelfAttention(ParameterSink& sink, const ModelConfig& c, int64_t layer, const std::string& layer_prefix)
    : heads_(c.num_heads),
      kv_heads_(c.num_kv_heads),
      head_dim_(c.head_dim),
      rotary_dim_(c.rotary_dim()),
      norm_eps_(c.rms_norm_eps),
      zero_centered_norm_(c.zero_centered_norm),
      output_gate_(c.attn_output_gate),
      fused_qkv_(c.fused_qkv),
      spec_(c.attention_spec(layer)),
      rope_attention_factor_(c.rope_of(spec_).attention_factor) {
  const std::string pre = layer_prefix + "self_attn.";
  const int64_t h = c.hidden_size;
  SPINDLE_CHECK(!(fused_qkv_ && output_gate_), "{}: a fused qkv_proj with an output gate is not a layout any family has",
                pre);
  if (fused_qkv_) {
    qkv_ = sink.add_linear({"qkv_proj", pre + "qkv_proj", c.q_dim() + 2 * c.kv_dim(), h, c.qkv_bias});
  } else {
    // With the output gate, q_proj's rows are per head D query rows then D gate rows.
    q_ = sink.add_linear({"q_proj", pre + "q_proj", c.q_dim() * (output_gate_ ? 2 : 1), h, c.qkv_bias});
    k_ = sink.add_linear({"k_proj", pre + "k_proj", c.kv_dim(), h, c.qkv_bias});
    v_ = sink.add_linear({"v_proj", pre + "v_proj", c.kv_dim(), h, c.qkv_bias});
  }
  o_ = sink.add_linear({"o_proj", pre + "o_proj", h, c.q_dim(), c.o_bias});
  if (c.qk_norm) {
    q_norm_ = &sink.add(pre + "q_norm.weight", Shape{c.head_dim});
    k_norm_ = &sink.add(pre + "k_norm.weight", Shape{c.head_dim});
  }
  if (spec_.sinks) sinks_ = &sink.add(pre + "sinks", Shape{c.num_heads});
}

AttentionCall SelfAttention::call(bool backward) const {
  AttentionCall call{{spec_.scale, spec_.softcap, spec_.window}};
  if (sinks_) {
    call.sinks = sinks_->value;
    if (backward) call.sinks_grad = trainable_grad(*sinks_);
  }
  return call;
}

double SelfAttention::forward_flops_per_pair(const ModelConfig& c) {
  return 4.0 * static_cast<double>(c.num_heads * c.head_dim);
}

std::vector<Linear*> SelfAttention::linears() {
  if (fused_qkv_) return {&qkv_, &o_};
  return {&q_, &k_, &v_, &o_};
}

std::vector<Parameter*> SelfAttention::parameters() const {
  std::vector<Parameter*> out;
  for (const Linear* lin : const_cast<SelfAttention*>(this)->linears()) append_parameters(out, *lin);
  if (q_norm_) out.push_back(q_norm_);
  if (k_norm_) out.push_back(k_norm_);
  if (sinks_) out.push_back(sinks_);
  return out;
}

void SelfAttention::allocate(Backend& be, DType dt, int64_t t, ActivationNeeds needs, MixerActivations& m) const {
  SelfAttentionActivations& a = m.attention;
  const DType st = stat_dtype(dt);
  if (needs.core && (!a.attn.defined() || a.attn.dim(0) != t)) {
    a.attn = be.empty(Shape{t, heads_, head_dim_}, dt);
    a.lse = be.empty(Shape{heads_, t}, st);
  }
  if (!needs.intermediates) return;
  if (a.q.defined() && a.q.dim(0) == t) return;
  if (output_gate_) a.gate = be.empty(Shape{t, heads_, head_dim_}, dt);
  if (q_norm_) {
    a.q_raw = be.empty(Shape{t, heads_, head_dim_}, dt);
    a.k_raw = be.empty(Shape{t, kv_heads_, head_dim_}, dt);
    a.q_rstd = be.empty(Shape{t * heads_}, st);
    a.k_rstd = be.empty(Shape{t * kv_heads_}, st);
  }
  a.q = be.empty(Shape{t, heads_, head_dim_}, dt);
  a.k = be.empty(Shape{t, kv_heads_, head_dim_}, dt);
  a.v = be.empty(Shape{t, kv_heads_, head_dim_}, dt);
  if (fused_qkv_) {
    qkv_.allocate(be, a.qkv_proj, t, dt);
  } else {
    q_.allocate(be, a.q_proj, t, dt);
    k_.allocate(be, a.k_proj, t, dt);
    v_.allocate(be, a.v_proj, t, dt);
  }
  o_.allocate(be, a.o_proj, t, dt);
}

void SelfAttention::use_kept_core(MixerActivations& view, const MixerActivations& kept) const {
  view.attention.attn = kept.attention.attn;
  view.attention.lse = kept.attention.lse;
}

// out = o(attention(rope(q(xn)), rope(k(xn)), v(xn)))
void SelfAttention::forward(const LayerContext& ctx, const Tensor& xn, MixerActivations& m, Tensor& out,
                            bool run_core) const {
  SelfAttentionActivations& a = m.attention;
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const int64_t t = ctx.tokens(), q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
  Tensor flat_k = a.k.reshape(Shape{t, kv_dim}), flat_v = a.v.reshape(Shape{t, kv_dim});
  Tensor& q_out = q_norm_ ? a.q_raw : a.q;  // [T, Hq, D] the query before q/k norm and RoPE
  if (fused_qkv_) {
    // [T, Hq·D + 2·Hkv·D]: per token the query, the key, the value, split apart.
    Tensor fused = be.empty(Shape{t, q_dim + 2 * kv_dim}, xn.dtype());
    qkv_.forward(be, st, xn, fused, a.qkv_proj);
    Tensor q_flat = q_out.reshape(Shape{t, q_dim});
    Tensor k_flat = (q_norm_ ? a.k_raw : a.k).reshape(Shape{t, kv_dim});
    be.copy_columns(st, fused, 0, q_flat, 0, q_dim);
    be.copy_columns(st, fused, q_dim, k_flat, 0, kv_dim);
    be.copy_columns(st, fused, q_dim + kv_dim, flat_v, 0, kv_dim);
  } else if (output_gate_) {
    // [T·Hq, 2D] per head: query then gate, split apart.
    Tensor fused = be.empty(Shape{t * heads_, 2 * head_dim_}, xn.dtype());
    Tensor fused_flat = fused.reshape(Shape{t, 2 * q_dim});
    q_.forward(be, st, xn, fused_flat, a.q_proj);
    Tensor query_rows = q_out.reshape(Shape{t * heads_, head_dim_}), gate_rows = a.gate.reshape(query_rows.shape());
    be.copy_columns(st, fused, 0, query_rows, 0, head_dim_);
    be.copy_columns(st, fused, head_dim_, gate_rows, 0, head_dim_);
  } else {
    Tensor q_flat = q_out.reshape(Shape{t, q_dim});
    q_.forward(be, st, xn, q_flat, a.q_proj);
  }
  if (q_norm_) {
    Tensor raw_k = a.k_raw.reshape(Shape{t, kv_dim});
    if (!fused_qkv_) k_.forward(be, st, xn, raw_k, a.k_proj);
    Tensor qr = a.q_raw.reshape(Shape{t * heads_, head_dim_}), qn = a.q.reshape(qr.shape());
    Tensor kr = a.k_raw.reshape(Shape{t * kv_heads_, head_dim_}), kn = a.k.reshape(kr.shape());
    be.rmsnorm_forward(st, qr, rmsnorm_multiplier(be, st, q_norm_->value, zero_centered_norm_), norm_eps_, qn,
                       a.q_rstd);
    be.rmsnorm_forward(st, kr, rmsnorm_multiplier(be, st, k_norm_->value, zero_centered_norm_), norm_eps_, kn,
                       a.k_rstd);
  } else if (!fused_qkv_) {
    k_.forward(be, st, xn, flat_k, a.k_proj);
  }
  if (!fused_qkv_) v_.forward(be, st, xn, flat_v, a.v_proj);
  rotate(ctx, a.q, +1);
  rotate(ctx, a.k, +1);
  if (run_core) {
    ctx.attention.forward(be, st, ctx.batch, a.q, a.k, a.v, call(false), a.attn, a.lse);
  } else {
    // Kept from the forward pass, which computed it from the same q, k, v as this recompute.
    SPINDLE_CHECK(a.attn.defined() && a.attn.shape() == a.q.shape() && a.lse.defined() && a.lse.dim(1) == t,
                  "{}: no kept attention output for {} tokens", o_.prefix, t);
  }
  o_.forward(be, st, output_projection_input(ctx, a).reshape(Shape{t, q_dim}), out, a.o_proj);
}

void SelfAttention::rotate(const LayerContext& ctx, Tensor& x, int sign) const {
  // Each span of tokens with its own table (one span unless the RoPE depends on document lengths).
  for (const RopeSpan& span : spec_.sliding_rope ? ctx.sliding_rope : ctx.rope) {
    Tensor xs = x.rows(span.begin, span.end);
    const Tensor positions = ctx.batch.positions.rows(span.begin, span.end);
    if (rotary_dim_ == head_dim_)
      ctx.backend.rope(ctx.stream, xs, positions, span.inv_freq, rope_attention_factor_, sign);
    else
      ctx.backend.rope_partial(ctx.stream, xs, positions, span.inv_freq, rotary_dim_, rope_attention_factor_, sign);
  }
}

Tensor SelfAttention::output_projection_input(const LayerContext& ctx, const SelfAttentionActivations& a) const {
  if (!output_gate_) return a.attn;
  Tensor gated = ctx.backend.empty(a.attn.shape(), a.attn.dtype());  // [T, Hq, D]
  ctx.backend.sigmoid_gate_forward(ctx.stream, a.attn, a.gate, gated);
  return gated;
}

void SelfAttention::backward(const LayerContext& ctx, const Tensor& xn, const MixerActivations& m,
                             const Tensor& dout, Tensor& dxn) const {
  const SelfAttentionActivations& a = m.attention;
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const DType dt = ctx.dtype;
  const int64_t t = ctx.tokens(), q_dim = heads_ * head_dim_, kv_dim = kv_heads_ * head_dim_;
  Tensor d_attn = be.empty(Shape{t, heads_, head_dim_}, dt);
  Tensor d_gate;  // [T, Hq, D] (output gate only)
  if (output_gate_) {
    // o_proj read attn·σ(gate), made again here (a kept layer does not keep it).
    Tensor d_gated = be.empty(d_attn.shape(), dt), d_gated_flat = d_gated.reshape(Shape{t, q_dim});
    o_.backward(be, st, output_projection_input(ctx, a).reshape(Shape{t, q_dim}), dout, a.o_proj, &d_gated_flat, false);
    d_gate = be.empty(d_attn.shape(), dt);
    be.sigmoid_gate_backward(st, a.attn, a.gate, d_gated, d_attn, d_gate);
  } else {
    Tensor d_attn_flat = d_attn.reshape(Shape{t, q_dim});
    o_.backward(be, st, a.attn.reshape(Shape{t, q_dim}), dout, a.o_proj, &d_attn_flat, false);
  }
  Tensor dq = be.empty(a.q.shape(), dt), dk = be.empty(a.k.shape(), dt), dv = be.empty(a.v.shape(), dt);
  ctx.attention.backward(be, st, ctx.batch, a.q, a.k, a.v, a.attn, d_attn, a.lse, call(true), dq, dk, dv);
  rotate(ctx, dq, -1);
  rotate(ctx, dk, -1);
  // Allocated after the attention backward, whose scratch made the peak (allocates_dxn).
  if (!dxn.defined()) dxn = be.empty(xn.shape(), dt);
  if (q_norm_) {
    Tensor dq_raw = be.empty(a.q.shape(), dt), dk_raw = be.empty(a.k.shape(), dt);
    const Shape qs{t * heads_, head_dim_}, ks{t * kv_heads_, head_dim_};
    Tensor dq_raw_rows = dq_raw.reshape(qs), dk_raw_rows = dk_raw.reshape(ks);
    be.rmsnorm_backward(st, a.q_raw.reshape(qs), rmsnorm_multiplier(be, st, q_norm_->value, zero_centered_norm_),
                        a.q_rstd, dq.reshape(qs), dq_raw_rows, trainable_grad(*q_norm_), false);
    be.rmsnorm_backward(st, a.k_raw.reshape(ks), rmsnorm_multiplier(be, st, k_norm_->value, zero_centered_norm_),
                        a.k_rstd, dk.reshape(ks), dk_raw_rows, trainable_grad(*k_norm_), false);
    dq = dq_raw;
    dk = dk_raw;
  }
  if (fused_qkv_) {
    // qkv_proj's gradient [T, Hq·D + 2·Hkv·D]: per token the query's, the key's, the value's.
    Tensor fused = be.empty(Shape{t, q_dim + 2 * kv_dim}, dt);
    be.copy_columns(st, dq.reshape(Shape{t, q_dim}), 0, fused, 0, q_dim);
    be.copy_columns(st, dk.reshape(Shape{t, kv_dim}), 0, fused, q_dim, kv_dim);
    be.copy_columns(st, dv.reshape(Shape{t, kv_dim}), 0, fused, q_dim + kv_dim, kv_dim);
    qkv_.backward(be, st, xn, fused, a.qkv_proj, &dxn, false);
    return;
  }
  if (output_gate_) {
    // The fused [T·Hq, 2D] gradient of q_proj: per head the query's, then the gate's.
    Tensor fused = be.empty(Shape{t * heads_, 2 * head_dim_}, dt);
    be.copy_columns(st, dq.reshape(Shape{t * heads_, head_dim_}), 0, fused, 0, head_dim_);
    be.copy_columns(st, d_gate.reshape(Shape{t * heads_, head_dim_}), 0, fused, head_dim_, head_dim_);
    q_.backward(be, st, xn, fused.reshape(Shape{t, 2 * q_dim}), a.q_proj, &dxn, false);
  } else {
    q_.backward(be, st, xn, dq.reshape(Shape{t, q_dim}), a.q_proj, &dxn, false);
  }
  k_.backward(be, st, xn, dk.reshape(Shape{t, kv_dim}), a.k_proj, &dxn, true);
  v_.backward(be, st, xn, dv.reshape(Shape{t, kv_dim}), a.v_proj, &dxn, true);
}

}  // namespace spindle
