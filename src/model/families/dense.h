// Dense decoder families: every layer softmax attention + SwiGLU MLP.
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

namespace spindle {

struct ModelConfig;

// llama: attention_bias adds biases to q, k, v and o.
void read_llama_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);
// qwen2: q, k, v always have biases, o never.
void read_qwen2_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);
// mistral: llama without biases, every layer a sliding window (sliding_window; 4096 when absent).
void read_mistral_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);
// qwen3: llama's biases plus a per-head RMSNorm on q and k before RoPE.
void read_qwen3_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);

}  // namespace spindle
