#include "bench/flops.h"

#include <algorithm>

namespace spindle::bench {

int64_t matmul_parameters(const ModelConfig& c) {
  const int64_t H = c.hidden_size, F = c.intermediate_size;
  const int64_t attention = H * c.q_dim() + 2 * H * c.kv_dim() + c.q_dim() * H;
  const int64_t mlp = 3 * H * F;
  return c.num_layers * (attention + mlp) + c.vocab_size * H;
}

int64_t lora_parameters(const ModelConfig& c, int64_t rank, int64_t targets) {
  if (rank == 0) return 0;
  // Average (in + out) over the 7 projections, scaled to the number targeted: exact for all 7.
  const int64_t H = c.hidden_size, F = c.intermediate_size;
  const int64_t in_plus_out = (H + c.q_dim()) * 2 + (H + c.kv_dim()) * 2 + (H + F) * 3;
  return c.num_layers * rank * in_plus_out * targets / 7;
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
  const double attention_forward =
      static_cast<double>(c.num_layers) * 4.0 * static_cast<double>(c.num_heads * c.head_dim) * pairs;

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
  f.attention_executed = (3.5 + (s.recompute == RecomputeMode::All ? share : 0.0)) * attention_forward;
  return f;
}

}  // namespace spindle::bench
