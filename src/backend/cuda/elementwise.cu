// Fill, dtype conversion, scale, axpy and bias add: memory-bound loops over contiguous tensors.
#include <cstring>

#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

// ---- fill: a bit pattern of the element's size, prepared on the host --------------------------
template <typename W>
__global__ void fill_kernel(W* p, int64_t n, W pattern) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) p[i] = pattern;
}

template <typename W>
void launch_fill(cudaStream_t s, void* p, int64_t n, W pattern) {
  fill_kernel<<<grid_for(n, 256), 256, 0, s>>>(static_cast<W*>(p), n, pattern);
  CUDA_CHECK_LAUNCH();
}

// ---- convert: through double, with the host's rounding (double -> f32 -> bf16/f16) ------------
template <typename T>
__device__ __forceinline__ double load_d(const T* p, int64_t i) { return static_cast<double>(p[i]); }
template <>
__device__ __forceinline__ double load_d<bf16>(const bf16* p, int64_t i) { return __bfloat162float(p[i]); }
template <>
__device__ __forceinline__ double load_d<__half>(const __half* p, int64_t i) { return __half2float(p[i]); }

template <typename T>
__device__ __forceinline__ void store_d(T* p, int64_t i, double v) { p[i] = static_cast<T>(v); }
template <>
__device__ __forceinline__ void store_d<bf16>(bf16* p, int64_t i, double v) {
  p[i] = __float2bfloat16_rn(static_cast<float>(v));
}
template <>
__device__ __forceinline__ void store_d<__half>(__half* p, int64_t i, double v) {
  p[i] = __float2half_rn(static_cast<float>(v));
}

template <typename S, typename D>
__global__ void convert_kernel(const S* src, D* dst, int64_t n) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    store_d(dst, i, load_d(src, i));
}

template <typename F>
void dispatch_any(DType t, const char* op, F&& f) {
  switch (t) {
    case DType::F32: f(float{}); break;
    case DType::F64: f(double{}); break;
    case DType::BF16: f(bf16{}); break;
    case DType::F16: f(__half{}); break;
    case DType::I32: f(int32_t{}); break;
    case DType::I64: f(int64_t{}); break;
    case DType::U8: f(uint8_t{}); break;
  }
  (void)op;
}

template <typename T>
__global__ void add_bias_kernel(T* y, const T* bias, int64_t rows, int64_t n) {
  const int64_t total = rows * n, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride)
    y[i] = from_f32<T>(to_f32(y[i]) + to_f32(bias[i % n]));
}

struct ScaleOp {
  float a;
  __device__ void operator()(const float (&in)[1], float (&out)[1]) const { out[0] = in[0] * a; }
};

struct AxpyOp {
  float a;
  __device__ void operator()(const float (&in)[2], float (&out)[1]) const { out[0] = fmaf(a, in[0], in[1]); }
};

}  // namespace

void fill(cudaStream_t s, void* p, DType t, int64_t n, double value) {
  if (n == 0) return;
  if (value == 0.0) {  // every dtype's zero is all-zero bits
    CUDA_CHECK(cudaMemsetAsync(p, 0, static_cast<size_t>(n) * dtype_size(t), s));
    return;
  }
  switch (t) {
    case DType::F32: {
      float f = static_cast<float>(value);
      uint32_t w;
      std::memcpy(&w, &f, 4);
      launch_fill<uint32_t>(s, p, n, w);
      break;
    }
    case DType::F64: {
      uint64_t w;
      std::memcpy(&w, &value, 8);
      launch_fill<uint64_t>(s, p, n, w);
      break;
    }
    case DType::BF16: launch_fill<uint16_t>(s, p, n, f32_to_bf16(static_cast<float>(value))); break;
    case DType::F16: launch_fill<uint16_t>(s, p, n, f32_to_f16(static_cast<float>(value))); break;
    case DType::I32: launch_fill<uint32_t>(s, p, n, static_cast<uint32_t>(static_cast<int32_t>(value))); break;
    case DType::I64: launch_fill<uint64_t>(s, p, n, static_cast<uint64_t>(static_cast<int64_t>(value))); break;
    case DType::U8: launch_fill<uint8_t>(s, p, n, static_cast<uint8_t>(value)); break;
  }
}

void convert(cudaStream_t s, const void* src, DType st, void* dst, DType dt, int64_t n) {
  if (n == 0) return;
  if (st == dt) {
    CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n) * dtype_size(st), cudaMemcpyDeviceToDevice, s));
    return;
  }
  dispatch_any(st, "copy", [&](auto a) {
    using S = decltype(a);
    dispatch_any(dt, "copy", [&](auto b) {
      using D = decltype(b);
      convert_kernel<<<grid_for(n, 256), 256, 0, s>>>(static_cast<const S*>(src), static_cast<D*>(dst), n);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void scale(cudaStream_t s, void* x, DType t, int64_t n, double alpha) {
  const float a = static_cast<float>(alpha);
  dispatch_compute(t, "scale", [&](auto z) {
    using T = decltype(z);
    launch_elementwise<T, 1, 1>(s, {{static_cast<const T*>(x)}}, {{static_cast<T*>(x)}}, n, ScaleOp{a});
  });
}

void axpy(cudaStream_t s, double alpha, const void* x, void* y, DType t, int64_t n) {
  const float a = static_cast<float>(alpha);
  dispatch_compute(t, "axpy", [&](auto z) {
    using T = decltype(z);
    launch_elementwise<T, 2, 1>(s, {{static_cast<const T*>(x), static_cast<const T*>(y)}}, {{static_cast<T*>(y)}}, n,
                                AxpyOp{a});
  });
}

void add_bias(cudaStream_t s, void* y, const void* bias, DType t, int64_t rows, int64_t n) {
  if (rows * n == 0) return;
  dispatch_compute(t, "add_bias", [&](auto z) {
    using T = decltype(z);
    add_bias_kernel<<<grid_for(rows * n, 256), 256, 0, s>>>(static_cast<T*>(y), static_cast<const T*>(bias), rows, n);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
