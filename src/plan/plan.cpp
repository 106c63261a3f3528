#include "plan/plan.h"

#include <fmt/ranges.h>

#include <algorithm>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <thread>

#include "backend/cpu/quant4_ops.h"
#include "bench/bench.h"
#include "bench/timed_backend.h"
#include "core/error.h"
#include "model/decoder.h"
#include "model/router_aux_loss.h"
#include "model/weights.h"
#include "parallel/fsdp.h"
#include "parallel/mesh.h"
#include "parallel/sequence_shard.h"
#include "parallel/sp_attention.h"
#include "plan/auto_recompute.h"
#include "plan/dry_backend.h"
#include "plan/dry_communicator.h"
#include "train/optimizer.h"
#include "train/run_assembly.h"

namespace spindle::plan {

namespace {

// Phase names, in the order a step meets them; the report lists the parts in this order.
constexpr const char* kWeights = "weights";
constexpr const char* kTrainable = "trainable parameters and gradients";
constexpr const char* kShards = "FSDP shards";
constexpr const char* kOptimizer = "optimizer state";
constexpr const char* kBatch = "batch";
constexpr const char* kReference = "reference model";
constexpr const char* kGathers = "FSDP gathers";
constexpr const char* kForward = "forward activations";
constexpr const char* kHead = "LM head and loss";
constexpr const char* kBackward = "backward and recompute";
constexpr const char* kReduce = "gradient reduction";
constexpr const char* kWorkspaces = DryBackend::kWorkspacePhase;  // CUDA kernels' scratch during one call
const char* const kPhaseOrder[] = {kWeights, kTrainable, kShards,   kOptimizer, kReference, kBatch,     kGathers,
                                   kForward, kHead,      kBackward, kReduce,    kWorkspaces};

// Labels the allocations of each part of a step: around every window of the decoder's units (the
// FSDP hooks when sharded, nothing else otherwise) it switches the DryBackend's phase.
// It also tells the step-time model which layer's window the ops that follow run in.
class PhaseHooks final : public ParameterHooks {
 public:
  PhaseHooks(DryBackend& backend, ParameterHooks* inner, StepCostModel& cost)
      : backend_(backend), inner_(inner), cost_(cost) {}
  void before_forward(const ParameterUnit& u) override {
    backend_.set_phase(kGathers);
    if (inner_) inner_->before_forward(u);
    // A forward window after the head's is a sparse checkpoint's regenerating forward (decoder.h).
    backend_.set_phase(in_backward_ ? kBackward : kForward);
    cost_.set_unit(u.kind == ParameterUnit::Kind::Layer ? u.layer : -1, false);
  }
  void after_forward(const ParameterUnit& u) override {
    cost_.set_unit(-1, false);
    if (inner_) inner_->after_forward(u);
  }
  void before_backward(const ParameterUnit& u) override {
    in_backward_ = true;
    backend_.set_phase(kGathers);
    if (inner_) inner_->before_backward(u);
    backend_.set_phase(u.kind == ParameterUnit::Kind::Head ? kHead : kBackward);
    cost_.set_unit(u.kind == ParameterUnit::Kind::Layer ? u.layer : -1, true);
  }
  void after_backward(const ParameterUnit& u) override {
    cost_.set_unit(-1, true);
    backend_.set_phase(kReduce);
    if (inner_) inner_->after_backward(u);
    backend_.set_phase(kBackward);
  }

 private:
  DryBackend& backend_;
  ParameterHooks* inner_;
  StepCostModel& cost_;
  bool in_backward_ = false;
};

}  // namespace

RunDescription describe_planned_run(const PlanOptions& o, const ModelConfig& config, DType dtype,
                                    double router_aux_loss) {
  RunDescription d;
  d.model = config;
  d.weights = WeightSource::kShapes;
  d.dtype = dtype;
  d.quantize = parse_quantize_options(o.quantize, o.double_quant, o.quant_block_size);
  if (o.full) {
    d.adapter.kind = AdapterDescription::Kind::kFull;
  } else {
    d.adapter.kind = AdapterDescription::Kind::kNewLora;
    d.adapter.lora.rank = o.lora_rank;
    d.adapter.lora.alpha = o.lora_alpha;
    // As bench: every projection the family has unless named (the routed experts only when named).
    d.adapter.lora.targets = o.lora_targets;
    d.adapter.only_targets_present = o.lora_targets_if_present;
  }
  d.shard = true;
  if (o.optimizer) d.optimizer = AdamWConfig{};
  d.router_aux_loss = router_aux_loss;
  return d;
}

namespace {

DType plan_dtype(const PlanOptions& o) {
  if (o.dtype == "auto") return o.device == "cuda" ? DType::BF16 : DType::F32;
  if (o.dtype == "f32") return DType::F32;
  if (o.dtype == "f64") return DType::F64;
  if (o.dtype == "bf16") return DType::BF16;
  fail("--dtype must be auto, f32, f64 or bf16, got \"{}\"", o.dtype);
}

RankPlan plan_rank(const PlanOptions& o, const ModelConfig& config, const ModelConfig* reference_config,
                   const parallel::MeshConfig& mesh_config, DType dtype, double aux_coefficient, const DeviceRates& rates,
                   int rank, int64_t seq, std::shared_ptr<Exchange> exchange) {
  // The CUDA pool hands out 512-byte multiples; the CPU backend pads to 64 bytes.
  const bool cuda = o.device == "cuda";
  int multiprocessors = 1;
  if (cuda) {
    static const int gpu_multiprocessors = machine_multiprocessors(0);  // asked once: a search plans many steps
    multiprocessors = gpu_multiprocessors;
  }
  DryBackend backend(Device{cuda ? DeviceKind::CUDA : DeviceKind::CPU, 0}, cuda ? 512 : 64, multiprocessors);
  std::unique_ptr<DryCommunicator> world;
  std::unique_ptr<parallel::Mesh> mesh;
  if (mesh_config.world_size() > 1) {
    world = std::make_unique<DryCommunicator>(mesh_config, rank, std::move(exchange));
    mesh = std::make_unique<parallel::Mesh>(mesh_config, *world);
  }

  // The run sft, dpo and bench build (train/run_assembly.h), its allocations labelled by stage: the
  // weights (4-bit projections as packed bytes and absmax, sharded as bytes by FSDP), the trainable
  // parameters, the FSDP shards, the optimizer state, the router loss's statistics and gradient.
  const std::unique_ptr<AssembledRun> run =
      assemble_run(backend, describe_planned_run(o, config, dtype, aux_coefficient),
                   RunPlacement{world.get(), mesh.get()}, [&backend](AssemblyStage stage) {
                     switch (stage) {
                       case AssemblyStage::kWeights: backend.set_phase(kWeights); break;
                       case AssemblyStage::kTrainable: backend.set_phase(kTrainable); break;
                       case AssemblyStage::kShards: backend.set_phase(kShards); break;
                       case AssemblyStage::kOptimizer: backend.set_phase(kOptimizer); break;
                       case AssemblyStage::kRouterAux: backend.set_phase(kBatch); break;
                     }
                   });
  // dpo's frozen reference model, sharded like the policy (dpo_trainer.cpp).
  std::unique_ptr<AssembledRun> reference;
  if (reference_config) {
    backend.set_phase(kReference);
    RunDescription frozen = describe_reference(run->description(), *reference_config, {});
    frozen.weights = WeightSource::kShapes;
    reference = assemble_run(backend, frozen, RunPlacement{world.get(), mesh.get()},
                             [&backend](AssemblyStage) { backend.set_phase(kReference); });
  }
  RouterAuxLoss* router_aux = run->router_aux.get();
  RankPlan r;
  r.rank = rank;
  r.steady_bytes = backend.live_bytes();

  // The step, as `spindle bench` and sft run it: this rank's shard of one row.
  backend.set_phase(kBatch);
  PackedRow row = bench::synthetic_row(seq, o.doc_length, config.vocab_size, 1);
  int64_t step_tokens = 0;  // real tokens of the step over every replica, the aux loss's N
  for (int32_t doc : row.doc_ids) step_tokens += doc >= 0;
  step_tokens *= mesh_config.dp;
  const bool whole_row_causal = is_one_causal_document(row) && seq % mesh_config.sp == 0 && mesh_config.ring == 1;
  if (mesh_config.sp > 1) row = parallel::shard_row(row, mesh_config)[static_cast<size_t>(mesh->sp_rank())];
  MicroBatch batch = make_micro_batch(backend, {row}, dtype);
  batch.row_one_causal_document = whole_row_causal;
  r.tokens = batch.num_tokens;
  // dpo: the step's other micro-batches, laid out with this one, and the per-token weights its
  // backward runs with beside the batch's own (preference_step.h).
  std::vector<MicroBatch> laid_out;
  for (int64_t i = 1; i < o.rows_held; ++i) laid_out.push_back(make_micro_batch(backend, {row}, dtype));
  Tensor batch_weights;
  if (o.preference) {
    batch_weights = batch.weights;
    batch.weights = backend.empty(batch_weights.shape(), batch_weights.dtype());
  }

  // The step's ops pass through the step-time model on their way to the dry backend.
  StepCostModel cost(rates, config.num_layers);
  bench::TimedBackend observed(backend, cost);
  const std::unique_ptr<Decoder> planned = run->make_decoder(
      observed, memory_options(parse_recompute_mode(o.recompute), config.num_layers, o.recompute_layers, o.offload,
                               o.offload_layers, o.mlp_tile_tokens, o.checkpoint_stride));
  Decoder& decoder = *planned;
  PhaseHooks hooks(backend, run->state->fsdp(), cost);
  decoder.set_parameter_hooks(&hooks);
  if (router_aux) {
    std::function<void(Tensor&)> reduce;
    if (world) reduce = [&](Tensor& t) { world->all_reduce_sum(backend.default_stream(), t); };
    router_aux->begin_step(step_tokens, std::move(reduce));
  }
  Tensor loss = backend.zeros(Shape{1}, stat_dtype(dtype));
  backend.reset_peak_memory();
  backend.set_phase(kForward);
  decoder.step(batch, 1.0, loss, true);
  if (router_aux) router_aux->end_step();

  r.peak_allocated_bytes = backend.peak_bytes();
  r.peak_phase = backend.peak_phase();
  r.host_peak_bytes = backend.host_peak_bytes();
  r.time = cost.time();
  for (const char* phase : kPhaseOrder) {
    auto it = backend.peak_by_phase().find(phase);
    if (it != backend.peak_by_phase().end() && it->second > 0) r.parts.push_back({phase, it->second});
  }
  return r;
}

// GiB for real models, smaller units for the tiny ones of tests.
std::string gib(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (b >= 0.1 * (1 << 30)) return fmt::format("{:.2f} GiB", b / (1 << 30));
  if (b >= 0.1 * (1 << 20)) return fmt::format("{:.2f} MiB", b / (1 << 20));
  return fmt::format("{:.1f} KiB", b / 1024);
}

}  // namespace

const RankPlan& LengthPlan::largest() const {
  SPINDLE_CHECK(!ranks.empty(), "a plan without ranks");
  return *std::max_element(ranks.begin(), ranks.end(), [](const RankPlan& a, const RankPlan& b) {
    return a.peak_allocated_bytes < b.peak_allocated_bytes;
  });
}

DeviceRates plan_rates(const PlanOptions& o) {
  if (o.rates) return *o.rates;
  // Asked once per process (a search plans hundreds of steps) for each device and kind.
  static std::mutex asked;
  static std::map<std::pair<std::string, std::string>, DeviceRates> rates_of;
  std::lock_guard<std::mutex> lock(asked);
  auto it = rates_of.find({o.device, o.gpu});
  if (it == rates_of.end()) it = rates_of.emplace(std::pair{o.device, o.gpu}, planning_rates(o.device, o.gpu, 0)).first;
  return it->second;
}

const RankPlan& LengthPlan::slowest() const {
  SPINDLE_CHECK(!ranks.empty(), "a plan without ranks");
  return *std::max_element(ranks.begin(), ranks.end(),
                           [](const RankPlan& a, const RankPlan& b) { return a.time.total_s() < b.time.total_s(); });
}

PlanReport run_plan(const PlanOptions& o) {
  if (o.device != "cuda" && o.device != "cpu") fail("--device must be cuda or cpu, got \"{}\"", o.device);
  if (o.world < 1) fail("--world must be at least 1, got {}", o.world);
  if (o.full ? o.lora_rank != 16 && o.lora_rank != 0 : o.lora_rank <= 0)
    fail("--lora-rank must be positive for LoRA (or use --full), got {}", o.lora_rank);
  if (o.seq_lengths.empty()) fail("--seq needs at least one length");
  check_recompute_layers(parse_recompute_mode(o.recompute), o.recompute_layers);
  if (o.offload) parse_offload("activations", parse_recompute_mode(o.recompute));
  check_offload_layers(o.offload, o.offload_layers);
  check_checkpoint_stride(parse_recompute_mode(o.recompute), o.checkpoint_stride);
  if (o.mlp_tile_tokens < kMlpTileAuto)
    fail("--mlp-tile-tokens must be auto, 0 (untiled) or a positive number of tokens, got {}", o.mlp_tile_tokens);
  PlanReport rep;
  rep.options = o;
  rep.config = ModelConfig::from_file(o.model);
  if (o.rows_held < 1) fail("rows held at once must be at least 1, got {}", o.rows_held);
  std::optional<ModelConfig> reference;
  if (!o.reference_model.empty()) reference = ModelConfig::from_file(o.reference_model);
  const ModelConfig* reference_config = reference ? &*reference : nullptr;
  // Mixture-of-experts layers size their buffers by the T·k routed rows, whatever the routing; the
  // per-expert path of 4-bit experts runs on the DryBackend's balanced routing (docs/memory.md).
  rep.router_aux_loss_coef = router_aux_loss_coefficient(rep.config, o.router_aux_loss_coef);
  const DType dtype = plan_dtype(o);
  if (dtype == DType::BF16 && o.device != "cuda") fail("--dtype bf16 is the CUDA backend's; the CPU computes in f32 or f64");
  if (dtype == DType::F64 && o.device == "cuda") fail("--dtype f64 runs on the CPU backend only (--device cpu)");
  rep.dtype = dtype_name(dtype);
  rep.rates = plan_rates(o);
  parallel::MeshFlags flags;
  if (o.dp) flags.dp = o.dp;
  if (o.sp) flags.sp = o.sp;
  if (o.ulysses) flags.ulysses = o.ulysses;
  if (o.ring) flags.ring = o.ring;
  const parallel::MeshConfig mesh = parallel::resolve_mesh(flags, o.world, static_cast<int>(rep.config.num_heads),
                                                           static_cast<int>(rep.config.num_kv_heads));
  rep.world = o.world;
  rep.dp = mesh.dp;
  rep.sp = mesh.sp;
  rep.ulysses = mesh.ulysses;
  rep.ring = mesh.ring;
  for (int64_t seq : o.seq_lengths) {
    if (seq <= 0) fail("--seq must be positive, got {}", seq);
    if (seq % parallel::sequence_multiple(mesh) != 0)
      fail("--seq {} is not a multiple of {}, which --sp {} (ulysses {} x ring {}) needs", seq,
           parallel::sequence_multiple(mesh), mesh.sp, mesh.ulysses, mesh.ring);
    LengthPlan length;
    length.seq = seq;
    // Each data-parallel replica's sp ranks (world ranks d·sp … d·sp + sp − 1) side by side, one
    // thread each, so the integer all-gathers between them carry the batch's real ids and positions
    // (dry_communicator.h); replicas exchange none, so they run one after the other.
    length.ranks.resize(static_cast<size_t>(mesh.world_size()));
    for (int d = 0; d < mesh.dp; ++d) {
      if (mesh.sp == 1) {
        length.ranks[static_cast<size_t>(d)] =
            plan_rank(o, rep.config, reference_config, mesh, dtype, rep.router_aux_loss_coef, rep.rates, d, seq, nullptr);
        continue;
      }
      std::vector<int> replica(static_cast<size_t>(mesh.sp));
      std::iota(replica.begin(), replica.end(), d * mesh.sp);
      auto exchange = std::make_shared<Exchange>(replica);
      auto plan_one = [&](int rank) {
        length.ranks[static_cast<size_t>(rank)] =
            plan_rank(o, rep.config, reference_config, mesh, dtype, rep.router_aux_loss_coef, rep.rates, rank, seq, exchange);
      };
      std::mutex failed;
      std::exception_ptr first_error;
      std::vector<std::thread> threads;
      for (int rank = d * mesh.sp; rank < (d + 1) * mesh.sp; ++rank)
        threads.emplace_back([&, rank] {
          try {
            plan_one(rank);
          } catch (...) {
            {
              std::lock_guard<std::mutex> lock(failed);
              if (!first_error) first_error = std::current_exception();
            }
            exchange->abort();  // the others may wait for this rank in an all-gather
          }
        });
      for (std::thread& t : threads) t.join();
      if (first_error) std::rethrow_exception(first_error);
    }
    rep.lengths.push_back(std::move(length));
  }
  return rep;
}

std::string format_plan(const PlanReport& rep) {
  const PlanOptions& o = rep.options;
  std::string s = fmt::format(
      "plan: {} ({} layers, hidden {}), {} on {}, {} {} world {} (dp {} x sp {}: ulysses {} x ring {}), recompute "
      "{}{}{}{}\n",
      o.model, rep.config.num_layers, rep.config.hidden_size,
      o.full ? std::string("full fine-tuning")
             : fmt::format("LoRA r{}{}{}", o.lora_rank,
                           o.lora_targets.empty() ? std::string()
                                                  : fmt::format(" on {}", fmt::join(o.lora_targets, ", ")),
                           o.quantize.empty() ? std::string()
                                              : fmt::format(" on {} base weights{}", o.quantize,
                                                            o.double_quant ? " (double quantisation)" : "")),
      o.device, rep.dtype,
      o.optimizer ? "with AdamW state," : "without optimizer state,", rep.world, rep.dp, rep.sp, rep.ulysses, rep.ring,
      o.recompute, o.recompute_layers >= 0 ? fmt::format(" (first {} layers)", o.recompute_layers) : "",
      !o.offload ? std::string()
      : o.offload_layers >= 0 ? fmt::format(", activations of the first {} layers offloaded to host memory", o.offload_layers)
                              : std::string(", activations offloaded to host memory"),
      rep.router_aux_loss_coef > 0 ? fmt::format(", router aux loss {:g}", rep.router_aux_loss_coef) : "");
  if (mlp_tile_tokens_to_run(o.mlp_tile_tokens) > 0)
    s += fmt::format("SwiGLU MLPs in tiles of {} tokens (--mlp-tile-tokens)\n", o.mlp_tile_tokens);
  if (o.preference)
    s += fmt::format("dpo's step: {} micro-batch(es) laid out at once{}\n", o.rows_held,
                     o.reference_model.empty() ? std::string(", the reference is the policy (adapters disabled) or cached")
                                               : fmt::format(", reference model {} held beside the policy", o.reference_model));
  if (o.checkpoint_stride > 1)
    s += fmt::format("one layer input kept in {}, the others regenerated in backward (--checkpoint-stride)\n",
                     o.checkpoint_stride);
  s += "predicted peak of live tensors per rank (the allocator's own slack and the backend's fixed workspaces "
       "come on top; docs/memory.md)\n";
  for (const LengthPlan& l : rep.lengths) {
    const RankPlan& r = l.largest();
    s += fmt::format("\nseq {}: peak {} on rank {} ({} tokens), reached in: {}; between steps {}\n", l.seq,
                     gib(r.peak_allocated_bytes), r.rank, r.tokens, r.peak_phase, gib(r.steady_bytes));
    if (o.offload) s += fmt::format("  host memory of activation offload at its peak: {}\n", gib(r.host_peak_bytes));
    const StepTime& t = l.slowest().time;
    s += fmt::format("  predicted step time on {}: {:.3f} s (matrix products {:.3f}, attention {:.3f}, memory-bound "
                     "ops {:.3f}, {} ops at {:.0f} us each; docs/perf.md, step-time model)\n",
                     rep.rates.kind, t.total_s(), t.gemm_s, t.attention_s, t.memory_s, t.ops, 1e6 * rep.rates.op_seconds);
    for (const PlanPart& p : r.parts)
      s += fmt::format("  {:<36} {:>12}  {:5.1f} %\n", p.name, gib(p.bytes),
                       100.0 * static_cast<double>(p.bytes) / static_cast<double>(r.peak_allocated_bytes));
    if (o.device_memory_gib > 0) {
      const double need = static_cast<double>(r.peak_allocated_bytes) / (1 << 30);
      s += need <= o.device_memory_gib
               ? fmt::format("  fits {:.1f} GiB per device ({:.1f} GiB to spare)\n", o.device_memory_gib,
                             o.device_memory_gib - need)
               : fmt::format("  does NOT fit {:.1f} GiB per device ({:.1f} GiB short)\n", o.device_memory_gib,
                             need - o.device_memory_gib);
    }
  }
  return s;
}

nlohmann::ordered_json plan_json(const PlanReport& rep) {
  nlohmann::ordered_json j;
  j["model"] = rep.options.model;
  j["device"] = rep.options.device;
  j["dtype"] = rep.dtype;
  j["world"] = rep.world;
  j["dp"] = rep.dp;
  j["sp"] = rep.sp;
  j["ulysses"] = rep.ulysses;
  j["ring"] = rep.ring;
  j["recompute"] = rep.options.recompute;
  j["recompute_layers"] = rep.options.recompute_layers;
  j["offload"] = rep.options.offload ? "activations" : "none";
  j["offload_layers"] = rep.options.offload_layers;
  j["mlp_tile_tokens"] = mlp_tile_tokens_to_run(rep.options.mlp_tile_tokens);
  j["checkpoint_stride"] = rep.options.checkpoint_stride;
  if (rep.options.preference) {
    j["preference"] = true;
    j["rows_held"] = rep.options.rows_held;
    j["reference_model"] = rep.options.reference_model;
  }
  j["lora_rank"] = rep.options.full ? 0 : rep.options.lora_rank;
  if (!rep.options.full && !rep.options.lora_targets.empty()) j["lora_targets"] = rep.options.lora_targets;
  j["quantize"] = rep.options.quantize.empty() ? "none" : rep.options.quantize;
  j["double_quant"] = rep.options.double_quant;
  j["optimizer"] = rep.options.optimizer;
  j["router_aux_loss_coef"] = rep.router_aux_loss_coef;
  j["results"] = nlohmann::ordered_json::array();
  for (const LengthPlan& l : rep.lengths) {
    nlohmann::ordered_json x;
    x["seq"] = l.seq;
    const RankPlan& top = l.largest();
    x["peak_allocated_bytes"] = top.peak_allocated_bytes;
    x["peak_rank"] = top.rank;
    x["offload_host_bytes"] = top.host_peak_bytes;
    const StepTime& t = l.slowest().time;
    x["predicted_step_s"] = t.total_s();
    x["predicted_step"] = {{"device", rep.rates.kind}, {"gemm_s", t.gemm_s},   {"attention_s", t.attention_s},
                           {"memory_s", t.memory_s},   {"overhead_s", t.overhead_s}, {"ops", t.ops}};
    x["ranks"] = nlohmann::ordered_json::array();
    for (const RankPlan& r : l.ranks) {
      nlohmann::ordered_json y;
      y["rank"] = r.rank;
      y["tokens"] = r.tokens;
      y["peak_allocated_bytes"] = r.peak_allocated_bytes;
      y["peak_phase"] = r.peak_phase;
      y["steady_bytes"] = r.steady_bytes;
      y["host_peak_bytes"] = r.host_peak_bytes;
      nlohmann::ordered_json parts = nlohmann::ordered_json::object();
      for (const PlanPart& p : r.parts) parts[p.name] = p.bytes;
      y["parts"] = parts;
      x["ranks"].push_back(y);
    }
    j["results"].push_back(x);
  }
  return j;
}

}  // namespace spindle::plan
