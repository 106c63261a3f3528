// glm4_moe on the CPU: its config (dense then MoE layers, the router's group settings, partial RoPE
// in both spellings, transformers' defaults, refusals, no router aux loss), the tensors as
// transformers names them (the correction bias a buffer: F32, loaded, never trained, outside the
// parameter count), the family row (CPU only; the MTP layers past the last carried), and the whole
// decoder's backward against finite differences in F64 with correction biases that change the
// routing: full fine-tune, and LoRA with nonzero B on every projection and the routed experts.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/op_test_util.h"
#include "core/error.h"
#include "model/decoder.h"
#include "model/family.h"
#include "model/layer.h"
#include "model/router_aux_loss.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;

namespace {

std::string error_of(const nlohmann::json& j) {
  try {
    ModelConfig::from_json(j, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Two documents and padding in one row: doc A (7 tokens), doc B (4), 1 pad.
PackedRow two_documents() {
  PackedRow r;
  r.input_ids = {3, 7, 1, 9, 4, 8, 6, 2, 2, 10, 5, 0};
  r.positions = {0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0};
  r.doc_ids = {0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1};
  r.targets = {kIgnoreIndex, 1, 9, 4, 8, 6, kIgnoreIndex, 2, 10, 5, kIgnoreIndex, kIgnoreIndex};
  r.weights = {0, 1.5, 1, 0.5, 2, 1, 0, 1, 2, 1, 0, 0};
  return r;
}

// At gradient-check sizes: hidden 8, 4 query heads over 2 KV heads of 4 (RoPE on 2 of them), 8
// experts of width 6 in 4 groups (3 per token from the best 2), a shared expert of width 6, a dense
// first layer of width 10. The correction biases drawn on ±0.3, the scale of the scores' spread, so
// that they move the choice.
ModelWeights gradcheck_model(Backend& be, uint64_t seed) {
  TinyModel m = tiny_glm4_moe();
  m.vocab_size = 11;
  m.hidden_size = 8;
  m.head_dim = 4;
  m.intermediate_size = 10;
  m.rope_theta = 100.0;
  m.extra["moe_intermediate_size"] = 6;
  ModelWeights w = random_weights(be, m.config(), DType::F64, seed, 10.0);
  std::mt19937_64 rng(seed + 100);
  std::uniform_real_distribution<double> bias(-0.3, 0.3);
  for (Parameter& p : w.parameters())
    if (p.buffer) {
      std::vector<double> values(static_cast<size_t>(p.value.numel()));
      for (double& x : values) x = bias(rng);
      from_host(be, values, p.value);
    }
  return w;
}

// The loss against central differences on up to 6 entries of every trainable tensor.
void check_gradients(ModelWeights& w, Backend& be) {
  Decoder decoder(be, w, DecoderOptions{});
  MicroBatch batch = make_micro_batch(be, {two_documents()}, DType::F64);
  const double inv_n = 1.0 / static_cast<double>(batch.num_items);
  auto run = [&](bool backward) {
    Tensor loss = be.zeros(Shape{1}, DType::F64);
    decoder.step(batch, inv_n, loss, backward);
    return to_host(be, loss)[0];
  };
  w.zero_grads(be);
  const double trained = run(true);
  EXPECT_NEAR(trained, run(false), 1e-14);
  std::mt19937_64 rng(7);
  int checked = 0;
  for (Parameter& p : w.parameters()) {
    if (!p.trainable) continue;
    std::vector<double> values = to_host(be, p.value), grad = to_host(be, p.grad);
    for (int probe = 0; probe < 6; ++probe) {
      const size_t i = rng() % values.size();
      const double h = 1e-6, keep = values[i];
      values[i] = keep + h;
      from_host(be, values, p.value);
      const double up = run(false);
      values[i] = keep - h;
      from_host(be, values, p.value);
      const double down = run(false);
      values[i] = keep;
      from_host(be, values, p.value);
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(grad[i], numeric, 1e-7 + 1e-6 * std::fabs(numeric)) << p.name << "[" << i << "]";
    }
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

// The loss with every correction bias set to zero: how much the biases move the model.
double loss_without_biases(ModelWeights& w, Backend& be) {
  std::vector<std::pair<Parameter*, std::vector<double>>> kept;
  for (Parameter& p : w.parameters())
    if (p.buffer) {
      kept.emplace_back(&p, to_host(be, p.value));
      be.fill(be.default_stream(), p.value, 0.0);
    }
  Decoder decoder(be, w, DecoderOptions{});
  MicroBatch batch = make_micro_batch(be, {two_documents()}, DType::F64);
  Tensor loss = be.zeros(Shape{1}, DType::F64);
  decoder.step(batch, 1.0, loss, false);
  for (auto& [p, values] : kept) from_host(be, values, p->value);
  return to_host(be, loss)[0];
}

}  // namespace

TEST(Glm4MoeConfig, DenseThenMoeLayersAndTheSigmoidRouter) {
  const ModelConfig c = tiny_glm4_moe().config();
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_FALSE(c.o_bias);  // Glm4MoeAttention's o_proj has no bias
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.zero_centered_norm);
  EXPECT_EQ(c.rope.partial_rotary_factor, 0.5);
  EXPECT_EQ(c.rotary_dim(), 4);
  EXPECT_EQ(c.layer_kind(0).feed_forward, FeedForwardKind::SwiGLU);
  EXPECT_EQ(c.layer_kind(1).feed_forward, FeedForwardKind::MixtureOfExperts);
  EXPECT_EQ(c.layer_kind(2).feed_forward, FeedForwardKind::MixtureOfExperts);
  EXPECT_EQ(c.intermediate_size, 48);
  EXPECT_EQ(c.moe.num_experts, 8);
  EXPECT_EQ(c.moe.experts_per_token, 3);
  EXPECT_EQ(c.moe.expert_intermediate_size, 12);
  EXPECT_EQ(c.moe.shared_expert_intermediate_size, 12);
  EXPECT_TRUE(c.moe.shared_expert_ungated);
  EXPECT_TRUE(c.moe.norm_topk_prob);
  EXPECT_TRUE(c.moe.gating.sigmoid_router);
  EXPECT_FALSE(c.moe.gating.router_bias || c.moe.gating.gpt_oss_experts);
  EXPECT_EQ(c.moe.gating.n_group, 4);
  EXPECT_EQ(c.moe.gating.topk_group, 2);
  EXPECT_EQ(c.moe.gating.routed_scaling_factor, 2.5);

  // n_shared_experts multiplies the shared experts' width; num_local_experts is transformers' alias.
  nlohmann::json j = tiny_glm4_moe().config_json();
  j["n_shared_experts"] = 2;
  j.erase("n_routed_experts");
  j["num_local_experts"] = 8;
  j["first_k_dense_replace"] = 0;
  const ModelConfig wide = ModelConfig::from_json(j, "wide");
  EXPECT_EQ(wide.moe.shared_expert_intermediate_size, 24);
  EXPECT_EQ(wide.moe.num_experts, 8);
  EXPECT_EQ(wide.layer_kind(0).feed_forward, FeedForwardKind::MixtureOfExperts);

  // transformers' Glm4MoeConfig defaults: 128 experts, 8 per token, width 1408, one shared expert,
  // first_k_dense_replace 1, n_group = topk_group = 1, scaling 1, norm_topk_prob on, no q/k norm or
  // attention bias, eps 1e-5, RoPE on half of each head.
  j = tiny_glm4_moe().config_json();
  for (const char* key : {"first_k_dense_replace", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "n_shared_experts", "n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor",
                          "use_qk_norm", "attention_bias", "partial_rotary_factor", "rms_norm_eps"})
    j.erase(key);
  const ModelConfig d = ModelConfig::from_json(j, "defaults");
  EXPECT_EQ(d.moe.num_experts, 128);
  EXPECT_EQ(d.moe.experts_per_token, 8);
  EXPECT_EQ(d.moe.expert_intermediate_size, 1408);
  EXPECT_EQ(d.moe.shared_expert_intermediate_size, 1408);
  EXPECT_EQ(d.layer_kind(0).feed_forward, FeedForwardKind::SwiGLU);
  EXPECT_EQ(d.layer_kind(1).feed_forward, FeedForwardKind::MixtureOfExperts);
  EXPECT_EQ(d.moe.gating.n_group, 1);
  EXPECT_EQ(d.moe.gating.topk_group, 1);
  EXPECT_EQ(d.moe.gating.routed_scaling_factor, 1.0);
  EXPECT_TRUE(d.moe.norm_topk_prob);
  EXPECT_FALSE(d.qk_norm || d.qkv_bias || d.o_bias);
  EXPECT_EQ(d.rms_norm_eps, 1e-5);
  EXPECT_EQ(d.rope.partial_rotary_factor, 0.5);

  // The RoPE spellings: transformers 4 (rope_theta, rope_scaling null, partial_rotary_factor at the
  // top, as the released GLM-4.5 config.json) and 5 (rope_parameters holding both).
  j = tiny_glm4_moe().config_json();
  j["rope_theta"] = 1000000.0;
  j["rope_scaling"] = nullptr;
  j["partial_rotary_factor"] = 0.5;
  const ModelConfig v4 = ModelConfig::from_json(j, "v4");
  j.erase("rope_theta");
  j.erase("rope_scaling");
  j.erase("partial_rotary_factor");
  j["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 1000000.0}, {"partial_rotary_factor", 0.5}};
  const ModelConfig v5 = ModelConfig::from_json(j, "v5");
  for (const ModelConfig* c2 : {&v4, &v5}) {
    EXPECT_EQ(c2->rope.theta, 1000000.0);
    EXPECT_EQ(c2->rope.partial_rotary_factor, 0.5);
    EXPECT_EQ(c2->rope.type, "default");
  }
  j["rope_parameters"]["partial_rotary_factor"] = 1.0;  // the config's own factor wins over the default
  EXPECT_EQ(ModelConfig::from_json(j, "full").rotary_dim(), 8);

  // No load-balancing loss: transformers defines none for glm4_moe.
  j = tiny_glm4_moe().config_json();
  j["output_router_logits"] = true;
  j["router_aux_loss_coef"] = 0.01;
  const ModelConfig asked = ModelConfig::from_json(j, "asked");
  EXPECT_EQ(router_aux_loss_coefficient(asked, -1), 0.0);
  EXPECT_EQ(router_aux_loss_coefficient(asked, 0), 0.0);
  std::string message;
  try {
    router_aux_loss_coefficient(asked, 0.01);
  } catch (const Error& e) {
    message = e.what();
  }
  EXPECT_NE(message.find("transformers defines no router auxiliary loss for glm4_moe"), std::string::npos) << message;
}

TEST(Glm4MoeConfig, GroupSettingsTransformersCannotRunAreRefused) {
  auto refusal = [](const nlohmann::json& changes) {
    nlohmann::json j = tiny_glm4_moe().config_json();
    j.update(changes);
    return error_of(j);
  };
  std::string e = refusal({{"n_group", 3}});
  EXPECT_NE(e.find("n_routed_experts 8 is not divisible into n_group 3 groups"), std::string::npos) << e;
  e = refusal({{"n_group", 8}, {"topk_group", 2}});
  EXPECT_NE(e.find("n_group 8 leaves 1 expert per group"), std::string::npos) << e;
  e = refusal({{"topk_group", 5}});
  EXPECT_NE(e.find("topk_group 5 is more than n_group 4"), std::string::npos) << e;
  e = refusal({{"num_experts_per_tok", 5}});
  EXPECT_NE(e.find("num_experts_per_tok 5 is more than the 4 experts of the topk_group 2 groups"), std::string::npos)
      << e;
  e = refusal({{"first_k_dense_replace", -1}});
  EXPECT_NE(e.find("\"first_k_dense_replace\" must be an integer >= 0"), std::string::npos) << e;
  e = refusal({{"hidden_act", "gelu_pytorch_tanh"}});
  EXPECT_NE(e.find("routed experts with hidden_act gelu_pytorch_tanh are not supported"), std::string::npos) << e;
}

TEST(Glm4MoeWeights, TensorsAsTransformersNamesThemAndTheBiasIsABuffer) {
  auto be = make_cpu_backend(1);
  const ModelConfig c = tiny_glm4_moe().config();
  ModelWeights w = ModelWeights::random(*be, c, DType::F32, 1);
  const std::string p0 = "model.layers.0.", p = "model.layers.2.";
  EXPECT_EQ(w.find(p0 + "mlp.gate_proj.weight")->value.shape(), (Shape{48, 32}));
  EXPECT_EQ(w.find(p0 + "mlp.gate.weight"), nullptr);
  EXPECT_EQ(w.find(p + "self_attn.q_proj.bias")->value.shape(), (Shape{32}));
  EXPECT_EQ(w.find(p + "self_attn.k_proj.bias")->value.shape(), (Shape{16}));
  EXPECT_EQ(w.find(p + "self_attn.o_proj.bias"), nullptr);
  EXPECT_EQ(w.find(p + "self_attn.q_norm.weight")->value.shape(), (Shape{8}));
  EXPECT_EQ(w.find(p + "mlp.gate.weight")->value.shape(), (Shape{8, 32}));
  EXPECT_EQ(w.find(p + "mlp.experts.7.down_proj.weight")->value.shape(), (Shape{32, 12}));
  EXPECT_EQ(w.find(p + "mlp.shared_experts.up_proj.weight")->value.shape(), (Shape{12, 32}));
  EXPECT_EQ(w.find(p + "mlp.shared_expert_gate.weight"), nullptr);
  std::map<std::string, Shape> packed;
  for (const PackedTensor& t : w.packed_tensors()) packed.emplace(t.name, t.shape);
  EXPECT_EQ(packed.at(p + "mlp.experts.gate_up_proj"), (Shape{8, 24, 32}));
  EXPECT_EQ(packed.at(p + "mlp.experts.down_proj"), (Shape{8, 32, 12}));

  // The correction bias: F32 (the stat dtype), a buffer of the layer, never trained, not counted.
  Parameter* bias = w.find(p + "mlp.gate.e_score_correction_bias");
  ASSERT_NE(bias, nullptr);
  EXPECT_EQ(bias->value.shape(), (Shape{8}));
  EXPECT_TRUE(bias->buffer);
  EXPECT_EQ(bias->value.dtype(), DType::F32);
  const std::vector<Parameter*> layer = w.layers[2].parameters();
  EXPECT_NE(std::find(layer.begin(), layer.end(), bias), layer.end());
  w.train_all(*be);
  int64_t trainable = 0, buffers = 0;
  for (const Parameter& q : w.parameters()) {
    if (q.buffer) {
      ++buffers;
      EXPECT_FALSE(q.trainable) << q.name;
      EXPECT_FALSE(q.grad.defined()) << q.name;
    } else {
      EXPECT_TRUE(q.trainable) << q.name;
      trainable += q.value.numel();
    }
  }
  EXPECT_EQ(buffers, 2);  // the two MoE layers
  EXPECT_EQ(count_parameters(c).total, trainable);  // transformers' count: parameters, not buffers
  // BF16 models keep the bias in F32 too (transformers' _keep_in_fp32_modules_strict); F64 in F64.
  EXPECT_EQ(ModelWeights::random(*be, c, DType::F64, 1).find(p + "mlp.gate.e_score_correction_bias")->value.dtype(),
            DType::F64);

  // LoRA names: the attention's, the dense MLP's and the shared experts' (PEFT's suffix match takes
  // mlp.shared_experts.gate_proj for gate_proj); the router is not a target; the routed experts take
  // PEFT's target_parameters.
  EXPECT_EQ(w.projection_names(),
            (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}));
  ModelWeights adapted = ModelWeights::random(*be, c, DType::F32, 1);
  adapted.add_lora(*be, {.rank = 2, .alpha = 4.0, .targets = {"gate_proj", "experts"}}, 3);
  EXPECT_NE(adapted.find("base_model.model.model.layers.1.mlp.shared_experts.gate_proj.lora_A.weight"), nullptr);
  EXPECT_NE(adapted.find("base_model.model.model.layers.0.mlp.gate_proj.lora_B.weight"), nullptr);
  EXPECT_NE(adapted.find("base_model.model.model.layers.2.mlp.experts.lora_A.weight"), nullptr);
  for (const Parameter& q : adapted.parameters()) EXPECT_EQ(q.trainable, q.name.find("lora_") != std::string::npos) << q.name;
}

TEST(Glm4MoeFamily, CpuOnlyAndTheLayersPastTheLastAreCarried) {
  const ModelFamily& family = model_family("glm4_moe", "test");
  EXPECT_NE(family.cpu_only_reason.find("sigmoid router"), std::string_view::npos);
  const ModelConfig c = tiny_glm4_moe().config();  // 3 layers: the MTP layer is model.layers.3
  EXPECT_TRUE(carried_tensor(c, "model.layers.3.eh_proj.weight"));
  EXPECT_TRUE(carried_tensor(c, "model.layers.3.mlp.experts.0.up_proj.weight"));
  EXPECT_TRUE(carried_tensor(c, "model.layers.12.shared_head.norm.weight"));
  EXPECT_FALSE(carried_tensor(c, "model.layers.2.mlp.gate.e_score_correction_bias"));
  EXPECT_FALSE(carried_tensor(c, "model.layers.0.self_attn.q_proj.weight"));
  EXPECT_FALSE(carried_tensor(c, "model.layers.x.weight"));
  EXPECT_FALSE(carried_tensor(c, "model.norm.weight"));
  EXPECT_FALSE(carried_tensor(c, "lm_head.weight"));
  // Other families carry nothing by layer number.
  TinyModel qwen = tiny_qwen3_moe();
  EXPECT_FALSE(carried_tensor(qwen.config(), "model.layers.3.mlp.gate.weight"));
}

TEST(WholeModelGradients, Glm4MoeSigmoidRouterWithCorrectionBiasesAndSharedExperts) {
  auto be = make_cpu_backend(1);
  ModelWeights w = gradcheck_model(*be, 5);
  // The biases change the routing (and so the loss), yet no gradient reaches them.
  Decoder decoder(*be, w, DecoderOptions{});
  MicroBatch batch = make_micro_batch(*be, {two_documents()}, DType::F64);
  Tensor loss = be->zeros(Shape{1}, DType::F64);
  decoder.step(batch, 1.0, loss, false);
  EXPECT_GT(std::fabs(to_host(*be, loss)[0] - loss_without_biases(w, *be)), 1e-3);
  w.train_all(*be);
  check_gradients(w, *be);
}

TEST(WholeModelGradients, Glm4MoeLoraWithNonzeroBOnEveryProjectionAndTheExperts) {
  auto be = make_cpu_backend(1);
  ModelWeights w = gradcheck_model(*be, 7);
  LoraConfig lora = lora_on_every_projection(2, 4.0);
  lora.targets.push_back("experts");
  add_lora_with_random_b(*be, w, lora, 3, uniform_draw(0.5));
  check_gradients(w, *be);
}
