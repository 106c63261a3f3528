// The model families spindle trains, one row per Hugging Face `model_type`. A row reads the config
// fields its family adds or interprets in its own way and gives each layer its kinds (mixer,
// feed-forward); the blocks themselves live in model/blocks/. Adding a family is a row here (its
// reader in model/families/) and, when it brings new layer kinds, new block files.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "model/config.h"

namespace spindle {

struct ModelFamily {
  std::string_view model_type;
  // Where the decoder's tensors live in the checkpoint: "model." gives model.embed_tokens.weight,
  // model.layers.N.…, model.norm.weight (the LM head is lm_head.weight in every family).
  std::string_view weight_prefix;
  // Fills what the common reader (ModelConfig::from_json) leaves to the family: biases, norms,
  // per-layer kinds (ModelConfig::layer_kinds). `source` names the file in errors.
  void (*read_config)(const nlohmann::json& j, ModelConfig& config, const std::string& source);
  // Where config.json holds the decoder's fields: the top level (empty), or the key a multimodal
  // checkpoint nests them under ("text_config"); tie_word_embeddings is read at the top first.
  std::string_view config_section = {};
  // Checkpoint tensors outside the decoder (a vision tower, multi-token-prediction heads): training
  // never loads them and a saved full model carries them over unchanged (train/export.cpp).
  std::vector<std::string_view> carried_prefixes = {};
  // Why only the CPU backend runs this family for now (empty: every backend does); loading it on
  // another backend is refused with this reason.
  std::string_view cpu_only_reason = {};
  // Checkpoint layers numbered num_hidden_layers and up (glm4_moe's multi-token-prediction layers,
  // "model.layers.{num_hidden_layers}.…"): carried like carried_prefixes.
  bool carries_layers_past_last = false;
  // How the family reads its RoPE settings, where transformers' config class reads them its own way
  // (phi3: its top-level original_max_position_embeddings, "su" and "yarn" as longrope); null: the
  // common reader (model/config.h read_rope).
  std::pair<RopeConfig, std::optional<RopeConfig>> (*read_rope)(const nlohmann::json& j, const std::string& source) =
      nullptr;
};

// The row of `model_type`; an error naming the supported types when there is none.
const ModelFamily& model_family(const std::string& model_type, const std::string& source);
// Whether a saved full model carries the source checkpoint's tensor `name` over unchanged (the
// family's carried_prefixes, its layers past the last).
bool carried_tensor(const ModelConfig& config, std::string_view name);
// "llama, qwen2 and qwen3": for messages.
std::string supported_model_types();

}  // namespace spindle
