#include "bench/flops.h"

#include <algorithm>

#include "model/blocks/self_attention.h"
#include "model/layer.h"

namespace spindle::bench {

int64_t matmul_parameters(const ModelConfig& c) { return count_parameters(c).matmul; }

int64_t lora_parameters(const ModelConfig& c, int64_t rank, const std::vector<std::string>& targets) {
  return count_parameters(c).lora(rank, targets);
}

StepFlops step_flops(const ModelConfig& c, const FlopSetup& s) {
  const double T = static_cast<double>(s.tokens);
  const double base = static_cast<double>(matmul_parameters(c));
  const double lora = static_cast<double>(lora_parameters(c, s.lora_rank, s.lora_targets));
  const double layer_base = base - static_cast<double>(c.vocab_size * c.hidden_size);  // recomputed part
  // Visible (query, key) pairs of the row's causal documents.
  const int64_t n = s.doc_length > 0 ? std::min(s.doc_length, s.tokens) : s.tokens;
  const double full_docs = n > 0 ? static_cast<double>(s.tokens / n) : 0.0, rest = n > 0 ? static_cast<double>(s.tokens % n) : 0.0;
  const double pairs = full_docs * static_cast<double>(n) * static_cast<double>(n + 1) / 2 + rest * (rest + 1) / 2;
  int64_t attention_layers = 0;
  for (int64_t l = 0; l < c.num_layers; ++l) attention_layers += c.layer_kind(l).mixer == MixerKind::SelfAttention;
  const double attention_forward =
      static_cast<double>(attention_layers) * SelfAttention::forward_flops_per_pair(c) * pairs;

  StepFlops f;
  f.dense_model = 6 * (base + lora) * T;
  f.attention_model = 3.5 * attention_forward;
  const bool frozen = s.lora_rank > 0;
  // Share of the layers that recompute (their per-layer FLOPs are equal).
  const double share =
      s.recompute == RecomputeMode::None
          ? 0.0
          : (s.recomputed_layers < 0 ? 1.0
                                     : static_cast<double>(std::min<int64_t>(s.recomputed_layers, c.num_layers)) /
                                           static_cast<double>(c.num_layers));
  f.dense_executed = ((frozen ? 4 : 6) * base + 6 * lora) * T + share * 2 * (layer_base + lora) * T;
  if (s.mlp_tiled) {
    // Weights (with their LoRA pairs) of the dense MLPs' gate and up, and of their down projections.
    double gate_up = 0, down = 0;
    const ParameterCounts counts = count_parameters(c);
    for (const LinearSpec& lin : counts.linears) {
      const bool adapted = s.lora_rank > 0 && lin.lora_target &&
                           (s.lora_targets.empty() ||
                            std::find(s.lora_targets.begin(), s.lora_targets.end(), lin.module) != s.lora_targets.end());
      const double weights = static_cast<double>(lin.out * lin.in) +
                             (adapted ? static_cast<double>(s.lora_rank * (lin.in + lin.out)) : 0.0);
      if (lin.prefix.ends_with(".mlp.gate_proj") || lin.prefix.ends_with(".mlp.up_proj") ||
          lin.prefix.ends_with(".mlp.gate_up_proj"))
        gate_up += weights;
      else if (lin.prefix.ends_with(".mlp.down_proj")) down += weights;
    }
    f.dense_executed += 2 * T * ((1 - share) * gate_up - share * down);
  }
  f.attention_executed = (3.5 + (s.recompute == RecomputeMode::All ? share : 0.0)) * attention_forward;
  if (s.recompute == RecomputeMode::All && s.checkpoint_stride > 1) {
    // Layers 0 … n−1 recompute; those off the stride keep no input and run forward again (decoder.h).
    const int64_t n_recomputed = s.recomputed_layers < 0 ? c.num_layers : std::min(s.recomputed_layers, c.num_layers);
    const int64_t regenerated = n_recomputed - (n_recomputed + s.checkpoint_stride - 1) / s.checkpoint_stride;
    const double extra = static_cast<double>(regenerated) / static_cast<double>(c.num_layers);
    f.dense_executed += extra * 2 * (layer_base + lora) * T;
    f.attention_executed += extra * attention_forward;
  }
  return f;
}

}  // namespace spindle::bench
