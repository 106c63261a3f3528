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
#include "train/stop_signal.h"
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

namespace {

ResumePoint read_resume_point(const TrainConfig& config) {
  ResumePoint resume;
  if (!config.resume) return resume;
  resume.dir = latest_checkpoint(config.output);
  if (resume.dir.empty())
    fail("--resume: no checkpoint in {} (checkpoints are written every --save-steps, on a stop signal and at the end)",
         config.output);
  const fs::path state_file = resume.dir / "trainer_state.json";
  std::ifstream in(state_file);
  resume.state = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (resume.state.is_discarded() || !resume.state.is_object() || !resume.state.contains("step"))
    fail("--resume: {} is damaged (not the JSON spindle writes); remove {} to resume from the checkpoint before it",
         state_file.string(), resume.dir.string());
  return resume;
}

}  // namespace

ResumePoint find_resume_point(const TrainConfig& config, const nlohmann::json& identity,
                              const nlohmann::json& fingerprint) {
  ResumePoint resume = read_resume_point(config);
  if (resume.empty()) return resume;
  // A checkpoint records its run's identity; one written by an earlier spindle, its settings alone.
  const bool has_identity = resume.state.contains("identity");
  const std::vector<std::string> changed =
      has_identity ? identity_differences(resume.state["identity"], identity)
                   : identity_differences(resume.state.value("config", nlohmann::json()), fingerprint);
  if (!changed.empty()) {
    std::string list;
    for (const std::string& line : changed) list += "\n  " + line;
    fail("--resume: {} was written by a run with other settings:{}\nresume with the settings the run was started "
         "with, or start this run in a new --output",
         resume.dir.string(), list);
  }
  if (has_identity && resume.state["identity"].value(kRunLength, nlohmann::json()) != identity.value(kRunLength, nlohmann::json()))
    std::fprintf(stderr,
                 "note: the run was started with other --max-steps or --epochs (%s, now %s): it continues to the "
                 "new length, and a decaying learning-rate schedule spans the new total from here\n",
                 resume.state["identity"][kRunLength].dump().c_str(), identity[kRunLength].dump().c_str());
  return resume;
}

RunStart start_run(const TrainConfig& config, const std::string& command, const nlohmann::json& command_options,
                   const nlohmann::json& fingerprint, const RunTopology& run, Backend& backend) {
  RunStart start;
  on_main_rank(backend, run, [&] {
    start.identity = run_identity(config, command, command_options, run.mesh_config.dp);
    check_run_output(config, start.identity);
    start.claim = RunOutputClaim(config, start.identity);
    start.resume = find_resume_point(config, start.identity, fingerprint);
    start.data = training_data(config, run, &start.claim);
  });
  if (!run.is_main()) {  // the main rank checked them: the others only read where they are
    start.resume = read_resume_point(config);
    start.data = training_data(config, run, nullptr);
  }
  return start;
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
  try {
    if (config.full) {
      HfModelExportOptions exact;
      exact.dtype = weights.dtype;  // resume must continue from the very same weights
      save_hf_model(backend, weights, config.model, tmp / "model", exact);
    } else {
      save_peft_adapter(backend, weights, tmp / "adapter", config.model, weights.dtype);  // exact resume
    }
    io::write_safetensors((tmp / "optimizer.safetensors").string(), optimizer_state, backend);
    nlohmann::ordered_json json;
    json["step"] = step;
    json["optimizer_steps"] = state.optimizer().steps_taken();
    json["loader"] = loader.to_json();
    json["config"] = fingerprint;
    json["identity"] = identity;
    json["cpu_threads"] = cpu_threads;
    train::write_file_atomically(tmp / "trainer_state.json", json.dump(1));
    fs::remove_all(final_dir);
    fs::rename(tmp, final_dir);
  } catch (...) {
    // A checkpoint that could not be written (a full disk) leaves nothing half-written behind.
    std::error_code error;
    fs::remove_all(tmp, error);
    throw;
  }
}

void note_thread_change(const ResumePoint& resume, const Backend& backend, int cpu_threads, bool main_rank) {
  if (resume.empty() || !main_rank || backend.device().kind != DeviceKind::CPU) return;
  const int64_t written_with = resume.state.value("cpu_threads", int64_t{0});
  if (written_with > 0 && written_with != cpu_threads)
    std::fprintf(stderr,
                 "note: %s was written by processes computing on %lld CPU threads, this one uses %d: the steps "
                 "from here differ from an uninterrupted run in their last bits (--threads %lld keeps them equal)\n",
                 resume.dir.string().c_str(), static_cast<long long>(written_with), cpu_threads,
                 static_cast<long long>(written_with));
}

StepBoundary::StepBoundary(const TrainConfig& config, Backend& backend, const RunTopology& run,
                           RunCheckpointer& checkpointer, RunReporter& reporter)
    : config_(config), backend_(backend), run_(run), checkpointer_(checkpointer), reporter_(reporter) {}

bool StepBoundary::after_step(int64_t step, int64_t total_steps, const LoaderState& loader, TrainSummary& summary) {
  const StopDecision stop = agree_to_stop(backend_, run_.world.get(), signals_.received());
  const bool stopping = stop.stop && step < total_steps;
  if ((config_.save_steps > 0 && step % config_.save_steps == 0) || step == total_steps || stopping) {
    checkpointer_.save(step, loader);
    if (run_.world) run_.world->barrier();
    reporter_.write_plot();
    if (step < total_steps && !stopping) reporter_.message(fmt::format("checkpoint-{} saved", step));
  }
  if (!stopping) return false;
  summary.stopped_by = stop.reason;
  summary.checkpoint = fs::path(config_.output) / fmt::format("checkpoint-{}", step);
  reporter_.finish_stopped(config_, total_steps, stop.reason, summary.checkpoint);
  return true;
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
  if (main_rank) {
    new_log_ = resume.empty() && !fs::exists(metrics_path_);
    metrics_.emplace(resume.empty() ? MetricsLog::start_new(metrics_path_) : MetricsLog::resume(metrics_path_, resume.step()));
  }
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

std::vector<fs::path> RunReporter::created_files() const {
  std::vector<fs::path> files;
  if (metrics_ && new_log_) files.push_back(metrics_path_);
  if (tensorboard_) files.push_back(tensorboard_->path());
  return files;
}

void RunReporter::record(StepMetrics& m) {
  total_tokens_ += m.tokens;
  m.total_tokens = total_tokens_;
  if (metrics_) metrics_->append(m);
  if (tensorboard_) tensorboard_->append(m);
  progress_->update(m);
}

fs::path RunReporter::plot_path() const {
  fs::path plot = metrics_path_;
  plot.replace_extension(".svg");
  return plot;
}

void RunReporter::write_plot() {
  if (metrics_) train::write_loss_plot_svg(metrics_->read(), plot_path());
}

std::vector<train::OutputLocation> RunReporter::outputs(const TrainConfig& config) const {
  std::vector<train::OutputLocation> outputs = {{"metrics", metrics_path_}, {"loss plot", plot_path()}};
  if (tensorboard_) outputs.push_back({"tensorboard", tensorboard_->path().parent_path()});
  return outputs;
}

void RunReporter::finish(const TrainConfig& config, int64_t total_steps, const fs::path& final_output) {
  if (!metrics_) return;
  progress_->finish();
  std::vector<StepMetrics> history = metrics_->read();
  train::write_loss_plot_svg(history, plot_path());
  std::vector<train::OutputLocation> locations = {{config.full ? "model" : "adapter", final_output}};
  if (!config.merge_output.empty()) locations.push_back({"merged model", config.merge_output});
  for (const train::OutputLocation& o : outputs(config)) locations.push_back(o);
  locations.push_back({"checkpoints", config.output});
  train::write_run_summary(std::cerr, train::summarize_run(history), total_steps, locations);
}

void RunReporter::finish_stopped(const TrainConfig& config, int64_t total_steps, const std::string& reason,
                                 const fs::path& checkpoint) {
  if (!metrics_) return;
  progress_->finish();
  std::vector<StepMetrics> history = metrics_->read();
  train::write_loss_plot_svg(history, plot_path());
  std::vector<train::OutputLocation> locations = {{"checkpoint", checkpoint}};
  for (const train::OutputLocation& o : outputs(config)) locations.push_back(o);
  train::write_run_summary(std::cerr, train::summarize_run(history), total_steps, locations);
  std::fprintf(stderr, "Stopped by %s: the same command with --resume continues from %s (exit status %d)\n",
               reason.c_str(), checkpoint.string().c_str(), kExitStoppedResumable);
}

void RunReporter::finish_failed(const TrainConfig& config, int64_t total_steps) noexcept {
  if (!metrics_) return;
  // The run's own error is what the user must see: one here (the disk that failed it is full) is dropped.
  try {
    progress_->finish();
    std::vector<StepMetrics> history = metrics_->read();
    if (history.empty()) return;
    std::vector<train::OutputLocation> locations = outputs(config);
    const fs::path checkpoint = latest_checkpoint(config.output);
    if (!checkpoint.empty()) locations.insert(locations.begin(), {"checkpoint", checkpoint});
    train::write_run_summary(std::cerr, train::summarize_run(history), total_steps, locations);
    train::write_loss_plot_svg(history, plot_path());
  } catch (const std::exception&) {
  }
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
