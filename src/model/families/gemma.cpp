#include "model/families/gemma.h"

#include <cmath>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "model/config_fields.h"

namespace spindle {

namespace {

// A number field whose null means "off" (0) and whose absence means transformers' default.
double number_or_off(const nlohmann::json& j, const char* key, double fallback, const std::string& source) {
  if (!j.contains(key)) return fallback;
  if (j[key].is_null()) return 0;
  const double value = number_or(j, key, fallback, source);
  if (!(value > 0)) fail("{}: \"{}\" must be positive or null, got {}", source, key, value);
  return value;
}

// Which layers slide: `layer_types` when given, else every layer but each `period`-th
// (transformers: Gemma 2 alternates, period 2; Gemma 3 has one full layer in sliding_window_pattern, 6).
std::vector<bool> sliding_layers(const nlohmann::json& j, int64_t layers, int64_t period, const std::string& source) {
  std::vector<bool> sliding(static_cast<size_t>(layers));
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const nlohmann::json& types = j["layer_types"];
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers)
      fail("{}: \"layer_types\" must list one type per layer ({}), got {}", source, layers, types.dump());
    for (int64_t l = 0; l < layers; ++l) {
      const nlohmann::json& t = types[static_cast<size_t>(l)];
      if (t == "sliding_attention") sliding[static_cast<size_t>(l)] = true;
      else if (t != "full_attention")
        fail("{}: layer {} has type {}; Gemma layers are sliding_attention or full_attention", source, l, t.dump());
    }
    return sliding;
  }
  for (int64_t l = 0; l < layers; ++l) sliding[static_cast<size_t>(l)] = (l + 1) % period != 0;
  return sliding;
}

// What Gemma 2 and 3 share. `attention_softcap`: Gemma 2's attn_logit_softcapping (Gemma 3 never
// applies one); `period`: the default pattern of full layers.
void read_gemma(const nlohmann::json& j, ModelConfig& c, const std::string& source, double attention_softcap,
                int64_t period, bool own_sliding_rope) {
  c.zero_centered_norm = true;
  c.sandwich_norms = true;
  c.qkv_bias = c.o_bias = bool_or(j, "attention_bias", false, source);
  // transformers reads hidden_activation (hidden_act is an older alias the Gemma classes ignore).
  const nlohmann::json activation = j.contains("hidden_activation") && !j["hidden_activation"].is_null()
                                        ? j["hidden_activation"]
                                        : nlohmann::json("gelu_pytorch_tanh");
  if (activation != "gelu_pytorch_tanh")
    fail("{}: hidden_activation {} is not supported; Gemma is implemented with gelu_pytorch_tanh", source,
         activation.dump());
  c.mlp_activation = MlpActivation::GeluTanh;
  c.tie_word_embeddings = bool_or(j, "tie_word_embeddings", true, source);
  c.embedding_multiplier = std::sqrt(static_cast<double>(c.hidden_size));
  c.final_logit_softcap = number_or_off(j, "final_logit_softcapping", period == 2 ? 30.0 : 0.0, source);
  const double scalar = number_or(j, "query_pre_attn_scalar", static_cast<double>(c.head_dim), source);
  if (!(scalar > 0)) fail("{}: \"query_pre_attn_scalar\" must be positive", source);
  const int64_t window = static_cast<int64_t>(number_or_off(j, "sliding_window", 4096, source));
  const std::vector<bool> sliding = sliding_layers(j, c.num_layers, period, source);
  c.layer_kinds.assign(static_cast<size_t>(c.num_layers), LayerKind{MixerKind::SelfAttention, FeedForwardKind::SwiGLU});
  c.attention_specs.clear();
  for (int64_t l = 0; l < c.num_layers; ++l) {
    AttentionSpec spec;
    spec.scale = 1.0 / std::sqrt(scalar);
    spec.softcap = attention_softcap;
    if (sliding[static_cast<size_t>(l)]) {
      spec.window = window;
      spec.sliding_rope = own_sliding_rope && c.sliding_rope.has_value();
    }
    c.attention_specs.push_back(spec);
  }
}

}  // namespace

void read_gemma2_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  read_gemma(j, c, source, number_or_off(j, "attn_logit_softcapping", 50.0, source), 2, false);
}

void read_gemma3_text_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  c.qk_norm = true;
  if (bool_or(j, "use_bidirectional_attention", false, source))
    fail("{}: use_bidirectional_attention = true (an encoder-style Gemma 3) is not supported; spindle trains causal "
         "decoders",
         source);
  // Gemma3TextConfig's default θ of the full layers is 1e6 (the common reader's is 1e4).
  if (!j.contains("rope_theta") && !j.contains("rope_parameters") && !j.contains("rope_scaling")) c.rope.theta = 1e6;
  // transformers 4 spelling: rope_theta and rope_scaling are the full layers', rope_local_base_freq the
  // sliding layers' θ (no scaling); transformers 5 writes both under rope_parameters (config.cpp).
  if (!c.sliding_rope && j.contains("rope_local_base_freq") && !j["rope_local_base_freq"].is_null()) {
    RopeConfig local;
    local.theta = number_or(j, "rope_local_base_freq", 10000.0, source);
    local.partial_rotary_factor = c.rope.partial_rotary_factor;
    c.sliding_rope = local;
  } else if (!c.sliding_rope) {
    RopeConfig local;  // transformers' default rope_local_base_freq
    local.partial_rotary_factor = c.rope.partial_rotary_factor;
    c.sliding_rope = local;
  }
  const double period = number_or(j, "sliding_window_pattern", 6.0, source);
  if (!(period >= 1)) fail("{}: \"sliding_window_pattern\" must be 1 or more, got {}", source, period);
  read_gemma(j, c, source, 0.0, static_cast<int64_t>(period), true);
}

}  // namespace spindle
