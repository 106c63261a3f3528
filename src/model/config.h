// The model architecture, read from a Hugging Face config.json. The fields common to every family
// are read here; each family (model/family.h) reads its own and gives each layer its kinds.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/layer_kind.h"

namespace spindle {

struct RopeConfig {
  std::string type = "default";  // default | linear | llama3 | yarn | longrope | dynamic
  double theta = 10000.0;
  double factor = 1.0;                               // linear, llama3, yarn, dynamic; longrope: for its attention factor
  double low_freq_factor = 1.0, high_freq_factor = 4.0;  // llama3
  // llama3, yarn, longrope: the pretraining window (longrope turns to its long factors past it);
  // dynamic: max_position_embeddings, past which its base grows.
  int64_t original_max_position_embeddings = 8192;
  double beta_fast = 32, beta_slow = 1;  // yarn: the rotation counts bounding the blend of frequencies
  bool truncate = true;                  // yarn: the blend's bounds rounded outward to whole dims
  // longrope: per rotated pair i < rotary_dim/2, inv_freq_i = 1 / (factor_i · θ^(2i/rotary_dim)), with
  // the short factors for a sequence up to original_max_position_embeddings, the long ones past it.
  std::vector<double> short_factor, long_factor;
  double partial_rotary_factor = 1.0;  // qwen3_5: RoPE on the first head_dim·factor dims of each head
  double attention_factor = 1.0;  // cos and sin are multiplied by it (YaRN, LongRoPE: scales q·k by its square)

  // Whether the inverse frequencies depend on the length of the sequence (longrope, dynamic): then
  // each document is rotated with the table of its own length (model/rope_tables.h).
  bool depends_on_length() const { return type == "longrope" || type == "dynamic"; }
  // Which table a sequence of `length` tokens (transformers' max(position_ids) + 1) gets: equal keys,
  // equal tables. 0 is the table of short sequences (and of every sequence when nothing depends on it).
  int64_t table_key(int64_t length) const;
};

// One layer's softmax attention beyond its projections: how q·k becomes a logit, which keys each
// query sees, its sinks and its RoPE (backend.h AttentionLogits, backend/attention_rule.h). A family
// with sliding or patterned layers gives each layer its own (ModelConfig::attention_specs).
struct AttentionSpec {
  double scale = 0;      // logit = scale·q·k; 0: 1/√head_dim
  double softcap = 0;    // > 0: logit ← softcap·tanh(logit / softcap) (attn_logit_softcapping)
  int64_t window = 0;    // > 0: the query sees the `window` latest keys of its document (sliding_window)
  bool sinks = false;    // a learned logit per query head in the softmax denominator (self_attn.sinks)
  bool sliding_rope = false;  // q and k rotate with ModelConfig::sliding_rope instead of rope
};

// Gated DeltaNet layers (qwen3_5's "linear_attention" layers): what a GatedDeltaNet mixer reads.
struct LinearAttentionConfig {
  int64_t num_key_heads = 0;    // Hk (linear_num_key_heads)
  int64_t num_value_heads = 0;  // Hv (linear_num_value_heads), a multiple of Hk
  int64_t key_head_dim = 0;     // dk (linear_key_head_dim)
  int64_t value_head_dim = 0;   // dv (linear_value_head_dim)
  int64_t conv_kernel = 4;      // K (linear_conv_kernel_dim)
  int64_t chunk_size = 64;      // tokens per chunk of the delta rule (not in config.json)
  // qwen3_next's checkpoint layout: in_proj_qkvz [2·Hk·dk + 2·Hv·dv, H] and in_proj_ba [2·Hv, H],
  // their rows grouped per key head (q, k, v, z of that head's value heads; then b, a). Otherwise
  // qwen3_5's in_proj_qkv, in_proj_z, in_proj_b and in_proj_a.
  bool fused_projections = false;
};

// How a MixtureOfExperts routes and activates where a family departs from qwen3_moe's block: the
// variant is parameters of the one block (blocks/moe.h), not a block of its own. gpt_oss sets the
// first four, glm4_moe the last four.
struct MoeGating {
  // The router is "mlp.router" with a bias, logits x·Wᵀ + b (qwen3_moe: "mlp.gate", no bias).
  bool router_bias = false;
  // transformers' GptOssExperts: per expert one projection whose output interleaves gate and up
  // (gate k at column 2k, up k at 2k + 1), biased, as is down; the checkpoint stores them
  // [E, in, out]: gate_up_proj [E, H, 2I], gate_up_proj_bias [E, 2I], down_proj [E, I, H],
  // down_proj_bias [E, H]. The activation is then the clamped SwiGLU below.
  bool gpt_oss_experts = false;
  // (clamp(up, −limit, limit) + 1) · g · σ(alpha·g), g = min(gate, limit).
  double swiglu_alpha = 1.702;
  double swiglu_limit = 7.0;
  // glm4_moe (transformers' Glm4MoeTopkRouter): scores s = σ(logits) instead of a softmax; the choice
  // ranks s + b, b = "mlp.gate.e_score_correction_bias" [E] (a buffer: read and saved, never trained),
  // among the experts of the topk_group best of n_group equal groups (a group scores the sum of its
  // two best); the k chosen experts weigh s (not s + b), renormalised when norm_topk_prob, times
  // routed_scaling_factor. No load-balancing loss (transformers defines none for it).
  bool sigmoid_router = false;
  int64_t n_group = 1, topk_group = 1;
  double routed_scaling_factor = 1.0;
};

// Routed experts (qwen3_moe, qwen3_5_moe, gpt_oss, glm4_moe): what a MixtureOfExperts feed-forward reads. Zero experts: no MoE layer.
struct MoeConfig {
  int64_t num_experts = 0;               // E
  int64_t experts_per_token = 0;         // k (num_experts_per_tok)
  int64_t expert_intermediate_size = 0;  // I (moe_intermediate_size)
  // qwen3_5_moe: every MoE layer also has a shared expert, a SwiGLU MLP of this width that every
  // token passes through, scaled by σ(shared_expert_gate(x)) (blocks/shared_expert_moe.h); 0: none.
  int64_t shared_expert_intermediate_size = 0;
  // glm4_moe: the shared experts are "mlp.shared_experts" and join ungated, out = routed + shared.
  bool shared_expert_ungated = false;
  bool norm_topk_prob = false;           // renormalise the k routing weights to sum to 1
  // HF adds router_aux_loss_coef × the load-balancing loss to the loss when output_router_logits is
  // true (model/router_aux_loss.h); both as config.json gives them.
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.0;
  MoeGating gating;
};

// The gated MLP's activation (hidden_act / hidden_activation): silu(gate)·up (SwiGLU) or
// gelu_tanh(gate)·up (GeGLU with transformers' gelu_pytorch_tanh).
enum class MlpActivation { SiLU, GeluTanh };

struct ModelConfig {
  std::string model_type;  // a row of model/family.cpp
  std::string weight_prefix = "model.";  // the family's checkpoint prefix of the decoder's tensors
  // A multimodal checkpoint's transformers class (config.json "architectures", e.g.
  // Qwen3_5MoeForConditionalGeneration), whose text model spindle trains; empty for a text-only model.
  // PEFT records it in an adapter's auto_mapping, where AutoPeftModel finds the base class.
  std::string multimodal_architecture;
  int64_t vocab_size = 0;
  // config.json's pad_token_id, or -1 when it has none: transformers' nn.Embedding(padding_idx=...)
  // gives that row no gradient from the tokens that look it up (its lm_head share when tied remains).
  int64_t pad_token_id = -1;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_position_embeddings = 0;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  // qwen2 always; llama/qwen3 when attention_bias
  bool o_bias = false;    // llama/qwen3 when attention_bias
  bool qk_norm = false;   // qwen3: RMSNorm over head_dim on q and k before RoPE
  // qwen3_5: every RMSNorm but gated DeltaNet's multiplies by (1 + w), its weight stored zero-centred.
  bool zero_centered_norm = false;
  // qwen3_5: q_proj holds per head D query rows then D gate rows; σ(gate) scales the attention output.
  bool attn_output_gate = false;
  // phi3: q, k and v are one projection, self_attn.qkv_proj, its rows q (Hq·D), k, v (Hkv·D each);
  // LoRA adapts it as one module (one A, one B over the whole output), as PEFT does.
  bool fused_qkv = false;
  // phi3: gate and up are one projection, mlp.gate_up_proj, its rows gate (F) then up (F).
  bool fused_gate_up = false;
  MlpActivation mlp_activation = MlpActivation::SiLU;
  // Gemma 2/3: RMSNorms on the mixer's and the feed-forward's outputs as well as their inputs:
  // x_mid = x_in + post_attention_layernorm(mixer(input_layernorm(x_in))),
  // x_out = x_mid + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x_mid))).
  bool sandwich_norms = false;
  // Gemma: the embedding's rows times this (√hidden, rounded to the activation dtype); 0: none.
  double embedding_multiplier = 0;
  // Gemma 2: the LM head's logits soft-capped before the loss, cap·tanh(logit / cap)
  // (final_logit_softcapping); 0: none.
  double final_logit_softcap = 0;
  LinearAttentionConfig linear_attention;
  RopeConfig rope;
  // The sliding-window layers' RoPE where a family gives them their own (AttentionSpec::sliding_rope).
  std::optional<RopeConfig> sliding_rope;
  std::vector<AttentionSpec> attention_specs;  // [num_layers], set by the family; empty: AttentionSpec{} for all
  MoeConfig moe;
  std::vector<LayerKind> layer_kinds;  // [num_layers], set by the family; empty: every layer dense
                                       // attention + SwiGLU (configs built in code)

  LayerKind layer_kind(int64_t layer) const;
  // Layer `layer`'s attention, its scale resolved (1/√head_dim unless the family sets one).
  AttentionSpec attention_spec(int64_t layer) const;
  const RopeConfig& rope_of(const AttentionSpec& spec) const { return spec.sliding_rope ? *sliding_rope : rope; }
  int64_t q_dim() const { return num_heads * head_dim; }
  int64_t kv_dim() const { return num_kv_heads * head_dim; }
  int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim) * rope.partial_rotary_factor); }
  int64_t parameter_count() const;  // every parameter, tied embeddings once (model/layer.h counts them)

  // Parses and validates; `source` names the file in error messages.
  static ModelConfig from_json(const nlohmann::json& j, const std::string& source);
  static ModelConfig from_file(const std::string& path);  // a config.json or a folder holding one
};

// RoPE inverse frequencies [rotary_dim/2] with the configured scaling, computed in fp32 as
// transformers computes them (its fp32 steps; its pow may round the last bit otherwise): of `rope`
// (the full-attention layers'), or of any RopeConfig over the same rotary dims. `length` is the
// sequence length a length-dependent scaling reads (longrope, dynamic: transformers' max(position_ids)
// + 1); 0 gives the short-sequence table.
std::vector<float> rope_inverse_frequencies(const ModelConfig& config);
std::vector<float> rope_inverse_frequencies(const RopeConfig& rope, int64_t rotary_dim, int64_t length = 0);

// The RoPE settings of a config.json section `j` (the decoder's fields): transformers 4's rope_theta
// + rope_scaling, or transformers 5's rope_parameters, possibly per layer type. The first is the
// full-attention layers' RoPE, the second the sliding layers' when they have their own. A family
// that reads its RoPE its own way (ModelFamily::read_rope) passes it an edited copy.
std::pair<RopeConfig, std::optional<RopeConfig>> read_rope(const nlohmann::json& j, const std::string& source);

}  // namespace spindle
