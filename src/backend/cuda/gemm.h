// GEMM through cuBLASLt in backend.h's row-major convention, with a cache of matmul descriptors,
// layouts and the heuristic's algorithm per shape (the heuristic query costs tens of µs).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "backend/cuda/context.h"
#include "core/dtype.h"

namespace spindle::cuda {

struct GemmArgs {
  int64_t m, n, k;      // C [m, n] = op(A) [m, k] · op(B) [k, n]
  bool trans_a, trans_b;
  DType ab, c;          // A/B dtype (F32 or BF16) and C dtype (F32, or BF16 with BF16 inputs)
  const void *a, *b;
  void* c_ptr;
  int64_t lda, ldb;     // row lengths of A and B as stored
  float alpha, beta;
  const void* bias = nullptr;  // [n] of C's dtype, added by the epilogue (16-byte aligned)
};

class GemmCache {
 public:
  explicit GemmCache(Context& ctx);
  ~GemmCache();
  void run(cudaStream_t stream, const GemmArgs& args);

 private:
  struct Key {
    int64_t m, n, k, lda, ldb;
    bool ta, tb;
    DType ab, c;
    int align_a, align_b, align_c;
    bool bias;
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  struct Plan;
  Context& ctx_;
  std::unordered_map<Key, std::unique_ptr<Plan>, KeyHash> plans_;
};

}  // namespace spindle::cuda
