// Shared by the attention kernels: per-tile ranges of document ids and positions, and the test
// that says whether a (query tile, key tile) pair is fully masked, fully visible, or mixed.
//
// The mask rule (backend/attention_rule.h): key j is visible to query i iff k_doc[j] == q_doc[i],
// k_pos[j] <= q_pos[i] and, with a window W, k_pos[j] > q_pos[i] − W. Ranges per tile let a kernel skip whole tiles (causal: everything above
// the diagonal; packing: other documents; ring: blocks entirely in the future) and drop the
// per-element test on tiles that are visible everywhere.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "backend/attention_rule.h"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {

struct TileRange {
  int doc_min, doc_max, pos_min, pos_max;  // over the valid tokens of the tile
};

// For one tile of one side, the tiles of the other side a kernel has to walk: [first, end). Tiles
// outside it are all skipped (below); tiles inside may still be. On a packed row this is the
// document's own stretch, so a block's walk costs its visible tiles, not the whole row.
struct TileSpan {
  int first, end;
};

// How the tokens of a tile lie in their documents when that is simple: at most two runs, each of
// one document and consecutive positions (two documents of a packed row; a zigzag shard's two
// chunks). Token e of the tile (e < split: the first run) has document (e < split ? doc0 : doc1)
// and position (e < split ? base0 : base1) + e. A kernel tests a mixed tile from these values in
// registers instead of reading each token's document and position from global memory (on packed
// rows of short documents that read was a third of a block's time). Any other tile (three runs or
// more) has regular = 0. Tokens past the end are not described: kernels test the index against
// the length themselves.
struct alignas(16) TileLayout {
  int doc0, base0, doc1, base1;
  int split, regular, unused0, unused1;
};

// Document and position of token e (tile-local) of a regular layout.
__device__ __forceinline__ int layout_doc(const TileLayout& l, int e) { return e < l.split ? l.doc0 : l.doc1; }
__device__ __forceinline__ int layout_pos(const TileLayout& l, int e) { return (e < l.split ? l.base0 : l.base1) + e; }

enum TileClass : int { kTileSkip = 0, kTileFull = 1, kTileMixed = 2 };

// No query of tile q sees a key of tile k (backend/attention_rule.h, window 0: none).
__device__ __forceinline__ bool tiles_disjoint(const TileRange& q, const TileRange& k, int window) {
  return ranges_disjoint(q.doc_min, q.doc_max, q.pos_min, q.pos_max, k.doc_min, k.doc_max, k.pos_min, k.pos_max,
                         window);
}

// `k_complete`: the key tile has no slot past the end of the keys (those must be masked).
__device__ __forceinline__ int classify_tile(const TileRange& q, const TileRange& k, bool k_complete, int window) {
  if (tiles_disjoint(q, k, window)) return kTileSkip;
  if (k_complete && ranges_all_visible(q.doc_min, q.doc_max, q.pos_min, q.pos_max, k.doc_min, k.doc_max, k.pos_min,
                                       k.pos_max, window))
    return kTileFull;
  return kTileMixed;
}

// A gradient pair (a, b) into F32 or BF16 storage at element `index` of `base`, added to what is
// there when `accumulate`.
__device__ __forceinline__ void store_grad_pair(void* base, int64_t index, bool f32, float a, float b,
                                                bool accumulate) {
  if (f32) {
    float2* o = reinterpret_cast<float2*>(static_cast<float*>(base) + index);
    if (accumulate) {
      const float2 old = *o;
      a += old.x;
      b += old.y;
    }
    *o = make_float2(a, b);
  } else {
    __nv_bfloat162* o = reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(base) + index);
    if (accumulate) {
      const float2 old = __bfloat1622float2(*o);
      a += old.x;
      b += old.y;
    }
    *o = __floats2bfloat162_rn(a, b);
  }
}

// Two neighbouring output values of a row (an accumulator pair) to F32 or BF16 storage.
template <typename TO>
__device__ __forceinline__ void store_pair(TO* p, float a, float b);
template <>
__device__ __forceinline__ void store_pair<float>(float* p, float a, float b) {
  *reinterpret_cast<float2*>(p) = make_float2(a, b);
}
template <>
__device__ __forceinline__ void store_pair<__nv_bfloat16>(__nv_bfloat16* p, float a, float b) {
  *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(a, b);
}

__device__ __forceinline__ TileRange load_range(const TileRange* r) {
  const int4 v = *reinterpret_cast<const int4*>(r);
  return TileRange{v.x, v.y, v.z, v.w};
}

// A layout from global memory into a stage's shared memory, in two 16-byte halves (a producer
// thread runs with few registers).
__device__ __forceinline__ void post_layout(TileLayout* dst, const TileLayout* src) {
  int4* d = reinterpret_cast<int4*>(dst);
  const int4* s = reinterpret_cast<const int4*>(src);
  d[0] = s[0];
  d[1] = s[1];
}

__device__ __forceinline__ TileSpan load_span(const TileSpan* s) {
  const int2 v = *reinterpret_cast<const int2*>(s);
  return TileSpan{v.x, v.y};
}

// ranges [ceil(n / tile)] for doc/pos I32 [n] (attention.cu).
void tile_ranges(cudaStream_t s, const int32_t* doc, const int32_t* pos, int64_t n, int tile, TileRange* ranges);
// layouts [ceil(n / tile)] for doc/pos I32 [n] (attention.cu).
void tile_layouts(cudaStream_t s, const int32_t* doc, const int32_t* pos, int64_t n, int tile, TileLayout* layouts);
// spans [q_tiles] (of key tiles, per query tile) when `per_query`, else spans [k_tiles] (of query
// tiles, per key tile), from the tile ranges of both sides (attention.cu).
void tile_spans(cudaStream_t s, const TileRange* q_ranges, int64_t q_tiles, const TileRange* k_ranges,
                int64_t k_tiles, bool per_query, int window, TileSpan* spans);
// delta f32 [hq, tq] = Σ_d dout·out per row (the softmax-backward row term, from the final out).
void attention_delta(cudaStream_t s, DType t, const void* out, const void* dout, int64_t tq, int hq, int d,
                     float* delta);
// dq [tq, hq, d] (=, or += when accumulate) = scale · dq_acc (f32 [tq, hq, d]).
void attention_dq_finish(cudaStream_t s, DType t, const float* dq_acc, float scale, void* dq, int64_t n,
                         bool accumulate);

// Simple f32-FMA kernels: any head dim up to 256, F32 or BF16 (attention_simple.cu).
void attention_forward_simple(cudaStream_t s, const AttentionShape& sh, DType io, const void* q, const void* k,
                              const void* v, const AttentionMaskPtrs& mask, float scale, void* out, DType out_dtype,
                              float* lse);
void attention_backward_simple(cudaStream_t s, const AttentionShape& sh, DType io, const void* q, const void* k,
                               const void* v, const void* out, const void* dout, const float* lse,
                               const AttentionMaskPtrs& mask, float scale, DType grad, void* dq, void* dk, void* dv,
                               bool accumulate);
// Tensor-core kernels (mma.sync m16n8k16 bf16, f32 accumulators): BF16, head dim 64 or 128
// (attention_fwd_mma.cu, attention_bwd_mma.cu).
bool attention_mma_supports(DType io, int d);
void attention_forward_mma(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                           const AttentionMaskPtrs& mask, float scale, void* out, DType out_dtype, float* lse);
void attention_backward_mma(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                            const void* out, const void* dout, const float* lse, const AttentionMaskPtrs& mask,
                            float scale, DType grad, void* dq, void* dk, void* dv, bool accumulate);

// Hopper kernels (wgmma, TMA; sm_90a): BF16, head dim 128 (attention_fwd_wgmma.cu,
// attention_bwd_wgmma.cu).
bool attention_wgmma_supports(DType io, int d);
void attention_forward_wgmma(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                             const AttentionMaskPtrs& mask, float scale, void* out, DType out_dtype, float* lse);
void attention_backward_wgmma(cudaStream_t s, const AttentionShape& sh, const void* q, const void* k, const void* v,
                              const void* out, const void* dout, const float* lse, const AttentionMaskPtrs& mask,
                              float scale, DType grad, void* dq, void* dk, void* dv, bool accumulate);

}  // namespace spindle::cuda
