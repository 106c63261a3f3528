#include "train/run_common.h"

#include <sys/resource.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <iostream>
#include <regex>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/write_safetensors.h"
#include "model/config.h"
#include "train/export.h"
#include "train/loss_plot.h"
#include "train/trainer.h"

namespace spindle {

namespace fs = std::filesystem;
using train::MetricsLog;
using train::StepMetrics;

fs::path latest_checkpoint(const fs::path& output) {
  fs::path best;
  int64_t best_step = -1;
  if (!fs::is_directory(output)) return best;
  static const std::regex pattern("checkpoint-([0-9]+)");
  for (const auto& entry : fs::directory_iterator(output)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (!entry.is_directory() || !std::regex_match(name, m, pattern)) continue;
    if (!fs::exists(entry.path() / "trainer_state.json")) continue;
    const int64_t step = std::stoll(m[1]);
    if (step > best_step) {
      best_step = step;
      best = entry.path();
    }
  }
  return best;
}

ResumePoint find_resume_point(const TrainConfig& config, const nlohmann::json& fingerprint) {
  ResumePoint resume;
  if (!config.resume) return resume;
  resume.dir = latest_checkpoint(config.output);
  if (resume.dir.empty()) fail("--resume: no checkpoint in {} (checkpoints are written every --save-steps)", config.output);
  std::ifstream in(resume.dir / "trainer_state.json");
  in >> resume.state;
  if (resume.state["config"] != fingerprint)
    fail("--resume: {} was written with other settings ({}); resume with the same model, data, max-length, "
         "grad-accum, data-parallel degree, seed and LoRA options",
         resume.dir.string(), resume.state["config"].dump());
  return resume;
}

void restore_run_state(const ResumePoint& resume, TrainDataLoader& loader, TrainableState& state) {
  if (resume.empty()) return;
  loader.restore(LoaderState::from_json(resume.state["loader"]));
  state.load_optimizer_state(io::Checkpoint((resume.dir / "optimizer.safetensors").string()));
  state.optimizer().set_steps_taken(resume.state["optimizer_steps"].get<int64_t>());
}

void RunCheckpointer::save(int64_t step, const LoaderState& loader) {
  auto gathered = state.gather_for_export(/*all=*/config.full);
  const auto optimizer_state = state.optimizer_state_for_checkpoint();
  if (!main_rank) return;
  const fs::path final_dir = fs::path(config.output) / fmt::format("checkpoint-{}", step);
  const fs::path tmp = fs::path(config.output) / fmt::format(".checkpoint-{}.tmp.{}", step, getpid());
  fs::remove_all(tmp);
  fs::create_directories(tmp);
  if (config.full) {
    HfModelExportOptions exact;
    exact.dtype = weights.dtype;  // resume must continue from the very same weights
    save_hf_model(backend, weights, config.model, tmp / "model", exact);
  }
  else save_peft_adapter(backend, weights, tmp / "adapter", config.model, weights.dtype);  // exact resume
  io::write_safetensors((tmp / "optimizer.safetensors").string(), optimizer_state, backend);
  nlohmann::ordered_json json;
  json["step"] = step;
  json["optimizer_steps"] = state.optimizer().steps_taken();
  json["loader"] = loader.to_json();
  json["config"] = fingerprint;
  train::write_file_atomically(tmp / "trainer_state.json", json.dump(1));
  fs::remove_all(final_dir);
  fs::rename(tmp, final_dir);
}

RunSchedule plan_schedule(const TrainConfig& config, int64_t items_per_epoch, int64_t items_per_step) {
  const int64_t steps_per_epoch = std::max<int64_t>(1, (items_per_epoch + items_per_step - 1) / items_per_step);
  RunSchedule plan;
  plan.total_steps = config.max_steps > 0
                         ? config.max_steps
                         : std::max<int64_t>(1, static_cast<int64_t>(std::ceil(config.epochs * steps_per_epoch)));
  plan.lr.kind = parse_lr_schedule(config.lr_scheduler);
  plan.lr.peak_lr = config.lr;
  plan.lr.total_steps = plan.total_steps;
  plan.lr.warmup_steps = config.warmup_steps > 0
                             ? config.warmup_steps
                             : static_cast<int64_t>(std::ceil(config.warmup_ratio * plan.total_steps));
  return plan;
}

RunReporter::RunReporter(const TrainConfig& config, bool main_rank, int64_t total_steps, const ResumePoint& resume) {
  metrics_path_ = config.metrics_file.empty() ? fs::path(config.output) / "metrics.jsonl" : fs::path(config.metrics_file);
  // Only the main rank writes; a new run starts a new log, a resumed one keeps the lines up to its checkpoint.
  if (main_rank)
    metrics_.emplace(resume.empty() ? MetricsLog::start_new(metrics_path_) : MetricsLog::resume(metrics_path_, resume.step()));
  if (main_rank && !config.tensorboard.empty())
    tensorboard_.emplace(train::TensorBoardLog::start(config.tensorboard, resume.step()));
  train::ProgressOptions options;
  options.total_steps = total_steps;
  options.log_every = config.log_every;
  options.is_terminal = train::stderr_is_terminal();
  options.terminal_columns = train::stderr_terminal_columns();
  // Ranks other than the main one report nothing.
  progress_ = std::make_unique<train::ProgressDisplay>(main_rank ? static_cast<std::ostream&>(std::cerr) : silent_,
                                                       options);
  if (!resume.empty() && metrics_)
    for (const StepMetrics& m : metrics_->read()) total_tokens_ += m.tokens;
}

void RunReporter::record(StepMetrics& m) {
  total_tokens_ += m.tokens;
  m.total_tokens = total_tokens_;
  if (metrics_) metrics_->append(m);
  if (tensorboard_) tensorboard_->append(m);
  progress_->update(m);
}

void RunReporter::finish(const TrainConfig& config, int64_t total_steps, const fs::path& final_output) {
  if (!metrics_) return;
  progress_->finish();
  std::vector<StepMetrics> history = metrics_->read();
  fs::path plot = metrics_path_;
  plot.replace_extension(".svg");
  train::write_loss_plot_svg(history, plot);
  std::vector<train::OutputLocation> outputs = {{config.full ? "model" : "adapter", final_output},
                                                {"metrics", metrics_path_}, {"loss plot", plot}};
  if (tensorboard_) outputs.push_back({"tensorboard", tensorboard_->path().parent_path()});
  outputs.push_back({"checkpoints", config.output});
  train::write_run_summary(std::cerr, train::summarize_run(history), total_steps, outputs);
}

DType export_dtype(const TrainConfig& config) {
  if (config.random_weights) return DType::BF16;  // no checkpoint: an adapter in the dtype of GPU training
  const io::Checkpoint source_checkpoint(config.model);
  // The embedding under the family's prefix (a multimodal checkpoint's text tower is under model.language_model.).
  const std::string prefix = ModelConfig::from_file(config.model).weight_prefix;
  const io::TensorRecord* embed_record = source_checkpoint.find(prefix + "embed_tokens.weight");
  return embed_record && is_float(embed_record->dtype) ? embed_record->dtype : DType::BF16;
}

fs::path export_trained(const TrainConfig& config, Backend& backend, ModelWeights& weights, TrainableState& state,
                        DType source_dtype, bool main_rank) {
  const bool merge = !config.merge_output.empty();
  auto gathered = state.gather_for_export(/*all=*/config.full || merge);
  const fs::path final_dir = fs::path(config.output) / (config.full ? "model" : "adapter");
  if (!main_rank) return final_dir;
  if (config.full) {
    HfModelExportOptions options;
    options.dtype = source_dtype;
    save_hf_model(backend, weights, config.model, final_dir, options);
  } else {
    save_peft_adapter(backend, weights, final_dir, config.model);
  }
  if (merge) {  // base (a 4-bit one dequantised) + s·B·A, one dense model: BF16 from GPUs, F32 from the CPU
    HfModelExportOptions options;
    options.merge_lora = true;
    options.dtype = backend.device().kind == DeviceKind::CUDA ? DType::BF16 : DType::F32;
    save_hf_model(backend, weights, config.model, config.merge_output, options);
  }
  return final_dir;
}

}  // namespace spindle
