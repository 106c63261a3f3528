// ModelWeights::random's counter-based values drawn on the device (backend.h, fill_random_uniform):
// the hash and the double arithmetic of core/random_hash.h, shared with the CPU reference, then the
// host's rounding (double -> F32 -> BF16/F16, each to nearest even), so the bits equal the CPU's.
// A 72B model's 7e10 values take well under a second here, where the host's cores took minutes.
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.h"
#include "core/random_hash.h"

namespace spindle::cuda {
namespace {

template <typename T>
__device__ __forceinline__ T store_double(double v);
template <>
__device__ __forceinline__ double store_double<double>(double v) { return v; }
template <>
__device__ __forceinline__ float store_double<float>(double v) { return __double2float_rn(v); }
template <>
__device__ __forceinline__ bf16 store_double<bf16>(double v) { return __float2bfloat16_rn(__double2float_rn(v)); }
template <>
__device__ __forceinline__ __half store_double<__half>(double v) { return __float2half_rn(__double2float_rn(v)); }

template <typename T>
__global__ void fill_random_uniform_kernel(T* __restrict__ out, int64_t n, uint64_t key, double half_width) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = store_double<T>(random_hash::uniform(key, static_cast<uint64_t>(i), half_width));
}

}  // namespace

void fill_random_uniform(cudaStream_t s, void* out, DType t, int64_t n, uint64_t seed, uint64_t sequence,
                         double half_width) {
  if (n == 0) return;
  const uint64_t key = random_hash::stream_key(seed, sequence);
  auto launch = [&](auto z) {
    using T = decltype(z);
    fill_random_uniform_kernel<T><<<grid_for(n, 256, int64_t{132} * 32), 256, 0, s>>>(static_cast<T*>(out), n, key,
                                                                                       half_width);
    CUDA_CHECK_LAUNCH();
  };
  switch (t) {
    case DType::F32: return launch(float{});
    case DType::F64: return launch(double{});
    case DType::BF16: return launch(bf16{});
    case DType::F16: return launch(__half{});
    default: throw_dtype("fill_random_uniform", t);
  }
}

}  // namespace spindle::cuda
