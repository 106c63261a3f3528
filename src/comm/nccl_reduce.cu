#include "comm/nccl_reduce.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"

namespace spindle::comm {
namespace {

// Accumulator type and conversions per storage type: halves widen to float.
template <typename T> struct Acc { using type = T; };
template <> struct Acc<__nv_bfloat16> { using type = float; };
template <> struct Acc<__half> { using type = float; };

template <typename T> __device__ __forceinline__ typename Acc<T>::type widen(T v) { return v; }
template <> __device__ __forceinline__ float widen<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> __device__ __forceinline__ float widen<__half>(__half v) { return __half2float(v); }

template <typename T> __device__ __forceinline__ T narrow(typename Acc<T>::type v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 narrow<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ __half narrow<__half>(float v) { return __float2half_rn(v); }

template <typename T>
__global__ void sum_blocks_kernel(const T* __restrict__ blocks, int count, int64_t elements, T* __restrict__ out) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < elements; i += stride) {
    typename Acc<T>::type acc = widen(blocks[i]);
    for (int j = 1; j < count; ++j) acc += widen(blocks[static_cast<int64_t>(j) * elements + i]);
    out[i] = narrow<T>(acc);
  }
}

template <typename T>
void launch(cudaStream_t stream, const void* blocks, int count, int64_t elements, void* out) {
  constexpr int threads = 256;
  // Enough blocks to fill the GPU several times over; the grid-stride loop covers the rest.
  const int64_t wanted = (elements + threads - 1) / threads;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, 132 * 16)));
  sum_blocks_kernel<T><<<grid, threads, 0, stream>>>(static_cast<const T*>(blocks), count, elements,
                                                     static_cast<T*>(out));
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void sum_blocks_in_rank_order_on_device(cudaStream_t stream, DType dtype, const void* blocks, int count,
                                        int64_t elements, void* out) {
  if (elements == 0) return;
  switch (dtype) {
    case DType::F32: return launch<float>(stream, blocks, count, elements, out);
    case DType::F64: return launch<double>(stream, blocks, count, elements, out);
    case DType::I32: return launch<int32_t>(stream, blocks, count, elements, out);
    case DType::I64: return launch<int64_t>(stream, blocks, count, elements, out);
    case DType::BF16: return launch<__nv_bfloat16>(stream, blocks, count, elements, out);
    case DType::F16: return launch<__half>(stream, blocks, count, elements, out);
    default:
      cuda::throw_message("sum reduction", "supported dtypes are F32, F64, BF16, F16, I32 and I64");
  }
}

}  // namespace spindle::comm
