// Gemma 2 and Gemma 3 (text): sliding and full attention layers in a pattern, four (1 + w) RMSNorms
// per layer, GeGLU with GELU-tanh, embeddings times √hidden, query_pre_attn_scalar, soft-capped logits
// (Gemma 2), q/k norms and a RoPE of their own for the sliding layers (Gemma 3).
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

namespace spindle {

struct ModelConfig;

void read_gemma2_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);
void read_gemma3_text_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);

}  // namespace spindle
