#include "model/families/phi3.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config_fields.h"

namespace spindle {

namespace {

// Phi3Config's default original_max_position_embeddings (the pretraining window of Phi-3-mini).
constexpr int64_t kPhi3OriginalWindow = 4096;

}  // namespace

std::pair<RopeConfig, std::optional<RopeConfig>> read_phi3_rope(const nlohmann::json& j, const std::string& source) {
  // As Phi3Config.convert_rope_params_to_dict: rope_scaling (or rope_parameters) standardised, then
  // "su" and "yarn" renamed longrope. Standardising puts the top-level original_max_position_embeddings
  // (the class default when absent) into the settings of a "longrope" or "yarn" entry, over its own
  // value; an "su" entry is renamed after that step and keeps its own value, which transformers then
  // requires.
  nlohmann::json edited = j;
  const char* key = j.contains("rope_parameters") && !j["rope_parameters"].is_null() ? "rope_parameters"
                                                                                      : "rope_scaling";
  if (edited.contains(key) && edited[key].is_object()) {
    nlohmann::json& params = edited[key];
    std::string type = "default";
    if (params.contains("rope_type") && params["rope_type"].is_string()) type = params["rope_type"];
    else if (params.contains("type") && params["type"].is_string()) type = params["type"];
    if (type == "longrope" || type == "yarn")
      params["original_max_position_embeddings"] =
          positive_int_or(j, "original_max_position_embeddings", kPhi3OriginalWindow, source);
    if (type == "su" && !(params.contains("original_max_position_embeddings") &&
                          !params["original_max_position_embeddings"].is_null()))
      fail("{}: RoPE scaling \"su\" (Phi-3's older name of longrope) is read by transformers 5.17 only with "
           "original_max_position_embeddings inside {}; write \"type\": \"longrope\" (the same scaling, over the "
           "top-level original_max_position_embeddings)",
           source, key);
    if (type == "su" || type == "yarn") {
      params.erase("type");
      params["rope_type"] = "longrope";
      type = "longrope";
    }
    if (type != "default" && type != "longrope")
      fail("{}: RoPE scaling \"{}\" is not one of phi3's: transformers' Phi3Config accepts default and longrope "
           "(\"su\" and \"yarn\" name longrope)",
           source, type);
    if (params.contains("full_attention"))
      fail("{}: phi3's RoPE settings are one set for every layer, not per layer type", source);
  }
  return read_rope(edited, source);
}

void read_phi3_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  // Phi3Attention and Phi3MLP have no biases; Phi3Config has no attention_bias.
  c.qkv_bias = c.o_bias = false;
  c.fused_qkv = true;
  c.fused_gate_up = true;
  c.layer_kinds.assign(static_cast<size_t>(c.num_layers), LayerKind{MixerKind::SelfAttention, FeedForwardKind::SwiGLU});
  // transformers' Phi3Model: a sliding-window mask on every layer when sliding_window is set (none by
  // default); Phi3Config has no layer_types.
  if (j.contains("sliding_window") && !j["sliding_window"].is_null()) {
    const int64_t window = positive_int_or(j, "sliding_window", 0, source);
    c.attention_specs.assign(static_cast<size_t>(c.num_layers), AttentionSpec{.window = window});
  }
}

}  // namespace spindle
