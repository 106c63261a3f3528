#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace spindle {

AdamWOptimizer::AdamWOptimizer(Backend& backend, ModelWeights& weights, AdamWConfig config)
    : backend_(backend), config_(config) {
  for (Parameter& p : weights.parameters()) {
    if (!p.trainable) continue;
    SPINDLE_CHECK(p.grad.defined(), "trainable parameter {} has no gradient buffer", p.name);
    slots_.push_back({&p, backend.zeros(p.value.shape(), p.value.dtype()), backend.zeros(p.value.shape(), p.value.dtype())});
  }
  if (slots_.empty()) fail("nothing to train: no trainable parameter (choose --lora-rank > 0 or --full)");
}

double AdamWOptimizer::gradient_norm() {
  Tensor acc = backend_.zeros(Shape{1}, DType::F64);
  const Stream st = backend_.default_stream();
  for (Slot& s : slots_) backend_.sum_squares(st, s.param->grad, acc);
  double sum = 0;
  backend_.copy_to_host(st, acc, &sum);
  return std::sqrt(sum);
}

double AdamWOptimizer::step(double lr) {
  const double norm = gradient_norm();
  if (!std::isfinite(norm))
    fail("the gradient norm is {} at optimizer step {}: training diverged (lower --lr, check the data)", norm, steps_ + 1);
  double clip = 1.0;
  // torch.nn.utils.clip_grad_norm_: coefficient max/(norm + 1e-6), clamped to 1.
  if (config_.max_grad_norm > 0) clip = std::min(1.0, config_.max_grad_norm / (norm + 1e-6));
  ++steps_;
  const Backend::AdamW hp{lr, config_.beta1, config_.beta2, config_.eps, config_.weight_decay, steps_, clip};
  const Stream st = backend_.default_stream();
  for (Slot& s : slots_) backend_.adamw_step(st, s.param->value, s.param->grad, s.exp_avg, s.exp_avg_sq, hp);
  return norm;
}

std::vector<std::pair<std::string, Tensor>> AdamWOptimizer::state_tensors() {
  std::vector<std::pair<std::string, Tensor>> out;
  for (Slot& s : slots_) {
    out.emplace_back("exp_avg." + s.param->name, s.exp_avg);
    out.emplace_back("exp_avg_sq." + s.param->name, s.exp_avg_sq);
  }
  return out;
}

}  // namespace spindle
