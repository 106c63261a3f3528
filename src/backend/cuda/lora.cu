// The backward of a LoRA projection's B product from one read of dy (kernels.h, lora_b_backward).
//
// Per projection, dxa = s·dy·B [T, r] and dB += s·dyᵀ·xa [out, r] both stream dy [T, out], the
// largest tensor of the pair by out/r (560× for the MLP at r 16); as two GEMMs they read it twice.
// Here each block owns a strip of up to 512 rows and walks it in tiles of 128 rows × 128 columns
// (rows of 256 contiguous bytes). A tile is loaded into shared memory once (cp.async, 3–4 stages)
// and feeds both products on the tensor cores (mma.sync m16n8k16, F32 accumulation):
//   dxa: every warp keeps 16 rows × r of each row tile in registers across all chunks;
//   dB:  every warp sums 16 of the chunk's columns × r over the strip's rows, then writes them as
//        the strip's F32 partial [strips, out, r].
// A second kernel sums the partials in strip order (no atomics: the result does not depend on
// scheduling) and adds s·Σ onto dB in F32 before the one rounding, as cuBLAS does with beta 1.
//
// Budget (H200, T 64k, out 8960, r 16): dy 1.17 GB read once (≈ 0.29 ms at 4 TB/s) against twice;
// partials 128 strips × 8960 × 16 × 4 B = 73 MB written and read (≈ 12 % of dy); 2·2·T·out·r =
// 37.6 GFLOP on mma.sync, far below its rate. Measured (bench_cuda --lora): 0.467 ms, dy at 2.5
// TB/s, against 0.581 ms for the two GEMMs; so it is not yet at the bound its bytes set (earlier
// forms with 64- and 128-byte row pieces and 2 or 4 stages: 2.0–2.5 TB/s). docs/perf-history.md.
#include <cuda_bf16.h>

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.h"
#include "backend/cuda/lora_scratch.h"
#include "backend/cuda/mma_util.cuh"

namespace spindle::cuda {
namespace {

constexpr int kTile = kLoraTile;      // a tile of dy: 128 rows × 128 columns (256 contiguous bytes a row)
constexpr int kWarps = 8;             // 256 threads
constexpr int kDyPitch = kTile + 8;   // bf16 per shared row: the 16-byte pad makes ldmatrix conflict-free

template <int R, int SUB, int STAGES>
struct LoraSmem {
  static constexpr int kRows = SUB * kTile;  // the strip: SUB tiles of rows
  static constexpr int kRPitch = R + 8;
  struct Stage {
    bf16 dy[kTile * kDyPitch];  // [row of the tile][column of the chunk]
    bf16 b[kTile * kRPitch];    // B's rows of the chunk [row][r]
  };
  Stage stage[STAGES];
  bf16 xa[kRows * kRPitch];  // [row of the strip][r]
};

// dy [t, n], b [n, R], xa [t, R] -> dxa [t, R] = s·dy·b; part [gridDim.x, n, R] = dy[strip]ᵀ·xa[strip]
// (part null: no dB). The block walks its strip's tiles chunk by chunk (chunk = 128 columns, all SUB
// row tiles of it, then the next chunk). dxa: warp w owns rows w·16 … of every row tile; dB: warp w
// owns the chunk's columns w·16 … over all the strip's rows, so no warp's sums meet another's.
template <int R, int SUB, int STAGES>
__global__ void __launch_bounds__(kWarps * 32)
    lora_b_backward_kernel(const bf16* __restrict__ dy, const bf16* __restrict__ b, const bf16* __restrict__ xa,
                           int64_t t, int n, float scaling, bf16* __restrict__ dxa, float* __restrict__ part) {
  using Smem = LoraSmem<R, SUB, STAGES>;
  constexpr int kRows = Smem::kRows, kRPitch = Smem::kRPitch;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int warp = static_cast<int>(threadIdx.x) / 32, lane = static_cast<int>(threadIdx.x) % 32;
  const int64_t row0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int tiles = n / kTile * SUB;

  // Rows past t load as zeros: they add nothing to dB and their dxa is not stored.
  for (int i = static_cast<int>(threadIdx.x); i < kRows * (R / 8); i += kWarps * 32) {
    const int r = i / (R / 8), p = i % (R / 8);
    const bool ok = row0 + r < t;
    mma::cp_async16(mma::smem_addr(&sm.xa[r * kRPitch + p * 8]), ok ? xa + (row0 + r) * R + p * 8 : xa, ok);
  }
  // Tile i = (chunk i / SUB, row tile i % SUB), with B's rows of its chunk. One commit group per
  // tile (empty past the last), so "all but the newest STAGES − 2 groups done" means tile i landed.
  auto load_tile = [&](int i) {
    if (i < tiles) {
      typename Smem::Stage& st = sm.stage[i % STAGES];
      const int64_t col0 = static_cast<int64_t>(i / SUB) * kTile, r0 = row0 + (i % SUB) * kTile;
      for (int j = static_cast<int>(threadIdx.x); j < kTile * (kTile / 8); j += kWarps * 32) {
        const int r = j / (kTile / 8), p = j % (kTile / 8);
        const bool ok = r0 + r < t;
        mma::cp_async16(mma::smem_addr(&st.dy[r * kDyPitch + p * 8]), ok ? dy + (r0 + r) * n + col0 + p * 8 : dy, ok);
      }
      for (int j = static_cast<int>(threadIdx.x); j < kTile * (R / 8); j += kWarps * 32) {
        const int r = j / (R / 8), p = j % (R / 8);
        mma::cp_async16(mma::smem_addr(&st.b[r * kRPitch + p * 8]), b + (col0 + r) * R + p * 8, true);
      }
    }
    mma::cp_async_commit();
  };
  for (int i = 0; i < STAGES - 1; ++i) load_tile(i);  // the first group also carries xa

  float acc_x[SUB][R / 8][4] = {};    // dxa: this warp's 16 rows of every row tile
  float acc_b[R / 16][2][4] = {};     // dB: this warp's 16 columns of the chunk × R
  const int g = lane / 4, tq = lane % 4;
  for (int i = 0; i < tiles; ++i) {
    mma::cp_async_wait<STAGES - 2>();
    __syncthreads();         // tile i visible to all; tile i − 1's stage is free again
    load_tile(i + STAGES - 1);  // into the stage tile i − 1 used
    const typename Smem::Stage& st = sm.stage[i % STAGES];
    const int sub = i % SUB;

    // dxa[rows sub·128 + warp·16 …] += dy[those rows, chunk] · b[chunk]
#pragma unroll
    for (int kk = 0; kk < kTile / 16; ++kk) {
      uint32_t a[4];
      mma::ldmatrix_x4(a, mma::a_frag_addr(st.dy, kDyPitch, warp * 16, kk * 16, lane));
#pragma unroll
      for (int nj = 0; nj < R / 16; ++nj) {
        uint32_t bf[4];
        mma::ldmatrix_x4_trans(bf, mma::b_frag_addr_kn(st.b, kRPitch, kk * 16, nj * 16, lane));
#pragma unroll
        for (int s = 0; s < SUB; ++s)
          if (s == sub) {  // registers cannot be indexed at run time: pick the tile's accumulators
            mma::mma_bf16(acc_x[s][2 * nj], a, bf[0], bf[1]);
            mma::mma_bf16(acc_x[s][2 * nj + 1], a, bf[2], bf[3]);
          }
      }
    }
    if (!part) continue;

    // dB[chunk columns warp·16 …] += dy[tile rows, those columns]ᵀ · xa[tile rows]
#pragma unroll
    for (int ks = 0; ks < kTile / 16; ++ks) {
      uint32_t a[4];
      mma::ldmatrix_x4_trans(a, mma::a_frag_addr_trans(st.dy, kDyPitch, ks * 16, warp * 16, lane));
#pragma unroll
      for (int nj = 0; nj < R / 16; ++nj) {
        uint32_t bx[4];
        mma::ldmatrix_x4_trans(bx, mma::b_frag_addr_kn(sm.xa, kRPitch, sub * kTile + ks * 16, nj * 16, lane));
        mma::mma_bf16(acc_b[nj][0], a, bx[0], bx[1]);
        mma::mma_bf16(acc_b[nj][1], a, bx[2], bx[3]);
      }
    }
    if (sub == SUB - 1) {  // the chunk is done: this strip's partial for its columns
      const int64_t col = static_cast<int64_t>(i / SUB) * kTile + warp * 16;
      float* out = part + (static_cast<int64_t>(blockIdx.x) * n + col) * R;
#pragma unroll
      for (int nj = 0; nj < R / 16; ++nj)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float* o = out + nj * 16 + h * 8 + 2 * tq;
          *reinterpret_cast<float2*>(o + g * R) = make_float2(acc_b[nj][h][0], acc_b[nj][h][1]);
          *reinterpret_cast<float2*>(o + (g + 8) * R) = make_float2(acc_b[nj][h][2], acc_b[nj][h][3]);
          acc_b[nj][h][0] = acc_b[nj][h][1] = acc_b[nj][h][2] = acc_b[nj][h][3] = 0.0f;
        }
    }
  }
  mma::cp_async_wait<0>();  // no copy may still target shared memory when the block exits

#pragma unroll
  for (int s = 0; s < SUB; ++s) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int64_t row = row0 + s * kTile + warp * 16 + g + half * 8;
      if (row >= t) continue;
#pragma unroll
      for (int j = 0; j < R / 8; ++j) {
        const uint32_t v = mma::pack_bf16(scaling * acc_x[s][j][2 * half], scaling * acc_x[s][j][2 * half + 1]);
        *reinterpret_cast<uint32_t*>(dxa + row * R + j * 8 + 2 * tq) = v;
      }
    }
  }
}

// db[i] = bf16(db[i] + s·Σ_strip part[strip][i]), strips in order.
__global__ void lora_db_reduce_kernel(const float* __restrict__ part, int strips, int64_t count, float scaling,
                                      bf16* __restrict__ db) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= count) return;
  float sum = 0.0f;
  for (int s = 0; s < strips; ++s) sum += part[s * count + i];
  db[i] = from_f32<bf16>(to_f32(db[i]) + scaling * sum);
}

template <int R, int SUB, int STAGES>
void launch(cudaStream_t s, const bf16* dy, const bf16* b, const bf16* xa, int64_t t, int n, float scaling, bf16* dxa,
            bf16* db) {
  using Smem = LoraSmem<R, SUB, STAGES>;
  const int64_t strips = lora_b_strips(t, SUB);  // as lora_scratch.h counts them for spindle plan
  const size_t smem = sizeof(Smem);
  auto kernel = lora_b_backward_kernel<R, SUB, STAGES>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
  Scratch part(s, db ? static_cast<size_t>(strips) * n * R * sizeof(float) : 0);  // none for a frozen B
  kernel<<<static_cast<unsigned>(strips), kWarps * 32, smem, s>>>(dy, b, xa, t, n, scaling, dxa, part.as<float>());
  CUDA_CHECK(cudaGetLastError());
  if (!db) return;
  const int64_t count = static_cast<int64_t>(n) * R;
  lora_db_reduce_kernel<<<static_cast<unsigned>((count + 255) / 256), 256, 0, s>>>(part.as<float>(),
                                                                                    static_cast<int>(strips), count,
                                                                                    scaling, db);
  CUDA_CHECK(cudaGetLastError());
}

// Row tiles per strip on this GPU (lora_scratch.h: as many as keep ≈ one block per SM or more, within
// shared memory).
int tiles_per_strip(int64_t t, int r) {
  static const int sms = [] {
    int device = 0, count = 0;
    CUDA_CHECK(cudaGetDevice(&device));
    CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
    return count;
  }();
  return lora_b_tiles_per_strip(t, r, sms);
}

}  // namespace

bool lora_b_backward_supported(int64_t n, int64_t r) { return lora_b_backward_shape_supported(n, r); }

void lora_b_backward(cudaStream_t s, const void* dy, const void* b, const void* xa, int64_t t, int64_t n, int64_t r,
                     float scaling, void* dxa, void* db) {
  if (t <= 0) return;  // the caller checked the shapes (lora_b_backward_supported)
  const auto* dyp = static_cast<const bf16*>(dy);
  const auto* bp = static_cast<const bf16*>(b);
  const auto* xap = static_cast<const bf16*>(xa);
  auto* dxap = static_cast<bf16*>(dxa);
  auto* dbp = static_cast<bf16*>(db);
  const int ni = static_cast<int>(n);
  const int sub = tiles_per_strip(t, static_cast<int>(r));
  // Shared memory (KB): r 16: 4 stages of 40 + xa 24·sub; r 32: 4 × 44 + 10·sub; r 64: 3 × 52 + 18·sub.
  switch (r * 10 + sub) {
    case 164: launch<16, 4, 4>(s, dyp, bp, xap, t, ni, scaling, dxap, dbp); break;
    case 162: launch<16, 2, 4>(s, dyp, bp, xap, t, ni, scaling, dxap, dbp); break;
    case 161: launch<16, 1, 4>(s, dyp, bp, xap, t, ni, scaling, dxap, dbp); break;
    case 324: launch<32, 4, 4>(s, dyp, bp, xap, t, ni, scaling, dxap, dbp); break;
    case 322: launch<32, 2, 4>(s, dyp, bp, xap, t, ni, scaling, dxap, dbp); break;
    case 321: launch<32, 1, 4>(s, dyp, bp, xap, t, ni, scaling, dxap, dbp); break;
    case 642: launch<64, 2, 3>(s, dyp, bp, xap, t, ni, scaling, dxap, dbp); break;
    default: launch<64, 1, 3>(s, dyp, bp, xap, t, ni, scaling, dxap, dbp); break;
  }
}

}  // namespace spindle::cuda
