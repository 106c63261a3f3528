// The small ops of gated attention and the gated DeltaNet (backend.h; the CPU reference is
// backend/cpu/gated_delta_ops.cpp): column copies, partial RoPE, the sigmoid output gate, L2 norm,
// the DeltaNet gates and the gated RMSNorm (the causal conv1d: deltanet_conv.cu). F32 arithmetic on
// F32 or BF16 storage; every sum over rows (a weight's gradient) is two-stage in a fixed order, so
// it is the same run to run.
#include <algorithm>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/gated_delta.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/weight_grad.cuh"

namespace spindle::cuda {

bool weight_is_bf16(DType wt, const char* op) {
  if (wt != DType::F32 && wt != DType::BF16) throw_dtype(op, wt);
  return wt == DType::BF16;
}

namespace {

// One thread per j (finish_partials, weight_grad.cuh).
__global__ void finish_partials_kernel(const float* partial, int64_t blocks, int64_t n, void* dst, bool bf16w) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= n) return;
  float sum = 0.f;
  for (int64_t b = 0; b < blocks; ++b) sum += partial[b * n + j];
  add_weight(dst, bf16w, j, sum);
}

}  // namespace

void finish_partials(cudaStream_t s, const float* partial, int64_t blocks, int64_t n, void* dst, bool bf16w) {
  if (n == 0) return;
  constexpr int threads = 256;
  finish_partials_kernel<<<static_cast<unsigned>((n + threads - 1) / threads), threads, 0, s>>>(partial, blocks, n,
                                                                                              dst, bf16w);
  CUDA_CHECK_LAUNCH();
}

namespace {

constexpr int kThreads = 256;

// ---- copy_columns ---------------------------------------------------------------------------------
template <typename E>
__global__ void copy_columns_kernel(const E* src, int64_t src_cols, int64_t src_col, E* dst, int64_t dst_cols,
                                    int64_t dst_col, int64_t rows, int64_t width) {
  const int64_t n = rows * width;
  for (int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = x / width, j = x % width;
    dst[r * dst_cols + dst_col + j] = src[r * src_cols + src_col + j];
  }
}

// The same in words V of 4, 8 or 16 bytes (every row start, column offset and width a whole number
// of them): src and dst point at the first copied word of row 0, strides and width in words; fewer
// than 2^32 words, so the row is a 32-bit division.
template <typename V>
__global__ void copy_column_words_kernel(const V* src, uint32_t src_stride, V* dst, uint32_t dst_stride,
                                         uint32_t width, uint32_t n) {
  for (uint32_t x = blockIdx.x * blockDim.x + threadIdx.x; x < n; x += gridDim.x * blockDim.x) {
    const uint32_t r = x / width, j = x - r * width;
    dst[static_cast<int64_t>(r) * dst_stride + j] = src[static_cast<int64_t>(r) * src_stride + j];
  }
}

// ---- partial RoPE ---------------------------------------------------------------------------------
// As rope.cu: the f32 angle, its cos and sin in double times the attention scale, the rotation in
// f32; dims ≥ rotary_dim are left alone.
template <typename T>
__global__ void rope_partial_kernel(T* x, int64_t tokens, int64_t heads, int64_t d, int64_t half, const int32_t* pos,
                                    const float* inv_freq, double attention_scale, int sign) {
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= tokens * half) return;
  const int64_t t = item / half, i = item % half;
  const float angle = __fmul_rn(static_cast<float>(pos[t]), inv_freq[i]);
  double sn, cs;
  sincos(static_cast<double>(angle), &sn, &cs);
  const float c = static_cast<float>(cs * attention_scale), s = static_cast<float>(sn * attention_scale * sign);
  T* row = x + t * heads * d;
  for (int64_t h = 0; h < heads; ++h, row += d) {
    const float a = to_f32(row[i]), b = to_f32(row[i + half]);
    row[i] = from_f32<T>(a * c - b * s);
    row[i + half] = from_f32<T>(b * c + a * s);
  }
}

// ---- sigmoid gate ---------------------------------------------------------------------------------
struct SigmoidGateForward {
  __device__ void operator()(const float (&in)[2], float (&o)[1]) const { o[0] = in[0] * sigmoidf(in[1]); }
};
struct SigmoidGateBackward {  // in: x, gate, dout; out: dx, dgate
  __device__ void operator()(const float (&in)[3], float (&o)[2]) const {
    const float s = sigmoidf(in[1]);
    o[0] = in[2] * s;
    o[1] = in[2] * in[0] * s * (1.0f - s);
  }
};

// ---- L2 norm ----------------------------------------------------------------------------------------
// One warp per row.
template <typename T>
__global__ void l2norm_forward_kernel(const T* x, T* y, float* rstd, int64_t rows, int64_t c, float eps) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const T* xr = x + r * c;
  float ss = 0.f;
  for (int64_t j = lane; j < c; j += 32) {
    const float v = to_f32(xr[j]);
    ss = fmaf(v, v, ss);
  }
  ss = warp_sum(ss);
  const float rs = 1.0f / sqrtf(ss + eps);  // saved and used at f32, like the reference
  if (lane == 0) rstd[r] = rs;
  for (int64_t j = lane; j < c; j += 32) y[r * c + j] = from_f32<T>(to_f32(xr[j]) * rs);
}

template <typename T>
__global__ void l2norm_backward_kernel(const T* y, const float* rstd, const T* dy, T* dx, int64_t rows, int64_t c) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const T* yr = y + r * c;
  const T* gr = dy + r * c;
  float yd = 0.f;
  for (int64_t j = lane; j < c; j += 32) yd = fmaf(to_f32(yr[j]), to_f32(gr[j]), yd);
  yd = warp_sum(yd);
  const float rs = rstd[r];
  for (int64_t j = lane; j < c; j += 32) dx[r * c + j] = from_f32<T>(rs * (to_f32(gr[j]) - to_f32(yr[j]) * yd));
}

// ---- DeltaNet gates ---------------------------------------------------------------------------------
// torch's softplus with its default threshold, as transformers computes g.
__device__ __forceinline__ float softplusf(float x) { return x > 20.f ? x : log1pf(expf(x)); }
__device__ __forceinline__ float softplus_grad(float x) { return x > 20.f ? 1.f : sigmoidf(x); }

template <typename T>
__global__ void gates_forward_kernel(const T* a, const T* b, const void* a_log, const void* dt_bias, bool bf16w,
                                     float* g, T* beta, int64_t tokens, int64_t heads) {
  const int64_t n = tokens * heads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t h = i % heads;
    g[i] = -expf(load_weight(a_log, bf16w, h)) * softplusf(to_f32(a[i]) + load_weight(dt_bias, bf16w, h));
    beta[i] = from_f32<T>(sigmoidf(to_f32(b[i])));
  }
}

template <typename T>
__device__ __forceinline__ float gates_da(const T* a, const void* a_log, const void* dt_bias, bool bf16w,
                                          const float* dg, int64_t i, int64_t h) {
  return dg[i] * -expf(load_weight(a_log, bf16w, h)) * softplus_grad(to_f32(a[i]) + load_weight(dt_bias, bf16w, h));
}

template <typename T>
__global__ void gates_backward_kernel(const T* a, const T* beta, const void* a_log, const void* dt_bias, bool bf16w,
                                      const float* dg, const T* dbeta, T* da, T* db, int64_t tokens, int64_t heads) {
  const int64_t n = tokens * heads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t h = i % heads;
    da[i] = from_f32<T>(gates_da(a, a_log, dt_bias, bf16w, dg, i, h));
    const float bt = to_f32(beta[i]);
    db[i] = from_f32<T>(to_f32(dbeta[i]) * bt * (1.f - bt));
  }
}

// One block per head: dA_log[h] += Σ_t dg·g, ddt_bias[h] += Σ_t da (a fixed-order block sum).
template <typename T>
__global__ void gates_weight_grad_kernel(const T* a, const void* a_log, const void* dt_bias, bool bf16w,
                                         const float* g, const float* dg, void* da_log, void* ddt_bias, int64_t tokens,
                                         int64_t heads) {
  __shared__ float shared[32];
  const int64_t h = blockIdx.x;
  float s_log = 0.f, s_bias = 0.f;
  for (int64_t t = threadIdx.x; t < tokens; t += blockDim.x) {
    const int64_t i = t * heads + h;
    s_log = fmaf(dg[i], g[i], s_log);
    s_bias += gates_da(a, a_log, dt_bias, bf16w, dg, i, h);
  }
  s_log = block_sum(s_log, shared);
  s_bias = block_sum(s_bias, shared);
  if (threadIdx.x == 0) {
    if (da_log) add_weight(da_log, bf16w, h, s_log);
    if (ddt_bias) add_weight(ddt_bias, bf16w, h, s_bias);
  }
}

// ---- gated RMSNorm ----------------------------------------------------------------------------------
// One warp per row: y = x·rstd·w·silu(z), rstd = (mean x² + eps)^-½.
template <typename T>
__global__ void gated_rmsnorm_forward_kernel(const T* x, const T* z, const void* w, bool bf16w, T* y, float* rstd,
                                             int64_t rows, int64_t c, float eps) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const T* xr = x + r * c;
  float ss = 0.f;
  for (int64_t j = lane; j < c; j += 32) {
    const float v = to_f32(xr[j]);
    ss = fmaf(v, v, ss);
  }
  ss = warp_sum(ss);
  const float rs = 1.0f / sqrtf(ss / static_cast<float>(c) + eps);
  if (lane == 0) rstd[r] = rs;
  for (int64_t j = lane; j < c; j += 32) {
    const float zv = to_f32(z[r * c + j]);
    y[r * c + j] = from_f32<T>(to_f32(xr[j]) * rs * load_weight(w, bf16w, j) * zv * sigmoidf(zv));
  }
}

// dn = dy·w·silu(z), dx = rstd·(dn − n·mean(n·dn)) with n = x·rstd, dz = dy·w·n·silu'(z).
template <typename T>
__global__ void gated_rmsnorm_backward_kernel(const T* x, const T* z, const void* w, bool bf16w, const float* rstd,
                                              const T* dy, T* dx, T* dz, int64_t rows, int64_t c) {
  const int64_t r = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (r >= rows) return;
  const float rs = rstd[r];
  float mean = 0.f;
  for (int64_t j = lane; j < c; j += 32) {
    const int64_t i = r * c + j;
    const float zv = to_f32(z[i]), n = to_f32(x[i]) * rs;
    mean = fmaf(n, to_f32(dy[i]) * load_weight(w, bf16w, j) * zv * sigmoidf(zv), mean);
  }
  mean = warp_sum(mean) / static_cast<float>(c);
  for (int64_t j = lane; j < c; j += 32) {
    const int64_t i = r * c + j;
    const float zv = to_f32(z[i]), xv = to_f32(x[i]), n = xv * rs, gw = to_f32(dy[i]) * load_weight(w, bf16w, j);
    dx[i] = from_f32<T>(rs * (gw * zv * sigmoidf(zv) - n * mean));
    dz[i] = from_f32<T>(gw * n * silu_grad(zv));
  }
}

// partial [row blocks, c]: Σ over the block's rows of dy·n·silu(z), one thread per column.
template <typename T>
__global__ void gated_rmsnorm_dw_kernel(const T* x, const T* z, const float* rstd, const T* dy, float* partial,
                                        int64_t rows, int64_t c, int64_t rows_per_block) {
  const int64_t j = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (j >= c) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_block, r1 = min(rows, r0 + rows_per_block);
  float sum = 0.f;
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r * c + j;
    const float zv = to_f32(z[i]);
    sum = fmaf(to_f32(dy[i]) * to_f32(x[i]) * rstd[r], zv * sigmoidf(zv), sum);
  }
  partial[blockIdx.y * c + j] = sum;
}

unsigned warp_rows_grid(int64_t rows) { return static_cast<unsigned>((rows * 32 + kThreads - 1) / kThreads); }

}  // namespace

void copy_columns(cudaStream_t s, const void* src, int64_t src_cols, int64_t src_col, void* dst, int64_t dst_cols,
                  int64_t dst_col, int64_t rows, int64_t width, size_t elem_bytes) {
  const int64_t n = rows * width;
  if (n == 0) return;
  // The widest word that divides every byte offset and count: 16-byte loads and stores reach the
  // bandwidth, single 2-byte elements with a 64-bit division each do not.
  const char* from = static_cast<const char*>(src) + src_col * static_cast<int64_t>(elem_bytes);
  char* to = static_cast<char*>(dst) + dst_col * static_cast<int64_t>(elem_bytes);
  const int64_t src_row = src_cols * static_cast<int64_t>(elem_bytes), dst_row = dst_cols * static_cast<int64_t>(elem_bytes),
                row_bytes = width * static_cast<int64_t>(elem_bytes);
  const uint64_t all = static_cast<uint64_t>(src_row | dst_row | row_bytes) | reinterpret_cast<uintptr_t>(from) |
                       reinterpret_cast<uintptr_t>(to);
  for (int64_t word : {16, 8, 4}) {
    if (all % static_cast<uint64_t>(word) != 0 || static_cast<uint64_t>(rows) * (row_bytes / word) >= (uint64_t{1} << 32) ||
        src_row / word >= (int64_t{1} << 32) || dst_row / word >= (int64_t{1} << 32))
      continue;
    const uint32_t words = static_cast<uint32_t>(rows * (row_bytes / word));
    auto run = [&](auto v) {
      using V = decltype(v);
      copy_column_words_kernel<<<grid_for(words, kThreads), kThreads, 0, s>>>(
          reinterpret_cast<const V*>(from), static_cast<uint32_t>(src_row / word), reinterpret_cast<V*>(to),
          static_cast<uint32_t>(dst_row / word), static_cast<uint32_t>(row_bytes / word), words);
    };
    if (word == 16) run(uint4{});
    if (word == 8) run(uint2{});
    if (word == 4) run(uint32_t{});
    CUDA_CHECK_LAUNCH();
    return;
  }
  const unsigned grid = grid_for(n, kThreads);
  auto run = [&](auto e) {
    using E = decltype(e);
    copy_columns_kernel<<<grid, kThreads, 0, s>>>(static_cast<const E*>(src), src_cols, src_col, static_cast<E*>(dst),
                                                  dst_cols, dst_col, rows, width);
  };
  switch (elem_bytes) {
    case 1: run(uint8_t{}); break;
    case 2: run(uint16_t{}); break;
    case 4: run(uint32_t{}); break;
    case 8: run(uint64_t{}); break;
    default: throw_message("copy_columns", "elements must be 1, 2, 4 or 8 bytes");
  }
  CUDA_CHECK_LAUNCH();
}

void rope_partial(cudaStream_t s, void* x, DType io, int64_t tokens, int64_t heads, int64_t d, int64_t rotary_dim,
                  const int32_t* pos, const float* inv_freq, double attention_scale, int sign) {
  const int64_t half = rotary_dim / 2, items = tokens * half;
  if (items == 0) return;
  dispatch_compute(io, "rope_partial", [&](auto z) {
    using T = decltype(z);
    rope_partial_kernel<<<static_cast<unsigned>((items + kThreads - 1) / kThreads), kThreads, 0, s>>>(
        static_cast<T*>(x), tokens, heads, d, half, pos, inv_freq, attention_scale, sign);
    CUDA_CHECK_LAUNCH();
  });
}

void sigmoid_gate_forward(cudaStream_t s, const void* x, const void* gate, void* out, DType io, int64_t n) {
  dispatch_compute(io, "sigmoid_gate_forward", [&](auto z) {
    using T = decltype(z);
    launch_elementwise<T, 2, 1>(s, {{static_cast<const T*>(x), static_cast<const T*>(gate)}}, {{static_cast<T*>(out)}},
                                n, SigmoidGateForward{});
  });
}

void sigmoid_gate_backward(cudaStream_t s, const void* x, const void* gate, const void* dout, void* dx, void* dgate,
                           DType io, int64_t n) {
  dispatch_compute(io, "sigmoid_gate_backward", [&](auto z) {
    using T = decltype(z);
    launch_elementwise<T, 3, 2>(s, {{static_cast<const T*>(x), static_cast<const T*>(gate), static_cast<const T*>(dout)}},
                                {{static_cast<T*>(dx), static_cast<T*>(dgate)}}, n, SigmoidGateBackward{});
  });
}

void l2norm_forward(cudaStream_t s, const void* x, void* y, float* rstd, DType io, int64_t rows, int64_t c, float eps) {
  if (rows == 0) return;
  dispatch_compute(io, "l2norm_forward", [&](auto z) {
    using T = decltype(z);
    l2norm_forward_kernel<<<warp_rows_grid(rows), kThreads, 0, s>>>(static_cast<const T*>(x), static_cast<T*>(y), rstd,
                                                                   rows, c, eps);
    CUDA_CHECK_LAUNCH();
  });
}

void l2norm_backward(cudaStream_t s, const void* y, const float* rstd, const void* dy, void* dx, DType io,
                     int64_t rows, int64_t c) {
  if (rows == 0) return;
  dispatch_compute(io, "l2norm_backward", [&](auto z) {
    using T = decltype(z);
    l2norm_backward_kernel<<<warp_rows_grid(rows), kThreads, 0, s>>>(
        static_cast<const T*>(y), rstd, static_cast<const T*>(dy), static_cast<T*>(dx), rows, c);
    CUDA_CHECK_LAUNCH();
  });
}

void gated_delta_gates_forward(cudaStream_t s, const void* a, const void* b, const void* a_log, const void* dt_bias,
                               DType wt, float* g, void* beta, DType io, int64_t tokens, int64_t heads) {
  const bool bf16w = weight_is_bf16(wt, "gated_delta_gates_forward");
  if (tokens * heads == 0) return;
  dispatch_compute(io, "gated_delta_gates_forward", [&](auto z) {
    using T = decltype(z);
    gates_forward_kernel<<<grid_for(tokens * heads, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(a), static_cast<const T*>(b), a_log, dt_bias, bf16w, g, static_cast<T*>(beta), tokens,
        heads);
    CUDA_CHECK_LAUNCH();
  });
}

void gated_delta_gates_backward(cudaStream_t s, const void* a, const void* beta, const void* a_log,
                                const void* dt_bias, DType wt, const float* g, const float* dg, const void* dbeta,
                                void* da, void* db, void* da_log, void* ddt_bias, DType io, int64_t tokens,
                                int64_t heads) {
  const bool bf16w = weight_is_bf16(wt, "gated_delta_gates_backward");
  if (tokens * heads == 0) return;
  dispatch_compute(io, "gated_delta_gates_backward", [&](auto z) {
    using T = decltype(z);
    gates_backward_kernel<<<grid_for(tokens * heads, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(a), static_cast<const T*>(beta), a_log, dt_bias, bf16w, dg,
        static_cast<const T*>(dbeta), static_cast<T*>(da), static_cast<T*>(db), tokens, heads);
    CUDA_CHECK_LAUNCH();
    if (da_log || ddt_bias) {
      gates_weight_grad_kernel<<<static_cast<unsigned>(heads), kThreads, 0, s>>>(
          static_cast<const T*>(a), a_log, dt_bias, bf16w, g, dg, da_log, ddt_bias, tokens, heads);
      CUDA_CHECK_LAUNCH();
    }
  });
}

void gated_rmsnorm_forward(cudaStream_t s, const void* x, const void* z, const void* w, DType wt, void* y,
                           float* rstd, DType io, int64_t rows, int64_t c, float eps) {
  const bool bf16w = weight_is_bf16(wt, "gated_rmsnorm_forward");
  if (rows == 0) return;
  dispatch_compute(io, "gated_rmsnorm_forward", [&](auto v) {
    using T = decltype(v);
    gated_rmsnorm_forward_kernel<<<warp_rows_grid(rows), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(z), w, bf16w, static_cast<T*>(y), rstd, rows, c, eps);
    CUDA_CHECK_LAUNCH();
  });
}

void gated_rmsnorm_backward(cudaStream_t s, const void* x, const void* z, const void* w, DType wt, const float* rstd,
                            const void* dy, void* dx, void* dz, void* dw, DType io, int64_t rows, int64_t c) {
  const bool bf16w = weight_is_bf16(wt, "gated_rmsnorm_backward");
  if (rows == 0 || c == 0) return;
  constexpr int64_t kRowsPerBlock = 256;
  const int64_t row_blocks = (rows + kRowsPerBlock - 1) / kRowsPerBlock;
  if (dw && row_blocks > 65535) throw_message("gated_rmsnorm_backward", "more than 16M rows");
  Scratch partial(s, dw ? sizeof(float) * row_blocks * c : 0);
  dispatch_compute(io, "gated_rmsnorm_backward", [&](auto v) {
    using T = decltype(v);
    gated_rmsnorm_backward_kernel<<<warp_rows_grid(rows), kThreads, 0, s>>>(
        static_cast<const T*>(x), static_cast<const T*>(z), w, bf16w, rstd, static_cast<const T*>(dy),
        static_cast<T*>(dx), static_cast<T*>(dz), rows, c);
    CUDA_CHECK_LAUNCH();
    if (!dw) return;
    const dim3 grid(static_cast<unsigned>((c + 127) / 128), static_cast<unsigned>(row_blocks));
    gated_rmsnorm_dw_kernel<<<grid, 128, 0, s>>>(static_cast<const T*>(x), static_cast<const T*>(z), rstd,
                                                 static_cast<const T*>(dy), partial.as<float>(), rows, c,
                                                 kRowsPerBlock);
    CUDA_CHECK_LAUNCH();
  });
  if (dw) finish_partials(s, partial.as<float>(), row_blocks, c, dw, bf16w);
}

}  // namespace spindle::cuda
