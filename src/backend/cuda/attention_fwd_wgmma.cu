// Attention forward for Hopper (sm_90a), head dim 128, BF16 inputs: the FlashAttention-3
// structure, written for this engine's document/position mask.
//
// A block owns 128 query rows of one head and runs three warpgroups: a producer that streams the
// visible 128-key tiles of K and V into a three-stage shared-memory ring with the copy engine (TMA,
// 128-byte swizzle, completion on mbarriers), and two consumers of 64 query rows each. A consumer
// computes S = Q·Kᵀ with wgmma from shared memory, the online softmax in registers (exp2 domain,
// f32), and O += P·V with P taken from registers. Within a consumer the next tile's Q·Kᵀ is issued
// before this tile's P·V and its softmax runs while the tensor cores work on the other product
// (FA3's intra-warpgroup overlap); the two consumers also cover each other's softmax.
//
// A block walks only the span of key tiles its rows can see (tile_spans: on a packed row, its
// document's), never loads a tile the mask hides completely, skips the per-element test on tiles it
// shows completely and takes a mixed tile's mask from the tile's layout (attention_common.cuh).
// Rows with no visible key get out = 0, lse = −inf.
//
// Budget per 128×128 tile pair: 2·128·128·128·2 = 8.4 MFLOP on the tensor cores (≈ 2050 cycles of
// one SM at its dense bf16 rate) against 16384 exp2 (≈ 1024 cycles of the SFUs): the exp2 work
// must hide under the matrix work, which is what the overlap above is for.
#include <cmath>

#include "backend/cuda/attention_common.cuh"
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/hopper.cuh"
#include "backend/cuda/tensor_map.h"

namespace spindle::cuda {
namespace {

using namespace hopper;

constexpr int kD = 128;      // head dim
constexpr int kBM = 128;     // query rows per block
constexpr int kBN = 128;     // keys per tile
constexpr int kStages = 3;   // K/V tiles in flight
constexpr int kConsumers = 2;
constexpr int kThreads = 128 * (1 + kConsumers);
constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

constexpr int kTileElems = kBN * kD;         // one K or V tile: 2 column chunks of [128][64]
constexpr uint32_t kTileBytes = kTileElems * 2;  // 32 KB
constexpr uint32_t kChunkBytes = kBN * 128;      // 16 KB: one [128 rows][64 cols] chunk

struct alignas(1024) Smem {
  bf16 q[kBM * kD];            // 2 chunks [128][64]
  bf16 k[kStages][kTileElems];
  bf16 v[kStages][kTileElems];
  int step_tile[kStages];   // key tile of the step in this stage (-1: the walk is over)
  int step_class[kStages];  // its TileClass
  TileLayout step_layout[kStages];  // its keys' layout (mixed tiles only)
  uint64_t q_full;
  // K and V of a stage are released separately: K once Q·Kᵀ is done, V once P·V is.
  uint64_t k_full[kStages], v_full[kStages], k_empty[kStages], v_empty[kStages];
};
constexpr size_t kSmemBytes = sizeof(Smem) + 1024;  // + room to align the dynamic base

struct Params {
  AttentionShape sh;
  AttentionMaskPtrs mask;
  const TileRange *q_ranges, *k_ranges;
  const TileSpan* k_spans;      // per query tile: the key tiles to walk
  const TileLayout* k_layouts;  // per key tile
  float scale_log2;  // softmax scale · log2(e)
  void* out;
  float* lse;
};

// grid (hq, ceil(tq / 128)); blocks run the heaviest (last, for causal) query tiles of every head
// first. The two consumers take turns issuing their matrix products (named barriers), so that one's
// softmax runs while the other's products occupy the tensor cores (FA3). With three K/V stages
// the forward measured the same without the turns (636 against 635 TFLOP/s at 32k causal, commit
// 0d4eadd); the switch between the two is gone, the turns stay: every measured step ran with them.
template <typename TO>
__global__ void __launch_bounds__(kThreads, 1)
    forward_wgmma_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                         const __grid_constant__ CUtensorMap v_map, const Params p) {
  extern __shared__ unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t{1023});

  const AttentionShape& sh = p.sh;
  const int wg = threadIdx.x / 128;
  const int q_tile = gridDim.y - 1 - blockIdx.y;
  const int h = blockIdx.x, hk = h / (sh.hq / sh.hkv);
  const int64_t q0 = static_cast<int64_t>(q_tile) * kBM;
  const TileRange qr = load_range(p.q_ranges + q_tile);
  auto tile_class = [&](int j) {
    return classify_tile(qr, load_range(p.k_ranges + j), static_cast<int64_t>(j + 1) * kBN <= sh.tk, p.mask.window);
  };

  if (threadIdx.x == 0) {
    mbar_init(&sm.q_full, 1);
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&sm.k_full[s], 1);
      mbar_init(&sm.v_full[s], 1);
      mbar_init(&sm.k_empty[s], kConsumers * 4);  // one arrival per consumer warp
      mbar_init(&sm.v_empty[s], kConsumers * 4);
    }
    fence_barrier_init();
  }
  __syncthreads();

  if (wg == 0) {
    // Producer: one thread issues every copy.
    regs_release<24>();
    if (threadIdx.x == 0) {
      tma_prefetch_descriptor(&q_map);
      tma_prefetch_descriptor(&k_map);
      tma_prefetch_descriptor(&v_map);
      mbar_arrive_expect_tx(&sm.q_full, kBM * kD * 2);
      for (int c = 0; c < kD / 64; ++c)
        tma_load_2d(sm.q + c * kBM * 64, &q_map, h * kD + c * 64, static_cast<int>(q0), &sm.q_full);
      // Each step's key tile and class are posted next to its K (the consumers never read the
      // tile ranges from global memory), then an end marker.
      int it = 0;
      const TileSpan span = load_span(p.k_spans + q_tile);
      for (int j = span.first; j < span.end; ++j) {
        const int cls = tile_class(j);
        if (cls == kTileSkip) continue;
        const int stage = it % kStages;
        const int y = j * kBN;
        if (it >= kStages) mbar_wait(&sm.k_empty[stage], ((it / kStages) - 1) & 1);
        sm.step_tile[stage] = j;
        sm.step_class[stage] = cls;
        if (cls == kTileMixed) post_layout(&sm.step_layout[stage], p.k_layouts + j);
        mbar_arrive_expect_tx(&sm.k_full[stage], kTileBytes);
        for (int c = 0; c < kD / 64; ++c)
          tma_load_2d(sm.k[stage] + c * kBN * 64, &k_map, hk * kD + c * 64, y, &sm.k_full[stage]);
        if (it >= kStages) mbar_wait(&sm.v_empty[stage], ((it / kStages) - 1) & 1);
        mbar_arrive_expect_tx(&sm.v_full[stage], kTileBytes);
        for (int c = 0; c < kD / 64; ++c)
          tma_load_2d(sm.v[stage] + c * kBN * 64, &v_map, hk * kD + c * 64, y, &sm.v_full[stage]);
        ++it;
      }
      const int stage = it % kStages;
      if (it >= kStages) mbar_wait(&sm.k_empty[stage], ((it / kStages) - 1) & 1);
      sm.step_tile[stage] = -1;
      mbar_arrive(&sm.k_full[stage]);
    }
    return;
  }

  // Consumers.
  regs_claim<240>();
  const int cw = wg - 1;  // which 64 rows of the block
  const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
  // This thread's two rows: r = 0 -> row g of its warp's 16, r = 1 -> row g + 8.
  int64_t row[2];
  int qdoc[2], qpos[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    row[r] = q0 + cw * 64 + warp * 16 + g + 8 * r;
    qdoc[r] = row[r] < sh.tq ? p.mask.q_doc[row[r]] : 0;
    qpos[r] = row[r] < sh.tq ? p.mask.q_pos[row[r]] : 0;
  }
  const uint32_t q_base = smem_u32(sm.q) + cw * 64 * 128;  // this warpgroup's 64 rows of chunk 0

  float o[kD / 2];  // m64n128 accumulator: O rows of this warpgroup
  float s[kBN / 2];  // m64n128 accumulator: S for one key tile
  uint32_t pa[kBN / 4];  // P as bf16 A fragments (k = keys)
#pragma unroll
  for (int i = 0; i < kD / 2; ++i) o[i] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  auto issue_qk = [&](int stage) {
    const uint32_t k_base = smem_u32(sm.k[stage]);
#pragma unroll
    for (int ks = 0; ks < kD / 16; ++ks) {
      const uint32_t off = (ks % 4) * 32;  // k slice within the 64-column chunk
      const uint64_t a = smem_desc(q_base + (ks / 4) * (kBM * 128) + off, 16, 1024);
      const uint64_t b = smem_desc(k_base + (ks / 4) * kChunkBytes + off, 16, 1024);
      wgmma_ss_n128<0, 0>(s, a, b, ks > 0);
    }
  };
  auto issue_pv = [&](int stage) {
    const uint32_t v_base = smem_u32(sm.v[stage]);
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk)
      wgmma_rs_n128<1>(o, pa + 4 * kk, smem_desc(v_base + kk * 2048, kChunkBytes, 1024), 1);
  };
  // Masks S of key tile j in `stage` when the tile is mixed: from its keys' layout when regular,
  // else from each key's document and position in global memory. Reads the stage, so it runs
  // before K is released.
  auto apply_mask = [&](int j, int cls, int stage) {
    if (cls != kTileMixed) return;
    const int64_t j0 = static_cast<int64_t>(j) * kBN;
    const uint32_t lay_addr = smem_u32(&sm.step_layout[stage]);
    const int4 l0 = ld_shared_s32x4(lay_addr), l1 = ld_shared_s32x4(lay_addr + 16);
    const TileLayout lay{l0.x, l0.y, l0.z, l0.w, l1.x, l1.y, 0, 0};
#pragma unroll
    for (int i = 0; i < kBN / 8; ++i)
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const int e = i * 8 + 2 * t + c;
        const bool in = j0 + e < sh.tk;
        int kd, kp;
        if (lay.regular) {
          kd = layout_doc(lay, e);
          kp = layout_pos(lay, e);
        } else {
          kd = in ? p.mask.k_doc[j0 + e] : 0;
          kp = in ? p.mask.k_pos[j0 + e] : 0;
        }
#pragma unroll
        for (int r = 0; r < 2; ++r)
          if (!(in && key_visible(qdoc[r], qpos[r], kd, kp, p.mask.window))) s[4 * i + 2 * r + c] = -INFINITY;
      }
  };
  // Updates the running max from the masked S; returns the row maxima's rescale factors in alpha
  // and leaves exp2(S·scale − m) in s with its row sums in rowsum.
  float alpha[2], rowsum[2];
  auto softmax = [&]() {
    float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int i = 0; i < kBN / 8; ++i) {
      mx[0] = fmaxf(mx[0], fmaxf(s[4 * i], s[4 * i + 1]));
      mx[1] = fmaxf(mx[1], fmaxf(s[4 * i + 2], s[4 * i + 3]));
    }
    float m_use[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
      mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
      const float m_new = fmaxf(m[r], mx[r] * p.scale_log2);
      // A row that has seen no key keeps m = −inf; exponentiate against 0 so that
      // exp2(−inf − (−inf)) never makes a NaN.
      m_use[r] = m_new == -INFINITY ? 0.f : m_new;
      alpha[r] = exp2_approx(m[r] - m_use[r]);
      m[r] = m_new;
      rowsum[r] = 0.f;
    }
#pragma unroll
    for (int i = 0; i < kBN / 8; ++i)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        const float e = exp2_approx(fmaf(s[4 * i + c], p.scale_log2, -m_use[c >> 1]));
        s[4 * i + c] = e;
        rowsum[c >> 1] += e;
      }
  };
  // Rescales O and l by alpha, adds the tile's row sums, and packs P for the next P·V.
  auto rescale_and_pack = [&]() {
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) {
      o[4 * i] *= alpha[0];
      o[4 * i + 1] *= alpha[0];
      o[4 * i + 2] *= alpha[1];
      o[4 * i + 3] *= alpha[1];
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) l[r] = l[r] * alpha[r] + rowsum[r];
#pragma unroll
    for (int kk = 0; kk < kBN / 16; ++kk) {
      pa[4 * kk] = pack_bf16x2(s[8 * kk], s[8 * kk + 1]);
      pa[4 * kk + 1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
      pa[4 * kk + 2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
      pa[4 * kk + 3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
    }
  };

  // Turn-taking between the consumers: barrier 3 + c is consumer c's turn; consumer 1
  // hands the first turn to consumer 0 and skips its hand-over after its last turn, so every
  // bar.sync is matched by exactly one bar.arrive.
  auto my_turn = [&] { named_barrier(3 + cw, 256); };
  auto their_turn = [&](bool last) {
    if (!(last && cw == 1)) named_barrier_arrive(3 + (1 - cw), 256);
  };

  // Each consumer warp arrives once per use of a stage's K and of its V.
  auto release = [&](uint64_t* bar) {
    __syncwarp();
    if (lane == 0) mbar_arrive(bar);
  };

  auto step_tile = [&](int stage) { return ld_shared_s32(smem_u32(&sm.step_tile[stage])); };
  auto step_class = [&](int stage) { return ld_shared_s32(smem_u32(&sm.step_class[stage])); };
  mbar_wait(&sm.q_full, 0);
  mbar_wait(&sm.k_full[0], 0);
  int j = step_tile(0), it = 0;
  if (j >= 0) {
    if (cw == 1) named_barrier_arrive(3, 256);
    my_turn();
    wgmma_fence();
    issue_qk(0);
    wgmma_commit();
    their_turn(false);
    wgmma_wait<0>();
    fence_regs(s);
    apply_mask(j, step_class(0), 0);
    release(&sm.k_empty[0]);
    softmax();
    rescale_and_pack();
    // Steady state: Q·Kᵀ of the next tile and P·V of this one in flight together; the next
    // tile's softmax runs while P·V does. The loop has no conditional wgmma (ptxas serializes
    // wgmma whose accumulators it cannot prove idle on every path).
    while (true) {
      const int stage = it % kStages, sn = (it + 1) % kStages;
      mbar_wait(&sm.k_full[sn], ((it + 1) / kStages) & 1);
      const int jn = step_tile(sn);
      if (jn < 0) break;
      const int cn = step_class(sn);
      mbar_wait(&sm.v_full[stage], (it / kStages) & 1);
      my_turn();
      fence_regs(s);
      wgmma_fence();
      issue_qk(sn);
      wgmma_commit();
      fence_regs(o);
      fence_regs(pa);
      wgmma_fence();
      issue_pv(stage);
      wgmma_commit();
      their_turn(false);
      wgmma_wait<1>();  // S of the next tile is ready; P·V may still run
      fence_regs(s);
      apply_mask(jn, cn, sn);
      release(&sm.k_empty[sn]);
      softmax();
      wgmma_wait<0>();
      fence_regs(o);
      fence_regs(pa);
      release(&sm.v_empty[stage]);
      rescale_and_pack();
      j = jn;
      ++it;
    }
    const int stage = it % kStages;
    mbar_wait(&sm.v_full[stage], (it / kStages) & 1);
    my_turn();
    fence_regs(o);
    fence_regs(pa);
    wgmma_fence();
    issue_pv(stage);
    wgmma_commit();
    their_turn(true);
    wgmma_wait<0>();
    fence_regs(o);
    release(&sm.v_empty[stage]);
  }

  TO* out = static_cast<TO*>(p.out);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float lr = l[r];
    lr += __shfl_xor_sync(0xffffffffu, lr, 1);
    lr += __shfl_xor_sync(0xffffffffu, lr, 2);
    if (row[r] >= sh.tq) continue;
    const bool empty = m[r] == -INFINITY;
    const float inv = empty ? 0.f : 1.f / lr;
    TO* orow = out + (row[r] * sh.hq + h) * kD;
#pragma unroll
    for (int i = 0; i < kD / 8; ++i) store_pair<TO>(orow + i * 8 + 2 * t, o[4 * i + 2 * r] * inv, o[4 * i + 2 * r + 1] * inv);
    if (t == 0) p.lse[static_cast<int64_t>(h) * sh.tq + row[r]] = empty ? -INFINITY : m[r] * kLn2 + logf(lr);
  }
}

template <typename TO>
void launch(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
            const AttentionMaskPtrs& mask, float scale, void* out, float* lse) {
  const int64_t q_tiles = (sh.tq + kBM - 1) / kBM, k_tiles = (sh.tk + kBN - 1) / kBN;
  if (q_tiles > 65535 || sh.hq > 0x7fffffff || sh.tk > 0x7fffffff || sh.tq > 0x7fffffff)
    throw_message("attention_forward", "too many tokens or heads for the Hopper kernel");
  Scratch ranges(s, static_cast<size_t>(q_tiles + k_tiles) * sizeof(TileRange) + (q_tiles + 1) * sizeof(TileSpan) +
                        k_tiles * sizeof(TileLayout));
  TileRange* q_ranges = ranges.as<TileRange>();
  TileRange* k_ranges = q_ranges + q_tiles;
  auto* k_spans = reinterpret_cast<TileSpan*>(k_ranges + k_tiles);
  tile_ranges(s, mask.q_doc, mask.q_pos, sh.tq, kBM, q_ranges);
  tile_ranges(s, mask.k_doc, mask.k_pos, sh.tk, kBN, k_ranges);
  tile_spans(s, q_ranges, q_tiles, k_ranges, k_tiles, /*per_query=*/true, mask.window, k_spans);
  auto* k_layouts = reinterpret_cast<TileLayout*>(k_spans + q_tiles + (q_tiles & 1));  // 16-byte aligned
  tile_layouts(s, mask.k_doc, mask.k_pos, sh.tk, kBN, k_layouts);
  const CUtensorMap q_map = bf16_tile_map(q, sh.tq, int64_t{sh.hq} * kD, kBM);
  const CUtensorMap k_map = bf16_tile_map(k, sh.tk, int64_t{sh.hkv} * kD, kBN);
  const CUtensorMap v_map = bf16_tile_map(v, sh.tk, int64_t{sh.hkv} * kD, kBN);
  const Params p{sh, mask, q_ranges, k_ranges, k_spans, k_layouts, scale * kLog2e, out, lse};
  auto kernel = forward_wgmma_kernel<TO>;
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kSmemBytes)));
  kernel<<<dim3(static_cast<unsigned>(sh.hq), static_cast<unsigned>(q_tiles)), kThreads, kSmemBytes, s>>>(
      q_map, k_map, v_map, p);
  CUDA_CHECK_LAUNCH();
}

}  // namespace

bool attention_wgmma_supports(DType io, int d) { return io == DType::BF16 && d == kD; }

void attention_forward_wgmma(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                             const AttentionMaskPtrs& mask, float scale, void* out, DType out_dtype, float* lse) {
  if (sh.tq == 0) return;
  if (sh.d != kD) throw_message("attention_forward", "the Hopper kernel needs head dim 128");
  if (sh.tk == 0) {
    // No keys: every row is empty (the copy engine cannot describe a zero-row tensor).
    attention_forward_simple(s, sh, DType::BF16, q, k, v, mask, scale, out, out_dtype, lse);
    return;
  }
  if (out_dtype == DType::F32) {
    launch<float>(s, sh, q, k, v, mask, scale, out, lse);
  } else if (out_dtype == DType::BF16) {
    launch<bf16>(s, sh, q, k, v, mask, scale, out, lse);
  } else {
    throw_dtype("attention_forward out", out_dtype);
  }
}

}  // namespace spindle::cuda
