// AdamW over the trainable parameters, with fp32 state and clipping on the global gradient norm.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/weights.h"

namespace spindle {

struct AdamWConfig {
  double beta1 = 0.9, beta2 = 0.999, eps = 1e-8;
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;  // 0 disables clipping
};

class AdamWOptimizer {
 public:
  AdamWOptimizer(Backend& backend, ModelWeights& weights, AdamWConfig config);

  // Global L2 norm of all trainable gradients (before clipping). Later summed across ranks
  // through the communicator by the caller that owns the shards.
  double gradient_norm();
  // One update at `lr` with gradients scaled by clip = min(1, max_norm / norm); returns the norm.
  double step(double lr);
  int64_t steps_taken() const { return steps_; }

  // State as named tensors ("exp_avg.<param>", "exp_avg_sq.<param>") for checkpoints.
  std::vector<std::pair<std::string, Tensor>> state_tensors();
  void set_steps_taken(int64_t steps) { steps_ = steps; }

 private:
  struct Slot {
    Parameter* param;
    Tensor exp_avg, exp_avg_sq;  // same shape as the parameter
  };
  Backend& backend_;
  AdamWConfig config_;
  std::vector<Slot> slots_;
  int64_t steps_ = 0;
};

}  // namespace spindle
