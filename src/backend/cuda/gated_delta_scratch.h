// The chunked gated delta rule's shape on the CUDA backend and the device scratch its kernels take
// from the memory pool for the length of one call (gated_delta.cu). Plain C++, no CUDA headers:
// the launchers size their Scratch with delta_rule_scratch (delta_rule_mma_scratch for the tensor-core
// kernels, below), and `spindle plan` (plan/dry_backend.cpp) counts the same allocations when it plans
// for the CUDA backend, so the plan follows the kernels. At Qwen3.6-35B-A3B's DeltaNet shape (32
// value heads of 128) the F32 kernels' backward scratch is ~5.3 GiB at 32k tokens and grows linearly:
// it can be the largest single buffer of a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <vector>

#include "core/error.h"

namespace spindle::cuda {

struct DeltaRuleShape {
  int64_t tokens;
  int key_heads, value_heads;  // value head h reads key head h / (value_heads / key_heads)
  int dk, dv;                  // at most kDeltaRuleMaxDim each
  int chunk;                   // tokens per chunk, at most kDeltaRuleMaxChunk
  int64_t chunks() const { return (tokens + chunk - 1) / chunk; }
};
constexpr int kDeltaRuleMaxDim = 128;
constexpr int kDeltaRuleMaxChunk = 64;

// F32 scratch in bytes, one field per kind of buffer (sh.tokens > 0).
struct DeltaRuleScratch {
  size_t per_key;    // [T, Hv, dk]: W, and the backward's dq, dk per value head
  size_t per_value;  // [T, Hv, dv]: U, and the backward's v_new, dv_new
  size_t per_state;  // [chunks, Hv, dk, dv]: the state entering each chunk, and its gradient (backward)
  size_t in_chunk;   // [chunks, Hv, C, C]: P, each chunk's masked in-chunk attention
  // One entry per Scratch of gated_delta_rule_forward / _backward, all live for the whole call.
  std::vector<size_t> forward() const { return {per_key, per_value, in_chunk}; }
  std::vector<size_t> backward() const {
    return {per_key, per_value, per_value, per_value, per_state, per_state, per_key, per_key, in_chunk};
  }
};

inline DeltaRuleScratch delta_rule_scratch(const DeltaRuleShape& sh) {
  const size_t f32 = sizeof(float), tokens = static_cast<size_t>(sh.tokens), hv = static_cast<size_t>(sh.value_heads);
  const size_t chunks = static_cast<size_t>(sh.chunks()), c = static_cast<size_t>(sh.chunk);
  const size_t dk = static_cast<size_t>(sh.dk), dv = static_cast<size_t>(sh.dv);
  return {f32 * tokens * hv * dk, f32 * tokens * hv * dv, f32 * chunks * hv * dk * dv, f32 * chunks * hv * c * c};
}

// The tensor-core kernels (gated_delta_mma.cu) run BF16 tensors whose head dims and chunk are
// multiples of 8 (they also want 16-byte aligned tensors, which the pool's allocations are). Their
// scratch is BF16, and the backward frees U before it allocates the state gradients: each list holds
// what is live at the call's peak, in the launchers' order. About 6.5 × T·Hv·128·2 bytes backward
// at Qwen3.6's shape (1.6 GiB at 32k), under a third of the F32 kernels' list above.
//
// SPINDLE_DELTA_RULE=fma sends BF16 tensors to the F32 kernels too (F32 arithmetic and scratch
// throughout, slower, more scratch): to see how much the tensor cores' BF16 operands and scratch move
// a result. Unset or "auto": the tensor cores where the shape allows. Read at each call.
inline bool delta_rule_tensor_cores_allowed() {
  const char* v = std::getenv("SPINDLE_DELTA_RULE");
  const std::string_view value = v ? v : "";
  if (value.empty() || value == "auto") return true;
  if (value == "fma") return false;
  fail("SPINDLE_DELTA_RULE must be auto or fma, got \"{}\" (the gated delta rule's kernels on CUDA: auto the "
       "tensor cores for BF16, fma the F32 kernels for every dtype)", value);
}

inline bool delta_rule_tensor_core_shape(const DeltaRuleShape& sh) {
  return sh.dk % 8 == 0 && sh.dv % 8 == 0 && sh.chunk % 8 == 0 && delta_rule_tensor_cores_allowed();
}

struct DeltaRuleMmaScratch {
  size_t per_key;    // [T, Hv, dk] BF16: W
  size_t per_value;  // [T, Hv, dv] BF16: U; V_new (forward) or dV_new (backward)
  size_t per_state;  // [chunks, Hv, dv, dk] BF16: the state entering each chunk; its gradient (backward)
  size_t inverse;    // [chunks, Hv, C, C] BF16: each chunk's (I + A)⁻¹ (backward)
  size_t gates;      // [chunks, Hv, 4, 64] F32: the gate table
  std::vector<size_t> forward() const { return {per_key, per_value, gates, per_state, per_value}; }
  std::vector<size_t> backward() const { return {gates, inverse, per_state, per_value, per_key, per_state}; }
};

inline DeltaRuleMmaScratch delta_rule_mma_scratch(const DeltaRuleShape& sh) {
  const size_t bf16 = 2, tokens = static_cast<size_t>(sh.tokens), hv = static_cast<size_t>(sh.value_heads);
  const size_t chunks = static_cast<size_t>(sh.chunks()), c = static_cast<size_t>(sh.chunk);
  const size_t dk = static_cast<size_t>(sh.dk), dv = static_cast<size_t>(sh.dv);
  return {bf16 * tokens * hv * dk, bf16 * tokens * hv * dv, bf16 * chunks * hv * dk * dv, bf16 * chunks * hv * c * c,
          sizeof(float) * chunks * hv * 4 * kDeltaRuleMaxChunk};
}

}  // namespace spindle::cuda
