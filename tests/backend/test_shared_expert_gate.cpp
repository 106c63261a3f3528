// The shared expert's sigmoid gate of qwen3_5_moe (out[t] += σ(gate[t])·shared[t], one logit per
// token) and its backward against central finite differences in F64, and the F32 path.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

TEST(SharedExpertGate, AddsTheGatedSharedOutputAndItsBackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const Stream st = be->default_stream();
  std::mt19937_64 rng(17);
  const int64_t tokens = 5, hidden = 6;
  Tensor shared = random_tensor(*be, Shape{tokens, hidden}, DType::F64, rng);
  Tensor gate = random_tensor(*be, Shape{tokens, 1}, DType::F64, rng, 3.0);
  Tensor routed = random_tensor(*be, Shape{tokens, hidden}, DType::F64, rng);
  Tensor proj = random_tensor(*be, Shape{tokens, hidden}, DType::F64, rng);
  Tensor out = be->empty(routed.shape(), DType::F64);
  be->copy(st, routed, out);
  be->shared_expert_gate_forward(st, shared, gate, out);
  const auto s = to_host(*be, shared), g = to_host(*be, gate), r = to_host(*be, routed), o = to_host(*be, out);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      const size_t i = static_cast<size_t>(t * hidden + h);
      EXPECT_NEAR(o[i], r[i] + s[i] / (1.0 + std::exp(-g[t])), 1e-15) << t << "," << h;
    }

  auto objective = [&] {
    be->copy(st, routed, out);
    be->shared_expert_gate_forward(st, shared, gate, out);
    return dot(*be, out, proj);
  };
  Tensor d_shared = be->empty(shared.shape(), DType::F64), d_gate = be->empty(gate.shape(), DType::F64);
  be->shared_expert_gate_backward(st, shared, gate, proj, d_shared, d_gate);
  expect_gradient(*be, shared, objective, d_shared, 1e-8, "d_shared");
  expect_gradient(*be, gate, objective, d_gate, 1e-8, "d_gate");

  // F32: the same values, rounded once.
  Tensor s32 = be->empty(shared.shape(), DType::F32), g32 = be->empty(gate.shape(), DType::F32);
  Tensor o32 = be->empty(routed.shape(), DType::F32);
  be->copy(st, shared, s32);
  be->copy(st, gate, g32);
  be->copy(st, routed, o32);
  be->shared_expert_gate_forward(st, s32, g32, o32);
  const auto o_f32 = to_host(*be, o32);
  const auto s_r = to_host(*be, s32), g_r = to_host(*be, g32);
  std::vector<float> r_r(r.begin(), r.end());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h) {
      const size_t i = static_cast<size_t>(t * hidden + h);
      const double want = static_cast<double>(r_r[i]) + s_r[i] / (1.0 + std::exp(-g_r[t]));
      EXPECT_EQ(o_f32[i], static_cast<double>(static_cast<float>(want))) << i;
    }

  Tensor wrong = be->empty(Shape{tokens, 2}, DType::F64);  // two logits per token
  EXPECT_THROW(be->shared_expert_gate_forward(st, shared, wrong, out), Error);
}
