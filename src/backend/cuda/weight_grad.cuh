// Helpers of the CUDA kernels whose small per-channel weights (the gated DeltaNet's conv taps, the
// gated RMSNorm's scale) may be F32 or BF16 independently of the activations' dtype, and whose weight
// gradients are reduced over tokens in a fixed order: each block writes its partial sum, then
// finish_partials adds the partials in block order (results are the same run to run).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "backend/cuda/device_util.cuh"

namespace spindle::cuda {

__device__ __forceinline__ float sigmoidf(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float silu_grad(float x) {
  const float s = sigmoidf(x);
  return s * (1.0f + x * (1.0f - s));
}

// A weight element of dtype F32 or BF16 (wt independent of the io dtype).
__device__ __forceinline__ float load_weight(const void* p, bool bf16w, int64_t i) {
  return bf16w ? __bfloat162float(static_cast<const bf16*>(p)[i]) : static_cast<const float*>(p)[i];
}
__device__ __forceinline__ void add_weight(void* p, bool bf16w, int64_t i, float v) {
  if (bf16w) {
    bf16* q = static_cast<bf16*>(p) + i;
    *q = __float2bfloat16_rn(__bfloat162float(*q) + v);
  } else {
    static_cast<float*>(p)[i] += v;
  }
}

// Whether weights of dtype `wt` are BF16; F32 is the other dtype taken, anything else throws for `op`.
bool weight_is_bf16(DType wt, const char* op);

// dst[j] += Σ_b partial[b, j] for j < n, in the order b = 0, 1, … (partial F32 [blocks, n]; dst F32 or
// BF16 [n]).
void finish_partials(cudaStream_t s, const float* partial, int64_t blocks, int64_t n, void* dst, bool bf16w);

}  // namespace spindle::cuda
