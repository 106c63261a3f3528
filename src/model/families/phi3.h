// phi3 (Phi-3, Phi-3.5-mini, Phi-4-mini, Phi-4): llama's layers with q, k and v in one projection
// (self_attn.qkv_proj) and gate and up in one (mlp.gate_up_proj), LongRoPE, partial rotary where the
// config says, a sliding window on every layer when sliding_window is set.
#pragma once

#include <optional>
#include <string>
#include <utility>

#include <nlohmann/json_fwd.hpp>

#include "model/config.h"

namespace spindle {

void read_phi3_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);
// transformers' Phi3Config RoPE: the top-level original_max_position_embeddings (4096 when absent)
// is longrope's window; "su" and "yarn" are older names of longrope; only default and longrope load.
std::pair<RopeConfig, std::optional<RopeConfig>> read_phi3_rope(const nlohmann::json& j, const std::string& source);

}  // namespace spindle
