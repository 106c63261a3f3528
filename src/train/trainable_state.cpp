#include "train/trainable_state.h"

#include <fmt/format.h>

#include "core/error.h"
#include "io/load_tensor.h"

namespace spindle {

TrainableState::TrainableState(Backend& backend, ModelWeights& weights, comm::Communicator* world, bool shard)
    : backend_(backend), weights_(weights), world_(world), rank_(world ? world->rank() : 0) {
  if (shard && world) fsdp_ = std::make_unique<parallel::Fsdp>(backend, weights, *world);
}

void TrainableState::add_optimizer(const AdamWConfig& adam) {
  if (fsdp_) {
    std::vector<OptimizerSlot> slots;
    for (const parallel::ParameterShard& s : fsdp_->trainable_shards()) slots.push_back({s.name, s.value, s.grad});
    if (slots.empty()) fail("nothing to train: no trainable parameter (choose --lora-rank > 0 or --full)");
    optimizer_ = std::make_unique<AdamWOptimizer>(backend_, std::move(slots), adam, world_);
  } else {
    // Replicated gradients are identical on every rank after the all-reduce: no norm group needed.
    optimizer_ = std::make_unique<AdamWOptimizer>(backend_, weights_, adam);
  }
}

AdamWOptimizer& TrainableState::optimizer() {
  SPINDLE_CHECK(optimizer_ != nullptr, "this run has no optimizer state");
  return *optimizer_;
}

void TrainableState::zero_grads() {
  if (fsdp_) fsdp_->zero_grads();
  else weights_.zero_grads(backend_);
}

std::optional<parallel::Fsdp::GatheredValues> TrainableState::gather_for_export(bool all) {
  if (!fsdp_) return std::nullopt;
  return fsdp_->gather_full([all](const Parameter& p) { return all || p.trainable; }, 0);
}

std::vector<std::pair<std::string, Tensor>> TrainableState::optimizer_state_for_checkpoint() {
  if (!fsdp_) return optimizer_->state_tensors();
  return fsdp_->gather_state(optimizer_->state_tensors(), 0);
}

void TrainableState::load_optimizer_state(const io::Checkpoint& file) {
  if (!fsdp_) {
    for (auto& [name, tensor] : optimizer_->state_tensors())
      io::load_tensor_into(backend_, file.require(name, tensor.shape()), tensor);
    return;
  }
  fsdp_->load_state(optimizer_->state_tensors(), [&](const std::string& name, Tensor& full) {
    io::load_tensor_into(backend_, file.require(name, full.shape()), full);
  });
}

std::vector<std::pair<std::string, Tensor>> TrainableState::full_gradients() {
  std::vector<std::pair<std::string, Tensor>> out;
  if (!fsdp_) {
    for (Parameter& p : weights_.parameters())
      if (p.trainable) out.emplace_back(p.name, p.grad);
    return out;
  }
  for (const parallel::ParameterShard& s : fsdp_->trainable_shards())
    out.emplace_back(s.name, fsdp_->gather_shard(s.name, s.grad));
  return out;
}

size_t TrainableState::held_bytes() const {
  if (fsdp_) return fsdp_->shard_bytes();
  size_t bytes = 0;
  for (const Parameter& p : weights_.parameters()) {
    bytes += p.value.bytes();
    if (p.trainable) bytes += p.grad.bytes();
  }
  return bytes;
}

std::string TrainableState::describe() const {
  constexpr double mib = 1024.0 * 1024.0;
  if (!fsdp_) return fmt::format("parameters and gradients replicated: {:.1f} MiB per process", held_bytes() / mib);
  return fmt::format("FSDP: parameters, gradients and AdamW state sharded over {} processes: {:.1f} MiB of {:.1f} MiB "
                     "parameters and gradients per process",
                     fsdp_->world(), fsdp_->shard_bytes() / mib, fsdp_->full_bytes() / mib);
}

}  // namespace spindle
