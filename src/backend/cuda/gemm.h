// GEMM through cuBLASLt in backend.h's row-major convention, with a cache of matmul descriptors,
// layouts and the algorithm per shape (the heuristic query costs tens of µs).
//
// Choosing the algorithm: cuBLASLt's heuristic ranks its algorithms without knowing beta, and where
// the GEMM adds onto C (beta ≠ 0) its first choice ran 6–18 % slower than its fifth or seventh on the
// H200 (tests/cuda/bench_gemm_algos, docs/perf.md). So for BF16 inputs the first use of a shape
// times the heuristic's first kCandidates algorithms once, on the real A and B with a scratch C of
// at most kTuneBytes (a prefix of C's rows), and keeps the fastest. Only algorithms without split-K
// take part (they were bit-identical to each other in the same survey), and when the heuristic's own
// first choice splits K it is kept: the choice by timing never changes a result. F32 keeps the
// heuristic's choice (it is the accuracy reference). There is no switch to skip the timing: it
// never changes a result, and the heuristic's first choice alone only ever measured slower.
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
    bool accumulate;  // beta ≠ 0: reading C changes which algorithm is fastest
    bool operator==(const Key&) const = default;
  };
  struct KeyHash {
    size_t operator()(const Key& k) const;
  };
  struct Plan;
  static constexpr int kCandidates = 8;
  static constexpr int64_t kTuneBytes = int64_t{256} << 20;
  static constexpr int kTuneRuns = 3;
  cublasLtMatmulAlgo_t fastest(cudaStream_t stream, const GemmArgs& g, const Plan& plan,
                               const cublasLtMatmulHeuristicResult_t* results, int count);
  Context& ctx_;
  std::unordered_map<Key, std::unique_ptr<Plan>, KeyHash> plans_;
};

}  // namespace spindle::cuda
