// Attention backward on tensor cores (FlashAttention-2 structure, written for this engine).
// A block of 8 warps owns 64 keys of one kv head and walks every (query head of its group, 64-query
// tile) that the mask does not hide, so dK and dV are complete in the block without atomics (GQA
// heads summed in registers). Per tile, with warp w owning keys 16·(w%4).. and queries 32·(w/4)..:
//   Sᵀ = K Qᵀ, dPᵀ = V dOᵀ (registers) -> Pᵀ = exp(Sᵀ − lse), dSᵀ = Pᵀ∘(dPᵀ − delta)
//   dV += Pᵀ dO, dK += dSᵀ Q (registers, f32)
//   dS -> shared memory, then dQ_tile = dS K, added to an f32 dq buffer with float4 atomics.
// Q/dO tiles go through a two-stage cp.async pipeline. The two query halves' dK/dV partials are
// summed through shared memory at the end. FLOPs per (query, visible key) pair: 10·D.
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/mma_util.cuh"

namespace spindle::cuda {
namespace {

using namespace mma;

constexpr int kBc = 64;        // keys per block
constexpr int kBr = 64;        // queries per tile
constexpr int kThreads = 256;  // 8 warps
constexpr int kDsStride = kBc + 8;
constexpr float kLog2e = 1.4426950408889634f;

template <int D>
struct Smem {
  static constexpr int kStride = D + 8;
  // sK, sV [kBc][S]; sQ, sdO [2][kBr][S]; sdS [kBr][kBc + 8] bf16; lse2, delta f32 and q doc/pos
  // i32 [2][kBr].
  static constexpr size_t kTileBytes = static_cast<size_t>(kBc) * kStride * 2;
  static constexpr size_t kBytes = 6 * kTileBytes + kBr * kDsStride * 2 + 4 * 2 * kBr * 4;
  static_assert(4 * kTileBytes >= 2 * kBc * D * sizeof(float), "dK/dV reduction reuses the sQ/sdO space");
};

struct BwdParams {
  AttentionShape sh;
  const bf16 *q, *k, *v, *dout;
  const float *lse, *delta;
  AttentionMaskPtrs mask;
  const TileRange *q_ranges, *k_ranges;
  float scale, scale_log2;
  float* dq_acc;  // f32 [tq, hq, D], pre-zeroed
  void *dk, *dv;    // BF16, or F32 when f32_grads
  bool f32_grads;
  bool accumulate;
};

template <int D, int kRows, int kNThreads>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* x, int64_t row0, int64_t n, int heads, int head) {
  constexpr int kChunks = D / 8;
#pragma unroll
  for (int c = threadIdx.x; c < kRows * kChunks; c += kNThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const int64_t row = row0 + r;
    const bool valid = row < n;
    cp_async16(smem_addr(dst + r * (D + 8) + col), valid ? x + (row * heads + head) * D + col : x, valid);
  }
}

// grid (ceil(tk / 64), hkv); key tile 0 (the most work under a causal mask) starts first.
template <int D, bool kWithDq>
__global__ void __launch_bounds__(kThreads, 1) backward_kernel(const BwdParams p) {
  constexpr int S = Smem<D>::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);
  bf16* sV = sK + kBc * S;
  bf16* sQ = sV + kBc * S;          // [2][kBr][S]
  bf16* sdO = sQ + 2 * kBr * S;     // [2][kBr][S]
  bf16* sdS = sdO + 2 * kBr * S;    // [kBr][kDsStride]
  float* s_lse2 = reinterpret_cast<float*>(sdS + kBr * kDsStride);  // [2][kBr]
  float* s_delta = s_lse2 + 2 * kBr;
  int* s_qdoc = reinterpret_cast<int*>(s_delta + 2 * kBr);
  int* s_qpos = s_qdoc + 2 * kBr;

  const AttentionShape& sh = p.sh;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int kw = warp & 3, qh = warp >> 2;
  const int kt = blockIdx.x, hk = blockIdx.y, group = sh.hq / sh.hkv;
  const int64_t j0 = static_cast<int64_t>(kt) * kBc;
  const TileRange kr = load_range(p.k_ranges + kt);
  const bool k_complete = j0 + kBc <= sh.tk;
  const int nq = static_cast<int>((sh.tq + kBr - 1) / kBr);
  const int items = group * nq;

  auto item_class = [&](int it) {
    return classify_tile(load_range(p.q_ranges + it % nq), kr, k_complete);
  };
  auto next_active = [&](int from) {
    for (int it = from; it < items; ++it)
      if (item_class(it) != kTileSkip) return it;
    return items;
  };
  auto load_q = [&](int it, int stage) {
    const int h = hk * group + it / nq;
    const int64_t i0 = static_cast<int64_t>(it % nq) * kBr;
    load_tile<D, kBr, kThreads>(sQ + stage * kBr * S, p.q, i0, sh.tq, sh.hq, h);
    load_tile<D, kBr, kThreads>(sdO + stage * kBr * S, p.dout, i0, sh.tq, sh.hq, h);
    if (threadIdx.x < kBr) {
      const int64_t i = i0 + threadIdx.x;
      const bool ok = i < sh.tq;
      const int at = stage * kBr + threadIdx.x;
      s_qdoc[at] = ok ? p.mask.q_doc[i] : 0;
      s_qpos[at] = ok ? p.mask.q_pos[i] : 0;
      // Rows past the end, and rows that saw no key at all, contribute nothing: lse = +inf
      // makes P = exp2(s − inf) = 0.
      const float l = ok ? p.lse[static_cast<int64_t>(h) * sh.tq + i] : INFINITY;
      s_lse2[at] = l == -INFINITY ? INFINITY : l * kLog2e;
      s_delta[at] = ok ? p.delta[static_cast<int64_t>(h) * sh.tq + i] : 0.f;
    }
  };

  load_tile<D, kBc, kThreads>(sK, p.k, j0, sh.tk, sh.hkv, hk);
  load_tile<D, kBc, kThreads>(sV, p.v, j0, sh.tk, sh.hkv, hk);
  int it = next_active(0);
  if (it < items) load_q(it, 0);
  cp_async_commit();

  // This thread's two key rows (r = 0: row g of the warp's 16, r = 1: row g + 8).
  int kdoc[2], kpos[2];
  bool kvalid[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t j = j0 + kw * 16 + g + 8 * r;
    kvalid[r] = j < sh.tk;
    kdoc[r] = kvalid[r] ? p.mask.k_doc[j] : 0;
    kpos[r] = kvalid[r] ? p.mask.k_pos[j] : 0;
  }

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i)
#pragma unroll
    for (int c = 0; c < 4; ++c) dk[i][c] = dv[i][c] = 0.f;

  cp_async_wait<0>();
  __syncthreads();
  int stage = 0;
  while (it < items) {
    const int next = next_active(it + 1);
    if (next < items) load_q(next, stage ^ 1);
    cp_async_commit();
    const int h = hk * group + it / nq;
    const int64_t i0 = static_cast<int64_t>(it % nq) * kBr;
    const int cls = item_class(it);
    const bf16* cQ = sQ + stage * kBr * S;
    const bf16* cdO = sdO + stage * kBr * S;
    const float* lse2 = s_lse2 + stage * kBr;
    const float* dl = s_delta + stage * kBr;
    const int* qdoc = s_qdoc + stage * kBr;
    const int* qpos = s_qpos + stage * kBr;

    // Sᵀ = K Qᵀ and dPᵀ = V dOᵀ: 16 keys × 32 queries per warp.
    float st[4][4], dpt[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) st[i][c] = dpt[i][c] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t ka[4], va[4];
      ldmatrix_x4(ka, a_frag_addr(sK, S, kw * 16, ks * 16, lane));
      ldmatrix_x4(va, a_frag_addr(sV, S, kw * 16, ks * 16, lane));
#pragma unroll
      for (int nb = 0; nb < 4; nb += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, b_frag_addr_nk(cQ, S, qh * 32 + nb * 8, ks * 16, lane));
        mma_bf16(st[nb], ka, b[0], b[1]);
        mma_bf16(st[nb + 1], ka, b[2], b[3]);
        ldmatrix_x4(b, b_frag_addr_nk(cdO, S, qh * 32 + nb * 8, ks * 16, lane));
        mma_bf16(dpt[nb], va, b[0], b[1]);
        mma_bf16(dpt[nb + 1], va, b[2], b[3]);
      }
    }
    // Pᵀ and dSᵀ (without the softmax scale, applied to dK and dQ at the end).
#pragma unroll
    for (int nb = 0; nb < 4; ++nb)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int qc = qh * 32 + nb * 8 + 2 * t + (c & 1), r = c >> 1;
        const bool vis = cls == kTileFull || (kvalid[r] && qdoc[qc] == kdoc[r] && kpos[r] <= qpos[qc]);
        const float pv = vis ? exp2f(st[nb][c] * p.scale_log2 - lse2[qc]) : 0.f;
        st[nb][c] = pv;
        dpt[nb][c] = pv * (dpt[nb][c] - dl[qc]);
      }
    // dV += Pᵀ dO, dK += dSᵀ Q (k = this warp's 32 queries).
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      uint32_t pa[4], da[4];
      pa[0] = pack_bf16(st[2 * kk][0], st[2 * kk][1]);
      pa[1] = pack_bf16(st[2 * kk][2], st[2 * kk][3]);
      pa[2] = pack_bf16(st[2 * kk + 1][0], st[2 * kk + 1][1]);
      pa[3] = pack_bf16(st[2 * kk + 1][2], st[2 * kk + 1][3]);
      da[0] = pack_bf16(dpt[2 * kk][0], dpt[2 * kk][1]);
      da[1] = pack_bf16(dpt[2 * kk][2], dpt[2 * kk][3]);
      da[2] = pack_bf16(dpt[2 * kk + 1][0], dpt[2 * kk + 1][1]);
      da[3] = pack_bf16(dpt[2 * kk + 1][2], dpt[2 * kk + 1][3]);
#pragma unroll
      for (int db = 0; db < D / 8; db += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, b_frag_addr_kn(cdO, S, qh * 32 + kk * 16, db * 8, lane));
        mma_bf16(dv[db], pa, b[0], b[1]);
        mma_bf16(dv[db + 1], pa, b[2], b[3]);
        ldmatrix_x4_trans(b, b_frag_addr_kn(cQ, S, qh * 32 + kk * 16, db * 8, lane));
        mma_bf16(dk[db], da, b[0], b[1]);
        mma_bf16(dk[db + 1], da, b[2], b[3]);
      }
    }
    if constexpr (kWithDq) {
      // dS [query][key] to shared memory for dQ = dS K.
#pragma unroll
      for (int nb = 0; nb < 4; ++nb)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const int qc = qh * 32 + nb * 8 + 2 * t + (c & 1);
          const int kc = kw * 16 + g + 8 * (c >> 1);
          sdS[qc * kDsStride + kc] = __float2bfloat16_rn(dpt[nb][c]);
        }
      __syncthreads();
      {
        // Warp w: queries 16·(w%4).., head-dim half w/4.
        const int r0 = (warp & 3) * 16, c0 = (warp >> 2) * (D / 2);
        float dq[D / 16][4];
#pragma unroll
        for (int i = 0; i < D / 16; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;
#pragma unroll
        for (int ks = 0; ks < kBc / 16; ++ks) {
          uint32_t a[4];
          ldmatrix_x4(a, a_frag_addr(sdS, kDsStride, r0, ks * 16, lane));
#pragma unroll
          for (int db = 0; db < D / 16; db += 2) {
            uint32_t b[4];
            ldmatrix_x4_trans(b, b_frag_addr_kn(sK, S, ks * 16, c0 + db * 8, lane));
            mma_bf16(dq[db], a, b[0], b[1]);
            mma_bf16(dq[db + 1], a, b[2], b[3]);
          }
        }
        // Lanes t and t^1 swap halves so that each adds 4 consecutive floats of one row with a
        // single 16-byte atomic (sm_90): even t takes row g, cols 2t..2t+3; odd t row g+8, cols
        // 2t-2..2t+1. Half the atomics of float2 adds; the L2 atomic rate limits this pass.
        const bool odd = t & 1;
        const int64_t i = i0 + r0 + g + (odd ? 8 : 0);
        float* dst = p.dq_acc + (i * sh.hq + h) * D + c0 + 2 * (t & ~1);
#pragma unroll
        for (int db = 0; db < D / 16; ++db) {
          const float send0 = odd ? dq[db][0] : dq[db][2], send1 = odd ? dq[db][1] : dq[db][3];
          const float recv0 = __shfl_xor_sync(0xffffffffu, send0, 1), recv1 = __shfl_xor_sync(0xffffffffu, send1, 1);
          const float4 v = odd ? make_float4(recv0, recv1, dq[db][2], dq[db][3])
                               : make_float4(dq[db][0], dq[db][1], recv0, recv1);
          if (i < sh.tq) atomicAdd(reinterpret_cast<float4*>(dst + db * 8), v);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // next Q/dO landed; sdS and this stage are free again
    stage ^= 1;
    it = next;
  }

  // Sum the two query halves' partial dK/dV: warps 4-7 park theirs in the (now idle) Q/dO space.
  float* red_k = reinterpret_cast<float*>(sQ);  // [kBc][D]
  float* red_v = red_k + kBc * D;                // [kBc][D]
  if (qh == 1) {
#pragma unroll
    for (int db = 0; db < D / 8; ++db)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int at = (kw * 16 + g + 8 * (c >> 1)) * D + db * 8 + 2 * t + (c & 1);
        red_k[at] = dk[db][c];
        red_v[at] = dv[db][c];
      }
  }
  __syncthreads();
  if (qh == 0) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int kl = kw * 16 + g + 8 * r;
      const int64_t j = j0 + kl;
      if (j >= sh.tk) continue;
      const int64_t row = (j * sh.hkv + hk) * D + 2 * t;
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        const int at = kl * D + db * 8 + 2 * t;
        store_grad_pair(p.dk, row + db * 8, p.f32_grads, (dk[db][2 * r] + red_k[at]) * p.scale,
                        (dk[db][2 * r + 1] + red_k[at + 1]) * p.scale, p.accumulate);
        store_grad_pair(p.dv, row + db * 8, p.f32_grads, dv[db][2 * r] + red_v[at], dv[db][2 * r + 1] + red_v[at + 1],
                        p.accumulate);
      }
    }
  }
}

// dQ without atomics (the "split" backward): a block of 4 warps owns 64 query rows of one head
// (16 per warp) and walks the visible 64-key tiles, recomputing S = Q Kᵀ and dP = dO Vᵀ:
//   P = exp(S − lse), dS = P∘(dP − delta), dQ += dS K (registers, f32).
// 3 of the backward's 5 products again, in exchange for no atomics and no dS round trip through
// shared memory in the dK/dV kernel. grid (ceil(tq / 64), hq); heaviest (last) query tiles first.
constexpr int kDqThreads = 128;

template <int D>
struct DqSmem {
  static constexpr int kStride = D + 8;
  // sQ, sdO [kBr][S]; sK, sV [2][kBc][S]; k doc / pos [2][kBc] i32
  static constexpr size_t kBytes = static_cast<size_t>(2 * kBr + 4 * kBc) * kStride * 2 + 4 * kBc * 4;
};

template <int D>
__global__ void __launch_bounds__(kDqThreads, 2) dq_kernel(const BwdParams p, void* dq_out) {
  constexpr int S = DqSmem<D>::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sdO = sQ + kBr * S;
  bf16* sK = sdO + kBr * S;  // [2][kBc][S]
  bf16* sV = sK + 2 * kBc * S;
  int* s_kdoc = reinterpret_cast<int*>(sV + 2 * kBc * S);
  int* s_kpos = s_kdoc + 2 * kBc;

  const AttentionShape& sh = p.sh;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int q_tile = gridDim.x - 1 - blockIdx.x;
  const int h = blockIdx.y, hk = h / (sh.hq / sh.hkv);
  const int64_t q0 = static_cast<int64_t>(q_tile) * kBr;
  const TileRange qr = load_range(p.q_ranges + q_tile);
  const int nk = static_cast<int>((sh.tk + kBc - 1) / kBc);

  auto tile_class = [&](int j) {
    return classify_tile(qr, load_range(p.k_ranges + j), static_cast<int64_t>(j + 1) * kBc <= sh.tk);
  };
  auto next_active = [&](int from) {
    for (int j = from; j < nk; ++j)
      if (tile_class(j) != kTileSkip) return j;
    return nk;
  };
  auto load_kv = [&](int j, int stage) {
    const int64_t j0 = static_cast<int64_t>(j) * kBc;
    load_tile<D, kBc, kDqThreads>(sK + stage * kBc * S, p.k, j0, sh.tk, sh.hkv, hk);
    load_tile<D, kBc, kDqThreads>(sV + stage * kBc * S, p.v, j0, sh.tk, sh.hkv, hk);
    if (threadIdx.x < kBc) {
      const int64_t jj = j0 + threadIdx.x;
      s_kdoc[stage * kBc + threadIdx.x] = jj < sh.tk ? p.mask.k_doc[jj] : 0;
      s_kpos[stage * kBc + threadIdx.x] = jj < sh.tk ? p.mask.k_pos[jj] : 0;
    }
  };

  load_tile<D, kBr, kDqThreads>(sQ, p.q, q0, sh.tq, sh.hq, h);
  load_tile<D, kBr, kDqThreads>(sdO, p.dout, q0, sh.tq, sh.hq, h);
  int kt = next_active(0);
  if (kt < nk) load_kv(kt, 0);
  cp_async_commit();

  // This thread's two rows (r = 0: row g of the warp's 16, r = 1: row g + 8).
  int qdoc[2], qpos[2];
  float lse2[2], dl[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = q0 + warp * 16 + g + 8 * r;
    const bool ok = i < sh.tq;
    qdoc[r] = ok ? p.mask.q_doc[i] : 0;
    qpos[r] = ok ? p.mask.q_pos[i] : 0;
    const float l = ok ? p.lse[static_cast<int64_t>(h) * sh.tq + i] : INFINITY;
    lse2[r] = l == -INFINITY ? INFINITY : l * kLog2e;  // no key seen: P = 0
    dl[r] = ok ? p.delta[static_cast<int64_t>(h) * sh.tq + i] : 0.f;
  }
  float dq[D / 8][4];
#pragma unroll
  for (int i = 0; i < D / 8; ++i) dq[i][0] = dq[i][1] = dq[i][2] = dq[i][3] = 0.f;

  cp_async_wait<0>();
  __syncthreads();
  int stage = 0;
  while (kt < nk) {
    const int next = next_active(kt + 1);
    if (next < nk) load_kv(next, stage ^ 1);
    cp_async_commit();
    const int cls = tile_class(kt);
    const bf16* cK = sK + stage * kBc * S;
    const bf16* cV = sV + stage * kBc * S;
    float sc[kBc / 8][4], dp[kBc / 8][4];
#pragma unroll
    for (int i = 0; i < kBc / 8; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) sc[i][c] = dp[i][c] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t qa[4], da[4];
      ldmatrix_x4(qa, a_frag_addr(sQ, S, warp * 16, ks * 16, lane));
      ldmatrix_x4(da, a_frag_addr(sdO, S, warp * 16, ks * 16, lane));
#pragma unroll
      for (int nb = 0; nb < kBc / 8; nb += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, b_frag_addr_nk(cK, S, nb * 8, ks * 16, lane));
        mma_bf16(sc[nb], qa, b[0], b[1]);
        mma_bf16(sc[nb + 1], qa, b[2], b[3]);
        ldmatrix_x4(b, b_frag_addr_nk(cV, S, nb * 8, ks * 16, lane));
        mma_bf16(dp[nb], da, b[0], b[1]);
        mma_bf16(dp[nb + 1], da, b[2], b[3]);
      }
    }
    const int* kdoc = s_kdoc + stage * kBc;
    const int* kpos = s_kpos + stage * kBc;
    const int64_t j0 = static_cast<int64_t>(kt) * kBc;
#pragma unroll
    for (int nb = 0; nb < kBc / 8; ++nb)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = nb * 8 + 2 * t + (c & 1), r = c >> 1;
        const bool vis =
            cls == kTileFull || (j0 + col < sh.tk && kdoc[col] == qdoc[r] && kpos[col] <= qpos[r]);
        const float pv = vis ? exp2f(sc[nb][c] * p.scale_log2 - lse2[r]) : 0.f;
        dp[nb][c] = pv * (dp[nb][c] - dl[r]);  // dS (scale applied at the end)
      }
    // dQ += dS K: dS repacked as A fragments, K [key][d] is B with k = key.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t a[4];
      a[0] = pack_bf16(dp[2 * kk][0], dp[2 * kk][1]);
      a[1] = pack_bf16(dp[2 * kk][2], dp[2 * kk][3]);
      a[2] = pack_bf16(dp[2 * kk + 1][0], dp[2 * kk + 1][1]);
      a[3] = pack_bf16(dp[2 * kk + 1][2], dp[2 * kk + 1][3]);
#pragma unroll
      for (int db = 0; db < D / 8; db += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, b_frag_addr_kn(cK, S, kk * 16, db * 8, lane));
        mma_bf16(dq[db], a, b[0], b[1]);
        mma_bf16(dq[db + 1], a, b[2], b[3]);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    stage ^= 1;
    kt = next;
  }
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t i = q0 + warp * 16 + g + 8 * r;
    if (i >= sh.tq) continue;
    const int64_t row = (i * sh.hq + h) * D + 2 * t;
#pragma unroll
    for (int db = 0; db < D / 8; ++db)
      store_grad_pair(dq_out, row + db * 8, p.f32_grads, dq[db][2 * r] * p.scale, dq[db][2 * r + 1] * p.scale,
                      p.accumulate);
  }
}

// The "wide" backward (FlashAttention-2's work split, written for this engine): a block of 8 warps
// owns 128 keys of one kv head; per 64-query tile each warp's products are 32x32 or wider, so every
// fragment it loads from shared memory feeds at least two MMAs:
//   phase 1, warp (keys 32·(w%4).., queries 32·(w/4)..): Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, then Pᵀ and dSᵀ
//            go to shared memory as bf16;
//   phase 2, warp (keys 32·(w%4).., head dims (D/2)·(w/4)..): dV += Pᵀ dO, dK += dSᵀ Q (registers);
//   phase 3, warp (queries 32·(w%2).., head dims (D/4)·(w/2)..): dQ_tile = dS K, float4 atomics.
// Measured 2026-11-29 on the H200 at 32k causal: the 64-key kernel above ran at 137 TFLOP/s with
// 16-key warps (each dK/dV operand fragment fed one MMA).
constexpr int kWBc = 128;      // keys per block
constexpr int kWPs = kBr + 8;  // row stride of the Pᵀ / dSᵀ tiles [key][query]

template <int D>
struct WideSmem {
  static constexpr int kStride = D + 8;
  // sK, sV [kWBc][S]; sQ, sdO [2][kBr][S]; sPt, sdSt [kWBc][kWPs] bf16; k doc / pos [kWBc] i32;
  // lse2, delta f32 and q doc / pos i32 [2][kBr].
  static constexpr size_t kBytes = static_cast<size_t>(2 * kWBc + 4 * kBr) * kStride * 2 +
                                   static_cast<size_t>(2 * kWBc) * kWPs * 2 + 2 * kWBc * 4 + 4 * 2 * kBr * 4;
};

template <int D>
__global__ void __launch_bounds__(kThreads, 1) backward_wide_kernel(const BwdParams p) {
  constexpr int S = WideSmem<D>::kStride;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sK = reinterpret_cast<bf16*>(smem_raw);
  bf16* sV = sK + kWBc * S;
  bf16* sQ = sV + kWBc * S;       // [2][kBr][S]
  bf16* sdO = sQ + 2 * kBr * S;   // [2][kBr][S]
  bf16* sPt = sdO + 2 * kBr * S;  // [kWBc][kWPs]
  bf16* sdSt = sPt + kWBc * kWPs;
  int* s_kdoc = reinterpret_cast<int*>(sdSt + kWBc * kWPs);
  int* s_kpos = s_kdoc + kWBc;
  float* s_lse2 = reinterpret_cast<float*>(s_kpos + kWBc);  // [2][kBr]
  float* s_delta = s_lse2 + 2 * kBr;
  int* s_qdoc = reinterpret_cast<int*>(s_delta + 2 * kBr);
  int* s_qpos = s_qdoc + 2 * kBr;

  const AttentionShape& sh = p.sh;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  const int kt = blockIdx.x, hk = blockIdx.y, group = sh.hq / sh.hkv;
  const int64_t j0 = static_cast<int64_t>(kt) * kWBc;
  const TileRange kr = load_range(p.k_ranges + kt);
  const bool k_complete = j0 + kWBc <= sh.tk;
  const int nq = static_cast<int>((sh.tq + kBr - 1) / kBr);
  const int items = group * nq;

  auto item_class = [&](int it) { return classify_tile(load_range(p.q_ranges + it % nq), kr, k_complete); };
  auto next_active = [&](int from) {
    for (int it = from; it < items; ++it)
      if (item_class(it) != kTileSkip) return it;
    return items;
  };
  auto load_q = [&](int it, int stage) {
    const int h = hk * group + it / nq;
    const int64_t i0 = static_cast<int64_t>(it % nq) * kBr;
    load_tile<D, kBr, kThreads>(sQ + stage * kBr * S, p.q, i0, sh.tq, sh.hq, h);
    load_tile<D, kBr, kThreads>(sdO + stage * kBr * S, p.dout, i0, sh.tq, sh.hq, h);
    if (threadIdx.x < kBr) {
      const int64_t i = i0 + threadIdx.x;
      const bool ok = i < sh.tq;
      const int at = stage * kBr + threadIdx.x;
      s_qdoc[at] = ok ? p.mask.q_doc[i] : 0;
      s_qpos[at] = ok ? p.mask.q_pos[i] : 0;
      const float l = ok ? p.lse[static_cast<int64_t>(h) * sh.tq + i] : INFINITY;  // +inf: P = 0
      s_lse2[at] = l == -INFINITY ? INFINITY : l * kLog2e;
      s_delta[at] = ok ? p.delta[static_cast<int64_t>(h) * sh.tq + i] : 0.f;
    }
  };

  load_tile<D, kWBc, kThreads>(sK, p.k, j0, sh.tk, sh.hkv, hk);
  load_tile<D, kWBc, kThreads>(sV, p.v, j0, sh.tk, sh.hkv, hk);
  if (threadIdx.x < kWBc) {
    const int64_t j = j0 + threadIdx.x;
    s_kdoc[threadIdx.x] = j < sh.tk ? p.mask.k_doc[j] : 0;
    s_kpos[threadIdx.x] = j < sh.tk ? p.mask.k_pos[j] : 0;
  }
  int it = next_active(0);
  if (it < items) load_q(it, 0);
  cp_async_commit();

  // Phase 2 ownership: keys kb2.., head dims c2.. (dK/dV accumulators, f32).
  const int kb2 = (warp & 3) * 32, c2 = (warp >> 2) * (D / 2);
  float dk[2][D / 16][4], dv[2][D / 16][4];
#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int i = 0; i < D / 16; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) dk[mb][i][c] = dv[mb][i][c] = 0.f;

  cp_async_wait<0>();
  __syncthreads();
  int stage = 0;
  while (it < items) {
    const int next = next_active(it + 1);
    if (next < items) load_q(next, stage ^ 1);
    cp_async_commit();
    const int h = hk * group + it / nq;
    const int64_t i0 = static_cast<int64_t>(it % nq) * kBr;
    const int cls = item_class(it);
    const bf16* cQ = sQ + stage * kBr * S;
    const bf16* cdO = sdO + stage * kBr * S;

    {  // Phase 1: keys kb1.., queries qb1..
      const int kb1 = (warp & 3) * 32, qb1 = (warp >> 2) * 32;
      float st[2][4][4], dpt[2][4][4];
#pragma unroll
      for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int i = 0; i < 4; ++i)
#pragma unroll
          for (int c = 0; c < 4; ++c) st[mb][i][c] = dpt[mb][i][c] = 0.f;
#pragma unroll
      for (int ks = 0; ks < D / 16; ++ks) {
        uint32_t ka[2][4], va[2][4];
#pragma unroll
        for (int mb = 0; mb < 2; ++mb) {
          ldmatrix_x4(ka[mb], a_frag_addr(sK, S, kb1 + mb * 16, ks * 16, lane));
          ldmatrix_x4(va[mb], a_frag_addr(sV, S, kb1 + mb * 16, ks * 16, lane));
        }
#pragma unroll
        for (int nb = 0; nb < 4; nb += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, b_frag_addr_nk(cQ, S, qb1 + nb * 8, ks * 16, lane));
#pragma unroll
          for (int mb = 0; mb < 2; ++mb) {
            mma_bf16(st[mb][nb], ka[mb], b[0], b[1]);
            mma_bf16(st[mb][nb + 1], ka[mb], b[2], b[3]);
          }
          ldmatrix_x4(b, b_frag_addr_nk(cdO, S, qb1 + nb * 8, ks * 16, lane));
#pragma unroll
          for (int mb = 0; mb < 2; ++mb) {
            mma_bf16(dpt[mb][nb], va[mb], b[0], b[1]);
            mma_bf16(dpt[mb][nb + 1], va[mb], b[2], b[3]);
          }
        }
      }
      const float* lse2 = s_lse2 + stage * kBr;
      const float* dl = s_delta + stage * kBr;
      const int* qdoc = s_qdoc + stage * kBr;
      const int* qpos = s_qpos + stage * kBr;
#pragma unroll
      for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int nb = 0; nb < 4; ++nb)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int key = kb1 + mb * 16 + g + 8 * r;
            const int qc = qb1 + nb * 8 + 2 * t;
            float pv[2], ds[2];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              const bool vis = cls == kTileFull || (j0 + key < sh.tk && qdoc[qc + e] == s_kdoc[key] &&
                                                    s_kpos[key] <= qpos[qc + e]);
              pv[e] = vis ? exp2f(st[mb][nb][2 * r + e] * p.scale_log2 - lse2[qc + e]) : 0.f;
              ds[e] = pv[e] * (dpt[mb][nb][2 * r + e] - dl[qc + e]);
            }
            *reinterpret_cast<__nv_bfloat162*>(sPt + key * kWPs + qc) = __floats2bfloat162_rn(pv[0], pv[1]);
            *reinterpret_cast<__nv_bfloat162*>(sdSt + key * kWPs + qc) = __floats2bfloat162_rn(ds[0], ds[1]);
          }
    }
    __syncthreads();

    // Phase 2: dV += Pᵀ dO, dK += dSᵀ Q over the tile's 64 queries.
#pragma unroll
    for (int kq = 0; kq < kBr / 16; ++kq) {
      uint32_t pa[2][4], da[2][4];
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
        ldmatrix_x4(pa[mb], a_frag_addr(sPt, kWPs, kb2 + mb * 16, kq * 16, lane));
        ldmatrix_x4(da[mb], a_frag_addr(sdSt, kWPs, kb2 + mb * 16, kq * 16, lane));
      }
#pragma unroll
      for (int db = 0; db < D / 16; db += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, b_frag_addr_kn(cdO, S, kq * 16, c2 + db * 8, lane));
#pragma unroll
        for (int mb = 0; mb < 2; ++mb) {
          mma_bf16(dv[mb][db], pa[mb], b[0], b[1]);
          mma_bf16(dv[mb][db + 1], pa[mb], b[2], b[3]);
        }
        ldmatrix_x4_trans(b, b_frag_addr_kn(cQ, S, kq * 16, c2 + db * 8, lane));
#pragma unroll
        for (int mb = 0; mb < 2; ++mb) {
          mma_bf16(dk[mb][db], da[mb], b[0], b[1]);
          mma_bf16(dk[mb][db + 1], da[mb], b[2], b[3]);
        }
      }
    }

    {  // Phase 3: dQ_tile [64][D] = dS K; A = dS from the transposed tile sdSt (ldmatrix.trans).
      const int qb3 = (warp & 1) * 32, c3 = (warp >> 1) * (D / 4);
      float dq[2][D / 32][4];
#pragma unroll
      for (int mb = 0; mb < 2; ++mb)
#pragma unroll
        for (int i = 0; i < D / 32; ++i) dq[mb][i][0] = dq[mb][i][1] = dq[mb][i][2] = dq[mb][i][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < kWBc / 16; ++kk) {
        uint32_t a[2][4];
#pragma unroll
        for (int mb = 0; mb < 2; ++mb)
          ldmatrix_x4_trans(a[mb], a_frag_addr_trans(sdSt, kWPs, kk * 16, qb3 + mb * 16, lane));
#pragma unroll
        for (int db = 0; db < D / 32; db += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, b_frag_addr_kn(sK, S, kk * 16, c3 + db * 8, lane));
#pragma unroll
          for (int mb = 0; mb < 2; ++mb) {
            mma_bf16(dq[mb][db], a[mb], b[0], b[1]);
            mma_bf16(dq[mb][db + 1], a[mb], b[2], b[3]);
          }
        }
      }
      // Lanes t and t^1 swap halves: each adds 4 consecutive floats of one row (float4 atomic).
      const bool odd = t & 1;
#pragma unroll
      for (int mb = 0; mb < 2; ++mb) {
        const int64_t i = i0 + qb3 + mb * 16 + g + (odd ? 8 : 0);
        float* dst = p.dq_acc + (i * sh.hq + h) * D + c3 + 2 * (t & ~1);
#pragma unroll
        for (int db = 0; db < D / 32; ++db) {
          const float send0 = odd ? dq[mb][db][0] : dq[mb][db][2], send1 = odd ? dq[mb][db][1] : dq[mb][db][3];
          const float recv0 = __shfl_xor_sync(0xffffffffu, send0, 1);
          const float recv1 = __shfl_xor_sync(0xffffffffu, send1, 1);
          const float4 v = odd ? make_float4(recv0, recv1, dq[mb][db][2], dq[mb][db][3])
                               : make_float4(dq[mb][db][0], dq[mb][db][1], recv0, recv1);
          if (i < sh.tq) atomicAdd(reinterpret_cast<float4*>(dst + db * 8), v);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // next Q/dO landed; Pᵀ/dSᵀ and this stage are free again
    stage ^= 1;
    it = next;
  }

#pragma unroll
  for (int mb = 0; mb < 2; ++mb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t j = j0 + kb2 + mb * 16 + g + 8 * r;
      if (j >= sh.tk) continue;
      const int64_t row = (j * sh.hkv + hk) * D + c2 + 2 * t;
#pragma unroll
      for (int db = 0; db < D / 16; ++db) {
        store_grad_pair(p.dk, row + db * 8, p.f32_grads, dk[mb][db][2 * r] * p.scale,
                        dk[mb][db][2 * r + 1] * p.scale, p.accumulate);
        store_grad_pair(p.dv, row + db * 8, p.f32_grads, dv[mb][db][2 * r], dv[mb][db][2 * r + 1], p.accumulate);
      }
    }
}

template <int D>
void launch_backward_wide(cudaStream_t s, const BwdParams& p, int64_t k_tiles) {
  auto kernel = backward_wide_kernel<D>;
  const size_t smem = WideSmem<D>::kBytes;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<dim3(static_cast<unsigned>(k_tiles), static_cast<unsigned>(p.sh.hkv)), kThreads, smem, s>>>(p);
  CUDA_CHECK_LAUNCH();
}

template <int D, bool kWithDq>
void launch_backward(cudaStream_t s, const BwdParams& p, int64_t k_tiles) {
  auto kernel = backward_kernel<D, kWithDq>;
  const size_t smem = Smem<D>::kBytes;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<dim3(static_cast<unsigned>(k_tiles), static_cast<unsigned>(p.sh.hkv)), kThreads, smem, s>>>(p);
  CUDA_CHECK_LAUNCH();
}

template <int D>
void launch_dq(cudaStream_t s, const BwdParams& p, int64_t q_tiles, void* dq) {
  auto kernel = dq_kernel<D>;
  const size_t smem = DqSmem<D>::kBytes;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  kernel<<<dim3(static_cast<unsigned>(q_tiles), static_cast<unsigned>(p.sh.hq)), kDqThreads, smem, s>>>(
      p, dq);
  CUDA_CHECK_LAUNCH();
}

// Which backward, for measurements: SPINDLE_CUDA_ATTN_BWD = wide (128-key blocks, 32x32 warp
// tiles, dQ by atomics) | atomic (64-key blocks, 16-key warps, dQ by atomics) | split (64-key
// blocks without dQ, then a separate dQ kernel: 7 products, no atomics). Default: wide.
enum class BwdMode { Wide, Atomic, Split };
BwdMode backward_mode() {
  const char* v = std::getenv("SPINDLE_CUDA_ATTN_BWD");
  if (!v || !std::strcmp(v, "wide")) return BwdMode::Wide;
  if (!std::strcmp(v, "atomic")) return BwdMode::Atomic;
  if (!std::strcmp(v, "split")) return BwdMode::Split;
  throw_message("SPINDLE_CUDA_ATTN_BWD", "must be wide, atomic or split");
}

}  // namespace

void attention_backward_mma(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                            const void* out, const void* dout, const float* lse, const AttentionMaskPtrs& mask,
                            float scale, DType grad, void* dq, void* dk, void* dv, bool accumulate) {
  if (sh.d != 64 && sh.d != 128) throw_message("attention_backward", "mma kernels need head dim 64 or 128");
  const BwdMode mode = backward_mode();
  const bool split = mode == BwdMode::Split;
  const int key_tile = mode == BwdMode::Wide ? kWBc : kBc;
  const int64_t q_tiles = (sh.tq + kBr - 1) / kBr, k_tiles = (sh.tk + key_tile - 1) / key_tile;
  const int64_t dq_elems = sh.tq * sh.hq * sh.d;
  if (static_cast<int64_t>(sh.hq / sh.hkv) * q_tiles > 0x7fffffff || k_tiles > 0x7fffffff || sh.hq > 65535)
    throw_message("attention_backward", "too many tiles or heads");
  Scratch dq_acc(s, split ? 0 : static_cast<size_t>(dq_elems) * sizeof(float));
  Scratch delta(s, static_cast<size_t>(sh.tq * sh.hq) * sizeof(float));
  Scratch ranges(s, static_cast<size_t>(q_tiles + k_tiles + 1) * sizeof(TileRange));
  if (dq_elems && !split)
    CUDA_CHECK(cudaMemsetAsync(dq_acc.as<float>(), 0, static_cast<size_t>(dq_elems) * sizeof(float), s));
  tile_ranges(s, mask.q_doc, mask.q_pos, sh.tq, kBr, ranges.as<TileRange>());
  tile_ranges(s, mask.k_doc, mask.k_pos, sh.tk, key_tile, ranges.as<TileRange>() + q_tiles);
  attention_delta(s, DType::BF16, out, dout, sh.tq, sh.hq, sh.d, delta.as<float>());
  BwdParams p{sh,
              static_cast<const bf16*>(q),
              static_cast<const bf16*>(k),
              static_cast<const bf16*>(v),
              static_cast<const bf16*>(dout),
              lse,
              delta.as<float>(),
              mask,
              ranges.as<TileRange>(),
              ranges.as<TileRange>() + q_tiles,
              scale,
              scale * kLog2e,
              dq_acc.as<float>(),
              dk,
              dv,
              grad == DType::F32,
              accumulate};
  if (k_tiles > 0) {
    if (mode == BwdMode::Wide) sh.d == 64 ? launch_backward_wide<64>(s, p, k_tiles) : launch_backward_wide<128>(s, p, k_tiles);
    else if (sh.d == 64) split ? launch_backward<64, false>(s, p, k_tiles) : launch_backward<64, true>(s, p, k_tiles);
    else split ? launch_backward<128, false>(s, p, k_tiles) : launch_backward<128, true>(s, p, k_tiles);
  }
  if (split) {
    if (q_tiles > 0) sh.d == 64 ? launch_dq<64>(s, p, q_tiles, dq) : launch_dq<128>(s, p, q_tiles, dq);
  } else {
    attention_dq_finish(s, grad, dq_acc.as<float>(), scale, dq, dq_elems, accumulate);
  }
}

}  // namespace spindle::cuda
