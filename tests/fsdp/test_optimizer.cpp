// AdamW's precision paths against a host reference in double:
//  - mixed precision: BF16/F16 values with an F32 master copy (the CUDA training setup). The CPU
//    backend cannot compute in BF16, but it stores and converts it, which is all this path needs:
//    gradients are converted to F32, the master updated, and the value rounded from the master.
//  - F32 and F64 values updated in place.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/op_test_util.h"
#include "train/optimizer.h"

namespace spindle {
namespace {

using test::from_host;
using test::to_host;

struct HostAdamW {
  std::vector<double> p, m, v;
  void step(const std::vector<double>& g, double clip, double lr, const AdamWConfig& c, int64_t t) {
    const double bc1 = 1 - std::pow(c.beta1, static_cast<double>(t)), bc2 = 1 - std::pow(c.beta2, static_cast<double>(t));
    for (size_t i = 0; i < p.size(); ++i) {
      const double gi = g[i] * clip;
      p[i] *= 1 - lr * c.weight_decay;
      m[i] = c.beta1 * m[i] + (1 - c.beta1) * gi;
      v[i] = c.beta2 * v[i] + (1 - c.beta2) * gi * gi;
      p[i] -= (lr / bc1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + c.eps);
    }
  }
};

std::vector<double> uniform(std::mt19937_64& rng, size_t n, double lo, double hi) {
  std::uniform_real_distribution<double> dist(lo, hi);
  std::vector<double> out(n);
  for (double& x : out) x = dist(rng);
  return out;
}

double rounded(DType dtype, double x) {
  switch (dtype) {
    case DType::BF16: return bf16_to_f32(f32_to_bf16(static_cast<float>(x)));
    case DType::F16: return f16_to_f32(f32_to_f16(static_cast<float>(x)));
    case DType::F32: return static_cast<float>(x);
    default: return x;
  }
}

// Three slots of odd sizes, value dtype `value_dtype`, gradient dtype per slot; 20 steps at a
// learning rate whose single updates (1e-3 on values near 1) are below half a BF16 ulp (2e-3):
// without the master copy the values would never move.
void check_against_reference(DType value_dtype, std::vector<DType> grad_dtypes, double master_tolerance) {
  auto backend = make_cpu_backend(1);
  Backend& be = *backend;
  std::mt19937_64 rng(11);
  const std::vector<int64_t> sizes = {7, 33, 130};
  AdamWConfig config;
  config.weight_decay = 0.05;
  config.max_grad_norm = 0.5;  // clips: the norm of these gradients is about 4
  const double lr = 1e-3;

  std::vector<OptimizerSlot> slots;
  std::vector<HostAdamW> reference(sizes.size());
  for (size_t k = 0; k < sizes.size(); ++k) {
    OptimizerSlot s{"p" + std::to_string(k), be.empty(Shape{sizes[k]}, value_dtype),
                    be.empty(Shape{sizes[k]}, grad_dtypes[k])};
    std::vector<double> init = uniform(rng, sizes[k], 0.5, 1.5);
    for (double& x : init) x = rounded(value_dtype, x);  // the reference starts from the stored value
    from_host(be, init, s.value);
    reference[k].p = init;
    reference[k].m.assign(sizes[k], 0.0);
    reference[k].v.assign(sizes[k], 0.0);
    slots.push_back(s);
  }
  const std::vector<OptimizerSlot> handles = slots;
  AdamWOptimizer optimizer(be, slots, config);
  const bool mixed = value_dtype == DType::BF16 || value_dtype == DType::F16;

  for (int64_t t = 1; t <= 20; ++t) {
    std::vector<std::vector<double>> grads;
    double sum_squares = 0;
    for (size_t k = 0; k < sizes.size(); ++k) {
      std::vector<double> g = uniform(rng, sizes[k], -0.5, 0.5);
      for (double& x : g) {
        x = rounded(grad_dtypes[k], x);
        sum_squares += x * x;
      }
      Tensor grad = handles[k].grad;
      from_host(be, g, grad);
      grads.push_back(std::move(g));
    }
    const double norm = std::sqrt(sum_squares);
    const double clip = std::min(1.0, config.max_grad_norm / (norm + 1e-6));
    for (size_t k = 0; k < sizes.size(); ++k) reference[k].step(grads[k], clip, lr, config, t);
    const double got = optimizer.step(lr);
    EXPECT_NEAR(got, norm, 1e-6 * norm) << "step " << t;
  }

  auto state = optimizer.state_tensors();
  ASSERT_EQ(state.size(), sizes.size() * (mixed ? 3 : 2));
  for (size_t k = 0; k < sizes.size(); ++k) {
    const std::vector<double> value = to_host(be, handles[k].value);
    const std::vector<double>& ref = reference[k].p;
    if (mixed) {
      const size_t base = 3 * k;
      ASSERT_EQ(state[base + 2].first, "master.p" + std::to_string(k));
      ASSERT_EQ(state[base + 2].second.dtype(), DType::F32);
      const std::vector<double> master = to_host(be, state[base + 2].second);
      for (int64_t i = 0; i < sizes[k]; ++i) {
        EXPECT_NEAR(master[i], ref[i], master_tolerance) << k << "[" << i << "]";
        // The value is the master rounded once.
        EXPECT_EQ(value[i], rounded(value_dtype, master[i])) << k << "[" << i << "]";
      }
    } else {
      for (int64_t i = 0; i < sizes[k]; ++i) EXPECT_NEAR(value[i], ref[i], master_tolerance) << k << "[" << i << "]";
    }
    const std::vector<double> m = to_host(be, state[(mixed ? 3 : 2) * k].second);
    for (int64_t i = 0; i < sizes[k]; ++i) EXPECT_NEAR(m[i], reference[k].m[i], 1e-7) << k << "[" << i << "]";
  }
}

TEST(AdamWMixedPrecision, Bf16ValuesWithF32MasterMatchDoubleReference) {
  // BF16 gradients (one process), and F32 gradient shards (FSDP's accumulation dtype).
  check_against_reference(DType::BF16, {DType::BF16, DType::F32, DType::BF16}, 2e-6);
}

TEST(AdamWMixedPrecision, F16ValuesWithF32MasterMatchDoubleReference) {
  check_against_reference(DType::F16, {DType::F16, DType::F16, DType::F32}, 2e-6);
}

TEST(AdamWInPlace, F32MatchesDoubleReference) { check_against_reference(DType::F32, {DType::F32, DType::F32, DType::F32}, 2e-6); }

TEST(AdamWInPlace, F64MatchesDoubleReference) { check_against_reference(DType::F64, {DType::F64, DType::F64, DType::F64}, 1e-13); }

TEST(AdamWMixedPrecision, MasterStaysAheadOfTheRoundedValue) {
  // One BF16 element at 1.0 with a constant gradient: each update (lr = 1e-4) is 1/40 of a BF16
  // ulp at 1.0. In-place BF16 would round every update away; the master accumulates them, and the
  // value follows once the sum crosses half an ulp.
  auto backend = make_cpu_backend(1);
  Backend& be = *backend;
  OptimizerSlot s{"w", be.empty(Shape{1}, DType::BF16), be.empty(Shape{1}, DType::BF16)};
  from_host(be, {1.0}, s.value);
  from_host(be, {0.25}, s.grad);
  AdamWConfig config;
  config.max_grad_norm = 0;
  AdamWOptimizer optimizer(be, {s}, config);
  for (int i = 0; i < 100; ++i) optimizer.step(1e-4);
  const double master = to_host(be, optimizer.state_tensors()[2].second)[0];
  // Adam's update is lr·sign(g) for a constant g; the F32 master rounds each one (ulp 6e-8 near 1).
  EXPECT_NEAR(master, 1.0 - 100 * 1e-4, 1e-5);
  EXPECT_EQ(to_host(be, s.value)[0], rounded(DType::BF16, master));
  EXPECT_LT(to_host(be, s.value)[0], 1.0);
}

TEST(AdamWSlots, RefreshMasterCopiesFollowsANewValue) {
  auto backend = make_cpu_backend(1);
  Backend& be = *backend;
  OptimizerSlot s{"w", be.empty(Shape{2}, DType::BF16), be.zeros(Shape{2}, DType::BF16)};
  from_host(be, {1.0, 2.0}, s.value);
  AdamWOptimizer optimizer(be, {s}, AdamWConfig{});
  from_host(be, {3.0, -4.0}, s.value);
  optimizer.refresh_master_copies();
  optimizer.step(1e-3);  // zero gradient, no decay: the value is the master, unchanged
  EXPECT_EQ(to_host(be, s.value), (std::vector<double>{3.0, -4.0}));
}

}  // namespace
}  // namespace spindle
