// Loading weights and adapters that do not fit the model: each failure names what is wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/write_safetensors.h"
#include "model/weights.h"
#include "support/tiny_model.h"

using namespace spindle;
namespace fs = std::filesystem;

namespace {

fs::path copy_case(const std::string& name) {
  const fs::path src = fs::path(SPINDLE_SOURCE_DIR) / "testdata/hf" / name;
  const fs::path dst = fs::temp_directory_path() / fmt::format("spindle-load-errors-{}-{}", name, getpid());
  fs::remove_all(dst);
  fs::copy(src, dst, fs::copy_options::recursive);
  return dst;
}

void edit_json(const fs::path& path, const std::function<void(nlohmann::json&)>& change) {
  nlohmann::json j;
  std::ifstream(path) >> j;
  change(j);
  std::ofstream(path) << j.dump(1);
}

std::string load_error(const fs::path& model, const fs::path& adapter = {}) {
  auto be = make_cpu_backend();
  try {
    ModelWeights w = ModelWeights::load(*be, ModelConfig::from_file(model.string()), io::Checkpoint(model.string()), DType::F32);
    if (!adapter.empty()) w.load_peft_adapter(*be, adapter.string());
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

}  // namespace

TEST(LoadErrors, ConfigThatDoesNotMatchTheWeightsNamesTheTensorAndShapes) {
  const fs::path dir = copy_case("qwen2");
  edit_json(dir / "config.json", [](nlohmann::json& j) { j["intermediate_size"] = 128; });
  const std::string e = load_error(dir);
  EXPECT_NE(e.find("mlp.gate_proj.weight"), std::string::npos) << e;
  EXPECT_NE(e.find("[128, 64]"), std::string::npos) << e;
  EXPECT_NE(e.find("[96, 64]"), std::string::npos) << e;
  fs::remove_all(dir);
}

TEST(LoadErrors, UntiedModelWithoutLmHeadIsMissingATensor) {
  const fs::path dir = copy_case("qwen2");  // saved tied: no lm_head.weight in the file
  edit_json(dir / "config.json", [](nlohmann::json& j) { j["tie_word_embeddings"] = false; });
  EXPECT_NE(load_error(dir).find("lm_head.weight"), std::string::npos);
  fs::remove_all(dir);
}

TEST(LoadErrors, UnsupportedAdapterSettingsAreRefused) {
  const fs::path dir = copy_case("qwen2_lora");
  for (auto [key, value, needle] : std::vector<std::tuple<std::string, nlohmann::json, std::string>>{
           {"use_dora", true, "use_dora = true is not supported"},
           {"bias", "all", "bias = \"all\" is not supported"},
           {"target_modules", nlohmann::json::array({"q_proj", "lm_head"}), "LoRA target \"lm_head\" is not supported"},
           {"modules_to_save", nlohmann::json::array({"embed_tokens"}), "modules_to_save is not supported"}}) {
    const fs::path adapter = dir / ("adapter-" + key);
    fs::copy(dir / "adapter", adapter, fs::copy_options::recursive);
    edit_json(adapter / "adapter_config.json", [&](nlohmann::json& j) { j[key] = value; });
    EXPECT_NE(load_error(dir, adapter).find(needle), std::string::npos) << key << ": " << load_error(dir, adapter);
  }
  // An adapter of another rank than its config says: the tensor shapes give it away.
  const fs::path wrong_rank = dir / "adapter-rank";
  fs::copy(dir / "adapter", wrong_rank, fs::copy_options::recursive);
  edit_json(wrong_rank / "adapter_config.json", [](nlohmann::json& j) { j["r"] = 8; });
  EXPECT_NE(load_error(dir, wrong_rank).find("lora_A.weight"), std::string::npos);
  EXPECT_NE(load_error(dir, dir / "nonexistent").find("cannot open"), std::string::npos);
  fs::remove_all(dir);
}

TEST(LoadErrors, MixtureOfExpertsConfigsAndCheckpoints) {
  using spindle::test::tiny_qwen3_moe;
  auto config_error = [](const nlohmann::json& extra) {
    spindle::test::TinyModel m = tiny_qwen3_moe();
    m.extra.update(extra);
    try {
      m.config();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(config_error({{"num_experts_per_tok", 5}}).find("num_experts_per_tok 5 is more than num_experts 4"),
            std::string::npos)
      << config_error({{"num_experts_per_tok", 5}});
  EXPECT_NE(config_error({{"mlp_only_layers", {3}}}).find("not a layer of this 3-layer model"), std::string::npos);
  EXPECT_NE(config_error({{"num_experts", nullptr}}).find("qwen3_moe needs \"num_experts\""), std::string::npos);
  EXPECT_NE(config_error({{"decoder_sparse_step", 0}}).find("decoder_sparse_step"), std::string::npos);

  // A checkpoint missing one expert's tensor: the error names it.
  const fs::path dir = fs::temp_directory_path() / fmt::format("spindle-load-errors-moe-{}", getpid());
  fs::remove_all(dir);
  spindle::test::write_model_folder(dir, tiny_qwen3_moe(), 3);
  auto be = make_cpu_backend(1);
  io::NamedTensors kept;
  {
    io::Checkpoint file((dir / "model.safetensors").string());
    ModelWeights w = ModelWeights::load(*be, ModelConfig::from_file(dir.string()), file, DType::F32);
    for (const Parameter& p : w.parameters())
      if (p.name != "model.layers.2.mlp.experts.3.up_proj.weight") kept.emplace_back(p.name, p.value);
  }
  io::write_safetensors((dir / "model.safetensors").string(), kept, *be, {{"format", "pt"}});
  const std::string e = load_error(dir);
  EXPECT_NE(e.find("model.layers.2.mlp.experts.3.up_proj.weight"), std::string::npos) << e;
  fs::remove_all(dir);
}
