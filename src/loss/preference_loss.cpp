#include "loss/preference_loss.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace spindle {

// The formulas follow TRL's DPOTrainer (huggingface/trl, trl/trainer/dpo_trainer.py):
//   sigmoid:  losses = -F.logsigmoid(beta * logits) * (1 - label_smoothing)
//                      - F.logsigmoid(-beta * logits) * label_smoothing
//             (label_smoothing > 0 is "conservative DPO", https://ericmitchell.ai/cdpo.pdf, eq. 3; TRL
//             had it in "sigmoid" until its DPO refactor of 2026-02 (#3906), which moved it to "robust")
//   ipo:      losses = (logits - 1 / (2 * beta)) ** 2   # eqn (17) of the IPO paper, beta = τ
//             with log-probabilities averaged over each response's completion tokens
//             ("chosen_scores / chosen_mask.sum(dim=1)"; before TRL's 2026 refactor:
//             "if 'ipo' in self.loss_type: all_logps = all_logps / loss_mask.sum(-1)").
//   rpo:      losses = losses + rpo_alpha * nll_loss, nll_loss = F.cross_entropy over the chosen
//             completion tokens of the batch (a token mean), then loss = losses.mean().
//   rewards:  chosen_rewards = beta * (chosen_logps - ref_chosen_logps), accuracy = chosen > rejected.

PreferenceLossType parse_preference_loss_type(std::string_view name) {
  if (name == "sigmoid" || name == "dpo") return PreferenceLossType::kSigmoid;
  if (name == "ipo") return PreferenceLossType::kIpo;
  fail("unknown preference loss type '{}'; use --loss-type sigmoid (DPO) or ipo", name);
}

std::string_view preference_loss_type_name(PreferenceLossType type) {
  switch (type) {
    case PreferenceLossType::kSigmoid: return "sigmoid";
    case PreferenceLossType::kIpo: return "ipo";
  }
  return "?";
}

void PreferenceLossOptions::validate() const {
  if (!(beta > 0) || !std::isfinite(beta)) fail("--beta must be a positive number (got {}); 0.1 is usual", beta);
  if (!(label_smoothing >= 0 && label_smoothing < 0.5))
    fail("--label-smoothing must lie in [0, 0.5) (got {}): it is the probability that a preference label is "
         "flipped",
         label_smoothing);
  if (label_smoothing > 0 && type != PreferenceLossType::kSigmoid)
    fail("--label-smoothing applies to the sigmoid (DPO) loss only; drop it or use --loss-type sigmoid");
  if (!(rpo_alpha >= 0) || !std::isfinite(rpo_alpha))
    fail("--rpo-alpha must be >= 0 (got {}); the RPO paper recommends 1.0", rpo_alpha);
}

double log_sigmoid(double x) {
  // −softplus(−x) = −(max(−x, 0) + log1p(exp(−|x|))): no overflow for any finite x.
  return -(std::max(-x, 0.0) + std::log1p(std::exp(-std::fabs(x))));
}

double sigmoid(double x) {
  if (x >= 0) return 1.0 / (1.0 + std::exp(-x));
  const double e = std::exp(x);
  return e / (1.0 + e);
}

PairLoss pair_preference_loss(const PairLogProbs& pair, const PreferenceLossOptions& o) {
  const double beta = o.beta;
  const double chosen_ratio = pair.chosen.policy - pair.chosen.reference;
  const double rejected_ratio = pair.rejected.policy - pair.rejected.reference;
  PairLoss out;
  out.reward_chosen = beta * chosen_ratio;
  out.reward_rejected = beta * rejected_ratio;
  switch (o.type) {
    case PreferenceLossType::kSigmoid: {
      const double h = chosen_ratio - rejected_ratio;
      const double eps = o.label_smoothing;
      out.loss = -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h);
      // d/dh[−logσ(βh)] = −β·σ(−βh);  d/dh[−logσ(−βh)] = β·σ(βh)
      const double d_h = -(1 - eps) * beta * sigmoid(-beta * h) + eps * beta * sigmoid(beta * h);
      out.d_chosen = d_h;
      out.d_rejected = -d_h;
      break;
    }
    case PreferenceLossType::kIpo: {
      if (pair.chosen.tokens <= 0 || pair.rejected.tokens <= 0)
        fail("IPO averages log-probabilities over each response's tokens, but a response has none "
             "(chosen {}, rejected {} supervised tokens)",
             pair.chosen.tokens, pair.rejected.tokens);
      const double nc = static_cast<double>(pair.chosen.tokens), nr = static_cast<double>(pair.rejected.tokens);
      const double h = chosen_ratio / nc - rejected_ratio / nr;
      const double gap = h - 1.0 / (2.0 * beta);
      out.loss = gap * gap;
      out.d_chosen = 2.0 * gap / nc;
      out.d_rejected = -2.0 * gap / nr;
      break;
    }
  }
  return out;
}

std::array<double, PreferenceSums::kCount> PreferenceSums::to_array() const {
  return {pairs, chosen_tokens, pair_loss, chosen_nll, reward_chosen, reward_rejected, correct, policy_chosen,
          policy_rejected};
}

PreferenceSums PreferenceSums::from_array(const std::array<double, kCount>& v) {
  PreferenceSums s;
  s.pairs = v[0];
  s.chosen_tokens = v[1];
  s.pair_loss = v[2];
  s.chosen_nll = v[3];
  s.reward_chosen = v[4];
  s.reward_rejected = v[5];
  s.correct = v[6];
  s.policy_chosen = v[7];
  s.policy_rejected = v[8];
  return s;
}

PreferenceSums sum_preference_pairs(std::span<const PairLogProbs> pairs, const PreferenceLossOptions& options) {
  options.validate();
  PreferenceSums s;
  for (const PairLogProbs& pair : pairs) {
    const PairLoss term = pair_preference_loss(pair, options);
    s.pairs += 1;
    s.chosen_tokens += static_cast<double>(pair.chosen.tokens);
    s.pair_loss += term.loss;
    s.chosen_nll -= pair.chosen.policy;
    s.reward_chosen += term.reward_chosen;
    s.reward_rejected += term.reward_rejected;
    s.correct += term.reward_chosen > term.reward_rejected ? 1.0 : 0.0;
    s.policy_chosen += pair.chosen.policy;
    s.policy_rejected += pair.rejected.policy;
  }
  return s;
}

PreferenceMetrics preference_metrics(const PreferenceSums& t, const PreferenceLossOptions& options) {
  PreferenceMetrics m;
  m.pairs = static_cast<int64_t>(t.pairs);
  if (t.pairs <= 0) return m;
  const double inv_p = 1.0 / t.pairs;
  m.preference_loss = t.pair_loss * inv_p;
  m.nll_loss = t.chosen_tokens > 0 ? t.chosen_nll / t.chosen_tokens : 0.0;
  m.loss = m.preference_loss + (options.rpo_alpha > 0 ? options.rpo_alpha * m.nll_loss : 0.0);
  m.rewards_chosen = t.reward_chosen * inv_p;
  m.rewards_rejected = t.reward_rejected * inv_p;
  m.margins = (t.reward_chosen - t.reward_rejected) * inv_p;
  m.accuracy = t.correct * inv_p;
  m.logps_chosen = t.policy_chosen * inv_p;
  m.logps_rejected = t.policy_rejected * inv_p;
  return m;
}

PairGradient preference_gradient(const PairLogProbs& pair, const PreferenceLossOptions& options,
                                 const PreferenceSums& totals) {
  SPINDLE_CHECK(totals.pairs > 0, "preference gradient with no pairs in the step");
  const PairLoss term = pair_preference_loss(pair, options);
  PairGradient g;
  g.d_chosen = term.d_chosen / totals.pairs;
  g.d_rejected = term.d_rejected / totals.pairs;
  // rpo_alpha·(−Σπ_c)/N_c: every chosen token's log-prob enters with −rpo_alpha/N_c.
  if (options.rpo_alpha > 0) {
    SPINDLE_CHECK(totals.chosen_tokens > 0, "RPO term with no chosen tokens in the step");
    g.d_chosen -= options.rpo_alpha / totals.chosen_tokens;
  }
  return g;
}

PreferenceLossResult preference_loss(std::span<const PairLogProbs> pairs, const PreferenceLossOptions& options) {
  PreferenceLossResult result;
  const PreferenceSums totals = sum_preference_pairs(pairs, options);
  result.metrics = preference_metrics(totals, options);
  result.gradients.reserve(pairs.size());
  for (const PairLogProbs& pair : pairs) result.gradients.push_back(preference_gradient(pair, options, totals));
  return result;
}

}  // namespace spindle
