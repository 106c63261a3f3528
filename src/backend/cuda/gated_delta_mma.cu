// The chunked gated delta rule on tensor cores (BF16 tensors; gated_delta.cu keeps the F32-FMA
// kernels for F32 tensors and for shapes these do not take). Same algorithm and notation as
// gated_delta.cu's file comment; what differs is where the work runs and what is stored:
//
//   intra   chunk-parallel, one block per (chunk, value head): the gates by a warp scan (written to
//           a small table the other kernels read), A = β·K·Kᵀ ⊙ D by mma, T = (I + A)⁻¹ by forward
//           substitution in F32 (one column per thread), U = T·diag(β)·V and W = T·diag(β·γ)·K by
//           mma. The backward also stores T (BF16) and the chunk-local part of dV_new, Pᵀ·dO.
//   state   the only sequential pass of the forward: one block per (value head, 16 value columns),
//           so 8× the blocks of the F32 kernels. The state slice S [dk, 16] stays in F32 registers
//           as mma accumulators (S' = γ_n·S + Kᵀ·(d ⊙ V_new) accumulates onto γ_n·S); a BF16 copy
//           in shared memory feeds V_new = U − W·S. The next chunk's W, K and U are fetched with
//           cp.async while this one computes. Writes the chunk-entering states (BF16) and V_new.
//   output  chunk-parallel: O = diag(γ)·scale·Q·S + P·V_new, P = lower(Q·Kᵀ ⊙ D)·scale.
//   dstate  the backward's sequential pass, in reverse, the same shape as state: dV_new =
//           Pᵀ·dO + diag(d)·K·dS and dS ← γ_n·dS + [Q; W]ᵀ·[γ·scale·dO; −dV_new] (one product).
//   grads   chunk-parallel, one block per (chunk, key head) and launch per value head of the group:
//           U, W and V_new recomputed from T and the stored state, then every gradient by mma.
//           dq and dk are summed over the group's value heads in their outputs (the first launch
//           writes, the next ones add), so no per-value-head F32 copies are needed.
//
// Precision: the mma operands are BF16 (inputs as stored; T, U, W, V_new, P, the states and the
// gradients' intermediates rounded to BF16, 2⁻⁹ relative), every sum and the recurrent state are
// F32, and so are the gate arithmetic and the row sums dg and dβ are made of. Each rounding adds
// about 2⁻⁹ relative error to one term; the CPU comparisons (test_cuda_gated_delta) allow 1e-2
// relative for BF16 tensors, the same tolerance the F32-FMA kernels were held to.
//
// Work per chunk and value head (n = C = 64, d = dk = dv = 128), in multiply-adds on tensor cores:
// forward ≈ 5.5 M (intra K·Kᵀ, U, W 1.5 M; state W·S, Kᵀ·V_new 2 M; output Q·Kᵀ, Q·S, P·V_new 2 M),
// backward ≈ 17.5 M (intra 2.5 M, state 2 M, dstate 3 M, grads 10 M): 0.18 and 0.57 TFLOP at T 32k,
// Hv 32. On one H200 that is 7.3 ms and 21.6 ms (25 and 26 TFLOP/s: docs/perf.md), far below the
// tensor cores' rate; not profiled yet, most likely the chunk steps' latency and the many small
// products with a barrier each bound them. The sequential passes re-read each chunk's W, K (and Q)
// once per 16-column slice, 8× over from L2.
//
// Scratch of the backward (X = T·Hv·128·2 bytes, the size of one BF16 [T, Hv, 128] tensor; 268 MB
// at T 32k, Hv 32): W X, U X (freed after the state pass), T X/2, the chunk-entering states and
// their gradients 2X each, dV_new X, the gate table T·Hv·16 bytes: at most 6.5X (1.75 GB at 32k)
// live at once, against 21X in F32 before (5.6 GB). DeltaRuleMmaScratch (gated_delta_scratch.h) lists
// them; the launchers size their Scratch from it and the memory plan counts the same list.
#include <algorithm>
#include <optional>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/gated_delta.h"
#include "backend/cuda/gated_delta_common.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/mma_util.cuh"

namespace spindle::cuda {
namespace {

using delta::ChunkGates;
using delta::decay;
using delta::load_gates;

constexpr int kMaxC = kDeltaRuleMaxChunk;  // 64: every [C, ·] tile has 64 rows of room
constexpr int kSlice = 16;                 // value columns per block of the sequential passes
constexpr int kPS = kSlice + 8;            // row stride (elements) of a [·, 16] BF16 tile
constexpr int kCS = kMaxC + 8;             // row stride of a [C, C] BF16 tile
constexpr int kFS = kMaxC + 1;             // row stride of a [C, C] F32 tile
constexpr int kGateRows = 4;               // gate table rows per chunk and head: G, γ, d, segment
constexpr int kWideThreads = 256;          // chunk-parallel kernels
constexpr int kSeqThreads = 128;           // sequential kernels: 4 warps, two 16-row tiles of S each

__host__ __device__ constexpr int round16(int x) { return (x + 15) / 16 * 16; }

struct MmaGeometry {
  int64_t tokens, chunks;
  int hk, hv, dk, dv, chunk, group;
  int cp, dkp, dvp;     // C, dk, dv rounded up to 16 (mma tiles); operands are zero beyond the real size
  int sk, sv, suw, sx;  // BF16 row strides: [·, dk], [·, dv], [·, dv + dk], [·, max(dk, dv)]
  int64_t q_rs, v_rs, w_rs;  // global row strides (one token) of q/k, v-like and W-like tensors
};

MmaGeometry mma_geometry(const DeltaRuleShape& sh) {
  MmaGeometry g{};
  g.tokens = sh.tokens;
  g.chunks = (sh.tokens + sh.chunk - 1) / sh.chunk;
  g.hk = sh.key_heads;
  g.hv = sh.value_heads;
  g.dk = sh.dk;
  g.dv = sh.dv;
  g.chunk = sh.chunk;
  g.group = sh.value_heads / sh.key_heads;
  g.cp = round16(sh.chunk);
  g.dkp = round16(sh.dk);
  g.dvp = round16(sh.dv);
  g.sk = g.dkp + 8;
  g.sv = g.dvp + 8;
  g.suw = g.dvp + g.dkp + 8;
  g.sx = std::max(g.dkp, g.dvp) + 8;
  g.q_rs = static_cast<int64_t>(sh.key_heads) * sh.dk;
  g.v_rs = static_cast<int64_t>(sh.value_heads) * sh.dv;
  g.w_rs = static_cast<int64_t>(sh.value_heads) * sh.dk;
  return g;
}

// ---- block-wide tensor-core product on shared-memory BF16 tiles ---------------------------------
// For i < Mp, j < Np (multiples of 16): epi(i, j, Σ_{k < Kp} A(i, k)·B(k, j)), F32 sums. A is stored
// [M][K] (row stride lda), or [K][M] when kATrans; B is stored [K][N], or [N][K] when kBNK. Padding
// rows and columns of the operands must be zero (finite). Each warp takes 16×16 output tiles in
// turn; the owner of (i, j) depends on (Mp, Np) alone. Called by all threads.
template <bool kATrans, bool kBNK, typename Epi>
__device__ __forceinline__ void block_mma(int Mp, int Np, int Kp, const bf16* A, int lda, const bf16* B, int ldb,
                                          Epi epi) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int tiles_n = Np / 16, tiles = (Mp / 16) * tiles_n;
  for (int t = warp; t < tiles; t += warps) {
    const int m0 = (t / tiles_n) * 16, n0 = (t % tiles_n) * 16;
    float acc[2][4] = {};
    for (int k0 = 0; k0 < Kp; k0 += 16) {
      uint32_t a[4], b[4];
      if constexpr (kATrans) mma::ldmatrix_x4_trans(a, mma::a_frag_addr_trans(A, lda, k0, m0, lane));
      else mma::ldmatrix_x4(a, mma::a_frag_addr(A, lda, m0, k0, lane));
      if constexpr (kBNK) mma::ldmatrix_x4(b, mma::b_frag_addr_nk(B, ldb, n0, k0, lane));
      else mma::ldmatrix_x4_trans(b, mma::b_frag_addr_kn(B, ldb, k0, n0, lane));
      mma::mma_bf16(acc[0], a, b[0], b[1]);
      mma::mma_bf16(acc[1], a, b[2], b[3]);
    }
    const int r = m0 + (lane >> 2), c = n0 + 2 * (lane & 3);
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      epi(r, c + 8 * nb, acc[nb][0]);
      epi(r, c + 8 * nb + 1, acc[nb][1]);
      epi(r + 8, c + 8 * nb, acc[nb][2]);
      epi(r + 8, c + 8 * nb + 1, acc[nb][3]);
    }
  }
}

// dst [rows_pad, cols_pad] (row stride dst_stride) ← src rows r < rows (row stride src_rs), columns
// c < cols; zeros elsewhere. cols, cols_pad multiples of 8, src 16-byte aligned. cp.async: the
// caller commits and waits.
__device__ __forceinline__ void stage_async(bf16* dst, int dst_stride, const bf16* src, int64_t src_rs, int rows,
                                            int rows_pad, int cols, int cols_pad) {
  const int vecs = cols_pad / 8;
  for (int x = threadIdx.x; x < rows_pad * vecs; x += blockDim.x) {
    const int r = x / vecs, c = (x % vecs) * 8;
    const bool valid = r < rows && c < cols;
    mma::cp_async16(mma::smem_addr(dst + r * dst_stride + c), valid ? src + r * src_rs + c : src, valid);
  }
}

// Stages and waits (chunk-parallel kernels). All threads; ends with __syncthreads.
__device__ __forceinline__ void stage_now(bf16* dst, int dst_stride, const bf16* src, int64_t src_rs, int rows,
                                          int rows_pad, int cols, int cols_pad) {
  stage_async(dst, dst_stride, src, src_rs, rows, rows_pad, cols, cols_pad);
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();
}

// ---- the gate table: F32 [chunks, Hv, 4, 64] (G, γ, d, segment id as int bits) -------------------
__device__ __forceinline__ const float* gate_row(const float* table, int64_t c, int hv, int h) {
  return table + (c * hv + h) * kGateRows * kMaxC;
}

__device__ __forceinline__ void store_gate_table(const ChunkGates& cg, float* t) {
  for (int x = threadIdx.x; x < kGateRows * kMaxC; x += blockDim.x) {
    const int row = x / kMaxC, r = x % kMaxC;
    t[x] = row == 0 ? cg.G[r] : row == 1 ? cg.gamma[r] : row == 2 ? cg.last[r] : __int_as_float(cg.seg[r]);
  }
}

// All threads; ends with __syncthreads.
__device__ __forceinline__ void load_gate_table(ChunkGates& cg, const float* t, int n) {
  for (int x = threadIdx.x; x < kGateRows * kMaxC; x += blockDim.x) {
    const int row = x / kMaxC, r = x % kMaxC;
    const float v = t[x];
    if (row == 0) cg.G[r] = v;
    else if (row == 1) cg.gamma[r] = v;
    else if (row == 2) cg.last[r] = v;
    else cg.seg[r] = __float_as_int(v);
  }
  if (threadIdx.x == 0) {
    cg.n = n;
    cg.gamma_last = t[kMaxC + n - 1];
  }
  __syncthreads();
}

__device__ __forceinline__ int chunk_tokens(const MmaGeometry& ge, int64_t c) {
  const int64_t left = ge.tokens - c * ge.chunk;
  return static_cast<int>(left < ge.chunk ? left : ge.chunk);
}

// ---- intra --------------------------------------------------------------------------------------
// Writes W [T, Hv, dk], U [T, Hv, dv] (BF16), the gate table; with dout (backward) also T = (I + A)⁻¹
// [chunks, Hv, C, C] (BF16) and dvn [T, Hv, dv] = Pᵀ·dO (BF16). Dynamic shared: Ks [64, sk], Xs [64, sx]
// (V, then Q, then dO), Af, Tf [64, 65] F32, TB, TBG [64, 72] BF16 (TB later holds P).
size_t intra_smem(const MmaGeometry& ge) {
  return sizeof(bf16) * kMaxC * (ge.sk + ge.sx) + sizeof(float) * 2 * kMaxC * kFS + sizeof(bf16) * 2 * kMaxC * kCS;
}

__global__ void __launch_bounds__(kWideThreads)
    delta_intra_mma_kernel(MmaGeometry ge, const bf16* q, const bf16* k, const bf16* v, const float* g,
                           const bf16* beta, const int32_t* doc, float scale, const bf16* dout, bf16* W, bf16* U,
                           bf16* Tinv, bf16* dvn, float* table) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ ChunkGates cg;
  __shared__ float beta_s[kMaxC];
  const int h = blockIdx.y, kh = h / ge.group, tid = threadIdx.x, cp = ge.cp;
  const int64_t c = blockIdx.x, c0 = c * ge.chunk;
  bf16* Ks = reinterpret_cast<bf16*>(smem_raw);
  bf16* Xs = Ks + kMaxC * ge.sk;
  float* Af = reinterpret_cast<float*>(Xs + kMaxC * ge.sx);
  float* Tf = Af + kMaxC * kFS;
  bf16* TB = reinterpret_cast<bf16*>(Tf + kMaxC * kFS);
  bf16* TBG = TB + kMaxC * kCS;
  const int n = chunk_tokens(ge, c);
  stage_async(Ks, ge.sk, k + (c0 * ge.hk + kh) * ge.dk, ge.q_rs, n, cp, ge.dk, ge.dkp);
  stage_async(Xs, ge.sx, v + (c0 * ge.hv + h) * ge.dv, ge.v_rs, n, cp, ge.dv, ge.dvp);
  mma::cp_async_commit();
  for (int r = tid; r < kMaxC; r += blockDim.x) beta_s[r] = r < n ? to_f32(beta[(c0 + r) * ge.hv + h]) : 0.f;
  load_gates(cg, g, doc, ge.tokens, ge.hv, h, c0, ge.chunk);  // synchronises
  store_gate_table(cg, const_cast<float*>(gate_row(table, c, ge.hv, h)));
  mma::cp_async_wait<0>();
  __syncthreads();
  // A = strictly lower (β_i·k_i·k_j·D_ij) within a segment.
  block_mma<false, true>(cp, cp, ge.dkp, Ks, ge.sk, Ks, ge.sk, [&](int i, int j, float acc) {
    Af[i * kFS + j] = i < n && j < i && cg.seg[i] == cg.seg[j] ? beta_s[i] * acc * expf(cg.G[i] - cg.G[j]) : 0.f;
  });
  __syncthreads();
  // T = (I + A)⁻¹, column `col` per thread: T_ii = 1, T_ic = −Σ_{c ≤ j < i} A_ij·T_jc below it.
  if (tid < cp) {
    const int col = tid;
    for (int i = 0; i < cp; ++i) {
      float x = 0.f;
      if (col < n && i < n && i >= col) {
        // Four partial sums: the chain of dependent FMAs is the kernel's longest path.
        float part[4] = {0.f, 0.f, 0.f, 0.f};
        int j = col;
        for (; j + 3 < i; j += 4)
#pragma unroll
          for (int u = 0; u < 4; ++u) part[u] = fmaf(Af[i * kFS + j + u], Tf[(j + u) * kFS + col], part[u]);
        for (; j < i; ++j) part[0] = fmaf(Af[i * kFS + j], Tf[j * kFS + col], part[0]);
        x = (i == col ? 1.f : 0.f) - ((part[0] + part[1]) + (part[2] + part[3]));
      }
      Tf[i * kFS + col] = x;
    }
  }
  __syncthreads();
  // T in BF16 (what the backward stores and recomputes from) and its two scaled copies.
  for (int x = tid; x < cp * cp; x += blockDim.x) {
    const int i = x / cp, j = x % cp;
    const bf16 t = __float2bfloat16_rn(Tf[i * kFS + j]);
    if (Tinv && i < ge.chunk && j < ge.chunk) Tinv[((c * ge.hv + h) * ge.chunk + i) * ge.chunk + j] = t;
    const float tf = __bfloat162float(t);
    TB[i * kCS + j] = __float2bfloat16_rn(tf * beta_s[j]);
    TBG[i * kCS + j] = __float2bfloat16_rn(j < n ? tf * beta_s[j] * cg.gamma[j] : 0.f);
  }
  __syncthreads();
  block_mma<false, false>(cp, ge.dvp, cp, TB, kCS, Xs, ge.sx, [&](int i, int e, float acc) {
    if (i < n && e < ge.dv) U[((c0 + i) * ge.hv + h) * ge.dv + e] = __float2bfloat16_rn(acc);
  });
  block_mma<false, false>(cp, ge.dkp, cp, TBG, kCS, Ks, ge.sk, [&](int i, int a, float acc) {
    if (i < n && a < ge.dk) W[((c0 + i) * ge.hv + h) * ge.dk + a] = __float2bfloat16_rn(acc);
  });
  if (!dout) return;
  __syncthreads();  // Xs and TB are free
  stage_now(Xs, ge.sx, q + (c0 * ge.hk + kh) * ge.dk, ge.q_rs, n, cp, ge.dk, ge.dkp);
  block_mma<false, true>(cp, cp, ge.dkp, Xs, ge.sx, Ks, ge.sk, [&](int i, int j, float acc) {
    TB[i * kCS + j] = __float2bfloat16_rn(i < n && j < n ? decay(cg, i, j) * scale * acc : 0.f);  // P
  });
  __syncthreads();
  stage_now(Xs, ge.sx, dout + (c0 * ge.hv + h) * ge.dv, ge.v_rs, n, cp, ge.dv, ge.dvp);
  block_mma<true, false>(cp, ge.dvp, cp, TB, kCS, Xs, ge.sx, [&](int j, int e, float acc) {
    if (j < n && e < ge.dv) dvn[((c0 + j) * ge.hv + h) * ge.dv + e] = __float2bfloat16_rn(acc);
  });
}

// ---- state: the forward's sequential pass -------------------------------------------------------
// Block (h, slice): value columns [e0, e0 + 16). states [chunks, Hv, dv, dk] (BF16, transposed): the
// state entering each chunk; vnew [T, Hv, dv] (null: not wanted). Dynamic shared: Wb, Kb [2][64, sk],
// Ub [2][64, 24], Sb [dkp, 24] (BF16 S), Vd [64, 24] (d ⊙ V_new), gam, lst [2][64] F32.
size_t state_smem(const MmaGeometry& ge) {
  return sizeof(bf16) * (4 * kMaxC * ge.sk + 2 * kMaxC * kPS + ge.dkp * kPS + kMaxC * kPS) +
         sizeof(float) * 4 * kMaxC;
}

// S [dkp, 16] of one block as the accumulators of warp w's m-tiles w and w + 4: acc[mt][nb][4].
// Writes the BF16 copy Sb from them.
__device__ __forceinline__ void store_state_bf16(const float (&acc)[2][2][4], bf16* Sb, int dkp) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int m0 = (warp + 4 * mt) * 16;
    if (m0 >= dkp) continue;
    const int r = m0 + (lane >> 2), c = 2 * (lane & 3);
#pragma unroll
    for (int nb = 0; nb < 2; ++nb) {
      *reinterpret_cast<__nv_bfloat162*>(Sb + r * kPS + c + 8 * nb) =
          __floats2bfloat162_rn(acc[mt][nb][0], acc[mt][nb][1]);
      *reinterpret_cast<__nv_bfloat162*>(Sb + (r + 8) * kPS + c + 8 * nb) =
          __floats2bfloat162_rn(acc[mt][nb][2], acc[mt][nb][3]);
    }
  }
}

// acc = decay·acc + Aᵀ·B: A stored [kp][dkp] (row stride lda, read transposed), B [kp][16] (kPS).
__device__ __forceinline__ void state_update(float (&acc)[2][2][4], float decay_all, const bf16* A, int lda,
                                             const bf16* B, int kp, int dkp) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    const int m0 = (warp + 4 * mt) * 16;
    if (m0 >= dkp) continue;
#pragma unroll
    for (int nb = 0; nb < 2; ++nb)
#pragma unroll
      for (int x = 0; x < 4; ++x) acc[mt][nb][x] *= decay_all;
    for (int k0 = 0; k0 < kp; k0 += 16) {
      uint32_t a[4], b[4];
      mma::ldmatrix_x4_trans(a, mma::a_frag_addr_trans(A, lda, k0, m0, lane));
      mma::ldmatrix_x4_trans(b, mma::b_frag_addr_kn(B, kPS, k0, 0, lane));
      mma::mma_bf16(acc[mt][0], a, b[0], b[1]);
      mma::mma_bf16(acc[mt][1], a, b[2], b[3]);
    }
  }
}

// states[c] (transposed, [dv, dk]) ← the BF16 slice Sb [dkp, 16].
__device__ __forceinline__ void write_state_slice(const MmaGeometry& ge, bf16* states, int64_t c, int h, int e0,
                                                  int ns, const bf16* Sb) {
  bf16* dst = states + ((c * ge.hv + h) * ge.dv + e0) * ge.dk;
  for (int x = threadIdx.x; x < ns * ge.dk; x += blockDim.x) {
    const int e = x / ge.dk, a = x % ge.dk;
    dst[x] = Sb[a * kPS + e];
  }
}

// gam, lst ← the γ and d rows of chunk c's gate table (cp.async).
__device__ __forceinline__ void stage_gates_async(float* gam, float* lst, const float* table, int64_t c, int hv,
                                                  int h) {
  const float* t = gate_row(table, c, hv, h);
  for (int x = threadIdx.x; x < 2 * kMaxC / 4; x += blockDim.x) {
    const int row = x / (kMaxC / 4), v = (x % (kMaxC / 4)) * 4;
    mma::cp_async16(mma::smem_addr((row == 0 ? gam : lst) + v), t + (1 + row) * kMaxC + v, true);
  }
}

__global__ void __launch_bounds__(kSeqThreads)
    delta_state_mma_kernel(MmaGeometry ge, const bf16* k, const bf16* W, const bf16* U, const float* table,
                           bf16* states, bf16* vnew) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int h = blockIdx.x, kh = h / ge.group, e0 = blockIdx.y * kSlice;
  const int ns = min(kSlice, ge.dv - e0), cp = ge.cp;
  // Buffer b of a double-buffered tile: base + b·(its size).
  const int tile = kMaxC * ge.sk;
  bf16* const Wb = reinterpret_cast<bf16*>(smem_raw);
  bf16* const Kb = Wb + 2 * tile;
  bf16* const Ub = Kb + 2 * tile;
  bf16* Sb = Ub + 2 * kMaxC * kPS;
  bf16* Vd = Sb + ge.dkp * kPS;
  float* gam = reinterpret_cast<float*>(Vd + kMaxC * kPS);  // [2][64]
  float* lst = gam + 2 * kMaxC;                              // [2][64]
  float acc[2][2][4] = {};
  for (int x = threadIdx.x; x < ge.dkp * kPS; x += blockDim.x) Sb[x] = __float2bfloat16_rn(0.f);
  auto prefetch = [&](int64_t c, int buf) {
    const int64_t c0 = c * ge.chunk;
    const int n = chunk_tokens(ge, c);
    stage_async(Wb + buf * tile, ge.sk, W + (c0 * ge.hv + h) * ge.dk, ge.w_rs, n, cp, ge.dk, ge.dkp);
    stage_async(Kb + buf * tile, ge.sk, k + (c0 * ge.hk + kh) * ge.dk, ge.q_rs, n, cp, ge.dk, ge.dkp);
    stage_async(Ub + buf * kMaxC * kPS, kPS, U + (c0 * ge.hv + h) * ge.dv + e0, ge.v_rs, n, cp, ns, kSlice);
    stage_gates_async(gam + buf * kMaxC, lst + buf * kMaxC, table, c, ge.hv, h);
    mma::cp_async_commit();
  };
  prefetch(0, 0);
  for (int64_t c = 0; c < ge.chunks; ++c) {
    const int buf = static_cast<int>(c & 1), n = chunk_tokens(ge, c);
    const int64_t c0 = c * ge.chunk;
    __syncthreads();  // the previous chunk is done with the other buffer and has written Sb
    if (c + 1 < ge.chunks) {
      prefetch(c + 1, buf ^ 1);
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    if (states) write_state_slice(ge, states, c, h, e0, ns, Sb);
    const bf16* Uc = Ub + buf * kMaxC * kPS;
    const float* d = lst + buf * kMaxC;
    // V_new = U − W·S; Vd = d ⊙ V_new (zero past the chunk's tokens).
    block_mma<false, false>(cp, kSlice, ge.dkp, Wb + buf * tile, ge.sk, Sb, kPS, [&](int i, int j, float acc_ij) {
      float x = 0.f;
      if (i < n) {
        const float vn = __bfloat162float(Uc[i * kPS + j]) - acc_ij;
        if (vnew && j < ns) vnew[((c0 + i) * ge.hv + h) * ge.dv + e0 + j] = __float2bfloat16_rn(vn);
        x = d[i] * vn;
      }
      Vd[i * kPS + j] = __float2bfloat16_rn(x);
    });
    __syncthreads();
    // S' = γ_n·S + Kᵀ·(d ⊙ V_new)
    state_update(acc, gam[buf * kMaxC + n - 1], Kb + buf * tile, ge.sk, Vd, cp, ge.dkp);
    store_state_bf16(acc, Sb, ge.dkp);
  }
}

// ---- output: O = diag(γ)·scale·Q·S + P·V_new, chunk-parallel ----------------------------------------
// Dynamic shared: Qs, Ks [64, sk], St [dvp, sk], Vn [64, sv], P [64, 72] BF16, Of [64, dvp + 1] F32.
size_t output_smem(const MmaGeometry& ge) {
  return sizeof(bf16) * (2 * kMaxC * ge.sk + ge.dvp * ge.sk + kMaxC * ge.sv + kMaxC * kCS) +
         sizeof(float) * kMaxC * (ge.dvp + 1);
}

__global__ void __launch_bounds__(kWideThreads)
    delta_output_mma_kernel(MmaGeometry ge, const bf16* q, const bf16* k, const float* table, const bf16* states,
                            const bf16* vnew, float scale, bf16* out) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ ChunkGates cg;
  const int h = blockIdx.y, kh = h / ge.group, cp = ge.cp, of_stride = ge.dvp + 1;
  const int64_t c = blockIdx.x, c0 = c * ge.chunk;
  bf16* Qs = reinterpret_cast<bf16*>(smem_raw);
  bf16* Ks = Qs + kMaxC * ge.sk;
  bf16* St = Ks + kMaxC * ge.sk;
  bf16* Vn = St + ge.dvp * ge.sk;
  bf16* P = Vn + kMaxC * ge.sv;
  float* Of = reinterpret_cast<float*>(P + kMaxC * kCS);
  const int n = chunk_tokens(ge, c);
  stage_async(Qs, ge.sk, q + (c0 * ge.hk + kh) * ge.dk, ge.q_rs, n, cp, ge.dk, ge.dkp);
  stage_async(Ks, ge.sk, k + (c0 * ge.hk + kh) * ge.dk, ge.q_rs, n, cp, ge.dk, ge.dkp);
  stage_async(St, ge.sk, states + (c * ge.hv + h) * ge.dv * ge.dk, ge.dk, ge.dv, ge.dvp, ge.dk, ge.dkp);
  stage_async(Vn, ge.sv, vnew + (c0 * ge.hv + h) * ge.dv, ge.v_rs, n, cp, ge.dv, ge.dvp);
  mma::cp_async_commit();
  load_gate_table(cg, gate_row(table, c, ge.hv, h), n);
  mma::cp_async_wait<0>();
  __syncthreads();
  block_mma<false, true>(cp, cp, ge.dkp, Qs, ge.sk, Ks, ge.sk, [&](int i, int j, float acc) {
    P[i * kCS + j] = __float2bfloat16_rn(i < n && j < n ? decay(cg, i, j) * scale * acc : 0.f);
  });
  // Q·S: B(a, e) = S[a][e] = St[e][a], stored [N][K].
  block_mma<false, true>(cp, ge.dvp, ge.dkp, Qs, ge.sk, St, ge.sk,
                         [&](int i, int e, float acc) { Of[i * of_stride + e] = cg.gamma[i] * scale * acc; });
  __syncthreads();
  block_mma<false, false>(cp, ge.dvp, cp, P, kCS, Vn, ge.sv, [&](int i, int e, float acc) {
    if (i < n && e < ge.dv) out[((c0 + i) * ge.hv + h) * ge.dv + e] = __float2bfloat16_rn(Of[i * of_stride + e] + acc);
  });
}

// ---- dstate: the backward's sequential pass, in reverse ---------------------------------------------
// dvn [T, Hv, dv]: in, Pᵀ·dO (from intra); out, dV_new. dstates [chunks, Hv, dv, dk] (BF16,
// transposed): ∂L/∂(state leaving chunk c). Dynamic shared: QW [2][128, sk] (Q rows, then W rows at
// cp), Kb [64, sk] (one buffer: K is read by the first product only, so the next chunk's K is
// fetched right after it; that keeps two blocks on an SM), dOb, dLb [2][64, 24], dSb [dkp, 24],
// Bst [128, 24] ([γ·scale·dO; −dV_new]), gam, lst [2][64] F32.
size_t dstate_smem(const MmaGeometry& ge) {
  return sizeof(bf16) * (2 * 2 * kMaxC * ge.sk + kMaxC * ge.sk + 4 * kMaxC * kPS + ge.dkp * kPS + 2 * kMaxC * kPS) +
         sizeof(float) * 4 * kMaxC;
}

__global__ void __launch_bounds__(kSeqThreads)
    delta_dstate_mma_kernel(MmaGeometry ge, const bf16* q, const bf16* k, const bf16* W, const bf16* dout,
                            const float* table, float scale, bf16* dvn, bf16* dstates) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  const int h = blockIdx.x, kh = h / ge.group, e0 = blockIdx.y * kSlice;
  const int ns = min(kSlice, ge.dv - e0), cp = ge.cp;
  const int qw_tile = 2 * kMaxC * ge.sk, slice_tile = kMaxC * kPS;
  bf16* const QW = reinterpret_cast<bf16*>(smem_raw);
  bf16* const Kb = QW + 2 * qw_tile;
  bf16* const dOb = Kb + kMaxC * ge.sk;
  bf16* const dLb = dOb + 2 * slice_tile;
  bf16* dSb = dLb + 2 * slice_tile;
  bf16* Bst = dSb + ge.dkp * kPS;
  float* gam = reinterpret_cast<float*>(Bst + 2 * kMaxC * kPS);
  float* lst = gam + 2 * kMaxC;
  float acc[2][2][4] = {};
  for (int x = threadIdx.x; x < ge.dkp * kPS; x += blockDim.x) dSb[x] = __float2bfloat16_rn(0.f);
  auto fetch_k = [&](int64_t c) {
    stage_async(Kb, ge.sk, k + (c * ge.chunk * ge.hk + kh) * ge.dk, ge.q_rs, chunk_tokens(ge, c), cp, ge.dk, ge.dkp);
  };
  auto prefetch = [&](int64_t c, int buf) {  // everything but K
    const int64_t c0 = c * ge.chunk;
    const int n = chunk_tokens(ge, c);
    bf16* qw = QW + buf * qw_tile;
    stage_async(qw, ge.sk, q + (c0 * ge.hk + kh) * ge.dk, ge.q_rs, n, cp, ge.dk, ge.dkp);
    stage_async(qw + cp * ge.sk, ge.sk, W + (c0 * ge.hv + h) * ge.dk, ge.w_rs, n, cp, ge.dk, ge.dkp);
    stage_async(dOb + buf * slice_tile, kPS, dout + (c0 * ge.hv + h) * ge.dv + e0, ge.v_rs, n, cp, ns, kSlice);
    stage_async(dLb + buf * slice_tile, kPS, dvn + (c0 * ge.hv + h) * ge.dv + e0, ge.v_rs, n, cp, ns, kSlice);
    stage_gates_async(gam + buf * kMaxC, lst + buf * kMaxC, table, c, ge.hv, h);
  };
  prefetch(ge.chunks - 1, 0);
  fetch_k(ge.chunks - 1);
  mma::cp_async_commit();
  for (int64_t c = ge.chunks - 1; c >= 0; --c) {
    const int buf = static_cast<int>((ge.chunks - 1 - c) & 1), n = chunk_tokens(ge, c);
    const int64_t c0 = c * ge.chunk;
    __syncthreads();
    // In flight: this chunk's tiles and K (older groups), then the previous chunk's tiles.
    if (c > 0) {
      prefetch(c - 1, buf ^ 1);
      mma::cp_async_commit();
      mma::cp_async_wait<1>();
    } else {
      mma::cp_async_wait<0>();
    }
    __syncthreads();
    write_state_slice(ge, dstates, c, h, e0, ns, dSb);
    const float* gm = gam + buf * kMaxC;
    const float* d = lst + buf * kMaxC;
    const bf16* dO = dOb + buf * slice_tile;
    const bf16* dL = dLb + buf * slice_tile;
    for (int x = threadIdx.x; x < cp * kSlice; x += blockDim.x) {
      const int i = x / kSlice, j = x % kSlice;
      Bst[i * kPS + j] = __float2bfloat16_rn(i < n ? gm[i] * scale * __bfloat162float(dO[i * kPS + j]) : 0.f);
    }
    // dV_new = Pᵀ·dO + d ⊙ (K·dS)
    block_mma<false, false>(cp, kSlice, ge.dkp, Kb, ge.sk, dSb, kPS, [&](int i, int j, float acc_ij) {
      float x = 0.f;
      if (i < n) {
        const float dv = __bfloat162float(dL[i * kPS + j]) + d[i] * acc_ij;
        if (j < ns) dvn[((c0 + i) * ge.hv + h) * ge.dv + e0 + j] = __float2bfloat16_rn(dv);
        x = -dv;
      }
      Bst[(cp + i) * kPS + j] = __float2bfloat16_rn(x);
    });
    __syncthreads();
    if (c > 0) {  // K is free: fetch the previous chunk's while this one finishes
      fetch_k(c - 1);
      mma::cp_async_commit();
    }
    // dS ← γ_n·dS + Qᵀ·(γ·scale·dO) − Wᵀ·dV_new
    state_update(acc, gm[n - 1], QW + buf * qw_tile, ge.sk, Bst, 2 * cp, ge.dkp);
    store_state_bf16(acc, dSb, ge.dkp);
  }
}

// ---- grads: everything else of the backward -------------------------------------------------------
// Block (chunk, key head) for value head h = kh·group + member. Shared-memory regions (byte offsets),
// with what each holds in turn (steps numbered in the kernel):
//   q, k [64, sk]; tinv [64, 72]; kk F32 [64, 65]
//   s     [max(dvp·sk, 64·suw)]: Sᵀ (1–7), dSᵀ (9–10), Sᵀ (11), Y = [Yu | Yw] [64, suw] (12–14)
//   uw    [64, suw]: [U | W] (3–14)
//   a     [64, max(sv, suw)]: V (1–3), dO (5–7), [dV_new | dBw] (11–12), V (13)
//   b0    Vn [64, sv] (4–9); TB, TBG [64, 72] (2–3); E F32 [64, 65] (14–15)
//   b1    M⊙D [64, 72] (6–10); B = βE + (βE)ᵀ (15–16)
//   b2    QK, M F32 [64, 65] each (2–6); dq accumulator F32 [64, dkp + 1] (7–8), dk's (9–16)
struct GradsLayout {
  size_t q, k, tinv, kk, s, uw, a, b0, b1, b2, total;
};

__host__ __device__ inline GradsLayout grads_layout(const MmaGeometry& ge) {
  GradsLayout L{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    const size_t at = off;
    off += (bytes + 15) / 16 * 16;
    return at;
  };
  auto mx = [](size_t x, size_t y) { return x > y ? x : y; };
  const size_t b = sizeof(bf16), f = sizeof(float);
  L.q = take(b * kMaxC * ge.sk);
  L.k = take(b * kMaxC * ge.sk);
  L.tinv = take(b * kMaxC * kCS);
  L.kk = take(f * kMaxC * kFS);
  L.s = take(b * mx(static_cast<size_t>(ge.dvp) * ge.sk, static_cast<size_t>(kMaxC) * ge.suw));
  L.uw = take(b * kMaxC * ge.suw);
  L.a = take(b * kMaxC * mx(ge.sv, ge.suw));
  L.b0 = take(mx(mx(b * kMaxC * ge.sv, 2 * b * kMaxC * kCS), f * kMaxC * kFS));
  L.b1 = take(b * kMaxC * kCS);
  L.b2 = take(mx(2 * f * kMaxC * kFS, f * kMaxC * (ge.dkp + 1)));
  L.total = off;
  return L;
}

// One row per warp: Σ_x a[x]·b[x] over x < len (F32 sums); every lane gets it.
template <typename TA, typename TB>
__device__ __forceinline__ float row_dot(const TA* a, const TB* b, int len) {
  float s = 0.f;
  for (int x = threadIdx.x & 31; x < len; x += 32) s = fmaf(to_f32(a[x]), to_f32(b[x]), s);
  return warp_sum(s);
}

__global__ void __launch_bounds__(kWideThreads)
    delta_grads_mma_kernel(MmaGeometry ge, int member, const bf16* q, const bf16* k, const bf16* v, const bf16* beta,
                           float scale, const bf16* dout, const float* table, const bf16* Tinv, const bf16* states,
                           const bf16* dstates, const bf16* dvn, bf16* dq, bf16* dk, bf16* dv, float* dg,
                           bf16* dbeta) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ ChunkGates cg;
  __shared__ float beta_s[kMaxC], dG[kMaxC], row_acc[kMaxC], col_acc[kMaxC], dbeta_acc[kMaxC], red[32];
  const GradsLayout L = grads_layout(ge);
  const int kh = blockIdx.y, h = kh * ge.group + member, cp = ge.cp, tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31, warps = blockDim.x >> 5;
  const int dkp = ge.dkp, dvp = ge.dvp, sk = ge.sk, sv = ge.sv, suw = ge.suw, acc_stride = dkp + 1;
  const int64_t c = blockIdx.x, c0 = c * ge.chunk;
  const int n = chunk_tokens(ge, c);
  auto at = [&](size_t off) { return smem_raw + off; };
  bf16* Qs = reinterpret_cast<bf16*>(at(L.q));
  bf16* Ks = reinterpret_cast<bf16*>(at(L.k));
  bf16* Ts = reinterpret_cast<bf16*>(at(L.tinv));
  float* KKf = reinterpret_cast<float*>(at(L.kk));
  bf16* Ss = reinterpret_cast<bf16*>(at(L.s));
  bf16* UW = reinterpret_cast<bf16*>(at(L.uw));
  bf16* As = reinterpret_cast<bf16*>(at(L.a));
  bf16* Vnb = reinterpret_cast<bf16*>(at(L.b0));
  bf16* TB = reinterpret_cast<bf16*>(at(L.b0));
  bf16* TBG = TB + kMaxC * kCS;
  float* Ef = reinterpret_cast<float*>(at(L.b0));
  bf16* MDb = reinterpret_cast<bf16*>(at(L.b1));
  bf16* Bsym = MDb;
  float* QKf = reinterpret_cast<float*>(at(L.b2));
  float* Mf = QKf + kMaxC * kFS;
  float* accf = QKf;  // dq's, then dk's accumulator [64, dkp + 1]
  const bf16* St_g = states + (c * ge.hv + h) * ge.dv * ge.dk;
  const bf16* dSt_g = dstates + (c * ge.hv + h) * ge.dv * ge.dk;
  const int64_t vrow = (c0 * ge.hv + h) * ge.dv, qrow = (c0 * ge.hk + kh) * ge.dk;

  // 1. Operands.
  stage_async(Qs, sk, q + qrow, ge.q_rs, n, cp, ge.dk, dkp);
  stage_async(Ks, sk, k + qrow, ge.q_rs, n, cp, ge.dk, dkp);
  stage_async(As, sv, v + vrow, ge.v_rs, n, cp, ge.dv, dvp);
  stage_async(Ss, sk, St_g, ge.dk, ge.dv, dvp, ge.dk, dkp);
  stage_async(Ts, kCS, Tinv + (c * ge.hv + h) * ge.chunk * ge.chunk, ge.chunk, ge.chunk, cp, ge.chunk, cp);
  mma::cp_async_commit();
  for (int r = tid; r < kMaxC; r += blockDim.x) {
    beta_s[r] = r < n ? to_f32(beta[(c0 + r) * ge.hv + h]) : 0.f;
    dG[r] = 0.f;
    dbeta_acc[r] = 0.f;
  }
  load_gate_table(cg, gate_row(table, c, ge.hv, h), n);
  mma::cp_async_wait<0>();
  __syncthreads();
  // 2. QK = scale·Q·Kᵀ, KK = K·Kᵀ (F32), T·diag(β) and T·diag(β·γ) as the intra kernel made them.
  block_mma<false, true>(cp, cp, dkp, Qs, sk, Ks, sk,
                         [&](int i, int j, float acc) { QKf[i * kFS + j] = scale * acc; });
  block_mma<false, true>(cp, cp, dkp, Ks, sk, Ks, sk, [&](int i, int j, float acc) { KKf[i * kFS + j] = acc; });
  for (int x = tid; x < cp * cp; x += blockDim.x) {
    const int i = x / cp, j = x % cp;
    const float tf = __bfloat162float(Ts[i * kCS + j]);
    TB[i * kCS + j] = __float2bfloat16_rn(tf * beta_s[j]);
    TBG[i * kCS + j] = __float2bfloat16_rn(j < n ? tf * beta_s[j] * cg.gamma[j] : 0.f);
  }
  __syncthreads();
  // 3. [U | W] = [T·diag(β)·V | T·diag(βγ)·K].
  block_mma<false, false>(cp, dvp, cp, TB, kCS, As, sv,
                          [&](int i, int e, float acc) { UW[i * suw + e] = __float2bfloat16_rn(acc); });
  block_mma<false, false>(cp, dkp, cp, TBG, kCS, Ks, sk,
                          [&](int i, int a, float acc) { UW[i * suw + dvp + a] = __float2bfloat16_rn(acc); });
  __syncthreads();
  // 4. V_new = U − W·S (S from Sᵀ: B(a, e) = St[e][a], stored [N][K]).
  block_mma<false, true>(cp, dvp, dkp, UW + dvp, suw, Ss, sk, [&](int i, int e, float acc) {
    Vnb[i * sv + e] = __float2bfloat16_rn(i < n && e < ge.dv ? __bfloat162float(UW[i * suw + e]) - acc : 0.f);
  });
  __syncthreads();
  // 5. M = dO·V_newᵀ (dP of P = QK ⊙ D).
  stage_now(As, sv, dout + vrow, ge.v_rs, n, cp, ge.dv, dvp);
  block_mma<false, true>(cp, cp, dvp, As, sv, Vnb, sv, [&](int i, int j, float acc) { Mf[i * kFS + j] = acc; });
  __syncthreads();
  // 6. O_i ∋ D_ij·(q_i·k_j)·V_new_j: dG_i += t_ij, dG_j −= t_ij with t = D ⊙ M ⊙ QK; then M ⊙ D.
  if (tid < n) {
    float sum = 0.f;
    for (int j = 0; j <= tid; ++j) sum += decay(cg, tid, j) * Mf[tid * kFS + j] * QKf[tid * kFS + j];
    row_acc[tid] = sum;
  } else if (tid >= kMaxC && tid - kMaxC < n) {
    const int j = tid - kMaxC;
    float sum = 0.f;
    for (int i = j; i < n; ++i) sum += decay(cg, i, j) * Mf[i * kFS + j] * QKf[i * kFS + j];
    col_acc[j] = sum;
  }
  for (int x = tid; x < cp * cp; x += blockDim.x) {
    const int i = x / cp, j = x % cp;
    MDb[i * kCS + j] = __float2bfloat16_rn(i < n && j < n ? Mf[i * kFS + j] * decay(cg, i, j) : 0.f);
  }
  __syncthreads();
  if (tid < n) dG[tid] += row_acc[tid] - col_acc[tid];
  // 7. dO·Sᵀ (B(e, a) = St[e][a], stored [K][N]); dG_i += γ_i·scale·q_i·(S·dO_i).
  block_mma<false, false>(cp, dkp, dvp, As, sv, Ss, sk,
                          [&](int i, int a, float acc) { accf[i * acc_stride + a] = acc; });
  __syncthreads();
  for (int i = warp; i < n; i += warps) {
    const float dot = row_dot(Qs + i * sk, accf + i * acc_stride, ge.dk);
    if (lane == 0) dG[i] += cg.gamma[i] * scale * dot;
  }
  // 8. dq = scale·(diag(γ)·dO·Sᵀ + (M ⊙ D)·K), summed over the group's value heads.
  block_mma<false, false>(cp, dkp, cp, MDb, kCS, Ks, sk, [&](int i, int a, float acc) {
    if (i < n && a < ge.dk) {
      float x = scale * (cg.gamma[i] * accf[i * acc_stride + a] + acc);
      bf16* o = dq + (c0 + i) * ge.q_rs + kh * ge.dk + a;
      if (member > 0) x += __bfloat162float(*o);
      *o = __float2bfloat16_rn(x);
    }
  });
  __syncthreads();
  // 9. S' ∋ Kᵀ·diag(d)·V_new: dk_r = d_r·(dS·V_new_r) + ..., dG_last += t_r, dG_r −= t_r, plus the
  // state's own decay γ_n·⟨S, dS⟩. dS from dSᵀ: B(e, a) = dSt[e][a], stored [K][N].
  stage_now(Ss, sk, dSt_g, ge.dk, ge.dv, dvp, ge.dk, dkp);
  block_mma<false, false>(cp, dkp, dvp, Vnb, sv, Ss, sk,
                          [&](int i, int a, float acc) { accf[i * acc_stride + a] = acc; });
  __syncthreads();
  for (int r = warp; r < kMaxC; r += warps) {
    const float dot = r < n ? row_dot(Ks + r * sk, accf + r * acc_stride, ge.dk) : 0.f;
    if (lane == 0) {
      row_acc[r] = cg.last[r] * dot;
      if (r < n) dG[r] -= row_acc[r];
    }
  }
  // ⟨S, dS⟩: S from global in 16-byte vectors, all of a thread's loads in flight at once; dSᵀ staged.
  float part = 0.f;
  {
    const int vecs_per_row = ge.dk / 8, vecs = ge.dv * vecs_per_row;
#pragma unroll 8
    for (int x = tid; x < vecs; x += blockDim.x) {
      const uint4 raw = reinterpret_cast<const uint4*>(St_g)[x];
      const bf16* sv8 = reinterpret_cast<const bf16*>(&raw);
      const bf16* ds8 = Ss + (x / vecs_per_row) * sk + (x % vecs_per_row) * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) part = fmaf(__bfloat162float(sv8[e]), __bfloat162float(ds8[e]), part);
    }
  }
  const float state_dot = block_sum(part, red);  // synchronises
  if (tid == 0) {
    float sum = 0.f;
    for (int r = 0; r < n; ++r) sum += row_acc[r];
    dG[n - 1] += cg.gamma_last * state_dot + sum;
  }
  // 10. dk = d ⊙ (V_new·dSᵀ) + scale·(M ⊙ D)ᵀ·Q so far.
  block_mma<true, false>(cp, dkp, cp, MDb, kCS, Qs, sk, [&](int i, int a, float acc) {
    accf[i * acc_stride + a] = cg.last[i] * accf[i * acc_stride + a] + scale * acc;
  });
  __syncthreads();
  // 11. Through V_new = U − W·S: [dBu | dBw] = [dV_new | −dV_new·Sᵀ].
  bf16* DB = As;
  stage_async(Ss, sk, St_g, ge.dk, ge.dv, dvp, ge.dk, dkp);
  stage_async(DB, suw, dvn + vrow, ge.v_rs, n, cp, ge.dv, dvp);
  mma::cp_async_commit();
  mma::cp_async_wait<0>();
  __syncthreads();
  block_mma<false, false>(cp, dkp, dvp, DB, suw, Ss, sk, [&](int i, int a, float acc) {
    DB[i * suw + dvp + a] = __float2bfloat16_rn(i < n && a < ge.dk ? -acc : 0.f);
  });
  __syncthreads();
  // 12. Y = (I + A)⁻ᵀ·[dBu | dBw] = Tᵀ·[...]; dv = β·Yu; dk += β·γ·Yw.
  bf16* Y = Ss;
  block_mma<true, false>(cp, dvp + dkp, cp, Ts, kCS, DB, suw, [&](int i, int x, float acc) {
    Y[i * suw + x] = __float2bfloat16_rn(acc);
    if (i >= n) return;
    if (x < dvp) {
      if (x < ge.dv) dv[vrow + i * ge.v_rs + x] = __float2bfloat16_rn(beta_s[i] * acc);
    } else if (x - dvp < ge.dk) {
      accf[i * acc_stride + x - dvp] += beta_s[i] * cg.gamma[i] * acc;
    }
  });
  __syncthreads();
  // 13. dβ_i = v_i·Yu_i + γ_i·k_i·Yw_i; dG_i += γ_i·β_i·k_i·Yw_i (V staged again where DB was).
  stage_now(As, sv, v + vrow, ge.v_rs, n, cp, ge.dv, dvp);
  for (int i = warp; i < n; i += warps) {
    const float vb = row_dot(As + i * sv, Y + i * suw, ge.dv);
    const float kb = row_dot(Ks + i * sk, Y + i * suw + dvp, ge.dk);
    if (lane == 0) {
      dbeta_acc[i] = vb + cg.gamma[i] * kb;
      dG[i] += cg.gamma[i] * beta_s[i] * kb;
    }
  }
  // 14. E = dA ⊙ D on the strict lower triangle of each segment, dA = −(Yu·Uᵀ + Yw·Wᵀ).
  block_mma<false, true>(cp, cp, dvp + dkp, Y, suw, UW, suw, [&](int i, int j, float acc) {
    Ef[i * kFS + j] = i < n && j < i && cg.seg[i] == cg.seg[j] ? -acc * expf(cg.G[i] - cg.G[j]) : 0.f;
  });
  __syncthreads();
  // 15. A_ij = β_i·(k_i·k_j)·D_ij: dβ_i += Σ_j E_ij·kk_ij; dG_i += β_i·E_ij·kk_ij, dG_j −= the same.
  if (tid < n) {
    float sum = 0.f;
    for (int j = 0; j < tid; ++j) sum += Ef[tid * kFS + j] * KKf[tid * kFS + j];
    dbeta_acc[tid] += sum;
    row_acc[tid] = beta_s[tid] * sum;
  } else if (tid >= kMaxC && tid - kMaxC < n) {
    const int j = tid - kMaxC;
    float sum = 0.f;
    for (int i = j + 1; i < n; ++i) sum += beta_s[i] * Ef[i * kFS + j] * KKf[i * kFS + j];
    col_acc[j] = sum;
  }
  for (int x = tid; x < cp * cp; x += blockDim.x) {
    const int i = x / cp, j = x % cp;
    Bsym[i * kCS + j] = __float2bfloat16_rn(beta_s[i] * Ef[i * kFS + j] + beta_s[j] * Ef[j * kFS + i]);
  }
  __syncthreads();
  if (tid < n) dG[tid] += row_acc[tid] - col_acc[tid];
  // 16. dk += (βE + (βE)ᵀ)·K, summed over the group's value heads.
  block_mma<false, false>(cp, dkp, cp, Bsym, kCS, Ks, sk, [&](int i, int a, float acc) {
    if (i < n && a < ge.dk) {
      float x = accf[i * acc_stride + a] + acc;
      bf16* o = dk + (c0 + i) * ge.q_rs + kh * ge.dk + a;
      if (member > 0) x += __bfloat162float(*o);
      *o = __float2bfloat16_rn(x);
    }
  });
  __syncthreads();
  // 17. G_r = Σ_{s ≤ r} g_s within the segment: dg_r = Σ of dG over the rest of r's segment.
  if (tid == 0) {
    float suffix = 0.f;
    for (int r = n - 1; r >= 0; --r) {
      if (r == n - 1 || cg.seg[r + 1] != cg.seg[r]) suffix = 0.f;
      suffix += dG[r];
      dg[(c0 + r) * ge.hv + h] = suffix;
      dbeta[(c0 + r) * ge.hv + h] = __float2bfloat16_rn(dbeta_acc[r]);
    }
  }
}

template <typename Kernel>
void launch_prep(Kernel kernel, size_t smem) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
}

size_t optin_smem() {
  int device = 0, bytes = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return static_cast<size_t>(bytes);
}

// Static shared memory of the grads kernel (ChunkGates and six [64] arrays), with room.
constexpr size_t kGradsStaticSmem = 4096;

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

void run_intra(cudaStream_t s, const MmaGeometry& ge, const bf16* q, const bf16* k, const bf16* v, const float* g,
               const bf16* beta, const int32_t* doc, float scale, const bf16* dout, bf16* W, bf16* U, bf16* Tinv,
               bf16* dvn, float* table) {
  const size_t smem = intra_smem(ge);
  launch_prep(delta_intra_mma_kernel, smem);
  delta_intra_mma_kernel<<<dim3(static_cast<unsigned>(ge.chunks), ge.hv), kWideThreads, smem, s>>>(
      ge, q, k, v, g, beta, doc, scale, dout, W, U, Tinv, dvn, table);
  CUDA_CHECK_LAUNCH();
}

void run_state(cudaStream_t s, const MmaGeometry& ge, const bf16* k, const bf16* W, const bf16* U,
               const float* table, bf16* states, bf16* vnew) {
  const size_t smem = state_smem(ge);
  launch_prep(delta_state_mma_kernel, smem);
  delta_state_mma_kernel<<<dim3(ge.hv, ge.dvp / kSlice), kSeqThreads, smem, s>>>(ge, k, W, U, table, states, vnew);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool gated_delta_rule_mma_supported(const DeltaRuleShape& sh, DType io, std::initializer_list<const void*> tensors) {
  if (io != DType::BF16 || !delta_rule_tensor_core_shape(sh)) return false;
  for (const void* p : tensors)
    if (!aligned16(p)) return false;
  const MmaGeometry ge = mma_geometry(sh);
  const size_t limit = optin_smem();
  return grads_layout(ge).total + kGradsStaticSmem <= limit && dstate_smem(ge) <= limit && output_smem(ge) <= limit;
}

void gated_delta_rule_forward_mma(cudaStream_t s, const DeltaRuleShape& sh, const void* q, const void* k,
                                  const void* v, const float* g, const void* beta, const int32_t* doc_ids,
                                  float scale, void* out) {
  const MmaGeometry ge = mma_geometry(sh);
  const auto* qb = static_cast<const bf16*>(q);
  const auto* kb = static_cast<const bf16*>(k);
  // In DeltaRuleMmaScratch::forward's order (spindle plan counts that list).
  const DeltaRuleMmaScratch bytes = delta_rule_mma_scratch(sh);
  Scratch w(s, bytes.per_key), u(s, bytes.per_value), table(s, bytes.gates), states(s, bytes.per_state),
      vnew(s, bytes.per_value);
  run_intra(s, ge, qb, kb, static_cast<const bf16*>(v), g, static_cast<const bf16*>(beta), doc_ids, scale, nullptr,
            w.as<bf16>(), u.as<bf16>(), nullptr, nullptr, table.as<float>());
  run_state(s, ge, kb, w.as<bf16>(), u.as<bf16>(), table.as<float>(), states.as<bf16>(), vnew.as<bf16>());
  const size_t smem = output_smem(ge);
  launch_prep(delta_output_mma_kernel, smem);
  delta_output_mma_kernel<<<dim3(static_cast<unsigned>(ge.chunks), ge.hv), kWideThreads, smem, s>>>(
      ge, qb, kb, table.as<float>(), states.as<bf16>(), vnew.as<bf16>(), scale, static_cast<bf16*>(out));
  CUDA_CHECK_LAUNCH();
}

void gated_delta_rule_backward_mma(cudaStream_t s, const DeltaRuleShape& sh, const void* q, const void* k,
                                   const void* v, const float* g, const void* beta, const int32_t* doc_ids,
                                   float scale, const void* dout, void* dq, void* dk, void* dv, float* dg,
                                   void* dbeta) {
  const MmaGeometry ge = mma_geometry(sh);
  const auto* qb = static_cast<const bf16*>(q);
  const auto* kb = static_cast<const bf16*>(k);
  const auto* vb = static_cast<const bf16*>(v);
  const auto* bb = static_cast<const bf16*>(beta);
  const auto* dob = static_cast<const bf16*>(dout);
  // DeltaRuleMmaScratch::backward lists what is live at the reverse pass, the peak (spindle plan
  // counts that list): U is freed before the state gradients are allocated.
  const DeltaRuleMmaScratch bytes = delta_rule_mma_scratch(sh);
  Scratch table(s, bytes.gates), tinv(s, bytes.inverse), states(s, bytes.per_state), dvn(s, bytes.per_value);
  std::optional<Scratch> w, u, dstates;
  w.emplace(s, bytes.per_key);
  u.emplace(s, bytes.per_value);
  run_intra(s, ge, qb, kb, vb, g, bb, doc_ids, scale, dob, w->as<bf16>(), u->as<bf16>(), tinv.as<bf16>(),
            dvn.as<bf16>(), table.as<float>());
  run_state(s, ge, kb, w->as<bf16>(), u->as<bf16>(), table.as<float>(), states.as<bf16>(), nullptr);
  u.reset();  // the grads recompute U from T; its bytes serve the reverse pass (stream-ordered)
  dstates.emplace(s, bytes.per_state);
  size_t smem = dstate_smem(ge);
  launch_prep(delta_dstate_mma_kernel, smem);
  delta_dstate_mma_kernel<<<dim3(ge.hv, ge.dvp / kSlice), kSeqThreads, smem, s>>>(
      ge, qb, kb, w->as<bf16>(), dob, table.as<float>(), scale, dvn.as<bf16>(), dstates->as<bf16>());
  CUDA_CHECK_LAUNCH();
  w.reset();
  smem = grads_layout(ge).total;
  launch_prep(delta_grads_mma_kernel, smem);
  for (int member = 0; member < ge.group; ++member) {
    delta_grads_mma_kernel<<<dim3(static_cast<unsigned>(ge.chunks), ge.hk), kWideThreads, smem, s>>>(
        ge, member, qb, kb, vb, bb, scale, dob, table.as<float>(), tinv.as<bf16>(), states.as<bf16>(),
        dstates->as<bf16>(), dvn.as<bf16>(), static_cast<bf16*>(dq), static_cast<bf16*>(dk), static_cast<bf16*>(dv),
        dg, static_cast<bf16*>(dbeta));
    CUDA_CHECK_LAUNCH();
  }
}

}  // namespace spindle::cuda
