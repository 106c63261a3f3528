// Qwen3.5-MoE and Qwen3.6 (qwen3_5_moe, qwen3_5_moe_text): qwen3_5's layers (gated DeltaNet or gated
// attention, zero-centred norms, partial RoPE) with a mixture of experts and a shared expert as
// every layer's feed-forward. docs/models.md describes the blocks.
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

namespace spindle {

struct ModelConfig;

// Reads the text model's fields (config.json's top level, or its text_config): qwen3_5's, then the
// experts (num_experts, num_experts_per_tok, moe_intermediate_size, shared_expert_intermediate_size,
// transformers' defaults when absent), output_router_logits and router_aux_loss_coef. Every layer is
// MoE (transformers' Qwen3_5MoeDecoderLayer; this family has no mlp_only_layers or
// decoder_sparse_step) and its router always renormalises the top-k (no norm_topk_prob).
void read_qwen3_5_moe_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);

// Qwen3-Next (qwen3_next): qwen3_5_moe's blocks with the DeltaNet input projections fused per key head
// (in_proj_qkvz, in_proj_ba: LinearAttentionConfig::fused_projections), the experts on the layers
// decoder_sparse_step and mlp_only_layers pick (dense SwiGLU elsewhere), and the router renormalising
// the top-k only with norm_topk_prob (default true), as transformers' Qwen2MoeTopKRouter.
void read_qwen3_next_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);

}  // namespace spindle
