// The mixture-of-experts ops of the CPU backend: the router (softmax, top-k, renormalisation) and
// its backward against central finite differences in F64, the load-balancing statistics, the
// permutation of routed rows by expert, and the weighted combine with its backward.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "backend/backend.h"
#include "backend/op_test_util.h"

using namespace spindle;
using namespace spindle::test;

namespace {

constexpr int64_t kTokens = 7, kExperts = 6, kTopK = 3;

// The router's outputs, computed on the host from the logits.
struct HostRouting {
  std::vector<double> probs, weights;
  std::vector<int> index;
};

HostRouting host_router(const std::vector<double>& logits, int64_t tokens, int64_t experts, int64_t k, bool normalize) {
  HostRouting r;
  r.probs.resize(logits.size());
  for (int64_t t = 0; t < tokens; ++t) {
    double mx = -INFINITY, z = 0;
    for (int64_t e = 0; e < experts; ++e) mx = std::max(mx, logits[t * experts + e]);
    for (int64_t e = 0; e < experts; ++e) z += std::exp(logits[t * experts + e] - mx);
    for (int64_t e = 0; e < experts; ++e) r.probs[t * experts + e] = std::exp(logits[t * experts + e] - mx) / z;
    std::vector<int> order(experts);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int a, int b) { return r.probs[t * experts + a] > r.probs[t * experts + b]; });
    double sum = 0;
    for (int64_t j = 0; j < k; ++j) sum += r.probs[t * experts + order[j]];
    for (int64_t j = 0; j < k; ++j) {
      r.index.push_back(order[j]);
      r.weights.push_back(r.probs[t * experts + order[j]] / (normalize ? sum : 1.0));
    }
  }
  return r;
}

// Logits whose top-k choice is decisive: the k-th and (k+1)-th probabilities of every token differ
// clearly, so finite differences never cross a routing decision.
std::vector<double> decisive_logits(std::mt19937_64& rng) {
  std::uniform_real_distribution<double> dist(-2.0, 2.0);
  for (;;) {
    std::vector<double> logits(kTokens * kExperts);
    for (double& x : logits) x = dist(rng);
    bool ok = true;
    for (int64_t t = 0; t < kTokens; ++t) {
      std::vector<double> row(logits.begin() + t * kExperts, logits.begin() + (t + 1) * kExperts);
      std::sort(row.rbegin(), row.rend());
      ok &= row[kTopK - 1] - row[kTopK] > 0.05;
    }
    if (ok) return logits;
  }
}

class RouterOps : public ::testing::TestWithParam<bool> {};

}  // namespace

TEST_P(RouterOps, ForwardIsSoftmaxThenTopK) {
  const bool normalize = GetParam();
  auto be = make_cpu_backend();
  std::mt19937_64 rng(1);
  const std::vector<double> logits = decisive_logits(rng);
  for (DType dt : {DType::F32, DType::F64}) {
    Tensor z = be->empty(Shape{kTokens, kExperts}, dt);
    from_host(*be, logits, z);
    Tensor probs = be->empty(Shape{kTokens, kExperts}, dt), index = be->empty(Shape{kTokens, kTopK}, DType::I32),
           weights = be->empty(Shape{kTokens, kTopK}, dt);
    be->moe_router_forward(be->default_stream(), z, kTopK, normalize, probs, index, weights);
    const HostRouting want = host_router(to_host(*be, z), kTokens, kExperts, kTopK, normalize);
    const double tol = dt == DType::F64 ? 1e-15 : 1e-6;
    EXPECT_LE(relative_error(to_host(*be, probs), want.probs), tol);
    EXPECT_LE(relative_error(to_host(*be, weights), want.weights), tol);
    const std::vector<double> got_index = to_host(*be, index);
    for (size_t i = 0; i < want.index.size(); ++i) EXPECT_EQ(got_index[i], want.index[i]) << i;
  }
}

TEST_P(RouterOps, BackwardMatchesFiniteDifferences) {
  // L(z) = Σ c[t, j] · w[t, j] + Σ_{t real} Σ_e g[e] · p[t, e]: the routing weights' gradient and the
  // load-balancing loss's, the latter skipping the padding token.
  const bool normalize = GetParam();
  auto be = make_cpu_backend();
  std::mt19937_64 rng(2);
  const std::vector<double> logits = decisive_logits(rng);
  std::uniform_real_distribution<double> dist(-1.0, 1.0);
  std::vector<double> c(kTokens * kTopK), g(kExperts);
  for (double& x : c) x = dist(rng);
  for (double& x : g) x = dist(rng);
  const std::vector<int> docs = {0, 0, 0, 1, 1, -1, 2};
  auto objective = [&](const std::vector<double>& z) {
    const HostRouting r = host_router(z, kTokens, kExperts, kTopK, normalize);
    double value = 0;
    for (size_t i = 0; i < c.size(); ++i) value += c[i] * r.weights[i];
    for (int64_t t = 0; t < kTokens; ++t)
      if (docs[t] >= 0)
        for (int64_t e = 0; e < kExperts; ++e) value += g[e] * r.probs[t * kExperts + e];
    return value;
  };
  const DType dt = DType::F64;
  Tensor z = be->empty(Shape{kTokens, kExperts}, dt);
  from_host(*be, logits, z);
  Tensor probs = be->empty(Shape{kTokens, kExperts}, dt), index = be->empty(Shape{kTokens, kTopK}, DType::I32),
         weights = be->empty(Shape{kTokens, kTopK}, dt);
  be->moe_router_forward(be->default_stream(), z, kTopK, normalize, probs, index, weights);
  Tensor dw = be->empty(Shape{kTokens, kTopK}, dt), aux = be->empty(Shape{kExperts}, dt);
  from_host(*be, c, dw);
  from_host(*be, g, aux);
  Tensor dz = be->empty(Shape{kTokens, kExperts}, dt);
  be->moe_router_backward(be->default_stream(), probs, index, dw, normalize, aux, int_tensor(*be, docs), dz);
  const std::vector<double> got = to_host(*be, dz);
  std::vector<double> probe = logits;
  for (size_t i = 0; i < probe.size(); ++i) {
    const double h = 1e-6, keep = probe[i];
    probe[i] = keep + h;
    const double up = objective(probe);
    probe[i] = keep - h;
    const double down = objective(probe);
    probe[i] = keep;
    EXPECT_NEAR(got[i], (up - down) / (2 * h), 1e-8) << "logit " << i;
  }

  // Without the load-balancing term (an undefined aux_grad) only the routing weights' gradient.
  Tensor dz_plain = be->empty(Shape{kTokens, kExperts}, dt);
  be->moe_router_backward(be->default_stream(), probs, index, dw, normalize, Tensor(), Tensor(), dz_plain);
  std::fill(g.begin(), g.end(), 0.0);
  const std::vector<double> plain = to_host(*be, dz_plain);
  for (size_t i = 0; i < probe.size(); ++i) {
    const double h = 1e-6, keep = probe[i];
    probe[i] = keep + h;
    const double up = objective(probe);
    probe[i] = keep - h;
    const double down = objective(probe);
    probe[i] = keep;
    EXPECT_NEAR(plain[i], (up - down) / (2 * h), 1e-8) << "logit " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Renormalised, RouterOps, ::testing::Values(true, false));

TEST(MoeOps, StatisticsCountRealTokensOnly) {
  auto be = make_cpu_backend();
  std::mt19937_64 rng(3);
  const std::vector<double> logits = decisive_logits(rng);
  const std::vector<int> docs = {0, -1, 0, 1, -1, 1, 1};
  Tensor z = be->empty(Shape{kTokens, kExperts}, DType::F32);
  from_host(*be, logits, z);
  Tensor probs = be->empty(Shape{kTokens, kExperts}, DType::F32), index = be->empty(Shape{kTokens, kTopK}, DType::I32),
         weights = be->empty(Shape{kTokens, kTopK}, DType::F32);
  be->moe_router_forward(be->default_stream(), z, kTopK, true, probs, index, weights);
  Tensor counts = be->zeros(Shape{kExperts}, DType::F32), sums = be->zeros(Shape{kExperts}, DType::F32);
  // Twice: the statistics accumulate.
  for (int pass = 0; pass < 2; ++pass)
    be->moe_router_statistics(be->default_stream(), probs, index, int_tensor(*be, docs), counts, sums);
  const std::vector<double> p = to_host(*be, probs), idx = to_host(*be, index);
  std::vector<double> want_counts(kExperts, 0.0), want_sums(kExperts, 0.0);
  for (int64_t t = 0; t < kTokens; ++t) {
    if (docs[t] < 0) continue;
    for (int64_t j = 0; j < kTopK; ++j) want_counts[static_cast<int>(idx[t * kTopK + j])] += 2;
    for (int64_t e = 0; e < kExperts; ++e) want_sums[e] += 2 * p[t * kExperts + e];
  }
  EXPECT_EQ(to_host(*be, counts), want_counts);
  EXPECT_LE(relative_error(to_host(*be, sums), want_sums), 1e-6);
  double total = 0;
  for (double x : to_host(*be, counts)) total += x;
  EXPECT_EQ(total, 2 * 5 * kTopK);  // five real tokens, k experts each
}

TEST(MoeOps, PermutationSortsRoutedRowsByExpertStably) {
  auto be = make_cpu_backend();
  // 5 tokens, 2 slots, 4 experts (expert 2 unused).
  const std::vector<int> chosen = {3, 0, 1, 3, 0, 1, 3, 1, 0, 3};
  const int64_t tokens = 5, k = 2, experts = 4;
  Tensor index = int_tensor(*be, chosen).reshape(Shape{tokens, k});
  Tensor rows_token = be->empty(Shape{tokens * k}, DType::I32), row_of_slot = be->empty(Shape{tokens * k}, DType::I32),
         offsets = be->empty(Shape{experts + 1}, DType::I32);
  be->moe_permute(be->default_stream(), index, experts, rows_token, row_of_slot, offsets);
  EXPECT_EQ(to_host(*be, offsets), (std::vector<double>{0, 3, 6, 6, 10}));
  // Expert 0: (0,1) (2,0) (4,0); expert 1: (1,0) (2,1) (3,1); expert 3: (0,0) (1,1) (3,0) (4,1).
  EXPECT_EQ(to_host(*be, rows_token), (std::vector<double>{0, 2, 4, 1, 2, 3, 0, 1, 3, 4}));
  const std::vector<double> rows = to_host(*be, row_of_slot), token = to_host(*be, rows_token);
  const std::vector<double> first = to_host(*be, offsets);
  for (int64_t i = 0; i < tokens * k; ++i) {
    const int r = static_cast<int>(rows[i]);
    EXPECT_EQ(token[r], i / k) << "slot " << i;
    EXPECT_GE(r, first[chosen[i]]);
    EXPECT_LT(r, first[chosen[i] + 1]);
  }
}

TEST(MoeOps, CombineAndItsBackward) {
  auto be = make_cpu_backend();
  std::mt19937_64 rng(4);
  const int64_t tokens = 5, k = 2, hidden = 3, experts = 4;
  const std::vector<int> chosen = {3, 0, 1, 3, 0, 1, 3, 1, 0, 3};
  const DType dt = DType::F64;
  Tensor index = int_tensor(*be, chosen).reshape(Shape{tokens, k});
  Tensor rows_token = be->empty(Shape{tokens * k}, DType::I32), row_of_slot = be->empty(Shape{tokens * k}, DType::I32),
         offsets = be->empty(Shape{experts + 1}, DType::I32);
  be->moe_permute(be->default_stream(), index, experts, rows_token, row_of_slot, offsets);
  Tensor y = random_tensor(*be, Shape{tokens * k, hidden}, dt, rng);
  Tensor w = random_tensor(*be, Shape{tokens, k}, dt, rng);
  Tensor out = be->empty(Shape{tokens, hidden}, dt);
  be->moe_combine(be->default_stream(), y, row_of_slot, index, w, out);
  const std::vector<double> yh = to_host(*be, y), wh = to_host(*be, w), rows = to_host(*be, row_of_slot);
  std::vector<double> want(tokens * hidden, 0.0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j)
      for (int64_t h = 0; h < hidden; ++h)
        want[t * hidden + h] += wh[t * k + j] * yh[static_cast<int64_t>(rows[t * k + j]) * hidden + h];
  EXPECT_LE(relative_error(to_host(*be, out), want), 1e-15);

  // L = Σ dout ⊙ out is linear in y and in w: its gradients are exact.
  Tensor dout = random_tensor(*be, Shape{tokens, hidden}, dt, rng);
  Tensor dy = be->empty(y.shape(), dt), dw = be->empty(w.shape(), dt);
  be->moe_combine_backward(be->default_stream(), dout, y, row_of_slot, w, dy, dw);
  const std::vector<double> g = to_host(*be, dout);
  std::vector<double> want_dy(yh.size(), 0.0), want_dw(wh.size(), 0.0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < k; ++j) {
      const int64_t r = static_cast<int64_t>(rows[t * k + j]);
      for (int64_t h = 0; h < hidden; ++h) {
        want_dy[r * hidden + h] = wh[t * k + j] * g[t * hidden + h];
        want_dw[t * k + j] += yh[r * hidden + h] * g[t * hidden + h];
      }
    }
  EXPECT_LE(relative_error(to_host(*be, dy), want_dy), 1e-15);
  EXPECT_LE(relative_error(to_host(*be, dw), want_dw), 1e-15);
}
