// Preference losses (DPO and relatives) on per-response log-probability sums, in double on the
// host: the inputs are a handful of numbers per pair (already reduced across sequence-parallel
// ranks), so nothing here touches a device tensor. docs/dpo.md has the formulas and their sources.
//
// Notation for pair i: π_c, π_r = policy log-probabilities of the chosen / rejected response summed
// over its supervised target tokens; ρ_c, ρ_r the same under the reference; n_c, n_r their token
// counts; P = pairs of the optimizer step, N_c = Σ n_c over those pairs.
//   sigmoid (DPO, conservative DPO with ε = label_smoothing):
//     h = (π_c − ρ_c) − (π_r − ρ_r),   ℓ = −(1−ε)·logσ(βh) − ε·logσ(−βh)
//   ipo (TRL's length-normalised form):
//     h = (π_c − ρ_c)/n_c − (π_r − ρ_r)/n_r,   ℓ = (h − 1/(2β))²
//   step loss:  L = (1/P)·Σ_i ℓ_i + rpo_alpha·(−Σ_i π_c,i)/N_c
// The RPO term is the chosen responses' NLL averaged over their tokens (a token mean over the
// step, as TRL's F.cross_entropy over the chosen tokens of the batch), not a per-pair mean.
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
};
// "sigmoid" (alias "dpo") or "ipo"; anything else is an error listing the choices.
PreferenceLossType parse_preference_loss_type(std::string_view name);
std::string_view preference_loss_type_name(PreferenceLossType type);

struct PreferenceLossOptions {
  PreferenceLossType type = PreferenceLossType::kSigmoid;
  double beta = 0.1;             // > 0; for IPO the regulariser τ
  double label_smoothing = 0.0;  // ε in [0, 0.5), sigmoid only: probability that a label is flipped
  double rpo_alpha = 0.0;        // ≥ 0; weight of the chosen responses' NLL (RPO); 0 disables it
  void validate() const;         // throws Error naming the option to change
};

// One response of a pair: log-probability sums over its supervised targets.
struct SequenceLogProb {
  double policy = 0;     // Σ_t log π(y_t | y_<t)
  double reference = 0;  // Σ_t log π_ref(y_t | y_<t)
  int64_t tokens = 0;    // supervised targets summed over (n)
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
  double reward_chosen = 0;    // β·(π_c − ρ_c)  (summed log-ratios, for every loss type, as TRL logs)
  double reward_rejected = 0;  // β·(π_r − ρ_r)
};
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
  double policy_chosen = 0;     // Σ π_c
  double policy_rejected = 0;   // Σ π_r
  static constexpr size_t kCount = 9;
  std::array<double, kCount> to_array() const;
  static PreferenceSums from_array(const std::array<double, kCount>& values);
};
PreferenceSums sum_preference_pairs(std::span<const PairLogProbs> pairs, const PreferenceLossOptions& options);

// What a run logs (TRL's names in brackets), all means over the step's pairs.
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
};
PreferenceMetrics preference_metrics(const PreferenceSums& totals, const PreferenceLossOptions& options);

// ∂L/∂π for one pair, given the step's totals P and N_c.
struct PairGradient {
  double d_chosen = 0;
  double d_rejected = 0;
};
PairGradient preference_gradient(const PairLogProbs& pair, const PreferenceLossOptions& options,
                                 const PreferenceSums& totals);

// Everything at once for pairs that are the whole step (one process, or already gathered).
struct PreferenceLossResult {
  PreferenceMetrics metrics;
  std::vector<PairGradient> gradients;  // one per pair
};
PreferenceLossResult preference_loss(std::span<const PairLogProbs> pairs, const PreferenceLossOptions& options);

// Numerically stable pieces, exposed for tests: log σ(x) = −softplus(−x) and σ(x).
double log_sigmoid(double x);
double sigmoid(double x);

}  // namespace spindle
