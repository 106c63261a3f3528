// The CUDA backend's mixture-of-experts ops against the CPU reference (F64) on random inputs:
// router (decisive logits, so both pick the same experts), its backward and statistics, the
// permutation (exact), the combine and its backward, and the grouped expert GEMMs (forward, input
// gradient, weight gradient) over ragged and empty experts — the Hopper kernels against the
// mma.sync ones as well —, and the shared expert's gate. Inputs are
// rounded to the GPU dtype first; overwritten outputs are poisoned with NaN first. Skipped without a
// CUDA device.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/moe.h"
#include "backend/op_test_util.h"
#include "core/error.h"

using namespace spindle;
using namespace spindle::test;

namespace {

double tol_for(DType t) { return t == DType::F32 ? 1e-5 : 1e-2; }

double round_to(DType t, double v) {
  switch (t) {
    case DType::BF16: return bf16_to_f32(f32_to_bf16(static_cast<float>(v)));
    case DType::F32: return static_cast<float>(v);
    default: return v;
  }
}

class CudaMoe : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA MoE tests need a GPU";
    gpu = make_cuda_backend(0);
    gs = gpu->default_stream();
  }

  std::vector<double> rand_values(int64_t n, DType t, double scale = 1.0) {
    std::uniform_real_distribution<double> dist(-scale, scale);
    std::vector<double> v(static_cast<size_t>(n));
    for (double& x : v) {
      do x = round_to(t, dist(rng));
      while (x == 0.0);
    }
    return v;
  }
  Tensor on(Backend& be, const std::vector<double>& v, Shape shape, DType t) {
    Tensor x = be.empty(shape, t);
    from_host(be, v, x);
    return x;
  }
  Tensor poisoned(Shape shape, DType t) {
    Tensor x = gpu->empty(shape, t);
    if (t == DType::I32) gpu->fill(gs, x, -7);
    else gpu->fill(gs, x, std::nan(""));
    return x;
  }
  // k distinct experts per token, drawn from the first `used` of E (the rest stay empty).
  std::vector<int> routing(int64_t tokens, int64_t top_k, int64_t used) {
    std::vector<int> out;
    std::vector<int> all(static_cast<size_t>(used));
    std::iota(all.begin(), all.end(), 0);
    for (int64_t t = 0; t < tokens; ++t) {
      std::shuffle(all.begin(), all.end(), rng);
      out.insert(out.end(), all.begin(), all.begin() + top_k);
    }
    return out;
  }
  // Logits where the top k are k given experts, 0.5 apart and ≥ 1.5 above the rest: both
  // backends select the same experts in the same order.
  std::vector<double> decisive_logits(int64_t tokens, int64_t experts, int64_t top_k, DType t,
                                      std::vector<int>& expected) {
    std::vector<double> z = rand_values(tokens * experts, t, 1.0);
    expected = routing(tokens, top_k, experts);
    for (int64_t i = 0; i < tokens; ++i)
      for (int64_t j = 0; j < top_k; ++j)
        z[i * experts + expected[i * top_k + j]] = round_to(t, 2.5 + 0.5 * static_cast<double>(top_k - j));
    return z;
  }

  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> gpu;
  Stream gs, cs{};
  std::mt19937_64 rng{20261202};
};

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaMoe, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST_P(CudaMoe, RouterForwardPicksTheCpuExpertsWithTheCpuWeights) {
  const DType t = GetParam();
  struct Case {
    int64_t tokens, experts, top_k;
  };
  for (const Case c : {Case{37, 8, 2}, Case{300, 128, 8}, Case{129, 256, 8}, Case{5, 64, 40}})
    for (bool normalize : {true, false}) {
      SCOPED_TRACE(testing::Message() << "T " << c.tokens << " E " << c.experts << " k " << c.top_k << " normalize "
                                      << normalize);
      std::vector<int> expected;
      const auto z = decisive_logits(c.tokens, c.experts, c.top_k, t, expected);
      Tensor gz = on(*gpu, z, Shape{c.tokens, c.experts}, t);
      Tensor probs = poisoned(Shape{c.tokens, c.experts}, DType::F32);
      Tensor index = poisoned(Shape{c.tokens, c.top_k}, DType::I32);
      Tensor weight = poisoned(Shape{c.tokens, c.top_k}, DType::F32);
      gpu->moe_router_forward(gs, gz, c.top_k, normalize, probs, index, weight);
      Tensor cz = on(*cpu, z, Shape{c.tokens, c.experts}, DType::F64);
      Tensor cprobs = cpu->empty(Shape{c.tokens, c.experts}, DType::F64);
      Tensor cindex = cpu->empty(Shape{c.tokens, c.top_k}, DType::I32);
      Tensor cweight = cpu->empty(Shape{c.tokens, c.top_k}, DType::F64);
      cpu->moe_router_forward(cs, cz, c.top_k, normalize, cprobs, cindex, cweight);
      const auto got_index = to_host(*gpu, index), want_index = to_host(*cpu, cindex);
      ASSERT_EQ(got_index, want_index);
      for (size_t i = 0; i < expected.size(); ++i) ASSERT_EQ(got_index[i], expected[i]) << i;
      expect_close(to_host(*gpu, probs), to_host(*cpu, cprobs), 1e-5, "probs");
      expect_close(to_host(*gpu, weight), to_host(*cpu, cweight), 1e-5, "topk_weight");
    }
}

TEST_P(CudaMoe, RouterBackwardAndStatisticsMatchCpu) {
  const DType t = GetParam();
  const int64_t tokens = 203, experts = 128, top_k = 8;
  std::vector<int> expected;
  const auto z = decisive_logits(tokens, experts, top_k, t, expected);
  // The forward on the CPU; its F32-rounded probabilities feed both backends.
  Tensor cz = on(*cpu, z, Shape{tokens, experts}, DType::F64);
  Tensor cprobs = cpu->empty(Shape{tokens, experts}, DType::F64);
  Tensor cindex = cpu->empty(Shape{tokens, top_k}, DType::I32);
  Tensor cweight = cpu->empty(Shape{tokens, top_k}, DType::F64);
  cpu->moe_router_forward(cs, cz, top_k, true, cprobs, cindex, cweight);
  auto probs = to_host(*cpu, cprobs);
  for (double& p : probs) p = static_cast<float>(p);
  std::vector<int> index;
  for (double v : to_host(*cpu, cindex)) index.push_back(static_cast<int>(v));
  const auto dw = rand_values(tokens * top_k, DType::F32);
  const auto aux = rand_values(experts, DType::F32, 0.1);
  std::vector<int> docs(static_cast<size_t>(tokens));
  for (int64_t i = 0; i < tokens; ++i) docs[i] = i % 17 == 16 ? -1 : static_cast<int>(i / 50);

  Tensor gprobs = on(*gpu, probs, Shape{tokens, experts}, DType::F32);
  Tensor gindex = int_tensor(*gpu, index);
  Tensor gindex2 = gpu->empty(Shape{tokens, top_k}, DType::I32);
  gpu->copy(gs, gindex, gindex2);
  Tensor cindex2 = int_tensor(*cpu, index);
  Tensor cindex_2d = cpu->empty(Shape{tokens, top_k}, DType::I32);
  cpu->copy(cs, cindex2, cindex_2d);
  Tensor cprobs_r = on(*cpu, probs, Shape{tokens, experts}, DType::F64);
  for (bool normalize : {true, false})
    for (bool with_aux : {true, false}) {
      SCOPED_TRACE(testing::Message() << "normalize " << normalize << " aux " << with_aux);
      Tensor gdl = poisoned(Shape{tokens, experts}, t);
      gpu->moe_router_backward(gs, gprobs, gindex2, on(*gpu, dw, Shape{tokens, top_k}, DType::F32), normalize,
                               with_aux ? on(*gpu, aux, Shape{experts}, DType::F32) : Tensor(),
                               with_aux ? int_tensor(*gpu, docs) : Tensor(), gdl);
      Tensor cdl = cpu->empty(Shape{tokens, experts}, DType::F64);
      cpu->moe_router_backward(cs, cprobs_r, cindex_2d, on(*cpu, dw, Shape{tokens, top_k}, DType::F64), normalize,
                               with_aux ? on(*cpu, aux, Shape{experts}, DType::F64) : Tensor(),
                               with_aux ? int_tensor(*cpu, docs) : Tensor(), cdl);
      expect_close(to_host(*gpu, gdl), to_host(*cpu, cdl), tol_for(t), "dlogits");
    }
  // Statistics add onto what the tensors hold.
  std::vector<double> counts0(static_cast<size_t>(experts)), sums0 = rand_values(experts, DType::F32);
  for (int64_t e = 0; e < experts; ++e) counts0[e] = static_cast<double>(e % 5);
  for (bool with_docs : {true, false}) {
    Tensor gcounts = on(*gpu, counts0, Shape{experts}, DType::F32), gsums = on(*gpu, sums0, Shape{experts}, DType::F32);
    gpu->moe_router_statistics(gs, gprobs, gindex2, with_docs ? int_tensor(*gpu, docs) : Tensor(), gcounts, gsums);
    Tensor ccounts = on(*cpu, counts0, Shape{experts}, DType::F64), csums = on(*cpu, sums0, Shape{experts}, DType::F64);
    cpu->moe_router_statistics(cs, cprobs_r, cindex_2d, with_docs ? int_tensor(*cpu, docs) : Tensor(), ccounts, csums);
    EXPECT_EQ(to_host(*gpu, gcounts), to_host(*cpu, ccounts));
    expect_close(to_host(*gpu, gsums), to_host(*cpu, csums), 1e-6, "prob_sums");
  }
}

TEST_P(CudaMoe, PermutationIsExactlyTheCpuOrder) {
  struct Case {
    int64_t tokens, experts, top_k, used;
  };
  // used < experts leaves the last experts empty; the shuffle leaves others empty at random.
  for (const Case c : {Case{1, 4, 1, 4}, Case{50, 16, 2, 11}, Case{1000, 128, 8, 128}, Case{16384, 256, 8, 256},
                       Case{3, 256, 8, 9}}) {
    SCOPED_TRACE(testing::Message() << "T " << c.tokens << " E " << c.experts << " k " << c.top_k);
    auto index = routing(c.tokens, c.top_k, c.used);
    if (c.used > 2)  // expert 0 empty too: every routed 0 becomes 1 where that stays distinct
      for (int64_t t = 0; t < c.tokens; ++t) {
        int* row = index.data() + t * c.top_k;
        if (std::find(row, row + c.top_k, 1) == row + c.top_k)
          std::replace(row, row + c.top_k, 0, 1);
      }
    const int64_t n = c.tokens * c.top_k;
    Tensor gflat = int_tensor(*gpu, index), gidx = gpu->empty(Shape{c.tokens, c.top_k}, DType::I32);
    gpu->copy(gs, gflat, gidx);
    Tensor rows_token = poisoned(Shape{n}, DType::I32), row_of_slot = poisoned(Shape{n}, DType::I32);
    Tensor offsets = poisoned(Shape{c.experts + 1}, DType::I32);
    gpu->moe_permute(gs, gidx, c.experts, rows_token, row_of_slot, offsets);
    Tensor cflat = int_tensor(*cpu, index), cidx = cpu->empty(Shape{c.tokens, c.top_k}, DType::I32);
    cpu->copy(cs, cflat, cidx);
    Tensor crt = cpu->empty(Shape{n}, DType::I32), cros = cpu->empty(Shape{n}, DType::I32);
    Tensor coff = cpu->empty(Shape{c.experts + 1}, DType::I32);
    cpu->moe_permute(cs, cidx, c.experts, crt, cros, coff);
    EXPECT_EQ(to_host(*gpu, rows_token), to_host(*cpu, crt));
    EXPECT_EQ(to_host(*gpu, row_of_slot), to_host(*cpu, cros));
    EXPECT_EQ(to_host(*gpu, offsets), to_host(*cpu, coff));
  }
}

TEST_F(CudaMoe, PermutationReportsAnExpertOutOfRange) {
  Tensor flat = int_tensor(*gpu, {0, 1, 2, 4}), idx = gpu->empty(Shape{2, 2}, DType::I32);
  gpu->copy(gs, flat, idx);
  Tensor a = gpu->empty(Shape{4}, DType::I32), b = gpu->empty(Shape{4}, DType::I32), off = gpu->empty(Shape{5}, DType::I32);
  Tensor off_small = gpu->empty(Shape{4}, DType::I32);
  gpu->moe_permute(gs, idx, 4, a, b, off);
  try {
    gpu->synchronize(gs);
    FAIL() << "expert 4 of 4 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert 4"), std::string::npos) << e.what();
  }
  EXPECT_THROW(gpu->moe_permute(gs, idx, 4, a, b, off_small), Error);  // offsets [4] for 4 experts
}

TEST_P(CudaMoe, CombineAndBackwardMatchCpu) {
  const DType t = GetParam();
  for (const int64_t hidden : {int64_t{2048}, int64_t{37}}) {
    SCOPED_TRACE(testing::Message() << "H " << hidden);
    const int64_t tokens = 97, experts = 32, top_k = 8, n = tokens * top_k;
    const auto index = routing(tokens, top_k, experts);
    Tensor cflat = int_tensor(*cpu, index), cidx = cpu->empty(Shape{tokens, top_k}, DType::I32);
    cpu->copy(cs, cflat, cidx);
    Tensor crt = cpu->empty(Shape{n}, DType::I32), cros = cpu->empty(Shape{n}, DType::I32);
    Tensor coff = cpu->empty(Shape{experts + 1}, DType::I32);
    cpu->moe_permute(cs, cidx, experts, crt, cros, coff);
    std::vector<int> row_of_slot;
    for (double v : to_host(*cpu, cros)) row_of_slot.push_back(static_cast<int>(v));
    Tensor gflat = int_tensor(*gpu, index), gidx = gpu->empty(Shape{tokens, top_k}, DType::I32);
    gpu->copy(gs, gflat, gidx);
    Tensor gros = int_tensor(*gpu, row_of_slot);

    const auto y = rand_values(n * hidden, t), w = rand_values(tokens * top_k, DType::F32),
               dout = rand_values(tokens * hidden, t);
    Tensor gout = poisoned(Shape{tokens, hidden}, t);
    gpu->moe_combine(gs, on(*gpu, y, Shape{n, hidden}, t), gros, gidx, on(*gpu, w, Shape{tokens, top_k}, DType::F32),
                     gout);
    Tensor cout_ = cpu->empty(Shape{tokens, hidden}, DType::F64);
    cpu->moe_combine(cs, on(*cpu, y, Shape{n, hidden}, DType::F64), cros, cidx,
                     on(*cpu, w, Shape{tokens, top_k}, DType::F64), cout_);
    expect_close(to_host(*gpu, gout), to_host(*cpu, cout_), tol_for(t), "combine");

    Tensor gdy = poisoned(Shape{n, hidden}, t), gdw = poisoned(Shape{tokens, top_k}, DType::F32);
    gpu->moe_combine_backward(gs, on(*gpu, dout, Shape{tokens, hidden}, t), on(*gpu, y, Shape{n, hidden}, t), gros,
                              on(*gpu, w, Shape{tokens, top_k}, DType::F32), gdy, gdw);
    Tensor cdy = cpu->empty(Shape{n, hidden}, DType::F64), cdw = cpu->empty(Shape{tokens, top_k}, DType::F64);
    cpu->moe_combine_backward(cs, on(*cpu, dout, Shape{tokens, hidden}, DType::F64),
                              on(*cpu, y, Shape{n, hidden}, DType::F64), cros,
                              on(*cpu, w, Shape{tokens, top_k}, DType::F64), cdy, cdw);
    expect_close(to_host(*gpu, gdy), to_host(*cpu, cdy), tol_for(t), "combine dy");
    // The dot products sum `hidden` BF16 products in F32: relative 1e-5 of each, far below BF16 rounding.
    expect_close(to_host(*gpu, gdw), to_host(*cpu, cdw), 1e-5, "combine d_topk_weight");
  }
}

// The shared expert's gate on several T and H: H a multiple of 8 (16-byte vectors), odd H (one
// element at a time), a single token; logits wide enough to reach both tails of the sigmoid. The
// forward adds onto random values; the backward's outputs are poisoned first.
TEST_P(CudaMoe, SharedExpertGateAndBackwardMatchCpu) {
  const DType t = GetParam();
  struct Case {
    int64_t tokens, hidden;
  };
  for (const Case c : {Case{97, 2048}, Case{1000, 256}, Case{33, 37}, Case{1, 8}, Case{260, 1}}) {
    SCOPED_TRACE(testing::Message() << "T " << c.tokens << " H " << c.hidden);
    const Shape rows{c.tokens, c.hidden}, logits{c.tokens, 1};
    const auto shared = rand_values(c.tokens * c.hidden, t), base = rand_values(c.tokens * c.hidden, t),
               gate = rand_values(c.tokens, t, 6.0), dout = rand_values(c.tokens * c.hidden, t);
    Tensor gout = on(*gpu, base, rows, t);
    gpu->shared_expert_gate_forward(gs, on(*gpu, shared, rows, t), on(*gpu, gate, logits, t), gout);
    Tensor cout_ = on(*cpu, base, rows, DType::F64);
    cpu->shared_expert_gate_forward(cs, on(*cpu, shared, rows, DType::F64), on(*cpu, gate, logits, DType::F64), cout_);
    expect_close(to_host(*gpu, gout), to_host(*cpu, cout_), tol_for(t), "out");

    Tensor gds = poisoned(rows, t), gdg = poisoned(logits, t);
    gpu->shared_expert_gate_backward(gs, on(*gpu, shared, rows, t), on(*gpu, gate, logits, t), on(*gpu, dout, rows, t),
                                     gds, gdg);
    Tensor cds = cpu->empty(rows, DType::F64), cdg = cpu->empty(logits, DType::F64);
    cpu->shared_expert_gate_backward(cs, on(*cpu, shared, rows, DType::F64), on(*cpu, gate, logits, DType::F64),
                                     on(*cpu, dout, rows, DType::F64), cds, cdg);
    expect_close(to_host(*gpu, gds), to_host(*cpu, cds), tol_for(t), "d_shared");
    // The dot products are summed in F32 whatever the storage: F32 within 1e-5; BF16 rounds the result.
    expect_close(to_host(*gpu, gdg), to_host(*cpu, cdg), t == DType::F32 ? 1e-5 : 5e-3, "d_gate");
  }
}

TEST_F(CudaMoe, SharedExpertGateRejectsMismatchedShapes) {
  Tensor shared = gpu->empty(Shape{4, 16}, DType::BF16), out = gpu->empty(Shape{4, 16}, DType::BF16);
  Tensor gate3 = gpu->empty(Shape{3, 1}, DType::BF16), gate_f32 = gpu->empty(Shape{4, 1}, DType::F32);
  EXPECT_THROW(gpu->shared_expert_gate_forward(gs, shared, gate3, out), Error);     // 3 logits for 4 tokens
  EXPECT_THROW(gpu->shared_expert_gate_forward(gs, shared, gate_f32, out), Error);  // mixed dtypes
  Tensor gate = gpu->empty(Shape{4, 1}, DType::BF16), d_shared = gpu->empty(Shape{4, 8}, DType::BF16);
  EXPECT_THROW(gpu->shared_expert_gate_backward(gs, shared, gate, out, d_shared, gate3), Error);
}

// Expert row counts with empty experts, one-row experts, a tail under one tile and experts
// above one tile (128 rows) with ragged ends.
std::vector<int> ragged_offsets(int64_t experts, std::mt19937_64& rng) {
  std::vector<int> counts(static_cast<size_t>(experts));
  std::uniform_int_distribution<int> small(0, 40), large(129, 300);
  for (int64_t e = 0; e < experts; ++e) counts[e] = e % 4 == 0 ? 0 : e % 4 == 1 ? large(rng) : e % 4 == 2 ? 1 : small(rng);
  std::vector<int> offsets{0};
  for (int c : counts) offsets.push_back(offsets.back() + c);
  return offsets;
}

TEST_P(CudaMoe, GroupedGemmsMatchCpuOverRaggedAndEmptyExperts) {
  const DType t = GetParam();
  struct Case {
    int64_t experts, in, out;
  };
  // 96 × 136: the tensor-core kernel with a column tail; 36 × 20: sizes it does not take.
  for (const Case c : {Case{9, 96, 136}, Case{6, 36, 20}, Case{130, 64, 48}}) {
    SCOPED_TRACE(testing::Message() << "E " << c.experts << " in " << c.in << " out " << c.out);
    const auto offsets = ragged_offsets(c.experts, rng);
    const int64_t rows = offsets.back();
    Tensor goff = int_tensor(*gpu, offsets), coff = int_tensor(*cpu, offsets);
    std::vector<Tensor> gw, cw;
    for (int64_t e = 0; e < c.experts; ++e) {
      const auto w = rand_values(c.out * c.in, t);
      gw.push_back(on(*gpu, w, Shape{c.out, c.in}, t));
      cw.push_back(on(*cpu, w, Shape{c.out, c.in}, DType::F64));
    }
    const auto x = rand_values(rows * c.in, t), dy = rand_values(rows * c.out, t), base = rand_values(rows * c.in, t);
    // Forward: y = x·W_eᵀ.
    Tensor gy = poisoned(Shape{rows, c.out}, t);
    gpu->moe_grouped_gemm(gs, on(*gpu, x, Shape{rows, c.in}, t), gw, true, goff, gy, false);
    Tensor cy = cpu->empty(Shape{rows, c.out}, DType::F64);
    cpu->moe_grouped_gemm(cs, on(*cpu, x, Shape{rows, c.in}, DType::F64), cw, true, coff, cy, false);
    expect_close(to_host(*gpu, gy), to_host(*cpu, cy), tol_for(t), "forward");
    // Input gradient, accumulated onto `base`: dx += dy·W_e.
    Tensor gdx = on(*gpu, base, Shape{rows, c.in}, t);
    gpu->moe_grouped_gemm(gs, on(*gpu, dy, Shape{rows, c.out}, t), gw, false, goff, gdx, true);
    Tensor cdx = on(*cpu, base, Shape{rows, c.in}, DType::F64);
    cpu->moe_grouped_gemm(cs, on(*cpu, dy, Shape{rows, c.out}, DType::F64), cw, false, coff, cdx, true);
    expect_close(to_host(*gpu, gdx), to_host(*cpu, cdx), tol_for(t), "input gradient");
    // Weight gradients onto random starting values, in the compute dtype and (BF16) in F32; one
    // expert frozen.
    for (DType grad : t == DType::BF16 ? std::vector<DType>{DType::BF16, DType::F32} : std::vector<DType>{DType::F32}) {
      std::vector<Tensor> gdw, cdw;
      std::vector<std::vector<double>> start;
      for (int64_t e = 0; e < c.experts; ++e) {
        start.push_back(rand_values(c.out * c.in, grad));
        const bool frozen = e == 1;
        gdw.push_back(frozen ? Tensor() : on(*gpu, start.back(), Shape{c.out, c.in}, grad));
        cdw.push_back(frozen ? Tensor() : on(*cpu, start.back(), Shape{c.out, c.in}, DType::F64));
      }
      gpu->moe_grouped_gemm_weight_grad(gs, on(*gpu, dy, Shape{rows, c.out}, t), on(*gpu, x, Shape{rows, c.in}, t),
                                        goff, gdw);
      cpu->moe_grouped_gemm_weight_grad(cs, on(*cpu, dy, Shape{rows, c.out}, DType::F64),
                                        on(*cpu, x, Shape{rows, c.in}, DType::F64), coff, cdw);
      for (int64_t e = 0; e < c.experts; ++e) {
        if (e == 1) continue;
        SCOPED_TRACE(testing::Message() << "expert " << e << " grad " << dtype_name(grad));
        expect_close(to_host(*gpu, gdw[e]), to_host(*cpu, cdw[e]), grad == DType::F32 && t == DType::F32 ? 1e-5 : 1e-2,
                     "weight gradient");
      }
    }
  }
}

// The grouped GEMMs as the routed experts' LoRA pairs call them (model/expert_lora.cpp): A [E·r, in]
// and B [E, out, r] are single tensors whose per-expert weights are row views (B's gate and up halves
// of a fused gate_up tensor: rows begin … end − 1 of each expert), ranks 2 and 4, small experts,
// gradients into views of the gradient tensors in the parameters' dtype (as ModelWeights keeps them):
// xs = x·A_eᵀ, y += xs·B_e[begin:end]ᵀ, dB_e[begin:end] += dyᵀ·xs, dxs = dy·B_e[begin:end],
// dA_e += dxsᵀ·x, dx += dxs·A_e.
TEST_P(CudaMoe, ExpertLoraShapesThroughViewsMatchCpu) {
  const DType t = GetParam();
  struct Case {
    int64_t experts, in, out, rank, begin, end;
  };
  // qwen3_5_moe_expert_lora's gate_up (H 64 -> 2·32, r 4; each half) and down (32 -> 64); qwen3_moe's r 2.
  for (const Case c : {Case{4, 64, 64, 4, 0, 32}, Case{4, 64, 64, 4, 32, 64}, Case{4, 32, 64, 4, 0, 64},
                       Case{8, 48, 64, 2, 32, 64}, Case{8, 32, 48, 2, 0, 48}}) {
    SCOPED_TRACE(testing::Message() << "E " << c.experts << " in " << c.in << " out " << c.out << " r " << c.rank
                                    << " rows " << c.begin << "-" << c.end);
    std::vector<int> offsets{0};
    for (int64_t e = 0; e < c.experts; ++e) offsets.push_back(offsets.back() + static_cast<int>(e == 1 ? 0 : 3 + 5 * e));
    const int64_t rows = offsets.back(), width = c.end - c.begin;
    Tensor goff = int_tensor(*gpu, offsets), coff = int_tensor(*cpu, offsets);
    const auto a = rand_values(c.experts * c.rank * c.in, t), b = rand_values(c.experts * c.out * c.rank, t);
    const auto x = rand_values(rows * c.in, t), dy = rand_values(rows * width, t);
    const auto y0 = rand_values(rows * width, t), dx0 = rand_values(rows * c.in, t);
    struct Side {
      Tensor a, b, da, db, x, dy, xs, y, dxs, dx;
    };
    auto make = [&](Backend& be, DType dt) {
      Side s;
      s.a = on(be, a, Shape{c.experts * c.rank, c.in}, dt);
      s.b = on(be, b, Shape{c.experts, c.out, c.rank}, dt);
      s.da = be.zeros(s.a.shape(), dt);
      s.db = be.zeros(s.b.shape(), dt);
      s.x = on(be, x, Shape{rows, c.in}, dt);
      s.dy = on(be, dy, Shape{rows, width}, dt);
      s.xs = be.empty(Shape{rows, c.rank}, dt);
      s.y = on(be, y0, Shape{rows, width}, dt);
      s.dxs = be.empty(Shape{rows, c.rank}, dt);
      s.dx = on(be, dx0, Shape{rows, c.in}, dt);
      return s;
    };
    auto per_a = [&](const Tensor& m) {
      std::vector<Tensor> v;
      for (int64_t e = 0; e < c.experts; ++e) v.push_back(m.rows(e * c.rank, (e + 1) * c.rank));
      return v;
    };
    auto per_b = [&](const Tensor& m) {
      std::vector<Tensor> v;
      for (int64_t e = 0; e < c.experts; ++e)
        v.push_back(m.flat((e * c.out + c.begin) * c.rank, width * c.rank).reshape(Shape{width, c.rank}));
      return v;
    };
    auto run = [&](Backend& be, Stream st, Side& s, const Tensor& off) {
      be.moe_grouped_gemm(st, s.x, per_a(s.a), true, off, s.xs, false);
      be.moe_grouped_gemm(st, s.xs, per_b(s.b), true, off, s.y, true);
      std::vector<Tensor> db = per_b(s.db), da = per_a(s.da);
      be.moe_grouped_gemm_weight_grad(st, s.dy, s.xs, off, db);
      be.moe_grouped_gemm(st, s.dy, per_b(s.b), false, off, s.dxs, false);
      be.moe_grouped_gemm_weight_grad(st, s.dxs, s.x, off, da);
      be.moe_grouped_gemm(st, s.dxs, per_a(s.a), false, off, s.dx, true);
    };
    Side g = make(*gpu, t), r = make(*cpu, DType::F64);
    run(*gpu, gs, g, goff);
    run(*cpu, cs, r, coff);
    // Each stage runs on its own inputs' rounding: BF16 rounds xs and dxs between the products.
    const double tol = t == DType::F32 ? 1e-5 : 3e-2;
    expect_close(to_host(*gpu, g.xs), to_host(*cpu, r.xs), tol, "xs = x·A_eᵀ");
    expect_close(to_host(*gpu, g.y), to_host(*cpu, r.y), tol, "y += xs·B_eᵀ");
    expect_close(to_host(*gpu, g.db), to_host(*cpu, r.db), tol, "dB_e += dyᵀ·xs");
    expect_close(to_host(*gpu, g.dxs), to_host(*cpu, r.dxs), tol, "dxs = dy·B_e");
    expect_close(to_host(*gpu, g.da), to_host(*cpu, r.da), tol, "dA_e += dxsᵀ·x");
    expect_close(to_host(*gpu, g.dx), to_host(*cpu, r.dx), tol, "dx += dxs·A_e");
  }
}

// Sets SPINDLE_MOE_GEMM for one scope (the grouped GEMM reads it at each call), then restores it.
class MoeGemmKernelEnv {
 public:
  explicit MoeGemmKernelEnv(const char* value) {
    if (const char* old = std::getenv("SPINDLE_MOE_GEMM")) saved_ = old;
    ::setenv("SPINDLE_MOE_GEMM", value, 1);
  }
  ~MoeGemmKernelEnv() {
    if (saved_.empty()) ::unsetenv("SPINDLE_MOE_GEMM");
    else ::setenv("SPINDLE_MOE_GEMM", saved_.c_str(), 1);
  }

 private:
  std::string saved_;
};

bool device_is_hopper() {
  int device = 0, major = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  return major == 9;
}

// Uneven experts as routing makes them: empty ones, one holding most of the rows, one of exactly a
// tile (128) and one a row over, small ones; `scale` multiplies the sizes.
std::vector<int> skewed_offsets(int64_t experts, int scale, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> small(1, 90);
  std::vector<int> offsets{0};
  for (int64_t e = 0; e < experts; ++e) {
    int c = e % 5 == 0 ? 0 : small(rng) * scale;
    if (e == 3) c = 700 * scale;
    if (e == 4) c = 128;
    if (e == 6) c = 129;
    offsets.push_back(offsets.back() + c);
  }
  return offsets;
}

// The Hopper kernels (SPINDLE_MOE_GEMM=wgmma) and the mma.sync ones against the CPU (F64) and each
// other, BF16: the forward (y = x·W_eᵀ, every row written: y starts as NaN), the input gradient
// overwriting (dx = dy·W_e) and accumulating (dx += dy·W_e), and the F32 weight gradient (dW_e += dy_eᵀ·x_e), with k tails (200 = 3·64 + 8), column tails (136, 520), a single
// k step (k 64: the copies run several tiles ahead), more tiles than SMs (each CTA of the
// persistent grid takes several), and 128- and 256-wide tiles (n 256 and above).
TEST_F(CudaMoe, GroupedGemmWgmmaMatchesMmaAndCpu) {
  if (!device_is_hopper()) GTEST_SKIP() << "the wgmma kernel runs on compute capability 9.x only";
  const DType t = DType::BF16;
  struct Case {
    int64_t experts, in, out;
    int scale;
  };
  for (const Case c : {Case{12, 200, 136, 1}, Case{9, 64, 256, 8}, Case{40, 136, 520, 1}, Case{16, 256, 128, 4}}) {
    SCOPED_TRACE(testing::Message() << "E " << c.experts << " in " << c.in << " out " << c.out);
    const auto offsets = skewed_offsets(c.experts, c.scale, rng);
    const int64_t rows = offsets.back();
    Tensor goff = int_tensor(*gpu, offsets), coff = int_tensor(*cpu, offsets);
    std::vector<Tensor> gw, cw;
    for (int64_t e = 0; e < c.experts; ++e) {
      const auto w = rand_values(c.out * c.in, t);
      gw.push_back(on(*gpu, w, Shape{c.out, c.in}, t));
      cw.push_back(on(*cpu, w, Shape{c.out, c.in}, DType::F64));
    }
    const auto x = rand_values(rows * c.in, t), dy = rand_values(rows * c.out, t), base = rand_values(rows * c.in, t);
    Tensor gx = on(*gpu, x, Shape{rows, c.in}, t), gdy = on(*gpu, dy, Shape{rows, c.out}, t);
    Tensor cy = cpu->empty(Shape{rows, c.out}, DType::F64);
    cpu->moe_grouped_gemm(cs, on(*cpu, x, Shape{rows, c.in}, DType::F64), cw, true, coff, cy, false);
    Tensor cdx = on(*cpu, base, Shape{rows, c.in}, DType::F64);
    cpu->moe_grouped_gemm(cs, on(*cpu, dy, Shape{rows, c.out}, DType::F64), cw, false, coff, cdx, true);
    Tensor cdx0 = cpu->empty(Shape{rows, c.in}, DType::F64);
    cpu->moe_grouped_gemm(cs, on(*cpu, dy, Shape{rows, c.out}, DType::F64), cw, false, coff, cdx0, false);
    const std::vector<double> want_y = to_host(*cpu, cy), want_dx = to_host(*cpu, cdx), want_dx0 = to_host(*cpu, cdx0);
    std::vector<double> got_y[2], got_dx[2];
    const char* kernels[2] = {"mma", "wgmma"};
    for (int i = 0; i < 2; ++i) {
      SCOPED_TRACE(kernels[i]);
      MoeGemmKernelEnv env(kernels[i]);
      Tensor gy = poisoned(Shape{rows, c.out}, t);
      gpu->moe_grouped_gemm(gs, gx, gw, true, goff, gy, false);
      got_y[i] = to_host(*gpu, gy);
      expect_close(got_y[i], want_y, tol_for(t), "forward");
      Tensor gdx = on(*gpu, base, Shape{rows, c.in}, t);
      gpu->moe_grouped_gemm(gs, gdy, gw, false, goff, gdx, true);
      got_dx[i] = to_host(*gpu, gdx);
      expect_close(got_dx[i], want_dx, tol_for(t), "input gradient");
      Tensor gdx0 = poisoned(Shape{rows, c.in}, t);  // not accumulating: written whole
      gpu->moe_grouped_gemm(gs, gdy, gw, false, goff, gdx0, false);
      expect_close(to_host(*gpu, gdx0), want_dx0, tol_for(t), "input gradient, overwritten");
    }
    // The Hopper kernel's other epilogues, 128- and 256-wide tiles: the forward stored from
    // registers (the backend stages overwriting calls in shared memory), and the input gradient
    // accumulated through shared memory (the backend accumulates from registers).
    {
      cuda::ExpertPointers table{};
      for (int64_t e = 0; e < c.experts; ++e) table.p[e] = gw[static_cast<size_t>(e)].data();
      for (int tile_n : {128, 256}) {
        SCOPED_TRACE(testing::Message() << "stores from registers, tile " << tile_n);
        Tensor gy = poisoned(Shape{rows, c.out}, t);
        cuda::moe_grouped_gemm_wgmma(static_cast<cudaStream_t>(gs.handle), gx.data(), rows, c.in, table,
                                     static_cast<int>(c.experts), true, goff.data_as<int32_t>(), gy.data(), c.out,
                                     false, tile_n, false);
        expect_close(to_host(*gpu, gy), want_y, tol_for(t), "forward");
      }
      // Accumulating through shared memory in F32 (staged_accumulate) rounds old + new once, as
      // the register stores do: the same bits.
      for (int tile_n : {128, 256}) {
        SCOPED_TRACE(testing::Message() << "accumulating, tile " << tile_n);
        Tensor from_registers = on(*gpu, base, Shape{rows, c.in}, t), staged = on(*gpu, base, Shape{rows, c.in}, t);
        for (bool staged_accumulate : {false, true})
          cuda::moe_grouped_gemm_wgmma(static_cast<cudaStream_t>(gs.handle), gdy.data(), rows, c.out, table,
                                       static_cast<int>(c.experts), false, goff.data_as<int32_t>(),
                                       (staged_accumulate ? staged : from_registers).data(), c.in, true, tile_n, true,
                                       staged_accumulate);
        const std::vector<double> got = to_host(*gpu, staged);
        expect_close(got, want_dx, tol_for(t), "input gradient, staged accumulation");
        EXPECT_EQ(got, to_host(*gpu, from_registers));
      }
    }
    // Both round F32 sums of the same products to BF16: they differ in the last bits only.
    expect_close(got_y[1], got_y[0], 1e-2, "forward, wgmma against mma");
    expect_close(got_dx[1], got_dx[0], 1e-2, "input gradient, wgmma against mma");

    // Weight gradients dW_e += dy_eᵀ·x_e onto random F32 starting values, expert 1 frozen (its
    // null gradient is skipped), by both kernels against the CPU.
    std::vector<std::vector<double>> start;
    std::vector<Tensor> cdw;
    for (int64_t e = 0; e < c.experts; ++e) {
      start.push_back(rand_values(c.out * c.in, DType::F32));
      cdw.push_back(e == 1 ? Tensor() : on(*cpu, start.back(), Shape{c.out, c.in}, DType::F64));
    }
    cpu->moe_grouped_gemm_weight_grad(cs, on(*cpu, dy, Shape{rows, c.out}, DType::F64),
                                      on(*cpu, x, Shape{rows, c.in}, DType::F64), coff, cdw);
    for (int i = 0; i < 2; ++i) {
      SCOPED_TRACE(kernels[i]);
      MoeGemmKernelEnv env(kernels[i]);
      std::vector<Tensor> gdw;
      for (int64_t e = 0; e < c.experts; ++e)
        gdw.push_back(e == 1 ? Tensor() : on(*gpu, start[e], Shape{c.out, c.in}, DType::F32));
      gpu->moe_grouped_gemm_weight_grad(gs, gdy, gx, goff, gdw);
      for (int64_t e = 0; e < c.experts; ++e) {
        if (e == 1) continue;
        SCOPED_TRACE(testing::Message() << "expert " << e);
        expect_close(to_host(*gpu, gdw[e]), to_host(*cpu, cdw[e]), 1e-2, "weight gradient");
      }
    }
  }
}

TEST_F(CudaMoe, GroupedGemmKernelChoiceRejectsUnknownValues) {
  MoeGemmKernelEnv env("cublas");
  const std::vector<int> offsets{0, 3, 5};
  Tensor off = int_tensor(*gpu, offsets);
  Tensor x = gpu->zeros(Shape{5, 64}, DType::BF16), y = gpu->empty(Shape{5, 64}, DType::BF16);
  std::vector<Tensor> w{gpu->zeros(Shape{64, 64}, DType::BF16), gpu->zeros(Shape{64, 64}, DType::BF16)};
  try {
    gpu->moe_grouped_gemm(gs, x, w, true, off, y, false);
    FAIL() << "SPINDLE_MOE_GEMM=cublas was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("auto, mma or wgmma"), std::string::npos) << e.what();
  }
}

TEST_F(CudaMoe, GroupedGemmRejectsMismatchedWeights) {
  const std::vector<int> offsets{0, 3, 5};
  Tensor off = int_tensor(*gpu, offsets);
  Tensor x = gpu->empty(Shape{5, 16}, DType::BF16), y = gpu->empty(Shape{5, 8}, DType::BF16);
  std::vector<Tensor> w{gpu->empty(Shape{8, 16}, DType::BF16), gpu->empty(Shape{16, 8}, DType::BF16)};
  try {
    gpu->moe_grouped_gemm(gs, x, w, true, off, y, false);
    FAIL() << "a transposed expert weight was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expert 1"), std::string::npos) << e.what();
  }
  std::vector<Tensor> three{w[0], w[0], w[0]};
  EXPECT_THROW(gpu->moe_grouped_gemm(gs, x, three, true, off, y, false), Error);  // offsets [3] for 3 experts
}

}  // namespace
