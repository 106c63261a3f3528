// Which keys a query of softmax attention sees: the one rule the CPU backend, every CUDA kernel and
// the sequence-parallel strategies share (compiled as host code and, in the CUDA kernels, as device
// code). Tokens carry a document id and a position inside their document; a layer may add a
// sliding window.
//
// Key (k_doc, k_pos) is visible to query (q_doc, q_pos) iff
//   k_doc == q_doc                       the same document (packing, padding, ring blocks)
//   k_pos <= q_pos                       causal
//   window == 0 || k_pos > q_pos − window  a window of W keys, the query's own included
// (transformers' sliding_window: query q sees keys q − W + 1 … q).
#pragma once

#if defined(__CUDACC__)
#define SPINDLE_RULE_FN __host__ __device__ __forceinline__
#else
#define SPINDLE_RULE_FN inline
#endif

namespace spindle {

SPINDLE_RULE_FN bool key_visible(int q_doc, int q_pos, int k_doc, int k_pos, int window) {
  return k_doc == q_doc && k_pos <= q_pos && (window <= 0 || k_pos > q_pos - window);
}

// The same rule over ranges of tokens (a tile of queries against a tile of keys), from each side's
// smallest and largest document id and position: whether no pair can be visible, and whether every
// pair is (both sides one document). Kernels skip the first kind of tile and drop the per-element
// test on the second.
SPINDLE_RULE_FN bool ranges_disjoint(int q_doc_min, int q_doc_max, int q_pos_min, int q_pos_max, int k_doc_min,
                                     int k_doc_max, int k_pos_min, int k_pos_max, int window) {
  return k_doc_max < q_doc_min || k_doc_min > q_doc_max  // no shared document
         || k_pos_min > q_pos_max                        // every key after every query
         || (window > 0 && k_pos_max <= q_pos_min - window);  // every key before every query's window
}

SPINDLE_RULE_FN bool ranges_all_visible(int q_doc_min, int q_doc_max, int q_pos_min, int q_pos_max, int k_doc_min,
                                        int k_doc_max, int k_pos_min, int k_pos_max, int window) {
  return q_doc_min == q_doc_max && k_doc_min == k_doc_max && q_doc_min == k_doc_min && k_pos_max <= q_pos_min &&
         (window <= 0 || k_pos_min > q_pos_max - window);
}

}  // namespace spindle
