// The routed experts' grouped GEMMs on Hopper (sm_90a): y[rows of e] (+)= x[rows of e]·op(W_e) with
// warpgroup matrix multiplies (wgmma) reading both operands from shared memory, for BF16 with
// sizes that are multiples of 8 (moe.h; the mma.sync kernel of moe_grouped_gemm.cu takes the rest).
//
// Tiles: 128 rows × 256 columns (128 for n < 256), k in steps of 64; two warpgroups of 64 rows
// each, one m64n256k16 (m64n128k16) wgmma per 16 of k. Operands reach shared memory through cp.async
// (16-byte pieces, zero outside the problem) in the 128-byte swizzle that wgmma reads (hopper.cuh).
// Not the copy engine: a TMA tensor map is per matrix, and the experts' weights are separate
// tensors (1024 maps would not fit the kernel arguments).
//
// Persistent scheduler: one CTA per SM walks the tiles i = blockIdx.x, + gridDim.x, … of the
// launch. Tile i is (tile-row slot i / n_tiles, column tile i % n_tiles); each CTA turns the
// offsets (read on the device, never on the host) into the first slot of every expert once, in
// shared memory, and finds a slot's expert by binary search. The k-steps of a CTA's tiles form
// one sequence, and the copies run ahead of the products across tile boundaries: the next tile's
// operands arrive while this tile's epilogue stores.
//
// Pipeline (S stages: 4 of 48 KiB for 256-wide tiles, 5 of 32 KiB for 128): at step s every
// thread waits for its copies of step s, makes them visible to the async proxy, and meets the
// others at a barrier; by then every warpgroup's products of step s − 2 have completed (each keeps
// at most one batch in flight), so the copies of step s + S − 2 go into that stage. The products
// of step s are issued next, then the wait for those of step s − 1.
#include <algorithm>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/hopper.cuh"
#include "backend/cuda/moe.h"

namespace spindle::cuda {
namespace {

using namespace hopper;

constexpr int kBM = 128, kBK = 64;
constexpr int kThreads = 256;  // two warpgroups of 64 rows each
constexpr uint32_t kABytes = kBM * kBK * 2;  // [128 rows][64 k]

// Per tile width BN (128 or 256 columns): B's bytes per k-step, the stages that fit the shared
// memory, and how many steps the copies run ahead of the products (see the pipeline above).
template <int BN>
struct TileShape {
  static constexpr uint32_t kBBytes = BN * kBK * 2;  // [BN n][64 k] or BN/64 × [64 k][64 n]
  static constexpr uint32_t kStageBytes = kABytes + kBBytes;
  static constexpr int kStages = BN == 128 ? 5 : 4;
  static constexpr int kLookahead = kStages - 2;
  static constexpr size_t smem_bytes(int experts) {
    return kStages * kStageBytes + 1024 + (static_cast<size_t>(experts) + 1) * sizeof(int);
  }
};

struct Args {
  const bf16* x;  // [rows, k]
  bf16* y;        // [rows, n]
  const int32_t* offsets;
  int experts;
  int n, k;
  int n_tiles, k_steps;
  bool accumulate;
};

// One tile's problem: rows row0 … row0 + m_count − 1 of expert e, columns n0 … n0 + n_count − 1.
struct Tile {
  const bf16* w;  // W_e
  int64_t row0;
  int m_count, n0, n_count;
};

// The tile of launch-wide index `index`: the slot's expert is the last one whose first slot is at
// or before it (empty experts share their first slot with the next one).
template <int BN>
__device__ __forceinline__ Tile find_tile(int index, const int* first_slot, const Args& g,
                                          const ExpertPointers& table) {
  const int slot = index / g.n_tiles, column = index % g.n_tiles;
  int lo = 0, hi = g.experts - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (first_slot[mid] <= slot) lo = mid;
    else hi = mid - 1;
  }
  Tile t;
  const int begin = g.offsets[lo], end = g.offsets[lo + 1];
  t.w = static_cast<const bf16*>(table.p[lo]);
  t.row0 = begin + static_cast<int64_t>(slot - first_slot[lo]) * kBM;
  t.m_count = min(kBM, static_cast<int>(end - t.row0));
  t.n0 = column * BN;
  t.n_count = min(BN, g.n - t.n0);
  return t;
}

__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}

// Byte offset of 16-byte piece `piece` (0…7) of row `row` in a [rows][64] bf16 chunk, 128-byte swizzle.
__device__ __forceinline__ uint32_t swizzled(int row, int piece) {
  return static_cast<uint32_t>(row * 128 + ((piece ^ (row & 7)) << 4));
}

// Copies k-step `ks` of tile t into the stage at shared address `stage`.
// A (x rows, k contiguous): [128 rows][64 k], K-major. B: Forward, W_e [n, k]: [BN n][64 k],
// K-major; InputGrad, W_e [k, n]: BN/64 column chunks [64 k][64 n] of 8 KiB, MN-major.
template <bool Forward, int BN>
__device__ __forceinline__ void load_step(uint32_t stage, const Tile& t, int ks, const Args& g) {
  const int k0 = ks * kBK;
#pragma unroll
  for (int i = 0; i < (kBM * 8) / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads, r = c >> 3, piece = c & 7;
    const bool ok = r < t.m_count && k0 + piece * 8 < g.k;
    const bf16* src = ok ? g.x + (t.row0 + r) * g.k + k0 + piece * 8 : g.x;
    cp_async16(stage + swizzled(r, piece), src, ok);
  }
  const uint32_t b = stage + kABytes;
#pragma unroll
  for (int i = 0; i < (BN * 8) / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads;
    if constexpr (Forward) {
      const int r = c >> 3, piece = c & 7;
      const bool ok = r < t.n_count && k0 + piece * 8 < g.k;
      const bf16* src = ok ? t.w + static_cast<int64_t>(t.n0 + r) * g.k + k0 + piece * 8 : t.w;
      cp_async16(b + swizzled(r, piece), src, ok);
    } else {
      constexpr int kPieces = BN / 8;  // 16-byte pieces along n per k row
      const int kr = c / kPieces, np = c % kPieces;
      const bool ok = k0 + kr < g.k && np * 8 < t.n_count;
      const bf16* src = ok ? t.w + static_cast<int64_t>(k0 + kr) * g.n + t.n0 + np * 8 : t.w;
      cp_async16(b + (np >> 3) * (kBK * 128) + swizzled(kr, np & 7), src, ok);
    }
  }
}

// d[128] (+)= A·B, m64n256k16, A and B from shared memory (descriptors, hopper.cuh); TA/TB = 1:
// that operand stored MN-major.
template <int TA, int TB>
__device__ __forceinline__ void wgmma_ss_n256(float (&d)[128], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %130, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {"
      "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
      "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
      "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
      "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63,"
      "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79,"
      "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95,"
      "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111,"
      "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
      "}, %128, %129, p, 1, 1, %131, %132;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]),
        "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]),
        "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]),
        "+f"(d[80]), "+f"(d[81]), "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]),
        "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), "+f"(d[94]), "+f"(d[95]),
        "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]),
        "+f"(d[104]), "+f"(d[105]), "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]),
        "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), "+f"(d[118]), "+f"(d[119]),
        "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
      : "l"(a), "l"(b), "r"(accumulate), "n"(TA), "n"(TB));
}

// The products of one k-step for one warpgroup: 4 wgmma of k 16 onto the m64nBN accumulator.
template <bool Forward, int BN>
__device__ __forceinline__ void step_products(float (&acc)[BN / 2], uint32_t a, uint32_t b, bool first) {
#pragma unroll
  for (int kk = 0; kk < kBK / 16; ++kk) {
    const uint64_t da = smem_desc(a + 32 * kk, 16, 1024);
    // K-major B: the 16-wide k slice at +32 bytes; MN-major B: 16 k rows at +2048 bytes, 64-column
    // chunks kBK·128 bytes apart.
    const uint64_t db = Forward ? smem_desc(b + 32 * kk, 16, 1024) : smem_desc(b + kk * 2048, kBK * 128, 1024);
    const int accumulate = !first || kk > 0;
    if constexpr (BN == 128) wgmma_ss_n128<0, Forward ? 0 : 1>(acc, da, db, accumulate);
    else wgmma_ss_n256<0, Forward ? 0 : 1>(acc, da, db, accumulate);
  }
}

// How a finished tile leaves (see the epilogue below): kRegisters, each thread stores its
// accumulator pairs straight from registers (adding the old values when accumulating); kStaged,
// through shared memory as BF16 (overwriting calls); kStagedAdd, through shared memory as F32, the
// old values read in whole-row pieces and added before the one rounding (accumulating calls).
constexpr int kRegisters = 0, kStaged = 1, kStagedAdd = 2;

template <bool Forward, int BN, int Epi>
__global__ void __launch_bounds__(kThreads, 1) grouped_wgmma_kernel(const Args g, const ExpertPointers table) {
  using Z = TileShape<BN>;
  extern __shared__ unsigned char wgmma_smem_raw[];
  unsigned char* smem =
      reinterpret_cast<unsigned char*>((reinterpret_cast<uintptr_t>(wgmma_smem_raw) + 1023) & ~uintptr_t{1023});
  const uint32_t stages = smem_u32(smem);
  int* first_slot = reinterpret_cast<int*>(smem + Z::kStages * Z::kStageBytes);  // [experts + 1]

  // The first tile-row slot of every expert: tile counts, then one warp's running prefix sum.
  for (int e = threadIdx.x; e < g.experts; e += kThreads)
    first_slot[e + 1] = (g.offsets[e + 1] - g.offsets[e] + kBM - 1) / kBM;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  if (threadIdx.x < 32) {
    int base = 0;
    for (int e0 = 0; e0 < g.experts; e0 += 32) {
      const int e = e0 + lane;
      int inclusive = e < g.experts ? first_slot[e + 1] : 0;
#pragma unroll
      for (int o = 1; o < 32; o <<= 1) {
        const int v = __shfl_up_sync(0xffffffffu, inclusive, o);
        if (lane >= o) inclusive += v;
      }
      if (e < g.experts) first_slot[e + 1] = base + inclusive;
      base += __shfl_sync(0xffffffffu, inclusive, 31);
    }
    if (lane == 0) first_slot[0] = 0;
  }
  __syncthreads();
  const int total_tiles = first_slot[g.experts] * g.n_tiles;
  if (static_cast<int>(blockIdx.x) >= total_tiles) return;
  const int my_tiles = (total_tiles - blockIdx.x + gridDim.x - 1) / gridDim.x;
  const int steps = my_tiles * g.k_steps;

  // The copy side's position: its tile (local index) and that tile's problem.
  int load_local = 0;
  Tile load_tile = find_tile<BN>(blockIdx.x, first_slot, g, table);
  auto load = [&](int s) {
    const int local = s / g.k_steps;
    if (local != load_local) {
      load_local = local;
      load_tile = find_tile<BN>(blockIdx.x + local * gridDim.x, first_slot, g, table);
    }
    load_step<Forward, BN>(stages + (s % Z::kStages) * Z::kStageBytes, load_tile, s - local * g.k_steps, g);
  };
#pragma unroll
  for (int s = 0; s < Z::kLookahead; ++s) {
    if (s < steps) load(s);
    cp_async_commit();
  }

  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, gr = lane >> 2, tq = lane & 3;
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  int s = 0;  // this CTA's step
  for (int local = 0; local < my_tiles; ++local) {
    const Tile tile = find_tile<BN>(blockIdx.x + local * gridDim.x, first_slot, g, table);
    for (int ks = 0; ks < g.k_steps; ++ks, ++s) {
      cp_async_wait<Z::kLookahead - 1>();
      fence_proxy_async();  // this thread's cp.async writes (generic proxy) become visible to wgmma
      __syncthreads();
      if (s + Z::kLookahead < steps) load(s + Z::kLookahead);
      cp_async_commit();
      const uint32_t stage = stages + (s % Z::kStages) * Z::kStageBytes;
      wgmma_fence();
      step_products<Forward, BN>(acc, stage + wg * (64 * 128), stage + kABytes, ks == 0);
      wgmma_commit();
      wgmma_wait<1>();
    }
    wgmma_wait<0>();
    fence_regs(acc);
    // The epilogue reads the accumulator on every thread's path alike (a read under a per-thread
    // condition makes ptxas serialize the wgmma of the whole kernel); only the stores are guarded.
    bf16* out = g.y + tile.row0 * g.n + tile.n0;
    if constexpr (Epi == kStaged) {
      // From registers, a warp's store touches 8 rows with 16 bytes each; staged, 16-byte pieces
      // of whole rows. The tile goes in 128-column halves [128 rows][256 bytes] (16-byte piece c of
      // row r at piece c ^ (r % 8): conflict-free both ways) into the stages of this tile's last
      // two steps, which no copy refills before the next step's barrier (the copies in flight
      // are for the steps after them). The barrier first: the other warpgroup may still read them.
      const int last = s - 1;
      __syncthreads();
#pragma unroll
      for (int half = 0; half < BN / 128; ++half) {
        const uint32_t buf = stages + ((last - half + Z::kStages) % Z::kStages) * Z::kStageBytes;
#pragma unroll
        for (int i = 0; i < 16; ++i)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const int row = wg * 64 + warp * 16 + gr + 8 * h;
            const int block = half * 16 + i;
            st_shared_b32(buf + row * 256 + ((i ^ (row & 7)) << 4) + tq * 4,
                          pack_bf16x2(acc[4 * block + 2 * h], acc[4 * block + 2 * h + 1]));
          }
      }
      __syncthreads();
#pragma unroll
      for (int half = 0; half < BN / 128; ++half) {
        const uint32_t buf = stages + ((last - half + Z::kStages) % Z::kStages) * Z::kStageBytes;
#pragma unroll
        for (int j = 0; j < (kBM * 16) / kThreads; ++j) {
          const int piece = threadIdx.x + j * kThreads, r = piece >> 4, c = piece & 15;
          const int col = half * 128 + c * 8;
          if (r < tile.m_count && col < tile.n_count) {
            const int4 v = ld_shared_s32x4(buf + r * 256 + ((c ^ (r & 7)) << 4));
            *reinterpret_cast<int4*>(out + static_cast<int64_t>(r) * g.n + col) = v;
          }
        }
      }
    } else if constexpr (Epi == kStagedAdd) {
      // F32 quarters of 64 columns ([128 rows][256 bytes], pieces swizzled as above), two at a
      // time in the same two stages: write, barrier, add the old values and store, barrier.
      const int last = s - 1;
#pragma unroll
      for (int pass = 0; pass < BN / 128; ++pass) {
        __syncthreads();  // the stages are free: the products and the previous pass are done with them
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const uint32_t buf = stages + ((last - q + Z::kStages) % Z::kStages) * Z::kStageBytes;
#pragma unroll
          for (int i = 0; i < 8; ++i)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int row = wg * 64 + warp * 16 + gr + 8 * h;
              const int block = pass * 16 + q * 8 + i;
              st_shared_f32x2(buf + row * 256 + (((2 * i + (tq >> 1)) ^ (row & 7)) << 4) + (tq & 1) * 8,
                              acc[4 * block + 2 * h], acc[4 * block + 2 * h + 1]);
            }
        }
        __syncthreads();
#pragma unroll
        for (int q = 0; q < 2; ++q) {
          const uint32_t buf = stages + ((last - q + Z::kStages) % Z::kStages) * Z::kStageBytes;
#pragma unroll
          for (int j = 0; j < (kBM * 8) / kThreads; ++j) {
            const int piece = threadIdx.x + j * kThreads, r = piece >> 3, c8 = piece & 7;
            const int col = pass * 128 + q * 64 + c8 * 8;
            if (r < tile.m_count && col < tile.n_count) {
              const int4 lo = ld_shared_s32x4(buf + r * 256 + (((2 * c8) ^ (r & 7)) << 4));
              const int4 hi = ld_shared_s32x4(buf + r * 256 + (((2 * c8 + 1) ^ (r & 7)) << 4));
              int4* dst = reinterpret_cast<int4*>(out + static_cast<int64_t>(r) * g.n + col);
              const int4 old = *dst;
              const float sum[8] = {__int_as_float(lo.x), __int_as_float(lo.y), __int_as_float(lo.z),
                                    __int_as_float(lo.w), __int_as_float(hi.x), __int_as_float(hi.y),
                                    __int_as_float(hi.z), __int_as_float(hi.w)};
              const int words[4] = {old.x, old.y, old.z, old.w};
              int packed[4];
#pragma unroll
              for (int w = 0; w < 4; ++w) {
                __nv_bfloat162 pair = *reinterpret_cast<const __nv_bfloat162*>(&words[w]);
                const float2 o = __bfloat1622float2(pair);
                pair = __floats2bfloat162_rn(sum[2 * w] + o.x, sum[2 * w + 1] + o.y);
                packed[w] = *reinterpret_cast<const int*>(&pair);
              }
              *dst = make_int4(packed[0], packed[1], packed[2], packed[3]);
            }
          }
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < BN / 8; ++i) {
        const int col = 8 * i + 2 * tq;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = wg * 64 + warp * 16 + gr + 8 * h;
          const bool inside = col < tile.n_count && row < tile.m_count;
          __nv_bfloat162* p = reinterpret_cast<__nv_bfloat162*>(out + static_cast<int64_t>(row) * g.n + col);
          float2 old = make_float2(0.f, 0.f);
          if (inside && g.accumulate) old = __bfloat1622float2(*p);
          const __nv_bfloat162 v =
              __floats2bfloat162_rn(acc[4 * i + 2 * h] + old.x, acc[4 * i + 2 * h + 1] + old.y);
          if (inside) *p = v;
        }
      }
    }
    fence_regs(acc);
  }
  cp_async_wait<0>();
}

// ---- weight gradient: dW_e [m, n] += dy[rows of e]ᵀ · x[rows of e] ---------------------------------
//
// The ragged dimension is the reduction: one CTA per (expert, m tile, n tile), grid over all of
// them (an expert without rows or frozen, a null dW_e, returns at once; the hardware hands the
// SMs to the CTAs left, which balances experts of different sizes). Both operands are MN-major:
// A = dyᵀ as BM/64 chunks [64 rows][64 m], B = x as BN/64 chunks [64 rows][64 n]; warpgroup w
// reads A's chunk w. The same pipeline as above over the expert's rows in steps of 64.

struct WeightGradArgs {
  const bf16* dy;  // [rows, m]
  const bf16* x;   // [rows, n]
  const int32_t* offsets;
  int m, n;
  int m_tiles, n_tiles;
};

// Copies rows r0 … r0 + 63 (of count) of a [rows, cols] matrix, columns c0 … c0 + 8·pieces − 1,
// into MN-major chunks [64 rows][64 cols] at `dst`, zero past `count` rows or `cols` columns.
template <int Pieces>
__device__ __forceinline__ void load_mn_major(uint32_t dst, const bf16* src, int cols, int r0, int count, int c0) {
#pragma unroll
  for (int i = 0; i < (64 * Pieces) / kThreads; ++i) {
    const int c = threadIdx.x + i * kThreads, kr = c / Pieces, np = c % Pieces;
    const bool ok = r0 + kr < count && c0 + np * 8 < cols;
    const bf16* from = ok ? src + static_cast<int64_t>(r0 + kr) * cols + c0 + np * 8 : src;
    cp_async16(dst + (np >> 3) * (kBK * 128) + swizzled(kr, np & 7), from, ok);
  }
}

template <int BN, typename TG>
__global__ void __launch_bounds__(kThreads, 1)
    weight_grad_wgmma_kernel(const WeightGradArgs g, const ExpertPointers grads) {
  using Z = TileShape<BN>;
  const int per_expert = g.m_tiles * g.n_tiles;
  const int e = blockIdx.x / per_expert;
  const int mt = (blockIdx.x % per_expert) / g.n_tiles, nt = blockIdx.x % g.n_tiles;
  const int begin = g.offsets[e], count = g.offsets[e + 1] - begin;
  TG* dw = static_cast<TG*>(grads.p[e]);
  if (count <= 0 || dw == nullptr) return;
  extern __shared__ unsigned char wgmma_smem_raw[];
  const uint32_t stages = (smem_u32(wgmma_smem_raw) + 1023) & ~uint32_t{1023};
  const int m0 = mt * kBM, n0 = nt * BN;
  const bf16* dy = g.dy + static_cast<int64_t>(begin) * g.m;
  const bf16* x = g.x + static_cast<int64_t>(begin) * g.n;
  const int steps = (count + kBK - 1) / kBK;
  auto load = [&](int s) {
    const uint32_t stage = stages + (s % Z::kStages) * Z::kStageBytes;
    load_mn_major<kBM / 8>(stage, dy, g.m, s * kBK, count, m0);
    load_mn_major<BN / 8>(stage + kABytes, x, g.n, s * kBK, count, n0);
  };
#pragma unroll
  for (int s = 0; s < Z::kLookahead; ++s) {
    if (s < steps) load(s);
    cp_async_commit();
  }
  const int wg = threadIdx.x >> 7, warp = (threadIdx.x >> 5) & 3, lane = threadIdx.x & 31;
  const int gr = lane >> 2, tq = lane & 3;
  float acc[BN / 2];
#pragma unroll
  for (int i = 0; i < BN / 2; ++i) acc[i] = 0.f;
  for (int s = 0; s < steps; ++s) {
    cp_async_wait<Z::kLookahead - 1>();
    fence_proxy_async();
    __syncthreads();
    if (s + Z::kLookahead < steps) load(s + Z::kLookahead);
    cp_async_commit();
    const uint32_t a = stages + (s % Z::kStages) * Z::kStageBytes + wg * (kBK * 128);
    const uint32_t b = stages + (s % Z::kStages) * Z::kStageBytes + kABytes;
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      const uint64_t da = smem_desc(a + kk * 2048, kBK * 128, 1024);
      const uint64_t db = smem_desc(b + kk * 2048, kBK * 128, 1024);
      const int accumulate = s > 0 || kk > 0;
      if constexpr (BN == 128) wgmma_ss_n128<1, 1>(acc, da, db, accumulate);
      else wgmma_ss_n256<1, 1>(acc, da, db, accumulate);
    }
    wgmma_commit();
    wgmma_wait<1>();
  }
  wgmma_wait<0>();
  fence_regs(acc);
  cp_async_wait<0>();
  const int m_count = min(kBM, g.m - m0), n_count = min(BN, g.n - n0);
#pragma unroll
  for (int i = 0; i < BN / 8; ++i) {
    const int col = 8 * i + 2 * tq;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = wg * 64 + warp * 16 + gr + 8 * h;
      if (col >= n_count || row >= m_count) continue;
      TG* p = dw + static_cast<int64_t>(m0 + row) * g.n + n0 + col;
      if constexpr (sizeof(TG) == 4) {
        float2* q = reinterpret_cast<float2*>(p);
        const float2 old = *q;
        *q = make_float2(old.x + acc[4 * i + 2 * h], old.y + acc[4 * i + 2 * h + 1]);
      } else {
        __nv_bfloat162* q = reinterpret_cast<__nv_bfloat162*>(p);
        const float2 old = __bfloat1622float2(*q);
        *q = __floats2bfloat162_rn(old.x + acc[4 * i + 2 * h], old.y + acc[4 * i + 2 * h + 1]);
      }
    }
  }
}

int sm_count() {
  static const int count = [] {
    int device = 0, n = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device));
    return n;
  }();
  return count;
}

template <bool Forward, int BN, int Epi>
void launch(cudaStream_t s, const Args& g, const ExpertPointers& table, int64_t rows) {
  using Z = TileShape<BN>;
  static const bool configured = [] {
    // Sized for the most experts, so one setting serves every call.
    CUDA_CHECK(cudaFuncSetAttribute(grouped_wgmma_kernel<Forward, BN, Epi>,
                                    cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(Z::smem_bytes(kMaxGroupedExperts))));
    return true;
  }();
  (void)configured;
  // Every CTA past the device's tile count returns at once; the count is bounded on the host.
  const int64_t tiles = ((rows + kBM - 1) / kBM + g.experts) * g.n_tiles;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>(tiles, sm_count()));
  grouped_wgmma_kernel<Forward, BN, Epi><<<grid, kThreads, Z::smem_bytes(g.experts), s>>>(g, table);
  CUDA_CHECK_LAUNCH();
}

template <int BN, int Epi>
void launch_epilogue(cudaStream_t s, const Args& g, const ExpertPointers& table, int64_t rows, bool transpose_weight) {
  if (transpose_weight) launch<true, BN, Epi>(s, g, table, rows);
  else launch<false, BN, Epi>(s, g, table, rows);
}

template <int BN>
void launch_width(cudaStream_t s, const Args& g, const ExpertPointers& table, int64_t rows, bool transpose_weight,
                  int epilogue) {
  if (epilogue == kStaged) launch_epilogue<BN, kStaged>(s, g, table, rows, transpose_weight);
  else if (epilogue == kStagedAdd) launch_epilogue<BN, kStagedAdd>(s, g, table, rows, transpose_weight);
  else launch_epilogue<BN, kRegisters>(s, g, table, rows, transpose_weight);
}

template <int BN, typename TG>
void launch_weight_grad(cudaStream_t s, const WeightGradArgs& g, const ExpertPointers& grads, int experts) {
  using Z = TileShape<BN>;
  const size_t smem = Z::kStages * Z::kStageBytes + 1024;
  static const bool configured = [smem] {
    CUDA_CHECK(cudaFuncSetAttribute(weight_grad_wgmma_kernel<BN, TG>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                    static_cast<int>(smem)));
    return true;
  }();
  (void)configured;
  const unsigned grid = static_cast<unsigned>(experts) * g.m_tiles * g.n_tiles;
  weight_grad_wgmma_kernel<BN, TG><<<grid, kThreads, smem, s>>>(g, grads);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool moe_grouped_gemm_wgmma_supports(DType t, int64_t k, int64_t n) {
  return t == DType::BF16 && k % 8 == 0 && n % 8 == 0 && k >= kBK && n >= 64;
}

void moe_grouped_gemm_wgmma(cudaStream_t s, const void* x, int64_t rows, int64_t k, const ExpertPointers& weights,
                            int experts, bool transpose_weight, const int32_t* offsets, void* y, int64_t n,
                            bool accumulate, int tile_n, bool staged_epilogue, bool staged_accumulate) {
  if (rows == 0 || n == 0) return;
  if (tile_n == 0) tile_n = n >= 256 ? 256 : 128;
  if (tile_n != 128 && tile_n != 256) throw_message("moe_grouped_gemm", "the Hopper kernel's tiles are 128 or 256 wide");
  const int64_t n_tiles = (n + tile_n - 1) / tile_n;
  if ((rows + kBM - 1) / kBM + experts > 0x7fffffff / n_tiles)
    throw_message("moe_grouped_gemm", "too many routed rows for one launch");
  const Args g{static_cast<const bf16*>(x),
               static_cast<bf16*>(y),
               offsets,
               experts,
               static_cast<int>(n),
               static_cast<int>(k),
               static_cast<int>(n_tiles),
               static_cast<int>((k + kBK - 1) / kBK),
               accumulate};
  const int epilogue = !staged_epilogue ? kRegisters : !accumulate ? kStaged : staged_accumulate ? kStagedAdd : kRegisters;
  if (tile_n == 128) launch_width<128>(s, g, weights, rows, transpose_weight, epilogue);
  else launch_width<256>(s, g, weights, rows, transpose_weight, epilogue);
}

void moe_grouped_gemm_weight_grad_wgmma(cudaStream_t s, const void* dy, const void* x, int64_t rows, int64_t m,
                                        int64_t n, const int32_t* offsets, const ExpertPointers& weight_grads,
                                        int experts, DType grad_dtype, int tile_n) {
  if (rows == 0 || m == 0 || n == 0) return;
  if (tile_n == 0) tile_n = n >= 256 ? 256 : 128;
  if (tile_n != 128 && tile_n != 256)
    throw_message("moe_grouped_gemm_weight_grad", "the Hopper kernel's tiles are 128 or 256 wide");
  const int64_t m_tiles = (m + kBM - 1) / kBM, n_tiles = (n + tile_n - 1) / tile_n;
  if (m_tiles * n_tiles * experts > 0x7fffffff) throw_message("moe_grouped_gemm_weight_grad", "too many tiles");
  const WeightGradArgs g{static_cast<const bf16*>(dy), static_cast<const bf16*>(x), offsets,
                         static_cast<int>(m),          static_cast<int>(n),         static_cast<int>(m_tiles),
                         static_cast<int>(n_tiles)};
  const bool f32 = grad_dtype == DType::F32;
  if (!f32 && grad_dtype != DType::BF16) throw_dtype("moe_grouped_gemm_weight_grad", grad_dtype);
  if (tile_n == 128) {
    if (f32) launch_weight_grad<128, float>(s, g, weight_grads, experts);
    else launch_weight_grad<128, bf16>(s, g, weight_grads, experts);
  } else {
    if (f32) launch_weight_grad<256, float>(s, g, weight_grads, experts);
    else launch_weight_grad<256, bf16>(s, g, weight_grads, experts);
  }
}

}  // namespace spindle::cuda
