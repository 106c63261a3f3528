#include "model/weights.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/load_tensor.h"
#include "model/family.h"
#include "model/mxfp4.h"

namespace spindle {

namespace {

std::string join(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : " ") + n;
  return out;
}

// LoRA's A matrix as PEFT initialises it: Kaiming-uniform with a = sqrt(5), i.e. U(±1/sqrt(in)),
// drawn on the host (doubles, in element order) and converted to a's dtype through an F64 staging
// tensor on the backend. A backend that only counts gets the staging allocation and no values.
void draw_lora_a(Backend& backend, Tensor& a, int64_t in_features, std::mt19937_64& rng) {
  Tensor dev;
  if (backend.device().kind != DeviceKind::CPU) dev = backend.empty(a.shape(), DType::F64);
  if (!backend.computes()) return;
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  std::uniform_real_distribution<double> uniform(-bound, bound);
  Tensor staging = make_cpu_backend(0)->empty(a.shape(), DType::F64);  // 0: keeps the process's thread count
  double* values = staging.data_as<double>();
  for (int64_t i = 0; i < a.numel(); ++i) values[i] = uniform(rng);
  if (!dev.defined()) {
    backend.copy(backend.default_stream(), staging, a);
    return;
  }
  backend.copy_from_host(backend.default_stream(), staging.data(), dev);
  backend.copy(backend.default_stream(), dev, a);
}

// ModelWeights::random's values: uniform on ±0.02·√3 (standard deviation 0.02), or 1 for a norm,
// from a counter-based hash of (seed, the parameter's place in declaration order from 1, element)
// drawn by the backend itself (core/random_hash.h): nothing is drawn on the host or copied, and a
// 72B model's 7e10 values take under a second on a GPU, where the host's cores took minutes.
bool is_norm(const std::string& name) { return name.find("norm") != std::string::npos; }

void draw_random(Backend& backend, Tensor& t, uint64_t seed, uint64_t ordinal, const std::string& name) {
  if (is_norm(name)) return backend.fill(backend.default_stream(), t, 1.0);
  static const double half_width = 0.02 * std::sqrt(3.0);
  backend.fill_random_uniform(backend.default_stream(), t, seed, ordinal, half_width);
}

}  // namespace

// Creates the parameters blocks ask for, in the model dtype on the backend.
class ModelWeights::Allocator final : public ParameterSink {
 public:
  Allocator(ModelWeights& weights, Backend& backend, QuantizedLoader* loader = nullptr)
      : weights_(weights), backend_(backend), loader_(loader) {}
  Parameter& add(const std::string& name, Shape shape) override { return weights_.add(backend_, name, shape); }
  Parameter& add_buffer(const std::string& name, Shape shape) override {
    Parameter& p = weights_.params_.emplace_back();
    p.name = name;
    p.value = backend_.empty(shape, stat_dtype(weights_.dtype));
    p.buffer = true;
    return p;
  }
  void add_packed(PackedTensor packed) override { weights_.packed_.push_back(std::move(packed)); }

 private:
  ModelWeights& weights_;
  Backend& backend_;
  QuantizedLoader* loader_;

  // A projection just declared: a 4-bit one replaces its dense weight at once (model/quantized_weights.h).
  void on_linear(const LinearSpec& spec) override {
    if (!loader_) return;
    // Its weight was added just now (before its bias): searched from the end, since a model of 128
    // experts per layer has tens of thousands of parameters and as many projections.
    const std::string name = spec.prefix + ".weight";
    Parameter* weight = nullptr;
    for (auto p = weights_.params_.rbegin(); p != weights_.params_.rend() && !weight; ++p)
      if (p->name == name) weight = &*p;
    SPINDLE_CHECK(weight, "projection {} has no weight parameter", spec.prefix);
    loader_->on_linear(spec, *weight, [this](const std::string& name) -> Parameter& {
      Parameter& p = weights_.params_.emplace_back();
      p.name = name;
      return p;
    });
  }
};

namespace {

// The routed experts' fused tensors as PEFT's target_parameters name them.
const char* const kExpertsGateUp = "mlp.experts.gate_up_proj";
const char* const kExpertsDown = "mlp.experts.down_proj";

// Why the router (mlp.gate) is not a LoRA target.
const char* const kRouterNotAdapted =
    "LoRA on the MoE router (mlp.gate) is not supported: an adapter there changes which experts each token is "
    "sent to, a discrete top-k choice no gradient reaches (only the chosen experts' routing weights are "
    "differentiable), and the experts' load balance rests on it, so spindle keeps the router frozen; adapt the "
    "routed experts instead (--lora-targets experts, PEFT's target_parameters mlp.experts.gate_up_proj and "
    "mlp.experts.down_proj)";

// Host values into a backend tensor of their dtype (t's shape and dtype, copied as stored).
void copy_host_tensor(Backend& backend, const Tensor& host, Tensor& t) {
  if (backend.device().kind == DeviceKind::CPU) backend.copy(backend.default_stream(), host, t);
  else backend.copy_from_host(backend.default_stream(), host.data(), t);
}

// gpt-oss's released experts: a transposed packed tensor [E, in, out] the checkpoint holds as MXFP4
// "<name>_blocks" U8 [E, out, in/32, 16] and "<name>_scales" U8 [E, out, in/32], dequantised into
// its parts ([out, in] each, so not transposed) as transformers' Mxfp4Config(dequantize=True)
// loads them. False when the checkpoint has no such pair.
bool read_mxfp4_packed(Backend& backend, const io::Checkpoint& checkpoint, PackedTensor& packed,
                       std::set<const Parameter*>& filled) {
  const io::TensorRecord* blocks = checkpoint.find(packed.name + "_blocks");
  const io::TensorRecord* scales = checkpoint.find(packed.name + "_scales");
  if (!packed.transposed_parts || !blocks || !scales) return false;
  const int64_t experts = packed.shape[0], in = packed.shape[1], out = packed.shape[2];
  if (in % 32) fail("{}_blocks: MXFP4 blocks of 32 values need an input width divisible by 32, got {}", packed.name, in);
  const Shape block_shape{experts, out, in / 32, 16}, scale_shape{experts, out, in / 32};
  if (blocks->shape != block_shape || blocks->dtype != DType::U8)
    fail("{}_blocks is {} {}; MXFP4 experts of this config are U8 {}", packed.name, blocks->stored_dtype,
         blocks->shape.str(), block_shape.str());
  if (scales->shape != scale_shape || scales->dtype != DType::U8)
    fail("{}_scales is {} {}; MXFP4 experts of this config are U8 {}", packed.name, scales->stored_dtype,
         scales->shape.str(), scale_shape.str());
  const std::vector<float> values = dequantize_mxfp4(static_cast<const uint8_t*>(blocks->data),
                                                     static_cast<const uint8_t*>(scales->data), experts * out, in / 32);
  Tensor whole = backend.empty(Shape{experts, out, in}, DType::F32);  // [E, out, in]
  backend.copy_from_host(backend.default_stream(), values.data(), whole);
  int64_t offset = 0;
  for (Parameter* part : packed.parts) {
    backend.copy(backend.default_stream(), whole.flat(offset, part->value.numel()), part->value);
    offset += part->value.numel();
    filled.insert(part);
  }
  backend.synchronize(backend.default_stream());
  packed.read = true;  // written back dense, in the layout transformers saves a dequantised model in
  return true;
}

}  // namespace

void copy_transposed(Backend& backend, const Tensor& stored, Tensor& matrix) {
  SPINDLE_CHECK(matrix.shape().rank() == 2 && stored.numel() == matrix.numel() && stored.dtype() == matrix.dtype(),
                "copy_transposed: {} into {}", stored.describe(), matrix.describe());
  const int64_t rows = matrix.dim(0), cols = matrix.dim(1);
  const size_t element = dtype_size(matrix.dtype());
  std::vector<char> in(stored.bytes()), out(matrix.bytes());  // [cols, rows], [rows, cols]
  backend.copy_to_host(backend.default_stream(), stored, in.data());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c)
      std::memcpy(out.data() + (r * cols + c) * element, in.data() + (c * rows + r) * element, element);
  backend.copy_from_host(backend.default_stream(), out.data(), matrix);
}

namespace {

// The projections a family may hold in one (phi3), by PEFT module name, and the ones each stands for.
struct FusedProjection {
  const char* name;
  std::vector<std::string> parts;
  const char* parts_text;
};
const FusedProjection kFusedProjections[] = {
    {"qkv_proj", {"q_proj", "k_proj", "v_proj"}, "q_proj, k_proj and v_proj"},
    {"gate_up_proj", {"gate_proj", "up_proj"}, "gate_proj and up_proj"},
};

}  // namespace

std::vector<std::string> ModelWeights::present_lora_targets(const std::vector<std::string>& targets) const {
  const std::vector<std::string> has = projection_names();
  std::vector<std::string> out;
  auto add = [&](const std::string& t) {
    if (std::find(has.begin(), has.end(), t) != has.end() && std::find(out.begin(), out.end(), t) == out.end())
      out.push_back(t);
  };
  for (const std::string& t : targets) {
    add(t);
    for (const FusedProjection& fused : kFusedProjections)
      if (std::find(fused.parts.begin(), fused.parts.end(), t) != fused.parts.end()) add(fused.name);
  }
  return out;
}

// What a target that names a projection LoRA does not adapt by its module name (the router, one
// routed expert's projection, a part of a fused projection) is.
std::string ModelWeights::lora_target_hint(const std::string& target) const {
  const std::vector<std::string> has = projection_names();
  for (const FusedProjection& fused : kFusedProjections)
    if (std::find(fused.parts.begin(), fused.parts.end(), target) != fused.parts.end() &&
        std::find(has.begin(), has.end(), fused.name) != has.end())
      return fmt::format(" (this {} model holds {} in one projection, {}, which PEFT adapts as one module: one A and "
                         "one B over its whole output; name {})",
                         config.model_type, fused.parts_text, fused.name, fused.name);
  for (const Linear* lin : linears())
    if (!lin->lora_target && (lin->module == target || lin->module.ends_with("." + target))) {
      if (lin->module == "gate") return fmt::format(" (\"{}\" of this model is the router. {})", target, kRouterNotAdapted);
      return fmt::format(" (\"{}\" of this model is a routed expert's projection: PEFT adapts the routed experts per "
                         "fused tensor, gate and up together as mlp.experts.gate_up_proj, and down as "
                         "mlp.experts.down_proj; name them experts, experts.gate_up_proj or experts.down_proj)",
                         target);
    }
  if (!expert_loras().empty())
    return "; the routed experts: experts (both fused tensors), experts.gate_up_proj, experts.down_proj";
  return "";
}

LoraConfig ModelWeights::resolve_expert_targets(const LoraConfig& in) const {
  LoraConfig out = in;
  out.targets.clear();
  auto add_parameter = [&](const std::string& name) {
    if (std::find(out.target_parameters.begin(), out.target_parameters.end(), name) == out.target_parameters.end())
      out.target_parameters.push_back(name);
  };
  for (const std::string& target : in.targets) {
    const std::vector<std::string> parameters = expert_target_parameters(target);
    if (parameters.empty()) out.targets.push_back(target);
    for (const std::string& name : parameters) add_parameter(name);
  }
  const std::vector<const ExpertLora*> experts = expert_loras();
  for (const std::string& entry : out.target_parameters) {
    if (std::any_of(experts.begin(), experts.end(), [&](const ExpertLora* x) { return x->matches(entry); })) continue;
    for (const Linear* lin : linears())
      if (lin->module == "gate" && !lin->lora_target) {
        const ExpertLora router{.module = lin->prefix, .tensor = "weight"};
        if (router.matches(entry)) fail("LoRA target parameter \"{}\": {}", entry, kRouterNotAdapted);
      }
    if (experts.empty() && config.moe.gating.gpt_oss_experts)
      fail("LoRA target parameter \"{}\": LoRA on gpt_oss's routed experts is not supported (their fused tensors "
           "are [E, in, out] with biases, a layout spindle's expert adapters do not take); adapt the attention "
           "projections (--lora-targets q_proj,k_proj,v_proj,o_proj) or train the experts in full (--full)",
           entry);
    if (experts.empty())
      fail("LoRA target parameter \"{}\": this {} model has no routed experts, and target_parameters adapt only "
           "the routed experts' fused tensors ({}, {}); adapt its projections by module name instead",
           entry, config.model_type, kExpertsGateUp, kExpertsDown);
    fail("LoRA target parameter \"{}\" names no tensor spindle adapts: target_parameters may name the routed "
         "experts' fused tensors {} and {} (the full name, e.g. {}, or a dotted suffix of it)",
         entry, kExpertsGateUp, kExpertsDown, experts.front()->key());
  }
  return out;
}

double LoraConfig::scaling() const {
  return rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / static_cast<double>(rank);
}

Parameter& ModelWeights::add(Backend& backend, const std::string& name, Shape shape) {
  Parameter& p = params_.emplace_back();
  p.name = name;
  p.value = backend.empty(shape, dtype);
  return p;
}

Parameter* ModelWeights::find(const std::string& name) {
  for (Parameter& p : params_)
    if (p.name == name) return &p;
  return nullptr;
}

void ModelWeights::wire(Backend& backend, QuantizedLoader* loader) {
  const ModelConfig& c = config;
  const int64_t h = c.hidden_size;
  if (backend.device().kind != DeviceKind::CPU && !c.model_type.empty())
    if (const ModelFamily& family = model_family(c.model_type, c.model_type); !family.cpu_only_reason.empty())
      fail("model_type {} runs on the CPU backend for now: {}; use --device cpu", c.model_type, family.cpu_only_reason);
  Allocator sink(*this, backend, loader);
  embed = &add(backend, c.weight_prefix + "embed_tokens.weight", Shape{c.vocab_size, h});
  layers.reserve(static_cast<size_t>(c.num_layers));
  for (int64_t l = 0; l < c.num_layers; ++l) layers.emplace_back(sink, c, l);
  final_norm = &add(backend, c.weight_prefix + "norm.weight", Shape{h});
  lm_head = c.tie_word_embeddings ? embed : &add(backend, "lm_head.weight", Shape{c.vocab_size, h});
}

std::vector<Linear*> ModelWeights::linears() {
  std::vector<Linear*> out;
  for (DecoderLayer& layer : layers)
    for (Linear* lin : layer.linears()) out.push_back(lin);
  return out;
}

std::vector<const Linear*> ModelWeights::linears() const {
  std::vector<const Linear*> out;
  for (Linear* lin : const_cast<ModelWeights*>(this)->linears()) out.push_back(lin);
  return out;
}

std::vector<std::string> ModelWeights::projection_names() const {
  std::vector<std::string> names;
  for (const Linear* lin : linears())
    if (lin->lora_target && std::find(names.begin(), names.end(), lin->module) == names.end())
      names.push_back(lin->module);
  return names;
}

ModelWeights ModelWeights::load(Backend& backend, const ModelConfig& config, const io::Checkpoint& checkpoint,
                                DType dtype, const QuantizeOptions& quantize) {
  ModelWeights w;
  w.config = config;
  w.dtype = dtype;
  QuantizedLoader loader(backend, checkpoint, checkpoint.path(), quantize);
  w.wire(backend, loader.active() ? &loader : nullptr);
  loader.bind(w.linears());
  if (loader.active()) loader.check_all_used();
  // A packed tensor the checkpoint holds fills its parts; every other parameter is read by its name.
  std::set<const Parameter*> filled;
  for (PackedTensor& packed : w.packed_) {
    if (!checkpoint.find(packed.name) && read_mxfp4_packed(backend, checkpoint, packed, filled)) continue;
    if (!checkpoint.find(packed.name)) continue;
    const Tensor whole = io::load_tensor(backend, checkpoint.require(packed.name, packed.shape), dtype);
    int64_t offset = 0;
    for (Parameter* part : packed.parts) {
      const Tensor stored = whole.flat(offset, part->value.numel());
      if (packed.transposed_parts) copy_transposed(backend, stored, part->value);
      else backend.copy(backend.default_stream(), stored, part->value);
      offset += part->value.numel();
      filled.insert(part);
    }
    packed.read = true;
  }
  for (Parameter& p : w.params_)
    if (!filled.count(&p) && !loader.filled(p))
      io::load_tensor_into(backend, checkpoint.require(p.name, p.value.shape()), p.value);
  return w;
}

ModelWeights ModelWeights::uninitialized(Backend& backend, const ModelConfig& config, DType dtype) {
  ModelWeights w;
  w.config = config;
  w.dtype = dtype;
  w.wire(backend);
  return w;
}

ModelWeights ModelWeights::random(Backend& backend, const ModelConfig& config, DType dtype, uint64_t seed,
                                  const QuantizeOptions& quantize) {
  ModelWeights w;
  w.config = config;
  w.dtype = dtype;
  // A quantised projection is drawn by the backend into its dense tensor (model dtype), quantised
  // there, and only its 4-bit data stay (model/quantized_weights.h). Its place in the order of
  // declaration (which seeds it) skips the absmax parameters the quantiser appended before it: one
  // per projection, two with double quantisation.
  const int64_t appended_per_projection = quantize.double_quant ? 2 : 1;
  int64_t quantized_so_far = 0;
  QuantizedLoader loader(backend, quantize, [&](const LinearSpec&, Parameter& weight, Tensor& dense) {
    int64_t position = static_cast<int64_t>(w.params_.size()) - 1;
    while (&w.params_[static_cast<size_t>(position)] != &weight) --position;
    const uint64_t ordinal = static_cast<uint64_t>(position + 1 - quantized_so_far * appended_per_projection);
    ++quantized_so_far;
    draw_random(backend, dense, seed, ordinal, weight.name);
  });
  w.wire(backend, loader.active() ? &loader : nullptr);
  loader.bind(w.linears());
  std::set<const Parameter*> quantized;  // the projections' packed bytes, in their dense weight's place
  for (const Linear* lin : w.linears())
    if (lin->quantized()) quantized.insert(lin->quant.packed);
  uint64_t ordinal = 0;
  for (Parameter& p : w.params_) {
    if (quantized.count(&p)) ++ordinal;
    if (loader.filled(p)) continue;
    draw_random(backend, p.value, seed, ++ordinal, p.name);
  }
  backend.synchronize(backend.default_stream());
  return w;
}

void ModelWeights::make_trainable(Backend& backend, Parameter& p) {
  p.trainable = true;
  if (!p.grad.defined()) p.grad = backend.zeros(p.value.shape(), p.value.dtype());
}

void ModelWeights::train_all(Backend& backend) {
  if (has_quantized_projections())
    fail("full fine-tuning needs dense weights, and this model's projections are 4-bit (bitsandbytes): train LoRA "
         "adapters on it (drop --full), or load a dense checkpoint");
  for (Parameter& p : params_)
    if (!p.buffer) make_trainable(backend, p);
}

bool ModelWeights::has_quantized_projections() const {
  for (const Linear* lin : linears())
    if (lin->quantized()) return true;
  return false;
}

void ModelWeights::quantize_projections(Backend& backend, const QuantizeOptions& options) {
  spindle::quantize_projections(backend, linears(), options, [this](const std::string& name) -> Parameter& {
    Parameter& p = params_.emplace_back();
    p.name = name;
    return p;
  });
}

void ModelWeights::zero_grads(Backend& backend) {
  for (Parameter& p : params_)
    if (p.grad.defined()) backend.fill(backend.default_stream(), p.grad, 0.0);
}

void ModelWeights::add_lora(Backend& backend, const LoraConfig& lora_config, uint64_t seed) {
  if (lora.rank) fail("this model already has LoRA adapters");
  if (lora_config.rank <= 0) fail("LoRA rank must be positive, got {}", lora_config.rank);
  if (lora_config.targets.empty() && lora_config.target_parameters.empty())
    fail("LoRA needs at least one target module");
  const LoraConfig resolved = resolve_expert_targets(lora_config);
  const std::vector<std::string> projections = projection_names();
  for (const std::string& target : resolved.targets)
    if (std::find(projections.begin(), projections.end(), target) == projections.end())
      fail("LoRA target \"{}\" is not a projection of this {} model; choose from {}{}", target, config.model_type,
           join(projections), lora_target_hint(target));
  lora = resolved;
  std::mt19937_64 rng(seed);
  for (DecoderLayer& layer : layers) {
    for (const std::string& target : lora.targets) {
      Linear* lin = layer.linear(target);
      if (!lin || !lin->lora_target) continue;  // a projection of other layers' kind (PEFT adapts the layers that have it)
      const std::string& base = lin->prefix;
      Parameter& a = add(backend, "base_model.model." + base + ".lora_A.weight", Shape{lora.rank, lin->in_features()});
      Parameter& b = add(backend, "base_model.model." + base + ".lora_B.weight", Shape{lin->out_features(), lora.rank});
      // B = 0 so training starts at the base model (PEFT's default).
      draw_lora_a(backend, a.value, lin->in_features(), rng);
      backend.fill(backend.default_stream(), b.value, 0.0);
      lin->lora_a = &a;
      lin->lora_b = &b;
      lin->lora_scaling = lora.scaling();
      lin->rank = lora.rank;
      make_trainable(backend, a);
      make_trainable(backend, b);
    }
    add_expert_lora(backend, layer, rng);
  }
}

void ModelWeights::add_expert_lora(Backend& backend, DecoderLayer& layer, std::mt19937_64& rng) {
  std::vector<ExpertLora*> adapted;
  for (ExpertLora* slot : layer.feed_forward().expert_loras())
    for (const std::string& entry : lora.target_parameters)
      if (slot->matches(entry)) {
        adapted.push_back(slot);
        break;
      }
  // PEFT wraps each targeted tensor of one module in a ParamWrapper of its own, the module's first
  // tensor innermost: a pair's names carry one ".base_layer" per wrapper around its own.
  for (size_t i = 0; i < adapted.size(); ++i) {
    ExpertLora& slot = *adapted[i];
    std::string module = "base_model.model." + slot.module;
    for (size_t outer = i + 1; outer < adapted.size(); ++outer) module += ".base_layer";
    Parameter& a = add(backend, module + ".lora_A.weight", Shape{slot.experts * lora.rank, slot.in});
    Parameter& b = add(backend, module + ".lora_B.weight", Shape{slot.experts, slot.out, lora.rank});
    // As PEFT initialises the pair (A: nn.Linear(in, r·E), Kaiming-uniform; B = 0).
    draw_lora_a(backend, a.value, slot.in, rng);
    backend.fill(backend.default_stream(), b.value, 0.0);
    slot.a = &a;
    slot.b = &b;
    slot.rank = lora.rank;
    slot.scaling = lora.scaling();
    make_trainable(backend, a);
    make_trainable(backend, b);
  }
}

std::vector<ExpertLora*> ModelWeights::expert_loras() {
  std::vector<ExpertLora*> out;
  for (DecoderLayer& layer : layers)
    for (ExpertLora* lora : layer.feed_forward().expert_loras()) out.push_back(lora);
  return out;
}

std::vector<const ExpertLora*> ModelWeights::expert_loras() const {
  std::vector<const ExpertLora*> out;
  for (ExpertLora* lora : const_cast<ModelWeights*>(this)->expert_loras()) out.push_back(lora);
  return out;
}

const ExpertLora* ModelWeights::expert_lora_of_b(const Parameter& p) const {
  for (const ExpertLora* lora : expert_loras())
    if (lora->b == &p) return lora;
  return nullptr;
}

void ModelWeights::load_peft_adapter(Backend& backend, const std::string& dir) {
  namespace fs = std::filesystem;
  const fs::path config_path = fs::path(dir) / "adapter_config.json";
  std::ifstream in(config_path);
  if (!in) fail("cannot open {}: --adapter must be a PEFT adapter folder", config_path.string());
  nlohmann::json j;
  try {
    in >> j;
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", config_path.string(), e.what());
  }
  const std::string src = config_path.string();
  auto unsupported_if = [&](bool cond, const std::string& what) {
    if (cond) fail("{}: {} is not supported by spindle's LoRA", src, what);
  };
  unsupported_if(j.value("peft_type", "LORA") != "LORA", "peft_type " + j.value("peft_type", std::string()));
  unsupported_if(j.value("use_dora", false), "use_dora = true");
  unsupported_if(j.value("fan_in_fan_out", false), "fan_in_fan_out = true");
  unsupported_if(j.contains("bias") && j["bias"] != "none", "bias = " + j["bias"].dump());
  unsupported_if(j.contains("modules_to_save") && !j["modules_to_save"].is_null() && !j["modules_to_save"].empty(),
                 "modules_to_save");
  unsupported_if(j.contains("layers_to_transform") && !j["layers_to_transform"].is_null(), "layers_to_transform");
  unsupported_if(j.contains("rank_pattern") && !j["rank_pattern"].empty(), "rank_pattern");
  unsupported_if(j.contains("alpha_pattern") && !j["alpha_pattern"].empty(), "alpha_pattern");
  if (!j.contains("r") || !j["r"].is_number_integer()) fail("{}: missing integer \"r\"", src);
  // PEFT's LoRA on parameters rather than modules: spindle reads it for the routed experts' fused tensors.
  std::vector<std::string> target_parameters;
  if (const nlohmann::json tp = j.value("target_parameters", nlohmann::json()); tp.is_array()) {
    for (const auto& t : tp) {
      if (!t.is_string()) fail("{}: target_parameters must be a list of parameter names, got {}", src, tp.dump());
      target_parameters.push_back(t.get<std::string>());
    }
  } else if (!tp.is_null()) {
    fail("{}: target_parameters must be a list of parameter names, got {}", src, tp.dump());
  }
  LoraConfig lc;
  lc.rank = j["r"].get<int64_t>();
  lc.alpha = j.value("lora_alpha", 8.0);
  lc.rslora = j.value("use_rslora", false);
  const auto& targets = j.value("target_modules", nlohmann::json());
  const std::vector<std::string> projections = projection_names();
  if (targets.is_string() && targets == "all-linear") {
    lc.targets = projections;
  } else if (targets.is_array()) {
    for (const auto& t : targets) lc.targets.push_back(t.get<std::string>());
  } else if (targets.is_null() && !target_parameters.empty()) {
    // no module targets: the adapter adapts parameters only
  } else {
    fail("{}: target_modules must be a list of module names or \"all-linear\", got {}", src, targets.dump());
  }
  // Keep the canonical projection order so parameters come out in a stable order.
  std::vector<std::string> ordered;
  for (const std::string& t : projections)
    if (std::find(lc.targets.begin(), lc.targets.end(), t) != lc.targets.end()) ordered.push_back(t);
  for (const std::string& t : lc.targets)
    if (std::find(projections.begin(), projections.end(), t) == projections.end())
      fail("{}: LoRA target \"{}\" is not supported (not a projection of this {} model); spindle adapts {}{}", src, t,
           config.model_type, join(projections), lora_target_hint(t));
  lc.targets = ordered;
  lc.target_parameters = target_parameters;

  add_lora(backend, lc, 0);
  const fs::path weights_path = fs::path(dir) / "adapter_model.safetensors";
  if (!fs::exists(weights_path))
    fail("{} is missing: spindle reads adapters saved with safetensors (PEFT's default)", weights_path.string());
  io::Checkpoint file(weights_path.string());
  std::set<std::string> used;
  for (Parameter& p : params_) {
    if (p.name.rfind("base_model.model.", 0) != 0) continue;
    used.insert(p.name);
    const ExpertLora* expert = expert_lora_of_b(p);
    if (!expert) {
      io::load_tensor_into(backend, file.require(p.name, p.value.shape()), p.value);
      continue;
    }
    // An expert LoRA's B: PEFT's [out, r·E] into spindle's [E, out, r] on the host.
    auto host = make_cpu_backend(0);
    const Tensor stored =
        io::load_tensor(*host, file.require(p.name, Shape{expert->out, expert->rank * expert->experts}), p.value.dtype());
    Tensor per_expert = host->empty(p.value.shape(), p.value.dtype());
    expert_lora_b_from_peft(stored, per_expert);
    copy_host_tensor(backend, per_expert, p.value);
  }
  for (const std::string& name : file.names())
    if (!used.count(name))
      fail("{}: tensor \"{}\" does not belong to a LoRA target of adapter_config.json; spindle cannot apply it",
           weights_path.string(), name);
}

}  // namespace spindle
