#include "model/families/glm4_moe.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "model/config_fields.h"

namespace spindle {

namespace {

int64_t non_negative_int_or(const nlohmann::json& j, const char* key, int64_t fallback, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) return fallback;
  if (!j[key].is_number_integer() || j[key].get<int64_t>() < 0)
    fail("{}: \"{}\" must be an integer >= 0, got {}", source, key, j[key].dump());
  return j[key].get<int64_t>();
}

}  // namespace

void read_glm4_moe_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  // Defaults of transformers' Glm4MoeConfig where config.json leaves a field out.
  c.qkv_bias = bool_or(j, "attention_bias", false, source);  // q, k and v; Glm4MoeAttention's o_proj has none
  c.o_bias = false;
  c.qk_norm = bool_or(j, "use_qk_norm", false, source);  // w·x RMSNorm over head_dim, as qwen3's
  if (!j.contains("rms_norm_eps") || j["rms_norm_eps"].is_null()) c.rms_norm_eps = 1e-5;
  if (!has_partial_rotary_factor(j)) c.rope.partial_rotary_factor = 0.5;

  MoeConfig& moe = c.moe;
  // transformers maps num_local_experts onto n_routed_experts (its attribute_map).
  moe.num_experts = positive_int_or(j, j.contains("n_routed_experts") ? "n_routed_experts" : "num_local_experts", 128,
                                    source);
  moe.experts_per_token = positive_int_or(j, "num_experts_per_tok", 8, source);
  moe.expert_intermediate_size = positive_int_or(j, "moe_intermediate_size", 1408, source);
  moe.shared_expert_intermediate_size =
      moe.expert_intermediate_size * non_negative_int_or(j, "n_shared_experts", 1, source);
  moe.shared_expert_ungated = true;
  moe.norm_topk_prob = bool_or(j, "norm_topk_prob", true, source);
  // Glm4MoeForCausalLM computes no load-balancing loss whatever these say (router_aux_loss.h).
  moe.output_router_logits = false;
  moe.router_aux_loss_coef = 0;
  MoeGating& g = moe.gating;
  g.sigmoid_router = true;
  g.n_group = positive_int_or(j, "n_group", 1, source);
  g.topk_group = positive_int_or(j, "topk_group", 1, source);
  g.routed_scaling_factor = number_or(j, "routed_scaling_factor", 1.0, source);
  // What transformers' router can run: E viewed as n_group rows, the top 2 of each, topk_group of
  // the groups, then k experts among theirs (beyond them it would pick masked-out experts).
  if (moe.num_experts % g.n_group)
    fail("{}: n_routed_experts {} is not divisible into n_group {} groups", source, moe.num_experts, g.n_group);
  const int64_t per_group = moe.num_experts / g.n_group;
  if (per_group < 2)
    fail("{}: n_group {} leaves {} expert per group; transformers' Glm4MoeTopkRouter scores each group by its two "
         "best experts, so a group needs at least 2 (n_routed_experts / n_group >= 2)",
         source, g.n_group, per_group);
  if (g.topk_group > g.n_group)
    fail("{}: topk_group {} is more than n_group {}: the router keeps topk_group of the n_group groups", source,
         g.topk_group, g.n_group);
  if (moe.experts_per_token > g.topk_group * per_group)
    fail("{}: num_experts_per_tok {} is more than the {} experts of the topk_group {} groups the router keeps "
         "(n_routed_experts {}, n_group {})",
         source, moe.experts_per_token, g.topk_group * per_group, g.topk_group, moe.num_experts, g.n_group);
  non_negative_int_or(j, "num_nextn_predict_layers", 1, source);  // checked; those layers are carried, not trained

  // Layers below first_k_dense_replace are dense (Glm4MoeMLP of intermediate_size), the rest MoE.
  const int64_t dense = non_negative_int_or(j, "first_k_dense_replace", 1, source);
  c.layer_kinds.assign(static_cast<size_t>(c.num_layers), LayerKind{});
  for (int64_t l = dense; l < c.num_layers; ++l)
    c.layer_kinds[static_cast<size_t>(l)].feed_forward = FeedForwardKind::MixtureOfExperts;
}

}  // namespace spindle
