// Device-side helpers shared by the kernel files: f32 <-> storage conversions, dtype dispatch,
// warp/block reductions, launch sizing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "backend/cuda/cuda_check.h"
#include "core/dtype.h"

namespace spindle::cuda {

using bf16 = __nv_bfloat16;

template <typename T>
__device__ __forceinline__ float to_f32(T v);
template <>
__device__ __forceinline__ float to_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ float to_f32<bf16>(bf16 v) { return __bfloat162float(v); }
template <>
__device__ __forceinline__ float to_f32<__half>(__half v) { return __half2float(v); }

// Round to nearest even, the same rounding as the host's f32_to_bf16 (core/dtype.cpp).
template <typename T>
__device__ __forceinline__ T from_f32(float v);
template <>
__device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <>
__device__ __forceinline__ bf16 from_f32<bf16>(float v) { return __float2bfloat16_rn(v); }
template <>
__device__ __forceinline__ __half from_f32<__half>(float v) { return __float2half_rn(v); }

// Calls f(T{}) with T = float or bf16 (the compute dtypes of this backend).
template <typename F>
void dispatch_compute(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::BF16: f(bf16{}); break;
    default: throw_dtype(op, t);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 values. Contains __syncthreads: call from all threads.
template <typename T>
__device__ __forceinline__ T block_sum(T v, T* shared) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  v = warp_sum(v);
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  v = lane < warps ? shared[lane] : T(0);
  return warp_sum(v);
}

// 16-byte vectors of a storage type as f32 (8 bf16 or 4 f32): one load or store instruction
// instead of 8 or 4, which is what lets a row-wise kernel reach the memory bandwidth.
template <typename T>
constexpr int kVecWidth = static_cast<int>(16 / sizeof(T));

template <typename T>
__device__ __forceinline__ bool vec_aligned(const T* p) {
  return (reinterpret_cast<uintptr_t>(p) & 15) == 0;
}

// p 16-byte aligned.
template <typename T>
__device__ __forceinline__ void load_vec(const T* p, float (&f)[kVecWidth<T>]) {
  const uint4 raw = *reinterpret_cast<const uint4*>(p);
  const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVecWidth<T>; ++i) f[i] = to_f32(e[i]);
}

template <typename T>
__device__ __forceinline__ void store_vec(T* p, const float (&f)[kVecWidth<T>]) {
  uint4 raw;
  T* e = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < kVecWidth<T>; ++i) e[i] = from_f32<T>(f[i]);
  *reinterpret_cast<uint4*>(p) = raw;
}

// Grid size for a grid-stride loop over n items with `threads` per block: enough blocks to fill
// the GPU several times over, never more than the work needs.
inline unsigned grid_for(int64_t n, int threads, int64_t max_blocks = 132 * 16) {
  int64_t b = (n + threads - 1) / threads;
  if (b > max_blocks) b = max_blocks;
  return static_cast<unsigned>(b < 1 ? 1 : b);
}

}  // namespace spindle::cuda
