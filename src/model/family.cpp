#include "model/family.h"

#include <charconv>
#include <iterator>

#include "core/error.h"
#include "model/config.h"
#include "model/families/dense.h"
#include "model/families/gemma.h"
#include "model/families/glm4_moe.h"
#include "model/families/gpt_oss.h"
#include "model/families/phi3.h"
#include "model/families/qwen3_moe.h"
#include "model/families/qwen3_5.h"
#include "model/families/qwen3_5_moe.h"

namespace spindle {

namespace {

constexpr std::string_view kGemmaCpuOnly =
    "the CUDA backend has no GeGLU, soft-capped logits or sandwich norms yet; run Gemma with --device cpu";

const ModelFamily kFamilies[] = {
    {"llama", "model.", read_llama_config},
    {"qwen2", "model.", read_qwen2_config},
    {"qwen3", "model.", read_qwen3_config},
    {"mistral", "model.", read_mistral_config},
    {"gemma2", "model.", read_gemma2_config, {}, {}, kGemmaCpuOnly},
    {"gemma3_text", "model.", read_gemma3_text_config, {}, {}, kGemmaCpuOnly},
    // Gemma 3's multimodal checkpoint (Gemma3ForConditionalGeneration, in the released layout that
    // transformers also saves): the text model under text_config and language_model.model.*.
    {"gemma3", "language_model.model.", read_gemma3_text_config, "text_config",
     {"vision_tower.", "multi_modal_projector."}, kGemmaCpuOnly},
    {"qwen3_moe", "model.", read_qwen3_moe_config},
    // Qwen3.5 (gated DeltaNet + gated attention): the multimodal checkpoint's text tower, and the
    // text-only Qwen3_5ForCausalLM folder.
    {"qwen3_5", "model.language_model.", read_qwen3_5_config, "text_config", {"model.visual.", "mtp."}},
    {"qwen3_5_text", "model.", read_qwen3_5_config, {}, {"model.visual.", "mtp."}},
    // Qwen3.5-MoE / Qwen3.6 (the same layers, every feed-forward routed experts plus a shared expert):
    // the multimodal checkpoint's text tower, and the text-only Qwen3_5MoeForCausalLM folder.
    {"qwen3_5_moe", "model.language_model.", read_qwen3_5_moe_config, "text_config", {"model.visual.", "mtp."}},
    {"qwen3_5_moe_text", "model.", read_qwen3_5_moe_config, {}, {"model.visual.", "mtp."}},
    // Qwen3-Next: the Qwen3.5-MoE blocks, its DeltaNet projections fused per key head; mtp.* unread.
    {"qwen3_next", "model.", read_qwen3_next_config, {}, {"mtp."}},
    // gpt-oss (sinks, alternating sliding windows, YaRN, biased clamped-SwiGLU experts).
    {"gpt_oss", "model.", read_gpt_oss_config, {}, {},
     "the CUDA kernels for gpt-oss's clamped-SwiGLU experts and attention sinks are not built yet"},
    // GLM-4.5/4.6/4.7 and GLM-4.5-Air (partial RoPE, the sigmoid router with its correction bias,
    // ungated shared experts); the multi-token-prediction layers after the last are carried.
    {"glm4_moe", "model.", read_glm4_moe_config, {}, {}, "the CUDA backend has no kernel for glm4_moe's sigmoid router yet",
     true},
    // Phi-3/3.5/4-mini, Phi-4: fused qkv_proj and gate_up_proj, LongRoPE, partial rotary.
    {"phi3", "model.", read_phi3_config, {}, {}, {}, false, read_phi3_rope},
};

}  // namespace

std::string supported_model_types() {
  std::string out;
  const size_t n = std::size(kFamilies);
  for (size_t i = 0; i < n; ++i) {
    if (i) out += i + 1 == n ? " and " : ", ";
    out += kFamilies[i].model_type;
  }
  return out;
}

bool carried_tensor(const ModelConfig& config, std::string_view name) {
  const ModelFamily& family = model_family(config.model_type, config.model_type);
  for (std::string_view prefix : family.carried_prefixes)
    if (name.starts_with(prefix)) return true;
  const std::string layers = std::string(family.weight_prefix) + "layers.";
  if (!family.carries_layers_past_last || !name.starts_with(layers)) return false;
  // "<prefix>layers.N.…" with N ≥ num_hidden_layers.
  const std::string_view rest = name.substr(layers.size());
  int64_t layer = -1;
  const auto [end, error] = std::from_chars(rest.data(), rest.data() + rest.size(), layer);
  return error == std::errc() && end != rest.data() && end < rest.data() + rest.size() && *end == '.' &&
         layer >= config.num_layers;
}

const ModelFamily& model_family(const std::string& model_type, const std::string& source) {
  for (const ModelFamily& f : kFamilies)
    if (f.model_type == model_type) return f;
  fail("{}: model_type \"{}\" is not supported; spindle supports {}", source, model_type, supported_model_types());
}

}  // namespace spindle
