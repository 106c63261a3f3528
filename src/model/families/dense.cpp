#include "model/families/dense.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "model/config_fields.h"

namespace spindle {

namespace {

bool attention_bias(const nlohmann::json& j, const std::string& source) {
  return bool_or(j, "attention_bias", false, source);
}

void all_layers_attention_swiglu(ModelConfig& c) {
  c.layer_kinds.assign(static_cast<size_t>(c.num_layers), LayerKind{MixerKind::SelfAttention, FeedForwardKind::SwiGLU});
}

}  // namespace

void read_llama_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  c.qkv_bias = c.o_bias = attention_bias(j, source);
  all_layers_attention_swiglu(c);
}

void read_qwen2_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  attention_bias(j, source);  // validated, but Qwen2 fixes its biases
  c.qkv_bias = true;
  c.o_bias = false;
  all_layers_attention_swiglu(c);
}

void read_mistral_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  c.qkv_bias = c.o_bias = false;
  all_layers_attention_swiglu(c);
  // transformers' MistralConfig: a window of 4096 when the key is absent, none when it is null; when
  // set, every layer slides (a layer_types key does not change that).
  int64_t window = 4096;
  if (j.contains("sliding_window")) window = j["sliding_window"].is_null() ? 0 : positive_int_or(j, "sliding_window", 0, source);
  if (window > 0) c.attention_specs.assign(static_cast<size_t>(c.num_layers), AttentionSpec{.window = window});
}

void read_qwen3_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  c.qkv_bias = c.o_bias = attention_bias(j, source);
  c.qk_norm = true;
  all_layers_attention_swiglu(c);
}

}  // namespace spindle
