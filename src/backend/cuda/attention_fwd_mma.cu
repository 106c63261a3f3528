// Attention forward on tensor cores (FlashAttention-2 structure, written for this engine):
// a block of 4 warps owns 128 query rows of one head, each warp 32 rows (two m16 row blocks that
// share every K/V fragment it loads: shared-memory traffic per MMA is what limits this design,
// measured: 16 rows per warp ran at 192 TFLOP/s); 64-key tiles of K and V stream
// through a two-stage cp.async pipeline; scores, the online softmax (exp2 domain, f32) and the
// P·V product never leave registers. Tiles that the mask hides completely are never loaded; tiles
// it shows completely skip the per-element test.
//
// FLOPs per (query, visible key) pair: 4·D (QKᵀ and PV, 2 each).
#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/mma_util.cuh"

namespace spindle::cuda {
namespace {

using namespace mma;

// Tile shape: RB m16 row blocks per warp (4 warps: 64·RB query rows per block), BC keys per tile.
// RB = 2 halves the K/V fragment loads per MMA (at the price of a few spilled registers at D=128);
// BC = 32 spills less but rescales the output twice as often.
constexpr int kThreads = 128;
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

template <int D, int RB, int BC>
struct Cfg {
  static constexpr int kBr = 64 * RB, kBc = BC;
  static constexpr int kStride = D + 8;  // bf16 per row: +16 bytes keeps ldmatrix conflict-free
  // sQ [kBr][kStride], sK [2][kBc][kStride], sV [2][kBc][kStride]; k doc / pos [2][kBc] i32
  static constexpr size_t kBytes = static_cast<size_t>(kBr + 4 * kBc) * kStride * 2 + 4 * kBc * 4;
};

struct FwdParams {
  AttentionShape sh;
  const bf16 *q, *k, *v;
  AttentionMaskPtrs mask;
  const TileRange *q_ranges, *k_ranges;
  const TileSpan* k_spans;  // per query tile: the key tiles to walk
  float scale_log2;  // softmax scale · log2(e)
  void* out;
  float* lse;
};

// cp.async `rows` rows of head `head` of x [n, heads, D] (from row0) into dst [rows][D + 8];
// rows past n become zeros.
template <int D, int kRows, int kNThreads>
__device__ __forceinline__ void load_tile(bf16* dst, const bf16* x, int64_t row0, int64_t n, int heads, int head) {
  constexpr int kChunks = D / 8;  // 16-byte pieces per row
#pragma unroll
  for (int c = threadIdx.x; c < kRows * kChunks; c += kNThreads) {
    const int r = c / kChunks, col = (c % kChunks) * 8;
    const int64_t row = row0 + r;
    const bool valid = row < n;
    cp_async16(smem_addr(dst + r * (D + 8) + col), valid ? x + (row * heads + head) * D + col : x, valid);
  }
}

// grid (ceil(tq / kBr), hq); blocks run the heaviest (last, for causal) query tiles first.
template <int D, int RB, int BC, typename TO>
__global__ void __launch_bounds__(kThreads, 2) forward_kernel(const FwdParams p) {
  using C = Cfg<D, RB, BC>;
  constexpr int S = C::kStride, kBr = C::kBr, kBc = C::kBc, kRB = RB;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* sQ = reinterpret_cast<bf16*>(smem_raw);
  bf16* sK = sQ + kBr * S;
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
  const TileSpan span = load_span(p.k_spans + q_tile);

  auto tile_class = [&](int j) {
    return classify_tile(qr, load_range(p.k_ranges + j), static_cast<int64_t>(j + 1) * kBc <= sh.tk, p.mask.window);
  };
  auto next_active = [&](int from) {
    for (int j = from; j < span.end; ++j)
      if (tile_class(j) != kTileSkip) return j;
    return nk;
  };
  auto load_kv = [&](int j, int stage) {
    const int64_t j0 = static_cast<int64_t>(j) * kBc;
    load_tile<D, kBc, kThreads>(sK + stage * kBc * S, p.k, j0, sh.tk, sh.hkv, hk);
    load_tile<D, kBc, kThreads>(sV + stage * kBc * S, p.v, j0, sh.tk, sh.hkv, hk);
    if (threadIdx.x < kBc) {
      const int64_t jj = j0 + threadIdx.x;
      s_kdoc[stage * kBc + threadIdx.x] = jj < sh.tk ? p.mask.k_doc[jj] : 0;
      s_kpos[stage * kBc + threadIdx.x] = jj < sh.tk ? p.mask.k_pos[jj] : 0;
    }
  };

  load_tile<D, kBr, kThreads>(sQ, p.q, q0, sh.tq, sh.hq, h);
  int kt = next_active(span.first);
  if (kt < nk) load_kv(kt, 0);
  cp_async_commit();

  // This thread's rows: row block rb, r = 0 -> row g of the block's 16, r = 1 -> row g + 8.
  auto local_row = [&](int rb, int r) { return warp * 16 * RB + rb * 16 + g + 8 * r; };
  int qdoc[RB][2], qpos[RB][2];
#pragma unroll
  for (int rb = 0; rb < RB; ++rb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int64_t i = q0 + local_row(rb, r);
      qdoc[rb][r] = i < sh.tq ? p.mask.q_doc[i] : 0;
      qpos[rb][r] = i < sh.tq ? p.mask.q_pos[i] : 0;
    }

  cp_async_wait<0>();
  __syncthreads();

  float o[kRB][D / 8][4];
#pragma unroll
  for (int rb = 0; rb < kRB; ++rb)
#pragma unroll
    for (int i = 0; i < D / 8; ++i) o[rb][i][0] = o[rb][i][1] = o[rb][i][2] = o[rb][i][3] = 0.f;
  float m[kRB][2], l[kRB][2];
#pragma unroll
  for (int rb = 0; rb < kRB; ++rb) m[rb][0] = m[rb][1] = -INFINITY, l[rb][0] = l[rb][1] = 0.f;

  int stage = 0;
  while (kt < nk) {
    const int next = next_active(kt + 1);
    if (next < nk) load_kv(next, stage ^ 1);  // overlaps with this tile's math
    cp_async_commit();
    const int cls = tile_class(kt);
    const bf16* cK = sK + stage * kBc * S;
    const bf16* cV = sV + stage * kBc * S;

    // S = Q Kᵀ: 16·RB rows × BC keys per warp; Q fragments come from shared memory (registers are
    // spent on the accumulators), each K fragment serves both row blocks.
    float s[kRB][kBc / 8][4];
#pragma unroll
    for (int rb = 0; rb < kRB; ++rb)
#pragma unroll
      for (int i = 0; i < kBc / 8; ++i) s[rb][i][0] = s[rb][i][1] = s[rb][i][2] = s[rb][i][3] = 0.f;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t qf[kRB][4];
#pragma unroll
      for (int rb = 0; rb < kRB; ++rb) ldmatrix_x4(qf[rb], a_frag_addr(sQ, S, warp * 16 * RB + rb * 16, ks * 16, lane));
#pragma unroll
      for (int nb = 0; nb < kBc / 8; nb += 2) {
        uint32_t b[4];
        ldmatrix_x4(b, b_frag_addr_nk(cK, S, nb * 8, ks * 16, lane));
#pragma unroll
        for (int rb = 0; rb < kRB; ++rb) {
          mma_bf16(s[rb][nb], qf[rb], b[0], b[1]);
          mma_bf16(s[rb][nb + 1], qf[rb], b[2], b[3]);
        }
      }
    }

    const int* kdoc = s_kdoc + stage * kBc;
    const int* kpos = s_kpos + stage * kBc;
    const int64_t j0 = static_cast<int64_t>(kt) * kBc;
#pragma unroll
    for (int rb = 0; rb < kRB; ++rb) {
      // Scale into the exp2 domain, mask, and the tile's row maxima.
      float mt[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int nb = 0; nb < kBc / 8; ++nb)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float x = s[rb][nb][c] * p.scale_log2;
          if (cls == kTileMixed) {
            const int col = nb * 8 + 2 * t + (c & 1), r = c >> 1;
            if (!(j0 + col < sh.tk && key_visible(qdoc[rb][r], qpos[rb][r], kdoc[col], kpos[col], p.mask.window)))
              x = -INFINITY;
          }
          s[rb][nb][c] = x;
          mt[c >> 1] = fmaxf(mt[c >> 1], x);
        }
      float alpha[2], m_use[2];
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 1));
        mt[r] = fmaxf(mt[r], __shfl_xor_sync(0xffffffffu, mt[r], 2));
        const float m_new = fmaxf(m[rb][r], mt[r]);
        // A row that has seen no key yet keeps m = −inf; exponentiate against 0 so that
        // exp2(−inf − (−inf)) never makes a NaN.
        m_use[r] = m_new == -INFINITY ? 0.f : m_new;
        alpha[r] = exp2f(m[rb][r] - m_use[r]);
        m[rb][r] = m_new;
      }
      float rowsum[2] = {0.f, 0.f};
#pragma unroll
      for (int nb = 0; nb < kBc / 8; ++nb)
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const float e = exp2f(s[rb][nb][c] - m_use[c >> 1]);
          s[rb][nb][c] = e;
          rowsum[c >> 1] += e;
        }
      // Per-thread partial sums: alpha is uniform over the 4 threads of a row, so the quad sum at
      // the end is exact.
#pragma unroll
      for (int r = 0; r < 2; ++r) l[rb][r] = l[rb][r] * alpha[r] + rowsum[r];
#pragma unroll
      for (int db = 0; db < D / 8; ++db) {
        o[rb][db][0] *= alpha[0];
        o[rb][db][1] *= alpha[0];
        o[rb][db][2] *= alpha[1];
        o[rb][db][3] *= alpha[1];
      }
    }

    // O += P V, P repacked from the score accumulators; each V fragment serves both row blocks.
#pragma unroll
    for (int kk = 0; kk < kBc / 16; ++kk) {
      uint32_t a[kRB][4];
#pragma unroll
      for (int rb = 0; rb < kRB; ++rb) {
        a[rb][0] = pack_bf16(s[rb][2 * kk][0], s[rb][2 * kk][1]);
        a[rb][1] = pack_bf16(s[rb][2 * kk][2], s[rb][2 * kk][3]);
        a[rb][2] = pack_bf16(s[rb][2 * kk + 1][0], s[rb][2 * kk + 1][1]);
        a[rb][3] = pack_bf16(s[rb][2 * kk + 1][2], s[rb][2 * kk + 1][3]);
      }
#pragma unroll
      for (int db = 0; db < D / 8; db += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, b_frag_addr_kn(cV, S, kk * 16, db * 8, lane));
#pragma unroll
        for (int rb = 0; rb < kRB; ++rb) {
          mma_bf16(o[rb][db], a[rb], b[0], b[1]);
          mma_bf16(o[rb][db + 1], a[rb], b[2], b[3]);
        }
      }
    }
    cp_async_wait<0>();
    __syncthreads();  // the next tile has landed and nobody reads this stage any more
    stage ^= 1;
    kt = next;
  }

  TO* out = static_cast<TO*>(p.out);
#pragma unroll
  for (int rb = 0; rb < kRB; ++rb)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float lr = l[rb][r];
      lr += __shfl_xor_sync(0xffffffffu, lr, 1);
      lr += __shfl_xor_sync(0xffffffffu, lr, 2);
      const int64_t row = q0 + local_row(rb, r);
      if (row >= sh.tq) continue;
      const bool empty = m[rb][r] == -INFINITY;
      const float inv = empty ? 0.f : 1.f / lr;
      TO* orow = out + (row * sh.hq + h) * D;
#pragma unroll
      for (int db = 0; db < D / 8; ++db)
        store_pair<TO>(orow + db * 8 + 2 * t, o[rb][db][2 * r] * inv, o[rb][db][2 * r + 1] * inv);
      if (t == 0)
        p.lse[static_cast<int64_t>(h) * sh.tq + row] = empty ? -INFINITY : m[rb][r] * kLn2 + logf(lr);
    }
}

template <int D, int RB, int BC, typename TO>
void launch_forward(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                    const AttentionMaskPtrs& mask, float scale, void* out, float* lse) {
  using C = Cfg<D, RB, BC>;
  const int64_t q_tiles = (sh.tq + C::kBr - 1) / C::kBr, k_tiles = (sh.tk + C::kBc - 1) / C::kBc;
  if (q_tiles > 0x7fffffff || sh.hq > 65535) throw_message("attention_forward", "too many query tiles or heads");
  Scratch ranges(s, static_cast<size_t>(q_tiles + k_tiles) * sizeof(TileRange) + q_tiles * sizeof(TileSpan));
  TileRange* q_ranges = ranges.as<TileRange>();
  TileRange* k_ranges = q_ranges + q_tiles;
  auto* k_spans = reinterpret_cast<TileSpan*>(k_ranges + k_tiles);
  tile_ranges(s, mask.q_doc, mask.q_pos, sh.tq, C::kBr, q_ranges);
  tile_ranges(s, mask.k_doc, mask.k_pos, sh.tk, C::kBc, k_ranges);
  tile_spans(s, q_ranges, q_tiles, k_ranges, k_tiles, /*per_query=*/true, mask.window, k_spans);
  const FwdParams p{sh,
                    static_cast<const bf16*>(q),
                    static_cast<const bf16*>(k),
                    static_cast<const bf16*>(v),
                    mask,
                    q_ranges,
                    k_ranges,
                    k_spans,
                    scale * kLog2e,
                    out,
                    lse};
  auto kernel = forward_kernel<D, RB, BC, TO>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(C::kBytes)));
  kernel<<<dim3(static_cast<unsigned>(q_tiles), static_cast<unsigned>(sh.hq)), kThreads, C::kBytes, s>>>(p);
  CUDA_CHECK_LAUNCH();
}

// Tile shape: 128 query rows x 64 keys per block (RB 2, BC 64). H200, 32k causal, D = 128,
// 248 TFLOP/s on the H200; 64x64 tiles ran at 184 and 128x32 at 207 (docs/perf-history.md).
template <int D, typename TO>
void forward_for(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                 const AttentionMaskPtrs& mask, float scale, void* out, float* lse) {
  launch_forward<D, 2, 64, TO>(s, sh, q, k, v, mask, scale, out, lse);
}

}  // namespace

bool attention_mma_supports(DType io, int d) { return io == DType::BF16 && (d == 64 || d == 128); }

void attention_forward_mma(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                           const AttentionMaskPtrs& mask, float scale, void* out, DType out_dtype, float* lse) {
  if (sh.tq == 0) return;
  if (out_dtype != DType::F32 && out_dtype != DType::BF16) throw_dtype("attention_forward out", out_dtype);
  const bool f32_out = out_dtype == DType::F32;
  if (sh.d == 64) {
    f32_out ? forward_for<64, float>(s, sh, q, k, v, mask, scale, out, lse)
            : forward_for<64, bf16>(s, sh, q, k, v, mask, scale, out, lse);
  } else if (sh.d == 128) {
    f32_out ? forward_for<128, float>(s, sh, q, k, v, mask, scale, out, lse)
            : forward_for<128, bf16>(s, sh, q, k, v, mask, scale, out, lse);
  } else {
    throw_message("attention_forward", "mma kernels need head dim 64 or 128");
  }
}

}  // namespace spindle::cuda
