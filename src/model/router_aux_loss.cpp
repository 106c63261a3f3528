#include "model/router_aux_loss.h"

#include <vector>

#include "core/error.h"
#include "model/batch.h"

namespace spindle {

RouterAuxLoss::RouterAuxLoss(Backend& backend, const ModelConfig& config, DType dtype, double coefficient)
    : backend_(backend), experts_(config.moe.num_experts), coefficient_(coefficient), stat_dtype_(stat_dtype(dtype)) {
  for (int64_t l = 0; l < config.num_layers; ++l)
    moe_layers_ += config.layer_kind(l).feed_forward == FeedForwardKind::MixtureOfExperts;
  SPINDLE_CHECK(moe_layers_ > 0 && experts_ > 0, "router aux loss on a model without MoE layers");
  SPINDLE_CHECK(coefficient > 0, "router aux loss coefficient {}", coefficient);
  statistics_ = backend_.empty(Shape{2, experts_}, stat_dtype_);
  gradient_ = backend_.empty(Shape{experts_}, stat_dtype_);
}

void RouterAuxLoss::begin_step(int64_t tokens, std::function<void(Tensor&)> all_reduce) {
  tokens_ = tokens;
  all_reduce_ = std::move(all_reduce);
  backend_.fill(backend_.default_stream(), statistics_, 0.0);
  value_ = 0;
  state_ = State::Collecting;
}

void RouterAuxLoss::add(Stream stream, const Tensor& probs, const Tensor& topk_index, const Tensor& token_doc) {
  SPINDLE_CHECK(collecting(), "router statistics added outside a step's collecting phase");
  Tensor counts = statistics_.rows(0, 1).reshape(Shape{experts_});
  Tensor sums = statistics_.rows(1, 2).reshape(Shape{experts_});
  backend_.moe_router_statistics(stream, probs, topk_index, token_doc, counts, sums);
}

void RouterAuxLoss::finish_statistics() {
  if (state_ != State::Collecting) return;
  const Stream stream = backend_.default_stream();
  if (all_reduce_) all_reduce_(statistics_);
  // 2E numbers: the host finishes the sums (one small copy per step).
  Tensor wide = backend_.empty(statistics_.shape(), DType::F64);
  backend_.copy(stream, statistics_, wide);
  std::vector<double> stats(static_cast<size_t>(2 * experts_));
  backend_.copy_to_host(stream, wide, stats.data());
  const double pairs = static_cast<double>(moe_layers_) * static_cast<double>(tokens_);
  std::vector<double> gradient(static_cast<size_t>(experts_), 0.0);
  value_ = 0;
  if (pairs > 0) {
    const double e = static_cast<double>(experts_);
    for (int64_t i = 0; i < experts_; ++i) {
      const double count = stats[i], mass = stats[experts_ + i];
      value_ += e * (count / pairs) * (mass / pairs);
      gradient[i] = coefficient_ * e * count / (pairs * pairs);
    }
  }
  Tensor staged = backend_.empty(gradient_.shape(), DType::F64);
  backend_.copy_from_host(stream, gradient.data(), staged);
  backend_.copy(stream, staged, gradient_);
  state_ = State::Final;
}

double router_aux_loss_coefficient(const ModelConfig& config, double flag) {
  bool has_moe = false;
  for (int64_t l = 0; l < config.num_layers; ++l)
    has_moe |= config.layer_kind(l).feed_forward == FeedForwardKind::MixtureOfExperts;
  if (!has_moe) {
    if (flag > 0)
      fail("--router-aux-loss-coef {}: the router auxiliary loss belongs to mixture-of-experts models, and this {} "
           "model has no MoE layer",
           flag, config.model_type);
    return 0.0;
  }
  if (config.moe.gating.sigmoid_router) {
    if (flag > 0)
      fail("--router-aux-loss-coef {}: transformers defines no router auxiliary loss for {} (Glm4MoeForCausalLM "
           "computes none; its experts are balanced through e_score_correction_bias, which training leaves as read); "
           "drop the flag or pass 0",
           flag, config.model_type);
    return 0.0;
  }
  if (flag >= 0) return flag;
  return config.moe.output_router_logits ? config.moe.router_aux_loss_coef : 0.0;
}

}  // namespace spindle
