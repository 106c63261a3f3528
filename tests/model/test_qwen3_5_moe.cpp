// qwen3_5_moe (Qwen3.5-MoE, Qwen3.6) on the CPU: its config (text-only and the multimodal checkpoint's
// text_config, every layer MoE with a shared expert, the router always renormalised), the tensors
// and projections as transformers and PEFT name them, both expert layouts loading the same model,
// the whole decoder's backward against finite differences in F64 (routers, experts, the shared
// expert and its gate, the load-balancing loss, LoRA with nonzero B on the shared expert, the gate,
// the DeltaNet and attention projections and the routed experts' fused tensors), and the recompute
// modes bit-identical.
#include <gtest/gtest.h>

#include <random>

#include "backend/op_test_util.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/io_test_util.h"
#include "model/decoder.h"
#include "model/router_aux_loss.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;

namespace {

// Every DeltaNet head decays slowly (exp(g) ≈ 0.9995), as in the qwen3_5 tests.
void slow_decay(Backend& be, ModelWeights& w) {
  for (Parameter& p : w.parameters()) {
    if (p.name.ends_with(".A_log")) be.fill(be.default_stream(), p.value, -5.0);
    if (p.name.ends_with(".dt_bias")) be.fill(be.default_stream(), p.value, -3.0);
  }
}

// At gradient-check sizes: hidden 8, attention 4 query heads over 2 KV heads of 4, DeltaNet 1 key
// head of 3 and 2 value heads of 2 in chunks of 3 tokens, 4 experts of width 6 (2 per token), a
// shared expert of width 5.
ModelWeights gradcheck_model(Backend& be, uint64_t seed) {
  TinyModel m = tiny_qwen3_5_moe();
  m.vocab_size = 11;
  m.hidden_size = 8;
  m.head_dim = 4;
  m.rope_theta = 100.0;
  m.extra.update({{"linear_num_key_heads", 1},
                  {"linear_num_value_heads", 2},
                  {"linear_key_head_dim", 3},
                  {"linear_value_head_dim", 2},
                  {"moe_intermediate_size", 6},
                  {"shared_expert_intermediate_size", 5}});
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

// The loss of docs/design.md §2.2 plus aux_coefficient × the router load-balancing loss, against
// central differences on up to 6 entries of every trainable tensor.
void check_gradients(ModelWeights& w, Backend& be, const DecoderOptions& options, double aux_coefficient) {
  Decoder decoder(be, w, options);
  MicroBatch batch = make_micro_batch(be, {two_documents()}, DType::F64);
  const double inv_n = 1.0 / static_cast<double>(batch.num_items);
  std::unique_ptr<RouterAuxLoss> aux;
  if (aux_coefficient > 0) {
    aux = std::make_unique<RouterAuxLoss>(be, w.config, DType::F64, aux_coefficient);
    decoder.set_router_aux_loss(aux.get());
  }
  const int64_t real_tokens = 10;  // every token of two_documents() but the padding
  auto run = [&](bool backward) {
    Tensor loss = be.zeros(Shape{1}, DType::F64);
    if (aux) aux->begin_step(real_tokens, nullptr);
    decoder.step(batch, inv_n, loss, backward);
    double value = to_host(be, loss)[0];
    if (aux) {
      if (!backward) aux->finish_statistics();
      EXPECT_GT(aux->value(), 0.0);
      value += aux_coefficient * aux->value();
      aux->end_step();
    }
    return value;
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

std::string error_of(const nlohmann::json& j) {
  try {
    ModelConfig::from_json(j, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST(Qwen35MoeConfig, EveryLayerIsMoeWithASharedExpert) {
  const ModelConfig c = tiny_qwen3_5_moe().config();
  EXPECT_EQ(c.model_type, "qwen3_5_moe_text");
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_EQ(c.intermediate_size, 0);  // no dense MLP anywhere
  for (int64_t l = 0; l < 3; ++l) EXPECT_EQ(c.layer_kind(l).feed_forward, FeedForwardKind::MixtureOfExperts) << l;
  EXPECT_EQ(c.layer_kind(0).mixer, MixerKind::GatedDeltaNet);
  EXPECT_EQ(c.layer_kind(1).mixer, MixerKind::SelfAttention);
  EXPECT_TRUE(c.moe.norm_topk_prob);  // transformers' router renormalises whatever the config says
  EXPECT_EQ(c.moe.num_experts, 4);
  EXPECT_EQ(c.moe.experts_per_token, 2);
  EXPECT_EQ(c.moe.expert_intermediate_size, 12);
  EXPECT_EQ(c.moe.shared_expert_intermediate_size, 16);
  EXPECT_FALSE(c.moe.output_router_logits);
  EXPECT_TRUE(c.zero_centered_norm && c.attn_output_gate);
  EXPECT_EQ(router_aux_loss_coefficient(c, -1), 0.0);  // off unless asked for

  // The multimodal checkpoint: the same text model under text_config, tensors under model.language_model.
  const ModelConfig mm = ModelConfig::from_json(multimodal_config_json(tiny_qwen3_5_moe()), "multimodal");
  EXPECT_EQ(mm.model_type, "qwen3_5_moe");
  EXPECT_EQ(mm.weight_prefix, "model.language_model.");
  EXPECT_EQ(mm.moe.shared_expert_intermediate_size, 16);
  EXPECT_EQ(mm.layer_kind(2).feed_forward, FeedForwardKind::MixtureOfExperts);

  // transformers' Qwen3_5MoeTextConfig defaults when the fields are absent; mlp_only_layers and
  // decoder_sparse_step mean nothing to this family (transformers drops them).
  nlohmann::json j = tiny_qwen3_5_moe().config_json();
  for (const char* key : {"num_experts", "num_experts_per_tok", "moe_intermediate_size",
                          "shared_expert_intermediate_size", "router_aux_loss_coef", "output_router_logits"})
    j.erase(key);
  j["mlp_only_layers"] = {0, 1};
  j["decoder_sparse_step"] = 2;
  j["norm_topk_prob"] = false;
  const ModelConfig d = ModelConfig::from_json(j, "defaults");
  EXPECT_EQ(d.moe.num_experts, 256);
  EXPECT_EQ(d.moe.experts_per_token, 8);
  EXPECT_EQ(d.moe.expert_intermediate_size, 512);
  EXPECT_EQ(d.moe.shared_expert_intermediate_size, 512);
  EXPECT_EQ(d.moe.router_aux_loss_coef, 0.001);
  EXPECT_TRUE(d.moe.norm_topk_prob);
  for (int64_t l = 0; l < 3; ++l) EXPECT_EQ(d.layer_kind(l).feed_forward, FeedForwardKind::MixtureOfExperts) << l;

  nlohmann::json on = tiny_qwen3_5_moe().config_json();
  on["output_router_logits"] = true;
  on["router_aux_loss_coef"] = 0.02;
  EXPECT_EQ(router_aux_loss_coefficient(ModelConfig::from_json(on, "on"), -1), 0.02);

  nlohmann::json bad = tiny_qwen3_5_moe().config_json();
  bad["num_experts_per_tok"] = 5;
  EXPECT_NE(error_of(bad).find("num_experts_per_tok 5 is more than num_experts 4"), std::string::npos) << error_of(bad);
  bad = tiny_qwen3_5_moe().config_json();
  bad["shared_expert_intermediate_size"] = 0;
  EXPECT_NE(error_of(bad).find("\"shared_expert_intermediate_size\" must be a positive integer"), std::string::npos)
      << error_of(bad);
}

TEST(Qwen35MoeWeights, TensorsAndProjectionsAsTransformersAndPeftNameThem) {
  auto be = make_cpu_backend(1);
  const ModelConfig c = ModelConfig::from_json(multimodal_config_json(tiny_qwen3_5_moe()), "multimodal");
  ModelWeights w = ModelWeights::random(*be, c, DType::F32, 1);
  const std::string p = "model.language_model.layers.1.mlp.";
  EXPECT_EQ(w.find(p + "gate.weight")->value.shape(), (Shape{4, 32}));
  EXPECT_EQ(w.find(p + "experts.3.gate_proj.weight")->value.shape(), (Shape{12, 32}));
  EXPECT_EQ(w.find(p + "experts.3.down_proj.weight")->value.shape(), (Shape{32, 12}));
  EXPECT_EQ(w.find(p + "shared_expert.gate_proj.weight")->value.shape(), (Shape{16, 32}));
  EXPECT_EQ(w.find(p + "shared_expert.up_proj.weight")->value.shape(), (Shape{16, 32}));
  EXPECT_EQ(w.find(p + "shared_expert.down_proj.weight")->value.shape(), (Shape{32, 16}));
  EXPECT_EQ(w.find(p + "shared_expert_gate.weight")->value.shape(), (Shape{1, 32}));
  EXPECT_EQ(w.find("model.language_model.layers.1.mlp.gate_proj.weight"), nullptr);
  // The fused layout the released checkpoints store.
  std::vector<std::string> packed;
  for (const PackedTensor& t : w.packed_tensors()) packed.push_back(t.name);
  EXPECT_NE(std::find(packed.begin(), packed.end(), p + "experts.gate_up_proj"), packed.end());
  EXPECT_NE(std::find(packed.begin(), packed.end(), p + "experts.down_proj"), packed.end());

  // LoRA targets: attention, DeltaNet, the shared expert and its gate; not the routed experts or the router.
  const std::vector<std::string> projections = w.projection_names();
  for (const char* name : {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                           "out_proj", "gate_proj", "up_proj", "down_proj", "shared_expert_gate"})
    EXPECT_NE(std::find(projections.begin(), projections.end(), name), projections.end()) << name;
  for (const char* name : {"gate", "experts.gate_proj", "experts.down_proj"})
    EXPECT_EQ(std::find(projections.begin(), projections.end(), name), projections.end()) << name;
  LoraConfig lora{.rank = 2, .alpha = 4.0, .rslora = false, .targets = {"gate_proj", "shared_expert_gate", "in_proj_qkv"}};
  w.add_lora(*be, lora, 3);
  // PEFT's names for the multimodal layout.
  EXPECT_NE(w.find("base_model.model.model.language_model.layers.1.mlp.shared_expert.gate_proj.lora_A.weight"), nullptr);
  EXPECT_NE(w.find("base_model.model.model.language_model.layers.2.mlp.shared_expert_gate.lora_B.weight"), nullptr);
  EXPECT_NE(w.find("base_model.model.model.language_model.layers.0.linear_attn.in_proj_qkv.lora_A.weight"), nullptr);
  for (const Parameter& q : w.parameters())
    EXPECT_EQ(q.name.find("experts.") != std::string::npos && q.name.find("lora_") != std::string::npos, false) << q.name;

  // The routed experts are adapted per fused tensor (PEFT's target_parameters), never one projection
  // of them; the router not at all.
  auto refusal = [&](LoraConfig config) {
    ModelWeights again = ModelWeights::random(*be, c, DType::F32, 1);
    try {
      again.add_lora(*be, config, 3);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("accepted");
  };
  const std::string one_projection = refusal({.rank = 2, .alpha = 4.0, .targets = {"experts.gate_proj"}});
  EXPECT_NE(one_projection.find("gate and up together as mlp.experts.gate_up_proj"), std::string::npos) << one_projection;
  for (const LoraConfig& router : {LoraConfig{.rank = 2, .alpha = 4.0, .targets = {"gate"}},
                                   LoraConfig{.rank = 2, .alpha = 4.0, .targets = {}, .target_parameters = {"mlp.gate.weight"}}}) {
    const std::string message = refusal(router);
    EXPECT_NE(message.find("LoRA on the MoE router (mlp.gate) is not supported"), std::string::npos) << message;
  }
  const std::string unknown = refusal({.rank = 2, .alpha = 4.0, .targets = {}, .target_parameters = {"mlp.experts.up_proj"}});
  EXPECT_NE(unknown.find("names no tensor spindle adapts"), std::string::npos) << unknown;

  ModelWeights experts = ModelWeights::random(*be, c, DType::F32, 1);
  experts.add_lora(*be, {.rank = 2, .alpha = 4.0, .targets = {"q_proj", "experts"}}, 3);
  EXPECT_EQ(experts.lora.targets, (std::vector<std::string>{"q_proj"}));
  EXPECT_EQ(experts.lora.target_parameters,
            (std::vector<std::string>{"mlp.experts.gate_up_proj", "mlp.experts.down_proj"}));
  // PEFT's names: gate_up_proj's wrapper inside down_proj's. A [E·r, in]; B [E, out, r] (PEFT's file: [out, r·E]).
  const std::string experts_prefix = "base_model.model.model.language_model.layers.2.mlp.experts.";
  ASSERT_NE(experts.find(experts_prefix + "base_layer.lora_A.weight"), nullptr);
  EXPECT_EQ(experts.find(experts_prefix + "base_layer.lora_A.weight")->value.shape(), (Shape{4 * 2, 32}));
  EXPECT_EQ(experts.find(experts_prefix + "base_layer.lora_B.weight")->value.shape(), (Shape{4, 2 * 12, 2}));
  EXPECT_EQ(experts.find(experts_prefix + "lora_A.weight")->value.shape(), (Shape{4 * 2, 12}));
  EXPECT_EQ(experts.find(experts_prefix + "lora_B.weight")->value.shape(), (Shape{4, 32, 2}));
}

TEST(Qwen35MoeWeights, LoraCountsForFlopsWeighExpertPairsByTheTokensTheySee) {
  // count_parameters' LoRA count (spindle bench's FLOPs) against the pairs add_lora makes: a routed
  // experts' tensor holds E pairs and a token passes through k of them.
  auto be = make_cpu_backend(1);
  const ModelConfig c = tiny_qwen3_5_moe().config();
  const double share = static_cast<double>(c.moe.experts_per_token) / static_cast<double>(c.moe.num_experts);
  const ParameterCounts counts = count_parameters(c);
  for (const std::vector<std::string>& targets : std::vector<std::vector<std::string>>{
           {"q_proj", "down_proj"}, {"experts"}, {"experts.down_proj", "gate_proj"}, {"experts.gate_up_proj"}}) {
    ModelWeights w = ModelWeights::random(*be, c, DType::F32, 1);
    w.add_lora(*be, {.rank = 2, .alpha = 4.0, .targets = targets}, 3);
    double per_token = 0;
    for (const Parameter& p : w.parameters())
      if (p.trainable)
        per_token += static_cast<double>(p.value.numel()) * (p.name.find(".mlp.experts.") != std::string::npos ? share : 1.0);
    EXPECT_EQ(counts.lora(2, targets), std::llround(per_token)) << targets.front();
  }
}

TEST(Qwen35MoeWeights, FusedAndPerExpertCheckpointsLoadTheSameModel) {
  io::testing::ScratchDir scratch;
  const nlohmann::json config = multimodal_config_json(tiny_qwen3_5_moe());
  write_model_folder(scratch.path() / "fused", config, 4, 1.0, {.fused_experts = true});
  write_model_folder(scratch.path() / "per_expert", config, 4, 1.0, {.fused_experts = false});
  const io::Checkpoint fused((scratch.path() / "fused").string());
  ASSERT_NE(fused.find("model.language_model.layers.0.mlp.experts.gate_up_proj"), nullptr);
  EXPECT_EQ(fused.find("model.language_model.layers.0.mlp.experts.0.gate_proj.weight"), nullptr);
  auto be = make_cpu_backend(1);
  const ModelConfig c = ModelConfig::from_file((scratch.path() / "fused").string());
  ModelWeights a = ModelWeights::load(*be, c, fused, DType::F32);
  ModelWeights b = ModelWeights::load(*be, c, io::Checkpoint((scratch.path() / "per_expert").string()), DType::F32);
  ASSERT_EQ(a.parameters().size(), b.parameters().size());
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_EQ(to_host(*be, a.parameters()[i].value), to_host(*be, b.parameters()[i].value)) << a.parameters()[i].name;
  for (const PackedTensor& t : a.packed_tensors()) EXPECT_TRUE(t.read) << t.name;
  for (const PackedTensor& t : b.packed_tensors()) EXPECT_FALSE(t.read) << t.name;
}

TEST(Qwen35MoeGradients, FullFineTuneWithTheLoadBalancingLoss) {
  auto be = make_cpu_backend();
  ModelWeights w = gradcheck_model(*be, 41);
  w.train_all(*be);
  DecoderOptions options;
  options.recompute = {false, true, false};  // the attention layer checkpointed
  check_gradients(w, *be, options, 0.5);
}

TEST(Qwen35MoeGradients, LoraOnSharedExpertGateDeltaNetAndAttentionWithNonzeroB) {
  // The routers and experts stay frozen; the aux loss still reaches the adapters through the routers' inputs.
  auto be = make_cpu_backend();
  ModelWeights w = gradcheck_model(*be, 43);
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 3;
  lora.targets = {"q_proj", "in_proj_qkv", "in_proj_z", "out_proj", "gate_proj", "up_proj", "down_proj",
                  "shared_expert_gate"};
  add_lora_with_random_b(*be, w, lora, 44, uniform_draw(1.0));
  int trainable = 0;
  for (Parameter& p : w.parameters()) trainable += p.trainable;
  // A and B: the shared expert's three and the gate on 3 layers, 3 DeltaNet projections on 2, q on 1.
  EXPECT_EQ(trainable, 2 * (4 * 3 + 3 * 2 + 1));
  check_gradients(w, *be, {}, 0.3);
}

TEST(Qwen35MoeGradients, LoraOnRoutedExpertsAndTheSharedExpertWithNonzeroB) {
  // PEFT's target_parameters on both fused expert tensors, beside the shared expert's projections.
  auto be = make_cpu_backend();
  ModelWeights w = gradcheck_model(*be, 45);
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 3;
  lora.targets = {"gate_proj", "down_proj"};
  lora.target_parameters = {"experts.gate_up_proj", "layers.1.mlp.experts.down_proj"};  // a dotted suffix: layer 1 only
  add_lora_with_random_b(*be, w, lora, 46, uniform_draw(1.0));
  int trainable = 0;
  for (Parameter& p : w.parameters()) trainable += p.trainable;
  EXPECT_EQ(trainable, 2 * (2 * 3 + 3 + 1));  // A and B: two shared-expert projections and gate_up on 3 layers, down on 1
  check_gradients(w, *be, {}, 0.3);
}

TEST(Qwen35MoeRecompute, EveryModeGivesBitIdenticalLossAndGradients) {
  for (DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype == DType::F64 ? "f64" : "f32");
    auto be = make_cpu_backend(1);
    TinyModel m = tiny_qwen3_5_moe();
    m.vocab_size = 11;
    ModelConfig config = m.config();
    config.linear_attention.chunk_size = 4;
    ModelWeights w = random_weights(*be, config, dtype, 51, 10.0);
    slow_decay(*be, w);
    w.train_all(*be);
    auto step = [&](RecomputeMode mode) {
      Decoder decoder(*be, w, recompute_options(mode, config.num_layers));
      RouterAuxLoss aux(*be, w.config, dtype, 0.1);
      decoder.set_router_aux_loss(&aux);
      w.zero_grads(*be);
      Tensor loss = be->zeros(Shape{1}, stat_dtype(dtype));
      aux.begin_step(10, nullptr);
      decoder.step(make_micro_batch(*be, {two_documents()}, dtype), 0.05, loss, true);
      std::vector<std::vector<double>> out{to_host(*be, loss), {aux.value()}};
      aux.end_step();
      for (Parameter& p : w.parameters()) out.push_back(to_host(*be, p.grad));
      return out;
    };
    const auto none = step(RecomputeMode::None);
    for (RecomputeMode mode : {RecomputeMode::All, RecomputeMode::KeepAttention}) {
      const auto other = step(mode);
      ASSERT_EQ(other.size(), none.size());
      for (size_t i = 0; i < none.size(); ++i) EXPECT_TRUE(other[i] == none[i]) << recompute_mode_name(mode) << " " << i;
    }
  }
}
