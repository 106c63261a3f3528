// Attention backward on tensor cores, mma.sync (FlashAttention-2's work split, written for this
// engine): the fallback for BF16 head dims 64 and 128 where the Hopper kernels do not run. A
// block of 8 warps owns 128 keys of one kv head and walks every (query head of its group, 64-query
// tile) that the mask does not hide, so dK and dV are complete in the block (GQA heads summed in
// registers). Q/dO tiles go through a two-stage cp.async pipeline. FLOPs per (query, visible key)
// pair: 10·D. Measured on the H200 at 32k causal, D = 128: 187 TFLOP/s; a 64-key
// block with 16-key warps ran at 137, and a split variant (dQ by a separate kernel that recomputes
// S and dP, no atomics) slower still; both were removed once the Hopper kernels landed.
#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/mma_util.cuh"

namespace spindle::cuda {
namespace {

using namespace mma;

constexpr int kBr = 64;        // queries per tile
constexpr int kThreads = 256;  // 8 warps
constexpr float kLog2e = 1.4426950408889634f;

struct BwdParams {
  AttentionShape sh;
  const bf16 *q, *k, *v, *dout;
  const float *lse, *delta;
  AttentionMaskPtrs mask;
  const TileRange *q_ranges, *k_ranges;
  const TileSpan* q_spans;  // per key tile: the query tiles to walk
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

// Per 64-query tile each warp's products are 32x32 or wider, so every fragment it loads from
// shared memory feeds at least two MMAs:
//   phase 1, warp (keys 32·(w%4).., queries 32·(w/4)..): Sᵀ = K Qᵀ, dPᵀ = V dOᵀ, then Pᵀ and dSᵀ
//            go to shared memory as bf16;
//   phase 2, warp (keys 32·(w%4).., head dims (D/2)·(w/4)..): dV += Pᵀ dO, dK += dSᵀ Q (registers);
//   phase 3, warp (queries 32·(w%2).., head dims (D/4)·(w/2)..): dQ_tile = dS K, float4 atomics
//            into an f32 buffer (attention_dq_finish rounds it).
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
  // Items: (head of the group, query tile of the span), heads outermost.
  const TileSpan span = load_span(p.q_spans + kt);
  const int nq = span.end - span.first;
  const int items = group * nq;
  auto item_tile = [&](int it) { return span.first + it % nq; };

  auto item_class = [&](int it) { return classify_tile(load_range(p.q_ranges + item_tile(it)), kr, k_complete, p.mask.window); };
  auto next_active = [&](int from) {
    for (int it = from; it < items; ++it)
      if (item_class(it) != kTileSkip) return it;
    return items;
  };
  auto load_q = [&](int it, int stage) {
    const int h = hk * group + it / nq;
    const int64_t i0 = static_cast<int64_t>(item_tile(it)) * kBr;
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
    const int64_t i0 = static_cast<int64_t>(item_tile(it)) * kBr;
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
              const bool vis = cls == kTileFull ||
                               (j0 + key < sh.tk &&
                                key_visible(qdoc[qc + e], qpos[qc + e], s_kdoc[key], s_kpos[key], p.mask.window));
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

}  // namespace

void attention_backward_mma(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                            const void* out, const void* dout, const float* lse, const AttentionMaskPtrs& mask,
                            float scale, DType grad, void* dq, void* dk, void* dv, bool accumulate) {
  if (sh.d != 64 && sh.d != 128) throw_message("attention_backward", "mma kernels need head dim 64 or 128");
  const int64_t q_tiles = (sh.tq + kBr - 1) / kBr, k_tiles = (sh.tk + kWBc - 1) / kWBc;
  const int64_t dq_elems = sh.tq * sh.hq * sh.d;
  if (static_cast<int64_t>(sh.hq / sh.hkv) * q_tiles > 0x7fffffff || k_tiles > 0x7fffffff || sh.hq > 65535)
    throw_message("attention_backward", "too many tiles or heads");
  Scratch dq_acc(s, static_cast<size_t>(dq_elems) * sizeof(float));
  Scratch delta(s, static_cast<size_t>(sh.tq * sh.hq) * sizeof(float));
  Scratch ranges(s, static_cast<size_t>(q_tiles + k_tiles + 1) * sizeof(TileRange) + k_tiles * sizeof(TileSpan));
  if (dq_elems)
    CUDA_CHECK(cudaMemsetAsync(dq_acc.as<float>(), 0, static_cast<size_t>(dq_elems) * sizeof(float), s));
  tile_ranges(s, mask.q_doc, mask.q_pos, sh.tq, kBr, ranges.as<TileRange>());
  tile_ranges(s, mask.k_doc, mask.k_pos, sh.tk, kWBc, ranges.as<TileRange>() + q_tiles);
  auto* q_spans = reinterpret_cast<TileSpan*>(ranges.as<TileRange>() + q_tiles + k_tiles + 1);
  tile_spans(s, ranges.as<TileRange>(), q_tiles, ranges.as<TileRange>() + q_tiles, k_tiles, /*per_query=*/false, mask.window,
             q_spans);
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
              q_spans,
              scale,
              scale * kLog2e,
              dq_acc.as<float>(),
              dk,
              dv,
              grad == DType::F32,
              accumulate};
  if (k_tiles > 0) sh.d == 64 ? launch_backward_wide<64>(s, p, k_tiles) : launch_backward_wide<128>(s, p, k_tiles);
  attention_dq_finish(s, grad, dq_acc.as<float>(), scale, dq, dq_elems, accumulate);
}

}  // namespace spindle::cuda
