// The three --recompute modes give bit-identical losses and gradients on the CPU (same kernels,
// same inputs): keeping everything, recomputing whole layers, and recomputing layers around a kept
// attention output. F32 and F64 models, full fine-tuning and LoRA, q/k norm and q/k/v biases,
// mixture-of-experts layers with the router load-balancing loss, two micro-batches of different
// lengths accumulated into the same gradients. The attention strategy
// counts its calls: keep-attention must not run any attention forward twice.
#include <gtest/gtest.h>

#include <random>

#include "backend/op_test_util.h"
#include "core/error.h"
#include "model/decoder.h"
#include "support/decoder_steps.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;

namespace {

ModelConfig tiny(const std::string& type) {
  TinyModel m{.model_type = type,
              .vocab_size = 13,
              .hidden_size = 16,
              .intermediate_size = 24,
              .num_layers = 3,
              .num_heads = 4,
              .num_kv_heads = 2,
              .head_dim = 4,
              .rope_theta = 100.0,
              .tie_word_embeddings = type == "qwen2"};
  if (type == "qwen3_moe") m.extra = tiny_qwen3_moe().extra;  // layers 0 and 2 MoE, layer 1 dense
  return m.config();
}

bool has_moe(const ModelConfig& c) {
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.layer_kind(l).feed_forward == FeedForwardKind::MixtureOfExperts) return true;
  return false;
}

// Packed documents of the given lengths with a few unsupervised prompt tokens and a padding tail.
PackedRow row(const std::vector<int>& lengths, int padding, uint64_t seed) {
  std::mt19937_64 rng(seed);
  PackedRow r;
  for (size_t d = 0; d < lengths.size(); ++d) {
    const size_t begin = r.input_ids.size();
    for (int i = 0; i < lengths[d]; ++i) {
      r.input_ids.push_back(static_cast<int32_t>(rng() % 13));
      r.positions.push_back(i);
      r.doc_ids.push_back(static_cast<int32_t>(d));
    }
    for (int i = 0; i < lengths[d]; ++i) {
      const bool supervised = i >= 2 && i + 1 < lengths[d];
      r.targets.push_back(supervised ? r.input_ids[begin + i + 1] : kIgnoreIndex);
      r.weights.push_back(supervised ? 0.5f + 0.5f * static_cast<float>(rng() % 3) : 0.0f);
    }
  }
  for (int i = 0; i < padding; ++i) {
    r.input_ids.push_back(0);
    r.positions.push_back(i);
    r.doc_ids.push_back(-1);
    r.targets.push_back(kIgnoreIndex);
    r.weights.push_back(0.0f);
  }
  return r;
}

ModelWeights make_weights(Backend& be, const std::string& type, DType dtype, bool lora) {
  ModelWeights w = random_weights(be, tiny(type), dtype, 21, 10.0);
  if (lora) add_lora_with_random_b(be, w, lora_on_every_projection(2, 4), 22, uniform_draw(0.3));
  else w.train_all(be);
  return w;
}

struct Result {
  std::vector<double> loss;                // after each micro-batch (then the router aux loss, MoE models)
  std::vector<std::vector<double>> grads;  // trainable parameters, in order
  int attention_forwards = 0, attention_backwards = 0;
};

// One optimizer step's worth: two micro-batches of different lengths into the same gradients.
Result run(Backend& be, ModelWeights& w, const DecoderOptions& options) {
  CountingAttention attention;
  Decoder decoder(be, w, options);
  decoder.set_attention(&attention);
  w.zero_grads(be);
  Result r;
  Tensor loss = be.zeros(Shape{1}, stat_dtype(w.dtype));
  const std::vector<PackedRow> rows = {row({7, 1, 9}, 3, 31), row({12, 6}, 0, 32)};
  const double inv_n = 1.0 / static_cast<double>(rows[0].num_items() + rows[1].num_items());
  // MoE models train with the router load-balancing loss, its statistics from a forward-only pass
  // over both micro-batches first (as StepRunner does), on a decoder of its own so that the
  // attention counts below are the training step's.
  std::unique_ptr<RouterAuxLoss> aux;
  if (has_moe(w.config)) {
    aux = std::make_unique<RouterAuxLoss>(be, w.config, w.dtype, 0.25);
    aux->begin_step(7 + 1 + 9 + 12 + 6, nullptr);  // the real tokens of both rows
    Decoder statistics(be, w, options);
    statistics.set_router_aux_loss(aux.get());
    Tensor discard = be.zeros(Shape{1}, stat_dtype(w.dtype));
    for (const PackedRow& pr : rows) statistics.step(make_micro_batch(be, {pr}, w.dtype), inv_n, discard, false);
    aux->finish_statistics();
    decoder.set_router_aux_loss(aux.get());
  }
  for (const PackedRow& pr : rows) {
    decoder.step(make_micro_batch(be, {pr}, w.dtype), inv_n, loss, true);
    r.loss.push_back(to_host(be, loss)[0]);
  }
  if (aux) r.loss.push_back(aux->value());
  for (Parameter& p : w.parameters())
    if (p.trainable) r.grads.push_back(to_host(be, p.grad));
  r.attention_forwards = attention.forwards;
  r.attention_backwards = attention.backwards;
  return r;
}

void expect_identical(const Result& got, const Result& want, const ModelWeights& w, const std::string& what) {
  ASSERT_EQ(got.loss.size(), want.loss.size());
  for (size_t i = 0; i < want.loss.size(); ++i) EXPECT_EQ(got.loss[i], want.loss[i]) << what << " micro-batch " << i;
  ASSERT_EQ(got.grads.size(), want.grads.size());
  size_t i = 0;
  for (const Parameter& p : w.parameters()) {
    if (!p.trainable) continue;
    // Exact: every element, not a norm (to_host widens F32 exactly, so == is bitwise).
    EXPECT_TRUE(got.grads[i] == want.grads[i])
        << what << ": gradient of " << p.name << " differs (relative error " << relative_error(got.grads[i], want.grads[i])
        << ")";
    ++i;
  }
}

struct Case {
  std::string type;
  DType dtype;
  bool lora;
};

class RecomputeModes : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(RecomputeModes, LossAndEveryGradientAreBitIdentical) {
  const Case c = GetParam();
  auto be = make_cpu_backend(1);
  ModelWeights w = make_weights(*be, c.type, c.dtype, c.lora);
  const int64_t layers = w.config.num_layers, micro_batches = 2;

  const Result none = run(*be, w, recompute_options(RecomputeMode::None, layers));
  double grad_sum = 0;
  for (const auto& g : none.grads)
    for (double x : g) grad_sum += std::fabs(x);
  ASSERT_GT(grad_sum, 0.0) << "the reference step produced no gradient: the comparison would prove nothing";
  EXPECT_EQ(none.attention_forwards, layers * micro_batches);

  const Result all = run(*be, w, recompute_options(RecomputeMode::All, layers));
  expect_identical(all, none, w, "recompute all");
  EXPECT_EQ(all.attention_forwards, 2 * layers * micro_batches);

  const Result kept = run(*be, w, recompute_options(RecomputeMode::KeepAttention, layers));
  expect_identical(kept, none, w, "recompute keep-attention");
  EXPECT_EQ(kept.attention_forwards, layers * micro_batches) << "keep-attention ran an attention forward again";
  EXPECT_EQ(kept.attention_backwards, layers * micro_batches);

  // Per-layer policy: layers 0 and 2 recomputed around their kept attention, layer 1 kept whole.
  DecoderOptions mixed;
  mixed.recompute = {true, false, true};
  mixed.keep_attention = true;
  const Result mix = run(*be, w, mixed);
  expect_identical(mix, none, w, "layers 0 and 2 keep-attention, layer 1 kept");
  EXPECT_EQ(mix.attention_forwards, layers * micro_batches);

  // --recompute all --recompute-layers 1: only layer 0 runs its attention forward twice.
  const Result first = run(*be, w, recompute_options(RecomputeMode::All, layers, 1));
  expect_identical(first, none, w, "recompute all on the first layer");
  EXPECT_EQ(first.attention_forwards, (layers + 1) * micro_batches);
}

INSTANTIATE_TEST_SUITE_P(Models, RecomputeModes,
                         ::testing::Values(Case{"qwen3", DType::F32, false}, Case{"qwen3", DType::F64, false},
                                           Case{"qwen2", DType::F32, true}, Case{"qwen2", DType::F64, true},
                                           Case{"llama", DType::F32, true}, Case{"llama", DType::F64, false},
                                           Case{"qwen3_moe", DType::F32, false}, Case{"qwen3_moe", DType::F64, true}),
                         [](const auto& info) {
                           return info.param.type + (info.param.dtype == DType::F64 ? "_f64" : "_f32") +
                                  (info.param.lora ? "_lora" : "_full");
                         });

// Forward-only passes (evaluation, logits) keep nothing, so keep_attention must not change them.
TEST(RecomputeModes, ForwardOnlyPassesIgnoreTheMode) {
  auto be = make_cpu_backend(1);
  ModelWeights w = make_weights(*be, "qwen3", DType::F32, false);
  const MicroBatch batch = make_micro_batch(*be, {row({8, 5}, 2, 41)}, DType::F32);
  auto evaluate = [&](RecomputeMode mode) {
    Decoder decoder(*be, w, recompute_options(mode, w.config.num_layers));
    Tensor loss = be->zeros(Shape{1}, DType::F32);
    decoder.step(batch, 1.0, loss, false);
    Tensor rows = int_tensor(*be, {0, 4, 12});
    Tensor logits = be->empty(Shape{3, w.config.vocab_size}, DType::F32);
    decoder.logits(batch, rows, logits);
    std::vector<double> out = to_host(*be, logits);
    out.push_back(to_host(*be, loss)[0]);
    return out;
  };
  const std::vector<double> none = evaluate(RecomputeMode::None);
  EXPECT_TRUE(evaluate(RecomputeMode::KeepAttention) == none);
  EXPECT_TRUE(evaluate(RecomputeMode::All) == none);
}

TEST(RecomputeModes, ParseNamesTheAcceptedValues) {
  EXPECT_EQ(parse_recompute_mode("none"), RecomputeMode::None);
  EXPECT_EQ(parse_recompute_mode("all"), RecomputeMode::All);
  EXPECT_EQ(parse_recompute_mode("keep-attention"), RecomputeMode::KeepAttention);
  for (RecomputeMode m : {RecomputeMode::None, RecomputeMode::All, RecomputeMode::KeepAttention})
    EXPECT_EQ(parse_recompute_mode(recompute_mode_name(m)), m);
  try {
    parse_recompute_mode("keep_attention");
    ADD_FAILURE() << "keep_attention was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--recompute must be none, all or keep-attention"), std::string::npos)
        << e.what();
  }
  const DecoderOptions o = recompute_options(RecomputeMode::KeepAttention, 4);
  EXPECT_EQ(o.recompute, std::vector<bool>(4, true));
  EXPECT_TRUE(o.keep_attention);
  EXPECT_TRUE(recompute_options(RecomputeMode::None, 4).recompute.empty());
  // --recompute-layers: the first N layers recompute, the rest keep everything.
  EXPECT_EQ(recompute_options(RecomputeMode::All, 4, 1).recompute, (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ(recompute_options(RecomputeMode::All, 4, 0).recompute, std::vector<bool>(4, false));
  EXPECT_EQ(recompute_options(RecomputeMode::All, 4, 4).recompute, std::vector<bool>(4, true));
  EXPECT_THROW(recompute_options(RecomputeMode::All, 4, 5), Error);
}
