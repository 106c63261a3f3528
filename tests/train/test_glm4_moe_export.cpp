// A glm4_moe checkpoint as the released GLM-4.5 ones are laid out: per-expert routed experts, the
// routers' e_score_correction_bias in F32, and a multi-token-prediction layer after the last
// (model.layers.{num_hidden_layers}.…). Training never loads the MTP layer; a saved full fine-tune
// keeps the experts per expert, the correction biases as read (F32, even in a BF16 export, as
// transformers keeps them), and carries the MTP layer over byte for byte.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <random>

#include "backend/op_test_util.h"
#include "io/checkpoint.h"
#include "io/io_test_util.h"
#include "io/load_tensor.h"
#include "support/tiny_model.h"
#include "train/export.h"

using namespace spindle;
using namespace spindle::test;
namespace fs = std::filesystem;

namespace {

// The MTP layer of a 3-layer model, a few of its tensors in dtypes of their own.
io::NamedTensors mtp_layer(Backend& cpu) {
  std::mt19937_64 rng(9);
  io::NamedTensors out;
  out.emplace_back("model.layers.3.eh_proj.weight", random_tensor(cpu, Shape{32, 64}, DType::BF16, rng));
  out.emplace_back("model.layers.3.enorm.weight", random_tensor(cpu, Shape{32}, DType::BF16, rng));
  out.emplace_back("model.layers.3.mlp.gate.e_score_correction_bias", random_tensor(cpu, Shape{8}, DType::F32, rng));
  out.emplace_back("model.layers.3.mlp.experts.0.gate_proj.weight", random_tensor(cpu, Shape{12, 32}, DType::BF16, rng));
  out.emplace_back("model.layers.3.shared_head.head.weight", random_tensor(cpu, Shape{64, 32}, DType::BF16, rng));
  return out;
}

std::vector<unsigned char> bytes_of(const io::TensorRecord& record) {
  const auto* p = static_cast<const unsigned char*>(record.data);
  return {p, p + record.bytes};
}

}  // namespace

TEST(Glm4MoeCheckpoint, AFullExportKeepsTheBiasesAndCarriesTheMtpLayer) {
  io::testing::ScratchDir scratch;
  const fs::path source = scratch.path() / "GLM-tiny";
  auto cpu = make_cpu_backend(1);
  const io::NamedTensors carried = mtp_layer(*cpu);
  write_model_folder(source, tiny_glm4_moe().config_json(), 3, 1.0, {.fused_experts = false, .extra = carried});
  const ModelConfig config = ModelConfig::from_file(source.string());
  const io::Checkpoint in(source.string());
  ModelWeights weights = ModelWeights::load(*cpu, config, in, DType::F32);
  for (const auto& [name, tensor] : carried) EXPECT_EQ(weights.find(name), nullptr) << name << " was loaded";
  weights.train_all(*cpu);
  for (Parameter& p : weights.parameters())  // "trained": every trainable weight moves, the buffers stay
    if (p.trainable) cpu->scale(cpu->default_stream(), p.value, 1.5);

  for (const DType dtype : {DType::F32, DType::BF16}) {
    const fs::path exported = scratch.path() / ("out_" + std::string(dtype_name(dtype)));
    save_hf_model(*cpu, weights, source, exported, {.dtype = dtype});
    const io::Checkpoint out(exported.string());
    for (const auto& [name, tensor] : carried) {
      const io::TensorRecord* record = out.find(name);
      ASSERT_NE(record, nullptr) << name << " was not carried over";
      EXPECT_EQ(record->dtype, tensor.dtype()) << name;
      EXPECT_EQ(bytes_of(*record), bytes_of(in.require(name, tensor.shape()))) << name;
    }
    // The routers' correction biases: F32 and as read, whatever the export dtype.
    for (const std::string layer : {"1", "2"}) {
      const std::string name = "model.layers." + layer + ".mlp.gate.e_score_correction_bias";
      const io::TensorRecord* record = out.find(name);
      ASSERT_NE(record, nullptr) << name;
      EXPECT_EQ(record->dtype, DType::F32) << name;
      EXPECT_EQ(bytes_of(*record), bytes_of(in.require(name, Shape{8}))) << name;
    }
    EXPECT_EQ(out.find("model.layers.2.self_attn.q_proj.weight")->dtype, dtype);
    EXPECT_NE(out.find("model.layers.1.mlp.experts.7.down_proj.weight"), nullptr);  // per expert, as read
    EXPECT_EQ(out.find("model.layers.1.mlp.experts.gate_up_proj"), nullptr);
    EXPECT_NE(out.find("model.layers.2.mlp.shared_experts.down_proj.weight"), nullptr);
    EXPECT_EQ(out.names().size(), in.names().size());  // nothing dropped, nothing added
    if (dtype != DType::F32) continue;
    ModelWeights again = ModelWeights::load(*cpu, ModelConfig::from_file(exported.string()), out, DType::F32);
    for (const Parameter& p : weights.parameters())
      EXPECT_EQ(to_host(*cpu, again.find(p.name)->value), to_host(*cpu, p.value)) << p.name;
  }
}
