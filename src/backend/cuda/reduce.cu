// Reductions: sum of squares (gradient norms) and bias gradients. Both run in two passes (per-block
// partials to scratch, then one fixed-order pass) so the result does not depend on scheduling.
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

constexpr int kSumBlocks = 1024;  // pass-1 blocks; pass 2 reduces this many partials
constexpr int kThreads = 256;

// partial[block] = Σ x² over a grid-stride share, accumulated in double: the squared norm of a
// billion-element gradient must not lose the small terms.
template <typename T>
__global__ void sum_squares_partial(const T* x, int64_t n, double* partial) {
  __shared__ double shared[32];
  double acc = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    const double v = to_f32(x[i]);
    acc += v * v;
  }
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) partial[blockIdx.x] = acc;
}

__global__ void sum_partials(const double* partial, int count, float* out) {
  __shared__ double shared[32];
  double acc = 0;
  for (int i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
  acc = block_sum(acc, shared);
  if (threadIdx.x == 0) out[0] = static_cast<float>(out[0] + acc);
}

// Block (32, 8) sums rows [chunk·rows_per_chunk, ...) of 32 columns; partial [chunks, n] f32.
template <typename T>
__global__ void bias_partial(const T* dy, int64_t rows, int64_t n, int64_t rows_per_chunk, float* partial) {
  __shared__ float shared[8][33];
  const int64_t col = static_cast<int64_t>(blockIdx.x) * 32 + threadIdx.x;
  const int64_t r0 = blockIdx.y * rows_per_chunk;
  const int64_t r1 = min(rows, r0 + rows_per_chunk);
  float acc = 0;
  if (col < n)
    for (int64_t r = r0 + threadIdx.y; r < r1; r += 8) acc += to_f32(dy[r * n + col]);
  shared[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && col < n) {
    float s = 0;
    for (int k = 0; k < 8; ++k) s += shared[k][threadIdx.x];
    partial[blockIdx.y * n + col] = s;
  }
}

template <typename T>
__global__ void bias_finish(const float* partial, int chunks, int64_t n, T* dbias) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (col >= n) return;
  float s = 0;
  for (int c = 0; c < chunks; ++c) s += partial[c * n + col];
  dbias[col] = from_f32<T>(to_f32(dbias[col]) + s);
}

}  // namespace

void sum_squares(cudaStream_t s, const void* x, DType t, int64_t n, float* out) {
  if (n == 0) return;
  const int blocks = static_cast<int>(grid_for(n, kThreads, kSumBlocks));
  Scratch partial(s, blocks * sizeof(double));
  dispatch_compute(t, "sum_squares", [&](auto z) {
    using T = decltype(z);
    sum_squares_partial<<<blocks, kThreads, 0, s>>>(static_cast<const T*>(x), n, partial.as<double>());
    CUDA_CHECK_LAUNCH();
  });
  sum_partials<<<1, 1024, 0, s>>>(partial.as<double>(), blocks, out);
  CUDA_CHECK_LAUNCH();
}

void bias_backward(cudaStream_t s, const void* dy, void* dbias, DType t, int64_t rows, int64_t n) {
  if (n == 0) return;
  const int64_t rows_per_chunk = 256;
  const int chunks = static_cast<int>(rows ? (rows + rows_per_chunk - 1) / rows_per_chunk : 1);
  Scratch partial(s, static_cast<size_t>(chunks) * n * sizeof(float));
  dispatch_compute(t, "bias_backward", [&](auto z) {
    using T = decltype(z);
    dim3 grid(static_cast<unsigned>((n + 31) / 32), static_cast<unsigned>(chunks));
    bias_partial<<<grid, dim3(32, 8), 0, s>>>(static_cast<const T*>(dy), rows, n, rows_per_chunk,
                                              partial.as<float>());
    CUDA_CHECK_LAUNCH();
    bias_finish<<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(partial.as<float>(), chunks, n,
                                                                       static_cast<T*>(dbias));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
