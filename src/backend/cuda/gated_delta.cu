// The chunked gated delta rule (backend.h: gated_delta_rule_forward/backward), F32 arithmetic on
// F32 or BF16 storage. BF16 tensors of the usual shapes go to the tensor-core kernels of
// gated_delta_mma.cu instead (gated_delta_rule_mma_supported); the F32-FMA kernels below run F32
// tensors (the tests hold them to 1e-4 against the CPU, which BF16 operands would not reach) and
// what the tensor-core kernels do not take. The algorithm is the one the CPU reference computes
// (docs/models.md): chunks of C ≤ 64 tokens, inside a chunk the WY form
//   A = strictly_lower(diag(β)·K·Kᵀ ⊙ D),  U = (I + A)⁻¹·diag(β)·V,  W = (I + A)⁻¹·diag(β·γ)·K,
//   V_new = U − W·S,  O = diag(γ)·Q·S + lower(Q·Kᵀ ⊙ D)·V_new,  S' = γ_n·S + Kᵀ·diag(d)·V_new,
// with D_ij = exp(G_i − G_j) (G the cumulative log decay inside the chunk), γ_i = exp(G_i), d_r = D_nr.
//
// Packed documents: the chunk grid is fixed (chunk c covers tokens [c·C, c·C + C) of the row) and a
// chunk may hold a document boundary. Inside a chunk the tokens form segments (runs of equal doc
// ids); G restarts at every segment, D_ij is zero across segments, γ_i is zero unless token i is in
// the chunk's first segment and that segment continues the previous chunk's document, and d_r is
// zero unless r is in the last token's segment. That is exactly a state reset at every document
// start (α = 0 there), so no state or gradient crosses a boundary, with no host-side chunk list.
//
// Kernels (per value head h; its key head is h / (Hv/Hk)):
//   intra    one block per (chunk, head): A, then U and W by forward substitution (F32 scratch).
//   state    one block per (head, 32 value columns), sequential over chunks: the state slice
//            S [dk, 32] in F32 shared memory; writes the output (forward), or the chunk-entering
//            states and V_new (backward recomputation).
//   dstate   the same, in reverse: dS (gradient of the chunk-exiting state), dV_new.
//   grads    one block per (chunk, head): dq, dk (per value head, F32), dv, dβ, dg.
//   reduce   dq and dk summed over the value heads that share a key head.
// Small matrix products run through block_mm: F32 FMAs, a 4×4 register tile per thread, operands
// read from shared memory or straight from global memory (L1/L2), no tensor cores.
//
// Work per chunk and value head (n = C = 64, d = dk = dv = 128), in multiply-adds (MAC):
//   forward: intra K·Kᵀ and Q·Kᵀ 2·n²·d (1 M) + the substitution n²·2d/2 (0.5 M); state W·S, Q·S and
//   Kᵀ·V_new 3·n·d² (3.1 M) + P·V_new n²·d (0.5 M): ≈ 5.1 M MAC.
//   backward: intra 1.5 M + state recomputation (no output) 2.1 M + dstate (Pᵀ·dO, K·dS, Qᵀ·dO,
//   Wᵀ·dV_new ≈ 3.7 M) + grads (Q·Kᵀ, K·Kᵀ, dO·V_newᵀ, dO·Sᵀ, V_new·dSᵀ, dV_new·Sᵀ, M·K, Mᵀ·Q,
//   dBu·Uᵀ, dBw·Wᵀ, 2 × E·K, the back substitution ≈ 8 M) ≈ 15 M MAC.
// At T = 32k and Hv = 32 (16k chunk-heads): ≈ 0.17 TFLOP forward, ≈ 0.5 TFLOP backward. The
// sequential kernels run Hv·dv/32 = 128 blocks, each a chain of T/C dependent chunk steps: latency,
// not FLOPs, bounds them (at BF16 these kernels took 62 ms forward, 176 ms backward at 32k on an
// H200, the tensor-core ones 7.3 and 21.6: docs/perf.md). Bytes: the F32 scratch dominates
// (W, U, V_new, dV_new, per-value-head dq and dk: 6·T·Hv·d·4 B; P: (T/C)·Hv·C²·4 B; the chunk
// states 2·(T/C)·Hv·dk·dv·4 B), each written once and read a few times.
#include <algorithm>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/gated_delta_common.cuh"
#include "backend/cuda/gated_delta.h"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxC = kDeltaRuleMaxChunk;
constexpr int kSlice = 32;  // value columns of the state per block of the sequential kernels
constexpr int kSliceStride = kSlice + 1;  // row stride of a state slice in shared memory: no bank conflicts
                                          // when it is written out transposed

using delta::ChunkGates;
using delta::decay;
using delta::load_gates;

// For i < M, j < N: epi(i, j, Σ_k a(i, k)·b(k, j)) with a(i, k) = A[i·a_rs + k·a_cs]·kscale[k]
// (kscale null: 1) and b(k, j) = B[k·b_rs + j·b_cs]. Each thread owns 4×4 output tiles, assigned by
// (M, N) alone: two calls of the same M and N give every element to the same thread, so an
// epilogue may read what the previous call's epilogue wrote there. Called by all threads.
template <typename TA, typename TB, typename Epi>
__device__ __forceinline__ void block_mm(int M, int N, int K, const TA* A, int64_t a_rs, int64_t a_cs, const TB* B,
                                         int64_t b_rs, int64_t b_cs, const float* kscale, Epi epi) {
  const int tiles_n = (N + 3) / 4, tiles = ((M + 3) / 4) * tiles_n;
  for (int tile = threadIdx.x; tile < tiles; tile += blockDim.x) {
    const int i0 = (tile / tiles_n) * 4, j0 = (tile % tiles_n) * 4;
    float acc[4][4] = {};
#pragma unroll 4
    for (int k = 0; k < K; ++k) {
      const float ks = kscale ? kscale[k] : 1.f;
      float a[4], b[4];
#pragma unroll
      for (int r = 0; r < 4; ++r) a[r] = i0 + r < M ? to_f32(A[(i0 + r) * a_rs + k * a_cs]) * ks : 0.f;
#pragma unroll
      for (int c = 0; c < 4; ++c) b[c] = j0 + c < N ? to_f32(B[k * b_rs + (j0 + c) * b_cs]) : 0.f;
#pragma unroll
      for (int r = 0; r < 4; ++r)
#pragma unroll
        for (int c = 0; c < 4; ++c) acc[r][c] = fmaf(a[r], b[c], acc[r][c]);
    }
#pragma unroll
    for (int r = 0; r < 4; ++r)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        if (i0 + r < M && j0 + c < N) epi(i0 + r, j0 + c, acc[r][c]);
  }
}

// dst [n, d] (row stride d, F32) = rows of d elements of src at row stride src_rs. All threads.
template <typename TS>
__device__ __forceinline__ void stage_rows(float* dst, const TS* src, int64_t src_rs, int n, int d) {
  for (int x = threadIdx.x; x < n * d; x += blockDim.x) dst[x] = to_f32(src[(x / d) * src_rs + x % d]);
}

struct Geometry {
  int64_t tokens;
  int hk, hv, dk, dv, chunk, group;
  int64_t q_rs, v_rs, w_rs;  // row strides (one token) of q/k [T, Hk, dk], v-like [T, Hv, dv], W-like [T, Hv, dk]
  __host__ __device__ int64_t chunks() const { return (tokens + chunk - 1) / chunk; }
};

Geometry geometry(const DeltaRuleShape& sh) {
  Geometry g{sh.tokens, sh.key_heads, sh.value_heads, sh.dk, sh.dv, sh.chunk, sh.value_heads / sh.key_heads,
             0,         0,            0};
  g.q_rs = static_cast<int64_t>(sh.key_heads) * sh.dk;
  g.v_rs = static_cast<int64_t>(sh.value_heads) * sh.dv;
  g.w_rs = static_cast<int64_t>(sh.value_heads) * sh.dk;
  return g;
}

// ---- intra: U [T, Hv, dv], W [T, Hv, dk] and P [chunks, Hv, C, C] (F32) of every chunk ---------------
// P = lower(Q·Kᵀ ⊙ D)·scale, the in-chunk attention of the output. Dynamic shared: A [C, C],
// X [C, dv + dk] (U's columns, then W's), Ks, Qs [C, dk].
template <typename T>
__global__ void __launch_bounds__(kThreads) delta_intra_kernel(Geometry ge, const T* q, const T* k, const T* v,
                                                               const float* g, const T* beta, const int32_t* doc,
                                                               float scale, float* W, float* U, float* P) {
  extern __shared__ float smem[];
  __shared__ ChunkGates cg;
  __shared__ float beta_s[kMaxC];
  const int C = ge.chunk, h = blockIdx.y, kh = h / ge.group, dk = ge.dk;
  const int64_t c = blockIdx.x, c0 = c * C;
  load_gates(cg, g, doc, ge.tokens, ge.hv, h, c0, C);
  const int n = cg.n, cols = ge.dv + dk;
  float* A = smem;
  float* X = A + C * C;
  float* Ks = X + C * cols;
  float* Qs = Ks + C * dk;
  for (int r = threadIdx.x; r < n; r += blockDim.x) beta_s[r] = to_f32(beta[(c0 + r) * ge.hv + h]);
  stage_rows(Ks, k + (c0 * ge.hk + kh) * dk, ge.q_rs, n, dk);
  stage_rows(Qs, q + (c0 * ge.hk + kh) * dk, ge.q_rs, n, dk);
  __syncthreads();
  block_mm(n, n, dk, Ks, dk, 1, Ks, 1, dk, nullptr, [&](int i, int j, float acc) {
    A[i * C + j] = i > j && cg.seg[i] == cg.seg[j] ? beta_s[i] * acc * expf(cg.G[i] - cg.G[j]) : 0.f;
  });
  float* Pc = P + (c * ge.hv + h) * C * C;
  block_mm(n, n, dk, Qs, dk, 1, Ks, 1, dk, nullptr,
           [&](int i, int j, float acc) { Pc[i * C + j] = decay(cg, i, j) * scale * acc; });
  __syncthreads();
  // Forward substitution (I + A)·X = rhs, one column per thread: columns are independent.
  const T* vc = v + (c0 * ge.hv + h) * ge.dv;
  for (int col = threadIdx.x; col < cols; col += blockDim.x) {
    const bool is_u = col < ge.dv;
    for (int i = 0; i < n; ++i) {
      float x = is_u ? beta_s[i] * to_f32(vc[i * ge.v_rs + col]) : beta_s[i] * cg.gamma[i] * Ks[i * dk + (col - ge.dv)];
      for (int j = 0; j < i; ++j) x = fmaf(-A[i * C + j], X[j * cols + col], x);
      X[i * cols + col] = x;
      if (is_u) U[((c0 + i) * ge.hv + h) * ge.dv + col] = x;
      else W[((c0 + i) * ge.hv + h) * dk + (col - ge.dv)] = x;
    }
  }
}

// ---- state: the sequential pass over chunks, forward -------------------------------------------
// Block (h, slice): value columns [e0, e0 + ns). out (forward) or states [chunks, Hv, dk, dv] and
// vnew [T, Hv, dv] (recomputation for the backward; the states transposed, [.., dv, dk]). Every operand of a chunk is staged in shared
// memory first: the chain of chunks is latency-bound. Dynamic shared: S [dk, kSliceStride],
// vn, o [C, kSlice], Ps [C, C], Ws, Qs, Ks [C, dk].
template <typename T>
__global__ void __launch_bounds__(kThreads) delta_state_kernel(Geometry ge, const T* q, const T* k, const float* g,
                                                               const int32_t* doc, float scale, const float* W,
                                                               const float* U, const float* P, T* out, float* states,
                                                               float* vnew) {
  extern __shared__ float smem[];
  __shared__ ChunkGates cg;
  const int C = ge.chunk, h = blockIdx.x, kh = h / ge.group, e0 = blockIdx.y * kSlice, dk = ge.dk;
  const int ns = min(kSlice, ge.dv - e0);
  float* S = smem;
  float* vn = S + dk * kSliceStride;
  float* o = vn + C * kSlice;
  float* Ps = o + C * kSlice;
  float* Ws = Ps + C * C;
  float* Qs = Ws + C * dk;
  float* Ks = Qs + C * dk;
  for (int x = threadIdx.x; x < dk * kSliceStride; x += blockDim.x) S[x] = 0.f;
  const int64_t chunks = ge.chunks();
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t c0 = c * C;
    load_gates(cg, g, doc, ge.tokens, ge.hv, h, c0, C);  // also orders the zeroing / last update of S
    const int n = cg.n;
    if (states)
      for (int x = threadIdx.x; x < dk * ns; x += blockDim.x) {  // transposed: [dv, dk]
        const int a = x % dk, e = x / dk;
        states[((c * ge.hv + h) * ge.dv + e0 + e) * dk + a] = S[a * kSliceStride + e];
      }
    stage_rows(Ws, W + (c0 * ge.hv + h) * dk, ge.w_rs, n, dk);
    stage_rows(Ks, k + (c0 * ge.hk + kh) * dk, ge.q_rs, n, dk);
    if (out) {
      stage_rows(Qs, q + (c0 * ge.hk + kh) * dk, ge.q_rs, n, dk);
      const float* Pc = P + (c * ge.hv + h) * C * C;
      for (int x = threadIdx.x; x < n * n; x += blockDim.x) Ps[(x / n) * C + x % n] = Pc[(x / n) * C + x % n];
    }
    __syncthreads();
    const float* Uc = U + (c0 * ge.hv + h) * ge.dv + e0;
    // V_new = U − W·S
    block_mm(n, ns, dk, Ws, dk, 1, S, kSliceStride, 1, nullptr,
             [&](int i, int j, float acc) { vn[i * kSlice + j] = Uc[i * ge.v_rs + j] - acc; });
    __syncthreads();
    if (vnew)
      for (int x = threadIdx.x; x < n * ns; x += blockDim.x) {
        const int i = x / ns, e = x % ns;
        vnew[((c0 + i) * ge.hv + h) * ge.dv + e0 + e] = vn[i * kSlice + e];
      }
    if (out) {
      // O = diag(γ)·Q·S·scale + P·V_new.
      block_mm(n, ns, dk, Qs, dk, 1, S, kSliceStride, 1, nullptr,
               [&](int i, int j, float acc) { o[i * kSlice + j] = cg.gamma[i] * scale * acc; });
      __syncthreads();
      T* oc = out + (c0 * ge.hv + h) * ge.dv + e0;
      block_mm(n, ns, n, Ps, C, 1, vn, kSlice, 1, nullptr,
               [&](int i, int j, float acc) { oc[i * ge.v_rs + j] = from_f32<T>(o[i * kSlice + j] + acc); });
      __syncthreads();
    }
    for (int x = threadIdx.x; x < n * ns; x += blockDim.x) vn[(x / ns) * kSlice + x % ns] *= cg.last[x / ns];
    __syncthreads();
    // S' = γ_n·S + Kᵀ·diag(d)·V_new
    const float gl = cg.gamma_last;
    block_mm(dk, ns, n, Ks, 1, dk, vn, kSlice, 1, nullptr,
             [&](int a, int j, float acc) { S[a * kSliceStride + j] = gl * S[a * kSliceStride + j] + acc; });
    __syncthreads();
  }
}

// ---- dstate: the sequential pass in reverse ----------------------------------------------------
// dstates [chunks, Hv, dv, dk] (transposed): ∂L/∂(state leaving chunk c); dvnew [T, Hv, dv]. Dynamic shared:
// dS [dk, kSliceStride], dvn [C, kSlice], Ps [C, C], Qs, Ks, Ws [C, dk].
template <typename T>
__global__ void __launch_bounds__(kThreads) delta_dstate_kernel(Geometry ge, const T* q, const T* k, const float* g,
                                                                const int32_t* doc, float scale, const float* W,
                                                                const float* P, const T* dout, float* dstates,
                                                                float* dvnew) {
  extern __shared__ float smem[];
  __shared__ ChunkGates cg;
  const int C = ge.chunk, h = blockIdx.x, kh = h / ge.group, e0 = blockIdx.y * kSlice, dk = ge.dk;
  const int ns = min(kSlice, ge.dv - e0);
  float* dS = smem;
  float* dvn = dS + dk * kSliceStride;
  float* Ps = dvn + C * kSlice;
  float* Qs = Ps + C * C;
  float* Ks = Qs + C * dk;
  float* Ws = Ks + C * dk;
  for (int x = threadIdx.x; x < dk * kSliceStride; x += blockDim.x) dS[x] = 0.f;
  for (int64_t c = ge.chunks() - 1; c >= 0; --c) {
    const int64_t c0 = c * C;
    load_gates(cg, g, doc, ge.tokens, ge.hv, h, c0, C);
    const int n = cg.n;
    for (int x = threadIdx.x; x < dk * ns; x += blockDim.x) {  // transposed: [dv, dk]
      const int a = x % dk, e = x / dk;
      dstates[((c * ge.hv + h) * ge.dv + e0 + e) * dk + a] = dS[a * kSliceStride + e];
    }
    stage_rows(Qs, q + (c0 * ge.hk + kh) * dk, ge.q_rs, n, dk);
    stage_rows(Ks, k + (c0 * ge.hk + kh) * dk, ge.q_rs, n, dk);
    stage_rows(Ws, W + (c0 * ge.hv + h) * dk, ge.w_rs, n, dk);
    const float* Pc = P + (c * ge.hv + h) * C * C;
    for (int x = threadIdx.x; x < n * n; x += blockDim.x) Ps[(x / n) * C + x % n] = Pc[(x / n) * C + x % n];
    __syncthreads();
    const T* doc_ = dout + (c0 * ge.hv + h) * ge.dv + e0;
    // dV_new = Pᵀ·dO + diag(d)·K·dS
    block_mm(n, ns, n, Ps, 1, C, doc_, ge.v_rs, 1, nullptr,
             [&](int i, int j, float acc) { dvn[i * kSlice + j] = acc; });
    __syncthreads();
    block_mm(n, ns, dk, Ks, dk, 1, dS, kSliceStride, 1, nullptr,
             [&](int i, int j, float acc) { dvn[i * kSlice + j] += cg.last[i] * acc; });
    __syncthreads();
    for (int x = threadIdx.x; x < n * ns; x += blockDim.x) {
      const int i = x / ns, e = x % ns;
      dvnew[((c0 + i) * ge.hv + h) * ge.dv + e0 + e] = dvn[i * kSlice + e];
    }
    // dS ← γ_n·dS + (Q ⊙ γ)ᵀ·dO·scale − Wᵀ·dV_new
    const float gl = cg.gamma_last;
    block_mm(dk, ns, n, Qs, 1, dk, doc_, ge.v_rs, 1, cg.gamma,
             [&](int a, int j, float acc) { dS[a * kSliceStride + j] = gl * dS[a * kSliceStride + j] + scale * acc; });
    __syncthreads();
    block_mm(dk, ns, n, Ws, 1, dk, dvn, kSlice, 1, nullptr,
             [&](int a, int j, float acc) { dS[a * kSliceStride + j] -= acc; });
    __syncthreads();
  }
}

// ---- grads: everything else of the backward, one block per (chunk, value head) --------------------
// dqh, dkh [T, Hv, dk] F32: per value head, w.r.t. the scaled q and k. Dynamic shared: QK, KK, M
// [C, C], tmp [C, dk], dBu [C, dv], dBw [C, dk], Qs, Ks [C, dk].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    delta_grads_kernel(Geometry ge, const T* q, const T* k, const T* v, const float* g, const T* beta,
                       const int32_t* doc, float scale, const T* dout, const float* W, const float* U,
                       const float* states, const float* dstates, const float* vnew, const float* dvnew, float* dqh,
                       float* dkh, T* dv, float* dg, T* dbeta) {
  extern __shared__ float smem[];
  __shared__ ChunkGates cg;
  __shared__ float beta_s[kMaxC], dG[kMaxC], row_acc[kMaxC], col_acc[kMaxC], dbeta_acc[kMaxC], red[32];
  const int C = ge.chunk, h = blockIdx.y, kh = h / ge.group;
  const int64_t c = blockIdx.x, c0 = c * C;
  const int tid = threadIdx.x, dk = ge.dk, dvw = ge.dv;
  load_gates(cg, g, doc, ge.tokens, ge.hv, h, c0, C);
  const int n = cg.n;
  float* QK = smem;
  float* KK = QK + C * C;
  float* M = KK + C * C;
  float* tmp = M + C * C;
  float* dBu = tmp + C * dk;
  float* dBw = dBu + C * dvw;
  float* Qs = dBw + C * dk;
  float* Ks = Qs + C * dk;
  stage_rows(Qs, q + (c0 * ge.hk + kh) * dk, ge.q_rs, n, dk);
  stage_rows(Ks, k + (c0 * ge.hk + kh) * dk, ge.q_rs, n, dk);
  const float* qc = Qs;  // [n, dk], row stride q_rs
  const float* kc = Ks;
  const int64_t q_rs = dk;
  const T* vc = v + (c0 * ge.hv + h) * dvw;
  const T* doc_ = dout + (c0 * ge.hv + h) * dvw;
  const float* vnc = vnew + (c0 * ge.hv + h) * dvw;
  const float* dvnc = dvnew + (c0 * ge.hv + h) * dvw;
  const float* Uc = U + (c0 * ge.hv + h) * dvw;
  const float* Wc = W + (c0 * ge.hv + h) * dk;
  const float* S = states + (c * ge.hv + h) * dk * dvw;  // [dv, dk]: Sᵀ
  const float* dS = dstates + (c * ge.hv + h) * dk * dvw;
  float* dqc = dqh + (c0 * ge.hv + h) * dk;
  float* dkc = dkh + (c0 * ge.hv + h) * dk;
  for (int r = tid; r < n; r += blockDim.x) {
    beta_s[r] = to_f32(beta[(c0 + r) * ge.hv + h]);
    dG[r] = 0.f;
  }
  __syncthreads();
  block_mm(n, n, dk, qc, q_rs, 1, kc, 1, q_rs, nullptr,
           [&](int i, int j, float acc) { QK[i * C + j] = scale * acc; });
  block_mm(n, n, dk, kc, q_rs, 1, kc, 1, q_rs, nullptr, [&](int i, int j, float acc) { KK[i * C + j] = acc; });
  block_mm(n, n, dvw, doc_, ge.v_rs, 1, vnc, 1, ge.v_rs, nullptr,
           [&](int i, int j, float acc) { M[i * C + j] = acc; });  // M_ij = dO_i · V_new_j
  __syncthreads();
  // O_i ∋ D_ij·(q_i·k_j)·V_new_j: dG_i += t_ij, dG_j −= t_ij with t = D ⊙ M ⊙ QK.
  if (tid < n) {
    float sum = 0.f;
    for (int j = 0; j <= tid; ++j) sum += decay(cg, tid, j) * M[tid * C + j] * QK[tid * C + j];
    row_acc[tid] = sum;
  } else if (tid >= kMaxC && tid - kMaxC < n) {
    const int j = tid - kMaxC;
    float sum = 0.f;
    for (int i = j; i < n; ++i) sum += decay(cg, i, j) * M[i * C + j] * QK[i * C + j];
    col_acc[j] = sum;
  }
  __syncthreads();
  if (tid < n) dG[tid] += row_acc[tid] - col_acc[tid];
  for (int x = tid; x < n * n; x += blockDim.x) M[(x / n) * C + x % n] *= decay(cg, x / n, x % n);
  __syncthreads();
  // dq = diag(γ)·dO·Sᵀ + (M ⊙ D)·K;  dG_i += γ_i·q_i·(S·dO_i).
  block_mm(n, dk, dvw, doc_, ge.v_rs, 1, S, dk, 1, nullptr, [&](int i, int a, float acc) { tmp[i * dk + a] = acc; });
  __syncthreads();
  if (tid < n && cg.gamma[tid] != 0.f) {
    float sum = 0.f;
    for (int a = 0; a < dk; ++a) sum += to_f32(qc[tid * q_rs + a]) * tmp[tid * dk + a];
    dG[tid] += cg.gamma[tid] * scale * sum;
  }
  block_mm(n, dk, n, M, C, 1, kc, q_rs, 1, nullptr,
           [&](int i, int a, float acc) { dqc[i * ge.w_rs + a] = cg.gamma[i] * tmp[i * dk + a] + acc; });
  __syncthreads();
  // S' ∋ Kᵀ·diag(d)·V_new: dk_r += d_r·(dS·V_new_r), dG_last += t_r, dG_r −= t_r; and dk += (M ⊙ D)ᵀ·Q.
  block_mm(n, dk, dvw, vnc, ge.v_rs, 1, dS, dk, 1, nullptr, [&](int i, int a, float acc) { tmp[i * dk + a] = acc; });
  __syncthreads();
  if (tid < n) {
    float sum = 0.f;
    for (int a = 0; a < dk; ++a) sum += to_f32(kc[tid * q_rs + a]) * tmp[tid * dk + a];
    row_acc[tid] = cg.last[tid] * sum;
    dG[tid] -= row_acc[tid];
  }
  block_mm(n, dk, n, M, 1, C, qc, q_rs, 1, nullptr, [&](int r, int a, float acc) {
    dkc[r * ge.w_rs + a] = cg.last[r] * tmp[r * dk + a] + scale * acc;
  });
  float part = 0.f;
  for (int x = tid; x < dk * dvw; x += blockDim.x) part = fmaf(S[x], dS[x], part);
  const float state_dot = block_sum(part, red);  // synchronises
  if (tid == 0) {
    float sum = 0.f;
    for (int r = 0; r < n; ++r) sum += row_acc[r];
    dG[n - 1] += cg.gamma_last * state_dot + sum;
  }
  // Through V_new = U − W·S: dU = dV_new, dW = −dV_new·Sᵀ; then (I + A)ᵀ·Y = d· by back substitution.
  block_mm(n, dk, dvw, dvnc, ge.v_rs, 1, S, dk, 1, nullptr, [&](int i, int a, float acc) { dBw[i * dk + a] = -acc; });
  for (int x = tid; x < n * dvw; x += blockDim.x) dBu[x] = dvnc[(x / dvw) * ge.v_rs + x % dvw];
  __syncthreads();
  for (int x = tid; x < n * n; x += blockDim.x) {
    const int i = x / n, j = x % n;
    M[i * C + j] = i > j ? beta_s[i] * KK[i * C + j] * decay(cg, i, j) : 0.f;  // A
  }
  __syncthreads();
  for (int col = tid; col < dvw + dk; col += blockDim.x) {
    float* B = col < dvw ? dBu + col : dBw + (col - dvw);
    const int stride = col < dvw ? dvw : dk;
    for (int j = n - 1; j >= 0; --j) {
      float x = B[j * stride];
      for (int i = j + 1; i < n; ++i) x = fmaf(-M[i * C + j], B[i * stride], x);
      B[j * stride] = x;
    }
  }
  __syncthreads();
  // dv = β·dBu; dβ = v·dBu + γ·k·dBw; dk += β·γ·dBw; dG += γ·β·k·dBw.
  T* dvc = dv + (c0 * ge.hv + h) * dvw;
  for (int x = tid; x < n * dvw; x += blockDim.x) {
    const int i = x / dvw, e = x % dvw;
    dvc[i * ge.v_rs + e] = from_f32<T>(beta_s[i] * dBu[x]);
  }
  if (tid < n) {
    float vb = 0.f, kb = 0.f;
    for (int e = 0; e < dvw; ++e) vb = fmaf(to_f32(vc[tid * ge.v_rs + e]), dBu[tid * dvw + e], vb);
    for (int a = 0; a < dk; ++a) kb = fmaf(to_f32(kc[tid * q_rs + a]), dBw[tid * dk + a], kb);
    dbeta_acc[tid] = vb + cg.gamma[tid] * kb;
    dG[tid] += cg.gamma[tid] * beta_s[tid] * kb;
  }
  for (int x = tid; x < n * dk; x += blockDim.x) {
    const int i = x / dk, a = x % dk;
    dkc[i * ge.w_rs + a] += beta_s[i] * cg.gamma[i] * dBw[x];
  }
  __syncthreads();
  // dA = −(dBu·Uᵀ + dBw·Wᵀ) on the strict lower triangle of each segment (QK is free now).
  block_mm(n, n, dvw, dBu, dvw, 1, Uc, 1, ge.v_rs, nullptr, [&](int i, int j, float acc) { QK[i * C + j] = -acc; });
  __syncthreads();
  block_mm(n, n, dk, dBw, dk, 1, Wc, 1, ge.w_rs, nullptr, [&](int i, int j, float acc) { QK[i * C + j] -= acc; });
  __syncthreads();
  for (int x = tid; x < n * n; x += blockDim.x) {
    const int i = x / n, j = x % n;
    QK[i * C + j] = i > j ? QK[i * C + j] * decay(cg, i, j) : 0.f;  // E = dA ⊙ D
  }
  __syncthreads();
  // A_ij = β_i·(k_i·k_j)·D_ij: dβ_i += Σ_j E_ij·kk_ij; dG_i += β_i·E_ij·kk_ij, dG_j −= the same.
  if (tid < n) {
    float sum = 0.f;
    for (int j = 0; j < tid; ++j) sum += QK[tid * C + j] * KK[tid * C + j];
    dbeta_acc[tid] += sum;
    row_acc[tid] = beta_s[tid] * sum;
  } else if (tid >= kMaxC && tid - kMaxC < n) {
    const int j = tid - kMaxC;
    float sum = 0.f;
    for (int i = j + 1; i < n; ++i) sum += beta_s[i] * QK[i * C + j] * KK[i * C + j];
    col_acc[j] = sum;
  }
  __syncthreads();
  if (tid < n) dG[tid] += row_acc[tid] - col_acc[tid];
  for (int x = tid; x < n * n; x += blockDim.x) QK[(x / n) * C + x % n] *= beta_s[x / n];  // β_i·E_ij
  __syncthreads();
  // dk_i += Σ_j β_i·E_ij·k_j and dk_j += Σ_i β_i·E_ij·k_i.
  block_mm(n, dk, n, QK, C, 1, kc, q_rs, 1, nullptr, [&](int i, int a, float acc) { dkc[i * ge.w_rs + a] += acc; });
  __syncthreads();
  block_mm(n, dk, n, QK, 1, C, kc, q_rs, 1, nullptr, [&](int j, int a, float acc) { dkc[j * ge.w_rs + a] += acc; });
  // G_r = Σ_{s ≤ r} g_s within the segment: dg_r = Σ of dG over the rest of r's segment.
  if (tid == 0) {
    float suffix = 0.f;
    for (int r = n - 1; r >= 0; --r) {
      if (r == n - 1 || cg.seg[r + 1] != cg.seg[r]) suffix = 0.f;
      suffix += dG[r];
      dg[(c0 + r) * ge.hv + h] = suffix;
      dbeta[(c0 + r) * ge.hv + h] = from_f32<T>(dbeta_acc[r]);
    }
  }
}

// dq [T, Hk, dk] = scale·Σ over the group's value heads of dqh; dk the same without the scale.
template <typename T>
__global__ void delta_reduce_kernel(Geometry ge, float scale, const float* dqh, const float* dkh, T* dq, T* dk) {
  const int64_t n = ge.tokens * ge.hk * ge.dk;
  for (int64_t x = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; x < n;
       x += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = x / (ge.hk * ge.dk);
    const int kh = static_cast<int>((x / ge.dk) % ge.hk), a = static_cast<int>(x % ge.dk);
    float sq = 0.f, sk = 0.f;
    for (int j = 0; j < ge.group; ++j) {
      const int64_t src = (t * ge.hv + kh * ge.group + j) * ge.dk + a;
      sq += dqh[src];
      sk += dkh[src];
    }
    dq[x] = from_f32<T>(scale * sq);
    dk[x] = from_f32<T>(sk);
  }
}

void check_shape(const DeltaRuleShape& sh, const char* op) {
  if (sh.key_heads <= 0 || sh.value_heads % sh.key_heads != 0) throw_message(op, "value heads must be a multiple of key heads");
  if (sh.dk < 1 || sh.dv < 1 || sh.dk > kDeltaRuleMaxDim || sh.dv > kDeltaRuleMaxDim)
    throw_message(op, "key and value head dims must be 1 ... 128");
  if (sh.chunk < 1 || sh.chunk > kDeltaRuleMaxChunk) throw_message(op, "chunk size must be 1 ... 64");
  if ((sh.tokens + sh.chunk - 1) / sh.chunk > 0x7fffffff) throw_message(op, "too many chunks");
}

size_t intra_smem(const Geometry& ge) {
  return sizeof(float) * (ge.chunk * ge.chunk + ge.chunk * (3 * ge.dk + ge.dv));
}
size_t state_smem(const Geometry& ge) {
  return sizeof(float) * (ge.dk * kSliceStride + 2 * ge.chunk * kSlice + ge.chunk * ge.chunk + 3 * ge.chunk * ge.dk);
}
size_t dstate_smem(const Geometry& ge) {
  return sizeof(float) * (ge.dk * kSliceStride + ge.chunk * kSlice + ge.chunk * ge.chunk + 3 * ge.chunk * ge.dk);
}
size_t grads_smem(const Geometry& ge) {
  return sizeof(float) * (3 * ge.chunk * ge.chunk + ge.chunk * (4 * ge.dk + ge.dv));
}

template <typename Kernel>
void allow_smem(Kernel kernel, size_t smem) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
}

// W, U and P of every chunk (F32 scratch the caller owns).
template <typename T>
void run_intra(cudaStream_t s, const Geometry& ge, const T* q, const T* k, const T* v, const float* g, const T* beta,
               const int32_t* doc, float scale, float* W, float* U, float* P) {
  const size_t smem = intra_smem(ge);
  allow_smem(delta_intra_kernel<T>, smem);
  delta_intra_kernel<T><<<dim3(static_cast<unsigned>(ge.chunks()), ge.hv), kThreads, smem, s>>>(ge, q, k, v, g, beta,
                                                                                                doc, scale, W, U, P);
  CUDA_CHECK_LAUNCH();
}

template <typename T>
void run_state(cudaStream_t s, const Geometry& ge, const T* q, const T* k, const float* g, const int32_t* doc,
               float scale, const float* W, const float* U, const float* P, T* out, float* states, float* vnew) {
  const size_t smem = state_smem(ge);
  allow_smem(delta_state_kernel<T>, smem);
  delta_state_kernel<T><<<dim3(ge.hv, (ge.dv + kSlice - 1) / kSlice), kThreads, smem, s>>>(ge, q, k, g, doc, scale,
                                                                                         W, U, P, out, states, vnew);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

void gated_delta_rule_forward(cudaStream_t s, const DeltaRuleShape& sh, DType io, const void* q, const void* k,
                              const void* v, const float* g, const void* beta, const int32_t* doc_ids, float scale,
                              void* out) {
  check_shape(sh, "gated_delta_rule_forward");
  if (sh.tokens == 0) return;
  if (gated_delta_rule_mma_supported(sh, io, {q, k, v, out})) {
    gated_delta_rule_forward_mma(s, sh, q, k, v, g, beta, doc_ids, scale, out);
    return;
  }
  const Geometry ge = geometry(sh);
  // As DeltaRuleScratch::forward lists them (spindle plan counts that list).
  const DeltaRuleScratch bytes = delta_rule_scratch(sh);
  Scratch w(s, bytes.per_key), u(s, bytes.per_value), p(s, bytes.in_chunk);
  dispatch_compute(io, "gated_delta_rule_forward", [&](auto z) {
    using T = decltype(z);
    const T* qt = static_cast<const T*>(q);
    const T* kt = static_cast<const T*>(k);
    run_intra(s, ge, qt, kt, static_cast<const T*>(v), g, static_cast<const T*>(beta), doc_ids, scale, w.as<float>(),
              u.as<float>(), p.as<float>());
    run_state(s, ge, qt, kt, g, doc_ids, scale, w.as<float>(), u.as<float>(), p.as<float>(), static_cast<T*>(out),
              nullptr, nullptr);
  });
}

void gated_delta_rule_backward(cudaStream_t s, const DeltaRuleShape& sh, DType io, const void* q, const void* k,
                               const void* v, const float* g, const void* beta, const int32_t* doc_ids, float scale,
                               const void* dout, void* dq, void* dk, void* dv, float* dg, void* dbeta) {
  check_shape(sh, "gated_delta_rule_backward");
  if (sh.tokens == 0) return;
  if (gated_delta_rule_mma_supported(sh, io, {q, k, v, dout, dq, dk, dv})) {
    gated_delta_rule_backward_mma(s, sh, q, k, v, g, beta, doc_ids, scale, dout, dq, dk, dv, dg, dbeta);
    return;
  }
  const Geometry ge = geometry(sh);
  // As DeltaRuleScratch::backward lists them (spindle plan counts that list).
  const DeltaRuleScratch bytes = delta_rule_scratch(sh);
  const size_t per_key = bytes.per_key, per_value = bytes.per_value, per_state = bytes.per_state;
  Scratch w(s, per_key), u(s, per_value), vnew(s, per_value), dvnew(s, per_value), states(s, per_state),
      dstates(s, per_state), dqh(s, per_key), dkh(s, per_key), p(s, bytes.in_chunk);
  dispatch_compute(io, "gated_delta_rule_backward", [&](auto z) {
    using T = decltype(z);
    const T* qt = static_cast<const T*>(q);
    const T* kt = static_cast<const T*>(k);
    const T* vt = static_cast<const T*>(v);
    const T* bt = static_cast<const T*>(beta);
    const T* dot = static_cast<const T*>(dout);
    run_intra(s, ge, qt, kt, vt, g, bt, doc_ids, scale, w.as<float>(), u.as<float>(), p.as<float>());
    run_state<T>(s, ge, qt, kt, g, doc_ids, scale, w.as<float>(), u.as<float>(), p.as<float>(), nullptr,
                 states.as<float>(), vnew.as<float>());
    size_t smem = dstate_smem(ge);
    allow_smem(delta_dstate_kernel<T>, smem);
    delta_dstate_kernel<T><<<dim3(ge.hv, (ge.dv + kSlice - 1) / kSlice), kThreads, smem, s>>>(
        ge, qt, kt, g, doc_ids, scale, w.as<float>(), p.as<float>(), dot, dstates.as<float>(), dvnew.as<float>());
    CUDA_CHECK_LAUNCH();
    smem = grads_smem(ge);
    allow_smem(delta_grads_kernel<T>, smem);
    delta_grads_kernel<T><<<dim3(static_cast<unsigned>(ge.chunks()), ge.hv), kThreads, smem, s>>>(
        ge, qt, kt, vt, g, bt, doc_ids, scale, dot, w.as<float>(), u.as<float>(), states.as<float>(),
        dstates.as<float>(), vnew.as<float>(), dvnew.as<float>(), dqh.as<float>(), dkh.as<float>(),
        static_cast<T*>(dv), dg, static_cast<T*>(dbeta));
    CUDA_CHECK_LAUNCH();
    delta_reduce_kernel<T><<<grid_for(ge.tokens * ge.hk * ge.dk, kThreads), kThreads, 0, s>>>(
        ge, scale, dqh.as<float>(), dkh.as<float>(), static_cast<T*>(dq), static_cast<T*>(dk));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
