#include "model/families/qwen3_5.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "model/config_fields.h"

namespace spindle {

namespace {

std::vector<LayerKind> layer_kinds(const nlohmann::json& j, int64_t layers, const std::string& source) {
  std::vector<LayerKind> kinds;
  auto kind = [](bool linear) {
    return LayerKind{linear ? MixerKind::GatedDeltaNet : MixerKind::SelfAttention, FeedForwardKind::SwiGLU};
  };
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const nlohmann::json& types = j["layer_types"];
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers)
      fail("{}: \"layer_types\" must list one type per layer ({}), got {}", source, layers, types.dump());
    for (const auto& t : types) {
      if (t == "linear_attention") kinds.push_back(kind(true));
      else if (t == "full_attention") kinds.push_back(kind(false));
      else fail("{}: layer type {} is not supported; spindle knows linear_attention and full_attention", source, t.dump());
    }
    return kinds;
  }
  // transformers' default: every interval-th layer is full attention, the others gated DeltaNet.
  const int64_t interval = positive_int_or(j, "full_attention_interval", 4, source);
  for (int64_t l = 0; l < layers; ++l) kinds.push_back(kind((l + 1) % interval != 0));
  return kinds;
}

}  // namespace

void read_qwen3_5_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  c.qkv_bias = c.o_bias = bool_or(j, "attention_bias", false, source);
  c.qk_norm = true;
  c.zero_centered_norm = true;
  c.attn_output_gate = true;  // transformers applies the gate whatever attn_output_gate says
  if (!has_partial_rotary_factor(j)) c.rope.partial_rotary_factor = 0.25;

  LinearAttentionConfig& la = c.linear_attention;
  la.num_key_heads = positive_int_or(j, "linear_num_key_heads", 16, source);
  la.num_value_heads = positive_int_or(j, "linear_num_value_heads", 32, source);
  la.key_head_dim = positive_int_or(j, "linear_key_head_dim", 128, source);
  la.value_head_dim = positive_int_or(j, "linear_value_head_dim", 128, source);
  la.conv_kernel = positive_int_or(j, "linear_conv_kernel_dim", 4, source);
  if (la.num_value_heads % la.num_key_heads)
    fail("{}: linear_num_value_heads {} is not a multiple of linear_num_key_heads {}", source, la.num_value_heads,
         la.num_key_heads);
  c.layer_kinds = layer_kinds(j, c.num_layers, source);
}

}  // namespace spindle
