// RMSNorm forward and backward, f32 arithmetic. Rows whose length is a multiple of the 16-byte
// vector take one warp each with vector loads; other rows one block each with scalar loads (the
// block-per-row form reached 1.0-1.3 TB/s on an H200 at hidden 1536, the warp form is
// bandwidth-bound). Backward: each block takes a fixed slice of rows (dx for them, and a partial
// dw in shared memory), then a second kernel sums the partial dw rows in a fixed order, so dw is
// the same run to run.
#include <algorithm>
#include <initializer_list>

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

// One warp per row; c a multiple of kVecWidth<T>, rows 16-byte aligned.
template <typename T>
__global__ void rmsnorm_forward_vec_kernel(const T* x, const T* w, T* y, float* rstd, int64_t rows, int64_t c,
                                           float eps) {
  constexpr int V = kVecWidth<T>;
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const T* xr = x + r * c;
  T* yr = y + r * c;
  const int64_t nv = c / V;
  float ss = 0;
#pragma unroll 4
  for (int64_t j = lane; j < nv; j += 32) {
    float a[V];
    load_vec(xr + j * V, a);
#pragma unroll
    for (int i = 0; i < V; ++i) ss = fmaf(a[i], a[i], ss);
  }
  ss = warp_sum(ss);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(c) + eps);
  if (lane == 0) rstd[r] = rs;
#pragma unroll 4
  for (int64_t j = lane; j < nv; j += 32) {
    float a[V], b[V];
    load_vec(xr + j * V, a);
    load_vec(w + j * V, b);
#pragma unroll
    for (int i = 0; i < V; ++i) a[i] = a[i] * rs * b[i];
    store_vec(yr + j * V, a);
  }
}

constexpr int kVecBackwardWarps = 4;

// Rows [blockIdx.x·rows_per_block, ...), warp k of the block taking every kVecBackwardWarps-th;
// each warp sums its rows' dw terms in its own shared row (dynamic shared f32
// [kVecBackwardWarps, c]), which the block adds up in a fixed order into dw_partial [gridDim.x, c].
// Without kDw (a frozen weight) no dw term is formed and no shared memory is used.
template <typename T, bool kDw>
__global__ void rmsnorm_backward_vec_kernel(const T* x, const T* w, const float* rstd, const T* dy, T* dx,
                                            float* dw_partial, int64_t rows, int64_t c, int64_t rows_per_block,
                                            bool accumulate_dx) {
  constexpr int V = kVecWidth<T>;
  extern __shared__ float dw_acc[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t nv = c / V;
  float* mine = dw_acc + warp * c;
  if constexpr (kDw)
    for (int64_t j = lane; j < c; j += 32) mine[j] = 0.f;
  const int64_t r0 = blockIdx.x * rows_per_block, r1 = min(rows, r0 + rows_per_block);
  const float inv_c = 1.0f / static_cast<float>(c);
  for (int64_t r = r0 + warp; r < r1; r += kVecBackwardWarps) {
    const T* xr = x + r * c;
    const T* gr = dy + r * c;
    T* dxr = dx + r * c;
    const float rs = rstd[r];
    float dot = 0;
#pragma unroll 2
    for (int64_t j = lane; j < nv; j += 32) {
      float xv[V], gv[V], wv[V];
      load_vec(xr + j * V, xv);
      load_vec(gr + j * V, gv);
      load_vec(w + j * V, wv);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        dot = fmaf(gv[i] * wv[i], xv[i], dot);
        if constexpr (kDw) mine[j * V + i] = fmaf(gv[i] * xv[i], rs, mine[j * V + i]);  // this lane's columns only
      }
    }
    dot = warp_sum(dot);
    // y = x·r·w, r = (mean x² + eps)^-½  =>  dx = r·(g∘w) − x·r³·mean(x∘g∘w)
    const float coef = dot * rs * rs * rs * inv_c;
#pragma unroll 2
    for (int64_t j = lane; j < nv; j += 32) {
      float xv[V], gv[V], wv[V], out[V];
      load_vec(xr + j * V, xv);
      load_vec(gr + j * V, gv);
      load_vec(w + j * V, wv);
      if (accumulate_dx) load_vec(dxr + j * V, out);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        const float v = rs * gv[i] * wv[i] - xv[i] * coef;
        out[i] = accumulate_dx ? out[i] + v : v;
      }
      store_vec(dxr + j * V, out);
    }
  }
  if constexpr (!kDw) return;
  __syncthreads();
  for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int k = 0; k < kVecBackwardWarps; ++k) sum += dw_acc[k * c + j];
    dw_partial[blockIdx.x * c + j] = sum;
  }
}

// Rows [blockIdx.x·rows_per_block, ...). dw_partial f32 [gridDim.x, c] (null: no dw); dynamic
// shared f32 [c].
template <typename T>
__global__ void rmsnorm_backward_kernel(const T* x, const T* w, const float* rstd, const T* dy, T* dx,
                                        float* dw_partial, int64_t rows, int64_t c, int64_t rows_per_block,
                                        bool accumulate_dx) {
  extern __shared__ float dw_acc[];
  __shared__ float shared[32];
  if (dw_partial)
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
      if (dw_partial) dw_acc[j] = fmaf(gv * xv, rs, dw_acc[j]);  // each thread owns its columns: no race
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
  if (dw_partial)
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) dw_partial[blockIdx.x * c + j] = dw_acc[j];
}

// dw += Σ_b dw_partial[b]: a block of 8 warps per 32 columns; warp k adds the partial rows k, k + 8,
// ... and the block adds the 8 sums, both in a fixed order.
template <typename T>
__global__ void rmsnorm_dw_finish(const float* dw_partial, int blocks, int64_t c, T* dw) {
  __shared__ float sums[8][33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t j = static_cast<int64_t>(blockIdx.x) * 32 + lane;
  float s = 0;
  if (j < c)
    for (int b = warp; b < blocks; b += 8) s += dw_partial[b * c + j];
  sums[warp][lane] = s;
  __syncthreads();
  if (warp == 0 && j < c) {
    float total = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) total += sums[k][lane];
    dw[j] = from_f32<T>(to_f32(dw[j]) + total);
  }
}

// Whether rows of c elements can go through the vector kernels: c a multiple of the vector width
// and every base pointer 16-byte aligned (then every row is).
template <typename T>
bool vector_rows(int64_t c, std::initializer_list<const void*> pointers) {
  if (c % kVecWidth<T> != 0) return false;
  for (const void* p : pointers)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

}  // namespace

void rmsnorm_forward(cudaStream_t s, const void* x, const void* w, void* y, float* rstd, DType t, int64_t rows,
                     int64_t c, float eps) {
  if (rows == 0) return;
  if (rows > 0x7fffffff) throw_message("rmsnorm_forward", "more than 2^31 rows");
  dispatch_compute(t, "rmsnorm_forward", [&](auto z) {
    using T = decltype(z);
    if (vector_rows<T>(c, {x, w, y})) {
      const int64_t warps_per_block = kThreads / 32;
      rmsnorm_forward_vec_kernel<<<static_cast<unsigned>((rows + warps_per_block - 1) / warps_per_block), kThreads, 0,
                                   s>>>(static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd,
                                        rows, c, eps);
    } else {
      rmsnorm_forward_kernel<<<static_cast<unsigned>(rows), kThreads, 0, s>>>(
          static_cast<const T*>(x), static_cast<const T*>(w), static_cast<T*>(y), rstd, c, eps);
    }
    CUDA_CHECK_LAUNCH();
  });
}

void rmsnorm_backward(cudaStream_t s, const void* x, const void* w, const float* rstd, const void* dy, void* dx,
                      void* dw, DType t, int64_t rows, int64_t c, bool accumulate_dx) {
  if (c == 0) return;
  // A fixed split (depends on the shape only) keeps dw reproducible run to run.
  // Without dw nothing is summed over rows: a warp per two rows, as many blocks as that takes.
  const int64_t blocks = rows == 0 ? 1
                         : dw      ? std::min<int64_t>(rows, 132 * 4)
                                   : (rows + 2 * kVecBackwardWarps - 1) / (2 * kVecBackwardWarps);
  const int64_t rows_per_block = rows == 0 ? 1 : (rows + blocks - 1) / blocks;
  Scratch partial(s, dw ? static_cast<size_t>(blocks) * c * sizeof(float) : 0);
  float* dw_partial = dw ? partial.as<float>() : nullptr;
  dispatch_compute(t, "rmsnorm_backward", [&](auto z) {
    using T = decltype(z);
    const size_t vec_smem = static_cast<size_t>(kVecBackwardWarps) * c * sizeof(float);
    if (vector_rows<T>(c, {x, w, dy, dx}) && vec_smem <= 200 * 1024) {
      auto kernel = dw ? rmsnorm_backward_vec_kernel<T, true> : rmsnorm_backward_vec_kernel<T, false>;
      const size_t smem = dw ? vec_smem : 0;
      if (smem > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      kernel<<<static_cast<unsigned>(blocks), 32 * kVecBackwardWarps, smem, s>>>(
          static_cast<const T*>(x), static_cast<const T*>(w), rstd, static_cast<const T*>(dy), static_cast<T*>(dx),
          dw_partial, rows, c, rows_per_block, accumulate_dx);
    } else {
      const size_t smem = dw ? static_cast<size_t>(c) * sizeof(float) : 0;
      auto kernel = rmsnorm_backward_kernel<T>;
      if (smem > 48 * 1024)
        CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      kernel<<<static_cast<unsigned>(blocks), kThreads, smem, s>>>(
          static_cast<const T*>(x), static_cast<const T*>(w), rstd, static_cast<const T*>(dy), static_cast<T*>(dx),
          dw_partial, rows, c, rows_per_block, accumulate_dx);
    }
    CUDA_CHECK_LAUNCH();
    if (!dw) return;
    rmsnorm_dw_finish<<<static_cast<unsigned>((c + 31) / 32), 256, 0, s>>>(partial.as<float>(),
                                                                             static_cast<int>(blocks), c,
                                                                             static_cast<T*>(dw));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
