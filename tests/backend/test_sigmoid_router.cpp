// glm4_moe's router (transformers' Glm4MoeTopkRouter) on the CPU backend: the forward against the
// transformers algorithm written out step by step on the host (sigmoid scores, the correction bias
// added for the choice, groups scored by their two best, the best topk_group groups, the top-k among
// them, the un-biased scores as weights, renormalisation, routed_scaling_factor), on inputs where
// the bias and the group limit both change which experts are chosen; the backward against central
// finite differences in F64 (the logits get the gradient, the correction bias none); F32 against F64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <tuple>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

namespace {

constexpr int64_t kTokens = 9, kExperts = 8;

struct HostRouting {
  std::vector<double> scores, weights;
  std::vector<int> index;  // [T, k] in descending choice
};

// transformers' Glm4MoeTopkRouter.forward, in doubles, one token at a time.
HostRouting host_router(const std::vector<double>& logits, const std::vector<double>& bias, const SigmoidRouting& r) {
  HostRouting out;
  const int64_t per_group = kExperts / r.groups;
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<double> s(kExperts), choice(kExperts);
    for (int64_t e = 0; e < kExperts; ++e) {
      s[e] = 1.0 / (1.0 + std::exp(-logits[t * kExperts + e]));
      choice[e] = s[e] + bias[e];
      out.scores.push_back(s[e]);
    }
    std::vector<double> group(r.groups);
    for (int64_t g = 0; g < r.groups; ++g) {
      std::vector<double> members(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
      std::sort(members.rbegin(), members.rend());
      group[g] = members[0] + members[1];
    }
    std::vector<int> groups(r.groups);
    std::iota(groups.begin(), groups.end(), 0);
    std::stable_sort(groups.begin(), groups.end(), [&](int a, int b) { return group[a] > group[b]; });
    std::vector<double> masked(kExperts, -INFINITY);
    for (int64_t i = 0; i < r.top_groups; ++i)
      for (int64_t e = groups[i] * per_group; e < (groups[i] + 1) * per_group; ++e) masked[e] = choice[e];
    std::vector<int> order(kExperts);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return masked[a] > masked[b]; });
    double sum = 1e-20;
    for (int64_t j = 0; j < r.top_k; ++j) sum += s[order[j]];
    for (int64_t j = 0; j < r.top_k; ++j) {
      out.index.push_back(order[j]);
      out.weights.push_back((r.normalize ? s[order[j]] / sum : s[order[j]]) * r.scaling);
    }
  }
  return out;
}

// The experts each token chooses, as sets (the order within a token's k is the choice's).
std::vector<std::vector<int>> chosen(const HostRouting& h, int64_t k) {
  std::vector<std::vector<int>> out;
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<int> set(h.index.begin() + t * k, h.index.begin() + (t + 1) * k);
    std::sort(set.begin(), set.end());
    out.push_back(set);
  }
  return out;
}

int differing_tokens(const HostRouting& a, const HostRouting& b, int64_t k) {
  const auto x = chosen(a, k), y = chosen(b, k);
  int n = 0;
  for (int64_t t = 0; t < kTokens; ++t) n += x[t] != y[t];
  return n;
}

// The smallest gap at a decision: between the topk_group-th and the next group score, and between
// the k-th and (k+1)-th candidate choice. Above 1e-3, finite differences of 1e-6 never cross one.
double decision_margin(const std::vector<double>& logits, const std::vector<double>& bias, const SigmoidRouting& r) {
  const int64_t per_group = kExperts / r.groups;
  double margin = INFINITY;
  for (int64_t t = 0; t < kTokens; ++t) {
    std::vector<double> choice(kExperts);
    for (int64_t e = 0; e < kExperts; ++e) choice[e] = 1.0 / (1.0 + std::exp(-logits[t * kExperts + e])) + bias[e];
    std::vector<std::pair<double, int>> group;
    for (int64_t g = 0; g < r.groups; ++g) {
      std::vector<double> m(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
      std::sort(m.rbegin(), m.rend());
      group.emplace_back(m[0] + m[1], static_cast<int>(g));
    }
    std::sort(group.rbegin(), group.rend());
    if (r.top_groups < r.groups) margin = std::min(margin, group[r.top_groups - 1].first - group[r.top_groups].first);
    std::vector<double> candidates;
    for (int64_t i = 0; i < r.top_groups; ++i)
      for (int64_t e = group[i].second * per_group; e < (group[i].second + 1) * per_group; ++e)
        candidates.push_back(choice[e]);
    std::sort(candidates.rbegin(), candidates.rend());
    if (r.top_k < static_cast<int64_t>(candidates.size()))
      margin = std::min(margin, candidates[r.top_k - 1] - candidates[r.top_k]);
  }
  return margin;
}

// Logits and a correction bias on the scale of the scores' spread, redrawn until every decision is
// clear of ties and both the bias and (with groups) the group limit change some token's experts.
std::pair<std::vector<double>, std::vector<double>> decisive_inputs(const SigmoidRouting& r, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> logit(-2.5, 2.5), offset(-0.3, 0.3);
  SigmoidRouting ungrouped = r;
  ungrouped.groups = ungrouped.top_groups = 1;
  for (int attempt = 0; attempt < 10000; ++attempt) {
    std::vector<double> logits(kTokens * kExperts), bias(kExperts), zero(kExperts, 0.0);
    for (double& x : logits) x = logit(rng);
    for (double& x : bias) x = offset(rng);
    if (decision_margin(logits, bias, r) < 2e-3) continue;
    const HostRouting with = host_router(logits, bias, r);
    if (differing_tokens(with, host_router(logits, zero, r), r.top_k) < 2) continue;
    if (r.top_groups < r.groups && differing_tokens(with, host_router(logits, bias, ungrouped), r.top_k) < 2) continue;
    return {logits, bias};
  }
  ADD_FAILURE() << "no decisive draw";
  return {};
}

// (groups, top_groups, top_k, normalize, scaling)
using Case = std::tuple<int64_t, int64_t, int64_t, bool, double>;

SigmoidRouting routing_of(const Case& c) {
  return {.top_k = std::get<2>(c), .groups = std::get<0>(c), .top_groups = std::get<1>(c), .normalize = std::get<3>(c),
          .scaling = std::get<4>(c)};
}

class SigmoidRouter : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(SigmoidRouter, ForwardIsTransformersRouterStepByStep) {
  const SigmoidRouting r = routing_of(GetParam());
  auto be = make_cpu_backend();
  const auto [logits, bias] = decisive_inputs(r, 11);
  const HostRouting want = host_router(logits, bias, r);
  for (DType dt : {DType::F64, DType::F32}) {
    Tensor z = be->empty(Shape{kTokens, kExperts}, dt), b = be->empty(Shape{kExperts}, dt);
    from_host(*be, logits, z);
    from_host(*be, bias, b);
    Tensor scores = be->empty(Shape{kTokens, kExperts}, dt), index = be->empty(Shape{kTokens, r.top_k}, DType::I32),
           weights = be->empty(Shape{kTokens, r.top_k}, dt);
    be->moe_sigmoid_router_forward(be->default_stream(), z, b, r, scores, index, weights);
    const double tol = dt == DType::F64 ? 1e-15 : 2e-7;
    EXPECT_LE(relative_error(to_host(*be, scores), want.scores), tol) << dtype_name(dt);
    EXPECT_LE(relative_error(to_host(*be, weights), want.weights), tol) << dtype_name(dt);
    const std::vector<double> got_index = to_host(*be, index);
    for (size_t i = 0; i < want.index.size(); ++i) EXPECT_EQ(got_index[i], want.index[i]) << dtype_name(dt) << " " << i;
  }
}

TEST_P(SigmoidRouter, BackwardMatchesFiniteDifferencesAndLeavesTheBiasOut) {
  // L = Σ c[t, j] · w[t, j]: the routing weights' gradient through the scaling, the renormalisation
  // and the sigmoid of the chosen experts.
  const SigmoidRouting r = routing_of(GetParam());
  auto be = make_cpu_backend();
  const auto [logits, bias] = decisive_inputs(r, 12);
  std::mt19937_64 rng(13);
  Tensor proj = random_tensor(*be, Shape{kTokens, r.top_k}, DType::F64, rng);
  Tensor z = be->empty(Shape{kTokens, kExperts}, DType::F64), b = be->empty(Shape{kExperts}, DType::F64);
  from_host(*be, logits, z);
  from_host(*be, bias, b);
  Tensor scores = be->empty(Shape{kTokens, kExperts}, DType::F64);
  Tensor index = be->empty(Shape{kTokens, r.top_k}, DType::I32), weights = be->empty(Shape{kTokens, r.top_k}, DType::F64);
  auto objective = [&] {
    be->moe_sigmoid_router_forward(be->default_stream(), z, b, r, scores, index, weights);
    return dot(*be, weights, proj);
  };
  objective();
  Tensor dz = be->empty(Shape{kTokens, kExperts}, DType::F64);
  be->fill(be->default_stream(), dz, 7.0);  // overwritten, unchosen experts included
  be->moe_sigmoid_router_backward(be->default_stream(), scores, index, proj, r, dz);
  expect_gradient(*be, z, objective, dz, 1e-8, "dlogits");
  // Only the chosen experts' logits get a gradient.
  const std::vector<double> d = to_host(*be, dz), idx = to_host(*be, index);
  for (int64_t t = 0; t < kTokens; ++t)
    for (int64_t e = 0; e < kExperts; ++e) {
      const bool picked = std::find(idx.begin() + t * r.top_k, idx.begin() + (t + 1) * r.top_k, e) !=
                          idx.begin() + (t + 1) * r.top_k;
      if (!picked) EXPECT_EQ(d[t * kExperts + e], 0.0) << t << "," << e;
    }
  // The bias only chooses: away from a tie the objective does not move with it.
  const double base = objective();
  std::vector<double> moved = bias;
  for (double& x : moved) x += 1e-6;
  from_host(*be, moved, b);
  EXPECT_EQ(objective(), base);
}

INSTANTIATE_TEST_SUITE_P(
    Routings, SigmoidRouter,
    ::testing::Values(Case{4, 2, 3, true, 2.5},   // 4 groups of 2, the best 2 kept, renormalised and scaled
                      Case{2, 1, 2, false, 1.0},  // 2 groups of 4, one kept, raw scores
                      Case{1, 1, 3, true, 1.0},   // no groups (GLM-4.5's n_group 1)
                      Case{1, 1, 2, false, 1.8}));

TEST(SigmoidRouter, F32ChoosesAsF64) {
  // On inputs clear of ties, F32 picks the experts F64 picks, with weights equal to F32 rounding.
  const SigmoidRouting r{.top_k = 3, .groups = 4, .top_groups = 2, .normalize = true, .scaling = 2.5};
  auto be = make_cpu_backend();
  const auto [logits, bias] = decisive_inputs(r, 17);
  std::vector<std::vector<double>> index, weights;
  for (DType dt : {DType::F64, DType::F32}) {
    Tensor z = be->empty(Shape{kTokens, kExperts}, dt), b = be->empty(Shape{kExperts}, dt);
    from_host(*be, logits, z);
    from_host(*be, bias, b);
    Tensor scores = be->empty(Shape{kTokens, kExperts}, dt), i = be->empty(Shape{kTokens, r.top_k}, DType::I32),
           w = be->empty(Shape{kTokens, r.top_k}, dt);
    be->moe_sigmoid_router_forward(be->default_stream(), z, b, r, scores, i, w);
    index.push_back(to_host(*be, i));
    weights.push_back(to_host(*be, w));
  }
  EXPECT_EQ(index[0], index[1]);
  EXPECT_LE(relative_error(weights[1], weights[0]), 2e-7);
}
