// The training loop, whatever the objective (sft's cross-entropy, dpo's preference losses): data →
// the objective's step over the drawn items (for sft: forward/backward with one global denominator
// per optimizer step, docs/design.md §2.2) → clipped AdamW → metrics, evaluation, checkpoints.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "data/packing.h"
#include "model/decoder.h"
#include "train/train_config.h"

namespace spindle {

// Σ loss_scale·CE / (number of supervised targets) over `rows`, forward only.
struct EvalResult {
  double loss = 0;
  int64_t num_items = 0;
  int64_t tokens = 0;
};
EvalResult evaluate(Backend& backend, Decoder& decoder, DType dtype, std::vector<PackedRow> rows, int64_t batch_tokens);

struct TrainSummary {
  int64_t steps = 0;
  double final_loss = 0;
  std::filesystem::path output;
  // A run stopped by a signal (stop_signal.h): why ("SIGTERM (rank 0)"), and the checkpoint it
  // saved, which --resume continues from; the command then exits with kExitStoppedResumable.
  std::string stopped_by;
  std::filesystem::path checkpoint;
  bool stopped() const { return !stopped_by.empty(); }
};

class Objective;

// The training loop of every objective (objective.h): runs a whole job as configured (resuming
// when config.resume), the model assembled once (run_assembly.h) and each optimizer step the
// objective's over the items drawn for it. Throws Error for bad configuration, inputs or output
// folder before the first step. From the first step on, SIGTERM, SIGINT and SIGUSR1 stop it after
// the step in progress, with a checkpoint (stop_signal.h).
TrainSummary run_training(const TrainConfig& config, const Objective& objective);

// A whole `spindle sft` job: run_training with SftObjective.
TrainSummary run_sft(const TrainConfig& config);

// The folder of the newest complete checkpoint in `output` (checkpoint-<step>), or empty.
std::filesystem::path latest_checkpoint(const std::filesystem::path& output);

}  // namespace spindle
