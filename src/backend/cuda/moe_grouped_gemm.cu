// Grouped GEMMs of the routed experts, sized on the device: the rows of expert e are
// offsets[e] … offsets[e+1]−1 and nobody reads the offsets on the host, so a MoE layer issues its
// GEMMs without a device→host synchronisation.
//
// Tile scheduler: a launch has one CTA per (output tile column, tile-row slot). The tile-row slots
// are an upper bound on Σ_e ceil(n_e / BM) (that is ≤ ceil(N / BM) + E); each CTA finds its expert
// and tile row from a warp-wide prefix sum over the offsets, and the slots past the real count
// return at once. The weight gradient (the ragged dimension is the reduction) has one CTA per
// (tile of dW_e, expert) and loops over that expert's rows.
//
// Two kernels share the scheduler: BF16 tensor cores (mma.sync m16n8k16, F32 accumulate, a
// 3-stage cp.async pipeline, ldmatrix with .trans for the operands whose contiguous dimension is
// not the reduction) for 16-byte aligned BF16 with sizes that are multiples of 8; and a plain F32
// FMA kernel for F32 and for every other shape. On Hopper the forward and the input gradients go
// to moe_grouped_gemm_wgmma.cu where it applies (SPINDLE_MOE_GEMM, moe.h).
#include <algorithm>
#include <cstdlib>
#include <string>
#include <string_view>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/moe.h"

namespace spindle::cuda {
namespace {

// ---- the scheduler ------------------------------------------------------------------------------

// The (expert, tile row within the expert) of tile-row slot `slot`, or expert −1 for a slot past
// the last tile. Called by one whole warp; every lane gets the answer.
__device__ __forceinline__ int2 find_tile_row(const int32_t* offsets, int experts, int bm, int slot) {
  const int lane = threadIdx.x & 31;
  int base = 0;
  int2 found = make_int2(-1, 0);
  for (int e0 = 0; e0 < experts; e0 += 32) {
    const int e = e0 + lane;
    const int tiles = e < experts ? (offsets[e + 1] - offsets[e] + bm - 1) / bm : 0;
    int inclusive = tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
      if (lane >= o) inclusive += v;
    }
    const int first = base + inclusive - tiles;
    const unsigned hit = __ballot_sync(0xffffffffu, tiles > 0 && slot >= first && slot < first + tiles);
    if (hit) {
      const int src = __ffs(hit) - 1;
      found.x = __shfl_sync(0xffffffffu, e, src);
      found.y = __shfl_sync(0xffffffffu, slot - first, src);
      return found;
    }
    base += __shfl_sync(0xffffffffu, inclusive, 31);
    if (base > slot) break;
  }
  return found;
}

// One CTA's problem: op(A) [m_count, k_count] · op(B) [k_count, n_count] onto C [m_count, n_count]
// (ldc), all pointers at the tile's origin; element addresses by the layouts of the kernel.
struct TileProblem {
  const void* a;
  const void* b;
  void* c;
  int64_t lda, ldb, ldc;
  int m_count, n_count, k_count;
};

enum class Mode { Forward, InputGrad, WeightGrad };

struct GroupedArgs {
  const void* x;    // Forward/InputGrad: A rows [rows, k]; WeightGrad: dy [rows, m]
  const void* x2;   // WeightGrad: x [rows, n]
  void* y;          // Forward/InputGrad: C [rows, n]
  const int32_t* offsets;
  int experts;
  int64_t m, n, k;  // Forward/InputGrad: m unused (ragged rows), n columns, k reduction; WeightGrad: dW_e [m, n]
  bool accumulate;
};

// Finds this CTA's tile; false when the CTA has nothing to do. tile_m0/tile_n0: the tile's first
// row and column inside its problem.
template <Mode M, int BM, int BN>
__device__ __forceinline__ bool schedule(const GroupedArgs& g, const ExpertPointers& table, size_t elem_a,
                                         size_t elem_c, TileProblem& p) {
  __shared__ int2 s_tile;
  if constexpr (M == Mode::WeightGrad) {
    const int e = blockIdx.y;
    const int tiles_n = static_cast<int>((g.n + BN - 1) / BN);
    const int tm = blockIdx.x / tiles_n, tn = blockIdx.x % tiles_n;
    const int begin = g.offsets[e], end = g.offsets[e + 1];
    if (end <= begin || table.p[e] == nullptr) return false;
    const int64_t m0 = static_cast<int64_t>(tm) * BM, n0 = static_cast<int64_t>(tn) * BN;
    // A = dyᵀ: element (m, k) at dy[(begin + k)·m_total + m]; B = x: (k, n) at x[(begin + k)·n_total + n].
    p.a = static_cast<const char*>(g.x) + (static_cast<int64_t>(begin) * g.m + m0) * elem_a;
    p.b = static_cast<const char*>(g.x2) + (static_cast<int64_t>(begin) * g.n + n0) * elem_a;
    p.c = static_cast<char*>(table.p[e]) + (m0 * g.n + n0) * elem_c;
    p.lda = g.m;
    p.ldb = g.n;
    p.ldc = g.n;
    p.m_count = static_cast<int>(min(static_cast<int64_t>(BM), g.m - m0));
    p.n_count = static_cast<int>(min(static_cast<int64_t>(BN), g.n - n0));
    p.k_count = end - begin;
    return true;
  } else {
    if (threadIdx.x < 32) {
      const int2 t = find_tile_row(g.offsets, g.experts, BM, blockIdx.y);
      if (threadIdx.x == 0) s_tile = t;
    }
    __syncthreads();
    const int2 t = s_tile;
    if (t.x < 0) return false;
    const int e = t.x;
    const int64_t row0 = g.offsets[e] + static_cast<int64_t>(t.y) * BM;
    const int64_t n0 = static_cast<int64_t>(blockIdx.x) * BN;
    p.a = static_cast<const char*>(g.x) + row0 * g.k * elem_a;
    // Forward: W_e [n, k], (k, n) at W[n·k_total + k]; InputGrad: W_e [k, n], (k, n) at W[k·n_total + n].
    p.b = static_cast<const char*>(table.p[e]) + (M == Mode::Forward ? n0 * g.k : n0) * elem_a;
    p.c = static_cast<char*>(g.y) + (row0 * g.n + n0) * elem_c;
    p.lda = g.k;
    p.ldb = M == Mode::Forward ? g.k : g.n;
    p.ldc = g.n;
    p.m_count = static_cast<int>(min(static_cast<int64_t>(BM), static_cast<int64_t>(g.offsets[e + 1]) - row0));
    p.n_count = static_cast<int>(min(static_cast<int64_t>(BN), g.n - n0));
    p.k_count = static_cast<int>(g.k);
    return true;
  }
}

// Layouts per mode: is A's contiguous dimension m (else k)? Is B's contiguous dimension n (else k)?
template <Mode M>
constexpr bool kAContiguousM = M == Mode::WeightGrad;
template <Mode M>
constexpr bool kBContiguousN = M != Mode::Forward;

// ---- BF16 tensor-core kernel --------------------------------------------------------------------

constexpr int kBM = 128, kBN = 128, kBK = 32, kStages = 3, kThreads = 256;
constexpr int kPad = 8;  // bf16 elements of padding per smem row: keeps ldmatrix free of bank conflicts
// A tile is [BM][BK+pad] when k is contiguous, [BK][BM+pad] when m is; the same for B with n.
constexpr int kTileElems = std::max(kBM * (kBK + kPad), kBK * (kBM + kPad));
constexpr int kStageElems = 2 * kTileElems;
constexpr size_t kMmaSmemBytes = static_cast<size_t>(kStages) * kStageElems * sizeof(bf16);

__device__ __forceinline__ unsigned smem_addr(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)), "l"(src),
               "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma_bf16(float (&c)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Loads k-tile `kt` of A and B into one stage: 16-byte pieces, zero outside the problem.
template <bool AContigM, bool BContigN>
__device__ __forceinline__ void load_stage(bf16* stage, const TileProblem& p, int kt) {
  const bf16* a = static_cast<const bf16*>(p.a);
  const bf16* b = static_cast<const bf16*>(p.b);
  bf16* as = stage;
  bf16* bs = stage + kTileElems;
  const int k0 = kt * kBK;
#pragma unroll
  for (int i = 0; i < (kBM * kBK / 8) / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if constexpr (AContigM) {
      const int kr = c / (kBM / 8), mc = (c % (kBM / 8)) * 8;
      const bool ok = k0 + kr < p.k_count && mc < p.m_count;
      cp_async16(as + kr * (kBM + kPad) + mc, ok ? a + static_cast<int64_t>(k0 + kr) * p.lda + mc : a, ok);
    } else {
      const int r = c / (kBK / 8), kc = (c % (kBK / 8)) * 8;
      const bool ok = r < p.m_count && k0 + kc < p.k_count;
      cp_async16(as + r * (kBK + kPad) + kc, ok ? a + static_cast<int64_t>(r) * p.lda + k0 + kc : a, ok);
    }
  }
#pragma unroll
  for (int i = 0; i < (kBN * kBK / 8) / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if constexpr (BContigN) {
      const int kr = c / (kBN / 8), nc = (c % (kBN / 8)) * 8;
      const bool ok = k0 + kr < p.k_count && nc < p.n_count;
      cp_async16(bs + kr * (kBN + kPad) + nc, ok ? b + static_cast<int64_t>(k0 + kr) * p.ldb + nc : b, ok);
    } else {
      const int r = c / (kBK / 8), kc = (c % (kBK / 8)) * 8;
      const bool ok = r < p.n_count && k0 + kc < p.k_count;
      cp_async16(bs + r * (kBK + kPad) + kc, ok ? b + static_cast<int64_t>(r) * p.ldb + k0 + kc : b, ok);
    }
  }
}

template <typename TC>
__device__ __forceinline__ void store_pair(TC* c, float v0, float v1, bool accumulate) {
  if constexpr (sizeof(TC) == 2) {
    __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(c);
    if (accumulate) {
      const float2 old = __bfloat1622float2(*q);
      v0 += old.x;
      v1 += old.y;
    }
    *q = __floats2bfloat162_rn(v0, v1);
  } else {
    float2* q = reinterpret_cast<float2*>(c);
    if (accumulate) {
      const float2 old = *q;
      v0 += old.x;
      v1 += old.y;
    }
    *q = make_float2(v0, v1);
  }
}

// 8 warps as 2 (m) × 4 (n), each a 64 × 32 piece of the 128 × 128 tile: 4 × 4 mma tiles of 16 × 8.
template <Mode M, typename TC>
__global__ void __launch_bounds__(kThreads) grouped_mma_kernel(const GroupedArgs g, const ExpertPointers table) {
  constexpr bool AContigM = kAContiguousM<M>;
  constexpr bool BContigN = kBContiguousN<M>;
  TileProblem p;
  if (!schedule<M, kBM, kBN>(g, table, sizeof(bf16), sizeof(TC), p)) return;
  extern __shared__ __align__(16) unsigned char mma_smem[];
  bf16* smem = reinterpret_cast<bf16*>(mma_smem);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 2, wn = warp & 3;
  float acc[4][4][4] = {};
  const int ktiles = (p.k_count + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage<AContigM, BContigN>(smem + s * kStageElems, p, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt is in; everyone is done with the stage the next load overwrites
    const int next = kt + kStages - 1;
    if (next < ktiles) load_stage<AContigM, BContigN>(smem + (next % kStages) * kStageElems, p, next);
    cp_async_commit();
    const bf16* as = smem + (kt % kStages) * kStageElems;
    const bf16* bs = as + kTileElems;
    const int q = lane >> 3, r = lane & 7;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      unsigned af[4][4], bfr[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int m = wm * 64 + i * 16;
        if constexpr (AContigM)
          ldmatrix_x4_trans(af[i], as + (kk + (q >> 1) * 8 + r) * (kBM + kPad) + m + (q & 1) * 8);
        else
          ldmatrix_x4(af[i], as + (m + (lane & 15)) * (kBK + kPad) + kk + (lane >> 4) * 8);
      }
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        const int n = wn * 32 + jp * 16;
        unsigned t[4];
        if constexpr (BContigN)
          ldmatrix_x4_trans(t, bs + (kk + (q & 1) * 8 + r) * (kBN + kPad) + n + (q >> 1) * 8);
        else
          ldmatrix_x4(t, bs + (n + (q >> 1) * 8 + r) * (kBK + kPad) + kk + (q & 1) * 8);
        bfr[2 * jp][0] = t[0];
        bfr[2 * jp][1] = t[1];
        bfr[2 * jp + 1][0] = t[2];
        bfr[2 * jp + 1][1] = t[3];
      }
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) mma_bf16(acc[i][j], af[i], bfr[j][0], bfr[j][1]);
    }
  }
  cp_async_wait<0>();
  // The weight gradient always adds (+=); the other modes as asked.
  const bool accumulate = M == Mode::WeightGrad || g.accumulate;
  TC* c = static_cast<TC*>(p.c);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int col = wn * 32 + j * 8 + 2 * (lane & 3);
      if (col >= p.n_count) continue;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = wm * 64 + i * 16 + (lane >> 2) + h * 8;
        if (row < p.m_count)
          store_pair(c + static_cast<int64_t>(row) * p.ldc + col, acc[i][j][2 * h], acc[i][j][2 * h + 1], accumulate);
      }
    }
}

// ---- F32 FMA kernel (F32, and BF16 shapes the tensor-core kernel does not take) ------------------

constexpr int kSBM = 64, kSBN = 64, kSBK = 16;

template <Mode M, typename T, typename TC>
__global__ void __launch_bounds__(256) grouped_simt_kernel(const GroupedArgs g, const ExpertPointers table) {
  constexpr bool AContigM = kAContiguousM<M>;
  constexpr bool BContigN = kBContiguousN<M>;
  TileProblem p;
  if (!schedule<M, kSBM, kSBN>(g, table, sizeof(T), sizeof(TC), p)) return;
  __shared__ float as[kSBK][kSBM + 1];
  __shared__ float bs[kSBK][kSBN + 1];
  const T* a = static_cast<const T*>(p.a);
  const T* b = static_cast<const T*>(p.b);
  const int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
  float acc[4][4] = {};
  for (int k0 = 0; k0 < p.k_count; k0 += kSBK) {
    for (int i = threadIdx.x; i < kSBK * kSBM; i += 256) {
      const int kk = i / kSBM, m = i % kSBM, k = k0 + kk;
      const bool ok = m < p.m_count && k < p.k_count;
      as[kk][m] = ok ? to_f32(AContigM ? a[static_cast<int64_t>(k) * p.lda + m] : a[static_cast<int64_t>(m) * p.lda + k])
                     : 0.0f;
      const int n = m;
      const bool okb = n < p.n_count && k < p.k_count;
      bs[kk][n] = okb ? to_f32(BContigN ? b[static_cast<int64_t>(k) * p.ldb + n] : b[static_cast<int64_t>(n) * p.ldb + k])
                      : 0.0f;
    }
    __syncthreads();
#pragma unroll
    for (int kk = 0; kk < kSBK; ++kk) {
      float av[4], bv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) av[i] = as[kk][ty + 16 * i], bv[i] = bs[kk][tx + 16 * i];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] += av[i] * bv[j];
    }
    __syncthreads();
  }
  const bool accumulate = M == Mode::WeightGrad || g.accumulate;
  TC* c = static_cast<TC*>(p.c);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int row = ty + 16 * i, col = tx + 16 * j;
      if (row >= p.m_count || col >= p.n_count) continue;
      TC* dst = c + static_cast<int64_t>(row) * p.ldc + col;
      *dst = from_f32<TC>(acc[i][j] + (accumulate ? to_f32(*dst) : 0.0f));
    }
}

// ---- launch ---------------------------------------------------------------------------------------

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <Mode M, typename TC>
void launch_mma(cudaStream_t s, const GroupedArgs& g, const ExpertPointers& table, dim3 grid) {
  static const bool configured = [] {
    CUDA_CHECK(cudaFuncSetAttribute(grouped_mma_kernel<M, TC>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(kMmaSmemBytes)));
    return true;
  }();
  (void)configured;
  grouped_mma_kernel<M, TC><<<grid, kThreads, kMmaSmemBytes, s>>>(g, table);
  CUDA_CHECK_LAUNCH();
}

// The grid of a launch: WeightGrad (tiles of dW_e, experts); otherwise (column tiles, tile-row slots).
dim3 grid_for_mode(Mode mode, const GroupedArgs& g, int64_t rows, int bm, int bn) {
  if (mode == Mode::WeightGrad)
    return dim3(static_cast<unsigned>(((g.m + bm - 1) / bm) * ((g.n + bn - 1) / bn)), static_cast<unsigned>(g.experts));
  const int64_t slots = (rows + bm - 1) / bm + g.experts;
  if (slots > 65535) throw_message("moe_grouped_gemm", "too many routed rows for one launch");
  return dim3(static_cast<unsigned>((g.n + bn - 1) / bn), static_cast<unsigned>(slots));
}

template <Mode M>
void run(cudaStream_t s, DType t, DType tc, const GroupedArgs& g, const ExpertPointers& table, int64_t rows,
         bool tensor_cores) {
  if (tensor_cores) {
    const dim3 grid = grid_for_mode(M, g, rows, kBM, kBN);
    if (tc == DType::F32) launch_mma<M, float>(s, g, table, grid);
    else launch_mma<M, bf16>(s, g, table, grid);
    return;
  }
  const dim3 grid = grid_for_mode(M, g, rows, kSBM, kSBN);
  dispatch_compute(t, "moe_grouped_gemm", [&](auto z) {
    using T = decltype(z);
    if (tc == DType::F32) grouped_simt_kernel<M, T, float><<<grid, 256, 0, s>>>(g, table);
    else if constexpr (std::is_same_v<T, bf16>) grouped_simt_kernel<M, T, bf16><<<grid, 256, 0, s>>>(g, table);
    else throw_dtype("moe_grouped_gemm", tc);
    CUDA_CHECK_LAUNCH();
  });
}

void check_experts(const char* op, int experts) {
  if (experts < 1 || experts > kMaxGroupedExperts) throw_message(op, "needs 1 … 1024 experts");
}

bool device_is_hopper() {
  static const bool hopper = [] {
    int device = 0, major = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major == 9;
  }();
  return hopper;
}


}  // namespace

MoeGemmKernel moe_gemm_kernel_choice() {
  const char* v = std::getenv("SPINDLE_MOE_GEMM");
  const std::string_view value = v ? v : "";
  if (value.empty() || value == "auto") return MoeGemmKernel::Auto;
  if (value == "mma") return MoeGemmKernel::Mma;
  if (value == "wgmma") return MoeGemmKernel::Wgmma;
  const std::string message = "must be auto, mma or wgmma, got \"" + std::string(value) +
                              "\" (the routed experts' grouped GEMM kernel: wgmma the Hopper kernel where it applies, "
                              "mma the mma.sync kernel everywhere, auto the default)";
  throw_message("SPINDLE_MOE_GEMM", message.c_str());
}

void moe_grouped_gemm(cudaStream_t s, DType t, const void* x, int64_t rows, int64_t k, const ExpertPointers& weights,
                      int experts, bool transpose_weight, const int32_t* offsets, void* y, int64_t n,
                      bool accumulate) {
  check_experts("moe_grouped_gemm", experts);
  if (rows == 0 || n == 0) return;
  if (rows > 0x7fffffff || k > 0x7fffffff || n > 0x7fffffff) throw_message("moe_grouped_gemm", "sizes above 2^31");
  const GroupedArgs g{x, nullptr, y, offsets, experts, 0, n, k, accumulate};
  bool tensor_cores = t == DType::BF16 && k % 8 == 0 && n % 8 == 0 && aligned16(x) && aligned16(y);
  for (int e = 0; e < experts && tensor_cores; ++e) tensor_cores = aligned16(weights.p[e]);
  if (tensor_cores && moe_grouped_gemm_wgmma_supports(t, k, n) && moe_gemm_kernel_choice() != MoeGemmKernel::Mma &&
      device_is_hopper()) {
    moe_grouped_gemm_wgmma(s, x, rows, k, weights, experts, transpose_weight, offsets, y, n, accumulate);
    return;
  }
  if (transpose_weight) run<Mode::Forward>(s, t, t, g, weights, rows, tensor_cores);
  else run<Mode::InputGrad>(s, t, t, g, weights, rows, tensor_cores);
}

void moe_grouped_gemm_weight_grad(cudaStream_t s, DType t, const void* dy, const void* x, int64_t rows, int64_t m,
                                  int64_t n, const int32_t* offsets, const ExpertPointers& weight_grads, int experts,
                                  DType grad_dtype) {
  check_experts("moe_grouped_gemm_weight_grad", experts);
  if (rows == 0 || m == 0 || n == 0) return;
  if (rows > 0x7fffffff || m > 0x7fffffff || n > 0x7fffffff)
    throw_message("moe_grouped_gemm_weight_grad", "sizes above 2^31");
  const GroupedArgs g{dy, x, nullptr, offsets, experts, m, n, 0, true};
  bool tensor_cores = t == DType::BF16 && m % 8 == 0 && n % 8 == 0 && aligned16(dy) && aligned16(x);
  const size_t grad_elem = grad_dtype == DType::F32 ? 4 : 2;
  for (int e = 0; e < experts && tensor_cores; ++e)
    tensor_cores = weight_grads.p[e] == nullptr || reinterpret_cast<uintptr_t>(weight_grads.p[e]) % (2 * grad_elem) == 0;
  // The Hopper weight gradient only when asked for: on one H200 it measured slower than mma.sync
  // (Qwen3.6-35B-A3B's dW at 16k: 2.30 against 1.77 ms, docs/perf.md).
  if (tensor_cores && moe_grouped_gemm_wgmma_supports(t, m, n) && moe_gemm_kernel_choice() == MoeGemmKernel::Wgmma &&
      device_is_hopper()) {
    moe_grouped_gemm_weight_grad_wgmma(s, dy, x, rows, m, n, offsets, weight_grads, experts, grad_dtype);
    return;
  }
  run<Mode::WeightGrad>(s, t, grad_dtype, g, weight_grads, rows, tensor_cores);
}

}  // namespace spindle::cuda
