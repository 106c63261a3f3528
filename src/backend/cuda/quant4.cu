// bitsandbytes' 4-bit weights (NF4/FP4, docs/qlora.md): dequantisation into the compute dtype, at
// memory bandwidth, before every GEMM that reads a quantised base weight. The arithmetic is
// bitsandbytes' exactly (its kernels are built with --use_fast_math): the product table · absmax
// in F32 with denormal inputs and result flushed (mul.rn.ftz), then rounded to nearest even; a
// double-quantised absmax is code · absmax2 (mul.rn.ftz) and then + offset as a separate IEEE add,
// never an FMA. The CPU reference is backend/cpu/quant4_ops.cpp; tests/cuda compares the two.
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

__constant__ float kNf4[16] = {-1.0f,
                               -0.6961928009986877f,
                               -0.5250730514526367f,
                               -0.39491748809814453f,
                               -0.28444138169288635f,
                               -0.18477343022823334f,
                               -0.09105003625154495f,
                               0.0f,
                               0.07958029955625534f,
                               0.16093020141124725f,
                               0.24611230194568634f,
                               0.33791524171829224f,
                               0.44070982933044434f,
                               0.5626170039176941f,
                               0.7229568362236023f,
                               1.0f};
// FP4: sign bit 3, magnitude from the low three bits.
__constant__ float kFp4Magnitude[8] = {0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f};

// Written in PTX so neither the build flags nor the compiler's contraction can change them.
__device__ __forceinline__ float mul_ftz(float a, float b) {
  float r;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float add_ieee(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

template <bool kNf4Type>
__device__ __forceinline__ float code_value(unsigned code) {
  if (kNf4Type) return kNf4[code];
  return mul_ftz(kFp4Magnitude[code & 7u], (code & 8u) ? -1.0f : 1.0f);
}

// One thread per packed byte: elements 2k (high nibble) and 2k+1 (low), of the same block because
// blocks hold an even number of elements. out [n]; the last byte of an odd n has one element.
template <typename T, bool kNf4Type>
__global__ void dequantize_4bit_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ absmax, T* out,
                                       int64_t n, int block_shift) {
  const int64_t bytes = (n + 1) / 2, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < bytes; k += stride) {
    const unsigned byte = packed[k];
    const int64_t j = 2 * k;
    const float scale = absmax[j >> block_shift];
    out[j] = from_f32<T>(mul_ftz(code_value<kNf4Type>(byte >> 4), scale));
    if (j + 1 < n) out[j + 1] = from_f32<T>(mul_ftz(code_value<kNf4Type>(byte & 15u), scale));
  }
}

__global__ void dequantize_absmax_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ code_map,
                                         const float* __restrict__ absmax2, float* absmax, int64_t k,
                                         int64_t blocksize2, float offset) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < k; i += stride)
    absmax[i] = add_ieee(mul_ftz(code_map[codes[i]], absmax2[i / blocksize2]), offset);
}

}  // namespace

void dequantize_4bit(cudaStream_t s, const void* packed, const void* absmax, void* out, DType t, int64_t n,
                     int64_t blocksize, bool nf4) {
  if (n == 0) return;
  int block_shift = 0;
  while ((int64_t{1} << block_shift) < blocksize) ++block_shift;
  const int64_t bytes = (n + 1) / 2;
  dispatch_compute(t, "dequantize_4bit", [&](auto z) {
    using T = decltype(z);
    auto* p = static_cast<const uint8_t*>(packed);
    auto* a = static_cast<const float*>(absmax);
    if (nf4) dequantize_4bit_kernel<T, true><<<grid_for(bytes, 256), 256, 0, s>>>(p, a, static_cast<T*>(out), n, block_shift);
    else dequantize_4bit_kernel<T, false><<<grid_for(bytes, 256), 256, 0, s>>>(p, a, static_cast<T*>(out), n, block_shift);
    CUDA_CHECK_LAUNCH();
  });
}

void dequantize_absmax(cudaStream_t s, const void* codes, const void* code_map, const void* absmax2, void* absmax,
                       int64_t k, int64_t blocksize2, float offset) {
  if (k == 0) return;
  dequantize_absmax_kernel<<<grid_for(k, 256), 256, 0, s>>>(
      static_cast<const uint8_t*>(codes), static_cast<const float*>(code_map), static_cast<const float*>(absmax2),
      static_cast<float*>(absmax), k, blocksize2, offset);
  CUDA_CHECK_LAUNCH();
}

}  // namespace spindle::cuda
