// Device helpers the two implementations of the chunked gated delta rule share (gated_delta.cu: F32
// FMAs, gated_delta_mma.cu: tensor cores): the gates of one chunk and the decay between two tokens.
#pragma once

#include <cstdint>

#include "backend/cuda/gated_delta.h"

namespace spindle::cuda::delta {

// The gates of one chunk of one value head, in shared memory (gated_delta.cu's file comment).
struct ChunkGates {
  float G[kDeltaRuleMaxChunk];      // cumulative log decay, restarted at every segment
  float gamma[kDeltaRuleMaxChunk];  // exp(G_i) for the continuing first segment, else 0
  float last[kDeltaRuleMaxChunk];   // exp(G_last − G_r) within the last token's segment, else 0
  int seg[kDeltaRuleMaxChunk];      // segment id inside the chunk: the index of the segment's first token
  int n;                            // tokens in the chunk
  float gamma_last;                 // gamma[n − 1]
};
static_assert(kDeltaRuleMaxChunk == 64, "the warp scan below covers a chunk in two halves of 32 lanes");

// All threads call it; warp 0 computes, with shuffles: a max-scan gives each token its segment's
// first index, a segmented sum-scan the cumulative decay (the sum restarts exactly at a segment's
// first token, as a serial loop would). Entries at r ≥ n are zero. Ends with __syncthreads.
__device__ inline void load_gates(ChunkGates& cg, const float* g, const int32_t* doc, int64_t tokens, int heads, int h,
                                  int64_t c0, int chunk) {
  if (threadIdx.x < 32) {
    const unsigned all = 0xffffffffu;
    const int lane = threadIdx.x;
    const int n = static_cast<int>(tokens - c0 < chunk ? tokens - c0 : chunk);
    float cum[2];
    int start[2];
    float carry_sum = 0.f;
    int carry_start = 0;
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half * 32 + lane;
      const bool valid = r < n;
      float v = valid ? g[(c0 + r) * heads + h] : 0.f;
      int s = valid && r > 0 && doc[c0 + r] != doc[c0 + r - 1] ? r : 0;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const int up = __shfl_up_sync(all, s, off);
        if (lane >= off) s = max(s, up);
      }
      s = max(s, carry_start);
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const float up_v = __shfl_up_sync(all, v, off);
        const int up_s = __shfl_up_sync(all, s, off);
        if (lane >= off && up_s == s) v += up_v;
      }
      if (s == carry_start) v += carry_sum;  // the segment began in the first half (or at 0)
      cum[half] = v;
      start[half] = s;
      carry_sum = __shfl_sync(all, v, 31);
      carry_start = __shfl_sync(all, s, 31);
    }
    const bool carry = c0 > 0 && doc[c0] == doc[c0 - 1];
    const bool last_in_second = n > 32;  // a select, not an index: keeps cum and start in registers
    const float g_last = __shfl_sync(all, last_in_second ? cum[1] : cum[0], (n - 1) % 32);
    const int s_last = __shfl_sync(all, last_in_second ? start[1] : start[0], (n - 1) % 32);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = half * 32 + lane;
      const bool valid = r < n;
      cg.G[r] = valid ? cum[half] : 0.f;
      cg.seg[r] = valid ? start[half] : -1;
      cg.gamma[r] = valid && carry && start[half] == 0 ? expf(cum[half]) : 0.f;
      cg.last[r] = valid && start[half] == s_last ? expf(g_last - cum[half]) : 0.f;
    }
    if (lane == 0) {
      cg.n = n;
      cg.gamma_last = carry && s_last == 0 ? expf(g_last) : 0.f;
    }
  }
  __syncthreads();
}

// D_ij: the decay from token j to token i ≥ j of one segment, else 0.
__device__ __forceinline__ float decay(const ChunkGates& cg, int i, int j) {
  return i >= j && cg.seg[i] == cg.seg[j] ? expf(cg.G[i] - cg.G[j]) : 0.f;
}

}  // namespace spindle::cuda::delta
