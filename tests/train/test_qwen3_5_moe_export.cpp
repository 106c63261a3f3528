// A Qwen3.5-MoE / Qwen3.6 checkpoint (Qwen3_5MoeForConditionalGeneration, the released layout: fused
// routed experts, a vision tower, multi-token-prediction heads): spindle trains the text tower and a
// saved full fine-tune keeps the experts in the layout it read and carries model.visual.* and mtp.*
// over byte for byte; a text-only per-expert folder is saved per expert. Both build on a backend
// that models a GPU (every op of their layers has a CUDA kernel).
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/op_test_util.h"
#include "io/checkpoint.h"
#include "io/io_test_util.h"
#include "plan/dry_backend.h"
#include "support/tiny_model.h"
#include "train/export.h"

using namespace spindle;
using namespace spindle::test;
namespace fs = std::filesystem;

namespace {

// Tensors outside the text tower, in dtypes of their own; Qwen3.5's MTP layer stores its experts
// per expert, as the released checkpoints do.
io::NamedTensors vision_and_mtp(Backend& cpu) {
  std::mt19937_64 rng(9);
  io::NamedTensors out;
  out.emplace_back("model.visual.blocks.0.attn.qkv.weight", random_tensor(cpu, Shape{12, 4}, DType::BF16, rng));
  out.emplace_back("model.visual.merger.linear_fc2.weight", random_tensor(cpu, Shape{32, 16}, DType::F32, rng));
  out.emplace_back("mtp.fc.weight", random_tensor(cpu, Shape{32, 64}, DType::BF16, rng));
  out.emplace_back("mtp.layers.0.mlp.experts.0.gate_proj.weight", random_tensor(cpu, Shape{12, 32}, DType::BF16, rng));
  out.emplace_back("mtp.layers.0.mlp.shared_expert_gate.weight", random_tensor(cpu, Shape{1, 32}, DType::BF16, rng));
  return out;
}

std::vector<unsigned char> bytes_of(const io::TensorRecord& record) {
  const auto* p = static_cast<const unsigned char*>(record.data);
  return {p, p + record.bytes};
}

// Loads `source`, trains every weight (scaled: "trained"), saves a full model to `exported` and
// checks the text tower reads back equal. Returns the weights.
void train_and_export(Backend& cpu, const fs::path& source, const fs::path& exported) {
  const ModelConfig config = ModelConfig::from_file(source.string());
  ModelWeights weights = ModelWeights::load(cpu, config, io::Checkpoint(source.string()), DType::F32);
  weights.train_all(cpu);
  for (Parameter& p : weights.parameters()) cpu.scale(cpu.default_stream(), p.value, 1.5);
  save_hf_model(cpu, weights, source, exported, {.dtype = DType::F32});
  const io::Checkpoint out(exported.string());
  ModelWeights again = ModelWeights::load(cpu, ModelConfig::from_file(exported.string()), out, DType::F32);
  for (const Parameter& p : weights.parameters())
    EXPECT_EQ(to_host(cpu, again.find(p.name)->value), to_host(cpu, p.value)) << p.name;
}

}  // namespace

TEST(Qwen35MoeCheckpoint, AFullExportKeepsTheFusedExpertsAndCarriesVisionAndMtp) {
  io::testing::ScratchDir scratch;
  const fs::path source = scratch.path() / "Qwen3.6-tiny", exported = scratch.path() / "out";
  auto cpu = make_cpu_backend(1);
  const io::NamedTensors carried = vision_and_mtp(*cpu);
  write_model_folder(source, multimodal_config_json(tiny_qwen3_5_moe()), 3, 1.0,
                     {.fused_experts = true, .extra = carried});
  train_and_export(*cpu, source, exported);

  const io::Checkpoint out(exported.string()), in(source.string());
  for (const auto& [name, tensor] : carried) {
    const io::TensorRecord* record = out.find(name);
    ASSERT_NE(record, nullptr) << name << " was not carried over";
    EXPECT_EQ(record->dtype, tensor.dtype()) << name;
    EXPECT_EQ(bytes_of(*record), bytes_of(in.require(name, tensor.shape()))) << name;
  }
  // The released layout, as read: fused routed experts, no per-expert tensors.
  const std::string mlp = "model.language_model.layers.2.mlp.";
  ASSERT_NE(out.find(mlp + "experts.gate_up_proj"), nullptr);
  EXPECT_EQ(out.find(mlp + "experts.gate_up_proj")->shape, (Shape{4, 24, 32}));
  EXPECT_EQ(out.find(mlp + "experts.down_proj")->shape, (Shape{4, 32, 12}));
  EXPECT_EQ(out.find(mlp + "experts.0.gate_proj.weight"), nullptr);
  EXPECT_NE(out.find(mlp + "shared_expert.up_proj.weight"), nullptr);
  EXPECT_NE(out.find(mlp + "shared_expert_gate.weight"), nullptr);
  EXPECT_EQ(out.names().size(), in.names().size());  // nothing dropped, nothing added
  nlohmann::json written;
  std::ifstream(exported / "config.json") >> written;
  EXPECT_EQ(written["model_type"], "qwen3_5_moe");
  EXPECT_TRUE(written.contains("vision_config"));
  EXPECT_EQ(written["text_config"]["shared_expert_intermediate_size"], 16);
}

TEST(Qwen35MoeCheckpoint, ATextOnlyPerExpertFolderIsSavedPerExpert) {
  io::testing::ScratchDir scratch;
  const fs::path source = scratch.path() / "text", exported = scratch.path() / "out";
  auto cpu = make_cpu_backend(1);
  write_model_folder(source, tiny_qwen3_5_moe().config_json(), 5, 1.0, {.fused_experts = false});
  train_and_export(*cpu, source, exported);
  const io::Checkpoint out(exported.string());
  EXPECT_NE(out.find("model.layers.0.mlp.experts.3.down_proj.weight"), nullptr);
  EXPECT_EQ(out.find("model.layers.0.mlp.experts.gate_up_proj"), nullptr);
  EXPECT_EQ(out.names().size(), io::Checkpoint(source.string()).names().size());
}

TEST(Qwen35MoeBackends, BuiltOnABackendThatModelsAGpu) {
  // spindle plan's backend, standing for CUDA: the shared expert's gate, the routed experts, gated
  // DeltaNet and gated attention all have CUDA kernels, so the family is no longer refused there.
  plan::DryBackend gpu(Device{DeviceKind::CUDA, 0}, 512);
  for (const ModelConfig& config : {tiny_qwen3_5_moe().config(),
                                    ModelConfig::from_json(multimodal_config_json(tiny_qwen3_5_moe()), "multimodal")})
    EXPECT_NO_THROW(ModelWeights::random(gpu, config, DType::BF16, 1)) << config.model_type;
}
