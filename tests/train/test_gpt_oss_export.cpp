// A gpt_oss checkpoint with transformers' [E, in, out] experts: a saved full fine-tune keeps that
// layout (each expert's matrix transposed back, the biases [E, out]) and reads back equal.
#include <gtest/gtest.h>

#include <filesystem>

#include "backend/op_test_util.h"
#include "io/checkpoint.h"
#include "io/io_test_util.h"
#include "io/load_tensor.h"
#include "support/tiny_model.h"
#include "train/export.h"

using namespace spindle;
using namespace spindle::test;
namespace fs = std::filesystem;

TEST(GptOssCheckpoint, AFullExportKeepsTransformersExpertLayout) {
  io::testing::ScratchDir scratch;
  const fs::path source = scratch.path() / "gpt-oss-tiny", exported = scratch.path() / "out";
  auto cpu = make_cpu_backend(1);
  write_model_folder(source, tiny_gpt_oss().config_json(), 3, 1.0, {.fused_experts = true, .extra = {}});
  const ModelConfig config = ModelConfig::from_file(source.string());
  ModelWeights weights = ModelWeights::load(*cpu, config, io::Checkpoint(source.string()), DType::F32);
  weights.train_all(*cpu);
  for (Parameter& p : weights.parameters()) cpu->scale(cpu->default_stream(), p.value, 1.5);
  save_hf_model(*cpu, weights, source, exported, {.dtype = DType::F32});

  const io::Checkpoint out(exported.string());
  const std::string mlp = "model.layers.1.mlp.";
  ASSERT_NE(out.find(mlp + "experts.gate_up_proj"), nullptr);
  EXPECT_EQ(out.find(mlp + "experts.gate_up_proj")->shape, (Shape{4, 32, 24}));
  EXPECT_EQ(out.find(mlp + "experts.gate_up_proj_bias")->shape, (Shape{4, 24}));
  EXPECT_EQ(out.find(mlp + "experts.down_proj")->shape, (Shape{4, 12, 32}));
  EXPECT_EQ(out.find(mlp + "experts.down_proj_bias")->shape, (Shape{4, 32}));
  EXPECT_EQ(out.find(mlp + "experts.0.gate_up_proj.weight"), nullptr);
  EXPECT_NE(out.find(mlp + "router.bias"), nullptr);
  // Element [e, h, j] of gate_up_proj is row j, column h of expert e's [2I, H] projection.
  const std::vector<double> stored =
      to_host(*cpu, io::load_tensor(*cpu, *out.find(mlp + "experts.gate_up_proj"), DType::F64));
  const std::vector<double> expert3 = to_host(*cpu, weights.find(mlp + "experts.3.gate_up_proj.weight")->value);
  for (int64_t j = 0; j < 24; ++j)
    for (int64_t h = 0; h < 32; h += 3)
      EXPECT_EQ(stored[static_cast<size_t>((3 * 32 + h) * 24 + j)], expert3[static_cast<size_t>(j * 32 + h)]);
  ModelWeights again = ModelWeights::load(*cpu, ModelConfig::from_file(exported.string()), out, DType::F32);
  for (const Parameter& p : weights.parameters())
    EXPECT_EQ(to_host(*cpu, again.find(p.name)->value), to_host(*cpu, p.value)) << p.name;
}
