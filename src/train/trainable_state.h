// Where the trainable state of a run lives: replicated on every rank (one process, or --no-fsdp:
// gradients all-reduced after backward) or sharded over all dp × sp ranks (FSDP: 1/world of every
// parameter, gradient and AdamW state per rank, layers gathered only while in use). sft, check and
// dpo use this one object, so checkpoints, exports and the optimizer look the same either way.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "io/checkpoint.h"
#include "model/decoder.h"
#include "model/weights.h"
#include "parallel/fsdp.h"
#include "train/optimizer.h"
#include "train/step_runner.h"

namespace spindle {

class TrainableState {
 public:
  // Collective when sharded. `weights` must be complete (adapter loaded or LoRA added) and
  // identical on every rank; with `shard` and several processes they are sharded over the world
  // and the decoder gets FSDP's hooks.
  TrainableState(Backend& backend, ModelWeights& weights, Decoder& decoder, const RunTopology& run, bool shard,
                 const AdamWConfig& adam);

  bool sharded() const { return fsdp_ != nullptr; }
  // For StepRunner: replicated gradients are summed over the world after backward.
  bool all_reduce_gradients() const { return !fsdp_; }
  AdamWOptimizer& optimizer() { return *optimizer_; }
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
  int rank_ = 0;
  std::unique_ptr<parallel::Fsdp> fsdp_;
  std::unique_ptr<AdamWOptimizer> optimizer_;
};

}  // namespace spindle
