#include "model/families/gpt_oss.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "model/config_fields.h"

namespace spindle {

namespace {

int64_t required_positive(const nlohmann::json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) fail("{}: gpt_oss needs \"{}\"", source, key);
  return positive_int_or(j, key, 0, source);
}

// Whether each layer slides: layer_types as given, else transformers' default (even layers slide).
std::vector<bool> sliding_layers(const nlohmann::json& j, int64_t layers, const std::string& source) {
  std::vector<bool> sliding(static_cast<size_t>(layers));
  if (j.contains("layer_types") && !j["layer_types"].is_null()) {
    const nlohmann::json& types = j["layer_types"];
    if (!types.is_array() || static_cast<int64_t>(types.size()) != layers)
      fail("{}: \"layer_types\" must list one type per layer ({}), got {}", source, layers, types.dump());
    for (int64_t l = 0; l < layers; ++l) {
      const nlohmann::json& t = types[static_cast<size_t>(l)];
      if (t != "sliding_attention" && t != "full_attention")
        fail("{}: layer type {} is not one of gpt_oss's; it knows sliding_attention and full_attention", source,
             t.dump());
      sliding[static_cast<size_t>(l)] = t == "sliding_attention";
    }
    return sliding;
  }
  for (int64_t l = 0; l < layers; ++l) sliding[static_cast<size_t>(l)] = l % 2 == 0;
  return sliding;
}

bool has_rope_theta(const nlohmann::json& j) {
  if (j.contains("rope_theta") && !j["rope_theta"].is_null()) return true;
  for (const char* key : {"rope_parameters", "rope_scaling"})
    if (j.contains(key) && j[key].is_object() && j[key].contains("rope_theta")) return true;
  return false;
}

}  // namespace

void read_gpt_oss_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  // Defaults of transformers' GptOssConfig where config.json leaves a field out.
  c.qkv_bias = c.o_bias = bool_or(j, "attention_bias", true, source);
  if (!j.contains("rms_norm_eps") || j["rms_norm_eps"].is_null()) c.rms_norm_eps = 1e-5;
  if (!has_rope_theta(j)) c.rope.theta = 150000.0;

  const int64_t window = positive_int_or(j, "sliding_window", 128, source);
  const std::vector<bool> sliding = sliding_layers(j, c.num_layers, source);
  c.attention_specs.assign(static_cast<size_t>(c.num_layers), AttentionSpec{});
  for (int64_t l = 0; l < c.num_layers; ++l) {
    AttentionSpec& spec = c.attention_specs[static_cast<size_t>(l)];
    spec.sinks = true;  // every layer has self_attn.sinks
    if (sliding[static_cast<size_t>(l)]) spec.window = window;
  }
  c.layer_kinds.assign(static_cast<size_t>(c.num_layers),
                       LayerKind{MixerKind::SelfAttention, FeedForwardKind::MixtureOfExperts});

  MoeConfig& moe = c.moe;
  moe.num_experts = required_positive(j, "num_local_experts", source);
  moe.experts_per_token = positive_int_or(j, "num_experts_per_tok", 4, source);
  if (moe.experts_per_token > moe.num_experts)
    fail("{}: num_experts_per_tok {} is more than num_local_experts {}: each token picks its experts among them",
         source, moe.experts_per_token, moe.num_experts);
  // Every expert is intermediate_size wide (gate_up_proj [E, H, 2·intermediate_size]).
  moe.expert_intermediate_size = required_positive(j, "intermediate_size", source);
  // transformers takes the top-k of the router's logits and a softmax over those k: the top-k of
  // the full softmax, renormalised to sum 1 (the same weights; the full softmax is what the
  // load-balancing loss reads, as transformers' load_balancing_loss_func recomputes it).
  moe.norm_topk_prob = true;
  moe.output_router_logits = bool_or(j, "output_router_logits", false, source);
  moe.router_aux_loss_coef = number_or(j, "router_aux_loss_coef", 0.9, source);
  if (moe.router_aux_loss_coef < 0)
    fail("{}: \"router_aux_loss_coef\" must be a number >= 0, got {}", source, moe.router_aux_loss_coef);
  moe.gating.router_bias = true;
  moe.gating.gpt_oss_experts = true;
  // transformers' GptOssExperts fixes alpha 1.702 and limit 7.0 (only its MXFP4 kernels read
  // swiglu_limit); a checkpoint asking for another limit would train a model transformers does not run.
  const double limit = number_or(j, "swiglu_limit", moe.gating.swiglu_limit, source);
  if (limit != moe.gating.swiglu_limit)
    fail("{}: swiglu_limit {} differs from the 7.0 transformers' GptOssExperts computes with; set it to 7.0", source,
         limit);
}

}  // namespace spindle
