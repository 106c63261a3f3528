#include "support/tiny_model.h"

#include <fstream>
#include <map>
#include <set>

#include "backend/op_test_util.h"
#include "core/error.h"
#include "io/write_safetensors.h"

namespace spindle::test {

nlohmann::json TinyModel::config_json() const {
  nlohmann::json j = {{"model_type", model_type},
                      {"vocab_size", vocab_size},
                      {"hidden_size", hidden_size},
                      {"intermediate_size", intermediate_size},
                      {"num_hidden_layers", num_layers},
                      {"num_attention_heads", num_heads},
                      {"num_key_value_heads", num_kv_heads},
                      {"head_dim", head_dim},
                      {"hidden_act", "silu"},
                      {"rms_norm_eps", rms_norm_eps},
                      {"rope_theta", rope_theta},
                      {"tie_word_embeddings", tie_word_embeddings}};
  // transformers picks the model class by this name; a preset of another family names its own in `extra`.
  static const std::map<std::string, std::string> kArchitectures = {
      {"llama", "LlamaForCausalLM"}, {"qwen2", "Qwen2ForCausalLM"}, {"qwen3", "Qwen3ForCausalLM"},
      {"qwen3_moe", "Qwen3MoeForCausalLM"}, {"qwen3_5_text", "Qwen3_5ForCausalLM"},
      {"qwen3_5_moe_text", "Qwen3_5MoeForCausalLM"}, {"gpt_oss", "GptOssForCausalLM"},
      {"glm4_moe", "Glm4MoeForCausalLM"}, {"phi3", "Phi3ForCausalLM"}};
  if (auto it = kArchitectures.find(model_type); it != kArchitectures.end()) j["architectures"] = {it->second};
  // Every qwen3_5_moe MLP is a mixture of experts: its config has no dense width (transformers
  // refuses the attribute).
  if (model_type == "qwen3_5_moe_text") j.erase("intermediate_size");
  j.update(extra);
  return j;
}

TinyModel tiny_qwen3_5_moe() {
  TinyModel m = tiny_qwen3_5();
  m.model_type = "qwen3_5_moe_text";
  m.extra.update({{"num_experts", 4},
                  {"num_experts_per_tok", 2},
                  {"moe_intermediate_size", 12},
                  {"shared_expert_intermediate_size", 16},
                  {"output_router_logits", false},
                  {"router_aux_loss_coef", 0.001}});
  return m;
}

TinyModel tiny_gpt_oss() {
  TinyModel m;
  m.model_type = "gpt_oss";
  m.intermediate_size = 12;
  m.extra = {{"layer_types", {"sliding_attention", "full_attention"}},
             {"sliding_window", 4},
             {"attention_bias", true},
             {"num_local_experts", 4},
             {"num_experts_per_tok", 2},
             {"swiglu_limit", 7.0},
             {"output_router_logits", false},
             {"router_aux_loss_coef", 0.9}};
  return m;
}

TinyModel tiny_glm4_moe() {
  TinyModel m;
  m.model_type = "glm4_moe";
  m.num_layers = 3;
  m.extra = {{"first_k_dense_replace", 1}, {"n_routed_experts", 8},    {"num_experts_per_tok", 3},
             {"moe_intermediate_size", 12}, {"n_shared_experts", 1},   {"n_group", 4},
             {"topk_group", 2},             {"norm_topk_prob", true},  {"routed_scaling_factor", 2.5},
             {"use_qk_norm", true},         {"attention_bias", true},  {"partial_rotary_factor", 0.5},
             {"num_nextn_predict_layers", 1}};
  return m;
}

TinyModel tiny_phi3() {
  TinyModel m;
  m.model_type = "phi3";
  m.extra = {{"original_max_position_embeddings", 12},
             {"max_position_embeddings", 256},
             {"sliding_window", 6},
             {"partial_rotary_factor", 0.75},
             {"rope_scaling", {{"type", "longrope"}, {"short_factor", {1.05, 1.1, 1.2}}, {"long_factor", {1.5, 4.0, 9.0}}}}};
  return m;
}

nlohmann::json multimodal_config_json(const TinyModel& text) {
  static const std::map<std::string, std::pair<std::string, std::string>> kMultimodal = {
      {"qwen3_5_text", {"qwen3_5", "Qwen3_5ForConditionalGeneration"}},
      {"qwen3_5_moe_text", {"qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration"}}};
  const auto it = kMultimodal.find(text.model_type);
  if (it == kMultimodal.end()) fail("{} has no multimodal checkpoint layout", text.model_type);
  nlohmann::json inner = text.config_json();
  inner.erase("architectures");
  inner.erase("tie_word_embeddings");  // the outer model ties
  return {{"model_type", it->second.first},
          {"architectures", {it->second.second}},
          {"tie_word_embeddings", text.tie_word_embeddings},
          {"image_token_id", text.vocab_size - 4},
          {"video_token_id", text.vocab_size - 3},
          {"text_config", inner},
          {"vision_config",
           {{"model_type", it->second.first + "_vision"}, {"depth", 1}, {"hidden_size", 4}, {"num_heads", 1},
            {"out_hidden_size", text.hidden_size}}}};
}

TinyModel tiny_qwen3_moe() {
  TinyModel m;
  m.model_type = "qwen3_moe";
  m.num_layers = 3;
  m.extra = {{"num_experts", 4},         {"num_experts_per_tok", 2},   {"moe_intermediate_size", 12},
             {"norm_topk_prob", true},   {"decoder_sparse_step", 1},   {"mlp_only_layers", {1}},
             {"output_router_logits", false}, {"router_aux_loss_coef", 0.001}};
  return m;
}

TinyModel tiny_qwen3_5() {
  TinyModel m;
  m.model_type = "qwen3_5_text";
  m.num_layers = 3;
  m.extra = {{"layer_types", {"linear_attention", "full_attention", "linear_attention"}},
             {"linear_num_key_heads", 2},
             {"linear_num_value_heads", 4},
             {"linear_key_head_dim", 8},
             {"linear_value_head_dim", 8},
             {"linear_conv_kernel_dim", 4},
             {"partial_rotary_factor", 0.5}};
  return m;
}

ModelConfig TinyModel::config() const { return ModelConfig::from_json(config_json(), "tiny " + model_type + " model"); }

ModelWeights random_weights(Backend& backend, const ModelConfig& config, DType dtype, uint64_t seed, double scale) {
  ModelWeights w = ModelWeights::random(backend, config, dtype, seed);
  if (scale != 1.0)
    for (Parameter& p : w.parameters())
      if (p.name.find("norm") == std::string::npos) backend.scale(backend.default_stream(), p.value, scale);
  return w;
}

LoraConfig lora_on_every_projection(int64_t rank, double alpha) {
  LoraConfig lora;
  lora.rank = rank;
  lora.alpha = alpha;
  lora.targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  return lora;
}

Draw uniform_draw(double bound) {
  return [dist = std::uniform_real_distribution<double>(-bound, bound)](std::mt19937_64& rng) mutable {
    return dist(rng);
  };
}

Draw normal_draw(double stddev) {
  // One distribution for every draw: it keeps the second value of each pair it generates.
  return [dist = std::normal_distribution<double>(0.0, stddev)](std::mt19937_64& rng) mutable { return dist(rng); };
}

void add_lora_with_random_b(Backend& backend, ModelWeights& weights, const LoraConfig& lora, uint64_t seed,
                            const Draw& draw_b) {
  weights.add_lora(backend, lora, seed);
  std::mt19937_64 rng(seed + 1);
  Draw draw = draw_b;  // a copy: the caller's stays unused, so it can serve another model identically
  for (Parameter& p : weights.parameters())
    if (p.name.find("lora_B") != std::string::npos) {
      std::vector<double> values(p.value.numel());
      for (double& x : values) x = draw(rng);
      from_host(backend, values, p.value);
    }
}

namespace {

void write_json(const std::filesystem::path& dir, const nlohmann::json& config) {
  std::filesystem::create_directories(dir);
  const std::filesystem::path path = dir / "config.json";
  std::ofstream out(path);
  out << config.dump(2) << "\n";
  if (!out) fail("cannot write {}", path.string());
}

}  // namespace

void write_config(const std::filesystem::path& dir, const TinyModel& model) { write_json(dir, model.config_json()); }
void write_config(const std::filesystem::path& dir, const nlohmann::json& config) { write_json(dir, config); }

void write_model_folder(const std::filesystem::path& dir, const nlohmann::json& config_json, uint64_t seed, double scale,
                        const FolderLayout& layout) {
  nlohmann::json config = config_json;
  config["torch_dtype"] = "float32";  // what the weights below are stored in
  write_json(dir, config);
  auto backend = make_cpu_backend(1);
  ModelWeights weights =
      random_weights(*backend, ModelConfig::from_json(config, dir.string()), DType::F32, seed, scale);
  io::NamedTensors tensors = layout.extra;
  std::set<const Parameter*> packed;
  if (layout.fused_experts)
    for (const PackedTensor& p : weights.packed_tensors()) {
      Tensor whole = backend->empty(p.shape, DType::F32);
      int64_t offset = 0;
      for (const Parameter* part : p.parts) {
        Tensor slice = whole.flat(offset, part->value.numel());
        if (p.transposed_parts) {  // gpt_oss: each expert's [out, in] stored [in, out]
          Tensor stored = slice.reshape(Shape{part->value.dim(1), part->value.dim(0)});
          copy_transposed(*backend, part->value, stored);
        } else {
          backend->copy(backend->default_stream(), part->value, slice);
        }
        offset += part->value.numel();
        packed.insert(part);
      }
      tensors.emplace_back(p.name, whole);
    }
  for (const Parameter& p : weights.parameters())
    if (!packed.count(&p)) tensors.emplace_back(p.name, p.value);
  io::write_safetensors((dir / "model.safetensors").string(), tensors, *backend, {{"format", "pt"}});
}

void write_model_folder(const std::filesystem::path& dir, const TinyModel& model, uint64_t seed, double scale) {
  nlohmann::json config = model.config_json();
  config["torch_dtype"] = "float32";  // what the weights below are stored in
  write_json(dir, config);
  auto backend = make_cpu_backend(1);
  ModelWeights weights = random_weights(*backend, model.config(), DType::F32, seed, scale);
  io::NamedTensors tensors;
  for (const Parameter& p : weights.parameters()) tensors.emplace_back(p.name, p.value);
  io::write_safetensors((dir / "model.safetensors").string(), tensors, *backend, {{"format", "pt"}});
}

}  // namespace spindle::test
