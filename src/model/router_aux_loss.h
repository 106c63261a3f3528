// The router load-balancing (auxiliary) loss of mixture-of-experts models, as transformers defines it
// for qwen3_moe (load_balancing_loss_func):
//
//   aux = E · Σ_e f_e · P_e,   f_e = C_e / (L·N),   P_e = S_e / (L·N)
//
// over the L MoE layers and the N real (non-padding) tokens: C_e counts the (layer, token) pairs
// whose top-k holds expert e, S_e sums the softmax probability of e. transformers computes it over
// one forward call; spindle over the whole optimizer step, every micro-batch of every rank (sequence
// and data parallel), as it does the loss denominator (docs/design.md §2.2), so any mesh and any
// gradient accumulation train with one device's aux loss. The training loss becomes
// CE + coefficient · aux.
//
// The gradient: C_e does not depend on the weights (a count), so ∂(coef·aux)/∂p[l, t, e] =
// coef · E · C_e / (L·N)² for every layer and real token, the same vector for all of them. It needs
// the step's global counts before the first backward; one step runs:
//   begin_step(N)                         collecting: MoE forwards add their statistics;
//   forward of every micro-batch ...      (with one micro-batch per rank: that micro-batch's forward);
//   finish_statistics()                   one all-reduce of [C; S], then the gradient vector is final;
//   backwards                             MoE layers add the gradient through their routers;
//   end_step()                            inactive again (evaluation passes add nothing).
#pragma once

#include <cstdint>
#include <functional>

#include "backend/backend.h"
#include "model/config.h"

namespace spindle {

class RouterAuxLoss {
 public:
  // `coefficient` > 0. Statistics in the stat dtype of `dtype`.
  RouterAuxLoss(Backend& backend, const ModelConfig& config, DType dtype, double coefficient);

  double coefficient() const { return coefficient_; }
  // A step over `tokens` real tokens in all; `all_reduce` sums a tensor over every rank of the step
  // (null: one process).
  void begin_step(int64_t tokens, std::function<void(Tensor&)> all_reduce);
  bool collecting() const { return state_ == State::Collecting; }
  bool ready() const { return state_ == State::Final; }
  // One MoE layer's forward over a micro-batch, while collecting: probs [T, E], topk_index I32
  // [T, k], token_doc I32 [T] (padding −1, not counted).
  void add(Stream stream, const Tensor& probs, const Tensor& topk_index, const Tensor& token_doc);
  // Ends collecting (a collective when there are several ranks; a no-op when already final): the
  // gradient vector and the value are known afterwards.
  void finish_statistics();
  // [E] stat dtype, ∂(coef·aux)/∂p[l, t, e] for real tokens; defined once final.
  const Tensor& probability_gradient() const { return gradient_; }
  double value() const { return value_; }  // aux of the step (without the coefficient), once final
  void end_step() { state_ = State::Inactive; }

 private:
  enum class State { Inactive, Collecting, Final };
  Backend& backend_;
  int64_t experts_ = 0, moe_layers_ = 0, tokens_ = 0;
  double coefficient_ = 0, value_ = 0;
  DType stat_dtype_;
  State state_ = State::Inactive;
  std::function<void(Tensor&)> all_reduce_;
  Tensor statistics_;  // [2, E] stat dtype: C (row 0), S (row 1) of this rank, then of the step
  Tensor gradient_;    // [E] stat dtype
};

// The coefficient a run trains with: `flag` when given (≥ 0; 0 turns the loss off), else the
// config's router_aux_loss_coef when its output_router_logits is true (transformers' rule), else 0.
// Models without MoE layers, and glm4_moe (transformers defines no aux loss for its sigmoid router;
// a flag > 0 is refused): 0.
double router_aux_loss_coefficient(const ModelConfig& config, double flag);

}  // namespace spindle
