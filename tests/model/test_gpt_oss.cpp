// gpt_oss on the CPU: its config (layer types, windows, sinks, the MoE variant, transformers'
// defaults, refusals), the tensors as transformers names them, the fused [E, in, out] expert layout
// and MXFP4 checkpoints loading the same model, MXFP4 dequantisation against values worked out by
// hand, the whole decoder's backward against finite differences in F64 (sinks, biases, the biased
// router, the clamped-SwiGLU experts, the load-balancing loss, attention LoRA with nonzero B), and
// LoRA on the experts refused with a message naming what works.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/op_test_util.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/load_tensor.h"
#include "io/io_test_util.h"
#include "io/write_safetensors.h"
#include "model/decoder.h"
#include "model/mxfp4.h"
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

// Two documents and padding in one row: doc A (7 tokens, past the window of 4), doc B (4), 1 pad.
PackedRow two_documents() {
  PackedRow r;
  r.input_ids = {3, 7, 1, 9, 4, 8, 6, 2, 2, 10, 5, 0};
  r.positions = {0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 0};
  r.doc_ids = {0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, -1};
  r.targets = {kIgnoreIndex, 1, 9, 4, 8, 6, kIgnoreIndex, 2, 10, 5, kIgnoreIndex, kIgnoreIndex};
  r.weights = {0, 1.5, 1, 0.5, 2, 1, 0, 1, 2, 1, 0, 0};
  return r;
}

// At gradient-check sizes: hidden 8, 4 query heads over 2 KV heads of 4, window 4, 4 experts of
// width 6 (2 per token).
ModelWeights gradcheck_model(Backend& be, uint64_t seed) {
  TinyModel m = tiny_gpt_oss();
  m.vocab_size = 11;
  m.hidden_size = 8;
  m.head_dim = 4;
  m.intermediate_size = 6;
  m.rope_theta = 100.0;
  return random_weights(be, m.config(), DType::F64, seed, 10.0);
}

// The loss plus aux_coefficient × the router load-balancing loss, against central differences on
// up to 6 entries of every trainable tensor.
void check_gradients(ModelWeights& w, Backend& be, double aux_coefficient) {
  Decoder decoder(be, w, DecoderOptions{});
  MicroBatch batch = make_micro_batch(be, {two_documents()}, DType::F64);
  const double inv_n = 1.0 / static_cast<double>(batch.num_items);
  std::unique_ptr<RouterAuxLoss> aux;
  if (aux_coefficient > 0) {
    aux = std::make_unique<RouterAuxLoss>(be, w.config, DType::F64, aux_coefficient);
    decoder.set_router_aux_loss(aux.get());
  }
  const int64_t real_tokens = 11;
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

}  // namespace

TEST(GptOssConfig, LayersWindowsSinksAndTheMoeVariant) {
  const ModelConfig c = tiny_gpt_oss().config();
  EXPECT_EQ(c.weight_prefix, "model.");
  EXPECT_TRUE(c.qkv_bias && c.o_bias);
  ASSERT_EQ(c.attention_specs.size(), 2u);
  EXPECT_EQ(c.attention_spec(0).window, 4);
  EXPECT_EQ(c.attention_spec(1).window, 0);
  EXPECT_TRUE(c.attention_spec(0).sinks && c.attention_spec(1).sinks);
  for (int64_t l = 0; l < 2; ++l) {
    EXPECT_EQ(c.layer_kind(l).mixer, MixerKind::SelfAttention) << l;
    EXPECT_EQ(c.layer_kind(l).feed_forward, FeedForwardKind::MixtureOfExperts) << l;
  }
  EXPECT_EQ(c.moe.num_experts, 4);
  EXPECT_EQ(c.moe.experts_per_token, 2);
  EXPECT_EQ(c.moe.expert_intermediate_size, 12);
  EXPECT_TRUE(c.moe.norm_topk_prob);  // the softmax over the k largest logits
  EXPECT_TRUE(c.moe.gating.router_bias && c.moe.gating.gpt_oss_experts);
  EXPECT_EQ(c.moe.gating.swiglu_alpha, 1.702);
  EXPECT_EQ(c.moe.gating.swiglu_limit, 7.0);
  EXPECT_EQ(router_aux_loss_coefficient(c, -1), 0.0);  // output_router_logits off

  // transformers' GptOssConfig defaults: layers alternate starting with a sliding one, window 128,
  // 4 experts per token, attention biases on, aux coefficient 0.9, eps 1e-5, rope_theta 150000.
  nlohmann::json j = tiny_gpt_oss().config_json();
  for (const char* key : {"layer_types", "sliding_window", "attention_bias", "num_experts_per_tok",
                          "router_aux_loss_coef", "swiglu_limit", "rms_norm_eps", "rope_theta"})
    j.erase(key);
  j["num_hidden_layers"] = 3;
  j["num_local_experts"] = 8;
  j["output_router_logits"] = true;
  const ModelConfig d = ModelConfig::from_json(j, "defaults");
  EXPECT_EQ(d.attention_spec(0).window, 128);
  EXPECT_EQ(d.attention_spec(1).window, 0);
  EXPECT_EQ(d.attention_spec(2).window, 128);
  EXPECT_TRUE(d.qkv_bias && d.o_bias);
  EXPECT_EQ(d.moe.experts_per_token, 4);
  EXPECT_EQ(router_aux_loss_coefficient(d, -1), 0.9);
  EXPECT_EQ(d.rms_norm_eps, 1e-5);
  EXPECT_EQ(d.rope.theta, 150000.0);

  nlohmann::json bad = tiny_gpt_oss().config_json();
  bad["swiglu_limit"] = 10.0;
  EXPECT_NE(error_of(bad).find("swiglu_limit 10 differs from the 7.0"), std::string::npos) << error_of(bad);
  bad = tiny_gpt_oss().config_json();
  bad["layer_types"] = {"sliding_attention", "linear_attention"};
  EXPECT_NE(error_of(bad).find("layer type \"linear_attention\" is not one of gpt_oss's"), std::string::npos)
      << error_of(bad);
  bad = tiny_gpt_oss().config_json();
  bad.erase("num_local_experts");
  EXPECT_NE(error_of(bad).find("gpt_oss needs \"num_local_experts\""), std::string::npos) << error_of(bad);
  bad = tiny_gpt_oss().config_json();
  bad["num_experts_per_tok"] = 5;
  EXPECT_NE(error_of(bad).find("num_experts_per_tok 5 is more than num_local_experts 4"), std::string::npos)
      << error_of(bad);
}

TEST(GptOssWeights, TensorsAsTransformersNamesThemAndLoraOnAttentionOnly) {
  auto be = make_cpu_backend(1);
  const ModelConfig c = tiny_gpt_oss().config();
  ModelWeights w = ModelWeights::random(*be, c, DType::F32, 1);
  const std::string p = "model.layers.1.";
  EXPECT_EQ(w.find(p + "self_attn.sinks")->value.shape(), (Shape{4}));
  EXPECT_EQ(w.find(p + "self_attn.q_proj.bias")->value.shape(), (Shape{32}));
  EXPECT_EQ(w.find(p + "self_attn.o_proj.bias")->value.shape(), (Shape{32}));
  EXPECT_EQ(w.find(p + "mlp.router.weight")->value.shape(), (Shape{4, 32}));
  EXPECT_EQ(w.find(p + "mlp.router.bias")->value.shape(), (Shape{4}));
  EXPECT_EQ(w.find(p + "mlp.experts.3.gate_up_proj.weight")->value.shape(), (Shape{24, 32}));
  EXPECT_EQ(w.find(p + "mlp.experts.3.gate_up_proj.bias")->value.shape(), (Shape{24}));
  EXPECT_EQ(w.find(p + "mlp.experts.3.down_proj.weight")->value.shape(), (Shape{32, 12}));
  EXPECT_EQ(w.find(p + "mlp.experts.3.down_proj.bias")->value.shape(), (Shape{32}));
  EXPECT_EQ(w.find(p + "mlp.gate.weight"), nullptr);
  std::map<std::string, Shape> packed;
  for (const PackedTensor& t : w.packed_tensors()) packed.emplace(t.name, t.shape);
  EXPECT_EQ(packed.at(p + "mlp.experts.gate_up_proj"), (Shape{4, 32, 24}));
  EXPECT_EQ(packed.at(p + "mlp.experts.gate_up_proj_bias"), (Shape{4, 24}));
  EXPECT_EQ(packed.at(p + "mlp.experts.down_proj"), (Shape{4, 12, 32}));
  EXPECT_EQ(packed.at(p + "mlp.experts.down_proj_bias"), (Shape{4, 32}));

  const std::vector<std::string> projections = w.projection_names();
  EXPECT_EQ(projections, (std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}));
  for (const std::vector<std::string>& targets :
       std::vector<std::vector<std::string>>{{"experts"}, {"q_proj", "experts.gate_up_proj"}}) {
    ModelWeights again = ModelWeights::random(*be, c, DType::F32, 1);
    std::string message = "accepted";
    try {
      again.add_lora(*be, {.rank = 2, .alpha = 4.0, .targets = targets}, 3);
    } catch (const Error& e) {
      message = e.what();
    }
    EXPECT_NE(message.find("LoRA on gpt_oss's routed experts is not supported"), std::string::npos) << message;
    EXPECT_NE(message.find("--lora-targets q_proj,k_proj,v_proj,o_proj"), std::string::npos) << message;
  }
}

TEST(Mxfp4, CodesAndScalesDequantiseToTheValuesWorkedOutByHand) {
  // Codes 0–15 are ±{0, 0.5, 1, 1.5, 2, 3, 4, 6}, code 8 being −0.
  const float expected_codes[16] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6, -0.0f, -0.5f, -1, -1.5f, -2, -3, -4, -6};
  for (uint8_t code = 0; code < 16; ++code) {
    EXPECT_EQ(mxfp4_code_value(code), expected_codes[code]) << int(code);
    EXPECT_EQ(std::signbit(mxfp4_code_value(code)), code >= 8) << int(code);
  }
  // Two rows of one block each. Row 0, scale 128 (×2): byte 0 = 0x71 holds element 0 (code 1:
  // 0.5·2 = 1) low and element 1 (code 7: 6·2 = 12) high; byte 1 = 0xF9: element 2 code 9 (−1),
  // element 3 code 15 (−12); the other bytes 0x00. Row 1, scale 124 (×1/8): byte 15 = 0x2C: element
  // 30 code 12 (−2/8 = −0.25), element 31 code 2 (1/8 = 0.125).
  std::vector<uint8_t> blocks(32, 0);
  blocks[0] = 0x71;
  blocks[1] = 0xF9;
  blocks[16 + 15] = 0x2C;
  const std::vector<uint8_t> scales = {128, 124};
  const std::vector<float> values = dequantize_mxfp4(blocks.data(), scales.data(), 2, 1);
  ASSERT_EQ(values.size(), 64u);
  std::vector<float> expected(64, 0.0f);
  expected[0] = 1.0f;
  expected[1] = 12.0f;
  expected[2] = -1.0f;
  expected[3] = -12.0f;
  expected[32 + 30] = -0.25f;
  expected[32 + 31] = 0.125f;
  EXPECT_EQ(values, expected);
  // Far scales: 2^-127 (0.5·2^-127 is an F32 subnormal) and 2^123. Byte 0x17: code 7 (6) low,
  // code 1 (0.5) high.
  const std::vector<uint8_t> one_block = {0x17, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0};
  for (const auto& [scale, factor] : {std::pair<uint8_t, float>{0, 0x1p-127f}, {250, 0x1p123f}}) {
    const std::vector<float> v = dequantize_mxfp4(one_block.data(), &scale, 1, 1);
    EXPECT_EQ(v[0], 6.0f * factor) << int(scale);
    EXPECT_EQ(v[1], 0.5f * factor) << int(scale);
  }
}

TEST(GptOssWeights, FusedAndMxfp4CheckpointsLoadTheSameModelAndExportFused) {
  io::testing::ScratchDir scratch;
  TinyModel m = tiny_gpt_oss();
  m.hidden_size = 64;  // MXFP4 blocks of 32 along the input dims: H and I multiples of 32
  m.intermediate_size = 32;
  m.num_heads = 4;
  m.head_dim = 16;
  const nlohmann::json config = m.config_json();
  write_model_folder(scratch.path() / "fused", config, 4, 1.0, {.fused_experts = true});
  write_model_folder(scratch.path() / "per_expert", config, 4, 1.0, {.fused_experts = false});
  const io::Checkpoint fused((scratch.path() / "fused").string());
  ASSERT_NE(fused.find("model.layers.0.mlp.experts.gate_up_proj"), nullptr);
  EXPECT_EQ(fused.find("model.layers.0.mlp.experts.gate_up_proj")->shape, (Shape{4, 64, 64}));
  EXPECT_EQ(fused.find("model.layers.0.mlp.experts.0.gate_up_proj.weight"), nullptr);
  auto be = make_cpu_backend(1);
  const ModelConfig c = ModelConfig::from_json(config, "config.json");
  ModelWeights a = ModelWeights::load(*be, c, fused, DType::F32);
  ModelWeights b = ModelWeights::load(*be, c, io::Checkpoint((scratch.path() / "per_expert").string()), DType::F32);
  ASSERT_EQ(a.parameters().size(), b.parameters().size());
  for (size_t i = 0; i < a.parameters().size(); ++i)
    EXPECT_EQ(to_host(*be, a.parameters()[i].value), to_host(*be, b.parameters()[i].value)) << a.parameters()[i].name;
  // gate_up_proj [E, H, 2I] is each expert's [2I, H] transposed: element [e, h, j] is row j, column h.
  const std::vector<double> stored = to_host(*be, io::load_tensor(*be, *fused.find("model.layers.0.mlp.experts.gate_up_proj"), DType::F64));
  const std::vector<double> expert2 = to_host(*be, a.find("model.layers.0.mlp.experts.2.gate_up_proj.weight")->value);
  for (int64_t j = 0; j < 64; j += 7)
    for (int64_t h = 0; h < 64; h += 5)
      EXPECT_EQ(stored[static_cast<size_t>((2 * 64 + h) * 64 + j)], expert2[static_cast<size_t>(j * 64 + h)]) << j << "," << h;

  // The same experts as MXFP4 blocks: codes drawn at random, one scale per block of 32 inputs.
  std::mt19937_64 rng(5);
  io::NamedTensors mx;
  std::map<std::string, std::vector<float>> dequantised;  // [E, out, in] per fused tensor
  const io::Checkpoint& source = fused;
  for (const std::string& layer : {std::string("model.layers.0."), std::string("model.layers.1.")}) {
    for (const auto& [name, out, in] : {std::tuple<std::string, int64_t, int64_t>{"gate_up_proj", 64, 64}, {"down_proj", 64, 32}}) {
      const int64_t rows = 4 * out, groups = in / 32;
      std::vector<uint8_t> blocks(static_cast<size_t>(rows * groups * 16)), scales(static_cast<size_t>(rows * groups));
      for (uint8_t& byte : blocks) byte = static_cast<uint8_t>(rng());
      for (uint8_t& s : scales) s = static_cast<uint8_t>(120 + rng() % 10);
      Tensor tb = be->empty(Shape{4, out, groups, 16}, DType::U8), ts = be->empty(Shape{4, out, groups}, DType::U8);
      be->copy_from_host(be->default_stream(), blocks.data(), tb);
      be->copy_from_host(be->default_stream(), scales.data(), ts);
      const std::string key = layer + "mlp.experts." + name;
      mx.emplace_back(key + "_blocks", tb);
      mx.emplace_back(key + "_scales", ts);
      dequantised[key] = dequantize_mxfp4(blocks.data(), scales.data(), rows, groups);
    }
  }
  for (const std::string& name : source.names())
    if (!name.ends_with("gate_up_proj") && !name.ends_with("down_proj"))
      mx.emplace_back(name, io::load_tensor(*be, *source.find(name), DType::F32));
  std::filesystem::create_directories(scratch.path() / "mxfp4");
  nlohmann::json quantized = config;
  quantized["quantization_config"] = {{"quant_method", "mxfp4"}, {"modules_to_not_convert", {"model.layers.*.self_attn"}}};
  write_config(scratch.path() / "mxfp4", quantized);
  io::write_safetensors((scratch.path() / "mxfp4" / "model.safetensors").string(), mx, *be, {{"format", "pt"}});
  const ModelConfig qc = ModelConfig::from_file((scratch.path() / "mxfp4").string());
  ModelWeights q = ModelWeights::load(*be, qc, io::Checkpoint((scratch.path() / "mxfp4").string()), DType::F32);
  for (const std::string& layer : {std::string("model.layers.0."), std::string("model.layers.1.")})
    for (int64_t e = 0; e < 4; ++e) {
      const std::vector<float>& gu = dequantised.at(layer + "mlp.experts.gate_up_proj");
      const std::vector<float>& dn = dequantised.at(layer + "mlp.experts.down_proj");
      const std::vector<double> want_gu(gu.begin() + e * 64 * 64, gu.begin() + (e + 1) * 64 * 64);
      const std::vector<double> want_dn(dn.begin() + e * 64 * 32, dn.begin() + (e + 1) * 64 * 32);
      const std::string expert = layer + "mlp.experts." + std::to_string(e) + ".";
      EXPECT_EQ(to_host(*be, q.find(expert + "gate_up_proj.weight")->value), want_gu) << expert;
      EXPECT_EQ(to_host(*be, q.find(expert + "down_proj.weight")->value), want_dn) << expert;
      EXPECT_EQ(to_host(*be, q.find(expert + "gate_up_proj.bias")->value),
                to_host(*be, a.find(expert + "gate_up_proj.bias")->value)) << expert;
    }
}

TEST(WholeModelGradients, GptOssSinksWindowsBiasedExpertsAndTheLoadBalancingLoss) {
  auto be = make_cpu_backend(1);
  ModelWeights w = gradcheck_model(*be, 5);
  w.train_all(*be);
  check_gradients(w, *be, 0.9);
}

TEST(WholeModelGradients, GptOssAttentionLoraWithNonzeroB) {
  auto be = make_cpu_backend(1);
  ModelWeights w = gradcheck_model(*be, 7);
  add_lora_with_random_b(*be, w, {.rank = 2, .alpha = 4.0, .targets = {"q_proj", "k_proj", "v_proj", "o_proj"}}, 3,
                         uniform_draw(0.5));
  check_gradients(w, *be, 0.0);
}
