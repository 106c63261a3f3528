// The whole decoder's backward against central finite differences in double, on tiny random
// models covering every architecture feature (GQA, q/k/v bias, q/k norm, tied and untied heads,
// LoRA with nonzero B, packing, loss_scale, checkpointed layers, mixture-of-experts layers with the
// router load-balancing loss).
#include <gtest/gtest.h>

#include <random>

#include <nlohmann/json.hpp>

#include "backend/op_test_util.h"
#include "model/decoder.h"
#include "model/router_aux_loss.h"
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

// The objective is the loss of docs/design.md §2.2, plus aux_coefficient × the router
// load-balancing loss (model/router_aux_loss.h) for MoE models when positive.
void check_model(ModelWeights& w, Backend& be, const DecoderOptions& options, double aux_coefficient = 0) {
  Decoder decoder(be, w, options);
  MicroBatch batch = make_micro_batch(be, {row()}, DType::F64);
  const double inv_n = 1.0 / static_cast<double>(batch.num_items);
  std::unique_ptr<RouterAuxLoss> aux;
  if (aux_coefficient > 0) {
    aux = std::make_unique<RouterAuxLoss>(be, w.config, DType::F64, aux_coefficient);
    decoder.set_router_aux_loss(aux.get());
  }
  const int64_t real_tokens = 9;  // row(): every token but the padding
  auto objective = [&] {
    Tensor loss = be.zeros(Shape{1}, DType::F64);
    if (aux) aux->begin_step(real_tokens, nullptr);
    decoder.step(batch, inv_n, loss, false);
    double value = to_host(be, loss)[0];
    if (aux) {
      aux->finish_statistics();
      value += aux_coefficient * aux->value();
      aux->end_step();
    }
    return value;
  };
  w.zero_grads(be);
  Tensor loss = be.zeros(Shape{1}, DType::F64);
  if (aux) aux->begin_step(real_tokens, nullptr);  // one micro-batch: its forward collects the statistics
  decoder.step(batch, inv_n, loss, true);
  double trained = to_host(be, loss)[0];
  if (aux) {
    EXPECT_GT(aux->value(), 0.0);
    trained += aux_coefficient * aux->value();
    aux->end_step();
  }
  EXPECT_NEAR(trained, objective(), 1e-14);

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

namespace {

// qwen3_moe at the sizes above: 4 experts of width 6, 2 per token, layers as `extra` says.
ModelWeights tiny_moe(Backend& be, nlohmann::json extra, uint64_t seed) {
  TinyModel m = tiny_qwen3_moe();
  m.vocab_size = 11;
  m.hidden_size = 8;
  m.intermediate_size = 12;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 2;
  m.rope_theta = 100.0;
  m.extra["moe_intermediate_size"] = 6;
  m.extra.update(extra);
  return random_weights(be, m.config(), DType::F64, seed, 20.0);
}

}  // namespace

TEST(WholeModelGradients, Qwen3MoeRoutersExpertsAndTheLoadBalancingLoss) {
  // Layers 0 and 2 MoE (renormalised top-2 of 4), layer 1 dense; layer 0 recomputed; every
  // parameter trains, routers included, through the routing weights and the aux loss.
  auto be = make_cpu_backend();
  ModelWeights w = tiny_moe(*be, nlohmann::json::object(), 5);
  w.train_all(*be);
  DecoderOptions options;
  options.recompute = {true, false, false};
  check_model(w, *be, options, 0.5);
}

TEST(WholeModelGradients, Qwen3MoeWithoutRenormalisationEverySecondLayer) {
  // decoder_sparse_step 2: layer 1 alone is MoE; top-2 weights are the raw probabilities; no aux loss.
  auto be = make_cpu_backend();
  ModelWeights w = tiny_moe(*be, {{"norm_topk_prob", false}, {"decoder_sparse_step", 2}, {"mlp_only_layers", {}}}, 9);
  ASSERT_EQ(w.config.layer_kind(1).feed_forward, FeedForwardKind::MixtureOfExperts);
  ASSERT_EQ(w.config.layer_kind(0).feed_forward, FeedForwardKind::SwiGLU);
  w.train_all(*be);
  check_model(w, *be, {});
}

TEST(WholeModelGradients, Qwen3MoeAttentionLoraWithNonzeroB) {
  // LoRA on the projections PEFT adapts in qwen3_moe (attention; the dense layer's MLP); the
  // router's and experts' weights stay frozen, the aux loss still reaches the attention through them.
  auto be = make_cpu_backend();
  ModelWeights w = tiny_moe(*be, nlohmann::json::object(), 7);
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 3;
  lora.targets = {"q_proj", "v_proj", "o_proj", "down_proj"};
  add_lora_with_random_b(*be, w, lora, 8, uniform_draw(1.0));
  int trainable = 0;
  for (Parameter& p : w.parameters()) trainable += p.trainable;
  EXPECT_EQ(trainable, 2 * (3 * 3 + 1));  // A and B: q, v, o on three layers, down_proj on the dense one
  check_model(w, *be, {}, 0.5);
}

TEST(WholeModelGradients, Qwen3MoeExpertLoraWithNonzeroB) {
  // LoRA on both fused expert tensors as PEFT's target_parameters adapt them (gate_up_proj: one A_e
  // for the gate and up rows of B_e; down_proj), and on q_proj; the expert weights run as grouped
  // GEMMs, the first layer recomputed, the aux loss on.
  auto be = make_cpu_backend();
  ModelWeights w = tiny_moe(*be, nlohmann::json::object(), 11);
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 3;
  lora.targets = {"q_proj", "experts"};
  add_lora_with_random_b(*be, w, lora, 12, uniform_draw(1.0));
  int trainable = 0;
  for (Parameter& p : w.parameters()) trainable += p.trainable;
  EXPECT_EQ(trainable, 2 * (3 + 2 * 2));  // A and B: q on three layers, both expert tensors on the two MoE ones
  EXPECT_NE(w.find("base_model.model.model.layers.2.mlp.experts.base_layer.lora_A.weight"), nullptr);
  ASSERT_NE(w.find("base_model.model.model.layers.2.mlp.experts.lora_B.weight"), nullptr);
  EXPECT_EQ(w.find("base_model.model.model.layers.2.mlp.experts.lora_B.weight")->value.shape(), (Shape{4, 8, 2}));
  DecoderOptions options;
  options.recompute = {true, false, false};
  check_model(w, *be, options, 0.5);
}

TEST(WholeModelGradients, Qwen3MoeDownProjLoraOverFourBitExperts) {
  // 4-bit experts run one Linear per expert (the offsets read on the host); the LoRA term of
  // down_proj is still grouped GEMMs. One targeted tensor: PEFT names it without a ".base_layer".
  auto be = make_cpu_backend();
  ModelWeights w = tiny_moe(*be, nlohmann::json::object(), 13);
  w.quantize_projections(*be, {.type = Quant4Type::NF4, .blocksize = 32});
  LoraConfig lora;
  lora.rank = 3;
  lora.alpha = 2;
  lora.targets = {"experts.down_proj"};
  add_lora_with_random_b(*be, w, lora, 14, uniform_draw(1.0));
  ASSERT_NE(w.find("base_model.model.model.layers.0.mlp.experts.lora_A.weight"), nullptr);
  EXPECT_EQ(w.find("base_model.model.model.layers.0.mlp.experts.lora_A.weight")->value.shape(), (Shape{4 * 3, 6}));
  EXPECT_EQ(w.find("base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"), nullptr);
  check_model(w, *be, {}, 0.5);
}

namespace {

// A tiny model of a wave-2 family from its config.json fields.
ModelWeights tiny_from_json(Backend& be, nlohmann::json j, uint64_t seed) {
  nlohmann::json base = {{"vocab_size", 11}, {"hidden_size", 8},        {"intermediate_size", 12},
                         {"num_hidden_layers", 2}, {"num_attention_heads", 4}, {"num_key_value_heads", 2},
                         {"head_dim", 2},    {"rms_norm_eps", 1e-6},    {"rope_theta", 100.0}};
  base.update(j);
  ModelWeights w = random_weights(be, ModelConfig::from_json(base, "test config"), DType::F64, seed, 20.0);
  w.train_all(be);
  return w;
}

}  // namespace

// Gemma 2: a window of 3 keys on the sliding layer (shorter than both documents), soft-capped
// attention and final logits, query_pre_attn_scalar, four (1 + w) norms per layer, GeGLU, √hidden
// embeddings under a tied head; once with every layer recomputed and logits in chunks of 3 rows.
TEST(WholeModelGradients, Gemma2WindowsSoftcapsSandwichNormsAndGeglu) {
  auto be = make_cpu_backend();
  for (bool recompute : {false, true}) {
    SCOPED_TRACE(recompute ? "recompute" : "kept");
    ModelWeights w = tiny_from_json(*be, {{"model_type", "gemma2"}, {"sliding_window", 3}, {"query_pre_attn_scalar", 3},
                                          {"attn_logit_softcapping", 2.0}, {"final_logit_softcapping", 3.0}},
                                    21);
    ASSERT_EQ(w.config.attention_spec(0).window, 3);
    ASSERT_EQ(w.config.attention_spec(1).window, 0);
    DecoderOptions options;
    if (recompute) {
      options.recompute = {true, true};
      options.logits_budget_bytes = 3 * 11 * 8;
    }
    check_model(w, *be, options);
  }
}

// Gemma 3: q/k (1 + w) norms, a sliding layer with its own RoPE table and a full layer with a
// linearly scaled one, no soft-caps.
TEST(WholeModelGradients, Gemma3QkNormsAndTwoRopeTables) {
  auto be = make_cpu_backend();
  ModelWeights w = tiny_from_json(
      *be,
      {{"model_type", "gemma3_text"},
       {"sliding_window", 3},
       {"layer_types", {"sliding_attention", "full_attention"}},
       {"rope_parameters",
        {{"full_attention", {{"rope_type", "linear"}, {"rope_theta", 1000.0}, {"factor", 2.0}}},
         {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 10.0}}}}}},
      22);
  ASSERT_TRUE(w.config.attention_spec(0).sliding_rope);
  check_model(w, *be, {});
}

// Mistral's window on every layer with YaRN RoPE (the documents run past its original window of 2).
TEST(WholeModelGradients, MistralWindowWithYarn) {
  auto be = make_cpu_backend();
  ModelWeights w = tiny_from_json(*be,
                                  {{"model_type", "mistral"},
                                   {"sliding_window", 2},
                                   {"rope_scaling",
                                    {{"rope_type", "yarn"}, {"factor", 4.0}, {"original_max_position_embeddings", 2}}}},
                                  23);
  check_model(w, *be, {});
}
