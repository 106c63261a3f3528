// RMSNorm forward and backward, f32 arithmetic. Forward: one block per row. Backward: each block
// takes a fixed slice of rows (dx for them, and a partial dw in shared memory), then a second
// kernel sums the partial dw rows in a fixed order (deterministic).
#include <algorithm>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

constexpr int kThreads = 256;

// x, y [rows, c]; w [c]; rstd f32 [rows]
template <typename T>
__global__ void rmsnorm_forward_kernel(const T* x, const T* w, T* y, float* rstd, int64_t c, float eps) {
  __shared__ float shared[32];
  const T* xr = x + blockIdx.x * c;
  T* yr = y + blockIdx.x * c;
  float ss = 0;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    const float v = to_f32(xr[j]);
    ss = fmaf(v, v, ss);
  }
  ss = block_sum(ss, shared);
  // Saved and used at f32, like the reference, which rounds its statistic before using it.
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(c) + eps);
  if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) yr[j] = from_f32<T>(to_f32(xr[j]) * rs * to_f32(w[j]));
}

// Rows [blockIdx.x·rows_per_block, ...). dw_partial f32 [gridDim.x, c]; dynamic shared f32 [c].
template <typename T>
__global__ void rmsnorm_backward_kernel(const T* x, const T* w, const float* rstd, const T* dy, T* dx,
                                        float* dw_partial, int64_t rows, int64_t c, int64_t rows_per_block,
                                        bool accumulate_dx) {
  extern __shared__ float dw_acc[];
  __shared__ float shared[32];
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) dw_acc[j] = 0.f;
  const int64_t r0 = blockIdx.x * rows_per_block, r1 = min(rows, r0 + rows_per_block);
  const float inv_c = 1.0f / static_cast<float>(c);
  for (int64_t r = r0; r < r1; ++r) {
    const T* xr = x + r * c;
    const T* gr = dy + r * c;
    T* dxr = dx + r * c;
    const float rs = rstd[r];
    float dot = 0;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      const float xv = to_f32(xr[j]), gv = to_f32(gr[j]);
      dot = fmaf(gv * to_f32(w[j]), xv, dot);
      dw_acc[j] = fmaf(gv * xv, rs, dw_acc[j]);  // each thread owns its columns: no race
    }
    dot = block_sum(dot, shared);
    // y = x·r·w, r = (mean x² + eps)^-½  =>  dx = r·(g∘w) − x·r³·mean(x∘g∘w)
    const float coef = dot * rs * rs * rs * inv_c;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      float v = rs * to_f32(gr[j]) * to_f32(w[j]) - to_f32(xr[j]) * coef;
      if (accumulate_dx) v += to_f32(dxr[j]);
      dxr[j] = from_f32<T>(v);
    }
  }
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) dw_partial[blockIdx.x * c + j] = dw_acc[j];
}

template <typename T>
__global__ void rmsnorm_dw_finish(const float* dw_partial, int blocks, int64_t c, T* dw) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= c) return;
  float s = 0;
  for (int b = 0; b < blocks; ++b) s += dw_partial[b * c + j];
  dw[j] = from_f32<T>(to_f32(dw[j]) + s);
}

}  // namespace

void rmsnorm_forward(cudaStream_t s, const void* x, const void* w, void* y, float* rstd, DType t, int64_t rows,
                     int64_t c, float eps) {
  if (rows == 0) return;
  if (rows > 0x7fffffff) throw_message("rmsnorm_forward", "more than 2^31 rows");
  dispatch_compute(t, "rmsnorm_forward", [&](auto z) {
    using T = decltype(z);
    rmsnorm_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd, c, eps);
    CUDA_CHECK_LAUNCH();
  });
}

void rmsnorm_backward(cudaStream_t s, const void* x, const void* w, const float* rstd, const void* dy, void* dx,
                      void* dw, DType t, int64_t rows, int64_t c, bool accumulate_dx) {
  if (c == 0) return;
  // A fixed split (depends on the shape only) keeps dw reproducible run to run.
  const int64_t blocks = rows == 0 ? 1 : std::min<int64_t>(rows, 132 * 4);
  const int64_t rows_per_block = rows == 0 ? 1 : (rows + blocks - 1) / blocks;
  const size_t smem = static_cast<size_t>(c) * sizeof(float);
  Scratch partial(s, static_cast<size_t>(blocks) * c * sizeof(float));
  dispatch_compute(t, "rmsnorm_backward", [&](auto z) {
    using T = decltype(z);
    auto kernel = rmsnorm_backward_kernel<T>;
    if (smem > 48 * 1024)
      CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
    kernel<<<static_cast<unsigned>(blocks), kThreads, smem, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(w), rstd, static_cast<const T*>(dy), static_cast<T*>(dx),
        partial.as<float>(), rows, c, rows_per_block, accumulate_dx);
    CUDA_CHECK_LAUNCH();
    rmsnorm_dw_finish<<<static_cast<unsigned>((c + 255) / 256), 256, 0, s>>>(partial.as<float>(),
                                                                             static_cast<int>(blocks), c,
                                                                             static_cast<T*>(dw));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
