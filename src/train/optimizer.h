// AdamW over trainable tensors, with F32 state and clipping on the global gradient norm.
//  - One process: every trainable parameter of a ModelWeights.
//  - Sharded (FSDP): a list of slots, one per parameter shard; the squared norm is summed over the
//    ranks holding the shards, so every rank clips with the same global norm.
//  - Mixed precision: a BF16/F16 value gets an F32 master copy (updated by the step and rounded
//    back into the value); gradients of another dtype are converted to F32 first, one slot at a
//    time. F32 and F64 values are updated in place, with state in their own dtype.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "model/weights.h"

namespace spindle {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;  // 0 disables clipping
};

// One tensor the optimizer updates: a whole parameter, or this rank's shard of one.
struct OptimizerSlot {
  std::string name;  // the parameter's name: state tensors are "exp_avg.<name>", ...
  Tensor value;      // updated in place; any float dtype
  Tensor grad;       // same element count; any float dtype
};

class AdamWOptimizer {
 public:
  // Every trainable parameter of `weights`, in one process.
  AdamWOptimizer(Backend& backend, ModelWeights& weights, AdamWConfig config);
  // The given slots. With `norm_group`, each rank holds a disjoint part of the parameters (FSDP
  // shards) and the squared gradient norm is all-reduced over the group before clipping.
  AdamWOptimizer(Backend& backend, std::vector<OptimizerSlot> slots, AdamWConfig config,
                 comm::Communicator* norm_group = nullptr);

  // Global L2 norm of all trainable gradients (before clipping); collective with a norm group.
  double gradient_norm();
  // One update at `lr` with gradients scaled by clip = min(1, max_norm / (norm + 1e-6)) (torch's
  // rule); returns the norm.
  double step(double lr);
  int64_t steps_taken() const { return steps_; }

  // State as named tensors for checkpoints: "exp_avg.<param>", "exp_avg_sq.<param>" (shaped like
  // the slot's value), and "master.<param>" (F32) for values kept in BF16/F16.
  std::vector<std::pair<std::string, Tensor>> state_tensors();
  void set_steps_taken(int64_t steps) { steps_ = steps; }
  // After a value was replaced behind the optimizer's back (not by a checkpoint's master state):
  // master copies restart from the current values.
  void refresh_master_copies();

 private:
  struct Slot {
    OptimizerSlot target;
    DType compute;               // F32, or F64 for F64 values
    Tensor master;               // F32 [value shape]; only when value is BF16/F16
    Tensor exp_avg, exp_avg_sq;  // compute dtype [value shape]
  };
  Tensor compute_grad(const Slot& slot);  // the gradient in the slot's compute dtype (maybe a copy)

  Backend& backend_;
  AdamWConfig config_;
  std::vector<Slot> slots_;
  comm::Communicator* norm_group_ = nullptr;
  int64_t steps_ = 0;
};

}  // namespace spindle
