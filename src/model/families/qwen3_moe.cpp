#include "model/families/qwen3_moe.h"

#include <algorithm>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"
#include "model/config_fields.h"
#include "model/families/dense.h"

namespace spindle {

namespace {

int64_t positive_int(const nlohmann::json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) fail("{}: qwen3_moe needs \"{}\"", source, key);
  if (!j[key].is_number_integer() || j[key].get<int64_t>() <= 0)
    fail("{}: \"{}\" must be a positive integer, got {}", source, key, j[key].dump());
  return j[key].get<int64_t>();
}

}  // namespace

void read_qwen3_moe_config(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  read_qwen3_config(j, c, source);  // attention as qwen3: q/k norms, attention_bias
  MoeConfig& moe = c.moe;
  // transformers 5 writes num_experts as num_local_experts (its attribute map); older configs, as num_experts.
  moe.num_experts = positive_int(j, j.contains("num_experts") || !j.contains("num_local_experts") ? "num_experts"
                                                                                                 : "num_local_experts",
                                 source);
  moe.experts_per_token = positive_int(j, "num_experts_per_tok", source);
  moe.expert_intermediate_size = positive_int(j, "moe_intermediate_size", source);
  if (moe.experts_per_token > moe.num_experts)
    fail("{}: num_experts_per_tok {} is more than num_experts {}: each token picks its experts among num_experts",
         source, moe.experts_per_token, moe.num_experts);
  // Defaults of transformers' Qwen3MoeConfig.
  moe.norm_topk_prob = bool_or(j, "norm_topk_prob", false, source);
  read_router_loss(j, c, source);
  read_sparse_layers(j, c, source);
}

void read_router_loss(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  MoeConfig& moe = c.moe;
  moe.output_router_logits = bool_or(j, "output_router_logits", false, source);
  moe.router_aux_loss_coef = 0.001;
  if (j.contains("router_aux_loss_coef") && !j["router_aux_loss_coef"].is_null()) {
    if (!j["router_aux_loss_coef"].is_number() || j["router_aux_loss_coef"].get<double>() < 0)
      fail("{}: \"router_aux_loss_coef\" must be a number >= 0, got {}", source, j["router_aux_loss_coef"].dump());
    moe.router_aux_loss_coef = j["router_aux_loss_coef"].get<double>();
  }
}

void read_sparse_layers(const nlohmann::json& j, ModelConfig& c, const std::string& source) {
  int64_t sparse_step = 1;
  if (j.contains("decoder_sparse_step") && !j["decoder_sparse_step"].is_null())
    sparse_step = positive_int(j, "decoder_sparse_step", source);
  std::vector<int64_t> dense_layers;
  if (j.contains("mlp_only_layers") && !j["mlp_only_layers"].is_null()) {
    if (!j["mlp_only_layers"].is_array()) fail("{}: \"mlp_only_layers\" must be a list of layer indices", source);
    for (const auto& v : j["mlp_only_layers"]) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= c.num_layers)
        fail("{}: \"mlp_only_layers\" holds {}, not a layer of this {}-layer model", source, v.dump(), c.num_layers);
      dense_layers.push_back(v.get<int64_t>());
    }
  }
  // transformers' rule: a layer is sparse unless listed in mlp_only_layers, and only every
  // decoder_sparse_step-th layer (counting from 1) is.
  for (int64_t l = 0; l < c.num_layers; ++l) {
    const bool dense = std::find(dense_layers.begin(), dense_layers.end(), l) != dense_layers.end();
    if (!dense && (l + 1) % sparse_step == 0) c.layer_kinds[static_cast<size_t>(l)].feed_forward = FeedForwardKind::MixtureOfExperts;
  }
}

}  // namespace spindle
