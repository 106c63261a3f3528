#include <gtest/gtest.h>

#include <algorithm>

#include <cmath>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config.h"

using namespace spindle;
using nlohmann::json;

namespace {
json base() {
  return json{{"model_type", "llama"},        {"vocab_size", 32},         {"hidden_size", 16},
              {"intermediate_size", 24},      {"num_hidden_layers", 2},   {"num_attention_heads", 4},
              {"num_key_value_heads", 2},     {"rms_norm_eps", 1e-5},     {"rope_theta", 10000.0}};
}

std::string error_of(const json& j) {
  try {
    ModelConfig::from_json(j, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}
}  // namespace

TEST(ModelConfig, ReadsBothRopeSpellings) {
  json v4 = base();
  v4["rope_theta"] = 500000.0;
  v4["rope_scaling"] = {{"type", "linear"}, {"factor", 4.0}};
  ModelConfig a = ModelConfig::from_json(v4, "v4");
  json v5 = base();
  v5.erase("rope_theta");
  v5["rope_parameters"] = {{"rope_type", "linear"}, {"factor", 4.0}, {"rope_theta", 500000.0}};
  ModelConfig b = ModelConfig::from_json(v5, "v5");
  EXPECT_EQ(a.rope.type, "linear");
  EXPECT_EQ(b.rope.type, "linear");
  EXPECT_EQ(a.rope.theta, 500000.0);
  EXPECT_EQ(b.rope.theta, 500000.0);
  EXPECT_EQ(rope_inverse_frequencies(a), rope_inverse_frequencies(b));
  json nested = base();
  nested["rope_parameters"] = {{"full_attention", {{"rope_type", "default"}, {"rope_theta", 1e6}}}};
  EXPECT_EQ(ModelConfig::from_json(nested, "nested").rope.theta, 1e6);
  json null_scaling = base();
  null_scaling["rope_scaling"] = nullptr;
  EXPECT_EQ(ModelConfig::from_json(null_scaling, "null").rope.type, "default");
}

TEST(ModelConfig, ArchitectureFlagsFollowModelType) {
  json q2 = base();
  q2["model_type"] = "qwen2";
  ModelConfig c2 = ModelConfig::from_json(q2, "q2");
  EXPECT_TRUE(c2.qkv_bias);
  EXPECT_FALSE(c2.o_bias);
  json q3 = base();
  q3["model_type"] = "qwen3";
  q3["head_dim"] = 8;
  ModelConfig c3 = ModelConfig::from_json(q3, "q3");
  EXPECT_TRUE(c3.qk_norm);
  EXPECT_EQ(c3.q_dim(), 32);
  EXPECT_EQ(ModelConfig::from_json(base(), "l").head_dim, 4);
}

TEST(ModelConfig, Llama3ScalingKeepsHighFrequenciesAndSlowsLowOnes) {
  json j = base();
  j["head_dim"] = 16;
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                       {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 64}};
  ModelConfig c = ModelConfig::from_json(j, "l3");
  json plain = j;
  plain.erase("rope_scaling");
  auto scaled = rope_inverse_frequencies(c), orig = rope_inverse_frequencies(ModelConfig::from_json(plain, "p"));
  EXPECT_EQ(scaled[0], orig[0]);                      // wavelength 2π < 16: unchanged
  EXPECT_FLOAT_EQ(scaled.back(), orig.back() / 8.0f);  // wavelength > 64: divided by factor
}

// transformers' MistralConfig: a window of 4096 when the key is absent, none when it is null, the
// given one otherwise, on every layer; the scale stays 1/√head_dim.
TEST(ModelConfig, MistralSlidesEveryLayerAsTransformersDefaultsIt) {
  json j = base();
  j["model_type"] = "mistral";
  j["head_dim"] = 24;
  ModelConfig absent = ModelConfig::from_json(j, "absent");
  ASSERT_EQ(absent.attention_specs.size(), static_cast<size_t>(absent.num_layers));
  for (int64_t l = 0; l < absent.num_layers; ++l) {
    EXPECT_EQ(absent.attention_spec(l).window, 4096);
    EXPECT_DOUBLE_EQ(absent.attention_spec(l).scale, 1.0 / std::sqrt(24.0));
  }
  EXPECT_FALSE(absent.qkv_bias || absent.o_bias);
  j["sliding_window"] = nullptr;
  EXPECT_EQ(ModelConfig::from_json(j, "null").attention_spec(0).window, 0);
  j["sliding_window"] = 5;
  EXPECT_EQ(ModelConfig::from_json(j, "five").attention_spec(1).window, 5);
  j["sliding_window"] = -3;
  EXPECT_NE(error_of(j).find("\"sliding_window\" must be a positive integer"), std::string::npos);
}

// YaRN as transformers 5.17 computes it, on gpt-oss's released values (d 64, θ 150000, factor 32,
// original 4096, untruncated): the blend's bounds 8.09 and 17.40, attention factor 1.3465736.
TEST(ModelConfig, YarnBlendsFrequenciesAsTransformersDoes) {
  json j = base();
  j["hidden_size"] = 256;
  j["num_attention_heads"] = 4;
  j["num_key_value_heads"] = 4;
  j["head_dim"] = 64;
  j["max_position_embeddings"] = 131072;
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"rope_theta", 150000.0}, {"factor", 32.0},
                          {"beta_fast", 32.0}, {"beta_slow", 1.0}, {"truncate", false},
                          {"original_max_position_embeddings", 4096}};
  const ModelConfig c = ModelConfig::from_json(j, "gpt-oss rope");
  EXPECT_NEAR(c.rope.attention_factor, 1.3465736, 1e-7);
  const std::vector<float> inv = rope_inverse_frequencies(c);
  ASSERT_EQ(inv.size(), 32u);
  const double low = 64 * std::log(4096 / (32 * 2 * M_PI)) / (2 * std::log(150000.0));
  const double high = 64 * std::log(4096 / (1 * 2 * M_PI)) / (2 * std::log(150000.0));
  EXPECT_NEAR(low, 8.0928, 1e-4);
  EXPECT_NEAR(high, 17.3980, 1e-4);
  for (int i = 0; i < 32; ++i) {
    const double original = std::pow(150000.0, -2.0 * i / 64), ramp = std::clamp((i - low) / (high - low), 0.0, 1.0);
    const double want = ramp * original / 32 + (1 - ramp) * original;
    EXPECT_NEAR(inv[i], want, 2e-6 * want) << i;
  }
  // The defaults: truncated bounds, attention factor 0.1·ln(factor) + 1; a missing factor is the ratio
  // of the windows; mscale over mscale_all_dim when both are given.
  j["rope_parameters"] = {{"rope_type", "yarn"}, {"original_max_position_embeddings", 4096}};
  const ModelConfig defaults = ModelConfig::from_json(j, "defaults");
  EXPECT_DOUBLE_EQ(defaults.rope.factor, 32.0);
  EXPECT_TRUE(defaults.rope.truncate);
  EXPECT_DOUBLE_EQ(defaults.rope.attention_factor, 0.1 * std::log(32.0) + 1);
  j["rope_parameters"]["mscale"] = 1.0;
  j["rope_parameters"]["mscale_all_dim"] = 0.5;
  EXPECT_DOUBLE_EQ(ModelConfig::from_json(j, "mscale").rope.attention_factor,
                   (0.1 * std::log(32.0) + 1) / (0.05 * std::log(32.0) + 1));
}

// Per-layer-type RoPE (transformers 5): the sliding layers' own settings become sliding_rope.
TEST(ModelConfig, SlidingLayersMayHaveTheirOwnRope) {
  json j = base();
  j["rope_parameters"] = {{"full_attention", {{"rope_type", "linear"}, {"rope_theta", 1e6}, {"factor", 8.0}}},
                          {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 1e4}}}};
  const ModelConfig c = ModelConfig::from_json(j, "two ropes");
  EXPECT_EQ(c.rope.type, "linear");
  ASSERT_TRUE(c.sliding_rope.has_value());
  EXPECT_EQ(c.sliding_rope->theta, 1e4);
  j["rope_parameters"]["chunked_attention"] = {{"rope_type", "default"}, {"rope_theta", 5.0}};
  EXPECT_NE(error_of(j).find("layer type \"chunked_attention\""), std::string::npos);
}

TEST(ModelConfig, RejectsWhatItCannotRunWithAClearMessage) {
  json j = base();
  j["model_type"] = "falcon";
  EXPECT_NE(error_of(j).find("model_type \"falcon\" is not supported"), std::string::npos);
  j = base();
  j["rope_scaling"] = {{"rope_type", "proportional"}, {"factor", 4.0}};
  EXPECT_NE(error_of(j).find("RoPE scaling \"proportional\" is not supported"), std::string::npos);
  j = base();
  j.erase("hidden_size");
  EXPECT_NE(error_of(j).find("missing \"hidden_size\""), std::string::npos);
  j = base();
  j["num_key_value_heads"] = 3;
  EXPECT_NE(error_of(j).find("not a multiple of num_key_value_heads 3"), std::string::npos);
  j = base();
  j["hidden_act"] = "gelu";
  EXPECT_NE(error_of(j).find("hidden_act \"gelu\" is not supported"), std::string::npos);
  j = base();
  j["use_sliding_window"] = true;
  EXPECT_NE(error_of(j).find("use_sliding_window"), std::string::npos);
  j = base();
  j["vocab_size"] = "many";
  EXPECT_NE(error_of(j).find("\"vocab_size\" must be a positive integer"), std::string::npos);
  EXPECT_THROW(ModelConfig::from_file("/nonexistent/model"), Error);
}

TEST(ModelConfig, Qwen3NextFusesTheDeltaNetProjectionsAndPlacesExpertsByStep) {
  json j = base();
  j["model_type"] = "qwen3_next";
  j["num_hidden_layers"] = 4;
  j["head_dim"] = 8;
  j["layer_types"] = {"linear_attention", "full_attention", "linear_attention", "full_attention"};
  j["linear_num_key_heads"] = 2;
  j["linear_num_value_heads"] = 4;
  j["linear_key_head_dim"] = 8;
  j["linear_value_head_dim"] = 8;
  j["num_experts"] = 4;
  j["num_experts_per_tok"] = 2;
  j["moe_intermediate_size"] = 8;
  j["shared_expert_intermediate_size"] = 12;
  j["decoder_sparse_step"] = 2;
  j["mlp_only_layers"] = {3};
  ModelConfig c = ModelConfig::from_json(j, "next");
  EXPECT_TRUE(c.linear_attention.fused_projections);
  EXPECT_TRUE(c.moe.norm_topk_prob);  // transformers' default for this family
  EXPECT_DOUBLE_EQ(c.rope.partial_rotary_factor, 0.25);
  // Layers 1 and 3 are every 2nd; 3 is listed dense: only layer 1 routes.
  const FeedForwardKind moe = FeedForwardKind::MixtureOfExperts, dense = FeedForwardKind::SwiGLU;
  ASSERT_EQ(c.layer_kinds.size(), 4u);
  EXPECT_EQ(c.layer_kinds[0].feed_forward, dense);
  EXPECT_EQ(c.layer_kinds[1].feed_forward, moe);
  EXPECT_EQ(c.layer_kinds[2].feed_forward, dense);
  EXPECT_EQ(c.layer_kinds[3].feed_forward, dense);
  EXPECT_EQ(c.layer_kinds[0].mixer, MixerKind::GatedDeltaNet);
  j["norm_topk_prob"] = false;
  EXPECT_FALSE(ModelConfig::from_json(j, "next").moe.norm_topk_prob);
  j["mlp_only_layers"] = {7};
  EXPECT_NE(error_of(j).find("mlp_only_layers"), std::string::npos);
}
