// The --recompute modes of sft, dpo, check and bench: what a training step keeps of each layer
// between forward and backward (docs/usage.md compares their memory and time).
//   None          every activation of every layer: no recompute, the most memory;
//   All           each layer's input only; backward re-runs the whole layer forward, attention too;
//   KeepAttention each layer's input, attention output and LSE; backward re-runs the layer forward
//                 except the attention (the O(T²) op), for T·Hq·D + Hq·T more elements per layer.
// Decoder::step gives bit-identical losses and gradients in all three (same kernels, same inputs).
#pragma once

#include <cstdint>
#include <string>

namespace spindle {

enum class RecomputeMode { None, All, KeepAttention };

// "none" | "all" | "keep-attention"; anything else throws an Error naming `option` and the values.
RecomputeMode parse_recompute_mode(const std::string& value, const std::string& option = "--recompute");
const char* recompute_mode_name(RecomputeMode mode);
// --recompute-layers: -1 (every layer) or N >= 0, and only with a mode that recomputes.
void check_recompute_layers(RecomputeMode mode, int64_t recompute_layers);
// --offload: "none" (false) or "activations" (true: DecoderOptions::offload); anything else, or
// activations with a mode that recomputes nothing, throws an Error naming the option.
bool parse_offload(const std::string& value, RecomputeMode mode);
// --offload-layers: -1 (every recomputed layer but the last) or N >= 0 (layers 0 … N−1; the others
// keep their tensors on the device: DecoderOptions::offload_layers), and N >= 0 only with offload;
// anything else throws an Error naming the option.
void check_offload_layers(bool offload, int64_t offload_layers);

// --checkpoint-stride: N >= 1 (DecoderOptions::checkpoint_stride); N > 1 only with --recompute all
// (keep-attention keeps every recomputed layer's attention output, which the regenerating forward
// would have to bring back too). Throws an Error naming the option otherwise.
void check_checkpoint_stride(RecomputeMode mode, int64_t stride);

// With --recompute auto, which chooses them: --offload-layers and --checkpoint-stride left at their
// defaults (-1, 1); otherwise throws an Error naming the option and how to set it.
void check_left_to_auto(int64_t offload_layers, int64_t checkpoint_stride);

// --mlp-tile-tokens: N >= 0 tokens per tile of the SwiGLU MLPs (DecoderOptions::mlp_tile_tokens; 0:
// untiled; "16k" = 16384), or "auto" (kMlpTileAuto): untiled unless --recompute auto finds that only
// a tiled setting fits (then kAutoMlpTileTokens). Anything else throws an Error naming the option.
constexpr int64_t kMlpTileAuto = -1;
int64_t parse_mlp_tile_tokens(const std::string& value);
// The tile size --recompute auto and `plan --max-seq` try: for Qwen2.5-7B in BF16 one [16k, 18944]
// buffer is 0.6 GiB (the tiled backward holds five), and 16k-row GEMMs still run near the peak.
constexpr int64_t kAutoMlpTileTokens = 16384;
// A parsed value as the decoder runs it when --recompute auto has not chosen: auto is untiled.
inline int64_t mlp_tile_tokens_to_run(int64_t parsed) { return parsed == kMlpTileAuto ? 0 : parsed; }

}  // namespace spindle
