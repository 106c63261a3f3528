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
#include "train/optimizer.h"
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

TrainSummary run_sft(const TrainConfig& config) {
  config.validate();
  const auto start = std::chrono::steady_clock::now();
  const ModelConfig model_config = ModelConfig::from_file(config.model);
  // The device and the mesh are checked against the job and the model before any data or weight is touched.
  const ComputeDevice device = choose_device(config, process_group_from_environment());
  RunTopology run = connect_training_run(config, model_config, device);
  const parallel::MeshConfig& mesh = run.mesh_config;
  const bool main_rank = run.is_main();
  const int cpu_threads = effective_cpu_threads(threads_per_process(config, run));
  auto backend = make_backend(device, threads_per_process(config, run));
  nlohmann::json fingerprint = config.fingerprint();
  if (mesh.dp > 1) fingerprint["data_parallel"] = mesh.dp;  // rows per step = grad_accum · dp
  // The output folder checked and claimed, the resume point checked, JSONL tokenized: by the main
  // rank, before anything is loaded; an error there stops every rank.
  RunStart run_start = start_run(config, "sft", nlohmann::json(), fingerprint, run, *backend);
  const ResumePoint& resume = run_start.resume;
  const TrainingData& data = run_start.data;

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
  const DType source_dtype = export_dtype(config);
  // LoRA adapters start from --seed on every rank: identical initial adapters without a broadcast.
  ModelWeights weights = load_training_weights(*backend, config, model_config, resume.dir, dtype);
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
  runner.set_router_aux_loss(router_aux_loss_coefficient(model_config, config.router_aux_loss_coef));

  // Schedule: one optimizer step takes grad_accum rows on each data-parallel replica.
  const int64_t rows_per_step = config.grad_accum * mesh.dp;
  const RunSchedule plan = plan_schedule(config, loader.rows_per_epoch(), rows_per_step);
  const int64_t total_steps = plan.total_steps;

  int64_t step = resume.step();
  restore_run_state(resume, loader, state);
  if (main_rank && !resume.empty())
    std::fprintf(stderr, "resuming from %s at step %lld\n", resume.dir.string().c_str(), static_cast<long long>(step));
  note_thread_change(resume, *backend, cpu_threads, main_rank);
  RunReporter reporter(config, main_rank, total_steps, resume);
  for (const fs::path& file : reporter.created_files()) run_start.claim.created(file);
  RunCheckpointer checkpointer{config, *backend, weights, state, fingerprint, run_start.identity, cpu_threads, main_rank};

  TrainSummary summary;
  summary.output = config.output;
  run_start.claim.keep();  // training starts: what the run wrote stays
  StepBoundary boundary(config, *backend, run, checkpointer, reporter);
  try {
    while (step < total_steps) {
      const auto step_start = std::chrono::steady_clock::now();
      // One optimizer step: every rank draws all rows of the global batch (the same ones) and takes its share.
      std::vector<PackedRow> rows;
      for (int64_t m = 0; m < rows_per_step; ++m) rows.push_back(loader.next());
      state.zero_grads();
      backend->reset_offload_stats();  // this step's copies only
      const StepTotals totals = runner.run(rows, /*backward=*/true);
      const double lr = learning_rate(plan.lr, step);
      const double grad_norm = optimizer.step(lr);
      ++step;

      StepMetrics m;
      m.step = step;
      m.loss = totals.loss;
      m.grad_norm = grad_norm;
      m.lr = lr;
      m.num_items = totals.num_items;
      m.tokens = totals.tokens;
      m.aux_loss = totals.aux_loss;
      m.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      m.tokens_per_s = m.step_seconds > 0 ? static_cast<double>(totals.tokens) / m.step_seconds : 0;
      const MemoryStats memory = backend->memory_stats();
      m.peak_memory_bytes = memory.peak_allocated_bytes;  // live tensors: the GPU pool on CUDA, tensor bytes on the CPU
      m.offload_host_bytes = memory.peak_host_allocated_bytes;  // --offload activations
      const OffloadStats copies = backend->offload_stats();
      m.offload_copy_bytes = copies.bytes;
      m.offload_copy_seconds = copies.copy_seconds;
      m.offload_wait_seconds = copies.wait_seconds;
      m.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      m.epoch = loader.epochs_done();
      if (config.eval_steps > 0 && (step % config.eval_steps == 0 || step == total_steps) && !eval_rows.empty()) {
        const StepTotals eval = runner.run(eval_rows, /*backward=*/false);
        m.eval_loss = eval.loss;
        m.eval_num_items = eval.num_items;
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
  const fs::path final_dir = export_trained(config, *backend, weights, state, source_dtype, main_rank);
  reporter.finish(config, total_steps, final_dir);
  return summary;
}

}  // namespace spindle
