// The tiny test models on disk: a folder written by write_model_folder loads, through the same
// config.json and safetensors readers as a Hugging Face checkout, as the model it was written from
// (every config field, every tensor bit for bit), for each family's features.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>

#include "backend/op_test_util.h"
#include "io/checkpoint.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;
namespace fs = std::filesystem;

namespace {

void expect_same_config(const ModelConfig& got, const ModelConfig& want) {
  EXPECT_EQ(got.model_type, want.model_type);
  EXPECT_EQ(got.vocab_size, want.vocab_size);
  EXPECT_EQ(got.hidden_size, want.hidden_size);
  EXPECT_EQ(got.intermediate_size, want.intermediate_size);
  EXPECT_EQ(got.num_layers, want.num_layers);
  EXPECT_EQ(got.num_heads, want.num_heads);
  EXPECT_EQ(got.num_kv_heads, want.num_kv_heads);
  EXPECT_EQ(got.head_dim, want.head_dim);
  EXPECT_EQ(got.max_position_embeddings, want.max_position_embeddings);
  EXPECT_EQ(got.rms_norm_eps, want.rms_norm_eps);
  EXPECT_EQ(got.tie_word_embeddings, want.tie_word_embeddings);
  EXPECT_EQ(got.qkv_bias, want.qkv_bias);
  EXPECT_EQ(got.o_bias, want.o_bias);
  EXPECT_EQ(got.qk_norm, want.qk_norm);
  EXPECT_EQ(got.rope.type, want.rope.type);
  EXPECT_EQ(got.rope.theta, want.rope.theta);
  EXPECT_EQ(got.moe.num_experts, want.moe.num_experts);
  EXPECT_EQ(got.moe.experts_per_token, want.moe.experts_per_token);
  EXPECT_EQ(got.moe.expert_intermediate_size, want.moe.expert_intermediate_size);
  EXPECT_EQ(got.moe.norm_topk_prob, want.moe.norm_topk_prob);
  EXPECT_EQ(got.layer_kinds, want.layer_kinds);
}

class TinyModelFolder : public ::testing::TestWithParam<TinyModel> {};

}  // namespace

TEST_P(TinyModelFolder, LoadsAsTheModelItWasWrittenFrom) {
  const TinyModel model = GetParam();
  const fs::path dir = fs::temp_directory_path() / fmt::format("spindle-tiny-model-{}-{}", model.model_type, getpid());
  fs::remove_all(dir);
  write_model_folder(dir, model, 5, 10.0);

  auto be = make_cpu_backend(1);
  const ModelConfig config = ModelConfig::from_file(dir.string());
  expect_same_config(config, model.config());
  const ModelWeights want = random_weights(*be, model.config(), DType::F32, 5, 10.0);
  const ModelWeights got = ModelWeights::load(*be, config, io::Checkpoint(dir.string()), DType::F32);
  ASSERT_EQ(got.parameters().size(), want.parameters().size());
  for (size_t i = 0; i < want.parameters().size(); ++i) {
    const Parameter &g = got.parameters()[i], &w = want.parameters()[i];
    EXPECT_EQ(g.name, w.name);
    EXPECT_TRUE(to_host(*be, g.value) == to_host(*be, w.value)) << w.name;
  }
  fs::remove_all(dir);
}

TEST(TinyModel, FamilyFeaturesFollowTheModelType) {
  const ModelConfig llama = TinyModel{}.config(), qwen2 = TinyModel{.model_type = "qwen2"}.config(),
                    qwen3 = TinyModel{.model_type = "qwen3"}.config();
  EXPECT_FALSE(llama.qkv_bias || llama.qk_norm);
  EXPECT_TRUE(qwen2.qkv_bias && !qwen2.qk_norm);
  EXPECT_TRUE(qwen3.qk_norm && !qwen3.qkv_bias);
  // `extra` keys reach config.json, and override the fields' keys.
  const ModelConfig biased = TinyModel{.extra = {{"attention_bias", true}, {"rope_theta", 500.0}}}.config();
  EXPECT_TRUE(biased.qkv_bias && biased.o_bias);
  EXPECT_EQ(biased.rope.theta, 500.0);
  // qwen3_moe: qwen3's attention, MoE feed-forwards but on mlp_only_layers.
  const ModelConfig moe = tiny_qwen3_moe().config();
  EXPECT_TRUE(moe.qk_norm && !moe.qkv_bias);
  EXPECT_EQ(moe.layer_kind(0).feed_forward, FeedForwardKind::MixtureOfExperts);
  EXPECT_EQ(moe.layer_kind(1).feed_forward, FeedForwardKind::SwiGLU);
  EXPECT_EQ(moe.layer_kind(2).feed_forward, FeedForwardKind::MixtureOfExperts);
  EXPECT_EQ(moe.moe.num_experts, 4);
  EXPECT_EQ(moe.moe.experts_per_token, 2);
  EXPECT_TRUE(moe.moe.norm_topk_prob);
}

INSTANTIATE_TEST_SUITE_P(Families, TinyModelFolder,
                         ::testing::Values(TinyModel{}, TinyModel{.model_type = "qwen2", .tie_word_embeddings = true},
                                           TinyModel{.model_type = "qwen3", .head_dim = 6}, tiny_qwen3_moe(),
                                           tiny_glm4_moe()),
                         [](const auto& info) { return info.param.model_type; });
