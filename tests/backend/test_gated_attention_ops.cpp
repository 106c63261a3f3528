// The CPU ops of gated attention (qwen3_5): copying column blocks (splitting q_proj's per-head
// query and gate), the sigmoid output gate, and partial RoPE (the first rotary_dim dims of a head).
#include <gtest/gtest.h>

#include <random>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

namespace {

class GatedAttentionOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
  Stream st = be->default_stream();
  std::mt19937_64 rng{31};
};

Tensor inv_freq(Backend& be, const std::vector<float>& values) {
  Tensor t = be.empty(Shape{static_cast<int64_t>(values.size())}, DType::F32);
  be.copy_from_host(be.default_stream(), values.data(), t);
  return t;
}

}  // namespace

TEST_F(GatedAttentionOps, CopyColumnsMovesOneBlockOfEveryRow) {
  for (DType dt : {DType::F32, DType::F64}) {
    Tensor src = random_tensor(*be, Shape{3, 5}, dt, rng);
    Tensor dst = be->zeros(Shape{3, 4}, dt);
    be->copy_columns(st, src, 1, dst, 2, 2);
    const auto s = to_host(*be, src), d = to_host(*be, dst);
    for (int r = 0; r < 3; ++r) {
      EXPECT_EQ(d[r * 4 + 0], 0.0);
      EXPECT_EQ(d[r * 4 + 1], 0.0);
      EXPECT_EQ(d[r * 4 + 2], s[r * 5 + 1]);
      EXPECT_EQ(d[r * 4 + 3], s[r * 5 + 2]);
    }
  }
  Tensor src = be->zeros(Shape{2, 3}, DType::F64), dst = be->zeros(Shape{2, 3}, DType::F64);
  EXPECT_THROW(be->copy_columns(st, src, 2, dst, 0, 2), Error);  // past the last column
}

TEST_F(GatedAttentionOps, SigmoidGateAndItsBackward) {
  Tensor x = random_tensor(*be, Shape{3, 2, 4}, DType::F64, rng), gate = random_tensor(*be, x.shape(), DType::F64, rng, 3.0);
  Tensor proj = random_tensor(*be, x.shape(), DType::F64, rng);
  Tensor out = be->empty(x.shape(), DType::F64);
  be->sigmoid_gate_forward(st, x, gate, out);
  const auto xs = to_host(*be, x), gs = to_host(*be, gate), os = to_host(*be, out);
  for (size_t i = 0; i < xs.size(); ++i) EXPECT_NEAR(os[i], xs[i] / (1.0 + std::exp(-gs[i])), 1e-15);
  auto objective = [&] {
    be->sigmoid_gate_forward(st, x, gate, out);
    return dot(*be, out, proj);
  };
  Tensor dx = be->empty(x.shape(), DType::F64), dgate = be->empty(x.shape(), DType::F64);
  be->sigmoid_gate_backward(st, x, gate, proj, dx, dgate);
  expect_gradient(*be, x, objective, dx, 1e-8, "dx");
  expect_gradient(*be, gate, objective, dgate, 1e-8, "dgate");
}

TEST_F(GatedAttentionOps, PartialRopeRotatesTheFirstDimsOnlyAndInvertsExactly) {
  const int64_t t = 3, heads = 2, d = 8, rotary = 4;
  Tensor x = random_tensor(*be, Shape{t, heads, d}, DType::F64, rng);
  const auto orig = to_host(*be, x);
  Tensor pos = int_tensor(*be, {0, 7, 300});
  const std::vector<float> freq = {1.0f, 0.01f};
  Tensor inv = inv_freq(*be, freq);
  be->rope_partial(st, x, pos, inv, rotary, 1.0, +1);
  const auto rot = to_host(*be, x);
  const int p[] = {0, 7, 300};
  for (int64_t ti = 0; ti < t; ++ti)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t base = (ti * heads + h) * d;
      for (int64_t i = 0; i < rotary / 2; ++i) {  // pairs (i, i + rotary/2) inside the rotary slice
        const double angle = static_cast<float>(p[ti]) * freq[i];
        const double a = orig[base + i], b = orig[base + i + rotary / 2];
        EXPECT_NEAR(rot[base + i], a * std::cos(angle) - b * std::sin(angle), 1e-12);
        EXPECT_NEAR(rot[base + i + rotary / 2], b * std::cos(angle) + a * std::sin(angle), 1e-12);
      }
      for (int64_t i = rotary; i < d; ++i) EXPECT_EQ(rot[base + i], orig[base + i]);  // passed through
    }
  be->rope_partial(st, x, pos, inv, rotary, 1.0, -1);
  EXPECT_LE(max_abs_difference(to_host(*be, x), orig), 1e-12);

  // rotary_dim = D is plain RoPE, with or without an attention scale on cos and sin.
  for (const double scale : {1.0, 1.1902381}) {
    Tensor full = random_tensor(*be, Shape{t, heads, 4}, DType::F64, rng), plain = be->empty(full.shape(), DType::F64);
    be->copy(st, full, plain);
    be->rope_partial(st, full, pos, inv, 4, scale, +1);
    be->rope(st, plain, pos, inv, scale, +1);
    EXPECT_EQ(to_host(*be, full), to_host(*be, plain)) << scale;
  }
}

// LongRoPE's attention factor scales the rotated dims only: the rest pass through unscaled.
TEST_F(GatedAttentionOps, PartialRopeScalesOnlyTheRotatedDims) {
  const int64_t t = 2, heads = 2, d = 8, rotary = 6;
  Tensor x = random_tensor(*be, Shape{t, heads, d}, DType::F64, rng), scaled = be->empty(x.shape(), DType::F64);
  be->copy(st, x, scaled);
  Tensor pos = int_tensor(*be, {5, 40});
  Tensor inv = inv_freq(*be, {0.7f, 0.05f, 0.001f});
  be->rope_partial(st, x, pos, inv, rotary, 1.0, +1);
  be->rope_partial(st, scaled, pos, inv, rotary, 1.5, +1);
  const auto plain = to_host(*be, x), got = to_host(*be, scaled);
  for (int64_t row = 0; row < t * heads; ++row)
    for (int64_t i = 0; i < d; ++i) {
      const double want = i < rotary ? 1.5 * plain[row * d + i] : plain[row * d + i];
      EXPECT_NEAR(got[row * d + i], want, 1e-14) << row << " " << i;
    }
}

TEST_F(GatedAttentionOps, PartialRopeBackwardIsTheInverseRotation) {
  const int64_t t = 2, heads = 1, d = 6, rotary = 4;
  Tensor x = random_tensor(*be, Shape{t, heads, d}, DType::F64, rng), proj = random_tensor(*be, x.shape(), DType::F64, rng);
  Tensor pos = int_tensor(*be, {3, 11});
  Tensor inv = inv_freq(*be, {0.9f, 0.2f});
  Tensor y = be->empty(x.shape(), DType::F64);
  for (const double scale : {1.0, 1.1902381}) {  // the backward of the scaled rotation: the same scale
    auto objective = [&] {
      be->copy(st, x, y);
      be->rope_partial(st, y, pos, inv, rotary, scale, +1);
      return dot(*be, y, proj);
    };
    Tensor grad = be->empty(x.shape(), DType::F64);
    be->copy(st, proj, grad);
    be->rope_partial(st, grad, pos, inv, rotary, scale, -1);
    expect_gradient(*be, x, objective, grad, 1e-8, "rope_partial");
  }
}
