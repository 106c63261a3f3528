// gpt_oss's clamped SwiGLU over interleaved gate/up columns: the forward against the formula of
// transformers' GptOssExperts, written out per element, and the backward against central finite
// differences in F64, with inputs on both sides of the clamps.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

namespace {

constexpr double kAlpha = 1.702, kLimit = 7.0;

// Values spread over ±12 and kept 1e-3 away from ±limit, where the finite differences would
// straddle a clamp's kink.
Tensor spread_across_the_clamps(Backend& be, Shape shape, std::mt19937_64& rng) {
  Tensor t = random_tensor(be, shape, DType::F64, rng, 12.0);
  std::vector<double> v = to_host(be, t);
  for (double& x : v)
    if (std::fabs(std::fabs(x) - kLimit) < 1e-3) x += 0.01;
  from_host(be, v, t);
  return t;
}

}  // namespace

TEST(ClampedSwiglu, ForwardIsTransformersFormulaOnInterleavedColumns) {
  auto be = make_cpu_backend();
  const Stream st = be->default_stream();
  std::mt19937_64 rng(29);
  const int64_t rows = 6, width = 5;
  Tensor gate_up = spread_across_the_clamps(*be, Shape{rows, 2 * width}, rng);  // [N, 2I]
  Tensor out = be->empty(Shape{rows, width}, DType::F64);                       // [N, I]
  be->clamped_swiglu_forward(st, gate_up, kAlpha, kLimit, out);
  const auto gu = to_host(*be, gate_up), o = to_host(*be, out);
  int clamped_gates = 0, clamped_ups = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t k = 0; k < width; ++k) {
      const double gate = gu[static_cast<size_t>(r * 2 * width + 2 * k)];
      const double up = gu[static_cast<size_t>(r * 2 * width + 2 * k + 1)];
      clamped_gates += gate > kLimit;
      clamped_ups += std::fabs(up) > kLimit;
      const double g = gate > kLimit ? kLimit : gate;
      const double u = up > kLimit ? kLimit : (up < -kLimit ? -kLimit : up);
      const double glu = g * (1.0 / (1.0 + std::exp(-g * kAlpha)));
      EXPECT_NEAR(o[static_cast<size_t>(r * width + k)], (u + 1.0) * glu, 1e-13) << r << "," << k;
    }
  // The draw crosses every clamp, so each branch of the formula is exercised.
  EXPECT_GT(clamped_gates, 0);
  EXPECT_GT(clamped_ups, 0);
}

TEST(ClampedSwiglu, BackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const Stream st = be->default_stream();
  std::mt19937_64 rng(31);
  const int64_t rows = 5, width = 4;
  Tensor gate_up = spread_across_the_clamps(*be, Shape{rows, 2 * width}, rng);  // [N, 2I]
  Tensor proj = random_tensor(*be, Shape{rows, width}, DType::F64, rng);       // [N, I]
  Tensor out = be->empty(Shape{rows, width}, DType::F64);
  auto objective = [&] {
    be->clamped_swiglu_forward(st, gate_up, kAlpha, kLimit, out);
    return dot(*be, out, proj);
  };
  Tensor d_gate_up = be->empty(gate_up.shape(), DType::F64);
  be->clamped_swiglu_backward(st, gate_up, proj, kAlpha, kLimit, d_gate_up);
  expect_gradient(*be, gate_up, objective, d_gate_up, 1e-7, "d_gate_up");
  // A clamped input passes no gradient.
  const auto gu = to_host(*be, gate_up), d = to_host(*be, d_gate_up);
  for (size_t i = 0; i < gu.size(); ++i) {
    const bool gate = i % 2 == 0;
    if ((gate && gu[i] > kLimit) || (!gate && std::fabs(gu[i]) > kLimit)) EXPECT_EQ(d[i], 0.0) << i;
  }
}

TEST(ClampedSwiglu, F32MatchesF64RoundedOnce) {
  auto be = make_cpu_backend();
  const Stream st = be->default_stream();
  std::mt19937_64 rng(37);
  const int64_t rows = 4, width = 3;
  Tensor gate_up64 = spread_across_the_clamps(*be, Shape{rows, 2 * width}, rng);
  Tensor gate_up32 = be->empty(gate_up64.shape(), DType::F32);
  be->copy(st, gate_up64, gate_up32);
  Tensor gate_up = be->empty(gate_up64.shape(), DType::F64);  // the F32 inputs, widened
  be->copy(st, gate_up32, gate_up);
  Tensor out64 = be->empty(Shape{rows, width}, DType::F64), out32 = be->empty(Shape{rows, width}, DType::F32);
  be->clamped_swiglu_forward(st, gate_up, kAlpha, kLimit, out64);
  be->clamped_swiglu_forward(st, gate_up32, kAlpha, kLimit, out32);
  const auto want = to_host(*be, out64), got = to_host(*be, out32);
  for (size_t i = 0; i < want.size(); ++i) EXPECT_EQ(got[i], static_cast<double>(static_cast<float>(want[i]))) << i;
}
