// The preference-training loop (`spindle dpo`): the same data preparation, mesh, FSDP,
// checkpoints, metrics and exports as `spindle sft` (run_common.h), with one optimizer step being
// a preference step (preference_step.h) over rows of whole chosen/rejected pairs. docs/dpo.md.
//
// Under a dp × sp mesh every rank draws the same items (rows of whole pairs) of the step; row j
// goes to replica j mod dp and each row is cut to this rank's sequence shard. A response's id
// (2·pair + side, pairs numbered over the whole step) travels with its tokens into the shard, so
// the per-response log-probability sums of all ranks add up over the world before the sigmoid:
// the loss and gradients are those of one process on the same step.
#pragma once

#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "loss/preference_loss.h"
#include "train/objective.h"
#include "train/train_config.h"
#include "train/trainer.h"

namespace spindle {

// Every option of `spindle dpo`: those of `spindle sft` plus the loss and the reference (none for
// the losses without one: cpo, simpo, orpo).
struct DpoConfig {
  TrainConfig train;
  std::string loss_type = "sigmoid";  // sigmoid (DPO) | ipo | cpo | simpo | orpo (loss/preference_loss.h)
  double beta = 0.1;
  double label_smoothing = 0.0;
  double rpo_alpha = 0.0;
  double cpo_alpha = -1;     // cpo, simpo: weight of the chosen responses' NLL (-1: 1 for cpo, 0 for simpo)
  double simpo_gamma = 0.5;  // simpo: the target reward margin
  // Reference log-probabilities: by default the policy with its LoRA adapters disabled (the base
  // model); with --full, the initial model, precomputed. ref_model: a separate model folder instead.
  std::string ref_model;
  bool precompute_ref = false;  // compute them once before training and cache them per pair

  PreferenceLossOptions loss_options() const;
  void validate() const;               // throws Error naming the option to change
  void validate_preference() const;    // the loss and reference options alone
  nlohmann::json fingerprint() const;  // with TrainConfig's: what a resumed run must share
  // What dpo adds to a run's identity (run_folder.h): the loss options, and the reference by contents.
  nlohmann::json identity_options() const;
};

// The preference losses as an objective of the training loop (objective.h): rows of whole pairs,
// the reference per dpo's options, the step of preference_step.h.
class DpoObjective final : public Objective {
 public:
  explicit DpoObjective(DpoConfig config);
  std::string command() const override { return "dpo"; }
  nlohmann::json identity_options() const override;
  void add_fingerprint(nlohmann::json& fingerprint) const override;
  DatasetKind data_kind() const override { return DatasetKind::kPreferencePairs; }
  void check_models(const ModelConfig& model) const override;
  void check_mesh(const TrainConfig& config, const RunTopology& run) const override;
  void describe_data(const TrainDataLoader& loader, const TrainConfig& config) const override;
  std::unique_ptr<ObjectiveRunner> bind(const ObjectiveContext& context) const override;

 private:
  DpoConfig config_;
};

// Runs a whole `spindle dpo` job (resuming when config.train.resume). Throws Error for bad
// configuration or data before any training work.
TrainSummary run_dpo(const DpoConfig& config);

}  // namespace spindle
