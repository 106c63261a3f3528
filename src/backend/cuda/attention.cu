// Attention entry points (which kernels run) and the small passes every implementation shares:
// tile ranges of the mask, the backward's row term delta, and the dq finishing pass.
#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/device_util.cuh"

namespace spindle::cuda {
namespace {

// One warp per tile.
__global__ void tile_ranges_kernel(const int32_t* doc, const int32_t* pos, int64_t n, int tile, int64_t tiles,
                                   TileRange* ranges) {
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (t >= tiles) return;
  int dmin = INT_MAX, dmax = INT_MIN, pmin = INT_MAX, pmax = INT_MIN;
  for (int e = lane; e < tile; e += 32) {
    const int64_t i = t * tile + e;
    if (i < n) {
      dmin = min(dmin, doc[i]);
      dmax = max(dmax, doc[i]);
      pmin = min(pmin, pos[i]);
      pmax = max(pmax, pos[i]);
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    dmin = min(dmin, __shfl_xor_sync(0xffffffffu, dmin, o));
    dmax = max(dmax, __shfl_xor_sync(0xffffffffu, dmax, o));
    pmin = min(pmin, __shfl_xor_sync(0xffffffffu, pmin, o));
    pmax = max(pmax, __shfl_xor_sync(0xffffffffu, pmax, o));
  }
  if (lane == 0) ranges[t] = TileRange{dmin, dmax, pmin, pmax};
}

// One warp per tile.
__global__ void tile_layouts_kernel(const int32_t* doc, const int32_t* pos, int64_t n, int tile, int64_t tiles,
                                    TileLayout* layouts) {
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (t >= tiles) return;
  const int64_t t0 = t * tile;
  const int valid = static_cast<int>(min(static_cast<int64_t>(tile), n - t0));
  const int doc0 = doc[t0], base0 = pos[t0];
  int split = tile;  // the first token that does not continue the first run
  for (int e = lane; e < valid; e += 32)
    if (doc[t0 + e] != doc0 || pos[t0 + e] != base0 + e) split = min(split, e);
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) split = min(split, __shfl_xor_sync(0xffffffffu, split, o));
  const int doc1 = split < valid ? doc[t0 + split] : doc0;
  const int base1 = split < valid ? pos[t0 + split] - split : base0;
  bool ok = true;
  for (int e = lane; e < valid; e += 32) {
    const bool first = e < split;
    ok = ok && doc[t0 + e] == (first ? doc0 : doc1) && pos[t0 + e] == (first ? base0 : base1) + e;
  }
  const bool regular = __all_sync(0xffffffffu, ok);
  if (lane == 0) layouts[t] = TileLayout{doc0, base0, doc1, base1, split, regular ? 1 : 0, 0, 0};
}

// One warp per tile of the walking side; its lanes test the other side's tiles.
__global__ void tile_spans_kernel(const TileRange* q_ranges, int64_t q_tiles, const TileRange* k_ranges,
                                  int64_t k_tiles, bool per_query, int window, TileSpan* spans) {
  const int64_t t = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  const int64_t n_self = per_query ? q_tiles : k_tiles, n_other = per_query ? k_tiles : q_tiles;
  if (t >= n_self) return;
  const TileRange self = load_range((per_query ? q_ranges : k_ranges) + t);
  const TileRange* other = per_query ? k_ranges : q_ranges;
  int first = INT_MAX, last = -1;
  for (int64_t j = lane; j < n_other; j += 32) {
    const TileRange o = load_range(other + j);
    if (!(per_query ? tiles_disjoint(self, o, window) : tiles_disjoint(o, self, window))) {
      first = min(first, static_cast<int>(j));
      last = max(last, static_cast<int>(j));
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    first = min(first, __shfl_xor_sync(0xffffffffu, first, o));
    last = max(last, __shfl_xor_sync(0xffffffffu, last, o));
  }
  if (lane == 0) spans[t] = last < 0 ? TileSpan{0, 0} : TileSpan{first, last + 1};
}

// One warp per (token, head) row: delta [h, i] = Σ_e dout·out.
template <typename T>
__global__ void delta_kernel(const T* out, const T* dout, int64_t tq, int hq, int d, float* delta) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= tq * hq) return;
  const T* o = out + row * d;
  const T* g = dout + row * d;
  float acc = 0;
  for (int e = lane; e < d; e += 32) acc = fmaf(to_f32(o[e]), to_f32(g[e]), acc);
  acc = warp_sum(acc);
  if (lane == 0) delta[(row % hq) * tq + row / hq] = acc;
}

template <typename T>
__global__ void dq_finish_kernel(const float* acc, float scale, T* dq, int64_t n, bool accumulate) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v = acc[i] * scale;
    if (accumulate) v += to_f32(dq[i]);
    dq[i] = from_f32<T>(v);
  }
}

}  // namespace

void tile_ranges(cudaStream_t s, const int32_t* doc, const int32_t* pos, int64_t n, int tile, TileRange* ranges) {
  const int64_t tiles = (n + tile - 1) / tile;
  if (tiles == 0) return;
  tile_ranges_kernel<<<static_cast<unsigned>((tiles * 32 + 255) / 256), 256, 0, s>>>(doc, pos, n, tile, tiles,
                                                                                      ranges);
  CUDA_CHECK_LAUNCH();
}

void tile_layouts(cudaStream_t s, const int32_t* doc, const int32_t* pos, int64_t n, int tile, TileLayout* layouts) {
  const int64_t tiles = (n + tile - 1) / tile;
  if (tiles == 0) return;
  tile_layouts_kernel<<<static_cast<unsigned>((tiles * 32 + 255) / 256), 256, 0, s>>>(doc, pos, n, tile, tiles,
                                                                                       layouts);
  CUDA_CHECK_LAUNCH();
}

void tile_spans(cudaStream_t s, const TileRange* q_ranges, int64_t q_tiles, const TileRange* k_ranges,
                int64_t k_tiles, bool per_query, int window, TileSpan* spans) {
  const int64_t n = per_query ? q_tiles : k_tiles;
  if (n == 0) return;
  tile_spans_kernel<<<static_cast<unsigned>((n * 32 + 255) / 256), 256, 0, s>>>(q_ranges, q_tiles, k_ranges, k_tiles,
                                                                                 per_query, window, spans);
  CUDA_CHECK_LAUNCH();
}

void attention_delta(cudaStream_t s, DType t, const void* out, const void* dout, int64_t tq, int hq, int d,
                     float* delta) {
  const int64_t rows = tq * hq;
  if (rows == 0) return;
  dispatch_compute(t, "attention_backward", [&](auto z) {
    using T = decltype(z);
    delta_kernel<<<static_cast<unsigned>((rows * 32 + 255) / 256), 256, 0, s>>>(
        static_cast<const T*>(out), static_cast<const T*>(dout), tq, hq, d, delta);
    CUDA_CHECK_LAUNCH();
  });
}

void attention_dq_finish(cudaStream_t s, DType t, const float* dq_acc, float scale, void* dq, int64_t n,
                         bool accumulate) {
  if (n == 0) return;
  dispatch_compute(t, "attention_backward", [&](auto z) {
    using T = decltype(z);
    dq_finish_kernel<<<grid_for(n, 256), 256, 0, s>>>(dq_acc, scale, static_cast<T*>(dq), n, accumulate);
    CUDA_CHECK_LAUNCH();
  });
}

namespace {

// Hopper's wgmma kernels run only on compute capability 9.x (they are built for sm_90a).
bool device_is_hopper() {
  static const bool hopper = [] {
    int device = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major == 9;
  }();
  return hopper;
}

AttentionImpl resolve(AttentionImpl impl, DType io, int d, const char* op) {
  if (impl == AttentionImpl::Auto) {
    if (attention_wgmma_supports(io, d) && device_is_hopper()) return AttentionImpl::Wgmma;
    return attention_mma_supports(io, d) ? AttentionImpl::Mma : AttentionImpl::Simple;
  }
  if (impl == AttentionImpl::Cudnn)
    throw_message(op, "the cuDNN attention is dispatched by the CUDA backend, not by these kernels");
  if (impl == AttentionImpl::Mma && !attention_mma_supports(io, d))
    throw_message(op, "mma kernels need BF16 and head dim 64 or 128");
  if (impl == AttentionImpl::Wgmma && !(attention_wgmma_supports(io, d) && device_is_hopper()))
    throw_message(op, "wgmma kernels need a Hopper GPU (sm_90), BF16 and head dim 128");
  return impl;
}

}  // namespace

bool attention_own_tensor_cores(DType io, int d) {
  return attention_mma_supports(io, d) || attention_wgmma_supports(io, d);
}

void attention_forward(cudaStream_t s, AttentionImpl impl, const AttentionShape& sh, DType io, const void* q,
                       const void* k, const void* v, const AttentionMaskPtrs& mask, float scale, void* out,
                       DType out_dtype, float* lse) {
  switch (resolve(impl, io, sh.d, "attention_forward")) {
    case AttentionImpl::Wgmma: attention_forward_wgmma(s, sh, q, k, v, mask, scale, out, out_dtype, lse); break;
    case AttentionImpl::Mma: attention_forward_mma(s, sh, q, k, v, mask, scale, out, out_dtype, lse); break;
    default: attention_forward_simple(s, sh, io, q, k, v, mask, scale, out, out_dtype, lse); break;
  }
}

void attention_backward(cudaStream_t s, AttentionImpl impl, const AttentionShape& sh, DType io, const void* q,
                        const void* k, const void* v, const void* out, const void* dout, const float* lse,
                        const AttentionMaskPtrs& mask, float scale, DType grad, void* dq, void* dk, void* dv,
                        bool accumulate) {
  switch (resolve(impl, io, sh.d, "attention_backward")) {
    case AttentionImpl::Wgmma:
      attention_backward_wgmma(s, sh, q, k, v, out, dout, lse, mask, scale, grad, dq, dk, dv, accumulate);
      break;
    case AttentionImpl::Mma:
      attention_backward_mma(s, sh, q, k, v, out, dout, lse, mask, scale, grad, dq, dk, dv, accumulate);
      break;
    default:
      attention_backward_simple(s, sh, io, q, k, v, out, dout, lse, mask, scale, grad, dq, dk, dv, accumulate);
      break;
  }
}

}  // namespace spindle::cuda
