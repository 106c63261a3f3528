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

// The parameters ModelWeights::quantize_projections leaves in place of each quantisable projection's
// dense weight (model/quantized_weights.h), allocated on the DryBackend without the host pass that
// computes their bytes (minutes for a 7B model, and a plan computes nothing): packed U8 [(n+1)/2],
// absmax F32 [blocks] or, double-quantised, U8 codes [blocks] with F32 nested absmax
// [ceil(blocks/256)] and one shared F32 [256] code map. tests/cli/check_plan.py compares the result
// with `spindle bench --quantize`, so a change of that layout shows there.
void declare_quantized_projections(Backend& backend, ModelWeights& weights, const QuantizeOptions& q) {
  if (!q.active()) return;
  Tensor code_map;
  if (q.double_quant) code_map = backend.empty(Shape{256}, DType::F32);
  for (Linear* lin : weights.linears()) {
    if (lin->quantized() || !quantizable_projection(lin->module)) continue;
    const int64_t n = lin->out * lin->in, blocks = quant4::num_blocks(n, q.blocksize);
    auto add = [&](const std::string& name) -> Parameter& {
      Parameter& p = weights.parameters().emplace_back();
      p.name = name;
      return p;
    };
    QuantizedWeight w;
    w.blocksize = q.blocksize;
    w.packed = lin->weight;
    w.packed->value = Tensor();  // the dense matrix first, as the real pass frees it
    w.packed->value = backend.empty(Shape{(n + 1) / 2}, DType::U8);
    w.absmax = &add(lin->prefix + ".weight.absmax");
    w.absmax->value = backend.empty(Shape{blocks}, q.double_quant ? DType::U8 : DType::F32);
    if (q.double_quant) {
      w.nested_absmax = &add(lin->prefix + ".weight.nested_absmax");
      w.nested_absmax->value = backend.empty(Shape{quant4::num_blocks(blocks, quant4::kNestedBlocksize)}, DType::F32);
      w.nested_blocksize = quant4::kNestedBlocksize;
      w.nested_code = code_map;
    }
    lin->quant = w;
    lin->format = *q.type == Quant4Type::NF4 ? WeightFormat::NF4 : WeightFormat::FP4;
    lin->weight = nullptr;
  }
}

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

  backend.set_phase(kWeights);
  ModelWeights weights = ModelWeights::uninitialized(backend, config, dtype);
  // As bench and sft hold them: packed bytes and absmax per projection (sharded as bytes by FSDP
  // below); the step then allocates each projection's dequantised scratch where Linear does.
  declare_quantized_projections(backend, weights, parse_quantize_options(o.quantize, o.double_quant, o.quant_block_size));
  backend.set_phase(kTrainable);
  if (o.full) {
    weights.train_all(backend);
  } else {
    LoraConfig lora;
    lora.rank = o.lora_rank;
    lora.alpha = o.lora_alpha;
    // As bench: every projection the family has unless named (the routed experts only when named).
    lora.targets = o.lora_targets.empty() ? weights.projection_names() : o.lora_targets;
    if (o.lora_targets_if_present) lora.targets = weights.present_lora_targets(lora.targets);
    weights.add_lora(backend, lora, 0);
  }
  std::unique_ptr<parallel::Fsdp> fsdp;
  if (world) {
    backend.set_phase(kShards);
    fsdp = std::make_unique<parallel::Fsdp>(backend, weights, *world);
  }
  std::unique_ptr<AdamWOptimizer> optimizer;
  if (o.optimizer) {
    backend.set_phase(kOptimizer);
    if (fsdp) {
      std::vector<OptimizerSlot> slots;
      for (const parallel::ParameterShard& s : fsdp->trainable_shards()) slots.push_back({s.name, s.value, s.grad});
      optimizer = std::make_unique<AdamWOptimizer>(backend, std::move(slots), AdamWConfig{}, world.get());
    } else {
      optimizer = std::make_unique<AdamWOptimizer>(backend, weights, AdamWConfig{});
    }
  }
  // dpo's frozen reference model, loaded after the policy's state and sharded like it (dpo_trainer.cpp).
  ModelWeights reference;
  std::unique_ptr<parallel::Fsdp> reference_fsdp;
  if (reference_config) {
    backend.set_phase(kReference);
    reference = ModelWeights::uninitialized(backend, *reference_config, dtype);
    declare_quantized_projections(backend, reference,
                                  parse_quantize_options(o.quantize, o.double_quant, o.quant_block_size));
    if (world) reference_fsdp = std::make_unique<parallel::Fsdp>(backend, reference, *world);
  }
  // The router load-balancing loss's statistics and gradient, held for the run (sft: StepRunner).
  std::unique_ptr<RouterAuxLoss> router_aux;
  if (aux_coefficient > 0) {
    backend.set_phase(kBatch);
    router_aux = std::make_unique<RouterAuxLoss>(backend, config, dtype, aux_coefficient);
  }
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

  const RecomputeMode recompute = parse_recompute_mode(o.recompute);
  DecoderOptions decoder_options = recompute_options(recompute, config.num_layers, o.recompute_layers);
  decoder_options.offload = o.offload;
  decoder_options.offload_layers = o.offload_layers;
  decoder_options.mlp_tile_tokens = mlp_tile_tokens_to_run(o.mlp_tile_tokens);
  decoder_options.checkpoint_stride = o.checkpoint_stride;
  // The step's ops pass through the step-time model on their way to the dry backend.
  StepCostModel cost(rates, config.num_layers);
  bench::TimedBackend observed(backend, cost);
  Decoder decoder(observed, weights, decoder_options);
  std::unique_ptr<AttentionStrategy> attention;
  if (mesh && mesh_config.sp > 1) attention = parallel::make_sequence_parallel_attention(*mesh, config);
  decoder.set_attention(attention.get());
  PhaseHooks hooks(backend, fsdp.get(), cost);
  decoder.set_parameter_hooks(&hooks);
  if (router_aux) {
    std::function<void(Tensor&)> reduce;
    if (world) reduce = [&](Tensor& t) { world->all_reduce_sum(backend.default_stream(), t); };
    router_aux->begin_step(step_tokens, std::move(reduce));
    decoder.set_router_aux_loss(router_aux.get());
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
