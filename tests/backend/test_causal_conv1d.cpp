// The depthwise causal conv1d + SiLU of gated DeltaNet layers on the CPU backend: the formula, its
// backward against finite differences, the window restarting at every packed document, and the
// layer's conv + split op (q and k L2-normalised).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

namespace {

class CausalConv1d : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
  Stream st = be->default_stream();
  std::mt19937_64 rng{21};
};

double silu(double x) { return x / (1.0 + std::exp(-x)); }

}  // namespace

TEST_F(CausalConv1d, MatchesTheFormulaAndRestartsAtEachDocument) {
  const int64_t t = 9, c = 3, k = 4;
  const std::vector<int> docs = {0, 0, 0, 0, 0, 1, 1, 1, -1};  // two documents and a padding token
  Tensor x = random_tensor(*be, Shape{t, c}, DType::F64, rng);
  Tensor w = random_tensor(*be, Shape{c, 1, k}, DType::F64, rng);
  Tensor ids = int_tensor(*be, docs);
  Tensor y = be->empty(Shape{t, c}, DType::F64);
  be->causal_conv1d_silu_forward(st, x, w, ids, y);
  const auto xs = to_host(*be, x), ws = to_host(*be, w), ys = to_host(*be, y);
  const int64_t starts[] = {0, 0, 0, 0, 0, 5, 5, 5, 8};
  for (int64_t i = 0; i < t; ++i)
    for (int64_t ch = 0; ch < c; ++ch) {
      double pre = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t src = i - (k - 1) + j;
        if (src >= starts[i]) pre += ws[ch * k + j] * xs[src * c + ch];
      }
      EXPECT_NEAR(ys[i * c + ch], silu(pre), 1e-14) << i << "," << ch;
    }
}

TEST_F(CausalConv1d, BackwardMatchesFiniteDifferences) {
  const int64_t t = 8, c = 2, k = 4;
  Tensor x = random_tensor(*be, Shape{t, c}, DType::F64, rng);
  Tensor w = random_tensor(*be, Shape{c, 1, k}, DType::F64, rng);
  Tensor ids = int_tensor(*be, {3, 3, 3, 3, 3, 7, 7, 7});
  Tensor proj = random_tensor(*be, Shape{t, c}, DType::F64, rng);
  Tensor y = be->empty(Shape{t, c}, DType::F64);
  auto objective = [&] {
    be->causal_conv1d_silu_forward(st, x, w, ids, y);
    return dot(*be, y, proj);
  };
  Tensor dx = be->empty(Shape{t, c}, DType::F64);
  Tensor dw = be->empty(w.shape(), DType::F64);
  be->fill(st, dw, 0.5);  // the weight gradient accumulates
  be->causal_conv1d_silu_backward(st, x, w, ids, proj, dx, &dw);
  std::vector<double> dws = to_host(*be, dw);
  for (double& v : dws) v -= 0.5;
  expect_gradient(*be, x, objective, dx, 1e-7, "dx");
  expect_gradient(*be, w, objective, dws, 1e-7, "dw");
  // A frozen weight: the same dx, no weight gradient asked for.
  Tensor dx_frozen = be->empty(Shape{t, c}, DType::F64);
  be->causal_conv1d_silu_backward(st, x, w, ids, proj, dx_frozen, nullptr);
  EXPECT_EQ(to_host(*be, dx_frozen), to_host(*be, dx));
}

TEST_F(CausalConv1d, TwoPackedDocumentsGiveWhatEachGivesAlone) {
  const int64_t a = 5, b = 6, c = 3;
  Tensor x = random_tensor(*be, Shape{a + b, c}, DType::F64, rng);
  Tensor w = random_tensor(*be, Shape{c, 1, 4}, DType::F64, rng);
  std::vector<int> packed_ids(a, 0);
  packed_ids.insert(packed_ids.end(), b, 1);
  Tensor y = be->empty(x.shape(), DType::F64);
  be->causal_conv1d_silu_forward(st, x, w, int_tensor(*be, packed_ids), y);
  const auto packed = to_host(*be, y), xs = to_host(*be, x);

  Tensor second = be->empty(Shape{b, c}, DType::F64);
  from_host(*be, std::vector<double>(xs.begin() + a * c, xs.end()), second);
  Tensor y_second = be->empty(second.shape(), DType::F64);
  be->causal_conv1d_silu_forward(st, second, w, int_tensor(*be, std::vector<int>(b, 0)), y_second);
  const auto alone = to_host(*be, y_second);
  for (int64_t i = 0; i < b * c; ++i) EXPECT_EQ(packed[a * c + i], alone[i]) << i;

  // One document over the same tokens mixes the first document into the second's window.
  Tensor y_joined = be->empty(x.shape(), DType::F64);
  be->causal_conv1d_silu_forward(st, x, w, int_tensor(*be, std::vector<int>(a + b, 0)), y_joined);
  EXPECT_GT(max_abs_difference(to_host(*be, y_joined), packed), 1e-3);
}

// The gated DeltaNet's conv and split as one op: q and k are the first two column blocks of the
// conv's output, each key head L2-normalised, v the rest; its backward against finite differences
// of a projection of all three (through the norms, the split and the conv), over two documents.
TEST_F(CausalConv1d, ConvSplitNormalisesQAndKAndItsBackwardMatchesFiniteDifferences) {
  const int64_t t = 7, hk = 2, dk = 3, hv = 2, dv = 2, key = hk * dk, value = hv * dv, c = 2 * key + value, k = 4;
  Tensor x = random_tensor(*be, Shape{t, c}, DType::F64, rng);
  Tensor w = random_tensor(*be, Shape{c, 1, k}, DType::F64, rng);
  Tensor ids = int_tensor(*be, {0, 0, 0, 1, 1, 1, 1});
  const Shape qs{t, hk, dk}, vs{t, hv, dv};
  Tensor q = be->empty(qs, DType::F64), kk = be->empty(qs, DType::F64), v = be->empty(vs, DType::F64);
  Tensor q_rstd = be->empty(Shape{t * hk}, DType::F64), k_rstd = be->empty(Shape{t * hk}, DType::F64);
  be->deltanet_conv_split_forward(st, x, w, ids, 1e-6, q, kk, v, q_rstd, k_rstd);

  Tensor mixed = be->empty(Shape{t, c}, DType::F64);
  be->causal_conv1d_silu_forward(st, x, w, ids, mixed);
  const auto ms = to_host(*be, mixed), gq = to_host(*be, q), gk = to_host(*be, kk), gv = to_host(*be, v);
  for (int64_t i = 0; i < t; ++i) {
    for (int64_t h = 0; h < hk; ++h)
      for (int64_t part = 0; part < 2; ++part) {
        const double* head = &ms[i * c + part * key + h * dk];
        double ss = 1e-6;
        for (int64_t j = 0; j < dk; ++j) ss += head[j] * head[j];
        for (int64_t j = 0; j < dk; ++j)
          EXPECT_NEAR((part ? gk : gq)[(i * hk + h) * dk + j], head[j] / std::sqrt(ss), 1e-14) << i << "," << h;
      }
    for (int64_t j = 0; j < value; ++j) EXPECT_EQ(gv[i * value + j], ms[i * c + 2 * key + j]) << i << "," << j;
  }

  Tensor pq = random_tensor(*be, qs, DType::F64, rng), pk = random_tensor(*be, qs, DType::F64, rng),
         pv = random_tensor(*be, vs, DType::F64, rng);
  auto objective = [&] {
    be->deltanet_conv_split_forward(st, x, w, ids, 1e-6, q, kk, v, q_rstd, k_rstd);
    return dot(*be, q, pq) + dot(*be, kk, pk) + dot(*be, v, pv);
  };
  objective();  // q, k and their rstd at x
  Tensor dx = be->empty(Shape{t, c}, DType::F64), dw = be->zeros(w.shape(), DType::F64);
  be->deltanet_conv_split_backward(st, x, w, ids, q, kk, q_rstd, k_rstd, pq, pk, pv, dx, &dw);
  const std::vector<double> dxs = to_host(*be, dx), dws = to_host(*be, dw);
  expect_gradient(*be, x, objective, dxs, 1e-7, "dx");
  expect_gradient(*be, w, objective, dws, 1e-7, "dw");
}
