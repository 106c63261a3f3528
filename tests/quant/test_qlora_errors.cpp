// Bad 4-bit input: every refusal names what is wrong and what to do (docs/qlora.md, "What is refused").
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>

#include "backend/backend.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/load_tensor.h"
#include "io/write_safetensors.h"
#include "model/weights.h"
#include "train/train_config.h"

namespace spindle {
namespace {

namespace fs = std::filesystem;
const std::string kSaved = "qwen2_nf4_dq_saved";  // nf4, double quantisation, uint8 storage
const std::string kQ = "model.layers.0.self_attn.q_proj.weight";

std::string case_dir(const std::string& name) { return std::string(SPINDLE_SOURCE_DIR) + "/testdata/hf/" + name; }

// A copy of a reference folder whose model.safetensors `change` edits (tensors on the host, in
// their file dtype) and whose config.json `change_config` edits.
class Folder {
 public:
  explicit Folder(const std::string& name) : dir_(fs::temp_directory_path() / ("spindle_qlora_" + std::to_string(++count_) + "_" + std::to_string(::getpid()))) {
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(case_dir(name) + "/" + f, dir_ / f);
  }
  ~Folder() { fs::remove_all(dir_); }
  std::string path() const { return dir_.string(); }

  void edit_tensors(const std::function<void(io::NamedTensors&)>& change) {
    auto host = make_cpu_backend();
    io::NamedTensors tensors;
    {
      io::Checkpoint file(path());
      for (const std::string& name : file.names()) {
        const io::TensorRecord* rec = file.find(name);
        tensors.emplace_back(name, io::load_tensor(*host, *rec, rec->dtype));
      }
    }
    change(tensors);
    io::write_safetensors((dir_ / "model.safetensors").string(), tensors, *host, {{"format", "pt"}});
  }
  void edit_quant_state(const std::string& weight, const std::function<void(nlohmann::json&)>& change) {
    edit_tensors([&](io::NamedTensors& tensors) {
      for (auto& [name, t] : tensors) {
        if (name != weight + ".quant_state.bitsandbytes__nf4") continue;
        nlohmann::json j = nlohmann::json::parse(std::string(t.data_as<char>(), t.bytes()));
        change(j);
        const std::string text = j.dump();
        t = make_cpu_backend()->empty(Shape{static_cast<int64_t>(text.size())}, DType::U8);
        std::memcpy(t.data(), text.data(), text.size());
      }
    });
  }
  void edit_config(const std::function<void(nlohmann::json&)>& change) {
    nlohmann::json j = nlohmann::json::parse(std::ifstream(dir_ / "config.json"));
    change(j);
    std::ofstream(dir_ / "config.json") << j.dump(2);
  }

 private:
  static inline int count_ = 0;
  fs::path dir_;
};

std::string load_error(const std::string& dir, const QuantizeOptions& quantize = {}) {
  auto be = make_cpu_backend();
  try {
    ModelWeights::load(*be, ModelConfig::from_file(dir), io::Checkpoint(dir), DType::F32, quantize);
  } catch (const Error& e) {
    return e.what();
  }
  return "(loaded)";
}

TEST(QloraErrors, TheUnchangedCopyLoads) {
  Folder f(kSaved);
  EXPECT_EQ(load_error(f.path()), "(loaded)");
}

TEST(QloraErrors, QuantStateBlocksizeThatDoesNotMatchTheAbsmax) {
  Folder f(kSaved);
  f.edit_quant_state(kQ, [](nlohmann::json& j) { j["blocksize"] = 128; });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("q_proj.weight.absmax is U8 [64], expected U8 with 32 elements"), std::string::npos) << e;
}

TEST(QloraErrors, QuantStateBlocksizeThatBitsandbytesNeverWrites) {
  Folder f(kSaved);
  f.edit_quant_state(kQ, [](nlohmann::json& j) { j["blocksize"] = 48; });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("corrupt or mismatched quant_state: blocksize 48 is not 32"), std::string::npos) << e;
}

TEST(QloraErrors, QuantStateShapeOfAnotherProjection) {
  Folder f(kSaved);
  f.edit_quant_state(kQ, [](nlohmann::json& j) { j["shape"] = {32, 64}; });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("its shape is not [64, 64], the q_proj projection"), std::string::npos) << e;
}

TEST(QloraErrors, QuantStateDtypeThatIsNotAFloat) {
  Folder f(kSaved);
  f.edit_quant_state(kQ, [](nlohmann::json& j) { j["dtype"] = "int8"; });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("dtype \"int8\" is not float32, bfloat16 or float16"), std::string::npos) << e;
}

TEST(QloraErrors, QuantStateThatIsNotJson) {
  Folder f(kSaved);
  f.edit_tensors([](io::NamedTensors& tensors) {
    for (auto& [name, t] : tensors)
      if (name == kQ + ".quant_state.bitsandbytes__nf4") std::memset(t.data(), '{', t.bytes());
  });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("quant_state is not valid JSON"), std::string::npos) << e;
}

TEST(QloraErrors, QuantStateWithoutTheDoubleQuantisationTheConfigDeclares) {
  Folder f(kSaved);
  f.edit_quant_state(kQ, [](nlohmann::json& j) { j.erase("nested_blocksize"); });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("does not use double quantisation, config.json's bnb_4bit_use_double_quant is true"),
            std::string::npos)
      << e;
}

TEST(QloraErrors, AbsmaxOfTheWrongDtype) {
  Folder f(kSaved);
  f.edit_tensors([](io::NamedTensors& tensors) {
    for (auto& [name, t] : tensors)
      if (name == kQ + ".absmax") {
        Tensor wide = make_cpu_backend()->empty(t.shape(), DType::F32);
        make_cpu_backend()->copy(Stream{}, t, wide);
        t = wide;
      }
  });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("q_proj.weight.absmax is F32 [64], expected U8"), std::string::npos) << e;
}

TEST(QloraErrors, PackedDataOfTheWrongSize) {
  Folder f(kSaved);
  f.edit_tensors([](io::NamedTensors& tensors) {
    for (auto& [name, t] : tensors)
      if (name == kQ) t = t.flat(0, t.numel() - 2);
  });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("2046 bytes of packed 4-bit data"), std::string::npos) << e;
}

TEST(QloraErrors, AQuantMapThatIsNotTheStandardTable) {
  Folder f(kSaved);
  f.edit_tensors([](io::NamedTensors& tensors) {
    for (auto& [name, t] : tensors)
      if (name == kQ + ".quant_map") t.data_as<float>()[3] = 0.5f;
  });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("quant_map entry 3 is 0.5"), std::string::npos) << e;
}

TEST(QloraErrors, AMissingQuantStateTensor) {
  Folder f(kSaved);
  f.edit_tensors([](io::NamedTensors& tensors) {
    std::erase_if(tensors, [](const auto& nt) { return nt.first == kQ + ".nested_absmax"; });
  });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("q_proj.weight.nested_absmax is missing"), std::string::npos) << e;
}

TEST(QloraErrors, QuantisedTensorsTheConfigDoesNotDescribe) {
  Folder f(kSaved);
  f.edit_config([](nlohmann::json& j) { j.erase("quantization_config"); });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("is bitsandbytes 4-bit data, but config.json has no quantization_config"), std::string::npos) << e;
}

TEST(QloraErrors, AQuantisedTensorForNoProjectionOfTheModel) {
  Folder f(kSaved);
  f.edit_tensors([](io::NamedTensors& tensors) {
    for (auto& [name, t] : std::vector<std::pair<std::string, Tensor>>(tensors))
      if (name.rfind(kQ, 0) == 0)
        tensors.emplace_back("model.layers.0.self_attn.extra_proj" + name.substr(std::string(kQ).size() - 7), t);
  });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("quantises model.layers.0.self_attn.extra_proj.weight, which this model does not hold"),
            std::string::npos)
      << e;
}

TEST(QloraErrors, ATypeOtherThanTheConfigs) {
  Folder f(kSaved);
  f.edit_config([](nlohmann::json& j) { j["quantization_config"]["bnb_4bit_quant_type"] = "fp4"; });
  const std::string e = load_error(f.path());
  EXPECT_NE(e.find("is stored as nf4 but config.json's quantization_config says fp4"), std::string::npos) << e;
}

TEST(QloraErrors, EightBitAndOtherMethodsAreRefused) {
  Folder f(kSaved);
  f.edit_config([](nlohmann::json& j) {
    j["quantization_config"]["load_in_8bit"] = true;
    j["quantization_config"]["load_in_4bit"] = false;
  });
  EXPECT_NE(load_error(f.path()).find("an 8-bit (LLM.int8) checkpoint"), std::string::npos);
  f.edit_config([](nlohmann::json& j) { j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}}; });
  EXPECT_NE(load_error(f.path()).find("quant_method \"gptq\" is not supported"), std::string::npos);
}

TEST(QloraErrors, QuantiseFlagsOnAPrequantisedFolder) {
  Folder f(kSaved);
  const std::string e = load_error(f.path(), parse_quantize_options("nf4", false, 64));
  EXPECT_NE(e.find("is already quantised by bitsandbytes (nf4, double quantisation); it loads as stored: drop "
                   "--quantize"),
            std::string::npos)
      << e;
}

TEST(QloraErrors, BadFlagCombinations) {
  auto error = [](const std::string& q, bool dq, int64_t bs) -> std::string {
    try {
      parse_quantize_options(q, dq, bs);
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(error("int4", false, 64).find("--quantize int4"), std::string::npos);
  EXPECT_NE(error("", true, 64).find("--double-quant quantises the absmax"), std::string::npos);
  EXPECT_NE(error("", false, 128).find("--quant-block-size is the block"), std::string::npos);
  EXPECT_NE(error("nf4", false, 96).find("--quant-block-size 96"), std::string::npos);
  EXPECT_EQ(error("nf4", true, 4096), "");

  TrainConfig c;
  c.model = case_dir("qwen2_nf4");
  c.data = {case_dir("qwen2_nf4") + "/data.jsonl"};
  c.output = "/tmp/unused";
  c.full = true;
  c.quantize = "nf4";
  try {
    c.validate();
    ADD_FAILURE() << "--full with --quantize validated";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--quantize with --full"), std::string::npos) << e.what();
  }
}

TEST(QloraErrors, FullFineTuningOfAPrequantisedModel) {
  auto be = make_cpu_backend();
  const std::string dir = case_dir(kSaved);
  ModelWeights w = ModelWeights::load(*be, ModelConfig::from_file(dir), io::Checkpoint(dir), DType::F32);
  try {
    w.train_all(*be);
    ADD_FAILURE() << "train_all on 4-bit weights";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("full fine-tuning needs dense weights"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace spindle
