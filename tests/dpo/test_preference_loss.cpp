// The preference loss formulas on hand-made log-probability sums: values against a plain
// (non-stabilised) evaluation of the published formulas, derivatives against central finite
// differences of the step loss, stability far from 0, and the option checks.
#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "loss/preference_loss.h"

using namespace spindle;

namespace {

std::vector<PairLogProbs> sample_pairs() {
  // Different lengths and signs of the log-ratio difference, so every branch is exercised.
  return {
      {{-12.5, -13.0, 5}, {-20.25, -19.0, 7}},
      {{-8.0, -7.25, 3}, {-6.5, -7.0, 4}},
      {{-30.0, -31.5, 11}, {-28.0, -27.75, 9}},
  };
}

// The formulas as written in the papers / TRL, in double, without any stabilisation.
double naive_step_loss(const std::vector<PairLogProbs>& pairs, const PreferenceLossOptions& o) {
  double sum = 0, chosen_nll = 0, chosen_tokens = 0;
  for (const PairLogProbs& p : pairs) {
    const double rc = p.chosen.policy - p.chosen.reference, rr = p.rejected.policy - p.rejected.reference;
    if (o.type == PreferenceLossType::kIpo) {
      const double h = rc / p.chosen.tokens - rr / p.rejected.tokens;
      sum += (h - 1 / (2 * o.beta)) * (h - 1 / (2 * o.beta));
    } else {
      const double h = rc - rr;
      sum += -(1 - o.label_smoothing) * std::log(1 / (1 + std::exp(-o.beta * h))) -
             o.label_smoothing * std::log(1 / (1 + std::exp(o.beta * h)));
    }
    chosen_nll -= p.chosen.policy;
    chosen_tokens += p.chosen.tokens;
  }
  return sum / pairs.size() + o.rpo_alpha * chosen_nll / chosen_tokens;
}

std::vector<PreferenceLossOptions> variants() {
  std::vector<PreferenceLossOptions> v(4);
  v[0].beta = 0.3;
  v[1].beta = 0.7;
  v[1].label_smoothing = 0.2;
  v[2].type = PreferenceLossType::kIpo;
  v[2].beta = 0.4;
  v[3].beta = 0.1;
  v[3].rpo_alpha = 1.5;
  return v;
}

}  // namespace

TEST(PreferenceLoss, MatchesThePublishedFormulas) {
  const auto pairs = sample_pairs();
  for (const PreferenceLossOptions& o : variants()) {
    const PreferenceLossResult r = preference_loss(pairs, o);
    EXPECT_NEAR(r.metrics.loss, naive_step_loss(pairs, o), 1e-13) << preference_loss_type_name(o.type);
    EXPECT_EQ(r.metrics.pairs, 3);
  }
}

TEST(PreferenceLoss, MetricsAreTheMeansTrlLogs) {
  const auto pairs = sample_pairs();
  PreferenceLossOptions o;
  o.beta = 0.5;
  const PreferenceMetrics m = preference_loss(pairs, o).metrics;
  // chosen rewards: 0.5·{0.5, −0.75, 1.5}; rejected: 0.5·{−1.25, 0.5, −0.25}
  EXPECT_NEAR(m.rewards_chosen, 0.5 * (0.5 - 0.75 + 1.5) / 3, 1e-15);
  EXPECT_NEAR(m.rewards_rejected, 0.5 * (-1.25 + 0.5 - 0.25) / 3, 1e-15);
  EXPECT_NEAR(m.margins, m.rewards_chosen - m.rewards_rejected, 1e-15);
  EXPECT_NEAR(m.accuracy, 2.0 / 3.0, 1e-15);  // pair 1 prefers the rejected response
  EXPECT_NEAR(m.logps_chosen, (-12.5 - 8.0 - 30.0) / 3, 1e-15);
  EXPECT_NEAR(m.logps_rejected, (-20.25 - 6.5 - 28.0) / 3, 1e-15);
  EXPECT_NEAR(m.nll_loss, (12.5 + 8.0 + 30.0) / (5 + 3 + 11), 1e-15);
  EXPECT_DOUBLE_EQ(m.loss, m.preference_loss);  // rpo_alpha 0: the NLL is reported, not added
}

TEST(PreferenceLoss, GradientsMatchFiniteDifferences) {
  for (const PreferenceLossOptions& o : variants()) {
    auto pairs = sample_pairs();
    const PreferenceLossResult r = preference_loss(pairs, o);
    for (size_t i = 0; i < pairs.size(); ++i) {
      for (int side = 0; side < 2; ++side) {
        double& x = side ? pairs[i].rejected.policy : pairs[i].chosen.policy;
        const double keep = x, h = 1e-5;
        x = keep + h;
        const double up = preference_loss(pairs, o).metrics.loss;
        x = keep - h;
        const double down = preference_loss(pairs, o).metrics.loss;
        x = keep;
        const double numeric = (up - down) / (2 * h);
        const double analytic = side ? r.gradients[i].d_rejected : r.gradients[i].d_chosen;
        EXPECT_NEAR(analytic, numeric, 1e-9) << preference_loss_type_name(o.type) << " pair " << i << " side " << side;
      }
    }
  }
}

TEST(PreferenceLoss, EqualPolicyAndReferenceGiveLn2) {
  std::vector<PairLogProbs> pairs = {{{-3.0, -3.0, 2}, {-4.0, -4.0, 2}}};
  const PreferenceLossResult r = preference_loss(pairs, PreferenceLossOptions{});
  EXPECT_EQ(r.metrics.loss, std::log(2.0));
  EXPECT_EQ(r.metrics.accuracy, 0.0);  // a tie is not a correct preference (TRL: chosen > rejected)
  EXPECT_EQ(r.metrics.margins, 0.0);
  EXPECT_NEAR(r.gradients[0].d_chosen, -0.1 * 0.5, 1e-17);  // −β·σ(0)
  EXPECT_NEAR(r.gradients[0].d_rejected, 0.1 * 0.5, 1e-17);
}

TEST(PreferenceLoss, StableFarFromZero) {
  EXPECT_EQ(log_sigmoid(-800.0), -800.0);  // log(1/(1+e^800)) would be −inf
  EXPECT_EQ(log_sigmoid(800.0), 0.0);
  EXPECT_NEAR(log_sigmoid(40.0), -std::exp(-40.0), 1e-30);
  EXPECT_EQ(sigmoid(-800.0), 0.0);
  EXPECT_EQ(sigmoid(800.0), 1.0);
  std::vector<PairLogProbs> pairs = {{{-5000.0, -10.0, 100}, {-10.0, -5000.0, 100}}};
  PreferenceLossOptions o;
  o.beta = 1.0;
  const PreferenceLossResult r = preference_loss(pairs, o);
  EXPECT_NEAR(r.metrics.loss, 9980.0, 1e-9);  // βh = −9980: −logσ(−9980) = 9980
  EXPECT_NEAR(r.gradients[0].d_chosen, -1.0, 1e-15);
  EXPECT_TRUE(std::isfinite(r.gradients[0].d_rejected));
}

TEST(PreferenceLoss, RejectsBadOptions) {
  auto message = [](const PreferenceLossOptions& o) {
    try {
      o.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  PreferenceLossOptions o;
  o.beta = 0;
  EXPECT_NE(message(o).find("--beta"), std::string::npos);
  o = {};
  o.label_smoothing = 0.5;
  EXPECT_NE(message(o).find("--label-smoothing"), std::string::npos);
  o = {};
  o.type = PreferenceLossType::kIpo;
  o.label_smoothing = 0.1;
  EXPECT_NE(message(o).find("sigmoid"), std::string::npos);
  o = {};
  o.rpo_alpha = -1;
  EXPECT_NE(message(o).find("--rpo-alpha"), std::string::npos);
  EXPECT_THROW(parse_preference_loss_type("hinge"), Error);
  EXPECT_EQ(parse_preference_loss_type("dpo"), PreferenceLossType::kSigmoid);
  EXPECT_EQ(parse_preference_loss_type("ipo"), PreferenceLossType::kIpo);
  std::vector<PairLogProbs> empty_side = {{{-1.0, -1.0, 0}, {-2.0, -1.0, 3}}};
  PreferenceLossOptions ipo;
  ipo.type = PreferenceLossType::kIpo;
  EXPECT_THROW(preference_loss(empty_side, ipo), Error);
}

namespace {

// cpo, simpo and orpo as their papers and TRL write them, without stabilisation: no reference, ā = π/n,
// odds(ā) = e^ā / (1 − e^ā); the NLL a token mean over the chosen tokens (orpo's prompts' too).
double naive_reference_free_loss(const std::vector<PairLogProbs>& pairs, const PreferenceLossOptions& o) {
  double sum = 0, chosen_nll = 0, chosen_tokens = 0;
  for (const PairLogProbs& p : pairs) {
    const double ac = p.chosen.policy / p.chosen.tokens, ar = p.rejected.policy / p.rejected.tokens;
    auto smoothed = [&](double h) {
      return -(1 - o.label_smoothing) * std::log(1 / (1 + std::exp(-o.beta * h))) -
             o.label_smoothing * std::log(1 / (1 + std::exp(o.beta * h)));
    };
    if (o.type == PreferenceLossType::kCpo) sum += smoothed(p.chosen.policy - p.rejected.policy);
    if (o.type == PreferenceLossType::kSimpo) sum += smoothed(ac - ar - o.simpo_gamma / o.beta);
    if (o.type == PreferenceLossType::kOrpo) {
      const double odds_c = std::exp(ac) / (1 - std::exp(ac)), odds_r = std::exp(ar) / (1 - std::exp(ar));
      sum += -o.beta * std::log(1 / (1 + 1 / (odds_c / odds_r)));
    }
    chosen_nll -= p.chosen.policy + p.chosen.prompt_policy;
    chosen_tokens += p.chosen.tokens + p.chosen.prompt_tokens;
  }
  return sum / pairs.size() + o.nll_weight() * chosen_nll / chosen_tokens;
}

std::vector<PreferenceLossOptions> reference_free_variants() {
  std::vector<PreferenceLossOptions> v(5);
  v[0].type = PreferenceLossType::kCpo;  // NLL weight 1
  v[0].beta = 0.3;
  v[1].type = PreferenceLossType::kCpo;
  v[1].beta = 0.2;
  v[1].label_smoothing = 0.1;
  v[1].cpo_alpha = 0.4;
  v[2].type = PreferenceLossType::kSimpo;  // no NLL
  v[2].beta = 2.0;
  v[2].simpo_gamma = 0.8;
  v[3].type = PreferenceLossType::kSimpo;  // CPO-SimPO
  v[3].beta = 1.5;
  v[3].cpo_alpha = 0.7;
  v[3].label_smoothing = 0.05;
  v[4].type = PreferenceLossType::kOrpo;
  v[4].beta = 0.25;
  return v;
}

// The reference sums are nonzero and must not matter; orpo's chosen prompts carry targets of their own.
std::vector<PairLogProbs> reference_free_pairs() {
  std::vector<PairLogProbs> pairs = sample_pairs();
  const double prompt[3][2] = {{-6.0, 4}, {-2.5, 2}, {-9.0, 6}};
  for (size_t i = 0; i < pairs.size(); ++i) {
    pairs[i].chosen.prompt_policy = prompt[i][0];
    pairs[i].chosen.prompt_tokens = static_cast<int64_t>(prompt[i][1]);
  }
  return pairs;
}

}  // namespace

TEST(PreferenceLoss, ReferenceFreeLossesMatchThePublishedFormulas) {
  for (const PreferenceLossOptions& o : reference_free_variants()) {
    auto pairs = reference_free_pairs();
    if (o.type != PreferenceLossType::kOrpo)  // the prompts' targets are orpo's alone
      for (PairLogProbs& p : pairs) p.chosen.prompt_policy = 0, p.chosen.prompt_tokens = 0;
    const PreferenceLossResult r = preference_loss(pairs, o);
    EXPECT_NEAR(r.metrics.loss, naive_reference_free_loss(pairs, o), 1e-12) << preference_loss_type_name(o.type);
    EXPECT_FALSE(uses_reference(o.type));
    // Scores, rewards and the NLL as TRL logs them.
    const bool average = o.type != PreferenceLossType::kCpo;
    double logps_chosen = 0, rewards_rejected = 0, nll = 0, nll_tokens = 0;
    for (const PairLogProbs& p : pairs) {
      logps_chosen += average ? p.chosen.policy / p.chosen.tokens : p.chosen.policy;
      rewards_rejected += o.beta * (average ? p.rejected.policy / p.rejected.tokens : p.rejected.policy);
      nll -= p.chosen.policy + p.chosen.prompt_policy;
      nll_tokens += p.chosen.tokens + p.chosen.prompt_tokens;
    }
    EXPECT_NEAR(r.metrics.logps_chosen, logps_chosen / 3, 1e-14);
    EXPECT_NEAR(r.metrics.rewards_rejected, rewards_rejected / 3, 1e-14);
    EXPECT_NEAR(r.metrics.nll_loss, nll / nll_tokens, 1e-14);
    if (o.type == PreferenceLossType::kOrpo) {
      double log_odds = 0;
      for (const PairLogProbs& p : pairs) {
        const double ac = p.chosen.policy / p.chosen.tokens, ar = p.rejected.policy / p.rejected.tokens;
        log_odds += std::log(std::exp(ac) / (1 - std::exp(ac))) - std::log(std::exp(ar) / (1 - std::exp(ar)));
      }
      EXPECT_NEAR(r.metrics.log_odds_chosen, log_odds / 3, 1e-12);
      EXPECT_NEAR(r.metrics.loss, r.metrics.nll_loss - o.beta * r.metrics.log_odds_ratio, 1e-14);
    }
  }
}

TEST(PreferenceLoss, ReferenceFreeGradientsMatchFiniteDifferences) {
  for (const PreferenceLossOptions& o : reference_free_variants()) {
    auto pairs = reference_free_pairs();
    const PreferenceLossResult r = preference_loss(pairs, o);
    for (size_t i = 0; i < pairs.size(); ++i) {
      for (int which = 0; which < 3; ++which) {  // chosen, rejected, the chosen prompt's targets
        double& x = which == 0 ? pairs[i].chosen.policy : which == 1 ? pairs[i].rejected.policy
                                                                      : pairs[i].chosen.prompt_policy;
        const double keep = x, h = 1e-5;
        x = keep + h;
        const double up = preference_loss(pairs, o).metrics.loss;
        x = keep - h;
        const double down = preference_loss(pairs, o).metrics.loss;
        x = keep;
        const double numeric = (up - down) / (2 * h);
        const PairGradient& g = r.gradients[i];
        const double analytic = which == 0 ? g.d_chosen : which == 1 ? g.d_rejected : g.d_prompt;
        EXPECT_NEAR(analytic, numeric, 1e-9) << preference_loss_type_name(o.type) << " pair " << i << " " << which;
      }
    }
  }
}

TEST(PreferenceLoss, ReferenceFreeOptionsAreChecked) {
  auto message = [](const PreferenceLossOptions& o) {
    try {
      o.validate();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  PreferenceLossOptions o;
  o.type = PreferenceLossType::kOrpo;
  o.rpo_alpha = 1;
  EXPECT_NE(message(o).find("--rpo-alpha"), std::string::npos) << message(o);
  o.rpo_alpha = 0;
  o.cpo_alpha = 1;
  EXPECT_NE(message(o).find("--cpo-alpha"), std::string::npos) << message(o);
  o.cpo_alpha = -1;
  o.label_smoothing = 0.1;
  EXPECT_NE(message(o).find("--label-smoothing"), std::string::npos) << message(o);
  o = PreferenceLossOptions{};
  o.cpo_alpha = 0.5;  // a DPO loss weighs its NLL with --rpo-alpha
  EXPECT_NE(message(o).find("--rpo-alpha"), std::string::npos) << message(o);
  o = PreferenceLossOptions{};
  o.type = PreferenceLossType::kSimpo;
  o.simpo_gamma = -1;
  EXPECT_NE(message(o).find("--simpo-gamma"), std::string::npos) << message(o);
  o.simpo_gamma = 0.5;
  o.cpo_alpha = -2;
  EXPECT_NE(message(o).find("--cpo-alpha"), std::string::npos) << message(o);
  EXPECT_EQ(parse_preference_loss_type("orpo"), PreferenceLossType::kOrpo);
  EXPECT_THROW(parse_preference_loss_type("kto"), Error);
  o.cpo_alpha = -1;
  EXPECT_EQ(o.nll_weight(), 0.0);  // SimPO
  o.type = PreferenceLossType::kCpo;
  EXPECT_EQ(o.nll_weight(), 1.0);  // CPO
}
