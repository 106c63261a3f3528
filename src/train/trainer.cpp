#include "train/trainer.h"

#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <iostream>
#include <fstream>
#include <regex>

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

int64_t peak_host_memory_bytes() {
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  return static_cast<int64_t>(usage.ru_maxrss) * 1024;  // Linux reports KiB
}

// "PATH" or "PATH:WEIGHT" (the weight only when what follows the last ':' is a number).
DataSource parse_data_spec(const std::string& spec) {
  const size_t colon = spec.rfind(':');
  if (colon != std::string::npos && colon + 1 < spec.size()) {
    const std::string tail = spec.substr(colon + 1);
    char* end = nullptr;
    const double weight = std::strtod(tail.c_str(), &end);
    if (end && *end == '\0') return {spec.substr(0, colon), weight};
  }
  return {spec, 1.0};
}

bool is_prepared(const fs::path& p) {
  return (fs::is_directory(p) && fs::exists(p / kPreparedDataFile)) || p.extension() == ".bin";
}

// JSONL inputs are tokenized once into OUTPUT/data/<name>; prepared datasets are used as they are.
fs::path prepared_path(const TrainConfig& config, const fs::path& input, const std::string& name,
                       const TextEncoder* encoder, bool announce) {
  if (is_prepared(input)) return input;
  if (!fs::exists(input)) fail("--data {} does not exist", input.string());
  PrepareOptions options;
  options.data = input;
  options.output_dir = fs::path(config.output) / "data" / name;
  options.fit.max_length = config.max_length;
  options.fit.over_length = parse_over_length(config.over_length);
  options.tokenizer_description = config.model;
  PrepareReport report = prepare_dataset(options, encoder);
  if (announce) std::fprintf(stderr, "%s: %s\n", input.string().c_str(), report.summary().c_str());
  return options.output_dir;
}

PackOptions pack_options(const TrainConfig& config) {
  PackOptions pack;
  pack.max_length = config.max_length;
  pack.packing = !config.no_packing;
  pack.over_length = parse_over_length(config.over_length);
  return pack;
}

struct Checkpointer {
  const TrainConfig& config;
  Backend& backend;
  ModelWeights& weights;
  AdamWOptimizer& optimizer;

  // OUTPUT/checkpoint-<step>: written under a temporary name and renamed when complete, so a crash
  // mid-save leaves the previous checkpoint as the latest.
  void save(int64_t step, const LoaderState& loader) {
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
    io::write_safetensors((tmp / "optimizer.safetensors").string(), optimizer.state_tensors(), backend);
    nlohmann::ordered_json state;
    state["step"] = step;
    state["optimizer_steps"] = optimizer.steps_taken();
    state["loader"] = loader.to_json();
    state["config"] = config.fingerprint();
    train::write_file_atomically(tmp / "trainer_state.json", state.dump(1));
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
  fs::create_directories(config.output);

  // Resume point, checked against this run's settings before any work.
  fs::path resume_from;
  nlohmann::json resume_state;
  if (config.resume) {
    resume_from = latest_checkpoint(config.output);
    if (resume_from.empty()) fail("--resume: no checkpoint in {} (checkpoints are written every --save-steps)", config.output);
    std::ifstream in(resume_from / "trainer_state.json");
    in >> resume_state;
    if (resume_state["config"] != config.fingerprint())
      fail("--resume: {} was written with other settings ({}); resume with the same model, data, max-length, "
           "grad-accum, seed and LoRA options",
           resume_from.string(), resume_state["config"].dump());
  }

  // Data.
  const bool has_tokenizer = fs::exists(fs::path(config.model) / "tokenizer.json");
  std::unique_ptr<TextEncoder> encoder = has_tokenizer ? load_text_encoder(config.model) : nullptr;
  std::vector<DataSource> sources;
  for (size_t i = 0; i < config.data.size(); ++i) {
    DataSource src = parse_data_spec(config.data[i]);
    src.path = prepared_path(config, src.path, fmt::format("train-{}", i), encoder.get(), true);
    sources.push_back(src);
  }
  const PackOptions pack = pack_options(config);
  TrainDataLoader loader(sources, pack, config.seed);
  std::fprintf(stderr, "%lld rows of up to %lld tokens per epoch\n", static_cast<long long>(loader.rows_per_epoch()),
               static_cast<long long>(config.max_length));
  std::vector<PackedRow> eval_rows;
  if (!config.eval_data.empty()) {
    const fs::path eval_path = prepared_path(config, config.eval_data, "eval", encoder.get(), true);
    PreparedDataset eval_set = PreparedDataset::open(eval_path);
    PackStats eval_stats;
    for (const RowPlan& plan : plan_prepared_rows(eval_set, pack, eval_stats))
      eval_rows.push_back(build_row(plan, [&](int64_t d) { return eval_set.document(d); }, pack, eval_stats));
  }

  // Model.
  const DType dtype = config.dtype == "f64" ? DType::F64 : DType::F32;
  auto backend = make_cpu_backend(config.threads);
  const ModelConfig model_config = ModelConfig::from_file(config.model);
  const fs::path weights_dir = !resume_from.empty() && config.full ? resume_from / "model" : fs::path(config.model);
  const io::Checkpoint source_checkpoint(config.model);
  // A full fine-tune is saved in the precision the user's model came in (bf16 usually).
  const io::TensorRecord* embed_record = source_checkpoint.find("model.embed_tokens.weight");
  const DType source_dtype = embed_record && is_float(embed_record->dtype) ? embed_record->dtype : DType::BF16;
  ModelWeights weights = ModelWeights::load(*backend, model_config, io::Checkpoint(weights_dir.string()), dtype);
  if (config.full) {
    weights.train_all(*backend);
  } else if (!resume_from.empty()) {
    weights.load_peft_adapter(*backend, (resume_from / "adapter").string());
  } else if (!config.adapter.empty()) {
    weights.load_peft_adapter(*backend, config.adapter);
  } else {
    LoraConfig lora;
    lora.rank = config.lora_rank;
    lora.alpha = config.lora_alpha;
    lora.rslora = config.rslora;
    lora.targets = config.lora_targets;
    weights.add_lora(*backend, lora, config.seed);
  }
  DecoderOptions decoder_options;
  if (config.recompute == "all") decoder_options.recompute.assign(model_config.num_layers, true);
  Decoder decoder(*backend, weights, decoder_options);
  AdamWOptimizer optimizer(*backend, weights,
                           {config.adam_beta1, config.adam_beta2, config.adam_eps, config.weight_decay, config.max_grad_norm});

  // Schedule.
  const int64_t steps_per_epoch =
      std::max<int64_t>(1, (loader.rows_per_epoch() + config.grad_accum - 1) / config.grad_accum);
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
  // A new run starts a new log; a resumed one keeps the lines up to its checkpoint.
  MetricsLog metrics = resume_from.empty() ? MetricsLog::start_new(metrics_path)
                                           : MetricsLog::resume(metrics_path, resume_state["step"].get<int64_t>());
  if (!resume_from.empty()) {
    step = resume_state["step"].get<int64_t>();
    loader.restore(LoaderState::from_json(resume_state["loader"]));
    io::Checkpoint state_file((resume_from / "optimizer.safetensors").string());
    for (auto& [name, tensor] : optimizer.state_tensors()) io::load_tensor_into(*backend, state_file.require(name, tensor.shape()), tensor);
    optimizer.set_steps_taken(resume_state["optimizer_steps"].get<int64_t>());
    std::fprintf(stderr, "resuming from %s at step %lld\n", resume_from.string().c_str(), static_cast<long long>(step));
  }
  Checkpointer checkpointer{config, *backend, weights, optimizer};

  train::ProgressOptions progress_options;
  progress_options.total_steps = total_steps;
  progress_options.log_every = config.log_every;
  progress_options.is_terminal = train::stderr_is_terminal();
  progress_options.terminal_columns = train::stderr_terminal_columns();
  train::ProgressDisplay progress(std::cerr, progress_options);
  int64_t total_tokens = 0;
  if (!resume_from.empty())
    for (const StepMetrics& m : metrics.read()) total_tokens += m.tokens;
  TrainSummary summary;
  summary.output = config.output;
  Tensor loss = backend->zeros(Shape{1}, stat_dtype(dtype));
  while (step < total_steps) {
    const auto step_start = std::chrono::steady_clock::now();
    // One optimizer step: all micro-batches first drawn, so the denominator N is known up front.
    std::vector<PackedRow> rows;
    int64_t num_items = 0, tokens = 0;
    for (int64_t m = 0; m < config.grad_accum; ++m) {
      rows.push_back(loader.next());
      num_items += rows.back().num_items();
      tokens += rows.back().length();
    }
    backend->fill(backend->default_stream(), loss, 0.0);
    weights.zero_grads(*backend);
    if (num_items > 0)
      for (const PackedRow& row : rows)
        decoder.step(make_micro_batch(*backend, {row}, dtype), 1.0 / static_cast<double>(num_items), loss, true);
    const double lr = learning_rate(schedule, step);
    const double grad_norm = optimizer.step(lr);
    ++step;

    StepMetrics m;
    m.step = step;
    m.loss = read_scalar(*backend, loss);
    m.grad_norm = grad_norm;
    m.lr = lr;
    m.num_items = num_items;
    m.tokens = tokens;
    total_tokens += tokens;
    m.total_tokens = total_tokens;
    m.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
    m.tokens_per_s = m.step_seconds > 0 ? static_cast<double>(tokens) / m.step_seconds : 0;
    m.peak_memory_bytes = peak_host_memory_bytes();
    m.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    m.epoch = loader.epochs_done();
    if (config.eval_steps > 0 && (step % config.eval_steps == 0 || step == total_steps) && !eval_rows.empty())
      m.eval_loss = evaluate(*backend, decoder, dtype, eval_rows, config.max_length).loss;
    metrics.append(m);
    progress.update(m);
    summary.final_loss = m.loss;
    if ((config.save_steps > 0 && step % config.save_steps == 0) || step == total_steps) {
      checkpointer.save(step, loader.state());
      if (step < total_steps) progress.message(fmt::format("checkpoint-{} saved", step));
    }
  }
  summary.steps = step;

  // Final outputs, loadable by transformers / PEFT: OUTPUT/model (full) or OUTPUT/adapter (LoRA).
  const fs::path final_dir = fs::path(config.output) / (config.full ? "model" : "adapter");
  if (config.full) {
    HfModelExportOptions options;
    options.dtype = source_dtype;
    save_hf_model(*backend, weights, config.model, final_dir, options);
  } else {
    save_peft_adapter(*backend, weights, final_dir, config.model);
  }
  progress.finish();
  std::vector<StepMetrics> history = metrics.read();
  fs::path plot = metrics_path;
  plot.replace_extension(".svg");
  train::write_loss_plot_svg(history, plot);
  train::write_run_summary(std::cerr, train::summarize_run(history), total_steps,
                           {{config.full ? "model" : "adapter", final_dir}, {"metrics", metrics_path}, {"loss plot", plot},
                            {"checkpoints", config.output}});
  return summary;
}

}  // namespace spindle
