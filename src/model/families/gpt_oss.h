// gpt_oss (gpt-oss-20b, gpt-oss-120b): biased attention with learned sinks on every layer, a sliding
// window on the "sliding_attention" layers (alternate layers by default), YaRN RoPE, and on every
// layer a mixture of experts with a biased router and biased, interleaved, clamped-SwiGLU experts
// (MoeGating). Its checkpoints hold the experts fused as transformers 5 saves them, in BF16/F32 or
// in MXFP4 (dequantised at load, model/mxfp4.h).
#pragma once

#include <string>

#include <nlohmann/json_fwd.hpp>

namespace spindle {

struct ModelConfig;

void read_gpt_oss_config(const nlohmann::json& j, ModelConfig& config, const std::string& source);

}  // namespace spindle
