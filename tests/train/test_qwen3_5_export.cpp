// A Qwen3.5 multimodal checkpoint (Qwen3_5ForConditionalGeneration): spindle reads its text tower
// (model.language_model.*, the config's text_config) and a saved full fine-tune carries the tensors
// it never trains — the vision tower and the multi-token-prediction heads — over byte for byte. Both
// layouts are refused on a GPU backend until the CUDA kernels of their layers exist.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "backend/op_test_util.h"
#include "io/checkpoint.h"
#include "io/io_test_util.h"
#include "io/write_safetensors.h"
#include "plan/dry_backend.h"
#include "support/tiny_model.h"
#include "train/export.h"

using namespace spindle;
using namespace spindle::test;
namespace fs = std::filesystem;

namespace {

nlohmann::json multimodal_config() {
  nlohmann::json text = tiny_qwen3_5().config_json();
  text["model_type"] = "qwen3_5_text";
  text.erase("architectures");
  return {{"model_type", "qwen3_5"},
          {"architectures", {"Qwen3_5ForConditionalGeneration"}},
          {"tie_word_embeddings", false},
          {"image_token_id", 60},
          {"text_config", text},
          {"vision_config", {{"model_type", "qwen3_5_vision"}, {"depth", 1}, {"hidden_size", 4}}}};
}

// Tensors outside the text tower, in dtypes of their own: what the export must not touch.
io::NamedTensors vision_and_mtp(Backend& cpu) {
  std::mt19937_64 rng(5);
  io::NamedTensors out;
  out.emplace_back("model.visual.blocks.0.attn.qkv.weight", random_tensor(cpu, Shape{12, 4}, DType::BF16, rng));
  out.emplace_back("model.visual.patch_embed.proj.weight", random_tensor(cpu, Shape{4, 3, 2, 2, 2}, DType::F32, rng));
  out.emplace_back("mtp.fc.weight", random_tensor(cpu, Shape{32, 64}, DType::BF16, rng));
  return out;
}

std::vector<unsigned char> bytes_of(const io::TensorRecord& record) {
  const auto* p = static_cast<const unsigned char*>(record.data);
  return {p, p + record.bytes};
}

}  // namespace

TEST(Qwen35MultimodalCheckpoint, TrainsTheTextTowerAndCarriesTheRestIntoAFullExport) {
  io::testing::ScratchDir scratch;
  const fs::path source = scratch.path() / "Qwen3.5-tiny", exported = scratch.path() / "out";
  fs::create_directories(source);
  {
    std::ofstream(source / "config.json") << multimodal_config().dump(2);
    std::ofstream(source / "tokenizer_config.json") << "{}";
  }
  auto cpu = make_cpu_backend(1);
  const ModelConfig config = ModelConfig::from_file(source.string());
  ASSERT_EQ(config.weight_prefix, "model.language_model.");
  io::NamedTensors tensors = vision_and_mtp(*cpu);
  const io::NamedTensors carried = tensors;
  {
    ModelWeights source_weights = random_weights(*cpu, config, DType::F32, 3);
    for (const Parameter& p : source_weights.parameters()) tensors.emplace_back(p.name, p.value);
    io::write_safetensors((source / "model.safetensors").string(), tensors, *cpu, {{"format", "pt"}});
  }

  // The text tower loads by its own names; the vision and MTP tensors are left alone.
  ModelWeights weights = ModelWeights::load(*cpu, config, io::Checkpoint(source.string()), DType::F32);
  ASSERT_NE(weights.find("model.language_model.layers.0.linear_attn.in_proj_qkv.weight"), nullptr);
  EXPECT_EQ(weights.find("mtp.fc.weight"), nullptr);
  weights.train_all(*cpu);
  for (Parameter& p : weights.parameters()) cpu->scale(cpu->default_stream(), p.value, 1.5);  // "trained"

  save_hf_model(*cpu, weights, source, exported, {.dtype = DType::F32});
  const io::Checkpoint out(exported.string());
  for (const auto& [name, tensor] : carried) {
    const io::TensorRecord* record = out.find(name);
    ASSERT_NE(record, nullptr) << name << " was not carried over";
    EXPECT_EQ(record->dtype, tensor.dtype()) << name;
    EXPECT_EQ(record->shape, tensor.shape()) << name;
    EXPECT_EQ(bytes_of(*record), bytes_of(io::Checkpoint(source.string()).require(name, tensor.shape()))) << name;
  }
  // The trained text tower, under its multimodal names; the config keeps both sections.
  const ModelConfig reread = ModelConfig::from_file(exported.string());
  ModelWeights again = ModelWeights::load(*cpu, reread, out, DType::F32);
  for (const Parameter& p : weights.parameters())
    EXPECT_EQ(to_host(*cpu, again.find(p.name)->value), to_host(*cpu, p.value)) << p.name;
  EXPECT_EQ(out.names().size(), weights.parameters().size() + carried.size());
  nlohmann::json written;
  std::ifstream(exported / "config.json") >> written;
  EXPECT_TRUE(written.contains("vision_config"));
  EXPECT_EQ(written["text_config"]["layer_types"], multimodal_config()["text_config"]["layer_types"]);
}

TEST(Qwen35Backends, BuiltOnABackendThatModelsAGpu) {
  // spindle plan's backend, standing for CUDA: the gated DeltaNet and gated attention ops have CUDA
  // kernels, so the family is no longer refused there (sequence parallelism still is).
  plan::DryBackend gpu(Device{DeviceKind::CUDA, 0}, 512);
  for (const ModelConfig& config : {tiny_qwen3_5().config(), ModelConfig::from_json(multimodal_config(), "multimodal")})
    EXPECT_NO_THROW(ModelWeights::random(gpu, config, DType::BF16, 1)) << config.model_type;
}
