// The chunked gated delta rule's shape on the CUDA backend and the device scratch its kernels take
// from the memory pool for the length of one call (gated_delta.cu). Plain C++, no CUDA headers:
// the launchers size their Scratch with delta_rule_scratch, and `spindle plan` (plan/dry_backend.cpp)
// counts the same allocations when it plans for the CUDA backend, so the plan follows the kernels.
// At Qwen3.6-35B-A3B's DeltaNet shape (32 value heads of 128) the backward's scratch is ~5.3 GiB
// at 32k tokens and grows linearly: it can be the largest single buffer of a step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

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

}  // namespace spindle::cuda
