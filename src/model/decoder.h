// The decoder's explicit forward and backward (no autograd): embedding, the layers (model/layer.h:
// norm, mixer, norm, feed-forward, with residuals), final RMSNorm, and the fused LM-head loss over
// the supervised positions only. Every buffer is named with its shape in the activation records
// (model/block.h, model/layer.h).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "backend/backend.h"
#include "model/attention_strategy.h"
#include "model/batch.h"
#include "model/layer.h"
#include "model/recompute.h"
#include "model/rope_tables.h"
#include "model/router_aux_loss.h"
#include "model/weights.h"

namespace spindle {

// The groups of parameters the decoder uses together, in the order it uses them:
//  - Embedding: embed (the token table).
//  - Layer l: every parameter of layers[l] (norms, projections, biases, LoRA A/B).
//  - Head: final_norm and lm_head. With tied embeddings lm_head is the embed Parameter, which then
//    belongs to two units and is used twice per pass.
struct ParameterUnit {
  enum class Kind { Embedding, Layer, Head };
  Kind kind = Kind::Embedding;
  int64_t layer = -1;  // Layer only
  static ParameterUnit embedding() { return {Kind::Embedding, -1}; }
  static ParameterUnit layer_unit(int64_t l) { return {Kind::Layer, l}; }
  static ParameterUnit head() { return {Kind::Head, -1}; }
  bool operator==(const ParameterUnit&) const = default;
};

// Called by the Decoder around every use of a unit's parameters, so parameters can live elsewhere
// (FSDP: sharded over ranks) and be materialised only while in use. The contract:
//  - Parameter::value of a unit is read only between before_forward and after_forward, or between
//    before_backward and after_backward of that unit; Parameter::grad of its trainable parameters
//    is written (+=) only inside the backward window.
//  - step(backward = true): forward windows for the embedding and each layer in order; then one
//    backward window for the head (its forward and backward are fused: the loss computes the
//    lm_head gradient chunk by chunk); then backward windows for layers L-1 … 0 (a recomputed
//    layer re-runs its forward inside its backward window; with sparse checkpoints, just before the
//    backward window of a group's top layer come forward windows of the group's lower layers, which
//    regenerate their inputs); then, only when embed is trainable, a
//    backward window for the embedding, which reads no value (a scatter-add of dout into rows).
//  - step(backward = false) and logits(): forward windows only, the head's last.
//  - Every rank makes the same sequence of calls whatever its data, even with no token at all, so
//    hooks may run collectives.
// Windows never overlap: each after_* comes before the next before_*.
class ParameterHooks {
 public:
  virtual ~ParameterHooks() = default;
  virtual void before_forward(const ParameterUnit& unit) = 0;
  virtual void after_forward(const ParameterUnit& unit) = 0;
  virtual void before_backward(const ParameterUnit& unit) = 0;
  virtual void after_backward(const ParameterUnit& unit) = 0;
};

struct DecoderOptions {
  // Layers whose activations are recomputed in backward instead of kept (checkpointing): only the
  // layer input is stored. Empty means keep everything.
  std::vector<bool> recompute;
  // Recomputed layers also keep their mixer's core output from the forward pass (attention: the
  // output and LSE), so their recompute rebuilds norms, projections, RoPE'd q/k/v and the MLP but
  // does not run the attention forward again (the O(T²) part); the attention backward then reads
  // the recomputed q, k, v with the kept out and lse. Costs T·Hq·D activation-dtype + Hq·T
  // stat-dtype elements per recomputed attention layer (SelfAttentionActivations::attn, lse).
  // Ignored for layers that are not recomputed.
  bool keep_attention = false;
  // Activation offload (--offload activations): what a recomputed layer keeps (its input and, with
  // keep_attention, its mixer's core) is copied to host memory (Backend::empty_host) on the
  // backend's copy stream once the layer's forward has run, and copied back one layer ahead of the
  // backward that reads it, so the device holds about three layers' worth instead of every
  // layer's. The last layer's stay (its backward comes first). Losses and gradients are
  // bit-identical with and without (the copies are exact). Ignored for kept layers.
  bool offload = false;
  // With offload: only layers 0 … offload_layers − 1 offload (--offload-layers; -1: every recomputed
  // layer but the last), so host memory need not hold every layer. The later layers keep theirs on
  // the device: their backward comes first, so their copies would have the least time to hide, they
  // are released first as the backward runs, and while they stay no copy is in flight at the top of
  // the backward, where the device holds most.
  int64_t offload_layers = -1;
  // Token tiling of the SwiGLU MLPs (--mlp-tile-tokens; 0: untiled): each MLP runs over its tokens in
  // tiles of at most this many rows and keeps only its input, so no layer holds a [T, F]
  // intermediate beyond one tile's (blocks/swiglu_mlp.h). Losses and gradients equal the untiled
  // ones up to the order in which weight gradients sum over the tiles. A recomputed layer's recompute
  // then stops at the MLP's input (its backward recomputes gate and up per tile); a kept layer's MLP
  // backward recomputes them too (two more projections per token).
  int64_t mlp_tile_tokens = 0;
  // Sparse checkpoints (--checkpoint-stride N; recompute all only): of the recomputed layers only
  // layers 0, N, 2N, … keep their input; the N − 1 layers above each such checkpoint keep nothing.
  // When backward reaches the top of a group it runs the group's lower layers forward again from
  // the checkpoint to regenerate their inputs, each held until its own layer's backward. Holds
  // (N − 1)/N fewer layer inputs at the cost of one more layer forward per non-checkpoint layer;
  // losses and gradients are bit-identical (same kernels on the same inputs). 1: every recomputed
  // layer keeps its input.
  int64_t checkpoint_stride = 1;
  // Upper bound of the logits chunk of the fused LM-head loss. 256 MiB is 883 rows of Qwen2.5's
  // 151936-word vocabulary in bf16: the chunk's two GEMMs ran at 620 TFLOP/s with 64 MiB (220
  // rows) on an H200, against ~780 for large ones.
  size_t logits_budget_bytes = size_t{256} << 20;
};

// Options that apply a --recompute mode to the first `recompute_layers` of `num_layers` layers
// (-1: all of them); the others keep every activation, trading memory for the recompute's time
// (--recompute-layers). Other fields at their defaults.
DecoderOptions recompute_options(RecomputeMode mode, int64_t num_layers, int64_t recompute_layers = -1);

class Decoder {
 public:
  Decoder(Backend& backend, ModelWeights& weights, DecoderOptions options = {});

  // One micro-batch: adds Σ weight·CE · loss_scale into loss_sum (one stat-dtype element). With
  // backward, accumulates the gradient of that sum into every trainable parameter's grad, so
  // micro-batches of one optimizer step simply add up when loss_scale = 1 / (global item count).
  // token_ce (optional, F32 [num_selected]) receives each selected target's unweighted CE.
  void step(const MicroBatch& batch, double loss_scale, Tensor& loss_sum, bool backward, Tensor* token_ce = nullptr);

  // Logits [n, V] at the token indices `rows` (I32 [n]) of the batch, forward only: for
  // generation and checks. Training never materialises logits (see step).
  void logits(const MicroBatch& batch, const Tensor& rows, Tensor& out);

  void set_attention(AttentionStrategy* attention) { attention_ = attention ? attention : &local_attention_; }
  // nullptr (the default): parameters are always resident and nothing is called.
  void set_parameter_hooks(ParameterHooks* hooks) { hooks_ = hooks; }
  // The router load-balancing loss of the step (MoE models; nullptr: none). A training step's
  // backward first finishes its statistics (model/router_aux_loss.h), on every rank at the same
  // point of the hook sequence: after the head's backward window, before the layers'.
  void set_router_aux_loss(RouterAuxLoss* aux) { router_aux_ = aux; }
  const ModelWeights& weights() const { return weights_; }

 private:
  Tensor forward(const MicroBatch& batch, bool keep, std::vector<LayerActivations>& acts);
  // The blocks' context for `batch`, with the RoPE spans of its documents (rope_spans_, valid until
  // the next call).
  LayerContext context(const MicroBatch& batch);
  // The tensors a recomputed layer runs in: `scratch` (each layer its own, in forward and in
  // backward) with the layer's kept x_in, and its kept mixer core when kept_core.
  LayerActivations scratch_view(LayerActivations& scratch, const LayerActivations& layer, int64_t layer_index,
                                int64_t tokens, bool kept_core);
  // Whether layer l's kept tensors go to host memory in a training step (DecoderOptions::offload,
  // offload_layers), given whether it is recomputed.
  bool offloads(int64_t l, bool recomputed) const;
  // ModelConfig::embedding_multiplier rounded to the weights' dtype.
  double embedding_multiplier() const;
  // Sparse checkpoints (DecoderOptions::checkpoint_stride): whether a training step keeps no input
  // for layer l (backward regenerates it), the checkpoint layer its group starts at, and whether l is
  // its group's top (backward regenerates the whole group there).
  bool regenerates(int64_t l) const;
  int64_t checkpoint_of(int64_t l) const { return l - l % options_.checkpoint_stride; }
  bool regenerates_group(int64_t l) const {
    return regenerates(l) && !(regenerates(l + 1) && checkpoint_of(l + 1) == checkpoint_of(l));
  }
  // Offload (DecoderOptions::offload): the device tensors a recomputed layer keeps, in a fixed
  // order (x_in, then its mixer's kept core), that are defined.
  static std::vector<Tensor*> offloaded_tensors(LayerActivations& a);
  // Copies layer `l`'s kept tensors to new host tensors (slots then refer to them) on the copy
  // stream; the device tensors go to `in_flight`, to be released after the default stream waits.
  void offload_layer(LayerActivations& a, std::vector<Tensor>& in_flight);
  // Brings them back into new device tensors (slots refer to those); the host tensors go to
  // `in_flight` likewise.
  void fetch_layer(LayerActivations& a, std::vector<Tensor>& in_flight);
  // The hook calls of one step without any compute: a rank with no token keeps the collectives
  // of its peers' hooks matched.
  void hooks_without_tokens(bool backward);
  void before_forward(const ParameterUnit& u) { if (hooks_) hooks_->before_forward(u); }
  void after_forward(const ParameterUnit& u) { if (hooks_) hooks_->after_forward(u); }
  void before_backward(const ParameterUnit& u) { if (hooks_) hooks_->before_backward(u); }
  void after_backward(const ParameterUnit& u) { if (hooks_) hooks_->after_backward(u); }

  Backend& backend_;
  ModelWeights& weights_;
  DecoderOptions options_;
  Stream stream_;
  LocalAttention local_attention_;
  AttentionStrategy* attention_;
  ParameterHooks* hooks_ = nullptr;
  RouterAuxLoss* router_aux_ = nullptr;
  std::unique_ptr<RopeTables> rope_;          // of config.rope
  std::unique_ptr<RopeTables> sliding_rope_;  // of config.sliding_rope, when the family has one
  std::vector<RopeSpan> rope_spans_, sliding_rope_spans_;  // of the batch context() was last called for
};

}  // namespace spindle
