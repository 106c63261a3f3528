// Survey of cuBLASLt's algorithms for the GEMM shapes of a Qwen2.5-1.5B LoRA step at 32k tokens
// (the shapes `spindle bench --op-table` lists), for docs/perf.md: for each shape, with and without
// accumulating onto C (beta 1 / 0), the time of every algorithm the heuristic offers (up to 16), in
// the heuristic's order, so that we know whether the heuristic's first choice is the fastest and
// what accumulating onto C costs. Also the K-concatenated LoRA form ([x | s·x·Aᵀ]·[W | B]ᵀ, K + r)
// next to the plain one; and whether the algorithms without split-K give bit-identical results
// (src/backend/cuda/gemm.cpp picks among those by timing). Row-major convention as in the backend (src/backend/cuda/gemm.cpp).
// Random BF16 inputs, F32 accumulation, median of CUDA-event timings after warm-up.
// Usage: bench_gemm_algos [--all]   (--all: every algorithm's line, not only the first and best)
#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

namespace {

#define CHECK_CUDA(x)                                                                                   \
  do {                                                                                                  \
    cudaError_t e_ = (x);                                                                               \
    if (e_ != cudaSuccess) {                                                                            \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_));          \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)
#define CHECK_LT(x)                                                                                     \
  do {                                                                                                  \
    cublasStatus_t s_ = (x);                                                                            \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s: cuBLAS status %d\n", __FILE__, __LINE__, #x, static_cast<int>(s_)); \
      std::exit(1);                                                                                     \
    }                                                                                                   \
  } while (0)

struct Shape {
  int64_t m, n, k;
  bool ta, tb;
  const char* what;
};

void fill_random(__nv_bfloat16* d, size_t n, uint32_t seed) {
  std::vector<__nv_bfloat16> h(n);
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.f, 1.f);
  for (auto& x : h) x = __float2bfloat16(dist(rng));
  CHECK_CUDA(cudaMemcpy(d, h.data(), n * sizeof(__nv_bfloat16), cudaMemcpyHostToDevice));
}

template <typename T>
int attr(const cublasLtMatmulAlgo_t& algo, cublasLtMatmulAlgoConfigAttributes_t a) {
  T v{};
  size_t written = 0;
  if (cublasLtMatmulAlgoConfigGetAttribute(&algo, a, &v, sizeof(v), &written) != CUBLAS_STATUS_SUCCESS) return -1;
  return static_cast<int>(v);
}

}  // namespace

int main(int argc, char** argv) {
  const bool all = argc > 1 && std::strcmp(argv[1], "--all") == 0;
  const Shape shapes[] = {
      {32768, 8960, 1536, false, true, "gate/up forward x·Wᵀ"},
      {32768, 8960, 1552, false, true, "gate/up forward, K-concatenated LoRA (K + 16)"},
      {32768, 1536, 8960, false, true, "down forward h·Wᵀ"},
      {32768, 1536, 8960, false, false, "gate/up backward dx = dy·W"},
      {32768, 8960, 1536, false, false, "down backward dh = dy·W"},
      {32768, 1536, 1536, false, true, "q/o forward"},
      {32768, 256, 1536, false, true, "k/v forward"},
      {883, 151936, 1536, false, true, "LM head chunk forward"},
      {883, 1536, 151936, false, false, "LM head chunk backward dx"},
      {1766, 151936, 1536, false, true, "LM head chunk forward, 512 MiB"},
      {1766, 1536, 151936, false, false, "LM head chunk backward dx, 512 MiB"},
      {3532, 151936, 1536, false, true, "LM head chunk forward, 1 GiB"},
      {3532, 1536, 151936, false, false, "LM head chunk backward dx, 1 GiB"},
      {32768, 8960, 16, false, true, "LoRA B forward (rank 16)"},
      {32768, 16, 8960, false, true, "LoRA A forward of down (rank 16)"},
  };
  cublasLtHandle_t lt;
  CHECK_LT(cublasLtCreate(&lt));
  cudaStream_t stream;
  CHECK_CUDA(cudaStreamCreate(&stream));
  const size_t ws_bytes = 64u << 20;
  void* ws = nullptr;
  CHECK_CUDA(cudaMalloc(&ws, ws_bytes));
  cudaEvent_t e0, e1;
  CHECK_CUDA(cudaEventCreate(&e0));
  CHECK_CUDA(cudaEventCreate(&e1));

  std::printf("%-48s %6s %4s %5s %9s %8s  %s\n", "shape (row-major C[m,n] = op(A)·op(B))", "beta", "algo", "of",
              "ms", "TFLOP/s", "tile stages splitK reduction swizzle cluster");
  for (const Shape& s : shapes) {
    const size_t na = s.m * s.k, nb = s.k * s.n, nc = s.m * s.n;
    __nv_bfloat16 *a, *b, *c;
    CHECK_CUDA(cudaMalloc(&a, na * 2));
    CHECK_CUDA(cudaMalloc(&b, nb * 2));
    CHECK_CUDA(cudaMalloc(&c, nc * 2));
    fill_random(a, na, 1);
    fill_random(b, nb, 2);
    fill_random(c, nc, 3);
    // Column-major view: Cᵀ [n, m] = op(B)ᵀ·op(A)ᵀ.
    cublasLtMatmulDesc_t op;
    CHECK_LT(cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t tfirst = s.tb ? CUBLAS_OP_T : CUBLAS_OP_N, tsecond = s.ta ? CUBLAS_OP_T : CUBLAS_OP_N;
    CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &tfirst, sizeof(tfirst)));
    CHECK_LT(cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSB, &tsecond, sizeof(tsecond)));
    cublasLtMatrixLayout_t lb, la, lc;
    const uint64_t b_rows = s.tb ? s.k : s.n, b_cols = s.tb ? s.n : s.k, ldb = s.tb ? s.k : s.n;
    const uint64_t a_rows = s.ta ? s.m : s.k, a_cols = s.ta ? s.k : s.m, lda = s.ta ? s.m : s.k;
    CHECK_LT(cublasLtMatrixLayoutCreate(&lb, CUDA_R_16BF, b_rows, b_cols, ldb));
    CHECK_LT(cublasLtMatrixLayoutCreate(&la, CUDA_R_16BF, a_rows, a_cols, lda));
    CHECK_LT(cublasLtMatrixLayoutCreate(&lc, CUDA_R_16BF, s.n, s.m, s.n));
    cublasLtMatmulPreference_t pref;
    CHECK_LT(cublasLtMatmulPreferenceCreate(&pref));
    CHECK_LT(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws_bytes,
                                                  sizeof(ws_bytes)));
    cublasLtMatmulHeuristicResult_t results[16];
    int found = 0;
    CHECK_LT(cublasLtMatmulAlgoGetHeuristic(lt, op, lb, la, lc, lc, pref, 16, results, &found));
    const double flops = 2.0 * s.m * s.n * s.k;
    // Beta 1 adds a product per launch onto C (≈ 12·sqrt(K) at most here): no overflow in BF16.
  for (float beta : {0.f, 1.f}) {
      const float alpha = 1.f;
      double first_ms = 0, best_ms = 1e30;
      int best = -1;
      std::vector<double> times(found, -1);
      std::vector<uint16_t> reference, candidate;  // C of the first algorithm without split-K, and another's
      int same_bits = 0, different_bits = 0;
      for (int i = 0; i < found; ++i) {
        auto launch = [&] {
          return cublasLtMatmul(lt, op, &alpha, b, lb, a, la, &beta, c, lc, c, lc, &results[i].algo, ws, ws_bytes,
                                stream);
        };
        if (launch() != CUBLAS_STATUS_SUCCESS) continue;
        for (int w = 0; w < 2; ++w) launch();
        std::vector<double> t;
        for (int r = 0; r < 9; ++r) {
          CHECK_CUDA(cudaEventRecord(e0, stream));
          launch();
          CHECK_CUDA(cudaEventRecord(e1, stream));
          CHECK_CUDA(cudaEventSynchronize(e1));
          float ms = 0;
          CHECK_CUDA(cudaEventElapsedTime(&ms, e0, e1));
          t.push_back(ms);
        }
        std::sort(t.begin(), t.end());
        times[i] = t[t.size() / 2];
        if (i == 0) first_ms = times[i];
        if (times[i] < best_ms) best_ms = times[i], best = i;
        // Do the algorithms without split-K give the same bits? (C is overwritten with beta 0.)
        if (beta == 0.f && attr<uint32_t>(results[i].algo, CUBLASLT_ALGO_CONFIG_SPLITK_NUM) <= 1) {
          std::vector<uint16_t>& dst = reference.empty() ? reference : candidate;
          dst.resize(nc);
          CHECK_CUDA(cudaMemcpy(dst.data(), c, nc * 2, cudaMemcpyDeviceToHost));
          if (&dst == &candidate) {
            const bool same = std::memcmp(reference.data(), candidate.data(), nc * 2) == 0;
            same_bits += same, different_bits += !same;
          }
        }
      }
      for (int i = 0; i < found; ++i) {
        if (times[i] < 0 || !(all || i == 0 || i == best)) continue;
        const auto& al = results[i].algo;
        std::printf("%-48s %6.0f %4d %5d %9.4f %8.1f  %d %d %d %d %d %d%s\n", s.what, beta, i, found, times[i],
                    flops / times[i] / 1e9, attr<uint32_t>(al, CUBLASLT_ALGO_CONFIG_TILE_ID),
                    attr<uint32_t>(al, CUBLASLT_ALGO_CONFIG_STAGES_ID), attr<uint32_t>(al, CUBLASLT_ALGO_CONFIG_SPLITK_NUM),
                    attr<uint32_t>(al, CUBLASLT_ALGO_CONFIG_REDUCTION_SCHEME),
                    attr<uint32_t>(al, CUBLASLT_ALGO_CONFIG_CTA_SWIZZLING),
                    attr<uint16_t>(al, CUBLASLT_ALGO_CONFIG_CLUSTER_SHAPE_ID), i == best ? "  best" : "");
      }
      std::printf("%-48s %6.0f  first %.4f ms, best %.4f ms (%.1f %%)", s.what, beta, first_ms, best_ms,
                  100.0 * (first_ms - best_ms) / first_ms);
      if (beta == 0.f)
        std::printf("; algorithms without split-K vs the first of them: %d same bits, %d different", same_bits,
                    different_bits);
      std::printf("\n");
      std::fflush(stdout);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(op);
    CHECK_CUDA(cudaFree(a));
    CHECK_CUDA(cudaFree(b));
    CHECK_CUDA(cudaFree(c));
  }
  return 0;
}
