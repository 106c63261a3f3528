// Loading weights and adapters that do not fit the model: each failure names what is wrong.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/checkpoint.h"
#include "model/weights.h"

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
