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
#include "train/run_folder.h"
#include "train/setup.h"
#include "train/stop_signal.h"
#include "train/trainer.h"
#include "train/schedule.h"
#include "train/tensorboard.h"
#include "train/train_config.h"
#include "train/trainable_state.h"

namespace spindle {


// Where a --resume run continues: the newest checkpoint of config.output. Empty without --resume.
struct ResumePoint {
  std::filesystem::path dir;  // OUTPUT/checkpoint-<step>, or empty for a new run
  nlohmann::json state;       // its trainer_state.json
  bool empty() const { return dir.empty(); }
  int64_t step() const { return empty() ? 0 : state["step"].get<int64_t>(); }
};
// The checkpoint's settings must be this run's: its identity (run_folder.h), or for a checkpoint
// that records none, `fingerprint` (TrainConfig::fingerprint with the command's additions); an
// error naming what differs otherwise.
ResumePoint find_resume_point(const TrainConfig& config, const nlohmann::json& identity,
                              const nlohmann::json& fingerprint);

// How a run starts, the same for sft and dpo: this run's identity; on the main rank the output
// folder checked and claimed (run_folder.h), the resume point checked and the data tokenized; on
// every rank the resume point and the data's paths. Collective: an error on the main rank stops
// every rank.
struct RunStart {
  nlohmann::ordered_json identity;
  RunOutputClaim claim;  // main rank: undoes what the run created if it fails before training
  ResumePoint resume;
  TrainingData data;
};
RunStart start_run(const TrainConfig& config, const std::string& command, const nlohmann::json& command_options,
                   const nlohmann::json& fingerprint, const RunTopology& run, Backend& backend);

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
  nlohmann::ordered_json identity;
  int cpu_threads;  // recorded: on the CPU the last bits of a step depend on the thread count
  bool main_rank;
  void save(int64_t step, const LoaderState& loader);
};

// On resume, says when this process computes with another CPU thread count than the checkpoint's
// writer did (the steps then differ from an uninterrupted run in their last bits).
void note_thread_change(const ResumePoint& resume, const Backend& backend, int cpu_threads, bool main_rank);

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
  // Main rank: the loss plot of every step logged so far (after each checkpoint, and at the end).
  void write_plot();
  // Main rank: ends the progress display, writes the loss plot and the run summary naming
  // `final_output` (adapter or model folder) and, with --merge-output, the merged model.
  void finish(const TrainConfig& config, int64_t total_steps, const std::filesystem::path& final_output);
  // Main rank: the same for a run that stopped on a signal (`reason`) after saving `checkpoint`.
  void finish_stopped(const TrainConfig& config, int64_t total_steps, const std::string& reason,
                      const std::filesystem::path& checkpoint);
  // Main rank: the same for a run that failed during training: what it logged stays readable.
  void finish_failed(const TrainConfig& config, int64_t total_steps) noexcept;
  // The files this reporter created (the metrics log of a new run, a TensorBoard file).
  std::vector<std::filesystem::path> created_files() const;

 private:
  std::vector<train::OutputLocation> outputs(const TrainConfig& config) const;
  std::filesystem::path plot_path() const;

  std::filesystem::path metrics_path_;
  std::optional<train::MetricsLog> metrics_;
  std::optional<train::TensorBoardLog> tensorboard_;
  std::ostringstream silent_;
  std::unique_ptr<train::ProgressDisplay> progress_;
  int64_t total_tokens_ = 0;
  bool new_log_ = false;
};

// The end of every optimizer step of sft and dpo, collective: the ranks agree whether a stop signal
// came (stop_signal.h; watched from construction on), the checkpoint that is due is saved
// (--save-steps, the last step, or a stop), and the loss plot is brought up to date with it.
class StepBoundary {
 public:
  StepBoundary(const TrainConfig& config, Backend& backend, const RunTopology& run, RunCheckpointer& checkpointer,
               RunReporter& reporter);
  // After step `step` (1-based) was recorded. True when the run stops here: `summary` then says
  // why, the checkpoint is saved and the reporter has written the summary. A stop asked for during
  // the last step lets the run finish instead.
  bool after_step(int64_t step, int64_t total_steps, const LoaderState& loader, TrainSummary& summary);

 private:
  const TrainConfig& config_;
  Backend& backend_;
  const RunTopology& run_;
  RunCheckpointer& checkpointer_;
  RunReporter& reporter_;
  StopSignals signals_;
};

// The dtype a full fine-tune is exported in: the precision the user's model came in (bf16 usually).
DType export_dtype(const TrainConfig& config);

// Collective. Final outputs, loadable by transformers / PEFT: OUTPUT/model (full) or OUTPUT/adapter
// (LoRA), written by the main rank. Returns that folder.
std::filesystem::path export_trained(const TrainConfig& config, Backend& backend, ModelWeights& weights,
                                     TrainableState& state, DType source_dtype, bool main_rank);

}  // namespace spindle
