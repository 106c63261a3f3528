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

void read_qwen3_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  c.qkv_bias = c.o_bias = attention_bias(j, source);
  c.qk_norm = true;
  all_layers_attention_swiglu(c);
}

}  // namespace spindle
