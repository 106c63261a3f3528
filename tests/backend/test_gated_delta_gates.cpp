// The decay and write-strength gates of gated DeltaNet layers on the CPU backend:
// g = −exp(A_log)·softplus(a + dt_bias) (stat dtype), beta = σ(b).
#include <gtest/gtest.h>

#include <random>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

TEST(GatedDeltaGates, MatchTheFormulaAndItsGradients) {
  auto be = make_cpu_backend();
  const Stream st = be->default_stream();
  std::mt19937_64 rng(10);
  const int64_t t = 5, heads = 3;
  Tensor a = random_tensor(*be, Shape{t, heads}, DType::F64, rng, 3.0), b = random_tensor(*be, Shape{t, heads}, DType::F64, rng, 3.0);
  Tensor a_log = random_tensor(*be, Shape{heads}, DType::F64, rng), dt_bias = random_tensor(*be, Shape{heads}, DType::F64, rng);
  Tensor g = be->empty(Shape{t, heads}, DType::F64), beta = be->empty(Shape{t, heads}, DType::F64);
  be->gated_delta_gates_forward(st, a, b, a_log, dt_bias, g, beta);
  {
    const auto as = to_host(*be, a), bs = to_host(*be, b), ls = to_host(*be, a_log), ds = to_host(*be, dt_bias);
    const auto gs = to_host(*be, g), betas = to_host(*be, beta);
    for (int64_t i = 0; i < t; ++i)
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t e = i * heads + h;
        EXPECT_NEAR(gs[e], -std::exp(ls[h]) * std::log1p(std::exp(as[e] + ds[h])), 1e-14);
        EXPECT_LE(gs[e], 0.0);
        EXPECT_NEAR(betas[e], 1.0 / (1.0 + std::exp(-bs[e])), 1e-15);
      }
  }
  Tensor proj_g = random_tensor(*be, g.shape(), DType::F64, rng), proj_beta = random_tensor(*be, g.shape(), DType::F64, rng);
  auto objective = [&] {
    be->gated_delta_gates_forward(st, a, b, a_log, dt_bias, g, beta);
    return dot(*be, g, proj_g) + dot(*be, beta, proj_beta);
  };
  objective();
  Tensor da = be->empty(a.shape(), DType::F64), db = be->empty(b.shape(), DType::F64);
  Tensor dlog = be->zeros(Shape{heads}, DType::F64), dbias = be->zeros(Shape{heads}, DType::F64);
  be->gated_delta_gates_backward(st, a, beta, a_log, dt_bias, g, proj_g, proj_beta, da, db, &dlog, &dbias);
  expect_gradient(*be, a, objective, da, 1e-7, "da");
  expect_gradient(*be, b, objective, db, 1e-7, "db");
  expect_gradient(*be, a_log, objective, dlog, 1e-7, "dA_log");
  expect_gradient(*be, dt_bias, objective, dbias, 1e-7, "ddt_bias");
}

TEST(GatedDeltaGates, DecayIsComputedInTheStatDtypeOfAnF32Model) {
  // F32 activations, F32 g: no overflow of softplus for large inputs (linear above 20, as torch).
  auto be = make_cpu_backend();
  Tensor a = be->empty(Shape{1, 2}, DType::F32), b = be->zeros(Shape{1, 2}, DType::F32);
  from_host(*be, {30.0, -30.0}, a);
  Tensor a_log = be->zeros(Shape{2}, DType::F32), dt_bias = be->zeros(Shape{2}, DType::F32);
  Tensor g = be->empty(Shape{1, 2}, DType::F32), beta = be->empty(Shape{1, 2}, DType::F32);
  be->gated_delta_gates_forward(be->default_stream(), a, b, a_log, dt_bias, g, beta);
  const auto gs = to_host(*be, g);
  EXPECT_FLOAT_EQ(gs[0], -30.0f);
  EXPECT_NEAR(gs[1], -std::exp(-30.0), 1e-18);
  EXPECT_EQ(to_host(*be, beta), (std::vector<double>{0.5, 0.5}));
}
