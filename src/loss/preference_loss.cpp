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
// Without a reference model, TRL's CPOTrainer (trl/experimental/cpo/cpo_trainer.py, cpo_loss) and
// ORPOTrainer (trl/experimental/orpo/orpo_trainer.py, odds_ratio_loss):
//   cpo:      logits = chosen_logps - rejected_logps (sums), losses as sigmoid's with beta and
//             label_smoothing; loss = losses.mean() + cpo_alpha * nll_loss (cross-entropy over the
//             chosen responses' tokens of the batch).
//   simpo:    the same on per-token averaged log-probabilities, logits - simpo_gamma / beta (cpo_alpha
//             0 is SimPO, > 0 CPO-SimPO).
//   orpo:     log_odds = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected)) on averaged
//             log-probabilities, losses = beta * logsigmoid(log_odds), loss = nll_loss - losses.mean()
//             with nll_loss the cross-entropy over the chosen sequences' prompt and response tokens.
//   rewards:  beta * logps (averaged for simpo and orpo).

PreferenceLossType parse_preference_loss_type(std::string_view name) {
  if (name == "sigmoid" || name == "dpo") return PreferenceLossType::kSigmoid;
  if (name == "ipo") return PreferenceLossType::kIpo;
  if (name == "cpo") return PreferenceLossType::kCpo;
  if (name == "simpo") return PreferenceLossType::kSimpo;
  if (name == "orpo") return PreferenceLossType::kOrpo;
  fail("unknown preference loss type '{}'; use --loss-type sigmoid (DPO), ipo, cpo, simpo or orpo", name);
}

std::string_view preference_loss_type_name(PreferenceLossType type) {
  switch (type) {
    case PreferenceLossType::kSigmoid: return "sigmoid";
    case PreferenceLossType::kIpo: return "ipo";
    case PreferenceLossType::kCpo: return "cpo";
    case PreferenceLossType::kSimpo: return "simpo";
    case PreferenceLossType::kOrpo: return "orpo";
  }
  return "?";
}

bool uses_reference(PreferenceLossType type) {
  return type == PreferenceLossType::kSigmoid || type == PreferenceLossType::kIpo;
}

bool averages_log_probs(PreferenceLossType type) {
  return type == PreferenceLossType::kIpo || type == PreferenceLossType::kSimpo || type == PreferenceLossType::kOrpo;
}

double PreferenceLossOptions::nll_weight() const {
  switch (type) {
    case PreferenceLossType::kSigmoid:
    case PreferenceLossType::kIpo: return rpo_alpha;
    case PreferenceLossType::kCpo: return cpo_alpha >= 0 ? cpo_alpha : 1.0;
    case PreferenceLossType::kSimpo: return cpo_alpha >= 0 ? cpo_alpha : 0.0;
    case PreferenceLossType::kOrpo: return 1.0;
  }
  return 0.0;
}

void PreferenceLossOptions::validate() const {
  if (!(beta > 0) || !std::isfinite(beta)) fail("--beta must be a positive number (got {}); 0.1 is usual", beta);
  if (!(label_smoothing >= 0 && label_smoothing < 0.5))
    fail("--label-smoothing must lie in [0, 0.5) (got {}): it is the probability that a preference label is "
         "flipped",
         label_smoothing);
  if (label_smoothing > 0 && type != PreferenceLossType::kSigmoid && type != PreferenceLossType::kCpo &&
      type != PreferenceLossType::kSimpo)
    fail("--label-smoothing applies to the sigmoid (DPO), cpo and simpo losses only; drop it or choose one of them "
         "with --loss-type");
  if (!(rpo_alpha >= 0) || !std::isfinite(rpo_alpha))
    fail("--rpo-alpha must be >= 0 (got {}); the RPO paper recommends 1.0", rpo_alpha);
  if (rpo_alpha > 0 && !uses_reference(type))
    fail("--rpo-alpha weighs the chosen responses' NLL in the sigmoid and ipo losses; {} takes {}",
         preference_loss_type_name(type),
         type == PreferenceLossType::kOrpo ? "none (ORPO always adds the NLL with weight 1)"
                                           : "--cpo-alpha for that weight");
  if (!(cpo_alpha >= 0 || cpo_alpha == -1) || !std::isfinite(cpo_alpha))
    fail("--cpo-alpha must be >= 0 (got {}); 1 is CPO's, 0 SimPO's", cpo_alpha);
  if (cpo_alpha >= 0 && type != PreferenceLossType::kCpo && type != PreferenceLossType::kSimpo)
    fail("--cpo-alpha weighs the chosen responses' NLL in the cpo and simpo losses; {}",
         uses_reference(type) ? "the sigmoid and ipo losses take --rpo-alpha" : "ORPO always adds it with weight 1");
  if (!(simpo_gamma >= 0) || !std::isfinite(simpo_gamma))
    fail("--simpo-gamma must be >= 0 (got {}); SimPO's paper uses 0.5 to 1.6", simpo_gamma);
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

double log1mexp(double x) {
  // Two forms, each accurate on its side of −ln 2 (Mächler 2012), as TRL's ORPO computes it.
  return x < -0.6931471805599453 ? std::log1p(-std::exp(x)) : std::log(-std::expm1(x));
}

namespace {

// cpo, simpo and orpo: the policy's scores alone (sums, or per-token averages ā = π/n).
PairLoss reference_free_loss(const PairLogProbs& pair, const PreferenceLossOptions& o) {
  const double beta = o.beta;
  double chosen = pair.chosen.policy, rejected = pair.rejected.policy;
  double d_chosen_score = 1.0, d_rejected_score = 1.0;  // ∂score/∂π
  if (averages_log_probs(o.type)) {
    if (pair.chosen.tokens <= 0 || pair.rejected.tokens <= 0)
      fail("{} averages log-probabilities over each response's tokens, but a response has none (chosen {}, "
           "rejected {} supervised tokens)",
           preference_loss_type_name(o.type), pair.chosen.tokens, pair.rejected.tokens);
    d_chosen_score = 1.0 / static_cast<double>(pair.chosen.tokens);
    d_rejected_score = 1.0 / static_cast<double>(pair.rejected.tokens);
    chosen *= d_chosen_score;
    rejected *= d_rejected_score;
  }
  PairLoss out;
  out.score_chosen = chosen;
  out.score_rejected = rejected;
  out.reward_chosen = beta * chosen;
  out.reward_rejected = beta * rejected;
  double d_chosen = 0, d_rejected = 0;  // ∂ℓ/∂score
  if (o.type == PreferenceLossType::kOrpo) {
    // x = log odds(chosen) − log odds(rejected), odds(ā) = e^ā / (1 − e^ā).
    const double x = (chosen - rejected) - (log1mexp(chosen) - log1mexp(rejected));
    out.log_odds = x;
    out.log_odds_ratio = log_sigmoid(x);
    out.loss = -beta * out.log_odds_ratio;
    // ∂ℓ/∂x = −β·σ(−x); ∂x/∂ā_c = 1/(1 − e^ā_c), ∂x/∂ā_r = −1/(1 − e^ā_r).
    const double d_x = -beta * sigmoid(-x);
    d_chosen = d_x / -std::expm1(chosen);
    d_rejected = -d_x / -std::expm1(rejected);
  } else {
    const double h = chosen - rejected - (o.type == PreferenceLossType::kSimpo ? o.simpo_gamma / beta : 0.0);
    const double eps = o.label_smoothing;
    out.loss = -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h);
    const double d_h = -(1 - eps) * beta * sigmoid(-beta * h) + eps * beta * sigmoid(beta * h);
    d_chosen = d_h;
    d_rejected = -d_h;
  }
  out.d_chosen = d_chosen * d_chosen_score;
  out.d_rejected = d_rejected * d_rejected_score;
  return out;
}

}  // namespace

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
    case PreferenceLossType::kCpo:
    case PreferenceLossType::kSimpo:
    case PreferenceLossType::kOrpo:
      return reference_free_loss(pair, o);
  }
  out.score_chosen = pair.chosen.policy;
  out.score_rejected = pair.rejected.policy;
  return out;
}

std::array<double, PreferenceSums::kCount> PreferenceSums::to_array() const {
  return {pairs,   chosen_tokens,  pair_loss,       chosen_nll,     reward_chosen,  reward_rejected,
          correct, policy_chosen, policy_rejected, log_odds_ratio, log_odds_chosen};
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
  s.log_odds_ratio = v[9];
  s.log_odds_chosen = v[10];
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
    s.policy_chosen += term.score_chosen;
    s.policy_rejected += term.score_rejected;
    s.log_odds_ratio += term.log_odds_ratio;
    s.log_odds_chosen += term.log_odds;
    if (pair.chosen.prompt_tokens > 0) {  // orpo: the NLL over the chosen prompt's targets too
      s.chosen_tokens += static_cast<double>(pair.chosen.prompt_tokens);
      s.chosen_nll -= pair.chosen.prompt_policy;
    }
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
  const double alpha = options.nll_weight();
  m.loss = m.preference_loss + (alpha > 0 ? alpha * m.nll_loss : 0.0);
  m.rewards_chosen = t.reward_chosen * inv_p;
  m.rewards_rejected = t.reward_rejected * inv_p;
  m.margins = (t.reward_chosen - t.reward_rejected) * inv_p;
  m.accuracy = t.correct * inv_p;
  m.logps_chosen = t.policy_chosen * inv_p;
  m.logps_rejected = t.policy_rejected * inv_p;
  m.log_odds_ratio = t.log_odds_ratio * inv_p;
  m.log_odds_chosen = t.log_odds_chosen * inv_p;
  return m;
}

PairGradient preference_gradient(const PairLogProbs& pair, const PreferenceLossOptions& options,
                                 const PreferenceSums& totals) {
  SPINDLE_CHECK(totals.pairs > 0, "preference gradient with no pairs in the step");
  const PairLoss term = pair_preference_loss(pair, options);
  PairGradient g;
  g.d_chosen = term.d_chosen / totals.pairs;
  g.d_rejected = term.d_rejected / totals.pairs;
  // α·(−Σπ_c)/N_c: every chosen token's log-prob enters with −α/N_c (orpo: its prompt's too).
  const double alpha = options.nll_weight();
  if (alpha > 0) {
    SPINDLE_CHECK(totals.chosen_tokens > 0, "NLL term with no chosen tokens in the step");
    g.d_chosen -= alpha / totals.chosen_tokens;
    g.d_prompt = -alpha / totals.chosen_tokens;
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
