// The whole decoder's backward against central finite differences in double, on tiny random
// models covering every architecture feature (GQA, q/k/v bias, q/k norm, tied and untied heads,
// LoRA with nonzero B, packing, loss_scale, checkpointed layers).
#include <gtest/gtest.h>

#include <random>

#include "backend/op_test_util.h"
#include "model/decoder.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;

namespace {

// Larger weights than the 0.02 init (norms excepted) so every path carries a visible gradient.
ModelWeights tiny_model(Backend& be, const std::string& type, bool tied, uint64_t seed) {
  const ModelConfig config = TinyModel{.model_type = type,
                                       .vocab_size = 11,
                                       .hidden_size = 8,
                                       .intermediate_size = 12,
                                       .num_layers = 2,
                                       .num_heads = 4,
                                       .num_kv_heads = 2,
                                       .head_dim = type == "qwen3" ? 6 : 2,
                                       .rope_theta = 100.0,
                                       .tie_word_embeddings = tied}
                                 .config();
  return random_weights(be, config, DType::F64, seed, 20.0);
}

// Two documents and padding in one row: doc A (5 tokens, prompt of 2), doc B (4 tokens), 1 pad.
PackedRow row() {
  PackedRow r;
  r.input_ids = {3, 7, 1, 9, 4, 2, 2, 10, 5, 0};
  r.positions = {0, 1, 2, 3, 4, 0, 1, 2, 3, 0};
  r.doc_ids = {0, 0, 0, 0, 0, 1, 1, 1, 1, -1};
  r.targets = {kIgnoreIndex, 1, 9, 4, kIgnoreIndex, 2, 10, 5, kIgnoreIndex, kIgnoreIndex};
  r.weights = {0, 1.5, 1, 0.5, 0, 1, 2, 1, 0, 0};
  return r;
}

void check_model(ModelWeights& w, Backend& be, const DecoderOptions& options) {
  Decoder decoder(be, w, options);
  MicroBatch batch = make_micro_batch(be, {row()}, DType::F64);
  const double inv_n = 1.0 / static_cast<double>(batch.num_items);
  auto objective = [&] {
    Tensor loss = be.zeros(Shape{1}, DType::F64);
    decoder.step(batch, inv_n, loss, false);
    return to_host(be, loss)[0];
  };
  w.zero_grads(be);
  Tensor loss = be.zeros(Shape{1}, DType::F64);
  decoder.step(batch, inv_n, loss, true);
  EXPECT_NEAR(to_host(be, loss)[0], objective(), 1e-14);

  std::mt19937_64 rng(7);
  for (Parameter& p : w.parameters()) {
    if (!p.trainable) continue;
    std::vector<double> values = to_host(be, p.value), grad = to_host(be, p.grad);
    // Up to 6 entries of each tensor, chosen at random.
    for (int probe = 0; probe < 6; ++probe) {
      const size_t i = rng() % values.size();
      const double h = 1e-5, keep = values[i];
      values[i] = keep + h;
      from_host(be, values, p.value);
      const double up = objective();
      values[i] = keep - h;
      from_host(be, values, p.value);
      const double down = objective();
      values[i] = keep;
      from_host(be, values, p.value);
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(grad[i], numeric, 1e-7 + 1e-6 * std::fabs(numeric)) << p.name << "[" << i << "]";
    }
  }
}

}  // namespace

TEST(WholeModelGradients, Qwen2WithBiasAndTiedHead) {
  auto be = make_cpu_backend();
  ModelWeights w = tiny_model(*be, "qwen2", true, 1);
  w.train_all(*be);
  check_model(w, *be, {});
}

TEST(WholeModelGradients, Qwen3WithQkNormUntiedHeadAndRecompute) {
  auto be = make_cpu_backend();
  ModelWeights w = tiny_model(*be, "qwen3", false, 2);
  w.train_all(*be);
  DecoderOptions options;
  options.recompute = {true, false};
  options.logits_budget_bytes = 3 * 11 * 8;  // three rows per logits chunk
  check_model(w, *be, options);
}

TEST(WholeModelGradients, LoraAdaptersWithNonzeroB) {
  auto be = make_cpu_backend();
  ModelWeights w = tiny_model(*be, "llama", false, 3);
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 3;
  lora.targets = {"q_proj", "v_proj", "o_proj", "up_proj", "down_proj"};
  add_lora_with_random_b(*be, w, lora, 4, uniform_draw(1.0));
  int trainable = 0;
  for (Parameter& p : w.parameters()) trainable += p.trainable;
  EXPECT_EQ(trainable, 2 * 5 * 2);  // A and B, five targets, two layers; the base stays frozen
  check_model(w, *be, {});
}
