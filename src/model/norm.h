// RMSNorm weights as a family stores them.
#pragma once

#include "backend/backend.h"

namespace spindle {

// The multiplier an RMSNorm applies: its stored weight, or 1 + weight for a zero-centred norm
// (qwen3_5: y = norm(x)·(1 + w), w initialised to 0). ∂L/∂multiplier is ∂L/∂w, so rmsnorm_backward
// writes the weight's gradient directly. For a zero-centred norm this is a new tensor, made where
// it is used (under FSDP the weight exists only inside its unit's window); 1 + w is rounded to the
// weight's dtype, as transformers rounds it to F32.
inline Tensor rmsnorm_multiplier(Backend& backend, Stream stream, const Tensor& weight, bool zero_centered) {
  if (!zero_centered) return weight;
  Tensor multiplier = backend.empty(weight.shape(), weight.dtype());
  backend.fill(stream, multiplier, 1.0);
  backend.axpy(stream, 1.0, weight, multiplier);
  return multiplier;
}

}  // namespace spindle
