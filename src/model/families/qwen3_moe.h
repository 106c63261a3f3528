// qwen3_moe (Qwen3-30B-A3B, Qwen3-235B-A22B): qwen3's attention (q/k norms) with mixture-of-experts
// feed-forwards on the layers decoder_sparse_step and mlp_only_layers pick, dense SwiGLU on the rest.
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

namespace spindle {

struct ModelConfig;

void read_qwen3_moe_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);

}  // namespace spindle
