#include "model/families/qwen3_5_moe.h"

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "model/config_fields.h"
#include "model/families/qwen3_5.h"
#include "model/families/qwen3_moe.h"

namespace spindle {

namespace {

// The routed and shared experts' sizes, transformers' defaults of the family where absent.
void read_expert_sizes(const nlohmann::json& j, MoeConfig& moe, int64_t experts, int64_t per_token,
                       const std::string& source) {
  moe.num_experts = positive_int_or(j, "num_experts", experts, source);
  moe.experts_per_token = positive_int_or(j, "num_experts_per_tok", per_token, source);
  moe.expert_intermediate_size = positive_int_or(j, "moe_intermediate_size", 512, source);
  moe.shared_expert_intermediate_size = positive_int_or(j, "shared_expert_intermediate_size", 512, source);
  if (moe.experts_per_token > moe.num_experts)
    fail("{}: num_experts_per_tok {} is more than num_experts {}: each token picks its experts among num_experts",
         source, moe.experts_per_token, moe.num_experts);
}

}  // namespace

void read_qwen3_5_moe_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  read_qwen3_5_config(j, c, source);
  MoeConfig& moe = c.moe;
  read_expert_sizes(j, moe, 256, 8, source);  // Qwen3_5MoeTextConfig's defaults (the 35B-A3B's sizes)
  moe.norm_topk_prob = true;  // Qwen3_5MoeTopKRouter renormalises unconditionally
  read_router_loss(j, c, source);
  for (LayerKind& kind : c.layer_kinds) kind.feed_forward = FeedForwardKind::MixtureOfExperts;
}

void read_qwen3_next_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  read_qwen3_5_config(j, c, source);
  c.linear_attention.fused_projections = true;
  MoeConfig& moe = c.moe;
  read_expert_sizes(j, moe, 512, 10, source);  // Qwen3NextConfig's defaults (the 80B-A3B's sizes)
  moe.norm_topk_prob = bool_or(j, "norm_topk_prob", true, source);  // Qwen2MoeTopKRouter: only when set
  read_router_loss(j, c, source);
  read_sparse_layers(j, c, source);
}

}  // namespace spindle
