// FLOP counts of one training step, for MFU (docs/perf.md states the same formulas).
//
//   model FLOPs = 6 · N_matmul · T                      dense: forward 2, backward 4 per weight and token
//               + 3.5 · L_attn · 4 · Hq · D · Σ n(n+1)/2 causal attention: QKᵀ and PV (2 FLOPs per
//                                                        multiply-add each) over visible pairs, summed
//                                                        over the row's documents of n tokens (one
//                                                        document: T(T+1)/2); backward = 2.5 × forward
// N_matmul = every projection's weight (every Linear of every layer's blocks), the LM head
// (V·H, also when tied to the embedding) and the LoRA A/B matrices; the embedding lookup, norms
// and biases are not matrix products. Mixture-of-experts layers count their active weights: the
// router (E·H) and k of the E experts (each token passes through its top-k experts only, so the
// routed experts' weights count k/E times: 3·k·H·I per token), as MoE MFU is usually reported.
// This is the usual model-FLOPs convention: recomputation is not counted, and with LoRA the frozen
// weights' gradients (which are never computed) are counted as if they were, so MFU compares with
// full fine-tuning numbers on the same footing.
//
//   executed FLOPs = what the engine really does: frozen weights need only the input gradient
//   (4 instead of 6 per weight and token), recomputed layers run their forward twice (dense 2·N
//   more; attention 1 × forward more with --recompute all, none with keep-attention, which keeps
//   each layer's attention output from the first forward), for the recomputed layers only
//   (--recompute-layers). With the SwiGLU MLP in token tiles (--mlp-tile-tokens) the backward
//   runs each MLP's gate and up projections again (2·N_gate,up more per token) and a recomputed
//   layer's recompute stops at the MLP's input (2·N_gate,up,down less): a kept layer pays two
//   projections more, a recomputed one saves the down projection's second forward. With sparse
//   checkpoints (--checkpoint-stride N) each recomputed layer that keeps no input runs its whole
//   forward once more (dense 2·N, attention 1 × forward), to regenerate the input above it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/config.h"
#include "model/recompute.h"

namespace spindle::bench {

struct StepFlops {
  double dense_model = 0, attention_model = 0;        // model FLOPs
  double dense_executed = 0, attention_executed = 0;  // executed FLOPs
  double model() const { return dense_model + attention_model; }
  double executed() const { return dense_executed + attention_executed; }
};

struct FlopSetup {
  int64_t tokens = 0;        // T
  int64_t doc_length = 0;    // documents of this many tokens (the last one shorter); 0: one document
  int64_t lora_rank = 0;     // 0: full fine-tuning
  std::vector<std::string> lora_targets;  // PEFT names of the projections carrying LoRA; empty: all
  RecomputeMode recompute = RecomputeMode::None;
  int64_t recomputed_layers = -1;  // how many layers `recompute` applies to (-1: all)
  bool mlp_tiled = false;          // --mlp-tile-tokens > 0
  int64_t checkpoint_stride = 1;   // --checkpoint-stride: layers between checkpoints run forward once more
};

// Parameters in matrix products per token (N_matmul above), base weights and LoRA separately.
int64_t matmul_parameters(const ModelConfig& config);
int64_t lora_parameters(const ModelConfig& config, int64_t rank, const std::vector<std::string>& targets = {});

StepFlops step_flops(const ModelConfig& config, const FlopSetup& setup);

}  // namespace spindle::bench
