// qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention (q/k norms) with mixture-of-experts
// feed-forwards on the layers decoder_sparse_step and mlp_only_layers pick, dense SwiGLU on the rest.
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

namespace spindle {

struct ModelConfig;

void read_qwen3_moe_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);

// transformers' Qwen MoE placement (qwen3_moe, qwen3_next): layer l's feed-forward is the mixture of
// experts unless l is in mlp_only_layers, and only when (l + 1) is a multiple of decoder_sparse_step
// (default 1); the other layers keep the dense SwiGLU of intermediate_size.
void read_sparse_layers(const nlohmann::json& j, ModelConfig& config, const std::string& source);

// output_router_logits (default false) and router_aux_loss_coef (default 0.001, >= 0) as the Qwen MoE
// configs spell them.
void read_router_loss(const nlohmann::json& j, ModelConfig& config, const std::string& source);

}  // namespace spindle
