// The CUDA backend's state-passing gated delta rule (gated_delta_rule_forward_states /
// _backward_states, what ring sequence parallelism runs for Gated DeltaNet layers) against the CPU
// reference in F64: outputs and final states, then every gradient and ∂L/∂(initial states), on runs
// of several lengths (one token, a run across many 64-token segments of the backward), random
// entering states, GQA heads, head dims from tiny to Qwen3.6's 128; F32 and BF16 inputs, rounded to
// the GPU dtype first. A run_ids that does not hold as many runs as the states is reported.
// Skipped without a CUDA device.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/op_test_util.h"
#include "core/error.h"

using namespace spindle;
using namespace spindle::test;

namespace {

double round_to(DType t, double v) {
  return t == DType::BF16 ? bf16_to_f32(f32_to_bf16(static_cast<float>(v))) : static_cast<float>(v);
}

struct Case {
  int64_t hk, hv, dk, dv;
  std::vector<int> lengths;  // run lengths, ids 0, 1, ...
};

struct HostInputs {
  int64_t tokens = 0, runs = 0;
  std::vector<double> q, k, v, g, beta, initial, dout, d_final;
  std::vector<int> ids;
};

// Unit-norm q and k rows (as the model's l2norm makes them: larger keys would make I − β·k·kᵀ
// expand the state), slow decays so the entering state reaches the end of a run, values in the
// GPU dtype.
HostInputs draw(const Case& c, DType t, std::mt19937_64& rng) {
  HostInputs in;
  for (size_t r = 0; r < c.lengths.size(); ++r) in.ids.insert(in.ids.end(), c.lengths[r], static_cast<int>(r));
  in.tokens = static_cast<int64_t>(in.ids.size());
  in.runs = static_cast<int64_t>(c.lengths.size());
  std::uniform_real_distribution<double> unit(-1.0, 1.0), decay(-0.2, -0.005), strength(0.1, 0.9);
  auto unit_rows = [&](int64_t rows, int64_t d) {
    std::vector<double> x(static_cast<size_t>(rows * d));
    for (int64_t r = 0; r < rows; ++r) {
      double norm = 0;
      for (int64_t e = 0; e < d; ++e) norm += std::pow(x[r * d + e] = unit(rng), 2);
      for (int64_t e = 0; e < d; ++e) x[r * d + e] = round_to(t, x[r * d + e] / std::sqrt(norm));
    }
    return x;
  };
  auto uniform = [&](int64_t n, DType dt) {
    std::vector<double> x(static_cast<size_t>(n));
    for (double& e : x) e = round_to(dt, unit(rng));
    return x;
  };
  in.q = unit_rows(in.tokens * c.hk, c.dk);
  in.k = unit_rows(in.tokens * c.hk, c.dk);
  in.v = uniform(in.tokens * c.hv * c.dv, t);
  in.g.resize(static_cast<size_t>(in.tokens * c.hv));
  in.beta.resize(in.g.size());
  for (double& x : in.g) x = static_cast<float>(decay(rng));
  for (double& x : in.beta) x = round_to(t, strength(rng));
  in.initial = uniform(in.runs * c.hv * c.dk * c.dv, DType::F32);
  in.dout = uniform(in.tokens * c.hv * c.dv, t);
  in.d_final = uniform(in.runs * c.hv * c.dk * c.dv, DType::F32);
  return in;
}

struct Results {
  std::vector<double> out, finals, dq, dk, dv, dg, dbeta, d_initial;
};

// Forward and backward on `be` with inputs of dtype t (states and g: F32 on the GPU, F64 on the CPU).
Results run(Backend& be, const Case& c, const HostInputs& in, DType t, DType stat) {
  auto up = [&](const std::vector<double>& x, Shape s, DType dt) {
    Tensor y = be.empty(s, dt);
    from_host(be, x, y);
    return y;
  };
  const Shape qs{in.tokens, c.hk, c.dk}, vs{in.tokens, c.hv, c.dv}, gs{in.tokens, c.hv}, ss{in.runs, c.hv, c.dk, c.dv};
  Tensor q = up(in.q, qs, t), k = up(in.k, qs, t), v = up(in.v, vs, t), g = up(in.g, gs, stat);
  Tensor beta = up(in.beta, gs, t), initial = up(in.initial, ss, stat), ids = int_tensor(be, in.ids);
  const double scale = 1.0 / std::sqrt(static_cast<double>(c.dk));
  Stream st = be.default_stream();
  Tensor out = be.empty(vs, t), finals = be.empty(ss, stat);
  if (be.device().kind != DeviceKind::CPU) {
    be.fill(st, out, std::nan(""));
    be.fill(st, finals, std::nan(""));
  }
  be.gated_delta_rule_forward_states(st, q, k, v, g, beta, ids, scale, 64, initial, out, finals);
  Tensor dq = be.empty(qs, t), dk = be.empty(qs, t), dv = be.empty(vs, t), dg = be.empty(gs, stat);
  Tensor dbeta = be.empty(gs, t), d_initial = be.empty(ss, stat);
  if (be.device().kind != DeviceKind::CPU)
    for (Tensor* x : {&dq, &dk, &dv, &dg, &dbeta, &d_initial}) be.fill(st, *x, std::nan(""));
  be.gated_delta_rule_backward_states(st, q, k, v, g, beta, ids, scale, 64, initial, up(in.dout, vs, t),
                                      up(in.d_final, ss, stat), dq, dk, dv, dg, dbeta, d_initial);
  return {to_host(be, out), to_host(be, finals), to_host(be, dq),    to_host(be, dk),
          to_host(be, dv),  to_host(be, dg),     to_host(be, dbeta), to_host(be, d_initial)};
}

class CudaDeltaStates : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
    gpu = make_cuda_backend(0);
  }
  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> gpu;
  std::mt19937_64 rng{20261202};
};

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaDeltaStates, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST_P(CudaDeltaStates, ForwardAndBackwardMatchCpu) {
  const DType t = GetParam();
  // Stored BF16 results round once (2^-9 relative); F32 ones differ only in the order of F32 sums.
  const double tol = t == DType::F32 ? 1e-4 : 1e-2;
  const std::vector<Case> cases = {
      {2, 4, 8, 16, {37, 1, 90, 64}},     // runs inside, at and across a segment; a one-token run
      {1, 2, 16, 16, {200}},              // one run of several segments
      {2, 4, 128, 128, {150, 70}},        // Qwen3.6's DeltaNet head dims
      {2, 2, 32, 32, {5, 6, 7, 8, 9, 10}},  // more runs than blocks per head
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(testing::Message() << "Hk " << c.hk << " Hv " << c.hv << " dk " << c.dk << " dv " << c.dv << " runs "
                                    << c.lengths.size() << " " << dtype_name(t));
    const HostInputs in = draw(c, t, rng);
    const Results want = run(*cpu, c, in, DType::F64, DType::F64), got = run(*gpu, c, in, t, DType::F32);
    expect_close(got.out, want.out, tol, "out");
    expect_close(got.finals, want.finals, 1e-4, "final states");
    expect_close(got.dq, want.dq, tol, "dq");
    expect_close(got.dk, want.dk, tol, "dk");
    expect_close(got.dv, want.dv, tol, "dv");
    expect_close(got.dg, want.dg, 1e-3, "dg");
    expect_close(got.dbeta, want.dbeta, tol, "dbeta");
    expect_close(got.d_initial, want.d_initial, 1e-4, "d_initial_states");
  }
}

TEST_F(CudaDeltaStates, RunCountThatDoesNotMatchTheStatesIsReported) {
  const Case c{1, 1, 8, 8, {10, 12}};
  const HostInputs in = draw(c, DType::F32, rng);
  Stream st = gpu->default_stream();
  Tensor q = gpu->empty(Shape{in.tokens, 1, 8}, DType::F32), v = gpu->empty(Shape{in.tokens, 1, 8}, DType::F32);
  Tensor g = gpu->empty(Shape{in.tokens, 1}, DType::F32), beta = gpu->empty(Shape{in.tokens, 1}, DType::F32);
  for (Tensor* x : {&q, &v, &g, &beta}) gpu->fill(st, *x, 0.0);
  Tensor ids = int_tensor(*gpu, in.ids);
  Tensor three = gpu->zeros(Shape{3, 1, 8, 8}, DType::F32), finals = gpu->empty(Shape{3, 1, 8, 8}, DType::F32);
  Tensor out = gpu->empty(v.shape(), DType::F32);
  gpu->gated_delta_rule_forward_states(st, q, q, v, g, beta, ids, 1.0, 64, three, out, finals);
  try {
    gpu->synchronize(st);
    FAIL() << "states for 3 runs were accepted for 2";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("2 runs"), std::string::npos) << e.what();
  }
  Tensor bf16_states = gpu->empty(Shape{2, 1, 8, 8}, DType::BF16);  // states are F32 on this backend
  EXPECT_THROW(gpu->gated_delta_rule_forward_states(st, q, q, v, g, beta, ids, 1.0, 64, bf16_states, out, finals),
               Error);
}

}  // namespace
