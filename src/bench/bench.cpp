#include "bench/bench.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <numeric>
#include <random>

#include "backend/cuda/cuda_options.h"
#include "bench/device_timer.h"
#include "bench/flops.h"
#include "bench/timed_backend.h"
#include "comm/communicator.h"
#include "core/error.h"
#include "data/document.h"
#include "model/batch.h"
#include "model/decoder.h"
#include "model/router_aux_loss.h"
#include "model/weights.h"
#include "parallel/fsdp.h"
#include "parallel/sequence_shard.h"
#include "parallel/sp_attention.h"
#include "train/run_assembly.h"
#include "train/setup.h"
#include "train/step_runner.h"


namespace spindle::bench {
namespace {

std::unique_ptr<Backend> make_backend(const BenchOptions& o) {
  ComputeDevice device;  // the trainer's backend factory (validate() has checked o.device and o.attention)
  device.cuda = o.device == "cuda";
  device.index = o.device_index;
  device.cuda_options.attention = parse_cuda_attention(o.attention);
  return spindle::make_backend(device, o.cpu_threads);
}

void validate(const BenchOptions& o) {
  if (o.model.empty()) fail("bench needs --model (a model folder or its config.json)");
  if (o.seq_lengths.empty()) fail("bench needs at least one --seq length");
  if (o.device != "cpu" && o.device != "cuda") fail("--device must be cpu or cuda, got '{}'", o.device);
  if (o.device == "cpu") check_cuda_attention_off_gpu(parse_cuda_attention(o.attention), "--device cpu");
  else parse_cuda_attention(o.attention);
  for (int64_t s : o.seq_lengths)
    if (s < 2) fail("--seq {} is too short: a step needs at least 2 tokens (one supervised target)", s);
  if (o.steps < 1) fail("--steps must be at least 1, got {}", o.steps);
  if (o.warmup < 0 || o.profile_steps < 0) fail("--warmup and --profile-steps cannot be negative");
  if (!o.full && o.lora_rank <= 0) fail("--lora-rank must be positive (or use --full), got {}", o.lora_rank);
  if (o.recompute == "auto") {
    if (!o.choose_recompute) fail("--recompute auto is chosen by the spindle command line (spindle bench)");
    check_left_to_auto(o.offload_layers, o.checkpoint_stride);
  } else {
    check_recompute_layers(parse_recompute_mode(o.recompute), o.recompute_layers);
    check_offload_layers(parse_offload(o.offload, parse_recompute_mode(o.recompute)), o.offload_layers);
    check_checkpoint_stride(parse_recompute_mode(o.recompute), o.checkpoint_stride);
  }
  parse_mlp_tile_tokens(o.mlp_tile_tokens);
  if (o.dp < 0 || o.sp < 0 || o.ulysses < 0 || o.ring < 0) fail("--dp, --sp, --ulysses and --ring must be positive");
  if (o.doc_length < 0 || o.doc_length == 1)
    fail("--doc-length {}: a document needs at least 2 tokens (0: one document per step)", o.doc_length);
}

float read_scalar(Backend& backend, const Tensor& t) {
  if (t.dtype() == DType::F64) {
    double v;
    backend.copy_to_host(backend.default_stream(), t, &v);
    return static_cast<float>(v);
  }
  float v;
  backend.copy_to_host(backend.default_stream(), t, &v);
  return v;
}

bool is_out_of_memory(const Error& e) { return std::string(e.what()).find("out of GPU memory") != std::string::npos; }

// What a sweep shares across lengths: the processes and the model, assembled as sft assembles it
// (train/run_assembly.h: FSDP over every rank, the mesh's sequence-parallel strategies, the router loss).
struct Parallel {
  RunTopology run;
  std::unique_ptr<AssembledRun> model;
};

// Times the groups' calls during the profiled steps. A call enqueued on the compute stream holds
// the step up (Communication); one on another stream (ring exchanges) runs under compute.
class CommTimer final : public comm::CommObserver {
 public:
  CommTimer(OpRecorder& recorder, Stream compute, const Parallel& par) : recorder_(recorder), compute_(compute) {
    if (par.run.world) groups_.push_back(par.run.world.get());
    if (const parallel::Mesh* mesh = par.run.mesh.get())
      for (comm::Communicator* g : {&mesh->dp(), &mesh->sp(), &mesh->ulysses(), &mesh->ring()}) groups_.push_back(g);
    for (comm::Communicator* g : groups_) g->set_observer(this);
  }
  ~CommTimer() override {
    for (comm::Communicator* g : groups_) g->set_observer(nullptr);
  }
  CommTimer(const CommTimer&) = delete;
  CommTimer& operator=(const CommTimer&) = delete;

  int begin(Stream stream, const comm::Communicator& group, const char* call, const Tensor& data) override {
    const OpCategory category =
        stream.handle == compute_.handle ? OpCategory::Communication : OpCategory::OverlappedCommunication;
    return recorder_.begin(stream, category,
                           fmt::format("{} {} {:.1f} MiB", group.name(), call, static_cast<double>(data.bytes()) / (1 << 20)),
                           0, static_cast<double>(data.bytes()));
  }
  void end(Stream stream, int token) override { recorder_.end(stream, token); }

 private:
  OpRecorder& recorder_;
  Stream compute_;
  std::vector<comm::Communicator*> groups_;
};

void run_length(Backend& backend, const BenchOptions& o, const DeviceInfo& device, double peak_tflops,
                const Parallel& par, BenchResult& r) {
  ModelWeights& weights = par.model->weights;
  parallel::Fsdp* fsdp = par.model->state->fsdp();
  const ModelConfig& config = weights.config;
  const DType dtype = weights.dtype;
  const int64_t seq = r.seq;
  const parallel::MeshConfig& mesh = par.run.mesh_config;
  const int dp_index = par.run.mesh ? par.run.mesh->coordinates().dp : 0;
  // One sequence per replica and step; this rank computes its sp shard of it.
  PackedRow row =
      synthetic_row(seq, o.doc_length, config.vocab_size, o.seed + seq + static_cast<uint64_t>(dp_index));
  const double loss_scale = 1.0 / static_cast<double>(row.num_items() * mesh.dp);
  int64_t step_tokens = 0;  // real tokens of the step over every replica: the router aux loss's N
  for (int32_t doc : row.doc_ids) step_tokens += doc >= 0;
  step_tokens *= mesh.dp;
  const bool whole_row_causal = is_one_causal_document(row) && seq % mesh.sp == 0 && mesh.ring == 1;
  if (mesh.sp > 1) row = parallel::shard_row(row, mesh)[par.run.mesh->sp_rank()];
  MicroBatch batch = make_micro_batch(backend, {row}, dtype);
  batch.row_one_causal_document = whole_row_causal;  // as StepRunner::run sets it

  const RecomputeMode recompute = parse_recompute_mode(o.recompute);
  const DecoderOptions decoder_options =
      memory_options(recompute, config.num_layers, o.recompute_layers, parse_offload(o.offload, recompute),
                     o.offload_layers, parse_mlp_tile_tokens(o.mlp_tile_tokens), o.checkpoint_stride);
  r.recompute = o.recompute;
  r.recompute_layers = o.recompute_layers;
  r.offload = decoder_options.offload;
  r.offload_layers = decoder_options.offload_layers;
  r.mlp_tile_tokens = decoder_options.mlp_tile_tokens;
  r.checkpoint_stride = decoder_options.checkpoint_stride;
  Stream stream = backend.default_stream();
  Tensor loss = backend.zeros(Shape{1}, stat_dtype(dtype));

  // MoE models: the router load-balancing loss as sft runs it (model/router_aux_loss.h).
  RouterAuxLoss* router_aux = par.model->router_aux.get();
  std::function<void(Tensor&)> reduce;
  if (par.run.world) reduce = [&](Tensor& t) { par.run.world->all_reduce_sum(stream, t); };

  // The optimizer step is not part of the timed step (see format_report).
  auto one_step = [&](Decoder& decoder, Backend& be) {
    if (fsdp) fsdp->zero_grads();
    else weights.zero_grads(be);
    if (router_aux) router_aux->begin_step(step_tokens, reduce);
    decoder.step(batch, loss_scale, loss, true);
    if (router_aux) router_aux->end_step();
  };

  const std::unique_ptr<Decoder> decoder_on_device = par.model->make_decoder(backend, decoder_options);
  Decoder& decoder = *decoder_on_device;
  for (int i = 0; i < o.warmup; ++i) one_step(decoder, backend);
  backend.synchronize(stream);
  backend.fill(stream, loss, 0.0);
  backend.reset_peak_memory();
  backend.reset_offload_stats();

  auto timer = make_device_timer(backend);
  std::vector<int> marks;
  marks.push_back(timer->mark(stream));
  for (int i = 0; i < o.steps; ++i) {
    one_step(decoder, backend);
    marks.push_back(timer->mark(stream));
  }
  backend.synchronize(stream);
  r.memory = backend.memory_stats();
  r.offload_copies = backend.offload_stats();
  // Each rank holds its shard's share of the loss (loss_scale already divides by dp); the sum
  // over the world is the replicas' mean, the number one GPU would print.
  if (par.run.world) par.run.world->all_reduce_sum(stream, loss);
  r.loss = read_scalar(backend, loss) / static_cast<float>(o.steps);
  for (int i = 0; i < o.steps; ++i) r.step_ms.push_back(timer->elapsed_ms(marks[i], marks[i + 1]));
  const double total_ms = std::accumulate(r.step_ms.begin(), r.step_ms.end(), 0.0);
  r.tokens_per_s = static_cast<double>(seq) * mesh.dp * o.steps / (total_ms / 1000.0);  // all replicas

  FlopSetup setup;
  setup.tokens = seq;  // one replica's sequence; its FLOPs are spread over the replica's sp GPUs
  setup.doc_length = o.doc_length;
  setup.lora_rank = o.full ? 0 : o.lora_rank;
  setup.recompute = recompute;
  setup.recomputed_layers = o.recompute_layers;
  setup.mlp_tiled = decoder_options.mlp_tile_tokens > 0;
  setup.checkpoint_stride = decoder_options.checkpoint_stride;
  const StepFlops flops = step_flops(config, setup);
  const double step_s = total_ms / 1000.0 / o.steps;
  r.model_flops = flops.model();
  r.executed_flops = flops.executed();
  r.model_tflops = flops.model() / mesh.sp / step_s / 1e12;  // per GPU
  r.executed_tflops = flops.executed() / mesh.sp / step_s / 1e12;
  r.mfu = peak_tflops > 0 ? r.model_tflops / peak_tflops : 0;

  if (o.profile_steps > 0) {
    OpRecorder recorder(backend);
    TimedBackend timed(backend, recorder);
    CommTimer comm_timer(recorder, stream, par);
    const std::unique_ptr<Decoder> timed_decoder = par.model->make_decoder(timed, decoder_options);
    Decoder& profiled = *timed_decoder;
    auto wall = make_device_timer(backend);
    const int start = wall->mark(stream);
    for (int i = 0; i < o.profile_steps; ++i) one_step(profiled, timed);
    const int stop = wall->mark(stream);
    backend.synchronize(stream);
    const auto totals = recorder.totals_ms();
    for (size_t c = 0; c < totals.size(); ++c) r.split_ms[c] = totals[c] / o.profile_steps;
    r.profiled_step_ms = wall->elapsed_ms(start, stop) / o.profile_steps;
    r.ops_per_step = recorder.op_count() / o.profile_steps;
    r.op_table = recorder.op_table();
    for (OpTime& t : r.op_table) {
      t.calls /= o.profile_steps;
      t.ms /= o.profile_steps;
      t.flops /= o.profile_steps;
      t.bytes /= o.profile_steps;
    }
    r.split_measured = true;
  }
  (void)device;
}

// ", activations offloaded: 12.3 GiB of host memory at the peak; copies of 24.6 GiB per step at 51.2
// GB/s, the step waited 0.12 s for them" (per timed step).
std::string offload_summary(const BenchResult& r) {
  const OffloadStats& c = r.offload_copies;
  const double steps = static_cast<double>(std::max<size_t>(r.step_ms.size(), 1));
  std::string s = fmt::format(", activations {}offloaded: {:.2f} GiB of host memory at the peak",
                              r.offload_layers >= 0 ? fmt::format("of the first {} layers ", r.offload_layers) : "",
                              static_cast<double>(r.memory.peak_host_allocated_bytes) / (1 << 30));
  if (c.copies > 0 && c.copy_seconds > 0)
    s += fmt::format("; copies of {:.2f} GiB per step at {:.1f} GB/s, the step waited {:.1f} ms for them",
                     static_cast<double>(c.bytes) / steps / (1 << 30),
                     static_cast<double>(c.bytes) / c.copy_seconds / 1e9, 1000 * c.wait_seconds / steps);
  return s;
}

// The profiled step's time outside ops and waited-for collectives.
double idle_ms(const BenchResult& r) {
  return r.profiled_step_ms - (r.split_ms[0] + r.split_ms[1] + r.split_ms[2] + r.split_ms[3]);
}

std::string gib(int64_t bytes) { return fmt::format("{:.2f} GiB", static_cast<double>(bytes) / (1 << 30)); }

}  // namespace

RunDescription describe_bench_run(const BenchOptions& o, const ModelConfig& config, DType dtype) {
  RunDescription d;
  d.model = config;
  // Random weights (--quantize: each projection quantised as it is drawn, so the dense model never
  // exists on the device), drawn by the backend.
  d.weights = WeightSource::kRandom;
  d.weight_seed = o.seed;
  d.dtype = dtype;
  d.quantize = parse_quantize_options(o.quantize, o.double_quant, o.quant_block_size);
  if (o.full) {
    d.adapter.kind = AdapterDescription::Kind::kFull;
  } else {
    d.adapter.kind = AdapterDescription::Kind::kNewLora;
    d.adapter.lora.rank = o.lora_rank;
    d.adapter.lora.alpha = o.lora_alpha;
    // Every projection the family has, unless named (the routed experts, "experts", only when named).
    d.adapter.lora.targets = o.lora_targets;
    d.adapter.seed = o.seed + 1;
  }
  d.shard = true;  // several processes: FSDP over all of them, as sft runs by default
  d.router_aux_loss = router_aux_loss_coefficient(config, o.router_aux_loss_coef);
  // No optimizer state: the timed step is forward and backward (format_report says so). The memory
  // options are each length's (run_length).
  return d;
}

PackedRow synthetic_row(int64_t length, int64_t doc_length, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int32_t> token(0, static_cast<int32_t>(vocab - 1));
  const int64_t n = doc_length > 0 ? doc_length : length;
  PackedRow row;
  row.input_ids.resize(length);
  for (auto& id : row.input_ids) id = token(rng);
  row.positions.resize(length);
  row.doc_ids.resize(length);
  row.targets.resize(length);
  row.weights.assign(length, 1.0f);
  for (int64_t i = 0; i < length; ++i) {
    row.positions[i] = static_cast<int32_t>(i % n);
    row.doc_ids[i] = static_cast<int32_t>(i / n);
    const bool last = i + 1 == length || (i + 1) % n == 0;
    row.targets[i] = last ? kIgnoreIndex : row.input_ids[i + 1];
    if (last) row.weights[i] = 0.0f;
  }
  return row;
}

BenchReport run_bench(const BenchOptions& options, const std::function<void(const BenchReport&)>& on_result) {
  validate(options);
  BenchReport report;
  report.options = options;
  report.config = ModelConfig::from_file(options.model);
  // Several processes: one GPU each (its local rank), NCCL between them, the mesh of the flags.
  const ProcessGroupInfo process = process_group_from_environment();
  BenchOptions local = options;
  if (process.distributed()) local.device_index = process.local_rank;
  auto backend = make_backend(local);
  Parallel par;
  parallel::MeshFlags flags;
  if (options.dp) flags.dp = options.dp;
  if (options.sp) flags.sp = options.sp;
  if (options.ulysses) flags.ulysses = options.ulysses;
  if (options.ring) flags.ring = options.ring;
  par.run = connect_run(flags, static_cast<int>(report.config.num_heads), static_cast<int>(report.config.num_kv_heads),
                        process.distributed() && options.device == "cuda" ? local.device_index : -1);
  const parallel::MeshConfig& mesh = par.run.mesh_config;
  report.world = par.run.world_size();
  report.dp = mesh.dp;
  report.sp = mesh.sp;
  report.ulysses = mesh.ulysses;
  report.ring = mesh.ring;
  const DeviceInfo device = describe_device(*backend);
  report.device_name = device.name;
  report.peak_tflops = options.peak_tflops > 0 ? options.peak_tflops : device.bf16_dense_tflops;

  // BF16 storage with F32 accumulation on CUDA (the product); F32 on the CPU reference.
  const DType dtype = backend->device().kind == DeviceKind::CUDA ? DType::BF16 : DType::F32;
  const auto build_start = std::chrono::steady_clock::now();
  par.model = assemble_run(*backend, describe_bench_run(options, report.config, dtype),
                           RunPlacement{par.run.world.get(), par.run.mesh.get()});
  report.parameters = par.model->parameters;
  report.trainable_parameters = par.model->trainable_parameters;
  backend->synchronize(backend->default_stream());
  report.model_build_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - build_start).count();
  if (options.on_model_built) options.on_model_built(report.model_build_s);

  for (int64_t seq : options.seq_lengths) {
    BenchResult r;
    r.seq = seq;
    try {
      if (seq % parallel::sequence_multiple(mesh) != 0)
        fail("--seq {} is not a multiple of {}, which --sp {} (ulysses {} x ring {}) needs", seq,
             parallel::sequence_multiple(mesh), mesh.sp, mesh.ulysses, mesh.ring);
      BenchOptions chosen = options;  // --recompute auto: this length's setting
      if (options.recompute == "auto") options.choose_recompute(seq, chosen);
      run_length(*backend, chosen, device, report.peak_tflops, par, r);
    } catch (const Error& e) {
      if (!is_out_of_memory(e)) throw;
      r.error = e.what();
      backend->synchronize(backend->default_stream());
      report.results.push_back(r);
      if (on_result) on_result(report);
      break;
    }
    report.results.push_back(r);
    if (on_result) on_result(report);
  }
  return report;
}

std::string format_report(const BenchReport& rep) {
  const BenchOptions& o = rep.options;
  const ModelConfig& c = rep.config;
  std::string s;
  s += fmt::format("spindle bench: {} ({} layers, hidden {}, {} q / {} kv heads of {}, vocab {}), {} parameters\n",
                   o.model, c.num_layers, c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size,
                   rep.parameters);
  s += fmt::format("  {} on {}{}, {}, {} trainable, recompute {}, {} warm-up + {} timed steps, {}\n",
                   o.device == "cuda" ? "BF16 (F32 accumulation)" : "F32", rep.device_name,
                   o.device == "cuda" ? fmt::format(" (attention {})", o.attention) : std::string(),
                   o.full ? std::string("full fine-tuning") : fmt::format("LoRA r={} on {}", o.lora_rank,
                                                                    o.lora_targets.empty()
                                                                        ? std::string("every projection")
                                                                        : fmt::format("{}", fmt::join(o.lora_targets, ", "))),
                   rep.trainable_parameters,
                   o.recompute_layers >= 0 ? fmt::format("{} on the first {} layers", o.recompute, o.recompute_layers)
                                           : o.recompute,
                   o.warmup, o.steps,
                   o.doc_length > 0 ? fmt::format("1 row per step packed with documents of {} tokens, every token "
                                                  "but a document's last supervised",
                                                  o.doc_length)
                                    : std::string("1 sequence per step, every token supervised"));
  if (rep.world > 1)
    s += fmt::format("  {} processes, one GPU each: dp {} x sp {} (ulysses {} x ring {}), FSDP over all; tokens/s counts "
                     "all replicas, TFLOP/s and MFU are per GPU, memory is rank 0's\n",
                     rep.world, rep.dp, rep.sp, rep.ulysses, rep.ring);
  s += fmt::format("  model built in {:.1f} s (random weights drawn{} by the backend)\n", rep.model_build_s,
                   o.quantize.empty() || o.quantize == "none" ? "" : " and quantised");
  s += "  step = forward + backward (gradients zeroed first); the optimizer step is not included\n";
  s += std::string("  model FLOPs = 6·N_matmul·T + 3.5·L·4·Hq·D·") +
       (o.doc_length > 0 ? "Σ n(n+1)/2 over the documents" : "T(T+1)/2") +
       " (no recompute; frozen LoRA base weights counted as "
       "trained); executed FLOPs count what runs (recompute: the layers' dense forward again, and the attention "
       "forward again with 'all' but not with 'keep-attention')\n";
  if (c.moe.num_experts > 0)
    s += fmt::format("  N_matmul counts active parameters ({}): the router and {} of the {} experts per token of each "
                     "mixture-of-experts layer (3·k·H·I), every other projection and the LM head\n",
                     matmul_parameters(c), c.moe.experts_per_token, c.moe.num_experts);
  if (rep.peak_tflops > 0)
    s += fmt::format("  MFU = model FLOP/s / {:.1f} TFLOP/s (dense BF16 peak)\n", rep.peak_tflops);
  s += "\n";
  s += fmt::format("{:>8} {:>10} {:>11} {:>9} {:>7} {:>9} {:>10} {:>10} {:>10}  {}\n", "seq", "tokens/s", "step ms",
                   "model TF", "MFU", "exec TF", "peak alloc", "peak resv", "device", "loss");
  for (const BenchResult& r : rep.results) {
    if (!r.error.empty()) {
      s += fmt::format("{:>8}  did not run: {}\n", r.seq, r.error);
      continue;
    }
    const double mean = std::accumulate(r.step_ms.begin(), r.step_ms.end(), 0.0) / r.step_ms.size();
    const std::string mfu = rep.peak_tflops > 0 ? fmt::format("{:.1f}%", 100 * r.mfu) : std::string("-");
    s += fmt::format("{:>8} {:>10.0f} {:>11.1f} {:>9.1f} {:>7} {:>9.1f} {:>10} {:>10} {:>10}  {:.4f}\n", r.seq,
                     r.tokens_per_s, mean, r.model_tflops, mfu, r.executed_tflops,
                     gib(r.memory.peak_allocated_bytes), gib(r.memory.peak_reserved_bytes),
                     gib(r.memory.device_used_bytes), r.loss);
    if (r.offload || r.mlp_tile_tokens > 0 || r.checkpoint_stride > 1 || o.recompute == "auto")
      s += fmt::format("{:>8}  recompute {}{}{}{}{}\n", "", r.recompute,
                       r.recompute_layers >= 0 ? fmt::format(" on the first {} layers", r.recompute_layers) : "",
                       r.offload ? offload_summary(r) : "",
                       r.mlp_tile_tokens > 0 ? fmt::format(", MLP in {}-token tiles", r.mlp_tile_tokens) : "",
                       r.checkpoint_stride > 1 ? fmt::format(", one layer input kept in {}", r.checkpoint_stride)
                                               : "");
  }
  bool any_split = false;
  for (const BenchResult& r : rep.results) any_split |= r.split_measured;
  if (any_split) {
    s += "\ntime split of the profiled step(s) (each op and each collective between device events; "
         "'communication': collectives on the compute stream, which the step waits for; 'idle' = step − those four: "
         "launch gaps, host work, allocation waits; 'overlapped comm': collectives on another stream (ring "
         "exchanges), which run under the compute and are not part of the step's sum)\n";
    s += fmt::format("{:>8} {:>11} {:>16} {:>16} {:>16} {:>16} {:>14} {:>16} {:>6}\n", "seq", "step ms", "attention",
                     "gemm", "communication", "other ops", "idle", "overlapped comm", "ops");
    for (const BenchResult& r : rep.results) {
      if (!r.split_measured) continue;
      const double step = r.profiled_step_ms;
      auto cell = [&](double ms) { return fmt::format("{:.1f} ({:.0f}%)", ms, step > 0 ? 100 * ms / step : 0); };
      s += fmt::format("{:>8} {:>11.1f} {:>16} {:>16} {:>16} {:>16} {:>14} {:>16} {:>6}\n", r.seq, step,
                       cell(r.split_ms[0]), cell(r.split_ms[1]), cell(r.split_ms[2]), cell(r.split_ms[3]),
                       cell(idle_ms(r)), cell(r.split_ms[4]), r.ops_per_step);
    }
  }
  if (any_split && o.op_table_rows > 0) {
    for (const BenchResult& r : rep.results) {
      if (!r.split_measured) continue;
      s += fmt::format("\nseq {}: the {} most costly ops of the profiled step (gemm M×N×K, op(A) op(B): N plain, T "
                       "transposed; +C accumulates)\n",
                       r.seq, std::min<size_t>(o.op_table_rows, r.op_table.size()));
      s += fmt::format("{:<36} {:>6} {:>10} {:>7} {:>9} {:>8}\n", "op", "calls", "ms", "share", "TFLOP/s", "GB/s");
      for (size_t i = 0; i < r.op_table.size() && i < static_cast<size_t>(o.op_table_rows); ++i) {
        const OpTime& t = r.op_table[i];
        const std::string rate = t.flops > 0 && t.ms > 0 ? fmt::format("{:.1f}", t.flops / t.ms / 1e9) : "";
        const std::string bandwidth = t.bytes > 0 && t.ms > 0 ? fmt::format("{:.0f}", t.bytes / t.ms / 1e6) : "";
        s += fmt::format("{:<36} {:>6} {:>10.2f} {:>6.1f}% {:>9} {:>8}\n", t.label, t.calls, t.ms,
                         r.profiled_step_ms > 0 ? 100 * t.ms / r.profiled_step_ms : 0, rate, bandwidth);
      }
    }
  }
  return s;
}

nlohmann::ordered_json report_json(const BenchReport& rep) {
  const BenchOptions& o = rep.options;
  nlohmann::ordered_json j;
  j["model"] = o.model;
  j["model_type"] = rep.config.model_type;
  j["device"] = rep.device_name;
  j["dtype"] = o.device == "cuda" ? "bf16" : "f32";
  j["mode"] = o.full ? "full" : "lora";
  j["lora_rank"] = o.full ? 0 : o.lora_rank;
  if (!o.full && !o.lora_targets.empty()) j["lora_targets"] = o.lora_targets;
  j["recompute"] = o.recompute;
  j["recompute_layers"] = o.recompute_layers;
  j["attention"] = o.attention;
  j["doc_length"] = o.doc_length;
  j["warmup"] = o.warmup;
  j["steps"] = o.steps;
  j["world"] = rep.world;
  j["dp"] = rep.dp;
  j["sp"] = rep.sp;
  j["ulysses"] = rep.ulysses;
  j["ring"] = rep.ring;
  j["parameters"] = rep.parameters;
  j["trainable_parameters"] = rep.trainable_parameters;
  j["model_build_s"] = rep.model_build_s;
  j["optimizer_step_included"] = false;
  j["peak_tflops"] = rep.peak_tflops;
  j["flops_formula"] =
      "model: 6*N_matmul*T + 3.5*L*4*Hq*D*sum over documents n*(n+1)/2 (N_matmul: active parameters, MoE router + "
      "k of E experts); executed: as run (LoRA, recompute)";
  auto& results = j["results"] = nlohmann::ordered_json::array();
  for (const BenchResult& r : rep.results) {
    nlohmann::ordered_json x;
    x["seq"] = r.seq;
    if (!r.error.empty()) {
      x["error"] = r.error;
      results.push_back(x);
      continue;
    }
    x["tokens_per_s"] = r.tokens_per_s;
    x["step_ms"] = r.step_ms;
    x["loss"] = r.loss;
    x["model_flops"] = r.model_flops;
    x["executed_flops"] = r.executed_flops;
    x["model_tflops"] = r.model_tflops;
    x["executed_tflops"] = r.executed_tflops;
    x["mfu"] = r.mfu;
    x["peak_allocated_bytes"] = r.memory.peak_allocated_bytes;
    x["peak_reserved_bytes"] = r.memory.peak_reserved_bytes;
    x["device_used_bytes"] = r.memory.device_used_bytes;
    x["device_total_bytes"] = r.memory.device_total_bytes;
    x["recompute"] = r.recompute;  // as run (auto: the choice)
    x["recompute_layers"] = r.recompute_layers;
    x["offload"] = r.offload ? "activations" : "none";
    x["offload_layers"] = r.offload_layers;
    x["mlp_tile_tokens"] = r.mlp_tile_tokens;
    x["checkpoint_stride"] = r.checkpoint_stride;
    x["offload_host_bytes"] = r.memory.peak_host_allocated_bytes;  // host memory of offload at its peak
    {
      // Per timed step: what the copies moved, how long they ran (their bandwidth) and how long the
      // compute stream waited for them (the time offload added; CPU: the copies' own time).
      const OffloadStats& c = r.offload_copies;
      const double steps = static_cast<double>(std::max<size_t>(r.step_ms.size(), 1));
      x["offload_copy_bytes"] = static_cast<int64_t>(static_cast<double>(c.bytes) / steps);
      x["offload_copy_ms"] = 1000 * c.copy_seconds / steps;
      x["offload_copy_gb_per_s"] = c.copy_seconds > 0 ? static_cast<double>(c.bytes) / c.copy_seconds / 1e9 : 0.0;
      x["offload_wait_ms"] = 1000 * c.wait_seconds / steps;
    }
    if (r.split_measured) {
      auto& split = x["split_ms"];
      for (int c = 0; c < static_cast<int>(OpCategory::kCount); ++c)
        split[category_name(static_cast<OpCategory>(c))] = r.split_ms[c];
      split["idle"] = idle_ms(r);
      x["profiled_step_ms"] = r.profiled_step_ms;
      x["ops_per_step"] = r.ops_per_step;
      auto& ops = x["ops"] = nlohmann::ordered_json::array();
      for (const OpTime& t : r.op_table)
        ops.push_back({{"op", t.label}, {"category", category_name(t.category)}, {"calls", t.calls}, {"ms", t.ms},
                       {"flops", t.flops}, {"bytes", t.bytes}});
    }
    results.push_back(x);
  }
  return j;
}

}  // namespace spindle::bench
