// Every op of the CUDA backend against the CPU reference (F64) on random inputs. Inputs are
// rounded to the GPU dtype first, so the reference sees exactly what the GPU sees; outputs that an
// op overwrites are poisoned with NaN first, so an unwritten element fails the comparison.
// Tolerance: relative norm error 1e-5 for F32, 1e-2 for BF16 (its storage rounding is 2^-9).
// With no CUDA device every test is skipped (CI compiles this binary but has no GPU).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quant4_ops.h"
#include "backend/cuda/attention_cudnn.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/op_test_util.h"
#include "core/error.h"

using namespace spindle;
using namespace spindle::test;

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

double tol_for(DType t) { return t == DType::F32 ? 1e-5 : 1e-2; }

double round_to(DType t, double v) {
  switch (t) {
    case DType::BF16: return bf16_to_f32(f32_to_bf16(static_cast<float>(v)));
    case DType::F32: return static_cast<float>(v);
    default: return v;
  }
}

class CudaOps : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
    gpu = make_cuda_backend(0);
    gs = gpu->default_stream();
  }

  // Random values already rounded to `t`.
  std::vector<double> rand_values(int64_t n, DType t, double scale = 1.0) {
    std::uniform_real_distribution<double> dist(-scale, scale);
    std::vector<double> v(n);
    for (double& x : v) {
      do x = round_to(t, dist(rng));
      while (x == 0.0);
    }
    return v;
  }
  Tensor on_gpu(const std::vector<double>& v, Shape shape, DType t) {
    Tensor x = gpu->empty(shape, t);
    from_host(*gpu, v, x);
    return x;
  }
  Tensor on_cpu(const std::vector<double>& v, Shape shape, DType t = DType::F64) {
    Tensor x = cpu->empty(shape, t);
    from_host(*cpu, v, x);
    return x;
  }
  Tensor gpu_ints(const std::vector<int>& v) { return int_tensor(*gpu, v); }
  Tensor cpu_ints(const std::vector<int>& v) { return int_tensor(*cpu, v); }
  Tensor poisoned(Shape shape, DType t) {
    Tensor x = gpu->empty(shape, t);
    gpu->fill(gs, x, std::nan(""));
    return x;
  }

  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> gpu;
  Stream gs, cs{};
  std::mt19937_64 rng{20261129};
};

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaOps, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST_P(CudaOps, CopyConvertsAndFillWritesEveryElement) {
  const DType t = GetParam();
  const int64_t n = 1001;  // odd: exercises the scalar tail of the vector loops
  std::vector<double> src(n);
  std::uniform_real_distribution<double> dist(-3, 3);
  for (double& x : src) x = static_cast<float>(dist(rng));
  Tensor a = on_gpu(src, Shape{n}, DType::F32);
  Tensor b = poisoned(Shape{n}, t);
  gpu->copy(gs, a, b);
  auto got = to_host(*gpu, b);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(got[i], round_to(t, src[i])) << i;
  Tensor c = poisoned(Shape{n}, DType::F32);
  gpu->copy(gs, b, c);
  EXPECT_EQ(to_host(*gpu, c), got);
  Tensor ints = gpu->empty(Shape{n}, DType::I32);
  gpu->copy(gs, a, ints);  // truncation toward zero, as the CPU backend
  auto gi = to_host(*gpu, ints);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(gi[i], static_cast<double>(static_cast<int32_t>(static_cast<float>(src[i]))));
  for (double value : {1.5, -2.25, 0.0}) {
    Tensor f = poisoned(Shape{n}, t);
    gpu->fill(gs, f, value);
    for (double x : to_host(*gpu, f)) ASSERT_EQ(x, value);
  }
  Tensor z = gpu->zeros(Shape{7, 3}, t);
  for (double x : to_host(*gpu, z)) ASSERT_EQ(x, 0.0);
}

TEST_P(CudaOps, ScaleAxpySumSquares) {
  const DType t = GetParam();
  const int64_t n = 100003;
  auto xv = rand_values(n, t), yv = rand_values(n, t);
  Tensor x = on_gpu(xv, Shape{n}, t), y = on_gpu(yv, Shape{n}, t);
  Tensor cx = on_cpu(xv, Shape{n}), cy = on_cpu(yv, Shape{n});
  gpu->scale(gs, x, -0.75);
  cpu->scale(cs, cx, -0.75);
  expect_close(to_host(*gpu, x), to_host(*cpu, cx), tol_for(t), "scale");
  gpu->axpy(gs, 1.25, x, y);
  cpu->axpy(cs, 1.25, cx, cy);
  expect_close(to_host(*gpu, y), to_host(*cpu, cy), tol_for(t), "axpy");
  // Unaligned views take the scalar path.
  Tensor xs = x.flat(1, n - 2), ys = y.flat(1, n - 2);
  Tensor cxs = cx.flat(1, n - 2), cys = cy.flat(1, n - 2);
  gpu->axpy(gs, 0.5, xs, ys);
  cpu->axpy(cs, 0.5, cxs, cys);
  expect_close(to_host(*gpu, y), to_host(*cpu, cy), tol_for(t), "axpy unaligned");
  // The reference sums the GPU's own y (its BF16 rounding differs from the F64 reference's y).
  Tensor acc = on_gpu({0.75}, Shape{1}, DType::F32);
  Tensor cacc = on_cpu({0.75}, Shape{1});
  gpu->sum_squares(gs, y, acc);
  cpu->sum_squares(cs, on_cpu(to_host(*gpu, y), Shape{n}), cacc);
  EXPECT_NEAR(to_host(*gpu, acc)[0], to_host(*cpu, cacc)[0], 1e-5 * to_host(*cpu, cacc)[0]);
}

TEST_P(CudaOps, GemmAllTransposesMatchesCpu) {
  const DType t = GetParam();
  const int64_t m = 67, n = 45, k = 130;
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb)
      for (DType ct : {t, DType::F32}) {
        Shape sa = ta ? Shape{k, m} : Shape{m, k}, sb = tb ? Shape{n, k} : Shape{k, n};
        auto av = rand_values(sa.numel(), t), bv = rand_values(sb.numel(), t), cv = rand_values(m * n, ct);
        Tensor a = on_gpu(av, sa, t), b = on_gpu(bv, sb, t), c = on_gpu(cv, Shape{m, n}, ct);
        Tensor ca = on_cpu(av, sa), cb = on_cpu(bv, sb), cc = on_cpu(cv, Shape{m, n});
        gpu->gemm(gs, a, ta, b, tb, c, 0.5, 0.75);
        cpu->gemm(cs, ca, ta, cb, tb, cc, 0.5, 0.75);
        const std::string what = "gemm ta=" + std::to_string(ta) + " tb=" + std::to_string(tb) + " C " +
                                 std::string(dtype_name(ct));
        expect_close(to_host(*gpu, c), to_host(*cpu, cc), tol_for(ct == DType::F32 && t == DType::F32 ? DType::F32 : DType::BF16) / (ct == DType::F32 ? 10 : 1), what.c_str());
        // beta = 0 must ignore whatever C held, NaN included.
        Tensor c0 = poisoned(Shape{m, n}, ct);
        gpu->gemm(gs, a, ta, b, tb, c0, 1.0, 0.0);
        cpu->gemm(cs, ca, ta, cb, tb, cc, 1.0, 0.0);
        expect_close(to_host(*gpu, c0), to_host(*cpu, cc), t == DType::F32 ? 1e-5 : 1e-2, (what + " beta=0").c_str());
      }
}

// gemm_bias: cuBLASLt's bias epilogue (a 16-byte aligned bias) and the GEMM-then-add fallback (a
// bias starting one element into its buffer) against the CPU's GEMM + add_bias, with beta 0 and not.
TEST_P(CudaOps, GemmBiasEpilogueMatchesCpu) {
  const DType t = GetParam();
  const int64_t m = 67, n = 48, k = 130;
  for (int tb = 0; tb < 2; ++tb)
    for (double beta : {0.0, 0.75})
      for (bool aligned : {true, false}) {
        Shape sb = tb ? Shape{n, k} : Shape{k, n};
        auto av = rand_values(m * k, t), bv = rand_values(sb.numel(), t), cv = rand_values(m * n, t);
        auto biasv = rand_values(n + 1, t);
        Tensor a = on_gpu(av, Shape{m, k}, t), b = on_gpu(bv, sb, t);
        Tensor c = beta != 0 ? on_gpu(cv, Shape{m, n}, t) : poisoned(Shape{m, n}, t);
        Tensor bias_buffer = on_gpu(biasv, Shape{n + 1}, t);
        Tensor bias = aligned ? bias_buffer.rows(0, n) : bias_buffer.rows(1, n + 1);
        Tensor ca = on_cpu(av, Shape{m, k}), cb = on_cpu(bv, sb), cc = on_cpu(cv, Shape{m, n});
        Tensor cbias = on_cpu(std::vector<double>(biasv.begin() + (aligned ? 0 : 1), biasv.begin() + (aligned ? n : n + 1)),
                              Shape{n});
        gpu->gemm_bias(gs, a, false, b, tb, c, 0.5, beta, bias);
        cpu->gemm_bias(cs, ca, false, cb, tb, cc, 0.5, beta, cbias);
        const std::string what = "gemm_bias tb=" + std::to_string(tb) + " beta=" + std::to_string(beta) +
                                 (aligned ? " epilogue" : " fallback");
        expect_close(to_host(*gpu, c), to_host(*cpu, cc), tol_for(t), what.c_str());
      }
}

// lora_b_backward: dxa = s·dy·B and dB += s·dyᵀ·xa. BF16 with out a multiple of 128 and rank 16/32/64
// runs the fused kernel (strips of 128, 256 and 512 rows, the last strip partial); other shapes and
// F32 run the two GEMMs. dB starts from random values (it accumulates) or is absent (frozen B).
TEST_P(CudaOps, LoraBBackwardMatchesCpu) {
  const DType t = GetParam();
  struct Case {
    int64_t rows, out, rank;
  };
  for (const Case c : {Case{1000, 128, 16}, Case{300, 256, 32}, Case{2500, 384, 64}, Case{61440, 128, 16},
                       Case{31000, 256, 16}, Case{61440, 128, 32}, Case{31000, 256, 64}, Case{70, 192, 16},
                       Case{50, 128, 8}})
    for (bool with_db : {true, false}) {
      auto dyv = rand_values(c.rows * c.out, t), bv = rand_values(c.out * c.rank, t);
      auto xav = rand_values(c.rows * c.rank, t), dbv = rand_values(c.out * c.rank, t, 50.0);
      const Shape sdy{c.rows, c.out}, sb{c.out, c.rank}, sxa{c.rows, c.rank};
      Tensor dy = on_gpu(dyv, sdy, t), b = on_gpu(bv, sb, t), xa = on_gpu(xav, sxa, t), db = on_gpu(dbv, sb, t);
      Tensor dxa = poisoned(sxa, t);
      Tensor cdy = on_cpu(dyv, sdy), cb = on_cpu(bv, sb), cxa = on_cpu(xav, sxa), cdb = on_cpu(dbv, sb);
      Tensor cdxa = cpu->empty(sxa, DType::F64);
      gpu->lora_b_backward(gs, dy, b, xa, 0.5, dxa, with_db ? &db : nullptr);
      cpu->lora_b_backward(cs, cdy, cb, cxa, 0.5, cdxa, with_db ? &cdb : nullptr);
      const std::string what = "lora_b_backward rows " + std::to_string(c.rows) + " out " + std::to_string(c.out) +
                               " rank " + std::to_string(c.rank) + (with_db ? "" : " frozen B");
      expect_close(to_host(*gpu, dxa), to_host(*cpu, cdxa), tol_for(t), (what + " dxa").c_str());
      expect_close(to_host(*gpu, db), to_host(*cpu, cdb), tol_for(t), (what + " dB").c_str());
    }
}

// The first use of a BF16 GEMM shape times several cuBLASLt algorithms (src/backend/cuda/gemm.h).
// With C larger than the timing's scratch (a prefix of C's rows, 256 MiB) and beta 1, the timing
// runs must leave C alone: the result equals the same product in F32 (which is not timed), to BF16
// accuracy. Compared on the GPU as a relative norm (C has 150M elements).
TEST(CudaGemmTuning, AccumulatingGemmLargerThanTheScratchIsUnchangedByTheTimingRuns) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
  auto gpu = make_cuda_backend(0);
  Stream st = gpu->default_stream();
  const int64_t m = 33000, n = 4480, k = 64;  // C BF16: 296 MB
  for (int ta = 0; ta < 2; ++ta) {
    const Shape sa = ta ? Shape{k, m} : Shape{m, k}, sb{n, k};
    Tensor a32 = gpu->empty(sa, DType::F32), b32 = gpu->empty(sb, DType::F32), c32 = gpu->empty(Shape{m, n}, DType::F32);
    Tensor a = gpu->empty(sa, DType::BF16), b = gpu->empty(sb, DType::BF16), c = gpu->empty(Shape{m, n}, DType::BF16);
    // Values on a coarse grid (exact in BF16) from a few host patterns, so both paths see the same inputs.
    auto pattern = [&](Tensor& dst, int64_t numel, int seed) {
      std::vector<float> v(numel);
      for (int64_t i = 0; i < numel; ++i) v[i] = static_cast<float>(((i * 2654435761u + seed * 97) % 17) - 8) / 8.f;
      gpu->copy_from_host(st, v.data(), dst);
    };
    pattern(a32, sa.numel(), 1);
    pattern(b32, sb.numel(), 2);
    pattern(c32, m * n, 3);
    gpu->copy(st, a32, a);
    gpu->copy(st, b32, b);
    gpu->copy(st, c32, c);
    gpu->gemm(st, a, ta, b, true, c, 0.5, 1.0);
    gpu->gemm(st, a32, ta, b32, true, c32, 0.5, 1.0);
    Tensor diff = gpu->empty(Shape{m, n}, DType::F32), norm2 = gpu->empty(Shape{1}, DType::F32),
           err2 = gpu->empty(Shape{1}, DType::F32);
    gpu->fill(st, norm2, 0.0);
    gpu->fill(st, err2, 0.0);
    gpu->copy(st, c, diff);
    gpu->axpy(st, -1.0, c32, diff);
    gpu->sum_squares(st, diff, err2);
    gpu->sum_squares(st, c32, norm2);
    float e = 0, r = 0;
    gpu->copy_to_host(st, err2, &e);
    gpu->copy_to_host(st, norm2, &r);
    ASSERT_GT(r, 0.f);
    // BF16 output rounding alone is ≤ 2^-9 relative; an extra product added by a timing run is ~1.
    EXPECT_LT(std::sqrt(e / r), 4e-3) << "ta=" << ta;
  }
}

TEST_P(CudaOps, BiasAddAndBackward) {
  const DType t = GetParam();
  const int64_t rows = 600, n = 70;
  auto yv = rand_values(rows * n, t), bv = rand_values(n, t), dbv = rand_values(n, t);
  Tensor y = on_gpu(yv, Shape{rows, n}, t), b = on_gpu(bv, Shape{n}, t), db = on_gpu(dbv, Shape{n}, t);
  Tensor cy = on_cpu(yv, Shape{rows, n}), cb = on_cpu(bv, Shape{n}), cdb = on_cpu(dbv, Shape{n});
  gpu->add_bias(gs, y, b);
  cpu->add_bias(cs, cy, cb);
  expect_close(to_host(*gpu, y), to_host(*cpu, cy), tol_for(t), "add_bias");
  gpu->bias_backward(gs, y, db);
  cpu->bias_backward(cs, cy, cdb);
  expect_close(to_host(*gpu, db), to_host(*cpu, cdb), tol_for(t), "bias_backward");
}

TEST_P(CudaOps, EmbeddingForwardBackwardWithRepeatedIds) {
  const DType t = GetParam();
  const int64_t vocab = 50, hidden = 72, tokens = 300;
  std::vector<int> ids(tokens);
  std::uniform_int_distribution<int> pick(0, 9);  // few distinct ids: many repeats
  for (int& i : ids) i = pick(rng) * 5;
  auto tv = rand_values(vocab * hidden, t), dv = rand_values(tokens * hidden, t), gv = rand_values(vocab * hidden, t);
  Tensor table = on_gpu(tv, Shape{vocab, hidden}, t), out = poisoned(Shape{tokens, hidden}, t);
  Tensor ctable = on_cpu(tv, Shape{vocab, hidden}), cout_ = cpu->empty(Shape{tokens, hidden}, DType::F64);
  gpu->embedding_forward(gs, gpu_ints(ids), table, out);
  cpu->embedding_forward(cs, cpu_ints(ids), ctable, cout_);
  EXPECT_EQ(to_host(*gpu, out), to_host(*cpu, cout_));
  Tensor dout = on_gpu(dv, Shape{tokens, hidden}, t), dtable = on_gpu(gv, Shape{vocab, hidden}, t);
  Tensor cdout = on_cpu(dv, Shape{tokens, hidden}), cdtable = on_cpu(gv, Shape{vocab, hidden});
  // ids are multiples of 5: the padding row 10 is among them.
  gpu->embedding_backward(gs, gpu_ints(ids), dout, dtable, 10);
  cpu->embedding_backward(cs, cpu_ints(ids), cdout, cdtable, 10);
  expect_close(to_host(*gpu, dtable), to_host(*cpu, cdtable), tol_for(t), "embedding_backward");
  // A bad id is reported at the next synchronization with the CPU backend's message.
  Tensor one = poisoned(Shape{1, hidden}, t);
  gpu->embedding_forward(gs, gpu_ints({int(vocab)}), table, one);
  try {
    gpu->synchronize(gs);
    FAIL() << "expected an error for a token id outside the vocabulary";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("outside the vocabulary"), std::string::npos) << e.what();
  }
  gpu->synchronize(gs);  // reported once, then cleared
}

TEST_P(CudaOps, GatherAndScatterRows) {
  const DType t = GetParam();
  for (int64_t width : {3, 64}) {  // 3: rows not a multiple of 16 bytes
    const int64_t rows = 40, n = 90;
    std::vector<int> idx(n);
    std::uniform_int_distribution<int> pick(0, rows - 1);
    for (int& i : idx) i = pick(rng);
    auto sv = rand_values(rows * width, t);
    Tensor src = on_gpu(sv, Shape{rows, width}, t), dst = poisoned(Shape{n, width}, t);
    Tensor csrc = on_cpu(sv, Shape{rows, width}), cdst = cpu->empty(Shape{n, width}, DType::F64);
    gpu->gather_rows(gs, src, gpu_ints(idx), dst);
    cpu->gather_rows(cs, csrc, cpu_ints(idx), cdst);
    EXPECT_EQ(to_host(*gpu, dst), to_host(*cpu, cdst));
    auto av = rand_values(rows * width, t);
    Tensor acc = on_gpu(av, Shape{rows, width}, t), cacc = on_cpu(av, Shape{rows, width});
    gpu->scatter_add_rows(gs, dst, gpu_ints(idx), acc);
    cpu->scatter_add_rows(cs, cdst, cpu_ints(idx), cacc);
    expect_close(to_host(*gpu, acc), to_host(*cpu, cacc), tol_for(t), "scatter_add_rows");
  }
  // Integer rows gather too (any dtype moves as bytes).
  Tensor ints = gpu_ints({10, 11, 12, 13, 14, 15});
  Tensor picked = gpu->empty(Shape{2, 2}, DType::I32);
  gpu->gather_rows(gs, ints.reshape(Shape{3, 2}), gpu_ints({2, 0}), picked);
  EXPECT_EQ(to_host(*gpu, picked), (std::vector<double>{14, 15, 10, 11}));
}

TEST_P(CudaOps, RmsNormForwardBackward) {
  const DType t = GetParam();
  // c = 1000: the vector kernels (a multiple of 8 and 4 elements), 1001: the scalar ones; 2500 rows
  // give every backward block several rows (its warps take turns and add up their dw).
  for (auto [rows, c] : {std::pair<int64_t, int64_t>{37, 1000}, {2500, 1000}, {37, 1001}}) {
    SCOPED_TRACE(testing::Message() << rows << " rows of " << c);
    auto xv = rand_values(rows * c, t, 2.0), wv = rand_values(c, t), gv = rand_values(rows * c, t);
    auto dxv = rand_values(rows * c, t), dwv = rand_values(c, t);
    Tensor x = on_gpu(xv, Shape{rows, c}, t), w = on_gpu(wv, Shape{c}, t), y = poisoned(Shape{rows, c}, t);
    Tensor rstd = poisoned(Shape{rows}, DType::F32);
    Tensor cx = on_cpu(xv, Shape{rows, c}), cw = on_cpu(wv, Shape{c}), cy = cpu->empty(Shape{rows, c}, DType::F64);
    Tensor crstd = cpu->empty(Shape{rows}, DType::F64);
    gpu->rmsnorm_forward(gs, x, w, 1e-6, y, rstd);
    cpu->rmsnorm_forward(cs, cx, cw, 1e-6, cy, crstd);
    expect_close(to_host(*gpu, y), to_host(*cpu, cy), tol_for(t), "rmsnorm y");
    expect_close(to_host(*gpu, rstd), to_host(*cpu, crstd), 1e-5, "rmsnorm rstd");
    for (bool acc : {false, true}) {
      Tensor dy = on_gpu(gv, Shape{rows, c}, t), cdy = on_cpu(gv, Shape{rows, c});
      Tensor dx = acc ? on_gpu(dxv, Shape{rows, c}, t) : poisoned(Shape{rows, c}, t);
      Tensor cdx = on_cpu(dxv, Shape{rows, c});
      Tensor dw = on_gpu(dwv, Shape{c}, t), cdw = on_cpu(dwv, Shape{c});
      gpu->rmsnorm_backward(gs, x, w, rstd, dy, dx, &dw, acc);
      cpu->rmsnorm_backward(cs, cx, cw, crstd, cdy, cdx, &cdw, acc);
      expect_close(to_host(*gpu, dx), to_host(*cpu, cdx), tol_for(t), acc ? "rmsnorm dx +=" : "rmsnorm dx");
      expect_close(to_host(*gpu, dw), to_host(*cpu, cdw), tol_for(t), "rmsnorm dw");
      // A frozen weight (no dw): the kernels without the column sums give the same dx.
      Tensor dx_frozen = acc ? on_gpu(dxv, Shape{rows, c}, t) : poisoned(Shape{rows, c}, t);
      gpu->rmsnorm_backward(gs, x, w, rstd, dy, dx_frozen, nullptr, acc);
      expect_close(to_host(*gpu, dx_frozen), to_host(*cpu, cdx), tol_for(t), "rmsnorm dx without dw");
    }
  }
}

TEST_P(CudaOps, RopeForwardAndInverseAtLongPositions) {
  const DType t = GetParam();
  const int64_t tokens = 50, heads = 3, d = 64;
  std::vector<int> pos(tokens);
  std::uniform_int_distribution<int> pick(0, 1 << 19);  // angles up to ~5e5 rad
  for (int& p : pos) p = pick(rng);
  pos[0] = 0;
  std::vector<double> freq(d / 2);
  for (int i = 0; i < d / 2; ++i) freq[i] = static_cast<float>(std::pow(1e6, -2.0 * i / d));
  auto xv = rand_values(tokens * heads * d, t);
  for (int sign : {1, -1}) {
    Tensor x = on_gpu(xv, Shape{tokens, heads, d}, t), cx = on_cpu(xv, Shape{tokens, heads, d});
    Tensor inv = on_gpu(freq, Shape{d / 2}, DType::F32), cinv = on_cpu(freq, Shape{d / 2}, DType::F32);
    gpu->rope(gs, x, gpu_ints(pos), inv, 1.3, sign);
    cpu->rope(cs, cx, cpu_ints(pos), cinv, 1.3, sign);
    expect_close(to_host(*gpu, x), to_host(*cpu, cx), tol_for(t), sign > 0 ? "rope" : "rope inverse");
  }
}

TEST_P(CudaOps, SwigluForwardBackward) {
  const DType t = GetParam();
  const int64_t n = 4099;
  auto g = rand_values(n, t, 6.0), u = rand_values(n, t), d = rand_values(n, t);
  Tensor gate = on_gpu(g, Shape{n}, t), up = on_gpu(u, Shape{n}, t), dout = on_gpu(d, Shape{n}, t);
  Tensor cg = on_cpu(g, Shape{n}), cu = on_cpu(u, Shape{n}), cd = on_cpu(d, Shape{n});
  Tensor out = poisoned(Shape{n}, t), cout_ = cpu->empty(Shape{n}, DType::F64);
  gpu->swiglu_forward(gs, gate, up, out);
  cpu->swiglu_forward(cs, cg, cu, cout_);
  expect_close(to_host(*gpu, out), to_host(*cpu, cout_), tol_for(t), "swiglu");
  Tensor dg = poisoned(Shape{n}, t), du = poisoned(Shape{n}, t);
  Tensor cdg = cpu->empty(Shape{n}, DType::F64), cdu = cpu->empty(Shape{n}, DType::F64);
  gpu->swiglu_backward(gs, gate, up, dout, dg, du);
  cpu->swiglu_backward(cs, cg, cu, cd, cdg, cdu);
  expect_close(to_host(*gpu, dg), to_host(*cpu, cdg), tol_for(t), "swiglu dgate");
  expect_close(to_host(*gpu, du), to_host(*cpu, cdu), tol_for(t), "swiglu dup");
}

TEST_P(CudaOps, CrossEntropyValueGradientAndTokenLoss) {
  const DType t = GetParam();
  // 1000 and 20000 take the vector path (pairs of vectors and a tail), 50021 the scalar one.
  for (int64_t vocab : {1000, 20000, 50021}) {
    const int64_t n = vocab > 10000 ? 5 : 37;
    auto lv = rand_values(n * vocab, t, 8.0);
    std::vector<int> tg(n);
    std::uniform_int_distribution<int> pick(0, static_cast<int>(vocab) - 1);
    for (int& x : tg) x = pick(rng);
    auto wv = rand_values(n, DType::F32);
    wv[1] = 0.0;  // an unsupervised row: zero gradient, no loss
    Tensor logits = on_gpu(lv, Shape{n, vocab}, t), clogits = on_cpu(lv, Shape{n, vocab});
    Tensor w = on_gpu(wv, Shape{n}, DType::F32), cw = on_cpu(wv, Shape{n});
    Tensor loss = on_gpu({0.5}, Shape{1}, DType::F32), closs = on_cpu({0.5}, Shape{1});
    Tensor ce = poisoned(Shape{n}, DType::F32), cce = cpu->empty(Shape{n}, DType::F64);
    gpu->cross_entropy(gs, logits, gpu_ints(tg), w, 0.3, 0.7, loss, ce);
    cpu->cross_entropy(cs, clogits, cpu_ints(tg), cw, 0.3, 0.7, closs, cce);
    expect_close(to_host(*gpu, logits), to_host(*cpu, clogits), tol_for(t), "dlogits");
    expect_close(to_host(*gpu, ce), to_host(*cpu, cce), 1e-5, "token_ce");
    EXPECT_NEAR(to_host(*gpu, loss)[0], to_host(*cpu, closs)[0], 1e-5 * std::fabs(to_host(*cpu, closs)[0]));
    Tensor none;  // token_ce is optional
    gpu->cross_entropy(gs, logits, gpu_ints(tg), w, 1.0, 1.0, loss, none);
    gpu->synchronize(gs);
  }
  Tensor logits = on_gpu(rand_values(8, t), Shape{2, 4}, t);
  Tensor loss = gpu->zeros(Shape{1}, DType::F32), none;
  gpu->cross_entropy(gs, logits, gpu_ints({1, 4}), on_gpu({1.0, 1.0}, Shape{2}, DType::F32), 1, 1, loss, none);
  EXPECT_THROW(gpu->synchronize(gs), Error);
}

TEST_F(CudaOps, AdamWMatchesCpu) {
  const int64_t n = 10007;
  auto p = rand_values(n, DType::F32), g = rand_values(n, DType::F32), m = rand_values(n, DType::F32, 0.1);
  auto v = rand_values(n, DType::F32, 0.01);
  for (double& x : v) x = std::fabs(x);
  Tensor gp = on_gpu(p, Shape{n}, DType::F32), gg = on_gpu(g, Shape{n}, DType::F32);
  Tensor gm = on_gpu(m, Shape{n}, DType::F32), gv = on_gpu(v, Shape{n}, DType::F32);
  Tensor cp = on_cpu(p, Shape{n}), cg = on_cpu(g, Shape{n}), cm = on_cpu(m, Shape{n}), cv = on_cpu(v, Shape{n});
  Backend::AdamW hp{3e-3, 0.9, 0.95, 1e-8, 0.1, 7, 0.8};
  for (int step = 0; step < 3; ++step, ++hp.step) {
    gpu->adamw_step(gs, gp, gg, gm, gv, hp);
    cpu->adamw_step(cs, cp, cg, cm, cv, hp);
  }
  expect_close(to_host(*gpu, gp), to_host(*cpu, cp), 1e-6, "param");
  expect_close(to_host(*gpu, gm), to_host(*cpu, cm), 1e-6, "m");
  expect_close(to_host(*gpu, gv), to_host(*cpu, cv), 1e-6, "v");
}

TEST_P(CudaOps, AttentionMergeIgnoresEmptyRows) {
  const DType t = GetParam();
  const int64_t tq = 33, hq = 3, d = 40;
  auto ov = rand_values(tq * hq * d, DType::F32), obv = rand_values(tq * hq * d, t);
  auto lv = rand_values(tq * hq, DType::F32, 5.0), lbv = rand_values(tq * hq, DType::F32, 5.0);
  for (int64_t i = 0; i < tq * hq; i += 5) lv[i] = -kInf;   // accumulator empty
  for (int64_t i = 0; i < tq * hq; i += 7) lbv[i] = -kInf;  // block empty (some rows: both)
  Tensor out = on_gpu(ov, Shape{tq, hq, d}, DType::F32), lse = on_gpu(lv, Shape{hq, tq}, DType::F32);
  Tensor ob = on_gpu(obv, Shape{tq, hq, d}, t), lb = on_gpu(lbv, Shape{hq, tq}, DType::F32);
  Tensor cout_ = on_cpu(ov, Shape{tq, hq, d}), clse = on_cpu(lv, Shape{hq, tq});
  Tensor cob = on_cpu(obv, Shape{tq, hq, d}), clb = on_cpu(lbv, Shape{hq, tq});
  gpu->attention_merge(gs, out, lse, ob, lb);
  cpu->attention_merge(cs, cout_, clse, cob, clb);
  expect_close(to_host(*gpu, out), to_host(*cpu, cout_), 1e-6, "merged out");
  auto gl = to_host(*gpu, lse), cl = to_host(*cpu, clse);
  for (size_t i = 0; i < gl.size(); ++i) {
    ASSERT_FALSE(std::isnan(gl[i])) << i;
    if (std::isinf(cl[i])) EXPECT_EQ(gl[i], cl[i]) << i;
    else EXPECT_NEAR(gl[i], cl[i], 1e-5 * std::max(1.0, std::fabs(cl[i]))) << i;
  }
}

TEST_F(CudaOps, RejectsWrongDtypesWithAClearMessage) {
  Tensor a = gpu->empty(Shape{2, 2}, DType::F16);
  try {
    gpu->gemm(gs, a, false, a, false, a, 1, 0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("F32 or BF16"), std::string::npos) << e.what();
  }
  Tensor x = gpu->empty(Shape{4, 8}, DType::BF16), w = gpu->empty(Shape{8}, DType::BF16);
  Tensor rstd64 = gpu->empty(Shape{4}, DType::F64);
  EXPECT_THROW(gpu->rmsnorm_forward(gs, x, w, 1e-5, x, rstd64), Error);
  Tensor on_host = cpu->empty(Shape{2, 2}, DType::F32);
  EXPECT_THROW(gpu->scale(gs, on_host, 2.0), Error);
}

// ---- attention -------------------------------------------------------------------------------

struct MaskSpec {
  std::vector<int> q_doc, q_pos, k_doc, k_pos;
  bool plain_causal = false;  // passed on as AttentionMask::plain_causal (the trainer's host-side fact)
};

MaskSpec causal(int t) {
  MaskSpec m;
  for (int i = 0; i < t; ++i) {
    m.q_doc.push_back(0);
    m.q_pos.push_back(i);
  }
  m.k_doc = m.q_doc;
  m.k_pos = m.q_pos;
  return m;
}

// Packed documents with restarting positions; the last one is padding (its own document id).
MaskSpec packed(const std::vector<int>& lengths, int padding) {
  MaskSpec m;
  for (size_t d = 0; d < lengths.size(); ++d)
    for (int i = 0; i < lengths[d]; ++i) {
      m.q_doc.push_back(static_cast<int>(d));
      m.q_pos.push_back(i);
    }
  for (int i = 0; i < padding; ++i) {
    m.q_doc.push_back(-1);
    m.q_pos.push_back(i);
  }
  m.k_doc = m.q_doc;
  m.k_pos = m.q_pos;
  return m;
}

// Query positions [q0, q0 + tq), key positions [k0, k0 + tk) of one document (a ring block).
MaskSpec block(int q0, int tq, int k0, int tk) {
  MaskSpec m;
  for (int i = 0; i < tq; ++i) {
    m.q_doc.push_back(0);
    m.q_pos.push_back(q0 + i);
  }
  for (int j = 0; j < tk; ++j) {
    m.k_doc.push_back(0);
    m.k_pos.push_back(k0 + j);
  }
  return m;
}

// Zigzag ring block: queries hold chunks {a, 2R-1-a}, keys chunks {b, 2R-1-b}, chunk size c.
MaskSpec zigzag(int a, int b, int ring, int c) {
  MaskSpec m;
  for (int chunk : {a, 2 * ring - 1 - a})
    for (int i = 0; i < c; ++i) {
      m.q_doc.push_back(0);
      m.q_pos.push_back(chunk * c + i);
    }
  for (int chunk : {b, 2 * ring - 1 - b})
    for (int i = 0; i < c; ++i) {
      m.k_doc.push_back(0);
      m.k_pos.push_back(chunk * c + i);
    }
  return m;
}

// One document whose neighbouring positions are swapped (1, 0, 3, 2, ...): no tile is a run of
// consecutive positions, so the kernels must read every token's position.
MaskSpec swapped_positions(int n) {
  MaskSpec m;
  for (int i = 0; i < n; ++i) {
    m.q_doc.push_back(0);
    m.q_pos.push_back(i ^ 1);
  }
  m.k_doc = m.q_doc;
  m.k_pos = m.q_pos;
  return m;
}

struct AttnCase {
  const char* name;
  MaskSpec mask;
  int hq, hkv;
  int64_t window = 0;  // the layer's sliding window (backend/attention_rule.h), 0: none
};

std::vector<AttnCase> attention_cases() {
  return {
      {"causal", causal(200), 4, 2},
      {"packed", packed({70, 1, 90, 25}, 14), 4, 4},
      {"ring block above the diagonal (all rows empty)", block(0, 96, 96, 130), 2, 1},
      {"partly empty rows", block(0, 150, 70, 100), 4, 2},
      {"gqa group 3 zigzag block", zigzag(0, 1, 2, 70), 6, 2},
      {"gqa group 3 zigzag block reversed", zigzag(1, 0, 2, 70), 6, 2},
      {"ring block below the diagonal (all visible)", block(300, 80, 0, 140), 2, 2},
      // Sliding windows: shorter than a tile, across tile borders, on packed rows and ring blocks
      // (a block the window leaves entirely behind has only empty rows).
      {"causal window 37", causal(200), 4, 2, 37},
      {"packed window 20", packed({70, 1, 90, 25}, 14), 4, 4, 20},
      {"gqa group 3 zigzag block window 50", zigzag(0, 1, 2, 70), 6, 2, 50},
      {"ring block below the diagonal, window 100 (partly visible)", block(150, 80, 0, 140), 2, 2, 100},
      {"ring block beyond the window (all rows empty)", block(300, 80, 0, 140), 2, 1, 20},
  };
}

class CudaAttention : public ::testing::TestWithParam<std::tuple<DType, int>> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
    gpu = make_cuda_backend(0);
  }
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> gpu;
  std::mt19937_64 rng{77};
};

std::vector<double> random_rounded(std::mt19937_64& rng, int64_t n, DType t, double scale) {
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<double> v(n);
  for (double& x : v) {
    do x = round_to(t, dist(rng));
    while (x == 0.0);
  }
  return v;
}

// Runs one case on both backends and compares out, lse, dq, dk, dv; then the same backward with
// accumulate = true on top of random gradients.
// `f32_variants`: also the F32 out / F32 gradient variants (ring partials; not for cuDNN).
void check_attention(Backend& cpu, Backend& gpu, std::mt19937_64& rng, const AttnCase& c, DType t, int d,
                     bool f32_variants = true) {
  SCOPED_TRACE(std::string(c.name) + " " + std::string(dtype_name(t)) + " d=" + std::to_string(d));
  const int64_t tq = c.mask.q_doc.size(), tk = c.mask.k_doc.size();
  const AttentionLogits logits{1.0 / std::sqrt(static_cast<double>(d)), 0, c.window};
  Stream gs = gpu.default_stream(), cs{};
  auto qv = random_rounded(rng, tq * c.hq * d, t, 2.0), kv = random_rounded(rng, tk * c.hkv * d, t, 2.0);
  auto vv = random_rounded(rng, tk * c.hkv * d, t, 1.0), dov = random_rounded(rng, tq * c.hq * d, t, 1.0);
  auto up = [&](Backend& be, const std::vector<double>& v, Shape s, DType dt) {
    Tensor x = be.empty(s, dt);
    from_host(be, v, x);
    return x;
  };
  const DType ct = DType::F64;
  const Shape qs{tq, c.hq, d}, ks{tk, c.hkv, d};
  AttentionMask gm{int_tensor(gpu, c.mask.q_doc), int_tensor(gpu, c.mask.q_pos), int_tensor(gpu, c.mask.k_doc),
                   int_tensor(gpu, c.mask.k_pos)};
  gm.plain_causal = c.mask.plain_causal;
  AttentionMask cm{int_tensor(cpu, c.mask.q_doc), int_tensor(cpu, c.mask.q_pos), int_tensor(cpu, c.mask.k_doc),
                   int_tensor(cpu, c.mask.k_pos)};
  Tensor q = up(gpu, qv, qs, t), k = up(gpu, kv, ks, t), v = up(gpu, vv, ks, t), dout = up(gpu, dov, qs, t);
  Tensor cq = up(cpu, qv, qs, ct), ck = up(cpu, kv, ks, ct), cv = up(cpu, vv, ks, ct), cdout = up(cpu, dov, qs, ct);
  Tensor out = gpu.empty(qs, t), lse = gpu.empty(Shape{c.hq, tq}, DType::F32);
  gpu.fill(gs, out, std::nan(""));
  gpu.fill(gs, lse, std::nan(""));
  Tensor cout_ = cpu.empty(qs, ct), clse = cpu.empty(Shape{c.hq, tq}, ct);
  gpu.attention_forward(gs, q, k, v, gm, logits, out, lse);
  cpu.attention_forward(cs, cq, ck, cv, cm, logits, cout_, clse);
  const double tol = tol_for(t);
  expect_close(to_host(gpu, out), to_host(cpu, cout_), tol, "out");
  auto gl = to_host(gpu, lse), cl = to_host(cpu, clse);
  std::vector<double> glf, clf;
  for (size_t i = 0; i < gl.size(); ++i) {
    ASSERT_FALSE(std::isnan(gl[i])) << "lse " << i;
    if (std::isinf(cl[i])) {
      ASSERT_EQ(gl[i], cl[i]) << "lse " << i << " must be -inf for a row without keys";
    } else {
      glf.push_back(gl[i]);
      clf.push_back(cl[i]);
    }
  }
  expect_close(glf, clf, t == DType::F32 ? 1e-6 : 1e-4, "lse");
  // The F32-output variant (ring partials) of the same forward.
  if (t == DType::BF16 && f32_variants) {
    Tensor out32 = gpu.empty(qs, DType::F32);
    gpu.fill(gs, out32, std::nan(""));
    gpu.attention_forward(gs, q, k, v, gm, logits, out32, lse);
    expect_close(to_host(gpu, out32), to_host(cpu, cout_), 5e-3, "out F32");
  }

  for (bool acc : {false, true}) {
    SCOPED_TRACE(acc ? "accumulate" : "overwrite");
    auto dq0 = random_rounded(rng, tq * c.hq * d, t, 1.0), dk0 = random_rounded(rng, tk * c.hkv * d, t, 1.0);
    auto dv0 = random_rounded(rng, tk * c.hkv * d, t, 1.0);
    Tensor dq = up(gpu, dq0, qs, t), dk = up(gpu, dk0, ks, t), dv = up(gpu, dv0, ks, t);
    if (!acc) {
      gpu.fill(gs, dq, std::nan(""));
      gpu.fill(gs, dk, std::nan(""));
      gpu.fill(gs, dv, std::nan(""));
    }
    Tensor cdq = up(cpu, dq0, qs, ct), cdk = up(cpu, dk0, ks, ct), cdv = up(cpu, dv0, ks, ct);
    gpu.attention_backward(gs, q, k, v, out, dout, lse, gm, logits, dq, dk, dv, acc);
    cpu.attention_backward(cs, cq, ck, cv, cout_, cdout, clse, cm, logits, cdq, cdk, cdv, acc);
    expect_close(to_host(gpu, dq), to_host(cpu, cdq), tol, "dq");
    expect_close(to_host(gpu, dk), to_host(cpu, cdk), tol, "dk");
    expect_close(to_host(gpu, dv), to_host(cpu, cdv), tol, "dv");
  }
  if (t != DType::BF16 || !f32_variants) return;
  // F32 gradients of BF16 inputs (ring attention's block partials). Accumulated onto 256 + u,
  // where BF16's spacing is 2: a gradient that went through BF16 storage would be off by ~1.
  Tensor cdq = cpu.empty(qs, ct), cdk = cpu.empty(ks, ct), cdv = cpu.empty(ks, ct);
  cpu.attention_backward(cs, cq, ck, cv, cout_, cdout, clse, cm, logits, cdq, cdk, cdv, false);
  const std::vector<double> want[3] = {to_host(cpu, cdq), to_host(cpu, cdk), to_host(cpu, cdv)};
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  for (bool acc : {false, true}) {
    SCOPED_TRACE(acc ? "F32 gradients, accumulate" : "F32 gradients, overwrite");
    std::vector<double> init[3];
    for (int i = 0; i < 3; ++i) {
      init[i].resize(want[i].size());
      for (double& x : init[i]) x = acc ? static_cast<float>(256.0 + unit(rng)) : 0.0;
    }
    Tensor dq = up(gpu, init[0], qs, DType::F32), dk = up(gpu, init[1], ks, DType::F32);
    Tensor dv = up(gpu, init[2], ks, DType::F32);
    if (!acc) {
      gpu.fill(gs, dq, std::nan(""));
      gpu.fill(gs, dk, std::nan(""));
      gpu.fill(gs, dv, std::nan(""));
    }
    gpu.attention_backward(gs, q, k, v, out, dout, lse, gm, logits, dq, dk, dv, acc);
    const std::vector<double> got[3] = {to_host(gpu, dq), to_host(gpu, dk), to_host(gpu, dv)};
    const char* names[3] = {"dq F32", "dk F32", "dv F32"};
    for (int i = 0; i < 3; ++i) {
      std::vector<double> delta(got[i].size());
      for (size_t e = 0; e < delta.size(); ++e) delta[e] = got[i][e] - init[i][e];
      expect_close(delta, want[i], tol, names[i]);
    }
  }
}

TEST_P(CudaAttention, EveryMaskCaseMatchesCpu) {
  const auto [t, d] = GetParam();
  for (const AttnCase& c : attention_cases()) check_attention(*cpu, *gpu, rng, c, t, d);
}

// BF16 with d 64/128 runs the tensor-core kernels; F32 and d = 96 run the simple kernels.
INSTANTIATE_TEST_SUITE_P(Kernels, CudaAttention,
                         ::testing::Values(std::make_tuple(DType::BF16, 64), std::make_tuple(DType::BF16, 128),
                                           std::make_tuple(DType::BF16, 96), std::make_tuple(DType::F32, 128),
                                           std::make_tuple(DType::F32, 40)),
                         [](const auto& info) {
                           return std::string(dtype_name(std::get<0>(info.param))) + "_d" +
                                  std::to_string(std::get<1>(info.param));
                         });

// The mma.sync kernels (the fallback where the Hopper kernels do not run), forced on d 64/128.
TEST(CudaAttentionImpls, TensorCoreFallbackMatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
  auto gpu = make_cuda_backend(0, {spindle::CudaAttention::Mma});
  auto cpu = make_cpu_backend();
  std::mt19937_64 rng(9);
  for (int d : {64, 128}) {
    for (const AttnCase& c : attention_cases()) check_attention(*cpu, *gpu, rng, c, DType::BF16, d);
    check_attention(*cpu, *gpu, rng, {"zigzag", zigzag(1, 0, 2, 100), 6, 2}, DType::BF16, d);
  }
}

bool gpu_is_hopper() {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, 0) == cudaSuccess && major == 9;
}

// The Hopper kernels on rows of several 128-token tiles: tails, documents across tile borders,
// ring blocks whose tiles are partly or wholly hidden, GQA groups of 1, 3 and 6; tiles of one run,
// of two runs (two documents; a zigzag shard's chunks) and of more (TileLayout's slow path).
TEST(CudaAttentionImpls, WgmmaMatchesCpuOnMultiTileRows) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
  if (!gpu_is_hopper()) GTEST_SKIP() << "the wgmma kernels need a Hopper GPU";
  auto gpu = make_cuda_backend(0, {spindle::CudaAttention::Wgmma});
  auto cpu = make_cpu_backend();
  std::mt19937_64 rng(21);
  const std::vector<AttnCase> cases = {
      {"causal 1000", causal(1000), 6, 1},
      {"packed across tile borders", packed({300, 700, 5, 129, 1}, 50), 6, 2},
      {"ring block above the diagonal", block(0, 400, 500, 300), 2, 2},
      {"ring block, partly empty rows", block(0, 450, 200, 333), 12, 2},
      {"zigzag 4 x 160", zigzag(0, 3, 4, 160), 6, 6},
      {"zigzag 4 x 160 reversed", zigzag(3, 1, 4, 160), 6, 2},
      {"ring block below the diagonal", block(1000, 256, 0, 640), 4, 2},
      {"positions out of order", swapped_positions(300), 4, 2},
      {"causal 1000 window 128", causal(1000), 6, 1, 128},
      {"packed across tile borders, window 200", packed({300, 700, 5, 129, 1}, 50), 6, 2, 200},
      {"zigzag 4 x 160 window 90", zigzag(0, 3, 4, 160), 6, 6, 90},
  };
  for (const AttnCase& c : cases) check_attention(*cpu, *gpu, rng, c, DType::BF16, 128);
}

// Asking for cuDNN in a build without it fails when the backend is made (before the device starts,
// so also on a machine without a GPU), not at the first attention call.
TEST(CudaAttentionImpls, CudnnChoiceWithoutCudnnFailsAtStartUp) {
  if (cuda::attention_cudnn_built()) {
    if (cuda_device_count() == 0) GTEST_SKIP() << "built with cuDNN; making a backend needs a GPU";
    EXPECT_NO_THROW(make_cuda_backend(0, {spindle::CudaAttention::Cudnn}));
    return;
  }
  try {
    make_cuda_backend(0, {spindle::CudaAttention::Cudnn});
    ADD_FAILURE() << "a cuDNN choice was accepted by a build without cuDNN";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--attention cudnn: this spindle was built without cuDNN"), std::string::npos)
        << e.what();
  }
}

// cuDNN's fused SDPA (CudaAttention::Cudnn, --attention cudnn) on its two mask cases: one causal
// document and a fully visible block (a ring block below the diagonal), GQA 12/2 and 4/4, T 300 and 1024.
TEST(CudaAttentionImpls, CudnnMatchesCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
  if (!cuda::attention_cudnn_built()) GTEST_SKIP() << "built without cuDNN";
  auto gpu = make_cuda_backend(0, {spindle::CudaAttention::Cudnn});
  auto cpu = make_cpu_backend();
  std::mt19937_64 rng(31);
  for (int t : {300, 1024})
    for (auto [hq, hkv] : {std::pair{12, 2}, std::pair{4, 4}}) {
      check_attention(*cpu, *gpu, rng, {"cudnn causal", causal(t), hq, hkv}, DType::BF16, 128, false);
      check_attention(*cpu, *gpu, rng, {"cudnn no mask", block(t, t, 0, t), hq, hkv}, DType::BF16, 128, false);
    }
  // Anything else is refused with a reason, not computed wrongly.
  const AttnCase packed_case{"packed", packed({100, 200}, 0), 4, 4};
  EXPECT_THROW(check_attention(*cpu, *gpu, rng, packed_case, DType::BF16, 128, false), Error);
}

// cuDNN at the other head dims it takes: 256 (Qwen3.5/3.6's full attention: 16 query heads over 2
// KV heads) and 64, causal and fully visible, GQA. A head dim it does not take is refused with the
// reason, never computed wrongly.
TEST(CudaAttentionImpls, CudnnHeadDims64And256MatchCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
  if (!cuda::attention_cudnn_built()) GTEST_SKIP() << "built without cuDNN";
  auto gpu = make_cuda_backend(0, {spindle::CudaAttention::Cudnn});
  auto cpu = make_cpu_backend();
  std::mt19937_64 rng(37);
  for (int t : {300, 640})
    check_attention(*cpu, *gpu, rng, {"cudnn causal", causal(t), 16, 2}, DType::BF16, 256, false);
  check_attention(*cpu, *gpu, rng, {"cudnn causal MHA", causal(200), 4, 4}, DType::BF16, 256, false);
  check_attention(*cpu, *gpu, rng, {"cudnn no mask", block(300, 300, 0, 300), 16, 2}, DType::BF16, 256, false);
  check_attention(*cpu, *gpu, rng, {"cudnn causal", causal(300), 12, 2}, DType::BF16, 64, false);
  try {
    check_attention(*cpu, *gpu, rng, {"cudnn causal d 96", causal(64), 4, 2}, DType::BF16, 96, false);
    ADD_FAILURE() << "cuDNN took head dim 96";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("head dim 64, 128 or 256"), std::string::npos) << e.what();
  }
}

// Head dim 256 has no tensor-core kernel of the engine's own (it runs the simple ones), so the
// default sends a plain causal row to cuDNN from its first call once it holds 1/32 of the scores a
// head dim 128 row needs (12 × 40k² / 32 = 6·10⁸): 16 heads × 8192² do, 16 × 2048² do not.
TEST(CudaAttentionImpls, DefaultTakesCudnnSoonerForHeadDim256) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
  if (!cuda::attention_cudnn_built()) GTEST_SKIP() << "built without cuDNN";
  auto dflt = make_cuda_backend(0);
  auto dnn = make_cuda_backend(0, {spindle::CudaAttention::Cudnn});
  auto own = make_cuda_backend(0, {spindle::CudaAttention::Own});
  std::mt19937_64 rng(41);
  const int hq = 16, hkv = 2, d = 256;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  for (const int64_t t : {int64_t{8192}, int64_t{2048}}) {
    SCOPED_TRACE(testing::Message() << "T " << t);
    auto make = [&](Shape s) {
      Tensor x = dflt->empty(s, DType::BF16);
      from_host(*dflt, random_rounded(rng, s.numel(), DType::BF16, 2.0), x);
      return x;
    };
    Tensor q = make(Shape{t, hq, d}), k = make(Shape{t, hkv, d}), v = make(Shape{t, hkv, d});
    const MaskSpec m = causal(static_cast<int>(t));
    AttentionMask mask{int_tensor(*dflt, m.q_doc), int_tensor(*dflt, m.q_pos), int_tensor(*dflt, m.k_doc),
                       int_tensor(*dflt, m.k_pos)};
    mask.plain_causal = true;
    auto forward = [&](Backend& be) {
      Tensor out = be.empty(q.shape(), DType::BF16), lse = be.empty(Shape{hq, t}, DType::F32);
      be.attention_forward(be.default_stream(), q, k, v, mask, AttentionLogits{scale}, out, lse);
      return to_host(be, out);
    };
    const auto by_default = forward(*dflt), by_dnn = forward(*dnn), by_own = forward(*own);
    EXPECT_NE(by_dnn, by_own) << "cuDNN and the own kernels agree to the bit: this test could not tell them apart";
    if (t == 8192) EXPECT_EQ(by_default, by_dnn) << "the default did not take cuDNN for an 8192-token d 256 row";
    else EXPECT_EQ(by_default, by_own) << "a short d 256 row's first call should not pay for a cuDNN plan";
  }
}

// The default choice: a call whose mask carries the host-side fact plain_causal goes to cuDNN when
// the shape is worth a plan — long enough (12 heads × 40k tokens²) from its first call, a shorter
// one once it recurs (after 64 calls) — and then matches cuDNN's forward to the bit and the CPU in
// both directions; without the fact, and under CudaAttention::Own, the engine's kernels.
TEST(CudaAttentionImpls, DefaultTakesCudnnForPlainCausalRows) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
  if (!cuda::attention_cudnn_built()) GTEST_SKIP() << "built without cuDNN";
  auto dflt = make_cuda_backend(0);
  auto dnn = make_cuda_backend(0, {spindle::CudaAttention::Cudnn});
  auto own = make_cuda_backend(0, {spindle::CudaAttention::Own});
  auto cpu = make_cpu_backend();
  std::mt19937_64 rng(77);
  const int hq = 12, hkv = 2, d = 128;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // out of the three backends for one set of inputs of t tokens, with or without the fact
  auto outputs = [&](int64_t t, int repeat_default) {
    auto make = [&](Shape s) {
      Tensor x = dflt->empty(s, DType::BF16);
      from_host(*dflt, random_rounded(rng, s.numel(), DType::BF16, 2.0), x);
      return x;
    };
    Tensor q = make(Shape{t, hq, d}), k = make(Shape{t, hkv, d}), v = make(Shape{t, hkv, d});
    const MaskSpec m = causal(static_cast<int>(t));
    AttentionMask mask{int_tensor(*dflt, m.q_doc), int_tensor(*dflt, m.q_pos), int_tensor(*dflt, m.k_doc),
                       int_tensor(*dflt, m.k_pos)};
    auto forward = [&](Backend& be, bool fact) {
      mask.plain_causal = fact;
      Tensor out = be.empty(q.shape(), DType::BF16), lse = be.empty(Shape{hq, t}, DType::F32);
      be.attention_forward(be.default_stream(), q, k, v, mask, AttentionLogits{scale}, out, lse);
      return to_host(be, out);
    };
    std::vector<std::vector<double>> r;
    r.push_back(forward(*dflt, true));  // the default's first call of this shape
    for (int i = 0; i < repeat_default; ++i) r.push_back(forward(*dflt, true));
    r.push_back(forward(*dnn, true));
    r.push_back(forward(*own, true));
    r.push_back(forward(*dflt, false));
    return r;
  };
  {  // a short shape: the engine's kernels at first, cuDNN once it recurs
    const auto r = outputs(640, 64);
    const auto& by_dnn = r[r.size() - 3];
    const auto& by_own = r[r.size() - 2];
    EXPECT_NE(by_dnn, by_own) << "cuDNN and the own kernels agree to the bit: this test could not tell them apart";
    EXPECT_EQ(r[0], by_own) << "a short shape's first call should not pay for a cuDNN plan";
    EXPECT_EQ(r[64], by_dnn) << "the 65th call of a recurring shape should run cuDNN";
    EXPECT_EQ(r.back(), by_own) << "without the fact the default must use the engine's own kernels";
  }
  {  // a long shape: cuDNN from its first call
    const auto r = outputs(40960, 0);
    EXPECT_EQ(r[0], r[1]) << "the default did not take cuDNN for a long plain causal row";
    EXPECT_EQ(r[3], r[2]) << "without the fact the default must use the engine's own kernels";
  }
  // The recurring short shape now runs cuDNN: both directions, accumulate and F32 variants (the
  // F32 ones fall back to the engine's kernels) against the CPU.
  MaskSpec plain = causal(640);
  plain.plain_causal = true;
  check_attention(*cpu, *dflt, rng, {"default, plain causal", plain, hq, hkv}, DType::BF16, d);
}

// The simple kernels forced on BF16 d = 128 (the tensor-core kernels' shape) also match the CPU,
// and the two GPU implementations agree with each other at a size the CPU would take long for.
TEST(CudaAttentionImpls, SimpleAndTensorCoreKernelsAgree) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
  auto simple = make_cuda_backend(0, {spindle::CudaAttention::Simple});
  auto mma = make_cuda_backend(0, {spindle::CudaAttention::Mma});
  auto wgmma = make_cuda_backend(0, {gpu_is_hopper() ? spindle::CudaAttention::Wgmma : spindle::CudaAttention::Mma});
  auto cpu = make_cpu_backend();
  std::mt19937_64 rng(5);
  check_attention(*cpu, *simple, rng, {"causal", causal(150), 4, 2}, DType::BF16, 128);

  const int64_t t = 2304, hq = 12, hkv = 2, d = 128;  // 36 tiles; documents of 1000, 1200, 104
  MaskSpec m = packed({1000, 1200}, 104);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Stream ss = simple->default_stream(), ms = mma->default_stream();
  auto make = [&](Backend& be, Shape s) {
    std::vector<double> v = random_rounded(rng, s.numel(), DType::BF16, 2.0);
    Tensor x = be.empty(s, DType::BF16);
    from_host(be, v, x);
    return x;
  };
  Tensor q = make(*mma, Shape{t, hq, d}), k = make(*mma, Shape{t, hkv, d}), v = make(*mma, Shape{t, hkv, d});
  Tensor dout = make(*mma, Shape{t, hq, d});
  AttentionMask mask{int_tensor(*mma, m.q_doc), int_tensor(*mma, m.q_pos), int_tensor(*mma, m.k_doc),
                     int_tensor(*mma, m.k_pos)};
  Tensor o1 = mma->empty(q.shape(), DType::BF16), l1 = mma->empty(Shape{hq, t}, DType::F32);
  Tensor o2 = mma->empty(q.shape(), DType::BF16), l2 = mma->empty(Shape{hq, t}, DType::F32);
  mma->attention_forward(ms, q, k, v, mask, AttentionLogits{scale}, o1, l1);
  simple->attention_forward(ss, q, k, v, mask, AttentionLogits{scale}, o2, l2);
  expect_close(to_host(*mma, o1), to_host(*simple, o2), 1e-2, "out");
  expect_close(to_host(*mma, l1), to_host(*simple, l2), 1e-4, "lse");
  {
    Tensor o3 = wgmma->empty(q.shape(), DType::BF16), l3 = wgmma->empty(Shape{hq, t}, DType::F32);
    wgmma->attention_forward(wgmma->default_stream(), q, k, v, mask, AttentionLogits{scale}, o3, l3);
    expect_close(to_host(*wgmma, o3), to_host(*simple, o2), 1e-2, "out (wgmma)");
    expect_close(to_host(*wgmma, l3), to_host(*simple, l2), 1e-4, "lse (wgmma)");
    Tensor g3[3] = {wgmma->empty(q.shape(), DType::BF16), wgmma->empty(k.shape(), DType::BF16),
                    wgmma->empty(v.shape(), DType::BF16)};
    Tensor g4[3] = {simple->empty(q.shape(), DType::BF16), simple->empty(k.shape(), DType::BF16),
                    simple->empty(v.shape(), DType::BF16)};
    wgmma->attention_backward(wgmma->default_stream(), q, k, v, o3, dout, l3, mask, AttentionLogits{scale}, g3[0], g3[1], g3[2], false);
    simple->attention_backward(ss, q, k, v, o3, dout, l3, mask, AttentionLogits{scale}, g4[0], g4[1], g4[2], false);
    const char* names[3] = {"dq (wgmma)", "dk (wgmma)", "dv (wgmma)"};
    for (int i = 0; i < 3; ++i) expect_close(to_host(*wgmma, g3[i]), to_host(*simple, g4[i]), 1e-2, names[i]);
  }
  Tensor g1[3] = {mma->empty(q.shape(), DType::BF16), mma->empty(k.shape(), DType::BF16),
                  mma->empty(v.shape(), DType::BF16)};
  Tensor g2[3] = {mma->empty(q.shape(), DType::BF16), mma->empty(k.shape(), DType::BF16),
                  mma->empty(v.shape(), DType::BF16)};
  mma->attention_backward(ms, q, k, v, o1, dout, l1, mask, AttentionLogits{scale}, g1[0], g1[1], g1[2], false);
  simple->attention_backward(ss, q, k, v, o1, dout, l1, mask, AttentionLogits{scale}, g2[0], g2[1], g2[2], false);
  const char* names[3] = {"dq", "dk", "dv"};
  for (int i = 0; i < 3; ++i) expect_close(to_host(*mma, g1[i]), to_host(*simple, g2[i]), 1e-2, names[i]);
}

// bitsandbytes' 4-bit dequantisation: the GPU kernels give the CPU reference's values bit for bit
// (F32), and those rounded to nearest even (BF16); random bytes, absmax that include values whose
// products flush to zero, odd lengths, every blocksize class, NF4 and FP4, double-quantised absmax.
TEST(CudaQuant4, DequantisationIsBitIdenticalToTheCpuReference) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto gpu = make_cuda_backend(0);
  auto cpu = make_cpu_backend(1);
  std::mt19937_64 rng(7);
  for (int64_t blocksize : {32, 64, 128, 4096})
    for (int64_t n : {int64_t{4096}, int64_t{8193}, int64_t{65 * 64 + 3}})
      for (Quant4Type type : {Quant4Type::NF4, Quant4Type::FP4}) {
        SCOPED_TRACE(::testing::Message() << "blocksize " << blocksize << " n " << n << " nf4 " << (type == Quant4Type::NF4));
        const int64_t bytes = (n + 1) / 2, blocks = (n + blocksize - 1) / blocksize;
        std::vector<uint8_t> packed(bytes);
        for (uint8_t& b : packed) b = static_cast<uint8_t>(rng());
        std::vector<float> absmax(blocks);
        std::uniform_real_distribution<float> u(0.001f, 2.0f);
        for (int64_t b = 0; b < blocks; ++b) absmax[b] = b % 7 == 3 ? 3e-38f : b % 11 == 5 ? 0.0f : u(rng);
        Tensor pc = cpu->empty(Shape{bytes}, DType::U8), ac = cpu->empty(Shape{blocks}, DType::F32);
        cpu->copy_from_host(cpu->default_stream(), packed.data(), pc);
        cpu->copy_from_host(cpu->default_stream(), absmax.data(), ac);
        Tensor want = cpu->empty(Shape{n}, DType::F32);
        cpu->dequantize_4bit(cpu->default_stream(), pc, ac, blocksize, type, want);
        Tensor pg = gpu->empty(Shape{bytes}, DType::U8), ag = gpu->empty(Shape{blocks}, DType::F32);
        gpu->copy_from_host(gpu->default_stream(), packed.data(), pg);
        gpu->copy_from_host(gpu->default_stream(), absmax.data(), ag);
        for (DType t : {DType::F32, DType::BF16}) {
          Tensor w = gpu->empty(Shape{n}, t);
          gpu->dequantize_4bit(gpu->default_stream(), pg, ag, blocksize, type, w);
          std::vector<uint8_t> got(w.bytes());
          gpu->copy_to_host(gpu->default_stream(), w, got.data());
          int64_t wrong = 0;
          for (int64_t j = 0; j < n; ++j) {
            const float ref = want.data_as<float>()[j];
            if (t == DType::F32) {
              float g;
              std::memcpy(&g, got.data() + 4 * j, 4);
              wrong += std::memcmp(&g, &ref, 4) != 0;
            } else {
              uint16_t g;
              std::memcpy(&g, got.data() + 2 * j, 2);
              wrong += g != f32_to_bf16(ref);
            }
          }
          EXPECT_EQ(wrong, 0) << dtype_name(t);
        }
      }
  // Double quantisation's absmax: code · absmax2 + offset, two roundings.
  const int64_t k = 1000;
  std::vector<uint8_t> codes(k);
  for (uint8_t& c : codes) c = static_cast<uint8_t>(rng());
  std::vector<float> code_map(256), absmax2(4);
  for (int i = 0; i < 256; ++i) code_map[i] = (i - 127.5f) / 128.0f * (1.0f + 1e-3f * static_cast<float>(i % 7));
  for (float& a : absmax2) a = std::uniform_real_distribution<float>(0.01f, 0.1f)(rng);
  const float offset = 0.0371f;
  auto run = [&](Backend& be) {
    Tensor c = be.empty(Shape{k}, DType::U8), m = be.empty(Shape{256}, DType::F32), a2 = be.empty(Shape{4}, DType::F32);
    be.copy_from_host(be.default_stream(), codes.data(), c);
    be.copy_from_host(be.default_stream(), code_map.data(), m);
    be.copy_from_host(be.default_stream(), absmax2.data(), a2);
    Tensor out = be.empty(Shape{k}, DType::F32);
    be.dequantize_absmax(be.default_stream(), c, m, a2, 256, offset, out);
    std::vector<float> host(k);
    be.copy_to_host(be.default_stream(), out, host.data());
    return host;
  };
  const std::vector<float> g = run(*gpu), c = run(*cpu);
  EXPECT_EQ(std::memcmp(g.data(), c.data(), k * sizeof(float)), 0);
}

// Building weights on the device: ModelWeights::random's values and quantising at load give the
// CPU reference's bits, so a model built on the GPU is the model the CPU builds.
std::vector<uint8_t> host_bytes(Backend& be, const Tensor& t) {
  std::vector<uint8_t> out(t.bytes());
  be.copy_to_host(be.default_stream(), t, out.data());
  return out;
}

int64_t differing_elements(const std::vector<uint8_t>& a, const std::vector<uint8_t>& b, size_t element) {
  if (a.size() != b.size()) return -1;
  int64_t wrong = 0;
  for (size_t i = 0; i < a.size(); i += element) wrong += std::memcmp(a.data() + i, b.data() + i, element) != 0;
  return wrong;
}

TEST(CudaInitOps, RandomFillIsBitIdenticalToTheCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto gpu = make_cuda_backend(0);
  auto cpu = make_cpu_backend();
  const double half_width = 0.02 * std::sqrt(3.0);
  for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F64})
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4097 * 3 + 1}, int64_t{3000017}})
      for (uint64_t sequence : {uint64_t{1}, uint64_t{912}}) {
        SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " n " << n << " sequence " << sequence);
        Tensor g = gpu->empty(Shape{n}, dtype), c = cpu->empty(Shape{n}, dtype);
        gpu->fill_random_uniform(gpu->default_stream(), g, 20261202, sequence, half_width);
        cpu->fill_random_uniform(cpu->default_stream(), c, 20261202, sequence, half_width);
        EXPECT_EQ(differing_elements(host_bytes(*gpu, g), host_bytes(*cpu, c), dtype_size(dtype)), 0);
      }
  // A half-width whose products round differently from the default's, and F16 values down to its
  // subnormals (|v| < 2^-14).
  for (DType dtype : {DType::F16, DType::F64}) {
    Tensor g = gpu->empty(Shape{100003}, dtype), c = cpu->empty(Shape{100003}, dtype);
    gpu->fill_random_uniform(gpu->default_stream(), g, 3, 4, 1e-4 / 3.0);
    cpu->fill_random_uniform(cpu->default_stream(), c, 3, 4, 1e-4 / 3.0);
    EXPECT_EQ(differing_elements(host_bytes(*gpu, g), host_bytes(*cpu, c), dtype_size(dtype)), 0) << dtype_name(dtype);
  }
}

// Weights like a projection's (normal, σ 0.02) with the blocks the quantiser treats specially:
// all zeros, denormals only (their absmax flushes to zero), signed zeros, one outlier, one
// element exactly at the block's absmax with either sign.
std::vector<double> quantiser_inputs(int64_t n, int64_t blocksize, std::mt19937_64& rng) {
  std::normal_distribution<double> normal(0.0, 0.02);
  std::vector<double> w(static_cast<size_t>(n));
  for (double& x : w) x = normal(rng);
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  auto block = [&](int64_t b, auto&& set) {
    if (b >= blocks) return;
    for (int64_t j = b * blocksize; j < std::min(n, (b + 1) * blocksize); ++j) set(w[static_cast<size_t>(j)], j);
  };
  block(0, [](double& x, int64_t) { x = 0.0; });
  block(1, [](double& x, int64_t j) { x = (j % 2 ? -1.0 : 1.0) * 1e-40 * static_cast<double>(j % 5); });
  block(2, [](double& x, int64_t j) { x = j % 3 ? -0.0 : 0.0; });
  block(3, [&](double& x, int64_t j) { x = j == 3 * blocksize + 1 ? 4.0 : x; });
  block(4, [&](double& x, int64_t j) { x = j == 4 * blocksize ? -0.125 : j == 4 * blocksize + 2 ? 0.125 : x * 0.5; });
  return w;
}

TEST(CudaInitOps, QuantiseIsBitIdenticalToTheCpu) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto gpu = make_cuda_backend(0);
  auto cpu = make_cpu_backend();
  Tensor map_gpu = gpu->empty(Shape{256}, DType::F32), map_cpu = cpu->empty(Shape{256}, DType::F32);
  gpu->copy_from_host(gpu->default_stream(), quant4::dynamic_map(), map_gpu);
  cpu->copy_from_host(cpu->default_stream(), quant4::dynamic_map(), map_cpu);
  std::mt19937_64 rng(2026);
  for (int64_t blocksize : {32, 64, 128, 4096})
    for (int64_t n : {int64_t{4096 * 3}, int64_t{4096 * 3 + 64 * 5 + 7}, int64_t{300001}})
      for (Quant4Type type : {Quant4Type::NF4, Quant4Type::FP4})
        for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
          SCOPED_TRACE(::testing::Message() << "blocksize " << blocksize << " n " << n << " "
                                            << (type == Quant4Type::NF4 ? "nf4 " : "fp4 ") << dtype_name(dtype));
          const std::vector<double> values = quantiser_inputs(n, blocksize, rng);
          Tensor wg = gpu->empty(Shape{n}, dtype), wc = cpu->empty(Shape{n}, dtype);
          from_host(*gpu, values, wg);
          from_host(*cpu, values, wc);
          const int64_t blocks = (n + blocksize - 1) / blocksize;
          Tensor pg = gpu->empty(Shape{(n + 1) / 2}, DType::U8), ag = gpu->empty(Shape{blocks}, DType::F32);
          Tensor pc = cpu->empty(Shape{(n + 1) / 2}, DType::U8), ac = cpu->empty(Shape{blocks}, DType::F32);
          gpu->quantize_4bit(gpu->default_stream(), wg, blocksize, type, pg, ag);
          cpu->quantize_4bit(cpu->default_stream(), wc, blocksize, type, pc, ac);
          EXPECT_EQ(differing_elements(host_bytes(*gpu, pg), host_bytes(*cpu, pc), 1), 0) << "packed bytes";
          const std::vector<uint8_t> absmax = host_bytes(*cpu, ac);
          EXPECT_EQ(differing_elements(host_bytes(*gpu, ag), absmax, 4), 0) << "absmax";
          if (blocksize != 64 || dtype == DType::F64) continue;
          // Double quantisation of these absmax, around their mean formed on the host.
          std::vector<float> host_absmax(static_cast<size_t>(blocks));
          std::memcpy(host_absmax.data(), absmax.data(), absmax.size());
          const float offset = quant4::absmax_mean(host_absmax.data(), blocks);
          const int64_t blocks2 = quant4::num_blocks(blocks, quant4::kNestedBlocksize);
          Tensor cg = gpu->empty(Shape{blocks}, DType::U8), a2g = gpu->empty(Shape{blocks2}, DType::F32);
          Tensor cc = cpu->empty(Shape{blocks}, DType::U8), a2c = cpu->empty(Shape{blocks2}, DType::F32);
          gpu->quantize_absmax(gpu->default_stream(), ag, map_gpu, offset, quant4::kNestedBlocksize, cg, a2g);
          cpu->quantize_absmax(cpu->default_stream(), ac, map_cpu, offset, quant4::kNestedBlocksize, cc, a2c);
          EXPECT_EQ(differing_elements(host_bytes(*gpu, cg), host_bytes(*cpu, cc), 1), 0) << "codes";
          EXPECT_EQ(differing_elements(host_bytes(*gpu, a2g), host_bytes(*cpu, a2c), 4), 0) << "nested absmax";
        }
}

}  // namespace
