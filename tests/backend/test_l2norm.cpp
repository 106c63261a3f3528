// The L2 norm over a head's dims (gated DeltaNet's q and k) on the CPU backend.
#include <gtest/gtest.h>

#include <random>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

TEST(L2Norm, NormalisesEachRowWithEps) {
  auto be = make_cpu_backend();
  std::mt19937_64 rng(5);
  const int64_t rows = 4, c = 5;
  Tensor x = random_tensor(*be, Shape{2, 2, c}, DType::F64, rng);
  Tensor y = be->empty(x.shape(), DType::F64), rstd = be->empty(Shape{rows}, DType::F64);
  be->l2norm_forward(be->default_stream(), x, 1e-6, y, rstd);
  const auto xs = to_host(*be, x), ys = to_host(*be, y), rs = to_host(*be, rstd);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < c; ++j) ss += xs[r * c + j] * xs[r * c + j];
    EXPECT_NEAR(rs[r], 1.0 / std::sqrt(ss + 1e-6), 1e-14);
    for (int64_t j = 0; j < c; ++j) EXPECT_NEAR(ys[r * c + j], xs[r * c + j] / std::sqrt(ss + 1e-6), 1e-14);
  }
}

TEST(L2Norm, BackwardMatchesFiniteDifferences) {
  auto be = make_cpu_backend();
  const Stream st = be->default_stream();
  std::mt19937_64 rng(6);
  Tensor x = random_tensor(*be, Shape{3, 2, 4}, DType::F64, rng, 0.3);  // small rows: eps matters a little
  Tensor proj = random_tensor(*be, x.shape(), DType::F64, rng);
  Tensor y = be->empty(x.shape(), DType::F64), rstd = be->empty(Shape{6}, DType::F64);
  auto objective = [&] {
    be->l2norm_forward(st, x, 1e-2, y, rstd);
    return dot(*be, y, proj);
  };
  objective();
  Tensor dx = be->empty(x.shape(), DType::F64);
  be->l2norm_backward(st, y, rstd, proj, dx);
  expect_gradient(*be, x, objective, dx, 1e-7, "dx");
}
