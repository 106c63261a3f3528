#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace spindle {

namespace {

std::vector<OptimizerSlot> trainable_slots(ModelWeights& weights) {
  std::vector<OptimizerSlot> slots;
  for (Parameter& p : weights.parameters()) {
    if (!p.trainable) continue;
    SPINDLE_CHECK(p.grad.defined(), "trainable parameter {} has no gradient buffer", p.name);
    slots.push_back({p.name, p.value, p.grad});
  }
  return slots;
}

}  // namespace

AdamWOptimizer::AdamWOptimizer(Backend& backend, ModelWeights& weights, AdamWConfig config)
    : AdamWOptimizer(backend, trainable_slots(weights), config, nullptr) {}

AdamWOptimizer::AdamWOptimizer(Backend& backend, std::vector<OptimizerSlot> slots, AdamWConfig config,
                               comm::Communicator* norm_group)
    : backend_(backend), config_(config), norm_group_(norm_group) {
  // A rank may hold no slot when there are fewer trainable elements than ranks; it still joins the norm.
  if (slots.empty() && !norm_group_)
    fail("nothing to train: no trainable parameter (choose --lora-rank > 0 or --full)");
  const Stream st = backend_.default_stream();
  for (OptimizerSlot& target : slots) {
    SPINDLE_CHECK(target.value.defined() && target.grad.defined(), "optimizer slot {} lacks a value or gradient",
                  target.name);
    SPINDLE_CHECK(target.value.numel() == target.grad.numel(), "optimizer slot {}: value {} vs gradient {}",
                  target.name, target.value.describe(), target.grad.describe());
    const DType vt = target.value.dtype();
    if (!is_float(vt)) fail("optimizer slot {}: cannot train a {} tensor", target.name, dtype_name(vt));
    Slot s;
    s.compute = vt == DType::F64 ? DType::F64 : DType::F32;
    const Shape shape = target.value.shape();
    if (vt != s.compute) {
      s.master = backend_.empty(shape, s.compute);
      backend_.copy(st, target.value, s.master);
    }
    s.exp_avg = backend_.zeros(shape, s.compute);
    s.exp_avg_sq = backend_.zeros(shape, s.compute);
    s.target = std::move(target);
    slots_.push_back(std::move(s));
  }
  // In name order: the squared gradient norm sums the slots in this order, and the same parameters
  // can come in another one (new LoRA adapters follow --lora-targets, a loaded adapter the model's
  // projection order), so a resumed run adds them up exactly as the run it continues did.
  std::sort(slots_.begin(), slots_.end(), [](const Slot& a, const Slot& b) { return a.target.name < b.target.name; });
}

void AdamWOptimizer::refresh_master_copies() {
  for (Slot& s : slots_)
    if (s.master.defined()) backend_.copy(backend_.default_stream(), s.target.value, s.master);
}

Tensor AdamWOptimizer::compute_grad(const Slot& s) {
  if (s.target.grad.dtype() == s.compute) return s.target.grad;
  Tensor converted = backend_.empty(s.target.value.shape(), s.compute);
  backend_.copy(backend_.default_stream(), s.target.grad, converted);
  return converted;
}

double AdamWOptimizer::gradient_norm() {
  // The CPU reference accumulates in F64; CUDA's statistics tensors are F32 (its sum_squares sums
  // each tensor in F64 and adds the result into the F32 accumulator).
  const DType acc_dtype = backend_.device().kind == DeviceKind::CPU ? DType::F64 : DType::F32;
  Tensor acc = backend_.zeros(Shape{1}, acc_dtype);
  const Stream st = backend_.default_stream();
  for (Slot& s : slots_) backend_.sum_squares(st, compute_grad(s), acc);
  // Shards are disjoint, so the global squared norm is the sum over ranks (in rank order: the same
  // value, hence the same clip, on every rank).
  if (norm_group_) norm_group_->all_reduce_sum(st, acc);
  double sum = 0;
  if (acc_dtype == DType::F64) {
    backend_.copy_to_host(st, acc, &sum);
  } else {
    float sum32 = 0;
    backend_.copy_to_host(st, acc, &sum32);
    sum = sum32;
  }
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
  for (Slot& s : slots_) {
    const Tensor grad = compute_grad(s);
    if (s.master.defined()) {
      backend_.adamw_step(st, s.master, grad, s.exp_avg, s.exp_avg_sq, hp);
      backend_.copy(st, s.master, s.target.value);  // rounded once, from the exact master
    } else {
      backend_.adamw_step(st, s.target.value, grad, s.exp_avg, s.exp_avg_sq, hp);
    }
  }
  return norm;
}

std::vector<std::pair<std::string, Tensor>> AdamWOptimizer::state_tensors() {
  std::vector<std::pair<std::string, Tensor>> out;
  for (Slot& s : slots_) {
    out.emplace_back("exp_avg." + s.target.name, s.exp_avg);
    out.emplace_back("exp_avg_sq." + s.target.name, s.exp_avg_sq);
    if (s.master.defined()) out.emplace_back("master." + s.target.name, s.master);
  }
  return out;
}

}  // namespace spindle
