// Gated RMSNorm (gated DeltaNet's output norm: plain weight, times silu of the gate) on the CPU
// backend.
#include <gtest/gtest.h>

#include <random>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

TEST(GatedRmsNorm, MatchesTheFormula) {
  auto be = make_cpu_backend();
  std::mt19937_64 rng(8);
  const int64_t rows = 3, c = 4;
  Tensor x = random_tensor(*be, Shape{rows, c}, DType::F64, rng), z = random_tensor(*be, Shape{rows, c}, DType::F64, rng);
  Tensor w = random_tensor(*be, Shape{c}, DType::F64, rng);
  Tensor y = be->empty(x.shape(), DType::F64), rstd = be->empty(Shape{rows}, DType::F64);
  be->gated_rmsnorm_forward(be->default_stream(), x, z, w, 1e-5, y, rstd);
  const auto xs = to_host(*be, x), zs = to_host(*be, z), ws = to_host(*be, w), ys = to_host(*be, y);
  for (int64_t r = 0; r < rows; ++r) {
    double ms = 0;
    for (int64_t j = 0; j < c; ++j) ms += xs[r * c + j] * xs[r * c + j] / c;
    for (int64_t j = 0; j < c; ++j) {
      const double zz = zs[r * c + j];
      EXPECT_NEAR(ys[r * c + j], xs[r * c + j] / std::sqrt(ms + 1e-5) * ws[j] * zz / (1 + std::exp(-zz)), 1e-14);
    }
  }
}

TEST(GatedRmsNorm, BackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const Stream st = be->default_stream();
  std::mt19937_64 rng(9);
  const int64_t rows = 4, c = 3;
  Tensor x = random_tensor(*be, Shape{rows, c}, DType::F64, rng), z = random_tensor(*be, Shape{rows, c}, DType::F64, rng, 2.0);
  Tensor w = random_tensor(*be, Shape{c}, DType::F64, rng);
  Tensor proj = random_tensor(*be, x.shape(), DType::F64, rng);
  Tensor y = be->empty(x.shape(), DType::F64), rstd = be->empty(Shape{rows}, DType::F64);
  auto objective = [&] {
    be->gated_rmsnorm_forward(st, x, z, w, 1e-3, y, rstd);
    return dot(*be, y, proj);
  };
  objective();
  Tensor dx = be->empty(x.shape(), DType::F64), dz = be->empty(x.shape(), DType::F64), dw = be->zeros(Shape{c}, DType::F64);
  be->gated_rmsnorm_backward(st, x, z, w, rstd, proj, dx, dz, &dw);
  expect_gradient(*be, x, objective, dx, 1e-7, "dx");
  expect_gradient(*be, z, objective, dz, 1e-7, "dz");
  expect_gradient(*be, w, objective, dw, 1e-7, "dw");
}
