#include "train/trainer.h"

#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <fstream>
#include <optional>
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
#include "train/objective.h"
#include "train/optimizer.h"
#include "train/run_assembly.h"
#include "train/progress.h"
#include "train/run_common.h"
#include "train/loss_plot.h"
#include "train/schedule.h"
#include "train/setup.h"
#include "train/step_runner.h"
#include "train/stop_signal.h"
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

}  // namespace

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

TrainSummary run_training(const TrainConfig& config, const Objective& objective) {
  config.validate();
  const auto start = std::chrono::steady_clock::now();
  const ModelConfig model_config = ModelConfig::from_file(config.model);
  objective.check_models(model_config);
  // The device and the mesh are checked against the job and the model(s) before any data or weight is touched.
  const ComputeDevice device = choose_device(config, process_group_from_environment());
  RunTopology run = connect_training_run(config, model_config, device);
  objective.check_mesh(config, run);
  const parallel::MeshConfig& mesh = run.mesh_config;
  const bool main_rank = run.is_main();
  const int cpu_threads = effective_cpu_threads(threads_per_process(config, run));
  auto backend = make_backend(device, threads_per_process(config, run));
  nlohmann::json fingerprint = config.fingerprint();
  objective.add_fingerprint(fingerprint);
  if (mesh.dp > 1) fingerprint["data_parallel"] = mesh.dp;  // items per step = grad_accum · dp
  // The output folder checked and claimed, the resume point checked, JSONL tokenized: by the main
  // rank, before anything is loaded; an error there stops every rank.
  RunStart run_start =
      start_run(config, objective.command(), objective.identity_options(), fingerprint, run, *backend);
  const ResumePoint& resume = run_start.resume;
  const TrainingData& data = run_start.data;

  // Data: items (a row of documents, or the rows of whole preference pairs); one optimizer step
  // takes grad_accum items on each data-parallel replica.
  const PackOptions pack = pack_options(config);
  TrainDataLoader loader(data.sources, pack, config.seed, objective.data_kind());
  if (main_rank) objective.describe_data(loader, config);
  if (main_rank && run.world)
    std::fprintf(stderr, "%d processes: dp %d x sp %d (ulysses %d x ring %d), each on %s\n", run.world_size(), mesh.dp,
                 mesh.sp, mesh.ulysses, mesh.ring, device.describe().c_str());

  // The model (run_assembly.h), trained as the objective says.
  const DType source_dtype = export_dtype(config);
  const std::unique_ptr<AssembledRun> policy =
      assemble_run(*backend, describe_training_run(config, model_config, device.dtype, resume.dir),
                   RunPlacement{run.world.get(), run.mesh.get()});
  TrainableState& state = *policy->state;
  AdamWOptimizer& optimizer = state.optimizer();
  if (main_rank && run.world) std::fprintf(stderr, "%s\n", state.describe().c_str());
  const std::unique_ptr<ObjectiveRunner> steps = objective.bind({*backend, run, *policy, config, !resume.empty()});
  const int64_t items_per_step = config.grad_accum * mesh.dp;
  steps->prepare({loader, data.eval, pack, config.seed, items_per_step});

  const RunSchedule plan = plan_schedule(config, loader.rows_per_epoch(), items_per_step);
  const int64_t total_steps = plan.total_steps;
  int64_t step = resume.step();
  restore_run_state(resume, loader, state);
  if (main_rank && !resume.empty())
    std::fprintf(stderr, "resuming from %s at step %lld\n", resume.dir.string().c_str(), static_cast<long long>(step));
  note_thread_change(resume, *backend, cpu_threads, main_rank);
  RunReporter reporter(config, main_rank, total_steps, resume);
  for (const fs::path& file : reporter.created_files()) run_start.claim.created(file);
  RunCheckpointer checkpointer{config,      *backend,          policy->weights, state, fingerprint,
                               run_start.identity, cpu_threads, main_rank};

  TrainSummary summary;
  summary.output = config.output;
  run_start.claim.keep();  // training starts: what the run wrote stays
  StepBoundary boundary(config, *backend, run, checkpointer, reporter);
  try {
    while (step < total_steps) {
      const auto step_start = std::chrono::steady_clock::now();
      // One optimizer step: every rank draws all items of the global batch (the same ones) and takes its share.
      std::vector<LoaderItem> items;
      for (int64_t i = 0; i < items_per_step; ++i) items.push_back(loader.next_item());
      state.zero_grads();
      backend->reset_offload_stats();  // this step's copies only
      const ObjectiveStep outcome = steps->step(items, /*backward=*/true);
      const double lr = learning_rate(plan.lr, step);
      const double grad_norm = optimizer.step(lr);
      ++step;

      StepMetrics m;
      m.step = step;
      m.loss = outcome.loss;
      m.grad_norm = grad_norm;
      m.lr = lr;
      m.num_items = outcome.num_items;
      m.tokens = outcome.tokens;
      m.aux_loss = outcome.aux_loss;
      m.preference = outcome.preference;
      m.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      m.tokens_per_s = m.step_seconds > 0 ? static_cast<double>(m.tokens) / m.step_seconds : 0;
      const MemoryStats memory = backend->memory_stats();
      m.peak_memory_bytes = memory.peak_allocated_bytes;  // live tensors: the GPU pool on CUDA, tensor bytes on the CPU
      m.offload_host_bytes = memory.peak_host_allocated_bytes;  // --offload activations
      const OffloadStats copies = backend->offload_stats();
      m.offload_copy_bytes = copies.bytes;
      m.offload_copy_seconds = copies.copy_seconds;
      m.offload_wait_seconds = copies.wait_seconds;
      m.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      m.epoch = loader.epochs_done();
      if (config.eval_steps > 0 && (step % config.eval_steps == 0 || step == total_steps))
        if (const std::optional<ObjectiveStep> eval = steps->evaluate()) {
          m.eval_loss = eval->loss;
          m.eval_num_items = eval->num_items;
          m.eval_accuracy = eval->accuracy;
        }
      reporter.record(m);
      summary.final_loss = m.loss;
      summary.steps = step;
      if (boundary.after_step(step, total_steps, loader.state(), summary)) return summary;
    }
  } catch (...) {
    reporter.finish_failed(config, total_steps);  // the steps logged so far: their plot and summary
    throw;
  }
  summary.steps = step;

  // Final outputs, loadable by transformers / PEFT: OUTPUT/model (full) or OUTPUT/adapter (LoRA).
  const fs::path final_dir = export_trained(config, *backend, policy->weights, state, source_dtype, main_rank);
  reporter.finish(config, total_steps, final_dir);
  return summary;
}

TrainSummary run_sft(const TrainConfig& config) { return run_training(config, SftObjective()); }

}  // namespace spindle
