// Central finite differences in F64 for op tests: the gradient of a scalar objective with respect
// to every element of one input tensor, compared with what a backward op computed.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <string>
#include <vector>

#include "op_test_util.h"

namespace spindle::test {

// Σ a·b over two tensors of equal size (the objective L = Σ proj·f(x) of most op tests).
inline double dot(Backend& be, const Tensor& a, const Tensor& b) {
  const std::vector<double> x = to_host(be, a), y = to_host(be, b);
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

// Checks `analytic` = ∂objective/∂x element by element (x F64; perturbed by ±h and restored):
// the largest error must stay below tol·max(1, largest numeric gradient).
inline void expect_gradient(Backend& be, Tensor& x, const std::function<double()>& objective,
                            const std::vector<double>& analytic, double tol, const std::string& what,
                            double h = 1e-6) {
  std::vector<double> xs = to_host(be, x);
  ASSERT_EQ(xs.size(), analytic.size()) << what;
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    std::vector<double> p = xs;
    p[i] = xs[i] + h;
    from_host(be, p, x);
    const double up = objective();
    p[i] = xs[i] - h;
    from_host(be, p, x);
    const double down = objective();
    const double numeric = (up - down) / (2 * h);
    ASSERT_FALSE(std::isnan(analytic[i])) << what << "[" << i << "] is NaN";
    max_err = std::max(max_err, std::fabs(numeric - analytic[i]));
    max_ref = std::max(max_ref, std::fabs(numeric));
  }
  from_host(be, xs, x);
  EXPECT_GT(max_ref, 0.0) << what << ": the objective does not depend on it";
  EXPECT_LE(max_err, tol * std::max(1.0, max_ref)) << what << ": max |numeric − analytic| = " << max_err;
}

inline void expect_gradient(Backend& be, Tensor& x, const std::function<double()>& objective, const Tensor& analytic,
                            double tol, const std::string& what) {
  expect_gradient(be, x, objective, to_host(be, analytic), tol, what);
}

inline double max_abs_difference(const std::vector<double>& a, const std::vector<double>& b) {
  EXPECT_EQ(a.size(), b.size());
  double m = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

}  // namespace spindle::test
