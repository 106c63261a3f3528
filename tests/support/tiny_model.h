// Tiny decoder models for tests: one description of the architecture (as the config.json keys a
// Hugging Face checkout would hold), random weights from it, and a model folder on disk.
//
// Every in-memory ModelConfig goes through ModelConfig::from_json, so a test's model has exactly
// the features a real config.json of that family gives it (qwen2: q/k/v biases; qwen3: q/k norms)
// and a folder written by write_model_folder loads as the same model. A new layer kind (MoE
// experts, gated DeltaNet layers) is a new preset: a function returning a TinyModel whose
// model_type and `extra` keys describe it, with no new weight maker, since the weights come from
// ModelWeights::random and are written by their parameter names.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "io/write_safetensors.h"
#include "model/weights.h"

namespace spindle::test {

// Defaults: the tiny GQA llama the sequence-parallel and FSDP tests train (4 query heads over 2 KV
// heads, so Ulysses 4 replicates KV heads). Tests override the fields their tolerances were set on.
struct TinyModel {
  std::string model_type = "llama";  // llama | qwen2 | qwen3 | qwen3_moe | qwen3_5_text | qwen3_5_moe_text | gpt_oss | glm4_moe | phi3 (presets below)
  int64_t vocab_size = 64;
  int64_t hidden_size = 32;
  int64_t intermediate_size = 48;
  int64_t num_layers = 2;
  int64_t num_heads = 4;
  int64_t num_kv_heads = 2;
  int64_t head_dim = 8;
  double rms_norm_eps = 1e-5;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  nlohmann::json extra = nlohmann::json::object();  // further config.json keys, written as given

  // The config.json a Hugging Face checkout of this architecture holds.
  nlohmann::json config_json() const;
  // config_json() read as spindle reads any config.json.
  ModelConfig config() const;
};

// qwen3_moe: qwen3's attention; 3 layers, the middle one dense (mlp_only_layers), the others 4 experts
// of width 12 with 2 per token, renormalised; output_router_logits off (tests turn the router
// load-balancing loss on themselves).
TinyModel tiny_qwen3_moe();

// qwen3_5 (text-only Qwen3_5ForCausalLM, model_type qwen3_5_text): 3 layers, gated DeltaNet, gated
// attention, gated DeltaNet; DeltaNet 2 key heads and 4 value heads of 8 (two value heads per key
// head), conv kernel 4; attention 4 query heads over 2 KV heads of 8, RoPE on the first 4 dims.
TinyModel tiny_qwen3_5();

// qwen3_5_moe (text-only Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): tiny_qwen3_5()'s layers,
// each with a mixture of experts (4 experts of width 12, 2 per token, always renormalised) and a
// shared expert of width 16 behind its sigmoid gate; output_router_logits off.
TinyModel tiny_qwen3_5_moe();

// gpt_oss: 2 layers, sliding (window 4) then full attention, sinks on both, biased q/k/v/o; every
// layer 4 experts of width 12 (intermediate_size), 2 per token, with the biased router and the
// clamped SwiGLU; output_router_logits off.
TinyModel tiny_gpt_oss();

// glm4_moe: 3 layers, the first a dense SwiGLU MLP (first_k_dense_replace 1), the others 8 experts of
// width 12 in 4 groups of 2, 3 per token from the best 2 groups, the sigmoid router with its
// correction bias, renormalised and scaled by 2.5, plus one ungated shared expert of width 12;
// q/k/v biases, q/k norms, RoPE on half of each head (partial_rotary_factor 0.5).
TinyModel tiny_glm4_moe();
// phi3: 2 layers, q/k/v in one projection (qkv_proj) and gate/up in one (gate_up_proj), a sliding
// window of 6 on both; LongRoPE (v4 spelling, as Phi-3 checkpoints ship it) on 0.75 of each head (6 of
// 8 dims: 3 factors per list) with an original window of 12, so documents of 13 tokens and more rotate
// with the long factors; max_position_embeddings 256 gives the attention factor √(1 + ln(256/12)/ln 12).
TinyModel tiny_phi3();

// The multimodal checkpoint's config.json around a text-only preset (qwen3_5_text or
// qwen3_5_moe_text): model_type qwen3_5 / qwen3_5_moe, the text model under text_config, a tiny
// vision_config, tie_word_embeddings at the top level.
nlohmann::json multimodal_config_json(const TinyModel& text);

// Random weights (ModelWeights::random, deterministic in `seed`) with every tensor but the norms
// multiplied by `scale`: tests scale the 0.02 initialisation up so that attention is far from
// uniform and every path carries a visible gradient.
ModelWeights random_weights(Backend& backend, const ModelConfig& config, DType dtype, uint64_t seed,
                            double scale = 1.0);

// LoRA of `rank` and `alpha` on every projection LoRA may target.
LoraConfig lora_on_every_projection(int64_t rank, double alpha);

// Draws one value of a LoRA B matrix from the generator it is given.
using Draw = std::function<double(std::mt19937_64&)>;
Draw uniform_draw(double bound);    // uniform on [-bound, bound)
Draw normal_draw(double stddev);    // N(0, stddev²)

// Adapters as add_lora makes them (seeded with `seed`), then every B drawn with `draw_b` from one
// generator seeded `seed + 1`, parameter by parameter: PEFT starts B at zero, which leaves A
// without a gradient and would hide a swapped A and B.
void add_lora_with_random_b(Backend& backend, ModelWeights& weights, const LoraConfig& lora, uint64_t seed,
                            const Draw& draw_b);

// A Hugging Face model folder at `dir`: config.json and model.safetensors (F32) holding
// random_weights(config, seed, scale), for tests that need a model on disk.
void write_model_folder(const std::filesystem::path& dir, const TinyModel& model, uint64_t seed, double scale = 1.0);
// How write_model_folder lays a checkpoint out beyond the decoder's own tensors.
struct FolderLayout {
  // Routed experts as transformers 5 keeps them and Qwen3.5/3.6-MoE checkpoints store them
  // (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]) instead of per expert.
  bool fused_experts = false;
  io::NamedTensors extra;  // tensors outside the decoder (a vision tower, mtp.*), written as given
};
// A model folder for any config.json (a multimodal one included): random_weights(config, seed,
// scale) under their checkpoint names in `layout`.
void write_model_folder(const std::filesystem::path& dir, const nlohmann::json& config, uint64_t seed, double scale,
                        const FolderLayout& layout);
// config.json alone, unchecked, for what reads only the architecture (the launcher's mesh check,
// bench's synthetic weights) or must refuse it.
void write_config(const std::filesystem::path& dir, const TinyModel& model);
void write_config(const std::filesystem::path& dir, const nlohmann::json& config);

}  // namespace spindle::test
