// The causal depthwise conv1d + SiLU of gated DeltaNet layers over packed documents (backend.h:
// causal_conv1d_silu_*, and deltanet_conv_split_*, which fuse the layer's split of the conv output
// into q, k, v and the L2 norms of q and k). F32 arithmetic on F32 or BF16 storage; the CPU reference
// is backend/cpu/gated_delta_ops.cpp (and deltanet_conv_ops.cpp for the split).
//
// The op is bound by memory: the forward reads x [T, C] and writes y [T, C], the backward reads x
// and dy and writes dx, plus dw [C, K] (a sum over T). The register-window kernels give each thread
// 4 adjacent channels over a run of tokens: a warp reads 128 channels of one token at a time (one
// 8-byte BF16 or 16-byte F32 load per thread, coalesced), the window of the last 4 tokens stays in
// registers, so each element comes from memory once (plus 3 tokens of halo per run, from L2). The
// window restarts at document boundaries by comparing the document ids of its taps, as the CPU
// reference's runs do. Every sum is in a fixed order (dw: per thread over its run, then over the
// runs of a block, then over the blocks in finish_partials), so results are the same run to run.
// Other shapes (widths above 4, channel counts not a multiple of 4) run the row-wise kernels.
#include <algorithm>

#include "backend/cuda/deltanet_conv_shape.h"
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/gated_delta.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/weight_grad.cuh"

namespace spindle::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxConvWidth = 16;

constexpr int kTaps = static_cast<int>(kConvWindowMaxWidth);  // the register window
constexpr int kVec = static_cast<int>(kConvWindowChannels);   // channels per thread
constexpr int kLanes = 32;                                     // blockDim.x: 128 channels per block
constexpr int kRuns = 8;                                       // blockDim.y: token runs per block
constexpr int kForwardRun = 16;                                // tokens per thread, forward
constexpr int kBackwardRun = static_cast<int>(kConvWindowBackwardRows) / kRuns;  // 32


// ---- the register-window kernels ---------------------------------------------------------------------
// 4 consecutive elements (8 bytes of BF16, 16 of F32; the address aligned to that).
__device__ __forceinline__ void load4(const float* p, float (&f)[kVec]) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(p));
  f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
}
__device__ __forceinline__ void load4(const bf16* p, float (&f)[kVec]) {
  const uint2 raw = __ldg(reinterpret_cast<const uint2*>(p));
  const bf16* e = reinterpret_cast<const bf16*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec; ++i) f[i] = __bfloat162float(e[i]);
}
__device__ __forceinline__ void store4(float* p, const float (&f)[kVec]) {
  *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
}
__device__ __forceinline__ void store4(bf16* p, const float (&f)[kVec]) {
  uint2 raw;
  bf16* e = reinterpret_cast<bf16*>(&raw);
#pragma unroll
  for (int i = 0; i < kVec; ++i) e[i] = __float2bfloat16_rn(f[i]);
  *reinterpret_cast<uint2*>(p) = raw;
}

// What storing v in T and reading it back gives.
template <typename T>
__device__ __forceinline__ float stored(float v) {
  return to_f32(from_f32<T>(v));
}

// Sum over the aligned groups of `lanes` lanes (a power of two ≤ 32); every lane of the warp calls it.
__device__ __forceinline__ float lanes_sum(float v, int lanes) {
  for (int o = lanes >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// w [C, width] as taps kTaps − width … kTaps − 1 of the window (the leading taps are never read).
__device__ __forceinline__ void load_taps(const void* w, bool bf16w, int64_t c, int width, bool active,
                                          float (&wv)[kVec][kTaps]) {
  const int first = kTaps - width;
#pragma unroll
  for (int v = 0; v < kVec; ++v)
#pragma unroll
    for (int j = 0; j < kTaps; ++j)
      wv[v][j] = active && j >= first ? load_weight(w, bf16w, (c + v) * width + (j - first)) : 0.f;
}

// Where the fused split puts conv output channel c: q or k (L2-normalised per head), or v.
template <typename T>
struct SplitOut {
  T* q;  // [T, key]
  T* k;  // [T, key]
  T* v;  // [T, value]
  float* q_rstd;  // [T·Hk]
  float* k_rstd;  // [T·Hk]
  int64_t key, value;
  int head_dim, head_lanes;  // head_lanes = head_dim / 4: a power of two ≤ 32
  float eps;
};

// The fused split's backward reads: q, k as normalised (the forward's outputs), their gradients, dv.
template <typename T>
struct SplitIn {
  const T* q;  // [T, key]
  const T* k;
  const T* dq;
  const T* dk;
  const T* dv;  // [T, value]
  const float* q_rstd;  // [T·Hk]
  const float* k_rstd;
  int64_t key, value;
  int head_dim, head_lanes;
};

// This thread's place in the split: column offset into its destination (q, k or v), that
// destination's row length, and for q and k the head's row of rstd.
struct SplitPlace {
  int part;  // 0 q, 1 k, 2 v
  int64_t col, row_len, head, heads;
};
__device__ __forceinline__ SplitPlace split_place(int64_t c, int64_t key, int64_t value, int head_dim) {
  SplitPlace p;
  if (c < key) {
    p = {0, c, key, c / head_dim, key / head_dim};
  } else if (c < 2 * key) {
    p = {1, c - key, key, (c - key) / head_dim, key / head_dim};
  } else {
    p = {2, c - 2 * key, value, 0, 0};
  }
  return p;
}

// pre[v] = Σ_j w[v][j]·x[t − 3 + j] over the taps of t's document (j ascending, as the row-wise
// kernels and the reference's order).
__device__ __forceinline__ void window_pre(const float (&wv)[kVec][kTaps], const float (&win)[kTaps][kVec],
                                           const int (&wdoc)[kTaps], int64_t t, int first_tap, float (&pre)[kVec]) {
#pragma unroll
  for (int v = 0; v < kVec; ++v) pre[v] = 0.f;
#pragma unroll
  for (int j = 0; j < kTaps; ++j) {
    if (j < first_tap || t - (kTaps - 1) + j < 0 || wdoc[j] != wdoc[kTaps - 1]) continue;
#pragma unroll
    for (int v = 0; v < kVec; ++v) pre[v] = fmaf(wv[v][j], win[j][v], pre[v]);
  }
}

// Forward: thread (lane, run) computes channels c … c+3 of tokens t0 … t0 + kForwardRun − 1.
// y [T, C] when !kSplit; the split's q, k, v, rstd otherwise.
template <typename T, bool kSplit>
__global__ void __launch_bounds__(kLanes* kRuns)
    conv_forward_window_kernel(const T* x, const void* w, bool bf16w, const int32_t* doc, T* y, SplitOut<T> split,
                               int64_t tokens, int64_t channels, int width) {
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kLanes + threadIdx.x) * kVec;
  const int64_t t0 = (static_cast<int64_t>(blockIdx.y) * kRuns + threadIdx.y) * kForwardRun;
  if (t0 >= tokens) return;  // the whole warp (one run)
  const bool active = c < channels;
  const int first_tap = kTaps - width;
  float wv[kVec][kTaps];
  load_taps(w, bf16w, c, width, active, wv);

  T* out = y + c;
  int64_t out_row = channels;
  float* rstd = nullptr;
  int64_t head = 0, heads = 0;
  if constexpr (kSplit) {
    const SplitPlace p = split_place(c, split.key, split.value, split.head_dim);
    out = (p.part == 0 ? split.q : p.part == 1 ? split.k : split.v) + p.col;
    out_row = p.row_len;
    rstd = p.part == 0 ? split.q_rstd : p.part == 1 ? split.k_rstd : nullptr;
    head = p.head;
    heads = p.heads;
  }

  float win[kTaps][kVec];  // x[t − 3 + j]
  int wdoc[kTaps];         // doc[t − 3 + j]
#pragma unroll
  for (int j = 1; j < kTaps; ++j) {
    const int64_t s = t0 - kTaps + j;
    wdoc[j] = s >= 0 ? __ldg(doc + s) : 0;
    if (active && s >= 0) {
      load4(x + s * channels + c, win[j]);
    } else {
#pragma unroll
      for (int v = 0; v < kVec; ++v) win[j][v] = 0.f;
    }
  }
#pragma unroll 4
  for (int step = 0; step < kForwardRun; ++step) {
    const int64_t t = t0 + step;
    if (t >= tokens) break;
#pragma unroll
    for (int j = 0; j + 1 < kTaps; ++j) {
      wdoc[j] = wdoc[j + 1];
#pragma unroll
      for (int v = 0; v < kVec; ++v) win[j][v] = win[j + 1][v];
    }
    wdoc[kTaps - 1] = __ldg(doc + t);
    if (active) load4(x + t * channels + c, win[kTaps - 1]);
    float o[kVec];
    window_pre(wv, win, wdoc, t, first_tap, o);
#pragma unroll
    for (int v = 0; v < kVec; ++v) o[v] = o[v] * sigmoidf(o[v]);
    if constexpr (kSplit) {
      // l2norm of the stored conv output over the head's lanes (every lane takes part).
      float ss = 0.f;
#pragma unroll
      for (int v = 0; v < kVec; ++v) {
        o[v] = stored<T>(o[v]);
        ss = fmaf(o[v], o[v], ss);
      }
      ss = lanes_sum(rstd && active ? ss : 0.f, split.head_lanes);
      if (rstd) {
        const float rs = 1.0f / sqrtf(ss + split.eps);
#pragma unroll
        for (int v = 0; v < kVec; ++v) o[v] *= rs;
        if (active && (threadIdx.x & (split.head_lanes - 1)) == 0) rstd[t * heads + head] = rs;
      }
    }
    if (active) store4(out + t * out_row, o);
  }
}

// Backward: thread (lane, run) owns dx and the dw partial of channels c … c+3 over the tokens
// t0 … t0 + kBackwardRun − 1; it walks 3 tokens further, whose pre-activation gradients reach the
// dx of its last tokens. dpre[t] = dy[t]·silu'(pre[t]) (dy from the split's norms when kSplit);
// dx[s] = Σ_i w[3 − i]·dpre[s + i] over the s + i of s's document.
template <typename T, bool kSplit>
__global__ void __launch_bounds__(kLanes* kRuns)
    conv_backward_window_kernel(const T* x, const void* w, bool bf16w, const int32_t* doc, const T* dy,
                                SplitIn<T> split, T* dx, float* dw_partial, int64_t tokens, int64_t channels,
                                int width) {
  __shared__ float dw_runs[kRuns][kLanes][kVec * kTaps];
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kLanes + threadIdx.x) * kVec;
  const int64_t t0 = (static_cast<int64_t>(blockIdx.y) * kRuns + threadIdx.y) * kBackwardRun;
  const bool active = c < channels;
  const int first_tap = kTaps - width;
  float wv[kVec][kTaps];
  load_taps(w, bf16w, c, width, active, wv);
  float dw_acc[kVec][kTaps];
#pragma unroll
  for (int v = 0; v < kVec; ++v)
#pragma unroll
    for (int j = 0; j < kTaps; ++j) dw_acc[v][j] = 0.f;

  const T* g_in = dy + c;  // the output gradient of this thread's channels
  const T* y_in = nullptr;  // kSplit, q or k: the normalised output
  const float* rstd = nullptr;
  int64_t g_row = channels, head = 0, heads = 0;
  if constexpr (kSplit) {
    const SplitPlace p = split_place(c, split.key, split.value, split.head_dim);
    g_in = (p.part == 0 ? split.dq : p.part == 1 ? split.dk : split.dv) + p.col;
    y_in = p.part == 0 ? split.q + p.col : p.part == 1 ? split.k + p.col : nullptr;
    rstd = p.part == 0 ? split.q_rstd : p.part == 1 ? split.k_rstd : nullptr;
    g_row = p.row_len;
    head = p.head;
    heads = p.heads;
  }

  if (t0 < tokens) {  // the whole warp (one run)
    float win[kTaps][kVec];  // x[t − 3 + j]
    float dph[kTaps][kVec];  // dpre[t − 3 + j]
    int wdoc[kTaps];         // doc[t − 3 + j]
#pragma unroll
    for (int j = 1; j < kTaps; ++j) {
      const int64_t s = t0 - kTaps + j;
      wdoc[j] = s >= 0 ? __ldg(doc + s) : 0;
#pragma unroll
      for (int v = 0; v < kVec; ++v) dph[j][v] = 0.f;  // before t0: never read for this run's dx
      if (active && s >= 0) {
        load4(x + s * channels + c, win[j]);
      } else {
#pragma unroll
        for (int v = 0; v < kVec; ++v) win[j][v] = 0.f;
      }
    }
#pragma unroll 2
    for (int step = 0; step < kBackwardRun + kTaps - 1; ++step) {
      const int64_t t = t0 + step;
      if (t - (kTaps - 1) >= tokens) break;
#pragma unroll
      for (int j = 0; j + 1 < kTaps; ++j) {
        wdoc[j] = wdoc[j + 1];
#pragma unroll
        for (int v = 0; v < kVec; ++v) {
          win[j][v] = win[j + 1][v];
          dph[j][v] = dph[j + 1][v];
        }
      }
      float dp[kVec] = {0.f, 0.f, 0.f, 0.f};
      if (t < tokens) {
        wdoc[kTaps - 1] = __ldg(doc + t);
        if (active) load4(x + t * channels + c, win[kTaps - 1]);
        float pre[kVec], g[kVec] = {0.f, 0.f, 0.f, 0.f};
        window_pre(wv, win, wdoc, t, first_tap, pre);
        if (active) load4(g_in + t * g_row, g);
        if constexpr (kSplit) {
          // l2norm_backward: g = rstd·(dy − y·(y·dy)), stored in T as the separate op stores it.
          float yv[kVec] = {0.f, 0.f, 0.f, 0.f}, dot = 0.f;
          if (active && rstd) {
            load4(y_in + t * g_row, yv);
#pragma unroll
            for (int v = 0; v < kVec; ++v) dot = fmaf(yv[v], g[v], dot);
          }
          dot = lanes_sum(dot, split.head_lanes);
          if (active && rstd) {
            const float rs = rstd[t * heads + head];
#pragma unroll
            for (int v = 0; v < kVec; ++v) g[v] = stored<T>(rs * (g[v] - yv[v] * dot));
          }
        }
#pragma unroll
        for (int v = 0; v < kVec; ++v) dp[v] = g[v] * silu_grad(pre[v]);
        if (step < kBackwardRun) {
#pragma unroll
          for (int j = 0; j < kTaps; ++j) {
            if (j < first_tap || t - (kTaps - 1) + j < 0 || wdoc[j] != wdoc[kTaps - 1]) continue;
#pragma unroll
            for (int v = 0; v < kVec; ++v) dw_acc[v][j] = fmaf(win[j][v], dp[v], dw_acc[v][j]);
          }
        }
      } else {
        wdoc[kTaps - 1] = wdoc[kTaps - 2];  // past the end: dpre 0, never a tap of a real token
#pragma unroll
        for (int v = 0; v < kVec; ++v) win[kTaps - 1][v] = 0.f;
      }
#pragma unroll
      for (int v = 0; v < kVec; ++v) dph[kTaps - 1][v] = dp[v];
      // Every token that reads s = t − 3 has been seen.
      if (step >= kTaps - 1 && active) {
        const int64_t s = t - (kTaps - 1);
        float d[kVec] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < kTaps; ++i) {
          if (kTaps - 1 - i < first_tap || s + i >= tokens || wdoc[i] != wdoc[0]) continue;
#pragma unroll
          for (int v = 0; v < kVec; ++v) d[v] = fmaf(wv[v][kTaps - 1 - i], dph[i][v], d[v]);
        }
        store4(dx + s * channels + c, d);
      }
    }
  }
  if (!dw_partial) return;  // uniform over the block
#pragma unroll
  for (int v = 0; v < kVec; ++v)
#pragma unroll
    for (int j = 0; j < kTaps; ++j) dw_runs[threadIdx.y][threadIdx.x][v * kTaps + j] = dw_acc[v][j];
  __syncthreads();
  // The block's partial [C, width]: its runs summed in order; one thread per (channel, tap).
  const int tid = threadIdx.y * kLanes + threadIdx.x;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kLanes * kVec;
  for (int e = tid; e < kLanes * kVec * width; e += kLanes * kRuns) {
    const int ch = e / width, j = e % width + first_tap;  // ch: channel within the block
    if (c0 + ch >= channels) continue;
    float sum = 0.f;
    for (int r = 0; r < kRuns; ++r) sum += dw_runs[r][ch / kVec][(ch % kVec) * kTaps + j];
    dw_partial[static_cast<int64_t>(blockIdx.y) * channels * width + (c0 + ch) * width + (j - first_tap)] = sum;
  }
}

// ---- the row-wise kernels (any width up to 16, any channel count) --------------------------------------
// How many tokens before t belong to t's document, up to width − 1 (tap j reads t − width + 1 + j,
// valid when width − 1 − j ≤ back).
__device__ __forceinline__ int reach_back(const int32_t* doc, int64_t t, int width) {
  int back = 0;
  while (back < width - 1 && t - back - 1 >= 0 && doc[t - back - 1] == doc[t - back]) ++back;
  return back;
}

template <typename T>
__device__ __forceinline__ float conv_pre(const T* x, const void* w, bool bf16w, const int32_t* doc, int64_t t,
                                          int64_t c, int64_t channels, int width) {
  const int back = reach_back(doc, t, width);
  float pre = 0.f;
  for (int j = width - 1 - back; j < width; ++j)
    pre = fmaf(load_weight(w, bf16w, c * width + j), to_f32(x[(t - width + 1 + j) * channels + c]), pre);
  return pre;
}

template <typename T>
__global__ void conv_forward_kernel(const T* x, const void* w, bool bf16w, const int32_t* doc, T* y, int64_t tokens,
                                    int64_t channels, int width) {
  const int64_t n = tokens * channels;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = i / channels, c = i % channels;
    const float pre = conv_pre(x, w, bf16w, doc, t, c, channels, width);
    y[i] = from_f32<T>(pre * sigmoidf(pre));
  }
}

// One thread per channel walks the rows [r0, r1) of its block (plus width − 1 rows after, whose
// pre-activation gradient reaches dx of the last rows): dpre[t] = dy[t]·silu'(pre[t]) is spread
// over the dx of the taps it read (a ring of width pending sums, each written once complete), and
// dw partial [row blocks, channels·width] sums x·dpre over t in [r0, r1).
template <typename T>
__global__ void conv_backward_kernel(const T* x, const void* w, bool bf16w, const int32_t* doc, const T* dy, T* dx,
                                     float* dw_partial, int64_t tokens, int64_t channels, int width,
                                     int64_t rows_per_block) {
  const int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (c >= channels) return;
  const int64_t r0 = static_cast<int64_t>(blockIdx.y) * rows_per_block, r1 = min(tokens, r0 + rows_per_block);
  const int64_t t_end = min(tokens, r1 + width - 1);
  float wv[kMaxConvWidth], pending[kMaxConvWidth], dw_acc[kMaxConvWidth];
  for (int j = 0; j < width; ++j) {
    wv[j] = load_weight(w, bf16w, c * width + j);
    pending[j] = 0.f;
    dw_acc[j] = 0.f;
  }
  for (int64_t t = r0; t < t_end; ++t) {
    const int back = reach_back(doc, t, width);
    float pre = 0.f;
    for (int j = width - 1 - back; j < width; ++j) pre = fmaf(wv[j], to_f32(x[(t - width + 1 + j) * channels + c]), pre);
    const float dp = to_f32(dy[t * channels + c]) * silu_grad(pre);
    for (int j = width - 1 - back; j < width; ++j) {
      const int64_t src = t - width + 1 + j;
      if (src >= r0) pending[src % width] = fmaf(wv[j], dp, pending[src % width]);
      if (t < r1) dw_acc[j] = fmaf(to_f32(x[src * channels + c]), dp, dw_acc[j]);
    }
    const int64_t done = t - (width - 1);  // every t' ≥ done that reads `done` has been seen
    if (done >= r0) {
      dx[done * channels + c] = from_f32<T>(pending[done % width]);
      pending[done % width] = 0.f;
    }
  }
  for (int64_t s = max(r0, t_end - (width - 1)); s < r1; ++s) dx[s * channels + c] = from_f32<T>(pending[s % width]);
  if (dw_partial)
    for (int j = 0; j < width; ++j) dw_partial[blockIdx.y * channels * width + c * width + j] = dw_acc[j];
}

// Whether every pointer is aligned for the window kernels' 4-element loads and stores.
template <typename T>
bool quad_aligned(std::initializer_list<const void*> ptrs) {
  for (const void* p : ptrs)
    if (p && reinterpret_cast<uintptr_t>(p) % (kVec * sizeof(T)) != 0) return false;
  return true;
}

dim3 window_grid(int64_t tokens, int64_t channels, int64_t run, const char* op) {
  const int64_t row_blocks = (tokens + kRuns * run - 1) / (kRuns * run);
  if (row_blocks > 65535) throw_message(op, "more than 65535 blocks of tokens (over 8M tokens)");
  return dim3(static_cast<unsigned>((channels + kLanes * kVec - 1) / (kLanes * kVec)),
              static_cast<unsigned>(row_blocks));
}

template <typename T, bool kSplit>
void launch_window_forward(cudaStream_t s, const T* x, const void* w, bool bf16w, const int32_t* doc, T* y,
                           const SplitOut<T>& split, int64_t tokens, int64_t channels, int width, const char* op) {
  conv_forward_window_kernel<T, kSplit><<<window_grid(tokens, channels, kForwardRun, op), dim3(kLanes, kRuns), 0, s>>>(
      x, w, bf16w, doc, y, split, tokens, channels, width);
  CUDA_CHECK_LAUNCH();
}

template <typename T, bool kSplit>
void launch_window_backward(cudaStream_t s, const T* x, const void* w, bool bf16w, const int32_t* doc, const T* dy,
                            const SplitIn<T>& split, T* dx, void* dw, int64_t tokens, int64_t channels, int width,
                            const char* op) {
  const dim3 grid = window_grid(tokens, channels, kBackwardRun, op);
  Scratch partial(s, dw ? conv_backward_scratch_bytes(tokens, channels, width) : 0);
  conv_backward_window_kernel<T, kSplit><<<grid, dim3(kLanes, kRuns), 0, s>>>(
      x, w, bf16w, doc, dy, split, dx, dw ? partial.as<float>() : nullptr, tokens, channels, width);
  CUDA_CHECK_LAUNCH();
  if (dw) finish_partials(s, partial.as<float>(), grid.y, channels * width, dw, bf16w);
}

}  // namespace

void causal_conv1d_silu_forward(cudaStream_t s, const void* x, const void* w, DType wt, const int32_t* doc_ids,
                                void* y, DType io, int64_t tokens, int64_t channels, int64_t width) {
  const char* op = "causal_conv1d_silu_forward";
  const bool bf16w = weight_is_bf16(wt, op);
  if (width < 1 || width > kMaxConvWidth) throw_message(op, "conv width must be 1 ... 16");
  if (tokens * channels == 0) return;
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    if (conv_window_shape(channels, width) && quad_aligned<T>({x, y})) {
      launch_window_forward<T, false>(s, static_cast<const T*>(x), w, bf16w, doc_ids, static_cast<T*>(y), {}, tokens,
                                      channels, static_cast<int>(width), op);
    } else {
      causal_conv1d_silu_forward_rowwise(s, x, w, wt, doc_ids, y, io, tokens, channels, width);
    }
  });
}

void causal_conv1d_silu_forward_rowwise(cudaStream_t s, const void* x, const void* w, DType wt, const int32_t* doc_ids,
                                        void* y, DType io, int64_t tokens, int64_t channels, int64_t width) {
  const char* op = "causal_conv1d_silu_forward";
  const bool bf16w = weight_is_bf16(wt, op);
  if (width < 1 || width > kMaxConvWidth) throw_message(op, "conv width must be 1 ... 16");
  if (tokens * channels == 0) return;
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    conv_forward_kernel<<<grid_for(tokens * channels, kThreads), kThreads, 0, s>>>(
        static_cast<const T*>(x), w, bf16w, doc_ids, static_cast<T*>(y), tokens, channels, static_cast<int>(width));
    CUDA_CHECK_LAUNCH();
  });
}

void causal_conv1d_silu_backward(cudaStream_t s, const void* x, const void* w, DType wt, const int32_t* doc_ids,
                                 const void* dy, void* dx, void* dw, DType io, int64_t tokens, int64_t channels,
                                 int64_t width) {
  const char* op = "causal_conv1d_silu_backward";
  const bool bf16w = weight_is_bf16(wt, op);
  if (width < 1 || width > kMaxConvWidth) throw_message(op, "conv width must be 1 ... 16");
  if (tokens * channels == 0) return;
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    if (conv_window_shape(channels, width) && quad_aligned<T>({x, dy, dx})) {
      launch_window_backward<T, false>(s, static_cast<const T*>(x), w, bf16w, doc_ids, static_cast<const T*>(dy), {},
                                       static_cast<T*>(dx), dw, tokens, channels, static_cast<int>(width), op);
    } else {
      causal_conv1d_silu_backward_rowwise(s, x, w, wt, doc_ids, dy, dx, dw, io, tokens, channels, width);
    }
  });
}

void causal_conv1d_silu_backward_rowwise(cudaStream_t s, const void* x, const void* w, DType wt,
                                         const int32_t* doc_ids, const void* dy, void* dx, void* dw, DType io,
                                         int64_t tokens, int64_t channels, int64_t width) {
  const char* op = "causal_conv1d_silu_backward";
  const bool bf16w = weight_is_bf16(wt, op);
  if (width < 1 || width > kMaxConvWidth) throw_message(op, "conv width must be 1 ... 16");
  if (tokens * channels == 0) return;
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    // A fixed split (the shape's alone) keeps dw the same run to run.
    const int64_t row_blocks = (tokens + kConvRowwiseBackwardRows - 1) / kConvRowwiseBackwardRows;
    if (row_blocks > 65535) throw_message(op, "more than 4M tokens");
    Scratch partial(s, dw ? sizeof(float) * row_blocks * channels * width : 0);
    constexpr int kChannelThreads = 128;
    const dim3 grid(static_cast<unsigned>((channels + kChannelThreads - 1) / kChannelThreads),
                    static_cast<unsigned>(row_blocks));
    conv_backward_kernel<<<grid, kChannelThreads, 0, s>>>(static_cast<const T*>(x), w, bf16w, doc_ids,
                                                          static_cast<const T*>(dy), static_cast<T*>(dx),
                                                          dw ? partial.as<float>() : nullptr, tokens, channels,
                                                          static_cast<int>(width), kConvRowwiseBackwardRows);
    CUDA_CHECK_LAUNCH();
    if (dw) finish_partials(s, partial.as<float>(), row_blocks, channels * width, dw, bf16w);
  });
}

bool deltanet_conv_split_forward(cudaStream_t s, const void* qkv, const void* w, DType wt, const int32_t* doc_ids,
                                 void* q, void* k, void* v, float* q_rstd, float* k_rstd, DType io, int64_t tokens,
                                 int64_t key, int64_t value, int64_t head_dim, int64_t width, float eps) {
  const char* op = "deltanet_conv_split_forward";
  const bool bf16w = weight_is_bf16(wt, op);
  const int64_t channels = 2 * key + value;
  if (!conv_split_fused_shape(channels, width, head_dim) || key % head_dim != 0) return false;
  bool launched = false;
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    if (!quad_aligned<T>({qkv, q, k, v})) return;
    launched = true;
    if (tokens == 0) return;
    const SplitOut<T> split{static_cast<T*>(q), static_cast<T*>(k), static_cast<T*>(v), q_rstd, k_rstd, key, value,
                            static_cast<int>(head_dim), static_cast<int>(head_dim / kVec), eps};
    launch_window_forward<T, true>(s, static_cast<const T*>(qkv), w, bf16w, doc_ids, nullptr, split, tokens, channels,
                                   static_cast<int>(width), op);
  });
  return launched;
}

bool deltanet_conv_split_backward(cudaStream_t s, const void* qkv, const void* w, DType wt, const int32_t* doc_ids,
                                  const void* q, const void* k, const float* q_rstd, const float* k_rstd,
                                  const void* dq, const void* dk, const void* dv, void* d_qkv, void* dw, DType io,
                                  int64_t tokens, int64_t key, int64_t value, int64_t head_dim, int64_t width) {
  const char* op = "deltanet_conv_split_backward";
  const bool bf16w = weight_is_bf16(wt, op);
  const int64_t channels = 2 * key + value;
  if (!conv_split_fused_shape(channels, width, head_dim) || key % head_dim != 0) return false;
  bool launched = false;
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    if (!quad_aligned<T>({qkv, q, k, dq, dk, dv, d_qkv})) return;
    launched = true;
    if (tokens == 0) return;
    const SplitIn<T> split{static_cast<const T*>(q),  static_cast<const T*>(k),  static_cast<const T*>(dq),
                           static_cast<const T*>(dk), static_cast<const T*>(dv), q_rstd,
                           k_rstd,                    key,                       value,
                           static_cast<int>(head_dim), static_cast<int>(head_dim / kVec)};
    launch_window_backward<T, true>(s, static_cast<const T*>(qkv), w, bf16w, doc_ids, nullptr, split,
                                    static_cast<T*>(d_qkv), dw, tokens, channels, static_cast<int>(width), op);
  });
  return launched;
}

}  // namespace spindle::cuda
