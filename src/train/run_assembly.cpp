#include "train/run_assembly.h"

#include <algorithm>

#include "backend/cpu/quant4_ops.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "parallel/sp_attention.h"
#include "train/setup.h"
#include "train/train_config.h"

namespace spindle {

namespace fs = std::filesystem;

namespace {

// The parameters ModelWeights::quantize_projections leaves in place of each quantisable projection's
// dense weight (model/quantized_weights.h), allocated without the host pass that computes their
// bytes (minutes for a 7B model, and a plan computes nothing): packed U8 [(n+1)/2], absmax F32
// [blocks] or, double-quantised, U8 codes [blocks] with F32 nested absmax [ceil(blocks/256)] and one
// shared F32 [256] code map. tests/cli/check_plan.py compares the result with `spindle bench
// --quantize`, so a change of that layout shows there.
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

ModelWeights build_weights(Backend& backend, const RunDescription& d) {
  switch (d.weights) {
    case WeightSource::kCheckpoint:
      return ModelWeights::load(backend, d.model, io::Checkpoint(d.checkpoint.string()), d.dtype, d.quantize);
    case WeightSource::kRandom:
      // With --quantize each projection is quantised as it is drawn: the dense model never exists.
      return ModelWeights::random(backend, d.model, d.dtype, d.weight_seed, d.quantize);
    case WeightSource::kShapes: {
      ModelWeights weights = ModelWeights::uninitialized(backend, d.model, d.dtype);
      declare_quantized_projections(backend, weights, d.quantize);
      return weights;
    }
  }
  SPINDLE_CHECK(false, "unknown weight source");
  return {};
}

void make_trainable(Backend& backend, ModelWeights& weights, const AdapterDescription& a) {
  switch (a.kind) {
    case AdapterDescription::Kind::kFrozen:
      return;
    case AdapterDescription::Kind::kFull:
      weights.train_all(backend);
      return;
    case AdapterDescription::Kind::kPeft:
      weights.load_peft_adapter(backend, a.folder.string());
      return;
    case AdapterDescription::Kind::kNewLora: {
      LoraConfig lora = a.lora;
      // No targets: every projection the family has (the routed experts, "experts", only when named).
      if (lora.targets.empty()) lora.targets = weights.projection_names();
      // sft's default list names every attention and MLP projection of the dense families; a model
      // without some of them (qwen3_moe: its MLPs are routed experts) adapts those it has, a model
      // that fuses some (phi3: qkv_proj, gate_up_proj) its fused ones.
      if (a.only_targets_present) lora.targets = weights.present_lora_targets(lora.targets);
      weights.add_lora(backend, lora, a.seed);
      return;
    }
  }
}

}  // namespace

Decoder& AssembledRun::decoder() {
  if (!decoder_) decoder_ = make_decoder(backend_, description_.decoder);
  return *decoder_;
}

std::unique_ptr<Decoder> AssembledRun::make_decoder(Backend& compute, const DecoderOptions& options) const {
  // Decoder computes with `weights` but may not modify them through a const run; the weights are
  // the run's own, which the decoder's backward writes gradients into.
  auto decoder = std::make_unique<Decoder>(compute, const_cast<ModelWeights&>(weights), options);
  if (sequence_mixer) decoder->set_attention(sequence_mixer.get());
  if (state && state->fsdp()) decoder->set_parameter_hooks(state->fsdp());
  decoder->set_router_aux_loss(router_aux.get());
  return decoder;
}

std::unique_ptr<AssembledRun> assemble_run(Backend& backend, const RunDescription& d, const RunPlacement& at,
                                           const std::function<void(AssemblyStage)>& on_stage) {
  auto stage = [&](AssemblyStage s) {
    if (on_stage) on_stage(s);
  };
  auto run = std::make_unique<AssembledRun>(backend, d);
  stage(AssemblyStage::kWeights);
  run->weights = build_weights(backend, d);
  stage(AssemblyStage::kTrainable);
  make_trainable(backend, run->weights, d.adapter);
  for (const Parameter& p : run->weights.parameters()) {
    run->parameters += p.value.numel();
    if (p.trainable) run->trainable_parameters += p.value.numel();
  }
  for (const Linear* lin : run->weights.linears())  // a 4-bit weight: its weights, not its bytes and absmax
    if (lin->quantized()) {
      run->parameters += lin->out_features() * lin->in_features();
      for (const Parameter* p : {lin->quant.packed, lin->quant.absmax, lin->quant.nested_absmax})
        if (p) run->parameters -= p->value.numel();
    }
  stage(AssemblyStage::kShards);
  run->state = std::make_unique<TrainableState>(backend, run->weights, at.world, d.shard);
  if (d.optimizer) {
    stage(AssemblyStage::kOptimizer);
    run->state->add_optimizer(*d.optimizer);
  }
  // Every mixer kind's sequence-parallel strategy (softmax attention, gated DeltaNet) for the mesh.
  if (at.mesh && at.sp() > 1) run->sequence_mixer = parallel::make_sequence_parallel_attention(*at.mesh, d.model);
  if (d.router_aux_loss > 0) {
    stage(AssemblyStage::kRouterAux);
    run->router_aux = std::make_unique<RouterAuxLoss>(backend, d.model, d.dtype, d.router_aux_loss);
  }
  return run;
}

DecoderOptions memory_options(RecomputeMode recompute, int64_t num_layers, int64_t recompute_layers, bool offload,
                              int64_t offload_layers, int64_t mlp_tile_tokens, int64_t checkpoint_stride) {
  DecoderOptions options = recompute_options(recompute, num_layers, recompute_layers);
  options.offload = offload;
  options.offload_layers = offload_layers;
  options.mlp_tile_tokens = mlp_tile_tokens_to_run(mlp_tile_tokens);
  options.checkpoint_stride = checkpoint_stride;
  return options;
}

RunDescription describe_training_run(const TrainConfig& config, const ModelConfig& model, DType dtype,
                                     const fs::path& resume_from) {
  RunDescription d;
  d.model = model;
  d.dtype = dtype;
  d.quantize = parse_quantize_options(config.quantize, config.double_quant, config.quant_block_size);
  // A full fine-tune resumes from its checkpoint's weights; LoRA from --model's and the checkpoint's adapter.
  d.weights = config.random_weights ? WeightSource::kRandom : WeightSource::kCheckpoint;
  d.checkpoint = !resume_from.empty() && config.full ? resume_from / "model" : fs::path(config.model);
  d.weight_seed = config.seed;
  AdapterDescription& a = d.adapter;
  if (config.full) {
    a.kind = AdapterDescription::Kind::kFull;
  } else if (!resume_from.empty()) {
    a.kind = AdapterDescription::Kind::kPeft;
    a.folder = resume_from / "adapter";
  } else if (!config.adapter.empty()) {
    a.kind = AdapterDescription::Kind::kPeft;
    a.folder = config.adapter;
  } else {
    // New adapters from --seed on every rank: identical initial adapters without a broadcast.
    a.kind = AdapterDescription::Kind::kNewLora;
    a.lora.rank = config.lora_rank;
    a.lora.alpha = config.lora_alpha;
    a.lora.rslora = config.rslora;
    a.lora.targets = config.lora_targets;
    // Targets the user names are checked against the model; of the default list, those it has.
    a.only_targets_present = config.lora_targets == TrainConfig{}.lora_targets;
    a.seed = config.seed;
  }
  // FSDP (default with several processes) shards parameters, gradients and AdamW state over all ranks.
  d.shard = !config.no_fsdp;
  d.optimizer = AdamWConfig{config.adam_beta1, config.adam_beta2, config.adam_eps, config.weight_decay,
                            config.max_grad_norm};
  d.decoder = decoder_options(config, model);
  d.router_aux_loss = router_aux_loss_coefficient(model, config.router_aux_loss_coef);
  return d;
}

RunDescription describe_reference(const RunDescription& policy, const ModelConfig& model, const fs::path& folder) {
  RunDescription d;
  d.model = model;
  d.weights = WeightSource::kCheckpoint;
  d.checkpoint = folder;
  d.dtype = policy.dtype;
  d.quantize = policy.quantize;
  d.adapter.kind = AdapterDescription::Kind::kFrozen;
  d.shard = policy.shard;
  d.decoder = policy.decoder;
  return d;
}

}  // namespace spindle
