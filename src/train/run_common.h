// The parts of a training run that `spindle sft` and `spindle dpo` share around their steps: the
// resume point, checkpoints, the schedule, the metrics log and progress display, and the final
// export. Each run's loop (what one optimizer step computes) stays in its own file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "model/weights.h"
#include "train/data_loader.h"
#include "train/metrics.h"
#include "train/progress.h"
#include "train/schedule.h"
#include "train/tensorboard.h"
#include "train/train_config.h"
#include "train/trainable_state.h"

namespace spindle {


// Where a --resume run continues: the newest checkpoint of config.output, whose settings must
// equal `fingerprint` (an error naming what to keep otherwise). Empty without --resume.
struct ResumePoint {
  std::filesystem::path dir;  // OUTPUT/checkpoint-<step>, or empty for a new run
  nlohmann::json state;       // its trainer_state.json
  bool empty() const { return dir.empty(); }
  int64_t step() const { return empty() ? 0 : state["step"].get<int64_t>(); }
};
ResumePoint find_resume_point(const TrainConfig& config, const nlohmann::json& fingerprint);

// Continues a resumed run's loader and optimizer from its checkpoint (no-op for a new run).
void restore_run_state(const ResumePoint& resume, TrainDataLoader& loader, TrainableState& state);

// OUTPUT/checkpoint-<step>: written under a temporary name and renamed when complete, so a crash
// mid-save leaves the previous checkpoint as the latest. Collective (sharded state is gathered to
// the main rank, which writes the same files a single process writes: any mesh can resume it).
struct RunCheckpointer {
  const TrainConfig& config;
  Backend& backend;
  ModelWeights& weights;
  TrainableState& state;
  nlohmann::json fingerprint;
  bool main_rank;
  void save(int64_t step, const LoaderState& loader);
};

// Optimizer steps of the run (--max-steps, else --epochs over `items_per_epoch` with
// `items_per_step` drawn per step) and its learning-rate schedule.
struct RunSchedule {
  int64_t total_steps = 1;
  LrScheduleConfig lr;
};
RunSchedule plan_schedule(const TrainConfig& config, int64_t items_per_epoch, int64_t items_per_step);

// The metrics log (and, with --tensorboard, TensorBoard's event file) and the progress display of
// a run. Only the main rank writes logs and shows progress; the others keep the same calls silent.
class RunReporter {
 public:
  RunReporter(const TrainConfig& config, bool main_rank, int64_t total_steps, const ResumePoint& resume);
  // Adds the step's tokens to the run's total (resumed sessions included), writes and shows it.
  void record(train::StepMetrics& metrics);
  void message(const std::string& text) { progress_->message(text); }
  // Main rank: ends the progress display, writes the loss plot and the run summary naming
  // `final_output` (adapter or model folder).
  void finish(const TrainConfig& config, int64_t total_steps, const std::filesystem::path& final_output);

 private:
  std::filesystem::path metrics_path_;
  std::optional<train::MetricsLog> metrics_;
  std::optional<train::TensorBoardLog> tensorboard_;
  std::ostringstream silent_;
  std::unique_ptr<train::ProgressDisplay> progress_;
  int64_t total_tokens_ = 0;
};

// The dtype a full fine-tune is exported in: the precision the user's model came in (bf16 usually).
DType export_dtype(const TrainConfig& config);

// Collective. Final outputs, loadable by transformers / PEFT: OUTPUT/model (full) or OUTPUT/adapter
// (LoRA), written by the main rank. Returns that folder.
std::filesystem::path export_trained(const TrainConfig& config, Backend& backend, ModelWeights& weights,
                                     TrainableState& state, DType source_dtype, bool main_rank);

}  // namespace spindle
