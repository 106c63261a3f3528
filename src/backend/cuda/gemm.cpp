#include "backend/cuda/gemm.h"

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

namespace spindle::cuda {

// Descriptors for one shape, alive as long as the cache.
struct GemmCache::Plan {
  cublasLtMatmulDesc_t op = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (op) cublasLtMatmulDescDestroy(op);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (c) cublasLtMatrixLayoutDestroy(c);
  }
};

size_t GemmCache::KeyHash::operator()(const Key& k) const {
  size_t h = 1469598103934665603ull;
  auto mix = [&h](uint64_t v) { h = (h ^ v) * 1099511628211ull; };
  mix(k.m), mix(k.n), mix(k.k), mix(k.lda), mix(k.ldb), mix(k.ta), mix(k.tb);
  mix(static_cast<uint64_t>(k.ab)), mix(static_cast<uint64_t>(k.c));
  mix(k.align_a), mix(k.align_b), mix(k.align_c), mix(k.bias), mix(k.accumulate);
  return h;
}

GemmCache::GemmCache(Context& ctx) : ctx_(ctx) {}
GemmCache::~GemmCache() = default;

namespace {

cudaDataType_t cuda_type(DType t) {
  switch (t) {
    case DType::F32: return CUDA_R_32F;
    case DType::BF16: return CUDA_R_16BF;
    default: fail("gemm: unsupported dtype {}", dtype_name(t));
  }
}

// Largest power of two (≤ 256) dividing the address: cuBLASLt assumes 256-byte alignment unless told.
int alignment(const void* p) {
  const auto v = reinterpret_cast<uintptr_t>(p);
  int a = 256;
  while (a > 1 && v % a) a >>= 1;
  return a;
}

uint32_t algo_config(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t attribute) {
  uint32_t value = 0;
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, attribute, &value, sizeof(value), &written) != CUBLAS_STATUS_SUCCESS)
    return 0;
  return value;
}

// Split-K algorithms sum partial products in another order (and may depend on the workspace).
bool splits_k(const cublasLtMatmulAlgo_t& algo) {
  return algo_config(algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) > 1 ||
         algo_config(algo, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME) != CUBLASLT_REDUCTION_SCHEME_NONE;
}

}  // namespace

cublasLtMatmulAlgo_t GemmCache::fastest(cudaStream_t stream, const GemmArgs& g, const Plan& plan,
                                        const cublasLtMatmulHeuristicResult_t* results, int count) {
  const cublasLtMatmulAlgo_t first = results[0].algo;
  if (splits_k(first)) return first;
  // A prefix of C's rows (≤ kTuneBytes) in scratch memory: C itself is never written here, and a
  // step at the edge of device memory does not fail for want of a full-size copy. Rows of the
  // row-major C are columns of cuBLASLt's column-major Cᵀ; A's layout has them as its m.
  const int64_t row_bytes = g.n * static_cast<int64_t>(dtype_size(g.c));
  const int64_t rows = std::min<int64_t>(g.m, std::max<int64_t>(1, kTuneBytes / row_bytes));
  void* scratch = nullptr;
  if (cudaMallocAsync(&scratch, rows * row_bytes, stream) != cudaSuccess) {
    (void)cudaGetLastError();  // no room to tune: the heuristic's choice
    return first;
  }
  cublasLtMatrixLayout_t a = nullptr, c = nullptr;
  const cudaDataType_t ab = cuda_type(g.ab), ct = cuda_type(g.c);
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&a, ab, g.trans_a ? rows : g.k, g.trans_a ? g.k : rows, g.lda));
  CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&c, ct, g.n, rows, g.n));
  cudaEvent_t start = nullptr, stop = nullptr;
  CUDA_CHECK(cudaEventCreate(&start));
  CUDA_CHECK(cudaEventCreate(&stop));
  cublasLtMatmulAlgo_t best = first;
  float best_ms = 0;
  bool timed = false;
  for (int i = 0; i < count; ++i) {
    const cublasLtMatmulAlgo_t& algo = results[i].algo;
    if (i > 0 && splits_k(algo)) continue;
    cublasLtMatmulHeuristicResult_t check{};
    if (cublasLtMatmulAlgoCheck(ctx_.lt(), plan.op, plan.b, a, c, c, &algo, &check) != CUBLAS_STATUS_SUCCESS ||
        check.workspaceSize > ctx_.workspace_bytes())
      continue;
    auto launch = [&] {
      CUBLAS_CHECK(cublasLtMatmul(ctx_.lt(), plan.op, &g.alpha, g.b, plan.b, g.a, a, &g.beta, scratch, c, scratch, c,
                                  &algo, ctx_.workspace(), ctx_.workspace_bytes(), stream));
    };
    launch();  // warm-up
    CUDA_CHECK(cudaEventRecord(start, stream));
    for (int r = 0; r < kTuneRuns; ++r) launch();
    CUDA_CHECK(cudaEventRecord(stop, stream));
    CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    if (!timed || ms < best_ms) best_ms = ms, best = algo, timed = true;
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cublasLtMatrixLayoutDestroy(a);
  cublasLtMatrixLayoutDestroy(c);
  CUDA_CHECK(cudaFreeAsync(scratch, stream));
  return best;
}

void GemmCache::run(cudaStream_t stream, const GemmArgs& g) {
  // Row-major C [m, n] = op(A)·op(B) is column-major Cᵀ [n, m] = op(B)ᵀ·op(A)ᵀ: hand cuBLASLt B as
  // its "A" and A as its "B"; a row-major [r, c] matrix is a column-major [c, r] one with ld = c.
  Key key{g.m,          g.n,          g.k,          g.lda, g.ldb, g.trans_a, g.trans_b, g.ab, g.c,
          alignment(g.a), alignment(g.b), alignment(g.c_ptr), g.bias != nullptr, g.beta != 0.f};
  auto found = plans_.find(key);
  if (found == plans_.end()) {
    auto plan = std::make_unique<Plan>();
    const cudaDataType_t ab = cuda_type(g.ab), ct = cuda_type(g.c);
    // F32 stays true F32 (no TF32) so the F32 path matches the CPU reference to ~1e-6.
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&plan->op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_first = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;   // applies to B
    const cublasOperation_t op_second = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;  // applies to A
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSA, &op_first, sizeof(op_first)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_TRANSB, &op_second, sizeof(op_second)));
    if (g.bias) {
      // Column-major Cᵀ [n, m]: the epilogue's per-row bias is our per-column one. Its dtype is C's
      // (cuBLASLt's default for BF16 and F32 outputs).
      const cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    }
    // B as stored: row-major [k, n] (or [n, k] when transposed) = column-major [n, k] (or [k, n]).
    const uint64_t b_rows = g.trans_b ? g.k : g.n, b_cols = g.trans_b ? g.n : g.k;
    const uint64_t a_rows = g.trans_a ? g.m : g.k, a_cols = g.trans_a ? g.k : g.m;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->b, ab, b_rows, b_cols, g.ldb));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->a, ab, a_rows, a_cols, g.lda));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&plan->c, ct, g.n, g.m, g.n));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    const size_t ws = ctx_.workspace_bytes();
    const uint32_t al_first = key.align_b, al_second = key.align_a, al_c = key.align_c;
    cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                             sizeof(ws));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_first,
                                                sizeof(al_first));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_second,
                                                sizeof(al_second));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_c, sizeof(al_c));
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_c, sizeof(al_c));
    cublasLtMatmulHeuristicResult_t results[kCandidates]{};
    int found_count = 0;
    if (st == CUBLAS_STATUS_SUCCESS)
      st = cublasLtMatmulAlgoGetHeuristic(ctx_.lt(), plan->op, plan->b, plan->a, plan->c, plan->c, pref,
                                          kCandidates, results, &found_count);
    cublasLtMatmulPreferenceDestroy(pref);
    CUBLAS_CHECK(st);
    if (found_count == 0)
      fail("gemm: cuBLASLt has no algorithm for {}x{}x{} ({} inputs, {} output)", g.m, g.n, g.k, dtype_name(g.ab),
           dtype_name(g.c));
    plan->algo = results[0].algo;
    if (g.bias)
      CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan->op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
    if (g.ab == DType::BF16 && found_count > 1) plan->algo = fastest(stream, g, *plan, results, found_count);
    found = plans_.emplace(key, std::move(plan)).first;
  }
  const Plan& plan = *found->second;
  if (g.bias)  // the pointer changes from call to call; the host enqueues one matmul at a time
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(plan.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &g.bias, sizeof(g.bias)));
  CUBLAS_CHECK(cublasLtMatmul(ctx_.lt(), plan.op, &g.alpha, g.b, plan.b, g.a, plan.a, &g.beta, g.c_ptr, plan.c,
                              g.c_ptr, plan.c, &plan.algo, ctx_.workspace(), ctx_.workspace_bytes(), stream));
}

}  // namespace spindle::cuda
