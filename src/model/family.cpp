#include "model/family.h"

#include <iterator>

#include "core/error.h"
#include "model/families/dense.h"
#include "model/families/gemma.h"
#include "model/families/gpt_oss.h"
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

const ModelFamily& model_family(const std::string& model_type, const std::string& source) {
  for (const ModelFamily& f : kFamilies)
    if (f.model_type == model_type) return f;
  fail("{}: model_type \"{}\" is not supported; spindle supports {}", source, model_type, supported_model_types());
}

}  // namespace spindle
