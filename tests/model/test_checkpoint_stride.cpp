// Sparse checkpoints (DecoderOptions::checkpoint_stride, --checkpoint-stride): with recompute all,
// only every Nth layer keeps its input and backward regenerates the others by running the layers
// above each checkpoint forward again. On the CPU backend:
//  - losses and every gradient are bit-identical to keeping every layer's input, for strides 2 to
//    the layer count and beyond, on dense, mixture-of-experts (router load-balancing loss on) and
//    hybrid gated-DeltaNet models, with offload of every or of the first layers, with token-tiled
//    MLPs and with only the first layers recomputed;
//  - the device holds fewer bytes at the peak, and offload moves fewer bytes;
//  - each regenerated layer runs its attention forward exactly once more;
//  - the parameter hooks see the documented sequence (forward windows of a group's lower layers
//    just before the backward window of its top layer, windows never overlapping), and a rank with
//    no token makes exactly the calls of a rank with tokens (FSDP's collectives depend on it).
#include <gtest/gtest.h>

#include "backend/op_test_util.h"
#include "core/error.h"
#include "model/decoder.h"
#include "model/router_aux_loss.h"
#include "support/decoder_steps.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;

namespace {

ModelConfig config_of(const std::string& type) {
  if (type == "qwen3_5_text") {  // DeltaNet, gated attention, DeltaNet, repeated to 6 layers
    TinyModel m = tiny_qwen3_5();
    m.num_layers = 6;
    m.extra["layer_types"] = {"linear_attention", "full_attention", "linear_attention",
                              "linear_attention", "full_attention", "linear_attention"};
    return m.config();
  }
  if (type == "qwen3_moe") {  // experts on every layer but 1 and 4
    TinyModel m = tiny_qwen3_moe();
    m.num_layers = 6;
    m.extra["mlp_only_layers"] = {1, 4};
    return m.config();
  }
  TinyModel m{.model_type = type, .vocab_size = 19, .hidden_size = 16, .intermediate_size = 24,
              .num_layers = 7, .num_heads = 4, .num_kv_heads = 2, .head_dim = 4, .rope_theta = 100.0};
  return m.config();
}

struct Result : StepOutcome {
  int64_t device_peak = 0, host_peak = 0, copied = 0, attention_forwards = 0;
};

// Two micro-batches of different lengths accumulated into the same gradients, with the router
// load-balancing loss on for mixture-of-experts models.
Result run(Backend& be, ModelWeights& w, const DecoderOptions& options) {
  Decoder decoder(be, w, options);
  CountingAttention attention;
  decoder.set_attention(&attention);
  std::unique_ptr<RouterAuxLoss> aux;
  bool moe = false;
  for (int64_t l = 0; l < w.config.num_layers; ++l)
    moe |= w.config.layer_kind(l).feed_forward == FeedForwardKind::MixtureOfExperts;
  if (moe) {
    aux = std::make_unique<RouterAuxLoss>(be, w.config, w.dtype, 0.1);
    decoder.set_router_aux_loss(aux.get());
  }
  w.zero_grads(be);
  Result r;
  Tensor loss = be.zeros(Shape{1}, stat_dtype(w.dtype));
  be.reset_peak_memory();
  be.reset_offload_stats();
  for (int64_t length : {40, 27}) {
    const MicroBatch batch = make_micro_batch(be, {two_document_row(length, w.config.vocab_size, 50 + length)}, w.dtype);
    if (aux) aux->begin_step(batch.num_tokens, nullptr);
    decoder.step(batch, 0.05, loss, true);
    if (aux) aux->end_step();
    r.loss.push_back(to_host(be, loss)[0]);
  }
  const MemoryStats m = be.memory_stats();
  r.device_peak = m.peak_allocated_bytes;
  r.host_peak = m.peak_host_allocated_bytes;
  r.copied = be.offload_stats().bytes;
  r.attention_forwards = attention.forwards;
  for (Parameter& p : w.parameters())
    if (p.trainable) r.grads.push_back(to_host(be, p.grad));
  return r;
}

int64_t attention_layers(const ModelConfig& c, int64_t below) {
  int64_t n = 0;
  for (int64_t l = 0; l < below; ++l) n += c.layer_kind(l).mixer == MixerKind::SelfAttention;
  return n;
}

struct Case {
  std::string type;
  DType dtype;
  bool lora;
};

class CheckpointStride : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(CheckpointStride, IsBitIdenticalAndHoldsFewerInputs) {
  const Case c = GetParam();
  auto be = make_cpu_backend(1);
  ModelWeights w = random_weights(*be, config_of(c.type), c.dtype, 11, 10.0);
  if (c.lora) add_lora_with_random_b(*be, w, lora_on_every_projection(2, 4), 12, uniform_draw(0.3));
  else w.train_all(*be);
  const ModelConfig& config = w.config;
  const int64_t layers = config.num_layers;

  const DecoderOptions every = recompute_options(RecomputeMode::All, layers);
  const Result kept = run(*be, w, every);
  ASSERT_GT(gradient_mass(kept), 0.0) << "no gradient: the comparison would prove nothing";
  // Forward, then the recompute of every layer: two attention forwards per attention layer and
  // micro-batch.
  EXPECT_EQ(kept.attention_forwards, 2 * 2 * attention_layers(config, layers));

  DecoderOptions offloaded = every;
  offloaded.offload = true;
  const Result kept_offloaded = run(*be, w, offloaded);
  expect_bit_identical(kept_offloaded, kept, "stride 1 with offload");

  for (int64_t stride : {int64_t{2}, int64_t{3}, layers - 1, layers, layers + 2}) {
    const std::string what = c.type + ", stride " + std::to_string(stride);
    DecoderOptions sparse = every;
    sparse.checkpoint_stride = stride;
    const Result got = run(*be, w, sparse);
    expect_bit_identical(got, kept, what);
    // Each layer off the stride regenerates: the layer below it runs forward once more.
    int64_t extra = 0;
    for (int64_t l = 1; l < layers; ++l)
      if (l % stride != 0) extra += config.layer_kind(l - 1).mixer == MixerKind::SelfAttention;
    EXPECT_EQ(got.attention_forwards, kept.attention_forwards + 2 * extra) << what;
    // Fewer inputs held: strides 2 and 3 keep half and a third of them (one or two regenerated
    // beside); a group as deep as the model regenerates all but one input at its top, which holds
    // no more than keeping them.
    if (stride <= 3) {
      EXPECT_LT(got.device_peak, kept.device_peak) << what;
    } else {
      EXPECT_LE(got.device_peak, kept.device_peak) << what;
    }

    // Offload moves only the checkpoints: fewer bytes than every input, the same result.
    DecoderOptions sparse_offloaded = sparse;
    sparse_offloaded.offload = true;
    const Result moved = run(*be, w, sparse_offloaded);
    expect_bit_identical(moved, kept, what + " with offload");
    int64_t checkpoints = 0;  // offloadable: every layer on the stride but the last
    for (int64_t l = 0; l + 1 < layers; ++l) checkpoints += l % stride == 0;
    const int64_t inputs = (40 + 27) * config.hidden_size * static_cast<int64_t>(dtype_size(c.dtype));
    EXPECT_EQ(moved.copied, 2 * checkpoints * inputs) << what << ": each checkpoint out and back once";
    EXPECT_LE(moved.host_peak, kept_offloaded.host_peak) << what;
    EXPECT_LE(moved.device_peak, got.device_peak) << what;

    // Offload of the first layers only (--offload-layers 3).
    DecoderOptions partial = sparse_offloaded;
    partial.offload_layers = 3;
    expect_bit_identical(run(*be, w, partial), kept, what + " with the first 3 layers offloaded");

    // Only the first 4 layers recompute; the groups stop at the first kept layer.
    DecoderOptions first_four = recompute_options(RecomputeMode::All, layers, 4);
    const Result four_kept = run(*be, w, first_four);
    first_four.checkpoint_stride = stride;
    expect_bit_identical(run(*be, w, first_four), four_kept, what + " on the first 4 layers");

    // Token-tiled MLPs (the regenerating forward runs the tiled MLP forward).
    DecoderOptions tiled = every;
    tiled.mlp_tile_tokens = 16;
    const Result tiled_kept = run(*be, w, tiled);
    tiled.checkpoint_stride = stride;
    expect_bit_identical(run(*be, w, tiled), tiled_kept, what + " with 16-token MLP tiles");
  }
}

INSTANTIATE_TEST_SUITE_P(Models, CheckpointStride,
                         ::testing::Values(Case{"qwen2", DType::F32, true}, Case{"qwen3", DType::F64, false},
                                           Case{"qwen3_moe", DType::F32, true}, Case{"qwen3_5_text", DType::F32, true},
                                           Case{"qwen3_5_text", DType::F64, false}),
                         [](const ::testing::TestParamInfo<Case>& info) {
                           return info.param.type + "_" + std::string(dtype_name(info.param.dtype)) +
                                  (info.param.lora ? "_lora" : "_full");
                         });

namespace {

// Records every hook call as "+F3" (before_forward of layer 3), "-B3", "+BH" (the head), "+BE"
// (the embedding), and fails on overlapping windows.
class RecordingHooks final : public ParameterHooks {
 public:
  void before_forward(const ParameterUnit& u) override { open("+F", u); }
  void after_forward(const ParameterUnit& u) override { close("-F", u); }
  void before_backward(const ParameterUnit& u) override { open("+B", u); }
  void after_backward(const ParameterUnit& u) override { close("-B", u); }
  std::vector<std::string> calls;

 private:
  static std::string name(const ParameterUnit& u) {
    switch (u.kind) {
      case ParameterUnit::Kind::Embedding: return "E";
      case ParameterUnit::Kind::Head: return "H";
      case ParameterUnit::Kind::Layer: return std::to_string(u.layer);
    }
    return "?";
  }
  void open(const char* what, const ParameterUnit& u) {
    EXPECT_FALSE(window_open_) << "window " << what << name(u) << " opened inside another";
    window_open_ = true;
    calls.push_back(what + name(u));
  }
  void close(const char* what, const ParameterUnit& u) {
    EXPECT_TRUE(window_open_) << what << name(u) << " closes no window";
    window_open_ = false;
    calls.push_back(what + name(u));
  }
  bool window_open_ = false;
};

}  // namespace

TEST(CheckpointStrideHooks, FollowTheDocumentedOrderWithAndWithoutTokens) {
  auto be = make_cpu_backend(1);
  ModelWeights w = random_weights(*be, config_of("qwen2"), DType::F32, 3, 10.0);
  w.train_all(*be);  // the embedding trains: its backward window comes last
  DecoderOptions options = recompute_options(RecomputeMode::All, w.config.num_layers);  // 7 layers
  options.checkpoint_stride = 3;  // checkpoints 0, 3, 6; groups {0, 1, 2}, {3, 4, 5}, {6}
  Decoder decoder(*be, w, options);

  RecordingHooks with_tokens, without;
  Tensor loss = be->zeros(Shape{1}, DType::F32);
  decoder.set_parameter_hooks(&with_tokens);
  decoder.step(make_micro_batch(*be, {two_document_row(20, w.config.vocab_size, 1)}, DType::F32), 1.0, loss, true);
  decoder.set_parameter_hooks(&without);
  decoder.step(make_micro_batch(*be, {PackedRow{}}, DType::F32), 1.0, loss, true);

  std::vector<std::string> want = {"+FE", "-FE"};
  for (int l = 0; l < 7; ++l) {
    want.push_back("+F" + std::to_string(l));
    want.push_back("-F" + std::to_string(l));
  }
  auto backward = [&](int l) {
    want.push_back("+B" + std::to_string(l));
    want.push_back("-B" + std::to_string(l));
  };
  auto forward = [&](int l) {
    want.push_back("+F" + std::to_string(l));
    want.push_back("-F" + std::to_string(l));
  };
  want.insert(want.end(), {"+BH", "-BH"});
  backward(6);
  forward(3), forward(4), backward(5), backward(4), backward(3);  // group {3, 4, 5}: regenerated at 5
  forward(0), forward(1), backward(2), backward(1), backward(0);
  want.insert(want.end(), {"+BE", "-BE"});
  EXPECT_EQ(with_tokens.calls, want);
  EXPECT_EQ(without.calls, want) << "a rank with no token must make its peers' hook calls";
}

TEST(CheckpointStrideOption, IsCheckedAgainstTheRecomputeMode) {
  EXPECT_NO_THROW(check_checkpoint_stride(RecomputeMode::All, 4));
  EXPECT_NO_THROW(check_checkpoint_stride(RecomputeMode::None, 1));
  EXPECT_NO_THROW(check_checkpoint_stride(RecomputeMode::KeepAttention, 1));
  auto message = [](RecomputeMode mode, int64_t stride) {
    try {
      check_checkpoint_stride(mode, stride);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  EXPECT_NE(message(RecomputeMode::KeepAttention, 2).find("--recompute all"), std::string::npos);
  EXPECT_NE(message(RecomputeMode::None, 2).find("--recompute all"), std::string::npos);
  EXPECT_NE(message(RecomputeMode::All, 0).find("--checkpoint-stride"), std::string::npos);

  auto be = make_cpu_backend(1);
  ModelWeights w = random_weights(*be, config_of("qwen2"), DType::F32, 3);
  DecoderOptions options = recompute_options(RecomputeMode::KeepAttention, w.config.num_layers);
  options.checkpoint_stride = 2;
  EXPECT_THROW(Decoder(*be, w, options), Error);
}
