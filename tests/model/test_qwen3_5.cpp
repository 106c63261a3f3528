// qwen3_5 on the CPU: its config (the multimodal checkpoint's nested text_config, layer_types,
// partial RoPE), the whole decoder's backward against finite differences in F64 (gated DeltaNet
// layers, gated attention with partial RoPE, zero-centred norms, LoRA on their projections),
// packed documents exact with slow-decay DeltaNet heads, and the recompute modes bit-identical.
#include <gtest/gtest.h>

#include <random>

#include "backend/op_test_util.h"
#include "core/error.h"
#include "model/decoder.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;

namespace {

nlohmann::json text_fields() { return tiny_qwen3_5().config_json(); }

// Sets every DeltaNet layer's decay to exp(g) ≈ 0.9995 (A_log = −5, dt_bias = −3): slow enough that
// a state leaking from one document would carry into the whole next one.
void slow_decay(Backend& be, ModelWeights& w) {
  for (Parameter& p : w.parameters()) {
    if (p.name.ends_with(".A_log")) be.fill(be.default_stream(), p.value, -5.0);
    if (p.name.ends_with(".dt_bias")) be.fill(be.default_stream(), p.value, -3.0);
  }
}

// The tiny qwen3_5 at gradient-check sizes: hidden 8, 4 query heads over 2 KV heads of 4 (RoPE on
// the first 2 dims), DeltaNet 1 key head of 3 and 2 value heads of 2, chunks of 3 tokens so that
// the state crosses chunk boundaries inside a document.
ModelWeights gradcheck_model(Backend& be, uint64_t seed) {
  TinyModel m = tiny_qwen3_5();
  m.vocab_size = 11;
  m.hidden_size = 8;
  m.intermediate_size = 12;
  m.head_dim = 4;
  m.rope_theta = 100.0;
  m.extra["linear_num_key_heads"] = 1;
  m.extra["linear_num_value_heads"] = 2;
  m.extra["linear_key_head_dim"] = 3;
  m.extra["linear_value_head_dim"] = 2;
  ModelConfig config = m.config();
  config.linear_attention.chunk_size = 3;
  ModelWeights w = random_weights(be, config, DType::F64, seed, 10.0);
  slow_decay(be, w);
  return w;
}

// Two documents and padding in one row: doc A (6 tokens, prompt of 2), doc B (4 tokens), 1 pad.
PackedRow two_documents() {
  PackedRow r;
  r.input_ids = {3, 7, 1, 9, 4, 8, 2, 2, 10, 5, 0};
  r.positions = {0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0};
  r.doc_ids = {0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1};
  r.targets = {kIgnoreIndex, 1, 9, 4, 8, kIgnoreIndex, 2, 10, 5, kIgnoreIndex, kIgnoreIndex};
  r.weights = {0, 1.5, 1, 0.5, 2, 0, 1, 2, 1, 0, 0};
  return r;
}

void check_gradients(ModelWeights& w, Backend& be, const DecoderOptions& options) {
  Decoder decoder(be, w, options);
  MicroBatch batch = make_micro_batch(be, {two_documents()}, DType::F64);
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
  int checked = 0;
  for (Parameter& p : w.parameters()) {
    if (!p.trainable) continue;
    std::vector<double> values = to_host(be, p.value), grad = to_host(be, p.grad);
    // A small step: the gated norms and gates make the loss curved enough that h = 1e-5 leaves a
    // truncation error of ~1e-6 relative (it falls as h², as it should).
    for (int probe = 0; probe < 6; ++probe) {
      const size_t i = rng() % values.size();
      const double h = 1e-6, keep = values[i];
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
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

}  // namespace

TEST(Qwen35Config, TheTinyPresetHasEveryFeature) {
  const ModelConfig c = tiny_qwen3_5().config();
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_EQ(c.layer_kind(0).mixer, MixerKind::GatedDeltaNet);
  EXPECT_EQ(c.layer_kind(1).mixer, MixerKind::SelfAttention);
  EXPECT_EQ(c.layer_kind(2).mixer, MixerKind::GatedDeltaNet);
  EXPECT_TRUE(c.zero_centered_norm && c.attn_output_gate && c.qk_norm && !c.qkv_bias);
  EXPECT_EQ(c.rotary_dim(), 4);
  EXPECT_EQ(rope_inverse_frequencies(c).size(), 2u);
  EXPECT_EQ(c.linear_attention.num_key_heads, 2);
  EXPECT_EQ(c.linear_attention.num_value_heads, 4);
  EXPECT_EQ(c.linear_attention.conv_kernel, 4);

  auto be = make_cpu_backend(1);
  ModelWeights w = ModelWeights::random(*be, c, DType::F32, 1);
  // q_proj holds each head's query and gate rows; the DeltaNet's tensors as transformers names them.
  EXPECT_EQ(w.find("model.layers.1.self_attn.q_proj.weight")->value.shape(), (Shape{2 * 4 * 8, 32}));
  EXPECT_EQ(w.find("model.layers.0.linear_attn.in_proj_qkv.weight")->value.shape(), (Shape{2 * 16 + 32, 32}));
  EXPECT_EQ(w.find("model.layers.0.linear_attn.conv1d.weight")->value.shape(), (Shape{64, 1, 4}));
  EXPECT_EQ(w.find("model.layers.0.linear_attn.in_proj_z.weight")->value.shape(), (Shape{32, 32}));
  EXPECT_EQ(w.find("model.layers.0.linear_attn.in_proj_b.weight")->value.shape(), (Shape{4, 32}));
  EXPECT_EQ(w.find("model.layers.0.linear_attn.in_proj_a.weight")->value.shape(), (Shape{4, 32}));
  EXPECT_EQ(w.find("model.layers.0.linear_attn.A_log")->value.shape(), (Shape{4}));
  EXPECT_EQ(w.find("model.layers.0.linear_attn.dt_bias")->value.shape(), (Shape{4}));
  EXPECT_EQ(w.find("model.layers.0.linear_attn.norm.weight")->value.shape(), (Shape{8}));
  EXPECT_EQ(w.find("model.layers.0.linear_attn.out_proj.weight")->value.shape(), (Shape{32, 32}));
  EXPECT_EQ(w.find("model.layers.0.self_attn.q_proj.weight"), nullptr);
  const std::vector<std::string> projections = w.projection_names();
  for (const char* name : {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj", "q_proj", "o_proj"})
    EXPECT_NE(std::find(projections.begin(), projections.end(), name), projections.end()) << name;
}

TEST(Qwen35Config, TheMultimodalCheckpointNestsTheTextModel) {
  nlohmann::json text = text_fields();
  text["model_type"] = "qwen3_5_text";
  text["tie_word_embeddings"] = false;
  const nlohmann::json file = {{"model_type", "qwen3_5"},
                               {"architectures", {"Qwen3_5ForConditionalGeneration"}},
                               {"tie_word_embeddings", true},  // the outer model's setting rules
                               {"text_config", text},
                               {"vision_config", {{"depth", 2}, {"hidden_size", 16}}}};
  const ModelConfig c = ModelConfig::from_json(file, "multimodal");
  EXPECT_EQ(c.weight_prefix, "model.language_model.");
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.layer_kind(0).mixer, MixerKind::GatedDeltaNet);
  nlohmann::json untied = file;
  untied.erase("tie_word_embeddings");
  EXPECT_FALSE(ModelConfig::from_json(untied, "multimodal").tie_word_embeddings);  // text_config's then
  nlohmann::json flat = file;
  flat.erase("text_config");
  try {
    ModelConfig::from_json(flat, "flat.json");
    FAIL() << "a qwen3_5 config without text_config was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("text_config"), std::string::npos) << e.what();
  }
}

TEST(Qwen35Config, TransformersDefaultsAndRopeSpellings) {
  nlohmann::json j = text_fields();
  j.erase("layer_types");
  j.erase("partial_rotary_factor");
  j["num_hidden_layers"] = 8;
  // transformers 4's spelling of text-only mRoPE, as older checkpoints carry it.
  j["rope_scaling"] = {{"type", "mrope"}, {"mrope_section", {1, 1, 0}}};
  const ModelConfig c = ModelConfig::from_json(j, "defaults");
  for (int64_t l = 0; l < 8; ++l)  // full_attention_interval 4
    EXPECT_EQ(c.layer_kind(l).mixer, l % 4 == 3 ? MixerKind::SelfAttention : MixerKind::GatedDeltaNet) << l;
  EXPECT_EQ(c.rope.partial_rotary_factor, 0.25);
  EXPECT_EQ(c.rotary_dim(), 2);
  EXPECT_EQ(c.rope.type, "default");

  j.erase("rope_scaling");
  j["rope_parameters"] = {{"rope_type", "default"},       {"rope_theta", 1e7},          {"partial_rotary_factor", 0.5},
                          {"mrope_section", {1, 1, 0}}, {"mrope_interleaved", true}};
  j["full_attention_interval"] = 2;
  const ModelConfig v5 = ModelConfig::from_json(j, "transformers 5");
  EXPECT_EQ(v5.rope.theta, 1e7);
  EXPECT_EQ(v5.rotary_dim(), 4);
  EXPECT_EQ(v5.layer_kind(1).mixer, MixerKind::SelfAttention);
  EXPECT_EQ(v5.layer_kind(2).mixer, MixerKind::GatedDeltaNet);

  nlohmann::json bad = text_fields();
  bad["layer_types"] = {"linear_attention", "sliding_attention", "linear_attention"};
  EXPECT_THROW(ModelConfig::from_json(bad, "bad"), Error);
  bad = text_fields();
  bad["linear_num_value_heads"] = 3;  // not a multiple of the 2 key heads
  EXPECT_THROW(ModelConfig::from_json(bad, "bad"), Error);
}

TEST(Qwen35Gradients, DeltaNetAndGatedAttentionLayersFullFineTune) {
  auto be = make_cpu_backend();
  ModelWeights w = gradcheck_model(*be, 11);
  w.train_all(*be);
  check_gradients(w, *be, {});
}

TEST(Qwen35Gradients, RecomputedLayersTied) {
  auto be = make_cpu_backend();
  TinyModel m = tiny_qwen3_5();
  m.vocab_size = 11;
  m.hidden_size = 8;
  m.intermediate_size = 12;
  m.head_dim = 4;
  m.tie_word_embeddings = true;
  m.extra["linear_key_head_dim"] = 2;
  m.extra["linear_value_head_dim"] = 3;
  ModelWeights w = random_weights(*be, m.config(), DType::F64, 12, 10.0);
  slow_decay(*be, w);
  w.train_all(*be);
  DecoderOptions options;
  options.recompute = {true, true, false};
  options.keep_attention = true;
  check_gradients(w, *be, options);
}

TEST(Qwen35Gradients, LoraOnDeltaNetAndAttentionProjectionsWithNonzeroB) {
  auto be = make_cpu_backend();
  ModelWeights w = gradcheck_model(*be, 13);
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 3;
  lora.targets = {"q_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "out_proj"};
  add_lora_with_random_b(*be, w, lora, 14, uniform_draw(1.0));
  int trainable = 0;
  for (Parameter& p : w.parameters()) trainable += p.trainable;
  EXPECT_EQ(trainable, 2 * (2 * 4 + 2));  // A and B: 4 DeltaNet projections × 2 layers, q and o on one
  check_gradients(w, *be, {});
}

TEST(Qwen35Packing, EachDocumentGivesWhatItGivesAlone) {
  // Slow-decay DeltaNet heads: a state or conv window leaking across the boundary would change the
  // second document's every token. (Attention over packed documents is tested with the other families.)
  auto be = make_cpu_backend();
  TinyModel m = tiny_qwen3_5();
  m.num_layers = 2;  // DeltaNet layers only: what reaches document B from A below can only be theirs
  m.extra["layer_types"] = {"linear_attention", "linear_attention"};
  ModelConfig config = m.config();
  config.linear_attention.chunk_size = 4;  // the boundary falls inside a chunk of the packed row
  ModelWeights w = random_weights(*be, config, DType::F64, 21, 10.0);
  slow_decay(*be, w);
  Decoder decoder(*be, w);
  std::mt19937_64 rng(3);
  auto document = [&](int length, int id) {
    PackedRow r;
    for (int i = 0; i < length; ++i) {
      r.input_ids.push_back(static_cast<int32_t>(rng() % 64));
      r.positions.push_back(i);
      r.doc_ids.push_back(id);
    }
    for (int i = 0; i < length; ++i) {
      r.targets.push_back(i + 1 < length ? r.input_ids[i + 1] : kIgnoreIndex);
      r.weights.push_back(i + 1 < length ? 1.0f : 0.0f);
    }
    return r;
  };
  const PackedRow a = document(7, 0), b = document(9, 1);
  PackedRow packed = a;
  auto append = [](auto& to, const auto& from) { to.insert(to.end(), from.begin(), from.end()); };
  append(packed.input_ids, b.input_ids);
  append(packed.positions, b.positions);
  append(packed.doc_ids, b.doc_ids);
  append(packed.targets, b.targets);
  append(packed.weights, b.weights);
  auto token_ce = [&](const PackedRow& row) {
    MicroBatch batch = make_micro_batch(*be, {row}, DType::F64);
    Tensor loss = be->zeros(Shape{1}, DType::F64), ce = be->empty(Shape{batch.num_selected}, DType::F32);
    decoder.step(batch, 1.0, loss, false, &ce);
    return to_host(*be, ce);
  };
  const std::vector<double> together = token_ce(packed), first = token_ce(a), second = token_ce(b);
  ASSERT_EQ(together.size(), first.size() + second.size());
  for (size_t i = 0; i < first.size(); ++i) EXPECT_NEAR(together[i], first[i], 1e-6) << "document A, target " << i;
  for (size_t i = 0; i < second.size(); ++i)
    EXPECT_NEAR(together[first.size() + i], second[i], 1e-6) << "document B, target " << i;

  // The same tokens as one document: B's predictions change, so the comparison above can see a leak.
  PackedRow joined = packed;
  for (size_t i = a.input_ids.size(); i < joined.doc_ids.size(); ++i) {
    joined.doc_ids[i] = 0;
    joined.positions[i] = static_cast<int32_t>(i);
  }
  const std::vector<double> leaked = token_ce(joined);
  double largest = 0;
  for (size_t i = 0; i < second.size(); ++i) largest = std::max(largest, std::fabs(leaked[first.size() + i] - second[i]));
  EXPECT_GT(largest, 1e-3);
}

namespace {

struct StepResult {
  std::vector<double> loss;                // after each micro-batch
  std::vector<std::vector<double>> grads;  // trainable parameters, in order
};

// Two micro-batches of packed documents (a padding tail in the first) into the same gradients.
StepResult train_step(Backend& be, ModelWeights& w, const DecoderOptions& options) {
  Decoder decoder(be, w, options);
  w.zero_grads(be);
  PackedRow first = two_documents(), second = two_documents();
  std::reverse(second.input_ids.begin(), second.input_ids.end());
  second.doc_ids.assign(second.doc_ids.size(), 0);
  for (size_t i = 0; i < second.positions.size(); ++i) second.positions[i] = static_cast<int32_t>(i);
  second.targets.assign(second.targets.size(), kIgnoreIndex);
  for (size_t i = 0; i + 1 < second.targets.size(); ++i) second.targets[i] = second.input_ids[i + 1];
  second.weights.assign(second.weights.size(), 1.0f);
  second.weights.back() = 0.0f;
  StepResult r;
  Tensor loss = be.zeros(Shape{1}, stat_dtype(w.dtype));
  for (const PackedRow* row : {&first, &second}) {
    decoder.step(make_micro_batch(be, {*row}, w.dtype), 0.05, loss, true);
    r.loss.push_back(to_host(be, loss)[0]);
  }
  for (Parameter& p : w.parameters())
    if (p.trainable) r.grads.push_back(to_host(be, p.grad));
  return r;
}

}  // namespace

TEST(Qwen35Recompute, EveryModeGivesBitIdenticalLossAndGradients) {
  for (DType dtype : {DType::F32, DType::F64})
    for (bool lora : {false, true}) {
      SCOPED_TRACE(std::string(dtype == DType::F64 ? "f64" : "f32") + (lora ? " lora" : " full"));
      auto be = make_cpu_backend(1);
      TinyModel m = tiny_qwen3_5();
      m.vocab_size = 11;
      ModelConfig config = m.config();
      config.linear_attention.chunk_size = 4;
      ModelWeights w = random_weights(*be, config, dtype, 31, 10.0);
      slow_decay(*be, w);
      if (lora) {
        LoraConfig every{.rank = 2, .alpha = 4.0, .rslora = false, .targets = w.projection_names()};
        add_lora_with_random_b(*be, w, every, 5, uniform_draw(0.5));
      }
      else w.train_all(*be);
      const int64_t layers = config.num_layers;
      const StepResult none = train_step(*be, w, recompute_options(RecomputeMode::None, layers));
      double total = 0;
      for (const auto& g : none.grads)
        for (double x : g) total += std::fabs(x);
      ASSERT_GT(total, 0.0);
      for (RecomputeMode mode : {RecomputeMode::All, RecomputeMode::KeepAttention}) {
        const StepResult other = train_step(*be, w, recompute_options(mode, layers));
        EXPECT_EQ(other.loss, none.loss) << recompute_mode_name(mode);
        ASSERT_EQ(other.grads.size(), none.grads.size());
        for (size_t i = 0; i < none.grads.size(); ++i)
          EXPECT_TRUE(other.grads[i] == none.grads[i]) << recompute_mode_name(mode) << ": gradient " << i;
      }
    }
}
