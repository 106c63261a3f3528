#include <gtest/gtest.h>

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

TEST(ModelConfig, RejectsWhatItCannotRunWithAClearMessage) {
  json j = base();
  j["model_type"] = "mistral";
  EXPECT_NE(error_of(j).find("model_type \"mistral\" is not supported"), std::string::npos);
  j = base();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  EXPECT_NE(error_of(j).find("RoPE scaling \"yarn\" is not supported"), std::string::npos);
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
