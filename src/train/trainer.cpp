#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <fstream>
#include <optional>
#include <regex>
#include <sstream>
#include <thread>

#include "core/error.h"
#include "data/prepared_dataset.h"
#include "data/sample_encoder.h"
#include "io/checkpoint.h"
#include "io/load_tensor.h"
#include "io/write_safetensors.h"
#include "train/data_loader.h"
#include "train/export.h"
#include "train/metrics.h"
#include "train/optimizer.h"
#include "train/progress.h"
#include "train/loss_plot.h"
#include "train/schedule.h"
#include "train/setup.h"
#include "train/step_runner.h"
#include "train/trainable_state.h"
#include "parallel/sp_attention.h"

namespace spindle {

namespace fs = std::filesystem;
using train::MetricsLog;
using train::StepMetrics;

namespace {

double read_scalar(Backend& backend, const Tensor& t) {
  if (t.dtype() == DType::F64) {
    double v;
    backend.copy_to_host(backend.default_stream(), t, &v);
    return v;
  }
  float v;
  backend.copy_to_host(backend.default_stream(), t, &v);
  return v;
}


struct Checkpointer {
  const TrainConfig& config;
  Backend& backend;
  ModelWeights& weights;
  TrainableState& state;
  nlohmann::json fingerprint;
  bool main_rank;

  // OUTPUT/checkpoint-<step>: written under a temporary name and renamed when complete, so a crash
  // mid-save leaves the previous checkpoint as the latest. Collective (sharded state is gathered to
  // the main rank, which writes the same files a single process writes: any mesh can resume it).
  void save(int64_t step, const LoaderState& loader) {
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
};

}  // namespace

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

EvalResult evaluate(Backend& backend, Decoder& decoder, DType dtype, std::vector<PackedRow> rows, int64_t batch_tokens) {
  EvalResult result;
  for (const PackedRow& r : rows) {
    result.num_items += r.num_items();
    result.tokens += r.length();
  }
  if (result.num_items == 0) return result;
  Tensor loss = backend.zeros(Shape{1}, stat_dtype(dtype));
  std::vector<PackedRow> group;
  int64_t group_tokens = 0;
  auto flush = [&] {
    if (group.empty()) return;
    decoder.step(make_micro_batch(backend, group, dtype), 1.0 / static_cast<double>(result.num_items), loss, false);
    group.clear();
    group_tokens = 0;
  };
  for (PackedRow& row : rows) {
    if (!group.empty() && group_tokens + row.length() > batch_tokens) flush();
    group_tokens += row.length();
    group.push_back(std::move(row));
  }
  flush();
  result.loss = read_scalar(backend, loss);
  return result;
}

TrainSummary run_sft(const TrainConfig& config) {
  config.validate();
  const auto start = std::chrono::steady_clock::now();
  const ModelConfig model_config = ModelConfig::from_file(config.model);
  // The device and the mesh are checked against the job and the model before any data or weight is touched.
  const ComputeDevice device = choose_device(config, process_group_from_environment());
  RunTopology run = connect_training_run(config, model_config, device);
  const parallel::MeshConfig& mesh = run.mesh_config;
  const bool main_rank = run.is_main();
  auto barrier = [&] {
    if (run.world) run.world->barrier();
  };
  if (main_rank) fs::create_directories(config.output);
  // Resume point, checked against this run's settings before any work.
  nlohmann::json fingerprint = config.fingerprint();
  if (mesh.dp > 1) fingerprint["data_parallel"] = mesh.dp;  // rows per step = grad_accum · dp
  fs::path resume_from;
  nlohmann::json resume_state;
  if (config.resume) {
    resume_from = latest_checkpoint(config.output);
    if (resume_from.empty()) fail("--resume: no checkpoint in {} (checkpoints are written every --save-steps)", config.output);
    std::ifstream in(resume_from / "trainer_state.json");
    in >> resume_state;
    if (resume_state["config"] != fingerprint)
      fail("--resume: {} was written with other settings ({}); resume with the same model, data, max-length, "
           "grad-accum, data-parallel degree, seed and LoRA options",
           resume_from.string(), resume_state["config"].dump());
  }

  // Data: the main rank tokenizes JSONL inputs once; the others wait and read the result.
  const TrainingData data = prepare_training_data(config, run);
  const PackOptions pack = pack_options(config);
  TrainDataLoader loader(data.sources, pack, config.seed);
  if (main_rank)
    std::fprintf(stderr, "%lld rows of up to %lld tokens per epoch\n", static_cast<long long>(loader.rows_per_epoch()),
                 static_cast<long long>(config.max_length));
  std::vector<PackedRow> eval_rows;
  if (!data.eval.empty()) {
    eval_rows = load_rows(data.eval, pack);
    // Every data-parallel replica scores the same number of rows (collectives inside each step).
    while (eval_rows.size() % mesh.dp) eval_rows.push_back(padding_row(parallel::sequence_multiple(mesh)));
  }
  if (main_rank && run.world)
    std::fprintf(stderr, "%d processes: dp %d x sp %d (ulysses %d x ring %d), each on %s\n", run.world_size(), mesh.dp,
                 mesh.sp, mesh.ulysses, mesh.ring, device.describe().c_str());

  // Model.
  const DType dtype = device.dtype;
  auto backend = make_backend(device, threads_per_process(config, run));
  const io::Checkpoint source_checkpoint(config.model);
  // A full fine-tune is saved in the precision the user's model came in (bf16 usually).
  const io::TensorRecord* embed_record = source_checkpoint.find("model.embed_tokens.weight");
  const DType source_dtype = embed_record && is_float(embed_record->dtype) ? embed_record->dtype : DType::BF16;
  // LoRA adapters start from --seed on every rank: identical initial adapters without a broadcast.
  ModelWeights weights = load_training_weights(*backend, config, model_config, resume_from, dtype);
  Decoder decoder(*backend, weights, decoder_options(config, model_config));
  std::unique_ptr<AttentionStrategy> sequence_attention;
  if (run.mesh && mesh.sp > 1) {
    sequence_attention = parallel::make_sequence_parallel_attention(*run.mesh, model_config);
    decoder.set_attention(sequence_attention.get());
  }
  // FSDP (default with several processes) shards parameters, gradients and AdamW state over all ranks.
  TrainableState state(*backend, weights, decoder, run, !config.no_fsdp,
                       {config.adam_beta1, config.adam_beta2, config.adam_eps, config.weight_decay, config.max_grad_norm});
  AdamWOptimizer& optimizer = state.optimizer();
  if (main_rank && run.world) std::fprintf(stderr, "%s\n", state.describe().c_str());
  StepRunner runner(*backend, decoder, weights, run.mesh.get(), state.all_reduce_gradients());

  // Schedule: one optimizer step takes grad_accum rows on each data-parallel replica.
  const int64_t rows_per_step = config.grad_accum * mesh.dp;
  const int64_t steps_per_epoch = std::max<int64_t>(1, (loader.rows_per_epoch() + rows_per_step - 1) / rows_per_step);
  const int64_t total_steps = config.max_steps > 0
                                  ? config.max_steps
                                  : std::max<int64_t>(1, static_cast<int64_t>(std::ceil(config.epochs * steps_per_epoch)));
  LrScheduleConfig schedule;
  schedule.kind = parse_lr_schedule(config.lr_scheduler);
  schedule.peak_lr = config.lr;
  schedule.total_steps = total_steps;
  schedule.warmup_steps = config.warmup_steps > 0 ? config.warmup_steps
                                                  : static_cast<int64_t>(std::ceil(config.warmup_ratio * total_steps));

  int64_t step = 0;
  const fs::path metrics_path = config.metrics_file.empty() ? fs::path(config.output) / "metrics.jsonl" : fs::path(config.metrics_file);
  // Only the main rank writes; a new run starts a new log, a resumed one keeps the lines up to its checkpoint.
  std::optional<MetricsLog> metrics;
  if (main_rank)
    metrics.emplace(resume_from.empty() ? MetricsLog::start_new(metrics_path)
                                        : MetricsLog::resume(metrics_path, resume_state["step"].get<int64_t>()));
  if (!resume_from.empty()) {
    step = resume_state["step"].get<int64_t>();
    loader.restore(LoaderState::from_json(resume_state["loader"]));
    state.load_optimizer_state(io::Checkpoint((resume_from / "optimizer.safetensors").string()));
    optimizer.set_steps_taken(resume_state["optimizer_steps"].get<int64_t>());
    if (main_rank)
      std::fprintf(stderr, "resuming from %s at step %lld\n", resume_from.string().c_str(), static_cast<long long>(step));
  }
  Checkpointer checkpointer{config, *backend, weights, state, fingerprint, main_rank};

  train::ProgressOptions progress_options;
  progress_options.total_steps = total_steps;
  progress_options.log_every = config.log_every;
  progress_options.is_terminal = train::stderr_is_terminal();
  progress_options.terminal_columns = train::stderr_terminal_columns();
  std::ostringstream silent;  // ranks other than the main one report nothing
  train::ProgressDisplay progress(main_rank ? static_cast<std::ostream&>(std::cerr) : silent, progress_options);
  int64_t total_tokens = 0;
  if (!resume_from.empty() && metrics)
    for (const StepMetrics& m : metrics->read()) total_tokens += m.tokens;
  TrainSummary summary;
  summary.output = config.output;
  while (step < total_steps) {
    const auto step_start = std::chrono::steady_clock::now();
    // One optimizer step: every rank draws all rows of the global batch (the same ones) and takes its share.
    std::vector<PackedRow> rows;
    for (int64_t m = 0; m < rows_per_step; ++m) rows.push_back(loader.next());
    state.zero_grads();
    const StepTotals totals = runner.run(rows, /*backward=*/true);
    const double lr = learning_rate(schedule, step);
    const double grad_norm = optimizer.step(lr);
    ++step;

    StepMetrics m;
    m.step = step;
    m.loss = totals.loss;
    m.grad_norm = grad_norm;
    m.lr = lr;
    m.num_items = totals.num_items;
    m.tokens = totals.tokens;
    total_tokens += totals.tokens;
    m.total_tokens = total_tokens;
    m.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    m.tokens_per_s = m.step_seconds > 0 ? static_cast<double>(totals.tokens) / m.step_seconds : 0;
    m.peak_memory_bytes = backend->memory_stats().peak_allocated_bytes;  // GPU pool on CUDA, RSS on the CPU
    m.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    m.epoch = loader.epochs_done();
    if (config.eval_steps > 0 && (step % config.eval_steps == 0 || step == total_steps) && !eval_rows.empty())
      m.eval_loss = runner.run(eval_rows, /*backward=*/false).loss;
    if (metrics) metrics->append(m);
    progress.update(m);
    summary.final_loss = m.loss;
    if ((config.save_steps > 0 && step % config.save_steps == 0) || step == total_steps) {
      checkpointer.save(step, loader.state());
      barrier();
      if (step < total_steps) progress.message(fmt::format("checkpoint-{} saved", step));
    }
  }
  summary.steps = step;

  // Final outputs, loadable by transformers / PEFT: OUTPUT/model (full) or OUTPUT/adapter (LoRA).
  auto gathered = state.gather_for_export(/*all=*/config.full);
  if (!main_rank) return summary;
  const fs::path final_dir = fs::path(config.output) / (config.full ? "model" : "adapter");
  if (config.full) {
    HfModelExportOptions options;
    options.dtype = source_dtype;
    save_hf_model(*backend, weights, config.model, final_dir, options);
  } else {
    save_peft_adapter(*backend, weights, final_dir, config.model);
  }
  progress.finish();
  std::vector<StepMetrics> history = metrics->read();
  fs::path plot = metrics_path;
  plot.replace_extension(".svg");
  train::write_loss_plot_svg(history, plot);
  train::write_run_summary(std::cerr, train::summarize_run(history), total_steps,
                           {{config.full ? "model" : "adapter", final_dir}, {"metrics", metrics_path}, {"loss plot", plot},
                            {"checkpoints", config.output}});
  return summary;
}

}  // namespace spindle
