// The interfaces of a decoder layer's blocks (a mixer, a feed-forward) and their activation
// records. Every block owns its weights (Parameters in ModelWeights, bound at construction), does
// its explicit forward and backward on the backend, and lists its parameters and projections, so
// FSDP, LoRA, export and FLOP counts iterate over blocks instead of naming tensors.
//
// Sizes below: T tokens, H hidden, Hq/Hkv heads of D, F MLP width, r LoRA rank. All tensors are
// in the model dtype but rstd/lse, which are in the stat dtype (F32, or F64 for F64 models).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/attention_strategy.h"
#include "model/batch.h"
#include "model/config.h"
#include "model/linear.h"
#include "model/rope_tables.h"

namespace spindle {

class RouterAuxLoss;
struct ExpertLora;

// What a block's forward and backward run with besides its own weights and record.
struct LayerContext {
  Backend& backend;
  Stream stream;
  const MicroBatch& batch;
  const ModelConfig& config;
  DType dtype;                     // activations
  AttentionStrategy& attention;    // softmax attention over the (possibly sharded) sequence
  // Which RoPE table rotates which tokens (model/rope_tables.h): of config.rope, and of
  // config.sliding_rope (empty without one).
  const std::vector<RopeSpan>& rope;
  const std::vector<RopeSpan>& sliding_rope;
  RouterAuxLoss* router_aux = nullptr;  // MoE load-balancing loss of the step (null: off)
  int64_t tokens() const { return batch.num_tokens; }
};

// A checkpoint tensor that holds several parameters end to end, e.g. transformers 5's fused experts
// (gate_up_proj [E, 2I, H]: expert 0's gate_proj then up_proj weight, expert 1's, …). A checkpoint
// that has it is read through it instead of the parameters' own tensors, and a model read that way
// is saved that way (model/weights.h).
struct PackedTensor {
  std::string name;               // "model.layers.0.mlp.experts.gate_up_proj"
  Shape shape;                    // [E, 2I, H]
  std::vector<Parameter*> parts;  // in storage order; their sizes add up to shape.numel()
  // Each part, a matrix [out, in], is stored transposed, [in, out] (gpt_oss's experts).
  bool transposed_parts = false;
  bool read = false;              // this layout was the checkpoint's
};

// Where blocks get their parameters: ModelWeights allocates them; counting sinks only record the
// shapes (model/layer.h: count_parameters).
class ParameterSink {
 public:
  virtual ~ParameterSink() = default;
  // A parameter that is not a projection weight (norms, gates' vectors): named as in HF.
  virtual Parameter& add(const std::string& name, Shape shape) = 0;
  // A buffer (Parameter::buffer): a tensor of the checkpoint that is never trained, kept in the stat
  // dtype. Not a parameter as transformers counts them (count_parameters leaves it out).
  virtual Parameter& add_buffer(const std::string& name, Shape shape) = 0;
  // A projection: its weight (and bias) through add, then recorded as a projection.
  Linear add_linear(const LinearSpec& spec);
  // Another checkpoint layout of parameters already added.
  virtual void add_packed(PackedTensor) {}

 protected:
  virtual void on_linear(const LinearSpec&) {}
};

// Softmax attention (blocks/self_attention.h).
struct SelfAttentionActivations {
  Tensor q_raw, k_raw;    // [T, Hq, D], [T, Hkv, D] projections before q/k norm (qk_norm only)
  Tensor q_rstd, k_rstd;  // [T·Hq], [T·Hkv]  (qk_norm only)
  Tensor q, k, v;         // [T, Hq, D], [T, Hkv, D], [T, Hkv, D] attention inputs (normed, rotated)
  Tensor gate;            // [T, Hq, D] the output gate's pre-activation, from q_proj (attn_output_gate only)
  Tensor attn, lse;       // [T, Hq, D], [Hq, T]  the core: kept by keep-attention recompute
  LinearActivations q_proj, k_proj, v_proj, o_proj;
  LinearActivations qkv_proj;  // the one q/k/v projection (ModelConfig::fused_qkv)
};

// Gated DeltaNet (blocks/gated_deltanet.h): Hk key heads of dk, Hv value heads of dv, C = 2·Hk·dk +
// Hv·dv conv channels.
struct GatedDeltaNetActivations {
  Tensor qkv;             // [T, C] in_proj_qkv's output, the conv's input
  Tensor q, k;            // [T, Hk, dk] the conv's q and k, L2-normed: the delta rule's inputs
  Tensor q_rstd, k_rstd;  // [T·Hk] stat dtype
  Tensor v;               // [T, Hv, dv] the conv's v
  Tensor a, b;            // [T, Hv] in_proj_a, in_proj_b outputs
  Tensor g;               // [T, Hv] stat dtype: log decay
  Tensor beta;            // [T, Hv]
  Tensor z;               // [T, Hv·dv] in_proj_z's output, the norm's gate
  Tensor core;            // [T, Hv, dv] the delta rule's output: kept by keep-attention recompute
  Tensor norm_rstd;       // [T·Hv] stat dtype
  Tensor normed;          // [T, Hv·dv] the gated norm's output, out_proj's input
  LinearActivations in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj;
  LinearActivations in_proj_qkvz, in_proj_ba;  // fused_projections (qwen3_next) instead of the four
};

// One member per mixer kind; a layer uses the one of its kind.
struct MixerActivations {
  SelfAttentionActivations attention;
  GatedDeltaNetActivations gated_deltanet;
};

// SwiGLU MLP (blocks/swiglu_mlp.h).
struct SwigluActivations {
  Tensor gate, up;  // [T, F] each
  Tensor act;       // [T, F] silu(gate)·up: only in the recompute scratch set; a kept layer
                    // recomputes it in backward (one elementwise pass for T·F less per layer)
  LinearActivations gate_proj, up_proj, down_proj;
  LinearActivations gate_up_proj;  // the one gate/up projection (ModelConfig::fused_gate_up)
  // > 0: the MLP runs over its tokens in tiles of at most this many rows (--mlp-tile-tokens) and
  // the record holds no tensor at all: the backward recomputes each tile's gate and up from the MLP
  // input, so no [T, F] tensor outlives one tile (blocks/swiglu_mlp.h).
  int64_t tile_tokens = 0;
};

// Mixture of experts (blocks/moe.h): E experts of width I, k per token; N = T·k routed rows, the
// (token, slot) pairs sorted by expert.
struct MoeActivations {
  Tensor probs;        // [T, E] stat dtype: the router's softmax (sigmoid_router: its sigmoid scores)
  Tensor topk_index;   // I32 [T, k] each token's experts, most probable first
  Tensor topk_weight;  // [T, k] stat dtype: their routing weights
  Tensor rows_token;   // I32 [N] the token of each routed row
  Tensor row_of_slot;  // I32 [T·k] the routed row of (token t, slot j), at t·k + j
  Tensor offsets;      // I32 [E + 1] each expert's first routed row
  std::vector<int64_t> expert_rows;  // [E + 1] offsets on the host (see blocks/moe.cpp)
  Tensor gate, up;     // [N, I] each routed row's expert projections
  // [N, 2I] instead of gate and up for interleaved experts (MoeGating::gpt_oss_experts): gate k at
  // column 2k, up k at 2k + 1.
  Tensor gate_up;
  Tensor act;          // [N, I] silu(gate)·up: recompute scratch set only (as SwigluActivations::act)
  LinearActivations router;
  std::vector<LinearActivations> gate_proj, up_proj, down_proj;  // [E] (LoRA intermediates)
};

// The shared expert's gate of a MoE layer that has one (blocks/shared_expert_moe.h); the shared
// expert itself keeps its record in FeedForwardActivations::swiglu.
struct SharedExpertGateActivations {
  Tensor logit;  // [T, 1] shared_expert_gate(xn), before the sigmoid
  LinearActivations gate;
};

struct FeedForwardActivations {
  SwigluActivations swiglu;
  MoeActivations moe;
  SharedExpertGateActivations shared_gate;
};

// Which tensors an allocate call provides (a kept layer: all; a recomputed layer's record: the
// kept core only; the recompute scratch set: everything but the kept core when it is kept).
struct ActivationNeeds {
  bool intermediates = false;  // everything backward reads but the core
  bool core = false;           // the mixer's expensive output (attention: attn, lse; DeltaNet: core)
  bool product = false;        // the feed-forward's inner product kept (scratch set only)
  // A SwiGLU MLP in token tiles of this many rows (0: untiled): with it the feed-forward provides
  // no intermediate at all (SwigluActivations::tile_tokens). DecoderLayer gives it to a layer whose
  // feed-forward is a SwiGLU MLP only (a MoE layer's shared expert stays untiled).
  int64_t mlp_tile_tokens = 0;
};

class Mixer {
 public:
  virtual ~Mixer() = default;
  virtual MixerKind kind() const = 0;
  // Tensors already allocated for `tokens` are kept.
  virtual void allocate(Backend& backend, DType dtype, int64_t tokens, ActivationNeeds needs,
                        MixerActivations& a) const = 0;
  // out [T, H] = mixer(xn [T, H]); with run_core false the core (a kept attention output) is
  // already in `a` and is not computed again.
  virtual void forward(const LayerContext& ctx, const Tensor& xn, MixerActivations& a, Tensor& out,
                       bool run_core) const = 0;
  // dxn [T, H] = ∂L/∂xn (overwritten) from dout = ∂L/∂out; parameter gradients accumulate. When
  // allocates_dxn(), dxn may come undefined and backward allocates it ([T, H], xn's dtype) just
  // before it first writes it.
  virtual void backward(const LayerContext& ctx, const Tensor& xn, const MixerActivations& a, const Tensor& dout,
                        Tensor& dxn) const = 0;
  // Whether backward can allocate dxn itself, after its core's backward (attention's scratch is a
  // layer's peak: a [T, H] less there).
  virtual bool allocates_dxn() const { return false; }
  // A recompute view uses a layer's kept core instead of the scratch set's.
  virtual void use_kept_core(MixerActivations& view, const MixerActivations& kept) const = 0;
  // Every parameter, in creation order (LoRA pairs included once attached).
  virtual std::vector<Parameter*> parameters() const = 0;
  virtual std::vector<Linear*> linears() = 0;
};

class FeedForward {
 public:
  virtual ~FeedForward() = default;
  virtual FeedForwardKind kind() const = 0;
  virtual void allocate(Backend& backend, DType dtype, int64_t tokens, ActivationNeeds needs,
                        FeedForwardActivations& a) const = 0;
  // out [T, H] = ffn(xn [T, H])
  virtual void forward(const LayerContext& ctx, const Tensor& xn, FeedForwardActivations& a, Tensor& out) const = 0;
  // dxn [T, H] overwritten from dout; parameter gradients accumulate.
  virtual void backward(const LayerContext& ctx, const Tensor& xn, const FeedForwardActivations& a,
                        const Tensor& dout, Tensor& dxn) const = 0;
  virtual std::vector<Parameter*> parameters() const = 0;
  virtual std::vector<Linear*> linears() = 0;
  // The routed experts' fused tensors LoRA may adapt (model/expert_lora.h), in checkpoint order;
  // none for a block without routed experts.
  virtual std::vector<ExpertLora*> expert_loras() { return {}; }
};

// Appends the non-null parameters of `linear` to `out`.
void append_parameters(std::vector<Parameter*>& out, const Linear& linear);

}  // namespace spindle
