// The LM head and cross-entropy, fused and chunked, over the selected (supervised) positions only
// (docs/design.md §2.3): at most chunk_rows × vocab logits exist at any time, never tokens × vocab.
#pragma once

#include <cstdint>

#include "backend/backend.h"

namespace spindle {

struct LmHeadLossArgs {
  const Tensor* hidden;   // [N, H] final-normed hidden states of the selected positions
  const Tensor* weight;   // [V, H] LM head
  const Tensor* targets;  // I32 [N]
  const Tensor* weights;  // [N] loss weight of each target (loss_scale)
  // The loss adds Σ weight·CE · loss_scale; gradients are of that sum (grad_scale = loss_scale when
  // training, 0 for evaluation). Both are 1 / (global number of supervised targets) in training.
  double loss_scale = 1.0;
  int64_t chunk_rows = 1024;
  // > 0: the logits are soft-capped before the cross-entropy, cap·tanh(logit / cap) (Gemma 2's
  // final_logit_softcapping); the chunk then holds a second [rows, V] buffer.
  double logit_softcap = 0;
  Tensor* loss_sum = nullptr;  // one element, accumulated
  Tensor* token_ce = nullptr;  // optional F32 [N]: unweighted CE per target
  Tensor* dhidden = nullptr;   // optional [N, H]: overwritten with ∂loss/∂hidden
  Tensor* dweight = nullptr;   // optional [V, H]: ∂loss/∂W accumulated (+=)
};

void lm_head_cross_entropy(Backend& backend, Stream stream, const LmHeadLossArgs& args);

// Rows per chunk so the logits chunk stays within `budget_bytes`.
int64_t lm_head_chunk_rows(int64_t vocab, DType dtype, size_t budget_bytes);

}  // namespace spindle
