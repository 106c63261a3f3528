// The device scratch the attention backward takes from the CUDA backend's memory pool for the
// length of one call, for `spindle plan` (plan/dry_backend.cpp). Plain C++, no CUDA headers.
//
// Every backward the backend may choose for a call holds F32 buffers (nq = Tq·Hq·D, nk = Tk·Hkv·D):
//   the wgmma kernels (Hopper, BF16, D 128; attention_bwd_wgmma.cu, sized by the function below):
//     dq, dk, dv accumulators and two per-row terms, (nq + 2·nk + 2·Hq·Tq_pad)·4 bytes;
//   the mma.sync kernels (attention_bwd_mma.cu): dq's accumulator and one per-row term, (nq + Hq·Tq)·4;
//   cuDNN (attention_cudnn.cpp): dq's accumulator and its row sums, nq·4 + Hq·Tq·4, plus BF16 copies
//     of the three gradients, (nq + 2·nk)·2, when the call accumulates into them, plus cuDNN's own
//     workspace, which its plan states: nq·4 + 256 bytes for every causal backward measured on an
//     H200 with cuDNN 9.14 (Hq/Hkv/D 12/2/128, 28/4/128, 64/8/128, 32/4/128 and 16/2/256; 4k to 1M
//     tokens; `bench_cuda --cudnn-workspace`), 256 bytes forward;
//   the simple kernels (attention_simple.cu): one per-row term, (Hq·Tq + 1)·4;
// and tile tables of a few KiB. Which one runs depends on the GPU, the head dim, the tensors'
// alignment and, for cuDNN, on how often a shape recurs, so the plan counts the largest of these
// for every BF16 call: a bound, tight to 2·nk·4 bytes for the engine's kernels; F32 calls run the
// simple kernels.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

namespace spindle::cuda {

constexpr int64_t kAttentionWgmmaBackwardRows = 64;  // query rows per step: Tq_pad is a multiple of it

// The wgmma backward's F32 accumulators and per-row terms (without its tile tables).
inline size_t attention_wgmma_backward_f32_bytes(int64_t tq, int64_t tk, int64_t hq, int64_t hkv, int64_t d) {
  const int64_t tq_pad = (tq + kAttentionWgmmaBackwardRows - 1) / kAttentionWgmmaBackwardRows *
                         kAttentionWgmmaBackwardRows;
  return static_cast<size_t>(tq * hq * d + 2 * tk * hkv * d + 2 * hq * tq_pad) * 4;
}

// cuDNN's own backward workspace as its plans ask for it (see above), nq = Tq·Hq·D.
inline size_t cudnn_own_backward_workspace_bytes(int64_t nq) { return static_cast<size_t>(nq) * 4 + 256; }

// The most any backward kernel holds for one call (see above).
inline size_t attention_backward_scratch_bound(int64_t tq, int64_t tk, int64_t hq, int64_t hkv, int64_t d,
                                               bool bf16, bool accumulate) {
  if (!bf16) return static_cast<size_t>(tq * hq + 1) * 4;
  const int64_t nq = tq * hq * d, nk = tk * hkv * d;
  const size_t cudnn = static_cast<size_t>(nq + hq * tq) * 4 + cudnn_own_backward_workspace_bytes(nq) +
                       (accumulate ? static_cast<size_t>(nq + 2 * nk) * 2 : 0);
  return std::max(attention_wgmma_backward_f32_bytes(tq, tk, hq, hkv, d), cudnn);
}

}  // namespace spindle::cuda
