// One optimizer step's worth of preference (DPO/IPO/RPO) micro-batches on a Decoder.
//
// The DPO gradient with respect to a response's summed log-probability π_s is one number c_s per
// response (preference_loss.h), and Decoder::step's backward of Σ_t w_t·CE_t is the gradient of
// −Σ_t w_t·log p_t. So the step is:
//   1. reference sums ρ_s: a forward without gradients with the LoRA adapters disabled, or with a
//      separate reference Decoder, or read from a cache computed once before training;
//   2. policy sums π_s: a forward without gradients (Decoder::step's per-token CE);
//   3. the per-response sums are added up across the sequence-parallel group (each rank holds part
//      of each response's tokens), then the loss and c_s are computed in double on the host;
//   4. a forward/backward with per-token weights w_t = −c_{s(t)}: its gradient is ∂L/∂θ (plus the
//      router loss's, for MoE models trained with it: its statistics come from step 2's forward).
// So a step costs one forward without gradients plus one forward/backward (plus the reference
// forward when it is not cached). The extra policy forward is the price of not keeping every
// micro-batch's activations until all sums of the step are known.
//
// Per-token sums are a small host step: each micro-batch's token CE vector ([num_selected] stat
// dtype) is copied back and added per response in double; the cross-rank reductions move 3 × 2P
// and 9 doubles (P = pairs in the step).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "data/document.h"
#include "loss/preference_loss.h"
#include "model/batch.h"
#include "model/decoder.h"
#include "model/router_aux_loss.h"
#include "model/weights.h"

namespace spindle {

// A response's identity in the step, independent of how its tokens are packed or split across
// ranks: pair p's chosen response is 2p, its rejected response 2p + 1. Pairs are numbered
// 0 .. num_pairs−1 within the step (across every rank of the sequence group).
inline int32_t preference_sequence_id(int64_t pair, bool rejected) {
  return static_cast<int32_t>(2 * pair + (rejected ? 1 : 0));
}

// A micro-batch plus, for each selected target, the response it belongs to. Under sequence
// parallelism a rank's shard carries the ids of its own selected targets: sharding moves the id
// with the token, as it moves positions.
struct PreferenceBatch {
  MicroBatch batch;
  std::vector<int32_t> selected_sequence;  // host [num_selected]: preference_sequence_id of each target
  // host [num_selected] or empty: 1 for a target of a chosen response's prompt, which only the NLL
  // term sees (orpo: supervise_chosen_prompts); its sequence id is the chosen response's.
  std::vector<uint8_t> selected_prompt;
};

// Builds the micro-batch from packed rows; row_sequences[r][d] is the sequence id of document d of
// row r (row.doc_ids index it). A dataset of kind kPreferencePairs stores pair i as documents 2i
// (chosen) and 2i+1 (rejected), so a document's id in the step is usually
// preference_sequence_id(pair index in the step, document is odd).
// token_prompt (optional): per row, per token, 1 where the target is a chosen prompt's (see above).
PreferenceBatch make_preference_batch(Backend& backend, const std::vector<PackedRow>& rows,
                                      const std::vector<std::vector<int32_t>>& row_sequences, DType model_dtype,
                                      const std::vector<std::vector<uint8_t>>* token_prompt = nullptr);

// orpo's NLL covers the chosen sequences' prompts, as TRL's ORPOTrainer computes it: in `row`,
// every position of a chosen response's document (an even sequence id in doc_sequence, indexed by
// the row's document index) whose target is ignored and whose next token is in the same document
// gets that token as its target (weight 1). Returns, per token, 1 where a target was added. Call it
// on whole rows, before they are sharded (shift before shard).
std::vector<uint8_t> supervise_chosen_prompts(PackedRow& row, const std::vector<int32_t>& doc_sequence);

// Maps each selected target of `batch` to its sequence through a per-token table
// (token_sequence[i] for token i of the batch; −1 where no response): copies batch.selected back.
std::vector<int32_t> selected_sequence_ids(Backend& backend, const MicroBatch& batch,
                                           std::span<const int32_t> token_sequence);

// While alive, every LoRA projection of `weights` has scaling 0, so the model computes exactly
// its base weights (the "adapter disabled" reference, without a second copy of the model). The
// previous scalings come back on destruction, also when an exception unwinds the scope.
class LoraDisabled {
 public:
  explicit LoraDisabled(ModelWeights& weights);  // throws Error when the model has no adapters
  ~LoraDisabled();
  LoraDisabled(const LoraDisabled&) = delete;
  LoraDisabled& operator=(const LoraDisabled&) = delete;

 private:
  ModelWeights& weights_;
  std::vector<double> saved_;  // lora_scaling of each Linear, in layer and projection order, then each
                               // expert LoRA's scaling (ModelWeights::expert_loras)
};

// Per-response sums for one step: index preference_sequence_id(pair, rejected).
struct SequenceSums {
  std::vector<double> log_prob;  // [2P] Σ_t log p(target_t)
  std::vector<double> tokens;    // [2P] supervised targets (as doubles: they travel in one reduction)
};

// Forward without gradients over `batches`, summing log p per response; with `group`, the sums of
// every rank of the group are added (all ranks call it with their own shards, same number of
// micro-batches). Use it to precompute a reference cache once.
SequenceSums sequence_log_probs(Backend& backend, Decoder& model, std::span<const PreferenceBatch> batches,
                                int64_t num_pairs, comm::Communicator* group = nullptr);

// Where the reference log-probabilities come from.
struct ReferenceSource {
  enum class Kind {
    kAdapterDisabled,  // the policy with its LoRA adapters disabled (new adapters: the base model)
    kCache,            // precomputed, already reduced over the group: cache[2p], cache[2p+1]
    kModel,            // a separate reference Decoder run on the same micro-batches
  };
  Kind kind = Kind::kAdapterDisabled;
  std::span<const double> cache;  // [2P] for kCache
  Decoder* model = nullptr;       // for kModel

  static ReferenceSource adapter_disabled() { return {}; }
  static ReferenceSource cached(std::span<const double> sums) { return {Kind::kCache, sums, nullptr}; }
  static ReferenceSource separate(Decoder& reference) { return {Kind::kModel, {}, &reference}; }
};

struct PreferenceStepOptions {
  PreferenceLossOptions loss;
  int64_t num_pairs = 0;  // P: pair ids of this step are 0 .. P−1 (every response must have a target)
  // Ranks holding parts of the same responses: their partial sums are added before the loss. The
  // sequence-parallel group, or the whole dp × sp world when pairs are numbered across DP ranks.
  comm::Communicator* sequence_group = nullptr;
  // Ranks holding disjoint pairs numbered independently (the data-parallel group when
  // sequence_group is the SP group): the step totals (pair and chosen-token counts, metric sums)
  // are added over it, so the loss is the mean over every pair of the step. Null when
  // sequence_group already spans all ranks of the step. Never both spanning the same ranks.
  comm::Communicator* pair_group = nullptr;
  bool backward = true;  // false: loss and metrics only (evaluation, finite differences)
  // Training steps of MoE models: the router load-balancing loss (model/router_aux_loss.h) over the
  // step's `step_tokens` real tokens (every row of every rank, prompts included, as transformers
  // counts the tokens of DPO's concatenated forward), its statistics collected by the policy's
  // forward pass and summed over sequence_group and pair_group. The policy decoder must compute
  // with it. Null: none.
  RouterAuxLoss* router_aux = nullptr;
  int64_t step_tokens = 0;
};

struct PreferenceStepResult {
  PreferenceMetrics metrics;        // of the whole step (after both reductions)
  std::vector<PairLogProbs> pairs;  // [P] this sequence group's pairs, reduced
  std::optional<double> aux_loss;   // the router loss of the step (without its coefficient), when trained with one
};

// Runs the step; with options.backward, adds ∂L/∂θ into the trainable parameters' grads (callers
// zero them first, as for SFT; across ranks the gradients then add up, as for SFT). `policy`
// must compute with `policy_weights` (the adapter-disabled reference switches their scalings).
// Losses without a reference (cpo, simpo, orpo) run no reference pass: `reference` is not used.
PreferenceStepResult preference_step(Backend& backend, Decoder& policy, ModelWeights& policy_weights,
                                     std::span<const PreferenceBatch> batches, const ReferenceSource& reference,
                                     const PreferenceStepOptions& options);

}  // namespace spindle
