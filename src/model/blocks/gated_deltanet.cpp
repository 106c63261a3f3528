#include "model/blocks/gated_deltanet.h"

#include <cmath>

#include "core/error.h"
#include "model/deltanet_sequence.h"

namespace spindle {

namespace {

// transformers' l2norm: x·rsqrt(Σx² + 1e-6), for the delta rule's q and k.
constexpr double kL2NormEps = 1e-6;

}  // namespace

GatedDeltaNet::GatedDeltaNet(ParameterSink& sink, const ModelConfig& c, const std::string& layer_prefix)
    : key_heads_(c.linear_attention.num_key_heads),
      value_heads_(c.linear_attention.num_value_heads),
      key_dim_(c.linear_attention.key_head_dim),
      value_dim_(c.linear_attention.value_head_dim),
      chunk_size_(c.linear_attention.chunk_size),
      norm_eps_(c.rms_norm_eps),
      fused_(c.linear_attention.fused_projections) {
  SPINDLE_CHECK(key_heads_ > 0 && value_heads_ % key_heads_ == 0 && key_dim_ > 0 && value_dim_ > 0,
                "gated DeltaNet with {} key heads of {} and {} value heads of {}", key_heads_, key_dim_, value_heads_,
                value_dim_);
  const std::string pre = layer_prefix + "linear_attn.";
  const int64_t h = c.hidden_size, key = key_heads_ * key_dim_, value = value_heads_ * value_dim_;
  const int64_t channels = 2 * key + value;
  if (fused_) {
    qkvz_ = sink.add_linear({"in_proj_qkvz", pre + "in_proj_qkvz", channels + value, h, false});
    ba_ = sink.add_linear({"in_proj_ba", pre + "in_proj_ba", 2 * value_heads_, h, false});
  } else {
    qkv_ = sink.add_linear({"in_proj_qkv", pre + "in_proj_qkv", channels, h, false});
    z_ = sink.add_linear({"in_proj_z", pre + "in_proj_z", value, h, false});
    b_ = sink.add_linear({"in_proj_b", pre + "in_proj_b", value_heads_, h, false});
    a_ = sink.add_linear({"in_proj_a", pre + "in_proj_a", value_heads_, h, false});
  }
  conv_ = &sink.add(pre + "conv1d.weight", Shape{channels, 1, c.linear_attention.conv_kernel});
  dt_bias_ = &sink.add(pre + "dt_bias", Shape{value_heads_});
  a_log_ = &sink.add(pre + "A_log", Shape{value_heads_});
  norm_ = &sink.add(pre + "norm.weight", Shape{value_dim_});
  out_ = sink.add_linear({"out_proj", pre + "out_proj", h, value, false});
}

std::vector<Parameter*> GatedDeltaNet::parameters() const {
  std::vector<Parameter*> out;
  if (fused_) {
    for (const Linear* lin : {&qkvz_, &ba_}) append_parameters(out, *lin);
  } else {
    for (const Linear* lin : {&qkv_, &z_, &b_, &a_}) append_parameters(out, *lin);
  }
  for (Parameter* p : {conv_, dt_bias_, a_log_, norm_}) out.push_back(p);
  append_parameters(out, out_);
  return out;
}

void GatedDeltaNet::allocate(Backend& be, DType dt, int64_t t, ActivationNeeds needs, MixerActivations& m) const {
  GatedDeltaNetActivations& a = m.gated_deltanet;
  const DType st = stat_dtype(dt);
  if (needs.core && (!a.core.defined() || a.core.dim(0) != t)) a.core = be.empty(Shape{t, value_heads_, value_dim_}, dt);
  if (!needs.intermediates) return;
  if (a.qkv.defined() && a.qkv.dim(0) == t) return;
  const int64_t key = key_heads_ * key_dim_, value = value_heads_ * value_dim_;
  a.qkv = be.empty(Shape{t, 2 * key + value}, dt);
  a.q = be.empty(Shape{t, key_heads_, key_dim_}, dt);
  a.k = be.empty(Shape{t, key_heads_, key_dim_}, dt);
  a.q_rstd = be.empty(Shape{t * key_heads_}, st);
  a.k_rstd = be.empty(Shape{t * key_heads_}, st);
  a.v = be.empty(Shape{t, value_heads_, value_dim_}, dt);
  a.a = be.empty(Shape{t, value_heads_}, dt);
  a.b = be.empty(Shape{t, value_heads_}, dt);
  a.g = be.empty(Shape{t, value_heads_}, st);
  a.beta = be.empty(Shape{t, value_heads_}, dt);
  a.z = be.empty(Shape{t, value}, dt);
  a.norm_rstd = be.empty(Shape{t * value_heads_}, st);
  a.normed = be.empty(Shape{t, value}, dt);
  if (fused_) {
    qkvz_.allocate(be, a.in_proj_qkvz, t, dt);
    ba_.allocate(be, a.in_proj_ba, t, dt);
  } else {
    qkv_.allocate(be, a.in_proj_qkv, t, dt);
    z_.allocate(be, a.in_proj_z, t, dt);
    b_.allocate(be, a.in_proj_b, t, dt);
    a_.allocate(be, a.in_proj_a, t, dt);
  }
  out_.allocate(be, a.out_proj, t, dt);
}

void GatedDeltaNet::use_kept_core(MixerActivations& view, const MixerActivations& kept) const {
  view.gated_deltanet.core = kept.gated_deltanet.core;
}

void GatedDeltaNet::forward(const LayerContext& ctx, const Tensor& xn, MixerActivations& m, Tensor& out,
                            bool run_core) const {
  GatedDeltaNetActivations& a = m.gated_deltanet;
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const int64_t t = ctx.tokens();
  projections(ctx, xn, a);

  if (DeltaNetSequence* sequence = ctx.attention.deltanet()) {
    // A shard of the sequence: the conv, gates and delta rule need the tokens before this shard's,
    // so the strategy runs them (the token-local norm and out_proj stay here).
    if (run_core) {
      sequence->forward(be, st, ctx.batch, sequence_heads(), a.qkv, a.a, a.b, a.core);
    } else {
      SPINDLE_CHECK(a.core.defined() && a.core.dim(0) == t, "{}: no kept delta-rule output for {} tokens",
                    out_.prefix, t);
    }
    output(ctx, a, out);
    return;
  }

  // Conv over every channel, then split: q and k are normalised, v goes to the delta rule as is (one
  // op, so a backend can fuse the split into the conv and never store the conv's output [T, C]).
  be.deltanet_conv_split_forward(st, a.qkv, conv_->value, ctx.batch.doc_ids, kL2NormEps, a.q, a.k, a.v, a.q_rstd,
                                 a.k_rstd);
  be.gated_delta_gates_forward(st, a.a, a.b, a_log_->value, dt_bias_->value, a.g, a.beta);

  if (run_core) {
    be.gated_delta_rule_forward(st, a.q, a.k, a.v, a.g, a.beta, ctx.batch.doc_ids,
                                1.0 / std::sqrt(static_cast<double>(key_dim_)), chunk_size_, a.core);
  } else {
    // Kept from the forward pass, which computed it from the same inputs as this recompute.
    SPINDLE_CHECK(a.core.defined() && a.core.dim(0) == t, "{}: no kept delta-rule output for {} tokens", out_.prefix,
                  t);
  }
  output(ctx, a, out);
}

namespace {

// One key head's share of each fused projection's rows: where q, k, v, z (and b, a) start in the fused
// output and in the regrouped tensors. r = Hv/Hk value heads read key head kh.
struct FusedSpans {
  int64_t dk, dv, r, key, value;  // head dims, value heads per key head, Hk·dk, Hv·dv
  int64_t qkvz_row(int64_t kh) const { return kh * (2 * dk + 2 * r * dv); }
  int64_t ba_row(int64_t kh) const { return kh * 2 * r; }
};

}  // namespace

void GatedDeltaNet::projections(const LayerContext& ctx, const Tensor& xn, GatedDeltaNetActivations& a) const {
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  if (!fused_) {
    qkv_.forward(be, st, xn, a.qkv, a.in_proj_qkv);
    z_.forward(be, st, xn, a.z, a.in_proj_z);
    b_.forward(be, st, xn, a.b, a.in_proj_b);
    a_.forward(be, st, xn, a.a, a.in_proj_a);
    return;
  }
  const int64_t t = ctx.tokens();
  const FusedSpans f{key_dim_, value_dim_, value_heads_ / key_heads_, key_heads_ * key_dim_, value_heads_ * value_dim_};
  Tensor qkvz = be.empty(Shape{t, 2 * f.key + 2 * f.value}, ctx.dtype);  // [T, 2·Hk·dk + 2·Hv·dv] grouped rows
  Tensor ba = be.empty(Shape{t, 2 * value_heads_}, ctx.dtype);            // [T, 2·Hv] grouped rows
  qkvz_.forward(be, st, xn, qkvz, a.in_proj_qkvz);
  ba_.forward(be, st, xn, ba, a.in_proj_ba);
  // Into qwen3_5's order: q of every key head, k of every key head, v of every value head; z, b, a
  // per value head (value head kh·r + j).
  for (int64_t kh = 0; kh < key_heads_; ++kh) {
    const int64_t row = f.qkvz_row(kh);
    be.copy_columns(st, qkvz, row, a.qkv, kh * f.dk, f.dk);
    be.copy_columns(st, qkvz, row + f.dk, a.qkv, f.key + kh * f.dk, f.dk);
    be.copy_columns(st, qkvz, row + 2 * f.dk, a.qkv, 2 * f.key + kh * f.r * f.dv, f.r * f.dv);
    be.copy_columns(st, qkvz, row + 2 * f.dk + f.r * f.dv, a.z, kh * f.r * f.dv, f.r * f.dv);
    be.copy_columns(st, ba, f.ba_row(kh), a.b, kh * f.r, f.r);
    be.copy_columns(st, ba, f.ba_row(kh) + f.r, a.a, kh * f.r, f.r);
  }
}

void GatedDeltaNet::output(const LayerContext& ctx, GatedDeltaNetActivations& a, Tensor& out) const {
  Backend& be = ctx.backend;
  const Shape head_rows{ctx.tokens() * value_heads_, value_dim_};
  Tensor normed_rows = a.normed.reshape(head_rows);
  be.gated_rmsnorm_forward(ctx.stream, a.core.reshape(head_rows), a.z.reshape(head_rows), norm_->value, norm_eps_,
                           normed_rows, a.norm_rstd);
  out_.forward(be, ctx.stream, a.normed, out, a.out_proj);
}

DeltaNetHeads GatedDeltaNet::sequence_heads() const {
  DeltaNetHeads h;
  h.key_heads = key_heads_;
  h.value_heads = value_heads_;
  h.key_dim = key_dim_;
  h.value_dim = value_dim_;
  h.chunk_size = chunk_size_;
  h.scale = 1.0 / std::sqrt(static_cast<double>(key_dim_));
  h.l2norm_eps = kL2NormEps;
  h.conv = conv_->value;
  h.a_log = a_log_->value;
  h.dt_bias = dt_bias_->value;
  h.conv_grad = trainable_grad(*conv_);
  h.a_log_grad = trainable_grad(*a_log_);
  h.dt_bias_grad = trainable_grad(*dt_bias_);
  return h;
}

void GatedDeltaNet::backward(const LayerContext& ctx, const Tensor& xn, const MixerActivations& m, const Tensor& dout,
                             Tensor& dxn) const {
  const GatedDeltaNetActivations& a = m.gated_deltanet;
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const DType dt = ctx.dtype;
  const int64_t t = ctx.tokens(), value = value_heads_ * value_dim_;
  const Shape head_rows{t * value_heads_, value_dim_};

  Tensor d_normed = be.empty(Shape{t, value}, dt);
  out_.backward(be, st, a.normed, dout, a.out_proj, &d_normed, false);
  Tensor d_core = be.empty(a.core.shape(), dt), dz = be.empty(Shape{t, value}, dt);
  Tensor d_core_rows = d_core.reshape(head_rows), dz_rows = dz.reshape(head_rows);
  be.gated_rmsnorm_backward(st, a.core.reshape(head_rows), a.z.reshape(head_rows), norm_->value, a.norm_rstd,
                            d_normed.reshape(head_rows), d_core_rows, dz_rows, trainable_grad(*norm_));

  if (DeltaNetSequence* sequence = ctx.attention.deltanet()) {
    Tensor d_qkv = be.empty(a.qkv.shape(), dt), da = be.empty(a.a.shape(), dt), db = be.empty(a.b.shape(), dt);
    sequence->backward(be, st, ctx.batch, sequence_heads(), a.qkv, a.a, a.b, d_core, d_qkv, da, db);
    projections_backward(ctx, xn, a, d_qkv, dz, db, da, dxn);
    return;
  }

  Tensor dq = be.empty(a.q.shape(), dt), dk = be.empty(a.k.shape(), dt), dv = be.empty(a.v.shape(), dt);
  Tensor dg = be.empty(a.g.shape(), a.g.dtype()), dbeta = be.empty(a.beta.shape(), dt);
  be.gated_delta_rule_backward(st, a.q, a.k, a.v, a.g, a.beta, ctx.batch.doc_ids,
                               1.0 / std::sqrt(static_cast<double>(key_dim_)), chunk_size_, d_core, dq, dk, dv, dg,
                               dbeta);
  Tensor da = be.empty(a.a.shape(), dt), db = be.empty(a.b.shape(), dt);
  be.gated_delta_gates_backward(st, a.a, a.beta, a_log_->value, dt_bias_->value, a.g, dg, dbeta, da, db,
                                trainable_grad(*a_log_), trainable_grad(*dt_bias_));

  // Back through the L2 norms, the split and the conv.
  Tensor d_qkv = be.empty(a.qkv.shape(), dt);
  be.deltanet_conv_split_backward(st, a.qkv, conv_->value, ctx.batch.doc_ids, a.q, a.k, a.q_rstd, a.k_rstd, dq, dk,
                                  dv, d_qkv, trainable_grad(*conv_));

  projections_backward(ctx, xn, a, d_qkv, dz, db, da, dxn);
}

void GatedDeltaNet::projections_backward(const LayerContext& ctx, const Tensor& xn, const GatedDeltaNetActivations& a,
                                         const Tensor& d_qkv, const Tensor& dz, const Tensor& db, const Tensor& da,
                                         Tensor& dxn) const {
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  if (!fused_) {
    qkv_.backward(be, st, xn, d_qkv, a.in_proj_qkv, &dxn, false);
    z_.backward(be, st, xn, dz, a.in_proj_z, &dxn, true);
    b_.backward(be, st, xn, db, a.in_proj_b, &dxn, true);
    a_.backward(be, st, xn, da, a.in_proj_a, &dxn, true);
    return;
  }
  // The gradients back into the fused rows' order, then one backward per fused projection.
  const int64_t t = ctx.tokens();
  const FusedSpans f{key_dim_, value_dim_, value_heads_ / key_heads_, key_heads_ * key_dim_, value_heads_ * value_dim_};
  Tensor d_qkvz = be.empty(Shape{t, 2 * f.key + 2 * f.value}, ctx.dtype);
  Tensor d_ba = be.empty(Shape{t, 2 * value_heads_}, ctx.dtype);
  for (int64_t kh = 0; kh < key_heads_; ++kh) {
    const int64_t row = f.qkvz_row(kh);
    be.copy_columns(st, d_qkv, kh * f.dk, d_qkvz, row, f.dk);
    be.copy_columns(st, d_qkv, f.key + kh * f.dk, d_qkvz, row + f.dk, f.dk);
    be.copy_columns(st, d_qkv, 2 * f.key + kh * f.r * f.dv, d_qkvz, row + 2 * f.dk, f.r * f.dv);
    be.copy_columns(st, dz, kh * f.r * f.dv, d_qkvz, row + 2 * f.dk + f.r * f.dv, f.r * f.dv);
    be.copy_columns(st, db, kh * f.r, d_ba, f.ba_row(kh), f.r);
    be.copy_columns(st, da, kh * f.r, d_ba, f.ba_row(kh) + f.r, f.r);
  }
  qkvz_.backward(be, st, xn, d_qkvz, a.in_proj_qkvz, &dxn, false);
  ba_.backward(be, st, xn, d_ba, a.in_proj_ba, &dxn, true);
}

}  // namespace spindle
