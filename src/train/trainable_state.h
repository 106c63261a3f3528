// Where the trainable state of a run lives: replicated on every rank (one process, or --no-fsdp:
// gradients all-reduced after backward) or sharded over all dp × sp ranks (FSDP: 1/world of every
// parameter, gradient and AdamW state per rank, layers gathered only while in use). sft, check and
// dpo use this one object (built by train/run_assembly.h), so checkpoints, exports and the optimizer
// look the same either way.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "io/checkpoint.h"
#include "model/decoder.h"
#include "model/weights.h"
#include "parallel/fsdp.h"
#include "train/optimizer.h"

namespace spindle {

class TrainableState {
 public:
  // Collective when sharded. `weights` must be complete (adapter loaded or LoRA added) and
  // identical on every rank; with `shard` and a world (several processes) they are sharded over it,
  // and decoders computing with them need fsdp() as their parameter hooks. No optimizer state
  // until add_optimizer (a step without one: bench, a frozen reference model).
  TrainableState(Backend& backend, ModelWeights& weights, comm::Communicator* world, bool shard);
  // AdamW over the trainable parameters (their shards when sharded).
  void add_optimizer(const AdamWConfig& adam);

  bool sharded() const { return fsdp_ != nullptr; }
  parallel::Fsdp* fsdp() const { return fsdp_.get(); }
  // For StepRunner: replicated gradients are summed over the world after backward.
  bool all_reduce_gradients() const { return !fsdp_; }
  bool has_optimizer() const { return optimizer_ != nullptr; }
  AdamWOptimizer& optimizer();
  void zero_grads();

  // Collective. While the returned scope lives, rank 0 holds the full values of the trainable
  // parameters (all parameters with `all`) in ModelWeights, for the exporters.
  std::optional<parallel::Fsdp::GatheredValues> gather_for_export(bool all);
  // Collective. The optimizer state as full tensors ("exp_avg.<param>", ...) on rank 0 (empty elsewhere).
  std::vector<std::pair<std::string, Tensor>> optimizer_state_for_checkpoint();
  // Loads optimizer state written by optimizer_state_for_checkpoint (any mesh).
  void load_optimizer_state(const io::Checkpoint& file);
  // Collective. Every trainable gradient as a full tensor, in parameter order, on every rank.
  std::vector<std::pair<std::string, Tensor>> full_gradients();
  // Bytes of parameters and gradients this rank holds between steps (optimizer state not included).
  size_t held_bytes() const;
  // One line for the run's start: what is sharded and what each process holds.
  std::string describe() const;

 private:
  Backend& backend_;
  ModelWeights& weights_;
  comm::Communicator* world_ = nullptr;
  int rank_ = 0;
  std::unique_ptr<parallel::Fsdp> fsdp_;
  std::unique_ptr<AdamWOptimizer> optimizer_;
};

}  // namespace spindle
