#include "model/decoder.h"

#include <algorithm>
#include <cctype>
#include <cmath>

#include "core/error.h"
#include "loss/lm_head_loss.h"
#include "model/norm.h"

namespace spindle {

namespace {

AttentionMask self_mask(const MicroBatch& b) {
  return {b.doc_ids, b.positions, b.doc_ids, b.positions, b.one_causal_document};
}

}  // namespace

void merge_attention_sinks(Backend& backend, Stream stream, const AttentionCall& call, Tensor& out, Tensor& lse) {
  if (call.sinks.defined()) backend.attention_sink_forward(stream, out, lse, call.sinks);
}

void attention_sinks_backward(Backend& backend, Stream stream, const AttentionCall& call, const Tensor& out,
                              const Tensor& dout, const Tensor& lse) {
  if (call.sinks.defined() && call.sinks_grad)
    backend.attention_sink_backward(stream, out, dout, lse, call.sinks, *call.sinks_grad);
}

void LocalAttention::forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                             const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) {
  backend.attention_forward(stream, q, k, v, self_mask(batch), call.logits, out, lse);
  merge_attention_sinks(backend, stream, call, out, lse);
}

void LocalAttention::backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                              const Tensor& lse, const AttentionCall& call, Tensor& dq, Tensor& dk, Tensor& dv) {
  backend.attention_backward(stream, q, k, v, out, dout, lse, self_mask(batch), call.logits, dq, dk, dv, false);
  attention_sinks_backward(backend, stream, call, out, dout, lse);
}

RecomputeMode parse_recompute_mode(const std::string& value, const std::string& option) {
  if (value == "none") return RecomputeMode::None;
  if (value == "all") return RecomputeMode::All;
  if (value == "keep-attention") return RecomputeMode::KeepAttention;
  fail("{} must be none, all or keep-attention, got \"{}\" (none: fastest, most memory; all: least memory; "
       "keep-attention: in between, see docs/usage.md)",
       option, value);
}

const char* recompute_mode_name(RecomputeMode mode) {
  switch (mode) {
    case RecomputeMode::None: return "none";
    case RecomputeMode::All: return "all";
    case RecomputeMode::KeepAttention: return "keep-attention";
  }
  return "?";
}

void check_recompute_layers(RecomputeMode mode, int64_t recompute_layers) {
  if (recompute_layers < -1) fail("--recompute-layers must be -1 (all layers) or >= 0, got {}", recompute_layers);
  if (recompute_layers >= 0 && mode == RecomputeMode::None)
    fail("--recompute-layers {} needs --recompute all or keep-attention (with none no layer is recomputed)",
         recompute_layers);
}

bool parse_offload(const std::string& value, RecomputeMode mode) {
  if (value == "none") return false;
  if (value != "activations")
    fail("--offload must be none or activations, got \"{}\" (activations: recomputed layers keep their inputs in "
         "host memory, docs/memory.md)",
         value);
  if (mode == RecomputeMode::None)
    fail("--offload activations moves what recomputed layers keep to host memory: it needs --recompute all or "
         "keep-attention (or auto), not none");
  return true;
}

void check_offload_layers(bool offload, int64_t offload_layers) {
  if (offload_layers < -1)
    fail("--offload-layers must be -1 (every recomputed layer but the last) or >= 0, got {}", offload_layers);
  if (offload_layers >= 0 && !offload)
    fail("--offload-layers {} says how many layers --offload activations moves to host memory: it needs --offload "
         "activations",
         offload_layers);
}

void check_checkpoint_stride(RecomputeMode mode, int64_t stride) {
  if (stride < 1)
    fail("--checkpoint-stride must be 1 (every recomputed layer keeps its input) or more, got {}", stride);
  if (stride > 1 && mode != RecomputeMode::All)
    fail("--checkpoint-stride {} keeps one layer input in {} and re-runs the layers between from it: it needs "
         "--recompute all (or auto), not {}",
         stride, stride, recompute_mode_name(mode));
}

void check_left_to_auto(int64_t offload_layers, int64_t checkpoint_stride) {
  if (offload_layers != -1)
    fail("--offload-layers is chosen by --recompute auto (the fewest layers whose offload makes the step fit); "
         "to set it, choose --recompute all or keep-attention with --offload activations");
  if (checkpoint_stride != 1)
    fail("--checkpoint-stride is chosen by --recompute auto (2 to 4 only when nothing else fits); to set it, "
         "choose --recompute all");
}

int64_t parse_mlp_tile_tokens(const std::string& value) {
  if (value == "auto") return kMlpTileAuto;
  std::string digits = value;
  int64_t unit = 1;
  if (!digits.empty() && (digits.back() == 'k' || digits.back() == 'K')) {
    digits.pop_back();
    unit = 1024;
  }
  const bool number = !digits.empty() && digits.size() <= 12 &&
                      std::all_of(digits.begin(), digits.end(), [](unsigned char ch) { return std::isdigit(ch); });
  if (!number)
    fail("--mlp-tile-tokens must be auto, 0 (untiled) or a number of tokens such as 16384 or 16k, got \"{}\" "
         "(docs/memory.md)",
         value);
  return std::stoll(digits) * unit;
}

DecoderOptions recompute_options(RecomputeMode mode, int64_t num_layers, int64_t recompute_layers) {
  check_recompute_layers(mode, recompute_layers);
  if (recompute_layers > num_layers)
    fail("--recompute-layers {} but the model has {} layers (at most {}; -1: all)", recompute_layers, num_layers,
         num_layers);
  DecoderOptions options;
  if (mode != RecomputeMode::None) {
    const int64_t n = recompute_layers < 0 ? num_layers : recompute_layers;
    options.recompute.assign(static_cast<size_t>(num_layers), false);
    for (int64_t l = 0; l < n; ++l) options.recompute[static_cast<size_t>(l)] = true;
  }
  options.keep_attention = mode == RecomputeMode::KeepAttention;
  return options;
}

Decoder::Decoder(Backend& backend, ModelWeights& weights, DecoderOptions options)
    : backend_(backend), weights_(weights), options_(std::move(options)), stream_(backend.default_stream()),
      attention_(&local_attention_) {
  const ModelConfig& c = weights_.config;
  if (!options_.recompute.empty() && static_cast<int64_t>(options_.recompute.size()) != c.num_layers)
    fail("recompute policy names {} layers but the model has {}", options_.recompute.size(), c.num_layers);
  check_offload_layers(options_.offload, options_.offload_layers);
  if (options_.mlp_tile_tokens < 0)
    fail("--mlp-tile-tokens must be 0 (untiled) or a positive number of tokens, got {}", options_.mlp_tile_tokens);
  if (options_.mlp_tile_tokens > 0 && c.sandwich_norms)
    fail("--mlp-tile-tokens {} is not supported with {}'s sandwich norms: the norm after the MLP needs its whole "
         "output; leave --mlp-tile-tokens at 0 (or auto, which never tiles this model)",
         options_.mlp_tile_tokens, c.model_type);
  if (options_.checkpoint_stride < 1)
    fail("--checkpoint-stride must be 1 or more, got {}", options_.checkpoint_stride);
  if (options_.checkpoint_stride > 1 && options_.keep_attention)
    fail("--checkpoint-stride {} needs --recompute all, not keep-attention", options_.checkpoint_stride);
  rope_ = std::make_unique<RopeTables>(backend_, stream_, c.rope, c.rotary_dim());
  if (c.sliding_rope) sliding_rope_ = std::make_unique<RopeTables>(backend_, stream_, *c.sliding_rope, c.rotary_dim());
}

LayerContext Decoder::context(const MicroBatch& batch) {
  rope_spans_ = rope_->spans(batch);
  sliding_rope_spans_.clear();
  if (sliding_rope_) sliding_rope_spans_ = sliding_rope_->spans(batch);
  return {backend_, stream_, batch, weights_.config, weights_.dtype, *attention_, rope_spans_, sliding_rope_spans_,
          router_aux_};
}

double Decoder::embedding_multiplier() const {
  // transformers rounds the multiplier to the weights' dtype before it multiplies (Gemma's √hidden).
  const double m = weights_.config.embedding_multiplier;
  switch (weights_.dtype) {
    case DType::F64: return m;
    case DType::BF16: return static_cast<double>(bf16_to_f32(f32_to_bf16(static_cast<float>(m))));
    default: return static_cast<double>(static_cast<float>(m));
  }
}

bool Decoder::offloads(int64_t l, bool recomputed) const {
  return options_.offload && recomputed && l + 1 < weights_.config.num_layers && !regenerates(l) &&
         (options_.offload_layers < 0 || l < options_.offload_layers);
}

bool Decoder::regenerates(int64_t l) const {
  const int64_t stride = options_.checkpoint_stride;
  if (stride <= 1 || l < 0 || l >= weights_.config.num_layers || l % stride == 0) return false;
  // The group's layers from its checkpoint up to l all recompute (kept layers keep their own input).
  for (int64_t k = checkpoint_of(l); k <= l; ++k)
    if (options_.recompute.empty() || !options_.recompute[static_cast<size_t>(k)]) return false;
  return true;
}

std::vector<Tensor*> Decoder::offloaded_tensors(LayerActivations& a) {
  // A recomputed layer's record holds x_in and, when kept, its mixer's core (Mixer::use_kept_core:
  // attention's attn and lse, DeltaNet's core); every other member is undefined there.
  std::vector<Tensor*> out;
  for (Tensor* t : {&a.x_in, &a.mixer.attention.attn, &a.mixer.attention.lse, &a.mixer.gated_deltanet.core})
    if (t->defined()) out.push_back(t);
  return out;
}

void Decoder::offload_layer(LayerActivations& a, std::vector<Tensor>& in_flight) {
  const Stream copy = backend_.copy_stream();
  backend_.stream_wait(copy, stream_);  // written on the default stream
  for (Tensor* t : offloaded_tensors(a)) {
    Tensor host = backend_.empty_host(t->shape(), t->dtype());
    backend_.copy_host_device(copy, *t, host);
    in_flight.push_back(std::move(*t));
    *t = std::move(host);
  }
}

void Decoder::fetch_layer(LayerActivations& a, std::vector<Tensor>& in_flight) {
  const Stream copy = backend_.copy_stream();
  const std::vector<Tensor*> slots = offloaded_tensors(a);
  std::vector<Tensor> device;
  for (Tensor* t : slots) device.push_back(backend_.empty(t->shape(), t->dtype()));
  backend_.stream_wait(copy, stream_);  // allocated in the default stream's order
  for (size_t i = 0; i < slots.size(); ++i) {
    backend_.copy_host_device(copy, *slots[i], device[i]);
    in_flight.push_back(std::move(*slots[i]));
    *slots[i] = std::move(device[i]);
  }
}

LayerActivations Decoder::scratch_view(LayerActivations& scratch, const LayerActivations& layer, int64_t l,
                                       int64_t t, bool kept_core) {
  scratch.x_in = layer.x_in;  // first, so the scratch allocates no input of its own
  // The scratch set holds the MLP product too: its backward follows the recompute at once.
  weights_.layers[l].allocate(backend_, weights_.dtype, t, {true, !kept_core, true, options_.mlp_tile_tokens}, scratch);
  // A copy of the handles: the scratch itself never refers to a layer's kept core, so a later
  // layer can never overwrite it.
  LayerActivations view = scratch;
  if (kept_core) weights_.layers[l].mixer().use_kept_core(view.mixer, layer.mixer);
  return view;
}

// Forward through every layer: returns the last layer's output [T, H]. With keep, each layer's
// activations (or, for recomputed layers, only its input) are left in acts for backward.
Tensor Decoder::forward(const MicroBatch& batch, bool keep, std::vector<LayerActivations>& acts) {
  const ModelConfig& c = weights_.config;
  auto& be = backend_;
  const Stream st = stream_;
  const int64_t t = batch.num_tokens, layers = c.num_layers;
  auto recompute = [&](int64_t l) { return !keep || (!options_.recompute.empty() && options_.recompute[l]); };
  auto keeps_attention = [&](int64_t l) { return keep && options_.keep_attention && recompute(l); };
  // Kept layers own their activations; recomputed layers keep only their input (and, with
  // keep_attention, their attention output) and run in a scratch set of their own, released after
  // the layer (so a hybrid model never holds two kinds of mixer buffers at once; also every layer
  // when nothing is kept).
  acts.assign(layers, LayerActivations());
  Tensor x_final = be.empty(Shape{t, c.hidden_size}, weights_.dtype);
  auto allocate_layer = [&](int64_t l) {
    weights_.layers[l].allocate(be, weights_.dtype, t,
                                {!recompute(l), !recompute(l) || keeps_attention(l), false, options_.mlp_tile_tokens},
                                acts[l]);
  };
  const LayerContext ctx = context(batch);
  // Offloaded layers' device copies stay alive until the default stream has waited for their copy
  // (the next layer's forward runs meanwhile).
  auto to_host = [&](int64_t l) { return keep && offloads(l, recompute(l)); };
  std::vector<Tensor> copying;
  auto copies_done = [&] {
    if (copying.empty()) return;
    be.wait_for_copies(st);
    copying.clear();
  };
  if (layers) allocate_layer(0);
  before_forward(ParameterUnit::embedding());
  Tensor& embedded = layers ? acts[0].x_in : x_final;
  be.embedding_forward(st, batch.input_ids, weights_.embed->value, embedded);
  if (c.embedding_multiplier != 0) be.scale(st, embedded, embedding_multiplier());
  after_forward(ParameterUnit::embedding());
  for (int64_t l = 0; l < layers; ++l) {
    if (l + 1 < layers) allocate_layer(l + 1);
    LayerActivations scratch, view;
    LayerActivations* a = &acts[l];
    if (recompute(l)) {
      view = scratch_view(scratch, acts[l], l, t, keeps_attention(l));  // the core lands in acts[l] when kept
      a = &view;
    }
    Tensor& out = l + 1 < layers ? acts[l + 1].x_in : x_final;
    before_forward(ParameterUnit::layer_unit(l));
    weights_.layers[l].forward(ctx, *a, out, /*run_core=*/true);
    after_forward(ParameterUnit::layer_unit(l));
    // Evaluation keeps nothing behind it; a layer of a sparse checkpoint's group keeps no input.
    if (!keep || regenerates(l)) acts[l].x_in = Tensor();
    copies_done();  // the previous layer's, enqueued before this layer's forward
    if (to_host(l)) offload_layer(acts[l], copying);
  }
  copies_done();
  return x_final;
}

void Decoder::logits(const MicroBatch& batch, const Tensor& rows, Tensor& out) {
  const ModelConfig& c = weights_.config;
  const int64_t n = rows.numel();
  SPINDLE_CHECK(out.rank() == 2 && out.dim(0) == n && out.dim(1) == c.vocab_size, "logits out {}", out.describe());
  std::vector<LayerActivations> acts;
  Tensor x_final = forward(batch, false, acts);
  Tensor h = backend_.empty(Shape{n, c.hidden_size}, weights_.dtype), hn = backend_.empty(h.shape(), weights_.dtype);
  Tensor rstd = backend_.empty(Shape{n}, stat_dtype(weights_.dtype));
  backend_.gather_rows(stream_, x_final, rows, h);
  before_forward(ParameterUnit::head());
  backend_.rmsnorm_forward(stream_, h, rmsnorm_multiplier(backend_, stream_, weights_.final_norm->value, c.zero_centered_norm),
                           c.rms_norm_eps, hn, rstd);
  backend_.gemm(stream_, hn, false, weights_.lm_head->value, true, out, 1.0, 0.0);
  if (c.final_logit_softcap > 0) backend_.softcap_forward(stream_, out, c.final_logit_softcap, out);
  after_forward(ParameterUnit::head());
}

void Decoder::hooks_without_tokens(bool backward) {
  const int64_t layers = weights_.config.num_layers;
  before_forward(ParameterUnit::embedding());
  after_forward(ParameterUnit::embedding());
  for (int64_t l = 0; l < layers; ++l) {
    before_forward(ParameterUnit::layer_unit(l));
    after_forward(ParameterUnit::layer_unit(l));
  }
  if (!backward) {
    before_forward(ParameterUnit::head());
    after_forward(ParameterUnit::head());
    return;
  }
  before_backward(ParameterUnit::head());
  after_backward(ParameterUnit::head());
  if (router_aux_) router_aux_->finish_statistics();
  for (int64_t l = layers - 1; l >= 0; --l) {
    if (regenerates_group(l))
      for (int64_t k = checkpoint_of(l); k < l; ++k) {
        before_forward(ParameterUnit::layer_unit(k));
        after_forward(ParameterUnit::layer_unit(k));
      }
    before_backward(ParameterUnit::layer_unit(l));
    after_backward(ParameterUnit::layer_unit(l));
  }
  if (weights_.embed->trainable) {
    before_backward(ParameterUnit::embedding());
    after_backward(ParameterUnit::embedding());
  }
}

void Decoder::step(const MicroBatch& batch, double loss_scale, Tensor& loss_sum, bool backward, Tensor* token_ce) {
  const ModelConfig& c = weights_.config;
  auto& be = backend_;
  const Stream st = stream_;
  const int64_t t = batch.num_tokens, n = batch.num_selected, layers = c.num_layers;
  const DType dt = weights_.dtype;
  if (t == 0) {
    if (hooks_) hooks_without_tokens(backward);
    else if (backward && router_aux_) router_aux_->finish_statistics();  // its collective, as the peers'
    return;
  }
  auto recompute = [&](int64_t l) { return !backward || (!options_.recompute.empty() && options_.recompute[l]); };
  // Layers whose mixer core forward() kept (see forward): their recompute skips it.
  auto keeps_attention = [&](int64_t l) { return backward && options_.keep_attention && recompute(l); };
  std::vector<LayerActivations> acts;
  Tensor x_final = forward(batch, backward, acts);
  const LayerContext ctx = context(batch);

  // Final norm and loss on the selected positions only.
  const DType sd = stat_dtype(dt);
  Tensor h = be.empty(Shape{n, c.hidden_size}, dt), hn = be.empty(Shape{n, c.hidden_size}, dt);
  Tensor rstd = be.empty(Shape{n}, sd);
  // Training fuses the head's forward and backward, so it gets one backward window.
  const ParameterUnit head = ParameterUnit::head();
  if (backward) before_backward(head);
  else before_forward(head);
  if (n) {
    be.gather_rows(st, x_final, batch.selected, h);
    be.rmsnorm_forward(st, h, rmsnorm_multiplier(be, st, weights_.final_norm->value, c.zero_centered_norm), c.rms_norm_eps,
                       hn, rstd);
  }
  Tensor dhn;
  if (backward) dhn = be.empty(Shape{n, c.hidden_size}, dt);
  LmHeadLossArgs loss;
  loss.hidden = &hn;
  loss.weight = &weights_.lm_head->value;
  loss.targets = &batch.targets;
  loss.weights = &batch.weights;
  loss.loss_scale = loss_scale;
  loss.chunk_rows = lm_head_chunk_rows(c.vocab_size, dt, options_.logits_budget_bytes);
  loss.logit_softcap = c.final_logit_softcap;
  loss.loss_sum = &loss_sum;
  loss.token_ce = token_ce;
  loss.dhidden = backward ? &dhn : nullptr;
  loss.dweight = backward && weights_.lm_head->trainable ? &weights_.lm_head->grad : nullptr;
  lm_head_cross_entropy(be, st, loss);
  if (!backward) {
    after_forward(head);
    return;
  }

  // Backward.
  Tensor d_res = be.zeros(Shape{t, c.hidden_size}, dt);
  if (n) {
    Tensor dh = be.empty(h.shape(), dt);
    be.rmsnorm_backward(st, h, rmsnorm_multiplier(be, st, weights_.final_norm->value, c.zero_centered_norm), rstd, dhn,
                        dh, trainable_grad(*weights_.final_norm), false);
    be.scatter_add_rows(st, dh, batch.selected, d_res);
  }
  after_backward(head);
  // The head is done with the last layer's output and its own [n, H] tensors: release them before
  // the layers' backward (at 512k tokens of Qwen2.5-7B they are four 3.5 GiB tensors).
  x_final = h = hn = dhn = rstd = Tensor();
  // The layers' backward needs the step's router statistics (one collective when not yet done).
  if (router_aux_) router_aux_->finish_statistics();
  // Offloaded layers (see forward) come back one layer ahead: layer l−1's copy runs during layer l's
  // backward; the host copies stay alive until the default stream has waited for it.
  auto offloaded = [&](int64_t l) { return offloads(l, recompute(l)); };
  std::vector<bool> fetched(static_cast<size_t>(layers), false);
  std::vector<Tensor> fetching;
  // Offloaded tensors layer l's backward must have on the device first: its own, once fetched.
  auto bring_back = [&](int64_t l) {
    if (!offloaded(l)) return;
    if (!fetched[l]) fetch_layer(acts[l], fetching);
    fetched[l] = true;
    be.wait_for_copies(st);
    fetching.clear();
  };
  // The layer whose kept input layer k's backward starts from: its own, or for a layer of a sparse
  // checkpoint's group not regenerated yet, the checkpoint's; -1 when already regenerated.
  auto source = [&](int64_t k) -> int64_t {
    if (!regenerates(k)) return k;
    return acts[k].x_in.defined() ? -1 : checkpoint_of(k);
  };
  for (int64_t l = layers - 1; l >= 0; --l) {
    if (regenerates_group(l)) {
      // The top of a sparse checkpoint's group: its layers' inputs again, forward from the checkpoint
      // (each layer in its own forward window and scratch set, as in the step's forward).
      const int64_t first = checkpoint_of(l);
      bring_back(first);
      for (int64_t k = first; k < l; ++k) {
        LayerActivations scratch;
        LayerActivations view = scratch_view(scratch, acts[k], k, t, false);
        acts[k + 1].x_in = be.empty(Shape{t, c.hidden_size}, dt);
        before_forward(ParameterUnit::layer_unit(k));
        weights_.layers[k].forward(ctx, view, acts[k + 1].x_in, /*run_core=*/true);
        after_forward(ParameterUnit::layer_unit(k));
      }
    }
    before_backward(ParameterUnit::layer_unit(l));
    bring_back(l);
    // The next layer's kept tensors come back while this layer computes.
    if (const int64_t next = l > 0 ? source(l - 1) : -1; next >= 0 && offloaded(next) && !fetched[next]) {
      fetch_layer(acts[next], fetching);
      fetched[next] = true;
    }
    LayerActivations view;
    LayerActivations* a = &acts[l];
    if (recompute(l)) {
      const bool kept = keeps_attention(l);
      {
        // A scratch set of this layer's own, whose only handles the view holds: the layer's backward
        // frees parts of it as it goes (DecoderLayer::backward), the rest goes after the layer.
        LayerActivations scratch;
        view = scratch_view(scratch, acts[l], l, t, kept);
      }
      weights_.layers[l].recompute(ctx, view, /*run_core=*/!kept);
      a = &view;
    }
    weights_.layers[l].backward(ctx, *a, d_res, l > 0 || weights_.embed->trainable);
    after_backward(ParameterUnit::layer_unit(l));
    // This layer's saved inputs are done with: free them before the next layer's recompute
    // allocates (stream-ordered, so the backward above has read them first).
    view = LayerActivations();
    acts[l] = LayerActivations();
  }
  if (weights_.embed->trainable) {
    before_backward(ParameterUnit::embedding());
    if (c.embedding_multiplier != 0) be.scale(st, d_res, embedding_multiplier());
    be.embedding_backward(st, batch.input_ids, d_res, weights_.embed->grad, c.pad_token_id);
    after_backward(ParameterUnit::embedding());
  }
}

}  // namespace spindle
