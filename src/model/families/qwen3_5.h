// Qwen3.5 (qwen3_5, qwen3_5_text): layers of gated DeltaNet (layer_types "linear_attention") or gated
// softmax attention ("full_attention"), each followed by a SwiGLU MLP; zero-centred RMSNorms and
// partial RoPE. docs/models.md describes the blocks.
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

namespace spindle {

struct ModelConfig;

// Reads the text model's fields (config.json's top level, or its text_config): attention bias, the
// DeltaNet sizes, partial_rotary_factor (0.25 when absent, as transformers), each layer's mixer from
// layer_types (or full_attention_interval, 4 when absent).
void read_qwen3_5_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);

}  // namespace spindle
