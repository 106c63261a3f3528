// Simple attention kernels with f32 FMAs: any head dim up to 256, F32 or BF16 storage. They are
// the F32 path, the fallback for head dims without a tensor-core kernel, and an independent
// implementation the tensor-core kernels are checked against. Online softmax in natural exp.
//
// Forward and dq: a block of 8 warps owns 8 query rows of one head; each warp one row; key tiles of
// 32 go through shared memory, lane j scores key j. dk/dv: a block owns 8 key rows of one kv head
// and walks the query tiles of every head of its group, so no atomics are needed anywhere.
#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/device_util.cuh"

namespace spindle::cuda {
namespace {

constexpr int kRows = 8;    // rows per block (one per warp)
constexpr int kTile = 32;   // keys (forward, dq) or queries (dk/dv) per shared-memory tile
constexpr int kMaxPerLane = 8;  // d ≤ 256 = 8 values per lane

// Range of the block's own rows (the rows past n are left out), for the tile test.
__device__ void block_range(const int32_t* doc, const int32_t* pos, int64_t first, int64_t n, TileRange* out) {
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int64_t i = first + lane;
    const bool ok = lane < kRows && i < n;
    int dmin = ok ? doc[i] : INT_MAX, dmax = ok ? doc[i] : INT_MIN;
    int pmin = ok ? pos[i] : INT_MAX, pmax = ok ? pos[i] : INT_MIN;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      dmin = min(dmin, __shfl_xor_sync(0xffffffffu, dmin, o));
      dmax = max(dmax, __shfl_xor_sync(0xffffffffu, dmax, o));
      pmin = min(pmin, __shfl_xor_sync(0xffffffffu, pmin, o));
      pmax = max(pmax, __shfl_xor_sync(0xffffffffu, pmax, o));
    }
    if (lane == 0) *out = TileRange{dmin, dmax, pmin, pmax};
  }
  __syncthreads();
}

// Copies rows [first, first + count) of head `head` of x [n, heads, d] into dst [count][stride]
// as f32 (zeros past n).
template <typename T>
__device__ void load_rows(float* dst, int stride, const T* x, int64_t first, int count, int64_t n, int heads,
                          int head, int d) {
  for (int idx = threadIdx.x; idx < count * d; idx += blockDim.x) {
    const int r = idx / d, e = idx % d;
    const int64_t i = first + r;
    dst[r * stride + e] = i < n ? to_f32(x[(i * heads + head) * d + e]) : 0.f;
  }
}

// grid (ceil(tq / 8), hq), 256 threads. Dynamic shared: sq [8][d], sk/sv [32][d+1] f32.
// out [tq, hq, d] (TO), lse [hq, tq].
template <typename T, typename TO>
__global__ void forward_kernel(AttentionShape sh, const T* q, const T* k, const T* v, AttentionMaskPtrs mask,
                               const TileRange* k_ranges, float scale, TO* out, float* lse) {
  extern __shared__ float smem[];
  float* sq = smem;
  float* sk = sq + kRows * sh.d;
  float* sv = sk + kTile * (sh.d + 1);
  __shared__ int s_kdoc[kTile], s_kpos[kTile];
  __shared__ TileRange q_range;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y, hk = h / (sh.hq / sh.hkv), d = sh.d;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRows, i = i0 + warp;
  const bool row_ok = i < sh.tq;
  load_rows(sq, d, q, i0, kRows, sh.tq, sh.hq, h, d);
  block_range(mask.q_doc, mask.q_pos, i0, sh.tq, &q_range);
  const int qdoc = row_ok ? mask.q_doc[i] : 0, qpos = row_ok ? mask.q_pos[i] : 0;
  float acc[kMaxPerLane] = {};
  float m = -INFINITY, l = 0.f;
  const int64_t tiles = (sh.tk + kTile - 1) / kTile;
  for (int64_t kt = 0; kt < tiles; ++kt) {
    const int64_t j0 = kt * kTile;
    const int cls = classify_tile(q_range, load_range(k_ranges + kt), j0 + kTile <= sh.tk, mask.window);
    if (cls == kTileSkip) continue;  // block-uniform
    load_rows(sk, d + 1, k, j0, kTile, sh.tk, sh.hkv, hk, d);
    load_rows(sv, d + 1, v, j0, kTile, sh.tk, sh.hkv, hk, d);
    if (threadIdx.x < kTile) {
      const int64_t j = j0 + threadIdx.x;
      s_kdoc[threadIdx.x] = j < sh.tk ? mask.k_doc[j] : 0;
      s_kpos[threadIdx.x] = j < sh.tk ? mask.k_pos[j] : 0;
    }
    __syncthreads();
    if (row_ok) {
      const int64_t j = j0 + lane;
      const bool vis =
          j < sh.tk && (cls == kTileFull || key_visible(qdoc, qpos, s_kdoc[lane], s_kpos[lane], mask.window));
      float s = -INFINITY;
      if (vis) {
        float dot = 0.f;
        for (int e = 0; e < d; ++e) dot = fmaf(sq[warp * d + e], sk[lane * (d + 1) + e], dot);
        s = dot * scale;
      }
      const float m_new = fmaxf(m, warp_max(s));
      if (m_new != -INFINITY) {
        const float p = expf(s - m_new);  // 0 for masked keys
        const float alpha = expf(m - m_new);  // 0 while the row was empty
        l = l * alpha + warp_sum(p);
#pragma unroll
        for (int c = 0; c < kMaxPerLane; ++c) acc[c] *= alpha;
        for (int jj = 0; jj < kTile; ++jj) {
          const float pj = __shfl_sync(0xffffffffu, p, jj);
          if (pj == 0.f) continue;  // warp-uniform
#pragma unroll
          for (int c = 0; c < kMaxPerLane; ++c) {
            const int e = lane + 32 * c;
            if (e < d) acc[c] = fmaf(pj, sv[jj * (d + 1) + e], acc[c]);
          }
        }
        m = m_new;
      }
    }
    __syncthreads();
  }
  if (!row_ok) return;
  const bool empty = m == -INFINITY;
  const float inv = empty ? 0.f : 1.f / l;
#pragma unroll
  for (int c = 0; c < kMaxPerLane; ++c) {
    const int e = lane + 32 * c;
    if (e < d) out[(i * sh.hq + h) * d + e] = from_f32<TO>(acc[c] * inv);
  }
  if (lane == 0) lse[static_cast<int64_t>(h) * sh.tq + i] = empty ? -INFINITY : m + logf(l);
}

// dq: grid (ceil(tq / 8), hq). Dynamic shared: sq, sdo [8][d], sk, sv [32][d+1].
template <typename T, typename TG>
__global__ void dq_kernel(AttentionShape sh, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                          const float* delta, AttentionMaskPtrs mask, const TileRange* k_ranges, float scale, TG* dq,
                          bool accumulate) {
  extern __shared__ float smem[];
  float* sq = smem;
  float* sdo = sq + kRows * sh.d;
  float* sk = sdo + kRows * sh.d;
  float* sv = sk + kTile * (sh.d + 1);
  __shared__ int s_kdoc[kTile], s_kpos[kTile];
  __shared__ TileRange q_range;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int h = blockIdx.y, hk = h / (sh.hq / sh.hkv), d = sh.d;
  const int64_t i0 = static_cast<int64_t>(blockIdx.x) * kRows, i = i0 + warp;
  const bool row_ok = i < sh.tq;
  load_rows(sq, d, q, i0, kRows, sh.tq, sh.hq, h, d);
  load_rows(sdo, d, dout, i0, kRows, sh.tq, sh.hq, h, d);
  block_range(mask.q_doc, mask.q_pos, i0, sh.tq, &q_range);
  const int qdoc = row_ok ? mask.q_doc[i] : 0, qpos = row_ok ? mask.q_pos[i] : 0;
  const float l_row = row_ok ? lse[static_cast<int64_t>(h) * sh.tq + i] : -INFINITY;
  const float dl = row_ok ? delta[static_cast<int64_t>(h) * sh.tq + i] : 0.f;
  float acc[kMaxPerLane] = {};
  const int64_t tiles = (sh.tk + kTile - 1) / kTile;
  for (int64_t kt = 0; kt < tiles; ++kt) {
    const int64_t j0 = kt * kTile;
    const int cls = classify_tile(q_range, load_range(k_ranges + kt), j0 + kTile <= sh.tk, mask.window);
    if (cls == kTileSkip) continue;
    load_rows(sk, d + 1, k, j0, kTile, sh.tk, sh.hkv, hk, d);
    load_rows(sv, d + 1, v, j0, kTile, sh.tk, sh.hkv, hk, d);
    if (threadIdx.x < kTile) {
      const int64_t j = j0 + threadIdx.x;
      s_kdoc[threadIdx.x] = j < sh.tk ? mask.k_doc[j] : 0;
      s_kpos[threadIdx.x] = j < sh.tk ? mask.k_pos[j] : 0;
    }
    __syncthreads();
    if (row_ok && l_row != -INFINITY) {
      const int64_t j = j0 + lane;
      const bool vis =
          j < sh.tk && (cls == kTileFull || key_visible(qdoc, qpos, s_kdoc[lane], s_kpos[lane], mask.window));
      float ds = 0.f;
      if (vis) {
        float dot = 0.f, dp = 0.f;
        for (int e = 0; e < d; ++e) {
          dot = fmaf(sq[warp * d + e], sk[lane * (d + 1) + e], dot);
          dp = fmaf(sdo[warp * d + e], sv[lane * (d + 1) + e], dp);
        }
        const float p = expf(dot * scale - l_row);
        ds = p * (dp - dl);
      }
      for (int jj = 0; jj < kTile; ++jj) {
        const float dsj = __shfl_sync(0xffffffffu, ds, jj);
        if (dsj == 0.f) continue;
#pragma unroll
        for (int c = 0; c < kMaxPerLane; ++c) {
          const int e = lane + 32 * c;
          if (e < d) acc[c] = fmaf(dsj, sk[jj * (d + 1) + e], acc[c]);
        }
      }
    }
    __syncthreads();
  }
  if (!row_ok) return;
#pragma unroll
  for (int c = 0; c < kMaxPerLane; ++c) {
    const int e = lane + 32 * c;
    if (e >= d) continue;
    TG* p = dq + (i * sh.hq + h) * d + e;
    const float g = acc[c] * scale;
    *p = from_f32<TG>(accumulate ? to_f32(*p) + g : g);
  }
}

// dk, dv: grid (ceil(tk / 8), hkv). Dynamic shared: sk, sv [8][d], sq, sdo [32][d+1] f32.
template <typename T, typename TG>
__global__ void dkv_kernel(AttentionShape sh, const T* q, const T* k, const T* v, const T* dout, const float* lse,
                           const float* delta, AttentionMaskPtrs mask, const TileRange* q_ranges, float scale, TG* dk,
                           TG* dv, bool accumulate) {
  extern __shared__ float smem[];
  float* sk = smem;
  float* sv = sk + kRows * sh.d;
  float* sq = sv + kRows * sh.d;
  float* sdo = sq + kTile * (sh.d + 1);
  __shared__ int s_qdoc[kTile], s_qpos[kTile];
  __shared__ float s_lse[kTile], s_delta[kTile];
  __shared__ TileRange k_range;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int hk = blockIdx.y, group = sh.hq / sh.hkv, d = sh.d;
  const int64_t j0 = static_cast<int64_t>(blockIdx.x) * kRows, j = j0 + warp;
  const bool row_ok = j < sh.tk;
  load_rows(sk, d, k, j0, kRows, sh.tk, sh.hkv, hk, d);
  load_rows(sv, d, v, j0, kRows, sh.tk, sh.hkv, hk, d);
  block_range(mask.k_doc, mask.k_pos, j0, sh.tk, &k_range);
  const bool k_complete = j0 + kRows <= sh.tk;
  const int kdoc = row_ok ? mask.k_doc[j] : 0, kpos = row_ok ? mask.k_pos[j] : 0;
  float acc_k[kMaxPerLane] = {}, acc_v[kMaxPerLane] = {};
  const int64_t tiles = (sh.tq + kTile - 1) / kTile;
  for (int h = hk * group; h < (hk + 1) * group; ++h) {
    for (int64_t qt = 0; qt < tiles; ++qt) {
      const int64_t i0 = qt * kTile;
      const int cls = classify_tile(load_range(q_ranges + qt), k_range, k_complete, mask.window);
      if (cls == kTileSkip) continue;
      load_rows(sq, d + 1, q, i0, kTile, sh.tq, sh.hq, h, d);
      load_rows(sdo, d + 1, dout, i0, kTile, sh.tq, sh.hq, h, d);
      if (threadIdx.x < kTile) {
        const int64_t i = i0 + threadIdx.x;
        const bool ok = i < sh.tq;
        s_qdoc[threadIdx.x] = ok ? mask.q_doc[i] : 0;
        s_qpos[threadIdx.x] = ok ? mask.q_pos[i] : 0;
        // Rows past the end and rows that saw no key contribute nothing: p = exp(s − ∞) = 0.
        const float l = ok ? lse[static_cast<int64_t>(h) * sh.tq + i] : INFINITY;
        s_lse[threadIdx.x] = l == -INFINITY ? INFINITY : l;
        s_delta[threadIdx.x] = ok ? delta[static_cast<int64_t>(h) * sh.tq + i] : 0.f;
      }
      __syncthreads();
      if (row_ok) {
        const bool vis = cls == kTileFull || key_visible(s_qdoc[lane], s_qpos[lane], kdoc, kpos, mask.window);
        float p = 0.f, ds = 0.f;
        if (vis) {
          float dot = 0.f, dp = 0.f;
          for (int e = 0; e < d; ++e) {
            dot = fmaf(sk[warp * d + e], sq[lane * (d + 1) + e], dot);
            dp = fmaf(sv[warp * d + e], sdo[lane * (d + 1) + e], dp);
          }
          p = expf(dot * scale - s_lse[lane]);
          ds = p * (dp - s_delta[lane]);
        }
        for (int ii = 0; ii < kTile; ++ii) {
          const float pi = __shfl_sync(0xffffffffu, p, ii), dsi = __shfl_sync(0xffffffffu, ds, ii);
          if (pi == 0.f && dsi == 0.f) continue;
#pragma unroll
          for (int c = 0; c < kMaxPerLane; ++c) {
            const int e = lane + 32 * c;
            if (e < d) {
              acc_v[c] = fmaf(pi, sdo[ii * (d + 1) + e], acc_v[c]);
              acc_k[c] = fmaf(dsi, sq[ii * (d + 1) + e], acc_k[c]);
            }
          }
        }
      }
      __syncthreads();
    }
  }
  if (!row_ok) return;
#pragma unroll
  for (int c = 0; c < kMaxPerLane; ++c) {
    const int e = lane + 32 * c;
    if (e >= d) continue;
    TG* pk = dk + (j * sh.hkv + hk) * d + e;
    TG* pv = dv + (j * sh.hkv + hk) * d + e;
    const float gk = acc_k[c] * scale, gv = acc_v[c];
    *pk = from_f32<TG>(accumulate ? to_f32(*pk) + gk : gk);
    *pv = from_f32<TG>(accumulate ? to_f32(*pv) + gv : gv);
  }
}

template <typename K>
void set_smem(K kernel, size_t bytes) {
  if (bytes > 48 * 1024)
    CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

}  // namespace

void attention_forward_simple(cudaStream_t s, const AttentionShape& sh, DType io, const void* q, const void* k,
                              const void* v, const AttentionMaskPtrs& mask, float scale, void* out, DType out_dtype,
                              float* lse) {
  if (sh.d > 256) throw_message("attention_forward", "head dim above 256");
  if (sh.tq == 0) return;
  const int64_t k_tiles = (sh.tk + kTile - 1) / kTile;
  Scratch ranges(s, static_cast<size_t>(k_tiles > 0 ? k_tiles : 1) * sizeof(TileRange));
  tile_ranges(s, mask.k_doc, mask.k_pos, sh.tk, kTile, ranges.as<TileRange>());
  const size_t smem = (kRows * sh.d + 2 * kTile * (sh.d + 1)) * sizeof(float);
  const dim3 grid(static_cast<unsigned>((sh.tq + kRows - 1) / kRows), static_cast<unsigned>(sh.hq));
  dispatch_compute(io, "attention_forward", [&](auto z) {
    using T = decltype(z);
    dispatch_compute(out_dtype, "attention_forward out", [&](auto y) {
      using TO = decltype(y);
      auto kernel = forward_kernel<T, TO>;
      set_smem(kernel, smem);
      kernel<<<grid, kRows * 32, smem, s>>>(sh, static_cast<const T*>(q), static_cast<const T*>(k),
                                           static_cast<const T*>(v), mask, ranges.as<TileRange>(), scale,
                                           static_cast<TO*>(out), lse);
      CUDA_CHECK_LAUNCH();
    });
  });
}

void attention_backward_simple(cudaStream_t s, const AttentionShape& sh, DType io, const void* q, const void* k,
                               const void* v, const void* out, const void* dout, const float* lse,
                               const AttentionMaskPtrs& mask, float scale, DType grad, void* dq, void* dk, void* dv,
                               bool accumulate) {
  if (sh.d > 256) throw_message("attention_backward", "head dim above 256");
  const int64_t k_tiles = (sh.tk + kTile - 1) / kTile, q_tiles = (sh.tq + kTile - 1) / kTile;
  Scratch delta(s, static_cast<size_t>(sh.tq * sh.hq + 1) * sizeof(float));
  Scratch ranges(s, static_cast<size_t>(k_tiles + q_tiles + 1) * sizeof(TileRange));
  TileRange* k_ranges = ranges.as<TileRange>();
  TileRange* q_ranges = k_ranges + k_tiles;
  tile_ranges(s, mask.k_doc, mask.k_pos, sh.tk, kTile, k_ranges);
  tile_ranges(s, mask.q_doc, mask.q_pos, sh.tq, kTile, q_ranges);
  attention_delta(s, io, out, dout, sh.tq, sh.hq, sh.d, delta.as<float>());
  dispatch_compute(io, "attention_backward", [&](auto z) {
   dispatch_compute(grad, "attention_backward gradients", [&](auto y) {
    using T = decltype(z);
    using TG = decltype(y);
    if (sh.tq > 0) {
      const size_t smem = (2 * kRows * sh.d + 2 * kTile * (sh.d + 1)) * sizeof(float);
      auto kernel = dq_kernel<T, TG>;
      set_smem(kernel, smem);
      const dim3 grid(static_cast<unsigned>((sh.tq + kRows - 1) / kRows), static_cast<unsigned>(sh.hq));
      kernel<<<grid, kRows * 32, smem, s>>>(sh, static_cast<const T*>(q), static_cast<const T*>(k),
                                           static_cast<const T*>(v), static_cast<const T*>(dout), lse,
                                           delta.as<float>(), mask, k_ranges, scale, static_cast<TG*>(dq), accumulate);
      CUDA_CHECK_LAUNCH();
    }
    if (sh.tk > 0) {
      const size_t smem = (2 * kRows * sh.d + 2 * kTile * (sh.d + 1)) * sizeof(float);
      auto kernel = dkv_kernel<T, TG>;
      set_smem(kernel, smem);
      const dim3 grid(static_cast<unsigned>((sh.tk + kRows - 1) / kRows), static_cast<unsigned>(sh.hkv));
      kernel<<<grid, kRows * 32, smem, s>>>(sh, static_cast<const T*>(q), static_cast<const T*>(k),
                                           static_cast<const T*>(v), static_cast<const T*>(dout), lse,
                                           delta.as<float>(), mask, q_ranges, scale, static_cast<TG*>(dk),
                                           static_cast<TG*>(dv), accumulate);
      CUDA_CHECK_LAUNCH();
    }
   });
  });
}

}  // namespace spindle::cuda
