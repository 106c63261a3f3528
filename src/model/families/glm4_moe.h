// glm4_moe (GLM-4.5, GLM-4.6, GLM-4.7, GLM-4.5-Air): llama-like attention with partial RoPE (half of
// each head by default), optional q/k/v biases (attention_bias; o_proj never has one) and q/k
// RMSNorms (use_qk_norm); the first first_k_dense_replace layers a dense SwiGLU MLP of
// intermediate_size, the others routed experts behind transformers' Glm4MoeTopkRouter (sigmoid
// scores, e_score_correction_bias for the choice only, group-limited top-k, routed_scaling_factor:
// MoeGating::sigmoid_router) plus ungated shared experts. The checkpoints' multi-token-prediction
// layers (model.layers.{num_hidden_layers}…) are never loaded and a saved full model carries them
// over (ModelFamily::carries_layers_past_last).
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

namespace spindle {

struct ModelConfig;

// Reads the fields transformers' Glm4MoeConfig adds, with its defaults when absent; refuses group
// settings its router cannot run (experts not divisible into groups of at least two, topk_group >
// n_group, more experts per token than the kept groups hold).
void read_glm4_moe_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);

}  // namespace spindle
