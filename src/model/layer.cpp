#include "model/layer.h"

#include <algorithm>
#include <cmath>
#include <deque>

#include "core/error.h"
#include "model/blocks/gated_deltanet.h"
#include "model/blocks/moe.h"
#include "model/blocks/self_attention.h"
#include "model/blocks/shared_expert_moe.h"
#include "model/blocks/swiglu_mlp.h"
#include "model/family.h"
#include "model/norm.h"

namespace spindle {

namespace {

std::unique_ptr<Mixer> make_mixer(MixerKind kind, ParameterSink& sink, const ModelConfig& c, int64_t layer,
                                  const std::string& prefix) {
  switch (kind) {
    case MixerKind::SelfAttention: return std::make_unique<SelfAttention>(sink, c, layer, prefix);
    case MixerKind::GatedDeltaNet: return std::make_unique<GatedDeltaNet>(sink, c, prefix);
  }
  fail("unknown mixer kind");
}

std::unique_ptr<FeedForward> make_feed_forward(FeedForwardKind kind, ParameterSink& sink, const ModelConfig& c,
                                               const std::string& prefix) {
  switch (kind) {
    case FeedForwardKind::SwiGLU: return std::make_unique<SwigluMlp>(sink, c, prefix, c.intermediate_size);
    case FeedForwardKind::MixtureOfExperts:
      if (c.moe.shared_expert_intermediate_size > 0) return std::make_unique<SharedExpertMoe>(sink, c, prefix);
      return std::make_unique<MixtureOfExperts>(sink, c, prefix);
  }
  fail("unknown feed-forward kind");
}

}  // namespace

Linear ParameterSink::add_linear(const LinearSpec& spec) {
  Linear lin;
  lin.module = spec.module;
  lin.prefix = spec.prefix;
  lin.lora_target = spec.lora_target;
  lin.out = spec.out;
  lin.in = spec.in;
  lin.weight = &add(spec.prefix + ".weight", Shape{spec.out, spec.in});
  if (spec.bias) lin.bias = &add(spec.prefix + ".bias", Shape{spec.out});
  on_linear(spec);
  return lin;
}

void append_parameters(std::vector<Parameter*>& out, const Linear& linear) {
  for (Parameter* p : linear.parameters()) out.push_back(p);
}

const char* mixer_kind_name(MixerKind kind) {
  switch (kind) {
    case MixerKind::SelfAttention: return "attention";
    case MixerKind::GatedDeltaNet: return "gated deltanet";
  }
  return "?";
}

const char* feed_forward_kind_name(FeedForwardKind kind) {
  switch (kind) {
    case FeedForwardKind::SwiGLU: return "swiglu";
    case FeedForwardKind::MixtureOfExperts: return "mixture of experts";
  }
  return "?";
}

std::string layer_prefix(const ModelConfig& c, int64_t layer) {
  return fmt::format("{}layers.{}.", c.weight_prefix, layer);
}

DecoderLayer::DecoderLayer(ParameterSink& sink, const ModelConfig& c, int64_t layer)
    : index_(layer), hidden_(c.hidden_size), norm_eps_(c.rms_norm_eps), zero_centered_norm_(c.zero_centered_norm) {
  const LayerKind kind = c.layer_kind(layer);
  const std::string pre = layer_prefix(c, layer);
  input_norm_ = &sink.add(pre + "input_layernorm.weight", Shape{c.hidden_size});
  mixer_ = make_mixer(kind.mixer, sink, c, layer, pre);
  if (c.sandwich_norms) {
    mixer_out_norm_ = &sink.add(pre + "post_attention_layernorm.weight", Shape{c.hidden_size});
    ff_in_norm_ = &sink.add(pre + "pre_feedforward_layernorm.weight", Shape{c.hidden_size});
  } else {
    ff_in_norm_ = &sink.add(pre + "post_attention_layernorm.weight", Shape{c.hidden_size});
  }
  feed_forward_ = make_feed_forward(kind.feed_forward, sink, c, pre);
  if (c.sandwich_norms) ff_out_norm_ = &sink.add(pre + "post_feedforward_layernorm.weight", Shape{c.hidden_size});
}

std::vector<Parameter*> DecoderLayer::parameters() const {
  std::vector<Parameter*> out{input_norm_};
  for (Parameter* p : mixer_->parameters()) out.push_back(p);
  if (mixer_out_norm_) out.push_back(mixer_out_norm_);
  out.push_back(ff_in_norm_);
  for (Parameter* p : feed_forward_->parameters()) out.push_back(p);
  if (ff_out_norm_) out.push_back(ff_out_norm_);
  return out;
}

std::vector<Linear*> DecoderLayer::linears() {
  std::vector<Linear*> out = mixer_->linears();
  for (Linear* lin : feed_forward_->linears()) out.push_back(lin);
  return out;
}

Linear* DecoderLayer::linear(const std::string& module) {
  for (Linear* lin : linears())
    if (lin->module == module) return lin;
  return nullptr;
}

void DecoderLayer::allocate(Backend& be, DType dt, int64_t t, ActivationNeeds needs, LayerActivations& a) const {
  const int64_t h = hidden_;
  if (!a.x_in.defined() || a.x_in.dim(0) != t) a.x_in = be.empty(Shape{t, h}, dt);
  mixer_->allocate(be, dt, t, {needs.intermediates, needs.core, false}, a.mixer);
  if (!needs.intermediates) return;
  if (!(a.xn1.defined() && a.xn1.dim(0) == t)) {
    const DType st = stat_dtype(dt);
    a.xn1 = be.empty(Shape{t, h}, dt);
    a.rstd1 = be.empty(Shape{t}, st);
    a.x_mid = be.empty(Shape{t, h}, dt);
    a.xn2 = be.empty(Shape{t, h}, dt);
    a.rstd2 = be.empty(Shape{t}, st);
    if (mixer_out_norm_) {
      a.mixer_out = be.empty(Shape{t, h}, dt);
      a.mixer_out_rstd = be.empty(Shape{t}, st);
      a.ff_out = be.empty(Shape{t, h}, dt);
      a.ff_out_rstd = be.empty(Shape{t}, st);
    }
  }
  const int64_t tile = feed_forward_->kind() == FeedForwardKind::SwiGLU ? needs.mlp_tile_tokens : 0;
  SPINDLE_CHECK(!(tile > 0 && ff_out_norm_),
                "--mlp-tile-tokens is not supported with sandwich norms (Gemma): the norm after the MLP needs its "
                "whole output; leave --mlp-tile-tokens at 0");
  feed_forward_->allocate(be, dt, t, {true, false, needs.product, tile}, a.feed_forward);
}

void DecoderLayer::forward_to_feed_forward(const LayerContext& ctx, LayerActivations& a, bool run_core) const {
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  be.rmsnorm_forward(st, a.x_in, rmsnorm_multiplier(be, st, input_norm_->value, zero_centered_norm_), norm_eps_, a.xn1,
                     a.rstd1);
  if (mixer_out_norm_) {
    mixer_->forward(ctx, a.xn1, a.mixer, a.mixer_out, run_core);
    be.rmsnorm_forward(st, a.mixer_out, rmsnorm_multiplier(be, st, mixer_out_norm_->value, zero_centered_norm_),
                       norm_eps_, a.x_mid, a.mixer_out_rstd);
  } else {
    mixer_->forward(ctx, a.xn1, a.mixer, a.x_mid, run_core);
  }
  be.axpy(st, 1.0, a.x_in, a.x_mid);
  be.rmsnorm_forward(st, a.x_mid, rmsnorm_multiplier(be, st, ff_in_norm_->value, zero_centered_norm_), norm_eps_, a.xn2,
                     a.rstd2);
}

void DecoderLayer::forward(const LayerContext& ctx, LayerActivations& a, Tensor& x_out, bool run_core) const {
  forward_to_feed_forward(ctx, a, run_core);
  Backend& be = ctx.backend;
  if (ff_out_norm_) {
    feed_forward_->forward(ctx, a.xn2, a.feed_forward, a.ff_out);
    be.rmsnorm_forward(ctx.stream, a.ff_out, rmsnorm_multiplier(be, ctx.stream, ff_out_norm_->value, zero_centered_norm_),
                       norm_eps_, x_out, a.ff_out_rstd);
  } else {
    feed_forward_->forward(ctx, a.xn2, a.feed_forward, x_out);
  }
  be.axpy(ctx.stream, 1.0, a.x_mid, x_out);
}

void DecoderLayer::recompute(const LayerContext& ctx, LayerActivations& a, bool run_core) const {
  // The record may be the scratch set another layer tiled in: only this layer's kind decides.
  if (feed_forward_->kind() == FeedForwardKind::SwiGLU && a.feed_forward.swiglu.tile_tokens > 0) {
    forward_to_feed_forward(ctx, a, run_core);
    return;
  }
  Tensor discard = ctx.backend.empty(Shape{ctx.tokens(), hidden_}, ctx.dtype);  // [T, H] the output, unused
  forward(ctx, a, discard, run_core);
}

void DecoderLayer::backward(const LayerContext& ctx, LayerActivations& a, Tensor& d_res,
                            bool need_input_grad) const {
  Backend& be = ctx.backend;
  const Stream st = ctx.stream;
  const Shape hidden{ctx.tokens(), a.x_in.dim(1)};
  Tensor d_xn2 = be.empty(hidden, ctx.dtype);
  if (ff_out_norm_) {
    Tensor d_ff_out = be.empty(hidden, ctx.dtype);  // [T, H] ∂L/∂(the feed-forward's output)
    be.rmsnorm_backward(st, a.ff_out, rmsnorm_multiplier(be, st, ff_out_norm_->value, zero_centered_norm_),
                        a.ff_out_rstd, d_res, d_ff_out, trainable_grad(*ff_out_norm_), false);
    a.ff_out = a.ff_out_rstd = Tensor();
    feed_forward_->backward(ctx, a.xn2, a.feed_forward, d_ff_out, d_xn2);
  } else {
    feed_forward_->backward(ctx, a.xn2, a.feed_forward, d_res, d_xn2);
  }
  be.rmsnorm_backward(st, a.x_mid, rmsnorm_multiplier(be, st, ff_in_norm_->value, zero_centered_norm_), a.rstd2, d_xn2,
                      d_res, trainable_grad(*ff_in_norm_), true);
  // Read: free before the mixer's backward allocates its own (three [T, H] less at its peak, and the
  // feed-forward's record; stream-ordered, so the kernels above have read them first).
  d_xn2 = a.x_mid = a.xn2 = a.rstd2 = Tensor();
  a.feed_forward = FeedForwardActivations();
  Tensor d_xn1;  // [T, H], allocated here or by the mixer as late as it can (Mixer::allocates_dxn)
  if (!mixer_->allocates_dxn()) d_xn1 = be.empty(hidden, ctx.dtype);
  if (mixer_out_norm_) {
    Tensor d_mixer_out = be.empty(hidden, ctx.dtype);  // [T, H] ∂L/∂(the mixer's output)
    be.rmsnorm_backward(st, a.mixer_out, rmsnorm_multiplier(be, st, mixer_out_norm_->value, zero_centered_norm_),
                        a.mixer_out_rstd, d_res, d_mixer_out, trainable_grad(*mixer_out_norm_), false);
    a.mixer_out = a.mixer_out_rstd = Tensor();
    mixer_->backward(ctx, a.xn1, a.mixer, d_mixer_out, d_xn1);
  } else {
    mixer_->backward(ctx, a.xn1, a.mixer, d_res, d_xn1);
  }
  if (need_input_grad || input_norm_->trainable)
    be.rmsnorm_backward(st, a.x_in, rmsnorm_multiplier(be, st, input_norm_->value, zero_centered_norm_), a.rstd1,
                        d_xn1, d_res, trainable_grad(*input_norm_), true);
}

namespace {

// Records shapes and projections; allocates nothing.
class CountingSink final : public ParameterSink {
 public:
  Parameter& add(const std::string& name, Shape shape) override {
    total += shape.numel();
    Parameter& p = params_.emplace_back();
    p.name = name;
    return p;
  }
  Parameter& add_buffer(const std::string& name, Shape) override {
    Parameter& p = params_.emplace_back();
    p.name = name;
    p.buffer = true;
    return p;
  }
  int64_t total = 0;
  std::vector<LinearSpec> linears;

 protected:
  void on_linear(const LinearSpec& spec) override { linears.push_back(spec); }

 private:
  std::deque<Parameter> params_;
};

}  // namespace

int64_t ParameterCounts::lora(int64_t rank, const std::vector<std::string>& targets) const {
  std::vector<std::string> fused;  // the routed experts' tensors the targets name (model/expert_lora.h)
  for (const std::string& target : targets)
    for (const std::string& tensor : expert_target_parameters(target)) fused.push_back(tensor);
  auto adapted = [&](const std::string& tensor) { return std::find(fused.begin(), fused.end(), tensor) != fused.end(); };
  double n = 0;
  for (const LinearSpec& lin : linears) {
    if (lin.lora_target && (targets.empty() || std::find(targets.begin(), targets.end(), lin.module) != targets.end()))
      n += static_cast<double>(rank * (lin.in + lin.out));
    // An expert's pair on gate_up_proj is r·(H + 2I) (one A for its gate and up rows), on down_proj
    // r·(I + H); a token passes through k of the E (the experts' token share).
    else if (lin.module == "experts.gate_proj" && adapted("mlp.experts.gate_up_proj"))
      n += lin.token_share * static_cast<double>(rank * (lin.in + 2 * lin.out));
    else if (lin.module == "experts.down_proj" && adapted("mlp.experts.down_proj"))
      n += lin.token_share * static_cast<double>(rank * (lin.in + lin.out));
  }
  return std::llround(n);
}

ParameterCounts count_parameters(const ModelConfig& c) {
  CountingSink sink;
  for (int64_t l = 0; l < c.num_layers; ++l) DecoderLayer layer(sink, c, l);
  ParameterCounts counts;
  const int64_t head = c.vocab_size * c.hidden_size;
  counts.total = sink.total + head * (c.tie_word_embeddings ? 1 : 2) + c.hidden_size;  // + final norm
  // Routed experts count with the share of tokens they see (k/E): the weights a token multiplies.
  double per_token = 0;
  for (const LinearSpec& lin : sink.linears) per_token += static_cast<double>(lin.out * lin.in) * lin.token_share;
  counts.matmul = head + std::llround(per_token);
  counts.linears = std::move(sink.linears);
  return counts;
}

}  // namespace spindle
