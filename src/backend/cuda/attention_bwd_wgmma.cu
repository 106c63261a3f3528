// Attention backward for Hopper (sm_90a), head dim 128, BF16 inputs: the FlashAttention-3
// structure, written for this engine's document/position mask.
//
// A block owns one 128-key tile of K and V (of the kv head its query head reads) and one query
// head, and walks the 64-row query tiles that can see the keys (the span tile_spans gives it).
// Three warpgroups: in the first, one thread streams Q, dO and the per-row terms (LSE·log2 e,
// delta) of each query tile into a two-stage ring with the copy engine and another adds the
// consumers' staged dQ parts to global memory; two consumers own 64 keys each. Per query tile a consumer computes
//   Sᵀ  = K·Qᵀ, dPᵀ = V·dOᵀ            (wgmma from shared memory, 64 keys × 64 queries)
//   Pᵀ  = exp2(Sᵀ·scale·log2 e − LSE·log2 e), dSᵀ = Pᵀ ∘ (dPᵀ − delta)
//   dV += Pᵀ·dO,  dK += dSᵀ·Q          (A from registers, accumulated over the whole walk)
//   dQ  = dS·K                          (dSᵀ of both consumers through shared memory; each
//                                        consumer takes 64 of the 128 head-dim columns)
// and stages its dQ part in shared memory, from where the copy engine's reduce-add puts it into an
// f32 accumulator in global memory. At the end dK and dV go to f32
// accumulators too (query heads of a GQA group add up there); small passes apply the softmax
// scale and round to bf16 (attention_dq_finish).
//
// Budget per (64 queries × 128 keys) step: 5 products of 2·64·128·128 = 10.5 MFLOP on the
// tensor cores (≈ 2560 cycles of one SM) against 8192 exp2 (≈ 512 cycles).
#include <cmath>
#include <cstdlib>
#include <cstring>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/attention_scratch.h"
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/hopper.cuh"
#include "backend/cuda/tensor_map.h"

namespace spindle::cuda {
namespace {

using namespace hopper;

constexpr int kD = 128;
constexpr int kBN = 128;  // keys per block
constexpr int kBM = 64;   // query rows per step
// Q/dO ring stages, dSᵀ exchange buffers (2: no barrier before writing) and dQ staging buffers
// per consumer. 2/1/2, 2/2/2, 3/1/1 and 3/2/1 measured the same (435-453 TFLOP/s at 32k causal).
constexpr int kStages = 2;
constexpr int kDsBuffers = 1;
constexpr int kDqBuffers = 2;
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr float kLog2e = 1.4426950408889634f;

constexpr uint32_t kKvChunk = kBN * 128;  // bytes of one [128 keys][64 cols] chunk
constexpr uint32_t kQChunk = kBM * 128;   // bytes of one [64 rows][64 cols] chunk

struct alignas(1024) Smem {
  bf16 k[kBN * kD];  // 2 chunks [128][64]
  bf16 v[kBN * kD];
  bf16 q[kStages][kBM * kD];   // 2 chunks [64][64]
  bf16 dout[kStages][kBM * kD];
  bf16 ds[kDsBuffers][kBN * kBM];  // dSᵀ [128 keys][64 queries], one swizzled chunk
  float dq[kConsumers][kDqBuffers][2][kBM * 32];  // per consumer, 2 buffers of its 64 dQ columns as
                                        // swizzled [64][32] boxes, for the writer's reduce-add
  float lse2[kStages][kBM];    // LSE·log2 e (+inf: row has no key or is padding)
  float delta[kStages][kBM];
  int step_tile[kStages];   // query tile of the step in this stage (-1: the walk is over)
  int step_class[kStages];  // its TileClass
  TileLayout step_layout[kStages];  // its queries' layout (mixed tiles only)
  uint64_t kv_full, full[kStages], empty[kStages];
  uint64_t dq_full[kConsumers][kDqBuffers], dq_empty[kConsumers][kDqBuffers];
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;
static_assert(kSmemBytes <= 227 * 1024, "the backward kernel needs more shared memory than an H100/H200 block has");

struct Params {
  AttentionShape sh;
  AttentionMaskPtrs mask;
  const TileRange *q_ranges, *k_ranges;  // tiles of kBM queries / kBN keys
  const TileSpan* q_spans;                // per key tile: the query tiles to walk
  const TileLayout* q_layouts;            // per query tile
  const float *lse2, *delta;             // [hq, tq_pad]
  int64_t tq_pad;
  float scale_log2;
  float *dk_acc, *dv_acc;  // f32 [tk, hkv, D] (dQ's f32 accumulator is reached through dq_map)
};

// Plain 1-D bulk copy global -> shared, completion counted on `bar`.
__device__ __forceinline__ void bulk_load(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];\n" ::"r"(
                   smem_u32(dst)),
               "l"(src), "r"(bytes), "r"(smem_u32(bar))
               : "memory");
}

// Byte offset of element (row, col) in a [rows][64] bf16 chunk with the 128-byte swizzle.
__device__ __forceinline__ uint32_t swizzled(int row, int col) {
  return row * 128 + ((((col * 2) >> 4) ^ (row & 7)) << 4) + ((col * 2) & 15);
}

// dQ accumulator fragment (m64n64) -> two swizzled [64 rows][32 f32] boxes in shared memory at
// `boxes`, laid out as the copy engine reads them for the reduce-add. Element (row, 8j + 2t)
// sits at row·128 + ((2·(j % 4) + t / 2) ⊕ (row % 8))·16 + 8·(t % 2) of box j / 4.
__device__ __forceinline__ void stage_dq(const float (&dq)[32], uint32_t boxes, int warp, int g, int t) {
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int qr = warp * 16 + g + 8 * r;
    const uint32_t base = qr * 128 + (((t >> 1) ^ (qr & 7)) << 4) + 8 * (t & 1);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      st_shared_f32x2(boxes + (j / 4) * (kBM * 128) + (base ^ ((j % 4) << 5)), dq[4 * j + 2 * r], dq[4 * j + 2 * r + 1]);
  }
}

// grid (hq, ceil(tk / 128)); key tile 0 of every head (the most query tiles under a causal mask)
// first.
__global__ void __launch_bounds__(kThreads, 1)
    backward_wgmma_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                          const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap do_map,
                          const __grid_constant__ CUtensorMap dq_map, const Params p) {
  extern __shared__ unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});

  const AttentionShape& sh = p.sh;
  const int wg = threadIdx.x / 128;
  const int k_tile = blockIdx.y;
  const int h = blockIdx.x, hk = h / (sh.hq / sh.hkv);
  const int64_t k0 = static_cast<int64_t>(k_tile) * kBN;
  const TileRange kr = load_range(p.k_ranges + k_tile);
  const bool k_complete = k0 + kBN <= sh.tk;
  auto tile_class = [&](int i) { return classify_tile(load_range(p.q_ranges + i), kr, k_complete, p.mask.window); };

  if (threadIdx.x == 0) {
    mbar_init(&sm.kv_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.full[s], 1);
      mbar_init(&sm.empty[s], kConsumers * 4);
    }
    for (int c = 0; c < kConsumers; ++c)
      for (int b = 0; b < kDqBuffers; ++b) {
        mbar_init(&sm.dq_full[c][b], 4);  // one arrival per consumer warp
        mbar_init(&sm.dq_empty[c][b], 1);
      }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    regs_release<24>();
    if (threadIdx.x == 0) {
      // Loader: K and V once, then Q, dO and the row terms of every query tile that sees the
      // keys, each step's tile and class posted next to its data (the consumers never read the
      // tile ranges from global memory), then an end marker.
      tma_prefetch_descriptor(&q_map);
      tma_prefetch_descriptor(&do_map);
      mbar_arrive_expect_tx(&sm.kv_full, 2 * kBN * kD * 2);
      for (int c = 0; c < kD / 64; ++c) {
        tma_load_2d(sm.k + c * kBN * 64, &k_map, hk * kD + c * 64, static_cast<int>(k0), &sm.kv_full);
        tma_load_2d(sm.v + c * kBN * 64, &v_map, hk * kD + c * 64, static_cast<int>(k0), &sm.kv_full);
      }
      int it = 0;
      const TileSpan span = load_span(p.q_spans + k_tile);
      for (int i = span.first; i < span.end; ++i) {
        const int cls = tile_class(i);
        if (cls == kTileSkip) continue;
        const int stage = it % kStages;
        if (it >= kStages) mbar_wait(&sm.empty[stage], ((it / kStages) - 1) & 1);
        ++it;
        sm.step_tile[stage] = i;
        sm.step_class[stage] = cls;
        const int y = i * kBM;
        const bool mixed = cls == kTileMixed;
        mbar_arrive_expect_tx(&sm.full[stage],
                              2 * kBM * kD * 2 + 2 * kBM * 4 + (mixed ? sizeof(TileLayout) : 0));
        // (by the copy engine: this thread has too few registers to copy it through them)
        if (mixed) bulk_load(&sm.step_layout[stage], p.q_layouts + i, sizeof(TileLayout), &sm.full[stage]);
        for (int c = 0; c < kD / 64; ++c) {
          tma_load_2d(sm.q[stage] + c * kBM * 64, &q_map, h * kD + c * 64, y, &sm.full[stage]);
          tma_load_2d(sm.dout[stage] + c * kBM * 64, &do_map, h * kD + c * 64, y, &sm.full[stage]);
        }
        bulk_load(sm.lse2[stage], p.lse2 + h * p.tq_pad + y, kBM * 4, &sm.full[stage]);
        bulk_load(sm.delta[stage], p.delta + h * p.tq_pad + y, kBM * 4, &sm.full[stage]);
      }
      const int stage = it % kStages;
      if (it >= kStages) mbar_wait(&sm.empty[stage], ((it / kStages) - 1) & 1);
      sm.step_tile[stage] = -1;
      mbar_arrive(&sm.full[stage]);
    } else if (threadIdx.x == 32) {
      // dQ writer: walks the same query tiles; each consumer's staged dQ part goes into dq_acc
      // by the copy engine's reduce-add (rows past tq are dropped by it). A staging buffer goes
      // back to its consumer once the copy engine has read it, so the consumers never wait for
      // the reduce themselves.
      tma_prefetch_descriptor(&dq_map);
      int n = 0;
      const TileSpan span = load_span(p.q_spans + k_tile);
      for (int i = span.first; i < span.end; ++i) {
        if (tile_class(i) == kTileSkip) continue;
        const int b = n % kDqBuffers;
        for (int c = 0; c < kConsumers; ++c) {
          mbar_wait(&sm.dq_full[c][b], (n / kDqBuffers) & 1);
          const int x = h * kD + c * 64;
          tma_reduce_add_2d(&dq_map, x, i * kBM, sm.dq[c][b][0]);
          tma_reduce_add_2d(&dq_map, x + 32, i * kBM, sm.dq[c][b][1]);
          bulk_commit();
        }
        // Step m's buffers are read once at most the later steps' reduces are pending.
        bulk_wait_read<kConsumers * (kDqBuffers - 1)>();
        const int m = n - (kDqBuffers - 1);
        if (m >= 0)
          for (int c = 0; c < kConsumers; ++c) mbar_arrive(&sm.dq_empty[c][m % kDqBuffers]);
        ++n;
      }
      bulk_wait_all();  // the block's shared memory must outlive the reduces
    }
    return;
  }

  regs_claim<240>();
  const int cw = wg - 1;  // keys 64·cw … 64·cw + 63 of the tile
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // This thread's two key rows (r = 0: row g of its warp's 16, r = 1: row g + 8), tile-local.
  int krow[2], kdoc[2], kpos[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    krow[r] = cw * 64 + warp * 16 + g + 8 * r;
    const int64_t key = k0 + krow[r];
    kdoc[r] = key < sh.tk ? p.mask.k_doc[key] : 0;
    kpos[r] = key < sh.tk ? p.mask.k_pos[key] : 0;
  }
  const uint32_t k_rows = smem_u32(sm.k) + cw * 64 * 128;  // this consumer's 64 key rows, chunk 0
  const uint32_t v_rows = smem_u32(sm.v) + cw * 64 * 128;

  float dk[kD / 2], dv[kD / 2];
#pragma unroll
  for (int e = 0; e < kD / 2; ++e) dk[e] = dv[e] = 0.f;

  mbar_wait(&sm.kv_full, 0);
  for (int it = 0;; ++it) {
    const int stage = it % kStages;
    mbar_wait(&sm.full[stage], (it / kStages) & 1);
    const int i = ld_shared_s32(smem_u32(&sm.step_tile[stage]));
    if (i < 0) break;
    const int cls = ld_shared_s32(smem_u32(&sm.step_class[stage]));
    const int64_t qbase = static_cast<int64_t>(i) * kBM;
    const uint32_t q_base = smem_u32(sm.q[stage]), do_base = smem_u32(sm.dout[stage]);
    const uint32_t lse2_row = smem_u32(sm.lse2[stage]), delta_row = smem_u32(sm.delta[stage]);

    // Sᵀ = K·Qᵀ and dPᵀ = V·dOᵀ: 64 keys × 64 queries each, reduction over the head dim; two
    // commit groups, so that Pᵀ is computed while dPᵀ's product still runs.
    float st[kBM / 2], dpt[kBM / 2];
    wgmma_fence();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks / 4) * kKvChunk + (ks % 4) * 32, qoff = (ks / 4) * kQChunk + (ks % 4) * 32;
      wgmma_ss_n64<0, 0>(st, smem_desc(k_rows + off, 16, 1024), smem_desc(q_base + qoff, 16, 1024), ks > 0);
    }
    wgmma_commit();
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks / 4) * kKvChunk + (ks % 4) * 32, qoff = (ks / 4) * kQChunk + (ks % 4) * 32;
      wgmma_ss_n64<0, 0>(dpt, smem_desc(v_rows + off, 16, 1024), smem_desc(do_base + qoff, 16, 1024), ks > 0);
    }
    wgmma_commit();
    wgmma_wait<1>();
    fence_regs(st);

    // Pᵀ = exp2(Sᵀ·scale·log2 e − LSE·log2 e) in place of Sᵀ; column c of this thread's
    // accumulators is query 8j + 2t + (c & 1).
    uint32_t pa[kBM / 4], dsa[kBM / 4];  // bf16 A fragments (k = queries)
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j) {
      const float2 lse2 = ld_shared_f32x2(lse2_row + 4 * (8 * j + 2 * t));
      // A mixed tile: document and position of this thread's two queries (columns 8j + 2t and
      // + 1), from the tile's layout when regular (re-read per j: registers are scarce here).
      int qd[2] = {0, 0}, qp[2] = {0, 0};
      if (cls == kTileMixed) {
        const uint32_t lay_addr = smem_u32(&sm.step_layout[stage]);
        const int4 l0 = ld_shared_s32x4(lay_addr), l1 = ld_shared_s32x4(lay_addr + 16);
        const TileLayout lay{l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, 0, 0};
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int col = 8 * j + 2 * t + c;
          const int64_t qi = qbase + col;
          if (lay.regular) {
            qd[c] = layout_doc(lay, col);
            qp[c] = layout_pos(lay, col);
          } else if (qi < sh.tq) {
            qd[c] = p.mask.q_doc[qi];
            qp[c] = p.mask.q_pos[qi];
          }
        }
      }
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const int col = 8 * j + 2 * t + (c & 1), r = c >> 1;
        float x = exp2_approx(fmaf(st[4 * j + c], p.scale_log2, -(c & 1 ? lse2.y : lse2.x)));
        if (cls == kTileMixed) {
          const bool visible = qbase + col < sh.tq && krow[r] + k0 < sh.tk &&
                               key_visible(qd[c & 1], qp[c & 1], kdoc[r], kpos[r], p.mask.window);
          if (!visible) x = 0.f;
        }
        st[4 * j + c] = x;
      }
      // Accumulator n8 block j -> half of the A fragment of k slice j / 2.
      const int f = 4 * (j / 2) + 2 * (j % 2);
      pa[f] = pack_bf16x2(st[4 * j], st[4 * j + 1]);
      pa[f + 1] = pack_bf16x2(st[4 * j + 2], st[4 * j + 3]);
    }

    float2 delta[kBM / 8];  // read before waiting for dPᵀ
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j) delta[j] = ld_shared_f32x2(delta_row + 4 * (8 * j + 2 * t));

    // dV += Pᵀ·dO (B = dO stored [query][dim]: MN-major), queued behind dPᵀ.
    fence_regs(dv);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk)
      wgmma_rs_n128<1>(dv, pa + 4 * kk, smem_desc(do_base + kk * 2048, kQChunk, 1024), 1);
    wgmma_commit();
    wgmma_wait<1>();  // dPᵀ done; dV may still run
    fence_regs(dpt);

    // dSᵀ = Pᵀ ∘ (dPᵀ − delta)
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j) {
      float dsv[4];
#pragma unroll
      for (int c = 0; c < 4; ++c) dsv[c] = st[4 * j + c] * (dpt[4 * j + c] - (c & 1 ? delta[j].y : delta[j].x));
      const int f = 4 * (j / 2) + 2 * (j % 2);
      dsa[f] = pack_bf16x2(dsv[0], dsv[1]);
      dsa[f + 1] = pack_bf16x2(dsv[2], dsv[3]);
    }

    // dSᵀ to shared memory for dQ = dS·K; the other consumer must be done reading the last one.
    // (Each consumer multiplying only its own keys into all 128 columns, which doubles the
    // reduce traffic but needs no exchange, measured slower: 421-426 vs 446-449 TFLOP/s.)
    const uint32_t ds_base = smem_u32(sm.ds[it % kDsBuffers]);
    if (kDsBuffers == 1) named_barrier(1, 256);
#pragma unroll
    for (int j = 0; j < kBM / 8; ++j)
#pragma unroll
      for (int r = 0; r < 2; ++r) st_shared_b32(ds_base + swizzled(krow[r], 8 * j + 2 * t), dsa[4 * (j / 2) + 2 * (j % 2) + r]);
    fence_proxy_async();
    named_barrier(2, 256);

    // dQ[:, 64·cw …] = dS·K: A = dSᵀ stored [key][query] (MN-major), B = K stored [key][dim]
    // (MN-major), reduction over the 128 keys. Issued before dK (FA3's order): dQ is ready while
    // dK still runs, so staging it overlaps dK's product.
    float dq[32];
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      wgmma_ss_n64<1, 1>(dq, smem_desc(ds_base + kk * 2048, kBN * 128, 1024),
                         smem_desc(smem_u32(sm.k) + cw * kKvChunk + kk * 2048, kKvChunk, 1024), kk > 0);
    wgmma_commit();

    // dK += dSᵀ·Q (B = Q stored [query][dim]: MN-major).
    fence_regs(dk);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kBM / 16; ++kk) wgmma_rs_n128<1>(dk, dsa + 4 * kk, smem_desc(q_base + kk * 2048, kQChunk, 1024), 1);
    wgmma_commit();
    wgmma_wait<1>();  // dV and dQ done; dK may still run
    fence_regs(dq);
    fence_regs(dv);
    fence_regs(pa);

    // Stage this consumer's dQ part for the writer (two buffers by step parity).
    const int b = it % kDqBuffers;
    if (it >= kDqBuffers) mbar_wait(&sm.dq_empty[cw][b], ((it / kDqBuffers) - 1) & 1);
    stage_dq(dq, smem_u32(sm.dq[cw][b][0]), warp, g, t);
    fence_proxy_async();  // the copy engine reads what these threads wrote
    __syncwarp();
    if (lane == 0) mbar_arrive(&sm.dq_full[cw][b]);

    wgmma_wait<0>();  // dK: Q is read
    fence_regs(dk);
    fence_regs(dsa);
    __syncwarp();
    if (lane == 0) mbar_arrive(&sm.empty[stage]);
  }

#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int64_t key = k0 + krow[r];
    if (key >= sh.tk) continue;
    float* dkr = p.dk_acc + (key * sh.hkv + hk) * kD;
    float* dvr = p.dv_acc + (key * sh.hkv + hk) * kD;
#pragma unroll
    for (int j = 0; j < kD / 8; ++j) {
      atomicAdd(reinterpret_cast<float2*>(dkr + 8 * j + 2 * t), make_float2(dk[4 * j + 2 * r], dk[4 * j + 2 * r + 1]));
      atomicAdd(reinterpret_cast<float2*>(dvr + 8 * j + 2 * t), make_float2(dv[4 * j + 2 * r], dv[4 * j + 2 * r + 1]));
    }
  }
}

// lse2 [hq, tq_pad] = LSE·log2 e, +inf for rows without keys and for padding rows (their P is 0);
// delta [hq, tq_pad] = Σ dout·out (0 on padding rows). One warp per (head, row).
__global__ void prepare_rows_kernel(const bf16* out, const bf16* dout, const float* lse, int64_t tq, int64_t tq_pad,
                                    int hq, float* lse2, float* delta) {
  const int64_t w = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (w >= tq_pad * hq) return;
  const int h = static_cast<int>(w / tq_pad);
  const int64_t row = w % tq_pad;
  float acc = 0.f, l = INFINITY;
  if (row < tq) {
    const bf16* o = out + (row * hq + h) * kD;
    const bf16* g = dout + (row * hq + h) * kD;
    for (int e = lane * 4; e < kD; e += 128) {
      const float2 o01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o + e));
      const float2 o23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(o + e + 2));
      const float2 g01 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(g + e));
      const float2 g23 = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(g + e + 2));
      acc += o01.x * g01.x + o01.y * g01.y + o23.x * g23.x + o23.y * g23.y;
    }
    acc = warp_sum(acc);
    const float x = lse[static_cast<int64_t>(h) * tq + row];
    l = x == -INFINITY ? INFINITY : x * kLog2e;
  }
  if (lane == 0) {
    lse2[w] = l;
    delta[w] = acc;
  }
}

}  // namespace

void attention_backward_wgmma(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                              const void* out, const void* dout, const float* lse, const AttentionMaskPtrs& mask,
                              float scale, DType grad, void* dq, void* dk, void* dv, bool accumulate) {
  if (sh.tq == 0 || sh.tk == 0) {
    attention_backward_simple(s, sh, DType::BF16, q, k, v, out, dout, lse, mask, scale, grad, dq, dk, dv, accumulate);
    return;
  }
  if (sh.d != kD) throw_message("attention_backward", "the Hopper kernel needs head dim 128");
  const int64_t q_tiles = (sh.tq + kBM - 1) / kBM, k_tiles = (sh.tk + kBN - 1) / kBN;
  if (k_tiles > 65535 || sh.hq > 0x7fffffff || sh.tq > 0x7fffffff || sh.tk > 0x7fffffff)
    throw_message("attention_backward", "too many tokens or heads for the Hopper kernel");
  const int64_t tq_pad = q_tiles * kBM;
  const int64_t nq = sh.tq * sh.hq * kD, nk = sh.tk * sh.hkv * kD;
  // f32 scratch: dq/dk/dv accumulators, then the per-row terms (sized as spindle plan counts them).
  static_assert(kBM == kAttentionWgmmaBackwardRows, "attention_scratch.h pads Tq to kBM rows");
  Scratch scratch(s, attention_wgmma_backward_f32_bytes(sh.tq, sh.tk, sh.hq, sh.hkv, kD) +
                         static_cast<size_t>(q_tiles + k_tiles) * sizeof(TileRange) +
                         (k_tiles + 1) * sizeof(TileSpan) + q_tiles * sizeof(TileLayout));
  float* dq_acc = scratch.as<float>();
  float* dk_acc = dq_acc + nq;
  float* dv_acc = dk_acc + nk;
  float* lse2 = dv_acc + nk;
  float* delta = lse2 + sh.hq * tq_pad;
  auto* ranges = reinterpret_cast<TileRange*>(delta + sh.hq * tq_pad);
  CUDA_CHECK(cudaMemsetAsync(dq_acc, 0, static_cast<size_t>(nq + 2 * nk) * 4, s));
  tile_ranges(s, mask.q_doc, mask.q_pos, sh.tq, kBM, ranges);
  tile_ranges(s, mask.k_doc, mask.k_pos, sh.tk, kBN, ranges + q_tiles);
  auto* q_spans = reinterpret_cast<TileSpan*>(ranges + q_tiles + k_tiles);
  tile_spans(s, ranges, q_tiles, ranges + q_tiles, k_tiles, /*per_query=*/false, mask.window, q_spans);
  auto* q_layouts = reinterpret_cast<TileLayout*>(q_spans + k_tiles + (k_tiles & 1));  // 16-byte aligned
  tile_layouts(s, mask.q_doc, mask.q_pos, sh.tq, kBM, q_layouts);
  const int64_t warps = sh.hq * tq_pad;
  prepare_rows_kernel<<<static_cast<unsigned>((warps * 32 + 255) / 256), 256, 0, s>>>(
      static_cast<const bf16*>(out), static_cast<const bf16*>(dout), lse, sh.tq, tq_pad, sh.hq, lse2, delta);
  CUDA_CHECK_LAUNCH();

  const CUtensorMap q_map = bf16_tile_map(q, sh.tq, int64_t{sh.hq} * kD, kBM);
  const CUtensorMap do_map = bf16_tile_map(dout, sh.tq, int64_t{sh.hq} * kD, kBM);
  const CUtensorMap k_map = bf16_tile_map(k, sh.tk, int64_t{sh.hkv} * kD, kBN);
  const CUtensorMap v_map = bf16_tile_map(v, sh.tk, int64_t{sh.hkv} * kD, kBN);
  const Params p{sh,   mask,   ranges, ranges + q_tiles, q_spans, q_layouts, lse2, delta, tq_pad, scale * kLog2e,
                 dk_acc, dv_acc};
  const CUtensorMap dq_map = f32_tile_map(dq_acc, sh.tq, int64_t{sh.hq} * kD, kBM);
  auto kernel = backward_wgmma_kernel;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes)));
  kernel<<<dim3(static_cast<unsigned>(sh.hq), static_cast<unsigned>(k_tiles)), kThreads, kSmemBytes, s>>>(
      q_map, k_map, v_map, do_map, dq_map, p);
  CUDA_CHECK_LAUNCH();
  attention_dq_finish(s, grad, dq_acc, scale, dq, nq, accumulate);
  attention_dq_finish(s, grad, dk_acc, scale, dk, nk, accumulate);
  attention_dq_finish(s, grad, dv_acc, 1.f, dv, nk, accumulate);
}

}  // namespace spindle::cuda
