// Preference losses (DPO and relatives) on per-response log-probability sums, in double on the
// host: the inputs are a handful of numbers per pair (already reduced across sequence-parallel
// ranks), so nothing here touches a device tensor. docs/dpo.md has the formulas and their sources.
//
// Notation for pair i: π_c, π_r = policy log-probabilities of the chosen / rejected response summed
// over its supervised target tokens; ρ_c, ρ_r the same under the reference; n_c, n_r their token
// counts, ā = π/n the per-token averages; P = pairs of the optimizer step, N_c = Σ n_c over those
// pairs (for orpo also the chosen prompts' targets, whose log-probabilities add to −Σπ_c).
//   sigmoid (DPO, conservative DPO with ε = label_smoothing):
//     h = (π_c − ρ_c) − (π_r − ρ_r),   ℓ = −(1−ε)·logσ(βh) − ε·logσ(−βh)
//   ipo (TRL's length-normalised form):
//     h = (π_c − ρ_c)/n_c − (π_r − ρ_r)/n_r,   ℓ = (h − 1/(2β))²
//   Without a reference model (TRL's CPOTrainer and ORPOTrainer):
//   cpo (CPO, sigmoid on summed log-probabilities):
//     h = π_c − π_r,   ℓ = −(1−ε)·logσ(βh) − ε·logσ(−βh)
//   simpo (SimPO; CPO-SimPO with an NLL weight): length-normalised with a target margin γ
//     h = ā_c − ā_r − γ/β,   ℓ = −(1−ε)·logσ(βh) − ε·logσ(−βh)
//   orpo (ORPO's odds ratio, λ = β):
//     x = (ā_c − ā_r) − (log(1 − e^ā_c) − log(1 − e^ā_r)),   ℓ = −β·logσ(x)
//   step loss:  L = (1/P)·Σ_i ℓ_i + α·(−Σ_i π_c,i)/N_c
// with α the NLL weight: rpo_alpha (sigmoid, ipo), cpo_alpha (cpo, simpo), 1 (orpo). The NLL term is
// the chosen sequences' NLL averaged over their tokens (a token mean over the step, as TRL's
// cross-entropy over the chosen tokens of the batch), not a per-pair mean; for orpo its tokens are
// the prompt's and the response's, as TRL's ORPOTrainer computes it.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

namespace spindle {

enum class PreferenceLossType {
  kSigmoid,  // DPO (Rafailov et al. 2023); with label_smoothing, conservative DPO (Mitchell 2023)
  kIpo,      // IPO (Azar et al. 2023, eq. 17) on per-token averaged log-ratios, as TRL computes it
  kCpo,      // CPO (Xu et al. 2024): no reference, TRL's CPOTrainer loss_type "sigmoid"
  kSimpo,    // SimPO (Meng et al. 2024): no reference, TRL's CPOTrainer loss_type "simpo"
  kOrpo,     // ORPO (Hong et al. 2024): no reference, TRL's ORPOTrainer
};
// Whether the loss compares the policy with a reference model (sigmoid, ipo) or with nothing.
bool uses_reference(PreferenceLossType type);
// Whether the per-response score is the per-token average ā (ipo's log-ratios, simpo, orpo) or the sum.
bool averages_log_probs(PreferenceLossType type);
// "sigmoid" (alias "dpo"), "ipo", "cpo", "simpo" or "orpo"; anything else is an error listing the choices.
PreferenceLossType parse_preference_loss_type(std::string_view name);
std::string_view preference_loss_type_name(PreferenceLossType type);

struct PreferenceLossOptions {
  PreferenceLossType type = PreferenceLossType::kSigmoid;
  double beta = 0.1;             // > 0; for IPO the regulariser τ, for ORPO its λ
  double label_smoothing = 0.0;  // ε in [0, 0.5), sigmoid, cpo and simpo: probability that a label is flipped
  double rpo_alpha = 0.0;        // ≥ 0; weight of the chosen responses' NLL (RPO; sigmoid and ipo); 0 disables it
  double cpo_alpha = -1;         // ≥ 0; cpo and simpo: weight of the chosen responses' NLL; -1: 1 for cpo, 0 for simpo
  double simpo_gamma = 0.5;      // ≥ 0; simpo: the target reward margin γ
  void validate() const;         // throws Error naming the option to change
  // α of the step loss: rpo_alpha, cpo_alpha (or its default), or 1 for orpo.
  double nll_weight() const;
};

// One response of a pair: log-probability sums over its supervised targets.
struct SequenceLogProb {
  double policy = 0;     // Σ_t log π(y_t | y_<t)
  double reference = 0;  // Σ_t log π_ref(y_t | y_<t)
  int64_t tokens = 0;    // supervised targets summed over (n)
  // orpo's chosen side: Σ log π over the prompt's own targets and their count (NLL term only).
  double prompt_policy = 0;
  int64_t prompt_tokens = 0;
};
struct PairLogProbs {
  SequenceLogProb chosen, rejected;
};

// Pair i's preference term ℓ_i and its derivatives with respect to the policy sums. The RPO term
// and the 1/P of the mean are not included: they need the step's totals.
struct PairLoss {
  double loss = 0;
  double d_chosen = 0;    // ∂ℓ/∂π_c
  double d_rejected = 0;  // ∂ℓ/∂π_r
  double reward_chosen = 0;    // β·(π_c − ρ_c)  (summed log-ratios for sigmoid and ipo, as TRL logs); β·score without reference
  double reward_rejected = 0;  // β·(π_r − ρ_r)
  double score_chosen = 0;     // what the loss compares of the policy: π_c, or ā_c (simpo, orpo)
  double score_rejected = 0;
  double log_odds = 0;         // orpo: x
  double log_odds_ratio = 0;   // orpo: logσ(x)
};
// (Rewards without a reference: β·score, the score being π or ā as the loss uses it.)
PairLoss pair_preference_loss(const PairLogProbs& pair, const PreferenceLossOptions& options);

// Additive totals over a set of pairs: ranks holding disjoint pairs (data parallel) add these
// element-wise (as doubles) and get the totals of the whole step.
struct PreferenceSums {
  double pairs = 0;
  double chosen_tokens = 0;     // N_c
  double pair_loss = 0;         // Σ ℓ_i
  double chosen_nll = 0;        // −Σ π_c
  double reward_chosen = 0;     // Σ β(π_c − ρ_c)
  double reward_rejected = 0;   // Σ β(π_r − ρ_r)
  double correct = 0;           // pairs with reward_chosen > reward_rejected (strictly)
  double policy_chosen = 0;     // Σ π_c (ā_c when the loss averages)
  double policy_rejected = 0;   // Σ π_r (ā_r)
  double log_odds_ratio = 0;    // orpo: Σ logσ(x)
  double log_odds_chosen = 0;   // orpo: Σ x
  static constexpr size_t kCount = 11;
  std::array<double, kCount> to_array() const;
  static PreferenceSums from_array(const std::array<double, kCount>& values);
};
PreferenceSums sum_preference_pairs(std::span<const PairLogProbs> pairs, const PreferenceLossOptions& options);

// What a run logs (TRL's names in brackets), all means over the step's pairs. The log-probabilities
// are the scores the loss compares: sums, or per-token averages for simpo and orpo (TRL logs those).
struct PreferenceMetrics {
  double loss = 0;             // L
  double preference_loss = 0;  // (1/P)·Σ ℓ_i
  double nll_loss = 0;         // −Σ π_c / N_c  [nll_loss]; reported whether or not rpo_alpha > 0
  double rewards_chosen = 0;   // [rewards/chosen]
  double rewards_rejected = 0; // [rewards/rejected]
  double margins = 0;          // [rewards/margins]
  double accuracy = 0;         // [rewards/accuracies]
  double logps_chosen = 0;     // [logps/chosen]
  double logps_rejected = 0;   // [logps/rejected]
  int64_t pairs = 0;
  double log_odds_ratio = 0;   // orpo: [log_odds_ratio] mean logσ(x)
  double log_odds_chosen = 0;  // orpo: [log_odds_chosen] mean x
};
PreferenceMetrics preference_metrics(const PreferenceSums& totals, const PreferenceLossOptions& options);

// ∂L/∂π for one pair, given the step's totals P and N_c; d_prompt for each target of the chosen
// prompt, which only the NLL term sees (orpo).
struct PairGradient {
  double d_chosen = 0;
  double d_rejected = 0;
  double d_prompt = 0;
};
PairGradient preference_gradient(const PairLogProbs& pair, const PreferenceLossOptions& options,
                                 const PreferenceSums& totals);

// Everything at once for pairs that are the whole step (one process, or already gathered).
struct PreferenceLossResult {
  PreferenceMetrics metrics;
  std::vector<PairGradient> gradients;  // one per pair
};
PreferenceLossResult preference_loss(std::span<const PairLogProbs> pairs, const PreferenceLossOptions& options);

// Numerically stable pieces, exposed for tests: log σ(x) = −softplus(−x), σ(x), and log(1 − e^x) for x < 0.
double log_sigmoid(double x);
double sigmoid(double x);
double log1mexp(double x);

}  // namespace spindle
