// What a training run minimises, pluggable: the loop (training_loop.h) and `spindle check` own
// everything else of a run — the device and processes, the data, the assembled model
// (run_assembly.h), the optimizer, checkpoints, metrics, stop signals, exports — and call an
// objective for what one optimizer step computes over the items it drew.
//
// An Objective is the definition (SFT's cross-entropy, a preference loss with its options): what
// the loader must hand out (rows of documents, or rows of whole preference pairs), what it adds to
// a run's identity, and which models it needs beyond the policy. bind() gives the objective on one
// assembled policy (a run, or check's mesh, one-process and F64 models): an ObjectiveRunner, which
// holds what the loss needs per row (a reference model or its cached log-probabilities, pair ids)
// and computes the step.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "data/packing.h"
#include "data/prepared_dataset.h"
#include "model/config.h"
#include "train/data_loader.h"
#include "train/metrics.h"
#include "train/run_assembly.h"
#include "train/step_runner.h"
#include "train/train_config.h"

namespace spindle {

// What an objective computes on: the run's backend, its processes and mesh, its assembled policy
// and its options.
struct ObjectiveContext {
  Backend& backend;
  const RunTopology& run;
  AssembledRun& policy;
  const TrainConfig& config;
  bool resumed = false;  // the policy continues a checkpoint (a full fine-tune: its weights are no longer --model's)
};

// What one step (or one pass over the eval data) computed, over every rank.
struct ObjectiveStep {
  double loss = 0;         // the objective's loss (without the router loss, which aux_loss gives)
  int64_t num_items = 0;   // supervised targets of the step
  int64_t tokens = 0;      // real (unpadded) tokens of the step
  int64_t rows = 0;        // packed rows of the step
  std::optional<double> aux_loss;  // the router load-balancing loss, when the run trains with one
  std::optional<train::StepMetrics::Preference> preference;  // preference objectives' metrics
  std::optional<double> accuracy;  // evaluation of a preference objective: rewards/accuracies
};

// The data an objective reads besides the training loader.
struct ObjectiveData {
  const TrainDataLoader& train;
  std::filesystem::path eval;  // prepared --eval-data, or empty
  PackOptions pack;
  uint64_t seed = 0;
  int64_t items_per_step = 1;  // items of one optimizer step over every replica
};

class ObjectiveRunner {
 public:
  virtual ~ObjectiveRunner() = default;
  // Once, before the first step: the eval data, and whatever the loss precomputes (dpo: the
  // reference log-probabilities of every pair). Collective.
  virtual void prepare(const ObjectiveData& data) { (void)data; }
  // One optimizer step over `items` (every rank the same items in the same order; each computes its
  // share on the mesh). With backward, the trainable gradients (zeroed by the caller) hold ∂L/∂θ of
  // the whole step afterwards, summed over the ranks. Collective.
  virtual ObjectiveStep step(const std::vector<LoaderItem>& items, bool backward) = 0;
  // The loss over the eval data given to prepare, without gradients (nullopt: no eval data). Collective.
  virtual std::optional<ObjectiveStep> evaluate() = 0;
};

class Objective {
 public:
  virtual ~Objective() = default;
  // The command that trains it ("sft", "dpo"): the run's identity and messages name it.
  virtual std::string command() const = 0;
  // What the objective adds to the run's identity (run_folder.h) and to a checkpoint's fingerprint.
  virtual nlohmann::json identity_options() const { return nlohmann::json(); }
  virtual void add_fingerprint(nlohmann::json& fingerprint) const { (void)fingerprint; }
  virtual DatasetKind data_kind() const { return DatasetKind::kDocuments; }
  // Before any data or weight is touched: the objective's other models against --model's config
  // and, once the processes are connected, against the mesh. Throw Error naming the option.
  virtual void check_models(const ModelConfig& model) const { (void)model; }
  virtual void check_mesh(const TrainConfig& config, const RunTopology& run) const {
    (void)config;
    (void)run;
  }
  // Main rank: what the training data holds, once its loader is built.
  virtual void describe_data(const TrainDataLoader& loader, const TrainConfig& config) const;
  // The objective on one assembled policy.
  virtual std::unique_ptr<ObjectiveRunner> bind(const ObjectiveContext& context) const = 0;
};

// Supervised fine-tuning: Σ loss_scale·CE over the step's supervised targets / their number, one
// denominator over every rank and micro-batch (docs/design.md §2.2; step_runner.h).
class SftObjective final : public Objective {
 public:
  std::string command() const override { return "sft"; }
  std::unique_ptr<ObjectiveRunner> bind(const ObjectiveContext& context) const override;
};

}  // namespace spindle
