// Training outputs: PEFT adapter folders and HF model folders, read back through spindle's own
// loaders, checked field by field against what PEFT and transformers write, swapped in atomically,
// and parsed by the Python safetensors library. PythonStackCases also writes the folders that
// scripts/gpu/check_exports.py loads with transformers and peft on the GPU host.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>

#include "backend/op_test_util.h"
#include "io/checkpoint.h"
#include "io/io_test_util.h"
#include "io/load_tensor.h"
#include "io/write_safetensors.h"
#include "model/batch.h"
#include "model/decoder.h"
#include "plan/dry_backend.h"
#include "support/tiny_model.h"
#include "train/export.h"

using namespace spindle;
using namespace spindle::test;
using io::testing::contains;
using io::testing::error_of;
using io::testing::read_bytes;
using io::testing::ScratchDir;
using io::testing::write_bytes;
namespace fs = std::filesystem;

namespace {

fs::path case_dir(const std::string& name) { return fs::path(SPINDLE_SOURCE_DIR) / "testdata/hf" / name; }

ModelWeights load_model(Backend& be, const fs::path& dir, DType dtype = DType::F32) {
  return ModelWeights::load(be, ModelConfig::from_file(dir.string()), io::Checkpoint(dir.string()), dtype);
}

// Every parameter moved by N(0, 0.02), norms included: an export of the unchanged source would pass
// a round trip even if it copied the source files instead of the trained weights.
void perturb(Backend& be, ModelWeights& w, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> noise(0.0, 0.02);
  for (Parameter& p : w.parameters()) {
    std::vector<double> v = to_host(be, p.value);
    for (double& x : v) x += noise(rng);
    from_host(be, v, p.value);
  }
}

// LoRA as add_lora makes it, with B random (PEFT starts B at zero, which would hide a swapped A/B).
void add_trained_lora(Backend& be, ModelWeights& w, const LoraConfig& lora, uint64_t seed) {
  add_lora_with_random_b(be, w, lora, seed, normal_draw(0.1));
}

LoraConfig lora_config(int64_t rank, double alpha, bool rslora, std::vector<std::string> targets) {
  LoraConfig c;
  c.rank = rank;
  c.alpha = alpha;
  c.rslora = rslora;
  c.targets = std::move(targets);
  return c;
}

// A fixed document every model of testdata/hf can read (vocab 96).
std::vector<int32_t> fixed_document(int64_t vocab) {
  std::vector<int32_t> ids;
  for (int32_t i = 0; i < 24; ++i) ids.push_back(static_cast<int32_t>((7 * i * i + 3 * i + 5) % vocab));
  return ids;
}

// Cross-entropy of each next-token prediction of one document, every position supervised.
std::vector<double> per_token_ce(Backend& be, ModelWeights& w, const std::vector<int32_t>& ids) {
  PackedRow row;
  const int32_t n = static_cast<int32_t>(ids.size());
  row.input_ids = ids;
  for (int32_t i = 0; i < n; ++i) {
    row.positions.push_back(i);
    row.doc_ids.push_back(0);
    row.targets.push_back(i + 1 < n ? ids[i + 1] : kIgnoreIndex);
    row.weights.push_back(i + 1 < n ? 1.0f : 0.0f);
  }
  MicroBatch batch = make_micro_batch(be, {row}, w.dtype);
  Decoder decoder(be, w);
  Tensor loss = be.zeros(Shape{1}, stat_dtype(w.dtype)), ce = be.empty(Shape{batch.num_selected}, DType::F32);
  decoder.step(batch, 1.0, loss, false, &ce);
  return to_host(be, ce);
}

nlohmann::json read_json(const fs::path& path) { return nlohmann::json::parse(read_bytes(path.string())); }

std::set<std::string> names_of(const io::Checkpoint& c) { return {c.names().begin(), c.names().end()}; }

std::vector<double> values_of(Backend& be, const io::Checkpoint& c, const std::string& name) {
  const io::TensorRecord* rec = c.find(name);
  EXPECT_NE(rec, nullptr) << name;
  return rec ? to_host(be, io::load_tensor(be, *rec, DType::F64)) : std::vector<double>{};
}

void expect_same_parameters(Backend& be, const ModelWeights& want, const ModelWeights& got) {
  ASSERT_EQ(want.parameters().size(), got.parameters().size());
  for (size_t i = 0; i < want.parameters().size(); ++i) {
    const Parameter& a = want.parameters()[i];
    const Parameter& b = got.parameters()[i];
    ASSERT_EQ(a.name, b.name);
    EXPECT_EQ(to_host(be, a.value), to_host(be, b.value)) << a.name;
  }
}

std::vector<std::string> leftover_staging_folders(const fs::path& parent) {
  std::vector<std::string> found;
  for (const auto& entry : fs::directory_iterator(parent)) {
    const std::string name = entry.path().filename().string();
    if (name.find(".tmp.") != std::string::npos || name.find(".old.") != std::string::npos) found.push_back(name);
  }
  return found;
}

// A model folder with tokenizer files (testdata/hf has none): qwen3's config and weights plus
// marker files whose bytes the export must reproduce.
fs::path make_source_with_tokenizer(const ScratchDir& scratch) {
  const fs::path src = scratch.path() / "source";
  fs::create_directories(src);
  fs::copy_file(case_dir("qwen3") / "config.json", src / "config.json");
  fs::copy_file(case_dir("qwen3") / "model.safetensors", src / "model.safetensors");
  write_bytes((src / "tokenizer.json").string(), "{\"model\": {\"type\": \"BPE\"}, \"marker\": 1}");
  write_bytes((src / "tokenizer_config.json").string(), "{\"model_max_length\": 512}");
  write_bytes((src / "special_tokens_map.json").string(), "{\"eos_token\": \"<|im_end|>\"}");
  write_bytes((src / "chat_template.jinja").string(), "{% for m in messages %}{{ m.content }}{% endfor %}");
  write_bytes((src / "generation_config.json").string(), "{\"do_sample\": false}");
  write_bytes((src / "vocab.json").string(), "{\"a\": 0}");
  write_bytes((src / "merges.txt").string(), "#version: 0.2\na b\n");
  write_bytes((src / "training_notes.txt").string(), "not part of a model");
  return src;
}

}  // namespace

// ---- PEFT adapters ------------------------------------------------------------------------------

TEST(PeftAdapterExport, LoadPeftAdapterReadsBackEveryTensorAndTheConfig) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights trained = load_model(*be, case_dir("qwen2"));
  add_trained_lora(*be, trained, lora_config(4, 8, false, {"q_proj", "v_proj", "down_proj"}), 11);
  const fs::path out = scratch.path() / "adapter";
  save_peft_adapter(*be, trained, out, "Qwen/Qwen2.5-0.5B");

  ModelWeights reloaded = load_model(*be, case_dir("qwen2"));
  reloaded.load_peft_adapter(*be, out.string());
  EXPECT_EQ(reloaded.lora.rank, 4);
  EXPECT_EQ(reloaded.lora.alpha, 8.0);
  EXPECT_FALSE(reloaded.lora.rslora);
  EXPECT_EQ(reloaded.lora.targets, (std::vector<std::string>{"q_proj", "v_proj", "down_proj"}));
  expect_same_parameters(*be, trained, reloaded);
  EXPECT_EQ(reloaded.layers[1].linear("down_proj")->lora_scaling, 2.0);
}

TEST(PeftAdapterExport, FileHoldsExactlyPeftNamesInF32WithPtMetadata) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights trained = load_model(*be, case_dir("qwen3"));
  add_trained_lora(*be, trained, lora_config(2, 4, false, {"q_proj", "gate_proj"}), 3);
  save_peft_adapter(*be, trained, scratch.path() / "a", "base");

  io::Checkpoint file((scratch.path() / "a/adapter_model.safetensors").string());
  std::set<std::string> want;
  for (int layer : {0, 1}) {
    for (const char* ab : {"lora_A", "lora_B"}) {
      want.insert(fmt::format("base_model.model.model.layers.{}.self_attn.q_proj.{}.weight", layer, ab));
      want.insert(fmt::format("base_model.model.model.layers.{}.mlp.gate_proj.{}.weight", layer, ab));
    }
  }
  EXPECT_EQ(names_of(file), want);
  for (const std::string& name : file.names()) EXPECT_EQ(file.find(name)->dtype, DType::F32) << name;
  const auto& metadata = file.files()[0]->metadata();
  ASSERT_TRUE(metadata.count("format"));
  EXPECT_EQ(metadata.at("format"), "pt");
  EXPECT_EQ(fs::directory_iterator(scratch.path() / "a") == fs::directory_iterator(), false);
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(scratch.path() / "a")) files.insert(e.path().filename().string());
  EXPECT_EQ(files, (std::set<std::string>{"adapter_config.json", "adapter_model.safetensors"}));
}

TEST(PeftAdapterExport, ConfigHasTheFieldsPeftWrites) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights trained = load_model(*be, case_dir("llama"));
  add_trained_lora(*be, trained, lora_config(8, 16, true, {"k_proj", "o_proj", "up_proj"}), 5);
  save_peft_adapter(*be, trained, scratch.path() / "a", "meta-llama/Llama-3.2-1B");
  const nlohmann::json j = read_json(scratch.path() / "a/adapter_config.json");
  EXPECT_EQ(j["peft_type"], "LORA");
  EXPECT_EQ(j["task_type"], "CAUSAL_LM");
  EXPECT_EQ(j["r"], 8);
  EXPECT_TRUE(j["lora_alpha"].is_number_integer());
  EXPECT_EQ(j["lora_alpha"], 16);
  EXPECT_EQ(j["lora_dropout"], 0.0);
  EXPECT_EQ(j["target_modules"], (nlohmann::json{"k_proj", "o_proj", "up_proj"}));
  EXPECT_EQ(j["use_rslora"], true);
  EXPECT_EQ(j["bias"], "none");
  EXPECT_EQ(j["fan_in_fan_out"], false);
  EXPECT_EQ(j["inference_mode"], true);
  EXPECT_EQ(j["base_model_name_or_path"], "meta-llama/Llama-3.2-1B");
  EXPECT_EQ(j["init_lora_weights"], true);
  EXPECT_TRUE(j["modules_to_save"].is_null());
  EXPECT_EQ(j["use_dora"], false);
  EXPECT_TRUE(j["rank_pattern"].is_object() && j["rank_pattern"].empty());
  EXPECT_TRUE(j["alpha_pattern"].is_object() && j["alpha_pattern"].empty());
  EXPECT_TRUE(j["layers_to_transform"].is_null());
}

TEST(PeftAdapterExport, NonIntegerAlphaIsWrittenAsANumberPeftReadsBack) {
  LoraConfig lora = lora_config(4, 12.5, false, {"q_proj"});
  const nlohmann::json j = nlohmann::json::parse(peft_adapter_config_json(lora, "x"));
  EXPECT_EQ(j["lora_alpha"].get<double>(), 12.5);
}

TEST(PeftAdapterExport, ReexportOfAPeftSavedAdapterMatchesPeftsFileAndConfig) {
  // testdata/hf/llama_rslora/adapter was written by peft 0.21: same tensor names, shapes and values,
  // and every config key spindle writes is one PEFT writes, with the same value where both describe
  // the adapter.
  const fs::path peft_dir = case_dir("llama_rslora") / "adapter";
  if (!fs::exists(peft_dir)) GTEST_SKIP() << "missing " << peft_dir;
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights w = load_model(*be, case_dir("llama_rslora"));
  w.load_peft_adapter(*be, peft_dir.string());
  save_peft_adapter(*be, w, scratch.path() / "a", "");

  io::Checkpoint theirs((peft_dir / "adapter_model.safetensors").string());
  io::Checkpoint ours((scratch.path() / "a/adapter_model.safetensors").string());
  ASSERT_EQ(names_of(ours), names_of(theirs));
  for (const std::string& name : theirs.names()) {
    EXPECT_EQ(ours.find(name)->shape, theirs.find(name)->shape) << name;
    EXPECT_EQ(values_of(*be, ours, name), values_of(*be, theirs, name)) << name;
  }
  const nlohmann::json peft = read_json(peft_dir / "adapter_config.json");
  const nlohmann::json mine = read_json(scratch.path() / "a/adapter_config.json");
  for (const auto& [key, value] : mine.items()) {
    EXPECT_TRUE(peft.contains(key)) << "spindle writes \"" << key << "\", which peft 0.21 does not know";
    if (key == "base_model_name_or_path" || key == "task_type" || key == "auto_mapping" || key == "target_modules")
      continue;
    EXPECT_EQ(value, peft[key]) << key;
  }
  const auto targets = [](const nlohmann::json& t) { return std::set<std::string>(t.begin(), t.end()); };
  EXPECT_EQ(targets(mine["target_modules"]), targets(peft["target_modules"]));
}

TEST(PeftAdapterExport, ReexportOfPeftExpertAdaptersMatchesPeftsFileAndConfig) {
  // LoRA on the routed experts' fused tensors (target_parameters), written by peft 0.21 over a
  // per-expert qwen3_moe checkpoint and over the fused multimodal qwen3_5_moe: read into spindle's
  // per-expert layout and written back, every tensor is PEFT's bit for bit (B as [out, r·E]), and the
  // config names the same target_parameters.
  for (const char* name : {"qwen3_moe_expert_lora", "qwen3_5_moe_expert_lora"}) {
    SCOPED_TRACE(name);
    const fs::path peft_dir = case_dir(name) / "adapter";
    if (!fs::exists(peft_dir)) GTEST_SKIP() << "missing " << peft_dir;
    auto be = make_cpu_backend();
    ScratchDir scratch;
    ModelWeights w = load_model(*be, case_dir(name));
    w.load_peft_adapter(*be, peft_dir.string());
    int adapted = 0;
    for (const ExpertLora* lora : w.expert_loras()) adapted += lora->adapted();
    EXPECT_GE(adapted, 4);
    save_peft_adapter(*be, w, scratch.path() / "a", "");

    io::Checkpoint theirs((peft_dir / "adapter_model.safetensors").string());
    io::Checkpoint ours((scratch.path() / "a/adapter_model.safetensors").string());
    ASSERT_EQ(names_of(ours), names_of(theirs));
    for (const std::string& tensor : theirs.names()) {
      EXPECT_EQ(ours.find(tensor)->shape, theirs.find(tensor)->shape) << tensor;
      EXPECT_EQ(values_of(*be, ours, tensor), values_of(*be, theirs, tensor)) << tensor;
    }
    const nlohmann::json peft = read_json(peft_dir / "adapter_config.json");
    const nlohmann::json mine = read_json(scratch.path() / "a/adapter_config.json");
    EXPECT_EQ(mine["target_parameters"], peft["target_parameters"]);
    // PEFT writes target_modules from a set: its order changes from one run to the next.
    const auto as_set = [](const nlohmann::json& t) { return std::set<std::string>(t.begin(), t.end()); };
    EXPECT_EQ(as_set(mine["target_modules"]), as_set(peft["target_modules"]));
    // The references were made without a task type, so PEFT wrote auto_mapping for the text-only
    // class too; spindle writes CAUSAL_LM there, and auto_mapping for the multimodal class only.
    if (!w.config.multimodal_architecture.empty()) EXPECT_EQ(mine["auto_mapping"], peft["auto_mapping"]);
    for (const auto& [key, value] : mine.items()) {
      EXPECT_TRUE(peft.contains(key)) << "spindle writes \"" << key << "\", which peft 0.21 does not know";
      if (key == "base_model_name_or_path" || key == "task_type" || key == "auto_mapping" || key == "target_modules")
        continue;
      EXPECT_EQ(value, peft[key]) << key;
    }
  }
}

TEST(PeftAdapterExport, ExpertAdapterRoundTripsThroughSpindlesLayout) {
  // B is [E, out, r] in memory and [out, r·E] in the file (B_e's column j at j·E + e): a pair trained
  // here reads back to the same values and the same per-token cross-entropy. Only down_proj: one
  // ParamWrapper, no ".base_layer" in the names.
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights trained = load_model(*be, case_dir("qwen3_moe"));
  add_trained_lora(*be, trained, lora_config(3, 6, false, {"experts.down_proj", "o_proj"}), 17);
  save_peft_adapter(*be, trained, scratch.path() / "a", "base");
  io::Checkpoint file((scratch.path() / "a/adapter_model.safetensors").string());
  const io::TensorRecord* b = file.find("base_model.model.model.layers.0.mlp.experts.lora_B.weight");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->shape, (Shape{48, 3 * 4}));
  // Expert 1's B_e[5, 2] is the file's row 5, column 2·E + 1.
  const Parameter* ours = trained.find("base_model.model.model.layers.0.mlp.experts.lora_B.weight");
  ASSERT_NE(ours, nullptr);
  EXPECT_EQ(values_of(*be, file, b->name)[5 * 12 + 2 * 4 + 1], to_host(*be, ours->value)[(1 * 48 + 5) * 3 + 2]);
  const nlohmann::json config = read_json(scratch.path() / "a/adapter_config.json");
  EXPECT_EQ(config["target_parameters"], (nlohmann::json{"mlp.experts.down_proj"}));
  EXPECT_EQ(config["target_modules"], (nlohmann::json{"o_proj"}));

  ModelWeights reloaded = load_model(*be, case_dir("qwen3_moe"));
  reloaded.load_peft_adapter(*be, (scratch.path() / "a").string());
  expect_same_parameters(*be, trained, reloaded);
  const std::vector<int32_t> doc = fixed_document(trained.config.vocab_size);
  EXPECT_EQ(per_token_ce(*be, reloaded, doc), per_token_ce(*be, trained, doc));
}

TEST(PeftAdapterExport, Bf16AdapterHoldsTheRoundedValues) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights trained = load_model(*be, case_dir("qwen2"));
  add_trained_lora(*be, trained, lora_config(4, 8, false, {"o_proj"}), 7);
  save_peft_adapter(*be, trained, scratch.path() / "a", "base", DType::BF16);
  io::Checkpoint file((scratch.path() / "a/adapter_model.safetensors").string());
  for (const Parameter& p : trained.parameters()) {
    if (p.name.find("lora_") == std::string::npos) continue;
    ASSERT_NE(file.find(p.name), nullptr) << p.name;
    EXPECT_EQ(file.find(p.name)->dtype, DType::BF16);
    std::vector<double> want = to_host(*be, p.value);
    for (double& x : want) x = bf16_to_f32(f32_to_bf16(static_cast<float>(x)));
    EXPECT_EQ(values_of(*be, file, p.name), want) << p.name;
  }
}

TEST(PeftAdapterExport, ModelWithoutAdaptersIsAClearError) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights w = load_model(*be, case_dir("qwen2"));
  const std::string message = error_of([&] { save_peft_adapter(*be, w, scratch.path() / "a", "base"); });
  EXPECT_TRUE(contains(message, "no LoRA adapters"));
  EXPECT_TRUE(contains(message, "save_hf_model"));
  EXPECT_FALSE(fs::exists(scratch.path() / "a"));
  EXPECT_TRUE(leftover_staging_folders(scratch.path()).empty());
}

// ---- HF model folders ---------------------------------------------------------------------------

TEST(HfModelExport, ShardedF32ExportLoadsBackBitForBit) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights trained = load_model(*be, case_dir("qwen3"));
  perturb(*be, trained, 1);
  HfModelExportOptions options;
  options.dtype = DType::F32;
  options.max_shard_bytes = 64 << 10;
  const fs::path out = scratch.path() / "model";
  save_hf_model(*be, trained, case_dir("qwen3"), out, options);

  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  EXPECT_FALSE(fs::exists(out / "model.safetensors"));
  EXPECT_TRUE(fs::exists(out / "model-00001-of-00004.safetensors")) << "64 KiB shards of the ~220 KiB qwen3";
  ModelWeights reloaded = load_model(*be, out);
  expect_same_parameters(*be, trained, reloaded);

  // config.json: the source's, with only the dtype changed.
  nlohmann::json source = read_json(case_dir("qwen3") / "config.json"), saved = read_json(out / "config.json");
  EXPECT_EQ(saved["dtype"], "float32");
  source.erase("dtype");
  saved.erase("dtype");
  EXPECT_EQ(saved, source);
}

TEST(HfModelExport, Bf16IsTheDefaultAndEveryTensorIsRoundedToNearest) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights trained = load_model(*be, case_dir("llama"));
  perturb(*be, trained, 2);
  const fs::path out = scratch.path() / "model";
  save_hf_model(*be, trained, case_dir("llama"), out);
  EXPECT_EQ(read_json(out / "config.json")["dtype"], "bfloat16");
  ASSERT_TRUE(fs::exists(out / "model.safetensors"));
  io::Checkpoint saved(out.string());
  for (const Parameter& p : trained.parameters()) {
    ASSERT_NE(saved.find(p.name), nullptr) << p.name;
    EXPECT_EQ(saved.find(p.name)->dtype, DType::BF16) << p.name;
    std::vector<double> want = to_host(*be, p.value);
    for (double& x : want) x = bf16_to_f32(f32_to_bf16(static_cast<float>(x)));
    EXPECT_EQ(values_of(*be, saved, p.name), want) << p.name;
  }
}

TEST(HfModelExport, TorchDtypeOfOlderConfigsIsUpdatedToo) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  const fs::path src = scratch.path() / "source";
  fs::create_directories(src);
  nlohmann::ordered_json config = nlohmann::ordered_json::parse(read_bytes((case_dir("qwen2") / "config.json").string()));
  config["torch_dtype"] = "float32";
  write_bytes((src / "config.json").string(), config.dump(2));
  ModelWeights w = load_model(*be, case_dir("qwen2"));
  HfModelExportOptions options;
  options.dtype = DType::F16;
  save_hf_model(*be, w, src, scratch.path() / "out", options);
  const nlohmann::json saved = read_json(scratch.path() / "out/config.json");
  EXPECT_EQ(saved["dtype"], "float16");
  EXPECT_EQ(saved["torch_dtype"], "float16");
  EXPECT_EQ(io::Checkpoint((scratch.path() / "out").string()).find("model.norm.weight")->dtype, DType::F16);
}

TEST(HfModelExport, TiedHeadIsLeftOutAsTransformersSavesIt) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  HfModelExportOptions options;
  options.dtype = DType::F32;
  ModelWeights tied = load_model(*be, case_dir("qwen2"));  // tie_word_embeddings true
  save_hf_model(*be, tied, case_dir("qwen2"), scratch.path() / "tied", options);
  const std::set<std::string> tied_names = names_of(io::Checkpoint((scratch.path() / "tied").string()));
  EXPECT_EQ(tied_names.count("lm_head.weight"), 0u);
  EXPECT_EQ(tied_names.count("model.embed_tokens.weight"), 1u);
  EXPECT_EQ(tied_names, names_of(io::Checkpoint(case_dir("qwen2").string())));

  ModelWeights untied = load_model(*be, case_dir("qwen3"));
  save_hf_model(*be, untied, case_dir("qwen3"), scratch.path() / "untied", options);
  EXPECT_EQ(names_of(io::Checkpoint((scratch.path() / "untied").string())).count("lm_head.weight"), 1u);
}

TEST(HfModelExport, TokenizerAndGenerationFilesAreCopiedAndNothingElse) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  const fs::path src = make_source_with_tokenizer(scratch);
  ModelWeights w = load_model(*be, src);
  const fs::path out = scratch.path() / "out";
  save_hf_model(*be, w, src, out);
  for (const char* name : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                           "generation_config.json", "vocab.json", "merges.txt"}) {
    ASSERT_TRUE(fs::exists(out / name)) << name;
    EXPECT_EQ(read_bytes((out / name).string()), read_bytes((src / name).string())) << name;
  }
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(out)) files.insert(e.path().filename().string());
  EXPECT_EQ(files.count("training_notes.txt"), 0u);
  EXPECT_EQ(files.size(), 9u);  // the seven above, config.json, model.safetensors
}

TEST(HfModelExport, LoraAdaptersDoNotLeakIntoTheModel) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights w = load_model(*be, case_dir("qwen2"));
  add_trained_lora(*be, w, lora_config(4, 8, false, {"q_proj", "k_proj", "v_proj", "o_proj"}), 9);
  HfModelExportOptions options;
  options.dtype = DType::F32;
  save_hf_model(*be, w, case_dir("qwen2"), scratch.path() / "out", options);
  io::Checkpoint saved((scratch.path() / "out").string());
  io::Checkpoint base(case_dir("qwen2").string());
  ASSERT_EQ(names_of(saved), names_of(base));
  for (const std::string& name : base.names()) EXPECT_EQ(values_of(*be, saved, name), values_of(*be, base, name));
}

TEST(HfModelExport, MergedExportEqualsBasePlusScaledBA) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights w = load_model(*be, case_dir("llama"));
  add_trained_lora(*be, w, lora_config(4, 8, true, {"q_proj", "down_proj"}), 21);
  HfModelExportOptions options;
  options.dtype = DType::F32;
  options.merge_lora = true;
  save_hf_model(*be, w, case_dir("llama"), scratch.path() / "merged", options);
  io::Checkpoint saved((scratch.path() / "merged").string());
  EXPECT_EQ(names_of(saved), names_of(io::Checkpoint(case_dir("llama").string())));

  const double scaling = 8.0 / std::sqrt(4.0);  // rsLoRA
  int merged = 0;
  for (const Linear* lin : w.linears()) {
      std::vector<double> want = to_host(*be, lin->weight->value);
      if (lin->lora_a) {
        const std::vector<double> a = to_host(*be, lin->lora_a->value), b = to_host(*be, lin->lora_b->value);
        const int64_t out = lin->out_features(), in = lin->in_features(), r = lin->lora_rank();
        for (int64_t i = 0; i < out; ++i)
          for (int64_t j = 0; j < in; ++j) {
            double ba = 0;
            for (int64_t k = 0; k < r; ++k) ba += b[i * r + k] * a[k * in + j];
            want[i * in + j] += scaling * ba;
          }
        ++merged;
      }
      const std::vector<double> got = values_of(*be, saved, lin->weight->name), base = to_host(*be, lin->weight->value);
      ASSERT_EQ(got.size(), want.size());
      double worst = 0, changed = 0;
      for (size_t i = 0; i < got.size(); ++i) {
        worst = std::max(worst, std::fabs(got[i] - want[i]));
        changed = std::max(changed, std::fabs(want[i] - base[i]));
      }
      EXPECT_LE(worst, 1e-6) << lin->weight->name;
      if (lin->lora_a) {
        EXPECT_GT(changed, 1e-3) << lin->weight->name << ": the LoRA update is too small to test";
      }
    }
  EXPECT_EQ(merged, 4);

  // The merged model computes what base + adapter computes.
  ModelWeights reloaded = load_model(*be, scratch.path() / "merged");
  const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
  const std::vector<double> with_adapter = per_token_ce(*be, w, doc), from_merged = per_token_ce(*be, reloaded, doc);
  ASSERT_EQ(with_adapter.size(), from_merged.size());
  for (size_t i = 0; i < with_adapter.size(); ++i) EXPECT_NEAR(from_merged[i], with_adapter[i], 1e-5) << i;
}

TEST(HfModelExport, ExpertLoraMergesIntoEveryExpertInEitherLayout) {
  // W_e + s·B_e·A_e per expert, written per expert (qwen3_moe as transformers saves it) or fused
  // (qwen3_5_moe as released): the merged model alone computes what base + adapters computed.
  for (const char* name : {"qwen3_moe", "qwen3_5_moe"}) {
    SCOPED_TRACE(name);
    auto be = make_cpu_backend();
    ScratchDir scratch;
    ModelWeights w = load_model(*be, case_dir(name));
    add_trained_lora(*be, w, lora_config(2, 4, false, {"experts"}), 21);
    HfModelExportOptions options;
    options.dtype = DType::F32;
    options.merge_lora = true;
    save_hf_model(*be, w, case_dir(name), scratch.path() / "merged", options);
    ModelWeights merged = load_model(*be, scratch.path() / "merged");
    EXPECT_EQ(merged.lora.rank, 0);
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> want = per_token_ce(*be, w, doc), got = per_token_ce(*be, merged, doc);
    ModelWeights base = load_model(*be, case_dir(name));
    const std::vector<double> unadapted = per_token_ce(*be, base, doc);
    double moved = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      EXPECT_NEAR(got[i], want[i], 2e-5) << "token " << i;
      moved = std::max(moved, std::fabs(want[i] - unadapted[i]));
    }
    EXPECT_GT(moved, 1e-3) << "the adapters must change the model for the merge to be tested";
  }
}

TEST(HfModelExport, BadRequestsAreClearErrorsThatWriteNothing) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights w = load_model(*be, case_dir("qwen2"));
  const fs::path out = scratch.path() / "out";
  HfModelExportOptions merge;
  merge.merge_lora = true;
  EXPECT_TRUE(contains(error_of([&] { save_hf_model(*be, w, case_dir("qwen2"), out, merge); }), "no LoRA adapters"));
  HfModelExportOptions ints;
  ints.dtype = DType::I32;
  EXPECT_TRUE(contains(error_of([&] { save_hf_model(*be, w, case_dir("qwen2"), out, ints); }), "choose bf16, f16, f32 or f64"));
  EXPECT_TRUE(contains(error_of([&] { save_hf_model(*be, w, scratch.path() / "nowhere", out); }), "config.json is missing"));
  EXPECT_FALSE(fs::exists(out));

  // Saving over the source folder would delete the weights being read.
  const fs::path src = scratch.path() / "src";
  fs::create_directories(src);
  fs::copy_file(case_dir("qwen2") / "config.json", src / "config.json");
  EXPECT_TRUE(contains(error_of([&] { save_hf_model(*be, w, src, src / "." ); }), "it is the source model folder"));

  // A target that is a file, or a folder of someone's other files, is never replaced.
  write_bytes((scratch.path() / "file").string(), "x");
  EXPECT_TRUE(contains(error_of([&] { save_hf_model(*be, w, case_dir("qwen2"), scratch.path() / "file"); }),
                       "is not a folder"));
  fs::create_directories(scratch.path() / "project");
  write_bytes((scratch.path() / "project/notes.txt").string(), "keep me");
  EXPECT_TRUE(contains(error_of([&] { save_hf_model(*be, w, case_dir("qwen2"), scratch.path() / "project"); }),
                       "not an earlier export"));
  EXPECT_EQ(read_bytes((scratch.path() / "project/notes.txt").string()), "keep me");
  EXPECT_TRUE(leftover_staging_folders(scratch.path()).empty());
}

// ---- atomicity ------------------------------------------------------------------------------------

TEST(ExportAtomicity, AFailureMidwayLeavesTheEarlierExportIntact) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  const fs::path src = make_source_with_tokenizer(scratch);
  ModelWeights first = load_model(*be, src);
  const fs::path out = scratch.path() / "out";
  HfModelExportOptions sharded;
  sharded.dtype = DType::F32;
  sharded.max_shard_bytes = 64 << 10;
  save_hf_model(*be, first, src, out, sharded);
  std::map<std::string, std::string> before;
  for (const auto& e : fs::directory_iterator(out)) before[e.path().filename().string()] = read_bytes(e.path().string());

  // The second export fails after its weights are written: the source's tokenizer.json cannot be
  // copied (here: a folder where a file should be).
  ModelWeights second = load_model(*be, src);
  perturb(*be, second, 3);
  fs::remove(src / "tokenizer.json");
  fs::create_directory(src / "tokenizer.json");
  const std::string message = error_of([&] { save_hf_model(*be, second, src, out); });
  EXPECT_TRUE(contains(message, "tokenizer.json"));
  EXPECT_TRUE(contains(message, "not a regular file"));

  std::map<std::string, std::string> after;
  for (const auto& e : fs::directory_iterator(out)) after[e.path().filename().string()] = read_bytes(e.path().string());
  EXPECT_EQ(after, before);
  EXPECT_TRUE(leftover_staging_folders(scratch.path()).empty());
  expect_same_parameters(*be, first, load_model(*be, out));
}

TEST(ExportAtomicity, ANewExportReplacesTheOldOneWhole) {
  // Sharded, then a single file, then an adapter over the model: no file of an earlier export stays.
  auto be = make_cpu_backend();
  ScratchDir scratch;
  const fs::path src = make_source_with_tokenizer(scratch);
  ModelWeights w = load_model(*be, src);
  const fs::path out = scratch.path() / "out";
  HfModelExportOptions sharded;
  sharded.max_shard_bytes = 16 << 10;
  save_hf_model(*be, w, src, out, sharded);
  EXPECT_TRUE(fs::exists(out / "model.safetensors.index.json"));
  perturb(*be, w, 4);
  HfModelExportOptions single;
  single.dtype = DType::F32;
  save_hf_model(*be, w, case_dir("qwen3"), out, single);  // a source without tokenizer files
  std::set<std::string> files;
  for (const auto& e : fs::directory_iterator(out)) files.insert(e.path().filename().string());
  EXPECT_EQ(files, (std::set<std::string>{"config.json", "model.safetensors"}));
  expect_same_parameters(*be, w, load_model(*be, out));

  add_trained_lora(*be, w, lora_config(2, 2, false, {"v_proj"}), 1);
  save_peft_adapter(*be, w, out, "base");
  files.clear();
  for (const auto& e : fs::directory_iterator(out)) files.insert(e.path().filename().string());
  EXPECT_EQ(files, (std::set<std::string>{"adapter_config.json", "adapter_model.safetensors"}));
  EXPECT_TRUE(leftover_staging_folders(scratch.path()).empty());
}

TEST(ExportAtomicity, TrailingSlashNamesTheSameFolder) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights w = load_model(*be, case_dir("qwen2"));
  save_hf_model(*be, w, case_dir("qwen2"), scratch.path() / "out");
  save_hf_model(*be, w, case_dir("qwen2"), (scratch.path() / "out").string() + "/");
  std::set<std::string> entries;
  for (const auto& e : fs::directory_iterator(scratch.path())) entries.insert(e.path().filename().string());
  EXPECT_EQ(entries, (std::set<std::string>{"out"}));
}

// ---- the Python safetensors library ---------------------------------------------------------------

TEST(ExportPythonSafetensors, ShardsIndexAndAdapterParseWithTheReferenceLibrary) {
  if (!io::testing::python_safetensors_available())
    GTEST_SKIP() << "python3 with numpy and safetensors is not installed (pip install numpy safetensors); "
                    "skipping the Python check of exported folders";
  auto be = make_cpu_backend();
  ScratchDir scratch;
  ModelWeights w = load_model(*be, case_dir("qwen3"));
  HfModelExportOptions options;
  options.max_shard_bytes = 24 << 10;
  save_hf_model(*be, w, case_dir("qwen3"), scratch.path() / "model", options);
  add_trained_lora(*be, w, lora_config(4, 8, false, {"q_proj", "up_proj"}), 2);
  save_peft_adapter(*be, w, scratch.path() / "adapter", "base");

  const std::string script = R"PY(
import json, os, sys
import numpy as np
from safetensors import safe_open
model, adapter = sys.argv[1], sys.argv[2]
index = json.load(open(os.path.join(model, "model.safetensors.index.json")))
shards = sorted(f for f in os.listdir(model) if f.endswith(".safetensors"))
assert len(shards) > 1, shards
assert set(index["weight_map"].values()) == set(shards), (index["weight_map"], shards)
total, seen = 0, {}
for shard in shards:
    with safe_open(os.path.join(model, shard), framework="numpy") as f:
        assert f.metadata() == {"format": "pt"}, f.metadata()
        for k in f.keys():
            seen[k] = shard
            total += int(np.prod(f.get_slice(k).get_shape())) * 2  # BF16
            assert f.get_slice(k).get_dtype() == "BF16", (k, f.get_slice(k).get_dtype())
assert seen == index["weight_map"], "index does not say where each tensor is"
assert index["metadata"]["total_size"] == total, (index["metadata"], total)
assert "lm_head.weight" in seen and not any("lora" in k for k in seen)
assert json.load(open(os.path.join(model, "config.json")))["dtype"] == "bfloat16"
with safe_open(os.path.join(adapter, "adapter_model.safetensors"), framework="numpy") as f:
    assert f.metadata() == {"format": "pt"}
    keys = set(f.keys())
    want = {f"base_model.model.model.layers.{l}.{m}.lora_{ab}.weight" for l in (0, 1)
            for m in ("self_attn.q_proj", "mlp.up_proj") for ab in "AB"}
    assert keys == want, keys ^ want
    assert f.get_tensor("base_model.model.model.layers.0.mlp.up_proj.lora_B.weight").shape == (96, 4)
    assert np.any(f.get_tensor("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight") != 0)
print("python checks passed:", len(seen), "tensors in", len(shards), "shards")
)PY";
  std::string output;
  ASSERT_EQ(io::testing::run_python(scratch, script,
                                    "'" + (scratch.path() / "model").string() + "' '" +
                                        (scratch.path() / "adapter").string() + "'",
                                    &output),
            0)
      << output;
  EXPECT_TRUE(contains(output, "python checks passed"));
}

// ---- cases for scripts/gpu/check_exports.py --------------------------------------------------------

// Writes exported folders and spindle's per-token cross-entropy of a fixed document for each, into
// $SPINDLE_EXPORT_CASES_DIR (kept for the GPU host) or a scratch folder. What Python must reproduce
// is first checked here: the folder, read back by spindle, gives the same cross-entropy.
TEST(PythonStackCases, ExportsReloadToTheCrossEntropySpindleComputed) {
  auto be = make_cpu_backend();
  ScratchDir scratch;
  const char* env = std::getenv("SPINDLE_EXPORT_CASES_DIR");
  const fs::path root = env && *env ? fs::path(env) : scratch.path() / "cases";
  fs::create_directories(root);
  nlohmann::json manifest = nlohmann::json::array();

  auto record = [&](const std::string& name, const std::string& kind, const std::string& base, const char* saved_dtype,
                    const std::vector<int32_t>& doc, const std::vector<double>& ce) {
    manifest.push_back({{"name", name}, {"kind", kind}, {"base", "testdata/hf/" + base}, {"saved_dtype", saved_dtype},
                        {"input_ids", doc}, {"token_ce", ce}});
  };
  auto expect_same_ce = [](const std::vector<double>& a, const std::vector<double>& b, const std::string& name) {
    ASSERT_EQ(a.size(), b.size()) << name;
    for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(a[i], b[i], 1e-6) << name << " token " << i;
  };

  {  // qwen2 (tied, q/k/v bias) + LoRA on every projection, F32 adapter.
    ModelWeights w = load_model(*be, case_dir("qwen2"));
    add_trained_lora(*be, w, lora_config(4, 8, false, {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                       "down_proj"}),
                     31);
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> ce = per_token_ce(*be, w, doc);
    save_peft_adapter(*be, w, root / "qwen2_adapter", "testdata/hf/qwen2");
    ModelWeights back = load_model(*be, case_dir("qwen2"));
    back.load_peft_adapter(*be, (root / "qwen2_adapter").string());
    expect_same_ce(per_token_ce(*be, back, doc), ce, "qwen2_adapter");
    record("qwen2_adapter", "adapter", "qwen2", "float32", doc, ce);
  }
  {  // llama (llama3 RoPE) + rsLoRA on three projections.
    ModelWeights w = load_model(*be, case_dir("llama"));
    add_trained_lora(*be, w, lora_config(8, 16, true, {"q_proj", "v_proj", "down_proj"}), 32);
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> ce = per_token_ce(*be, w, doc);
    save_peft_adapter(*be, w, root / "llama_rslora_adapter", "testdata/hf/llama");
    ModelWeights back = load_model(*be, case_dir("llama"));
    back.load_peft_adapter(*be, (root / "llama_rslora_adapter").string());
    expect_same_ce(per_token_ce(*be, back, doc), ce, "llama_rslora_adapter");
    record("llama_rslora_adapter", "adapter", "llama", "float32", doc, ce);
  }
  {  // qwen3 (q/k norm, untied head) fully fine-tuned: every weight perturbed, F32 in four shards.
    ModelWeights w = load_model(*be, case_dir("qwen3"));
    perturb(*be, w, 33);
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> ce = per_token_ce(*be, w, doc);
    HfModelExportOptions options;
    options.dtype = DType::F32;
    options.max_shard_bytes = 64 << 10;
    save_hf_model(*be, w, case_dir("qwen3"), root / "qwen3_full", options);
    ModelWeights back = load_model(*be, root / "qwen3_full");
    expect_same_ce(per_token_ce(*be, back, doc), ce, "qwen3_full");
    record("qwen3_full", "model", "qwen3", "float32", doc, ce);
  }
  {  // qwen2 + LoRA merged, saved in bf16 (the user default): the reference is the bf16 file read in F32.
    ModelWeights w = load_model(*be, case_dir("qwen2"));
    add_trained_lora(*be, w, lora_config(4, 8, false, {"q_proj", "o_proj", "up_proj"}), 34);
    HfModelExportOptions options;
    options.merge_lora = true;
    save_hf_model(*be, w, case_dir("qwen2"), root / "qwen2_merged_bf16", options);
    ModelWeights back = load_model(*be, root / "qwen2_merged_bf16");
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> ce = per_token_ce(*be, back, doc), unmerged = per_token_ce(*be, w, doc);
    for (size_t i = 0; i < ce.size(); ++i) EXPECT_NEAR(ce[i], unmerged[i], 2e-2) << "bf16 rounding only, token " << i;
    record("qwen2_merged_bf16", "model", "qwen2", "bfloat16", doc, ce);
  }

  {  // qwen3_5_moe, the multimodal checkpoint (Qwen3.6's layout: fused experts, a vision tower, mtp.*):
     // LoRA on the attention, DeltaNet, shared-expert and shared-gate projections, under PEFT's names
     // for the multimodal model (base_model.model.model.language_model.layers...).
    ModelWeights w = load_model(*be, case_dir("qwen3_5_moe"));
    add_trained_lora(*be, w,
                     lora_config(4, 8, false, {"q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z",
                                               "in_proj_b", "in_proj_a", "out_proj", "gate_proj", "up_proj",
                                               "down_proj", "shared_expert_gate"}),
                     35);
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> ce = per_token_ce(*be, w, doc);
    save_peft_adapter(*be, w, root / "qwen3_5_moe_adapter", "testdata/hf/qwen3_5_moe");
    ModelWeights back = load_model(*be, case_dir("qwen3_5_moe"));
    back.load_peft_adapter(*be, (root / "qwen3_5_moe_adapter").string());
    expect_same_ce(per_token_ce(*be, back, doc), ce, "qwen3_5_moe_adapter");
    // As PEFT writes it for a multimodal base: AutoPeftModel finds the class in auto_mapping.
    const nlohmann::json config = read_json(root / "qwen3_5_moe_adapter" / "adapter_config.json");
    EXPECT_TRUE(config["task_type"].is_null());
    EXPECT_EQ(config["auto_mapping"]["base_model_class"], "Qwen3_5MoeForConditionalGeneration");
    EXPECT_EQ(config["auto_mapping"]["parent_library"], "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe");
    record("qwen3_5_moe_adapter", "adapter", "qwen3_5_moe", "float32", doc, ce);
  }
  {  // qwen3_5_moe fully fine-tuned, F32: the vision tower and mtp.* carried over, the experts fused as read.
    ModelWeights w = load_model(*be, case_dir("qwen3_5_moe"));
    perturb(*be, w, 36);
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> ce = per_token_ce(*be, w, doc);
    HfModelExportOptions options;
    options.dtype = DType::F32;
    save_hf_model(*be, w, case_dir("qwen3_5_moe"), root / "qwen3_5_moe_full", options);
    ModelWeights back = load_model(*be, root / "qwen3_5_moe_full");
    expect_same_ce(per_token_ce(*be, back, doc), ce, "qwen3_5_moe_full");
    record("qwen3_5_moe_full", "model", "qwen3_5_moe", "float32", doc, ce);
  }
  {  // qwen3_moe (per-expert checkpoint) + LoRA on q_proj and both routed experts' fused tensors, as
     // PEFT's target_parameters adapt them (B written as PEFT's [out, r·E]).
    ModelWeights w = load_model(*be, case_dir("qwen3_moe"));
    add_trained_lora(*be, w, lora_config(4, 8, false, {"q_proj", "experts"}), 37);
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> ce = per_token_ce(*be, w, doc);
    save_peft_adapter(*be, w, root / "qwen3_moe_expert_adapter", "testdata/hf/qwen3_moe");
    ModelWeights back = load_model(*be, case_dir("qwen3_moe"));
    back.load_peft_adapter(*be, (root / "qwen3_moe_expert_adapter").string());
    expect_same_ce(per_token_ce(*be, back, doc), ce, "qwen3_moe_expert_adapter");
    record("qwen3_moe_expert_adapter", "adapter", "qwen3_moe", "float32", doc, ce);
  }
  {  // qwen3_5_moe, the multimodal checkpoint (fused experts): LoRA on down_proj of the routed experts
     // only, and on the attention; auto_mapping names the multimodal class.
    ModelWeights w = load_model(*be, case_dir("qwen3_5_moe"));
    add_trained_lora(*be, w, lora_config(2, 4, true, {"q_proj", "o_proj", "experts.down_proj"}), 38);
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> ce = per_token_ce(*be, w, doc);
    save_peft_adapter(*be, w, root / "qwen3_5_moe_expert_adapter", "testdata/hf/qwen3_5_moe");
    ModelWeights back = load_model(*be, case_dir("qwen3_5_moe"));
    back.load_peft_adapter(*be, (root / "qwen3_5_moe_expert_adapter").string());
    expect_same_ce(per_token_ce(*be, back, doc), ce, "qwen3_5_moe_expert_adapter");
    record("qwen3_5_moe_expert_adapter", "adapter", "qwen3_5_moe", "float32", doc, ce);
  }
  {  // qwen3_moe with expert LoRA merged into each expert, F32, per-expert tensors as the source has them.
    ModelWeights w = load_model(*be, case_dir("qwen3_moe"));
    add_trained_lora(*be, w, lora_config(4, 8, false, {"experts", "k_proj"}), 39);
    HfModelExportOptions options;
    options.dtype = DType::F32;
    options.merge_lora = true;
    save_hf_model(*be, w, case_dir("qwen3_moe"), root / "qwen3_moe_expert_merged", options);
    ModelWeights back = load_model(*be, root / "qwen3_moe_expert_merged");
    const std::vector<int32_t> doc = fixed_document(w.config.vocab_size);
    const std::vector<double> ce = per_token_ce(*be, back, doc);
    expect_same_ce(ce, per_token_ce(*be, w, doc), "qwen3_moe_expert_merged");
    record("qwen3_moe_expert_merged", "model", "qwen3_moe", "float32", doc, ce);
  }

  const fs::path manifest_path = root / "cases.json";
  write_bytes((manifest_path.string() + ".tmp"), manifest.dump(1) + "\n");
  fs::rename(manifest_path.string() + ".tmp", manifest_path);
  EXPECT_EQ(read_json(manifest_path).size(), 9u);
}

// ---- mixture-of-experts checkpoint layouts --------------------------------------------------------

TEST(HfModelExport, RoutedExpertsAreSavedInTheLayoutTheCheckpointHad) {
  // The same qwen3_moe weights as per-expert tensors (mlp.experts.N.{gate,up,down}_proj.weight) and
  // as transformers 5's fused ones (experts.gate_up_proj [E, 2I, H]: each expert's gate rows then
  // its up rows; experts.down_proj [E, H, I]): both load as the same model, and each exports as it came.
  auto be = make_cpu_backend();
  ScratchDir scratch;
  const TinyModel tiny = tiny_qwen3_moe();
  const fs::path per_expert = scratch.path() / "per_expert", fused = scratch.path() / "fused";
  write_model_folder(per_expert, tiny, 11, 10.0);
  const ModelWeights want = load_model(*be, per_expert);
  for (const PackedTensor& packed : want.packed_tensors()) EXPECT_FALSE(packed.read) << packed.name;

  const ModelConfig& c = want.config;
  const int64_t experts = c.moe.num_experts, width = c.moe.expert_intermediate_size, h = c.hidden_size;
  io::NamedTensors tensors;
  std::set<std::string> fused_names;
  for (const Parameter& p : want.parameters())
    if (p.name.find(".mlp.experts.") == std::string::npos) tensors.emplace_back(p.name, p.value);
  for (int64_t l = 0; l < c.num_layers; ++l) {
    if (c.layer_kind(l).feed_forward != FeedForwardKind::MixtureOfExperts) continue;
    const std::string pre = fmt::format("model.layers.{}.mlp.experts.", l);
    auto values = [&](int64_t e, const char* proj) {
      for (const Parameter& p : want.parameters())
        if (p.name == fmt::format("{}{}.{}.weight", pre, e, proj)) return to_host(*be, p.value);
      ADD_FAILURE() << "no " << pre << e << "." << proj;
      return std::vector<double>{};
    };
    std::vector<double> gate_up, down;
    for (int64_t e = 0; e < experts; ++e) {
      for (const char* proj : {"gate_proj", "up_proj"}) {
        const std::vector<double> v = values(e, proj);
        gate_up.insert(gate_up.end(), v.begin(), v.end());
      }
      const std::vector<double> v = values(e, "down_proj");
      down.insert(down.end(), v.begin(), v.end());
    }
    Tensor gu = be->empty(Shape{experts, 2 * width, h}, DType::F32), dn = be->empty(Shape{experts, h, width}, DType::F32);
    from_host(*be, gate_up, gu);
    from_host(*be, down, dn);
    tensors.emplace_back(pre + "gate_up_proj", gu);
    tensors.emplace_back(pre + "down_proj", dn);
    fused_names.insert({pre + "gate_up_proj", pre + "down_proj"});
  }
  fs::create_directories(fused);
  fs::copy_file(per_expert / "config.json", fused / "config.json");
  io::write_safetensors((fused / "model.safetensors").string(), tensors, *be, {{"format", "pt"}});

  const ModelWeights got = load_model(*be, fused);
  expect_same_parameters(*be, want, got);
  int read = 0;
  for (const PackedTensor& packed : got.packed_tensors()) read += packed.read;
  EXPECT_EQ(read, 4) << "two MoE layers, two fused tensors each";

  HfModelExportOptions options;
  options.dtype = DType::F32;
  save_hf_model(*be, got, fused, scratch.path() / "fused_out", options);
  save_hf_model(*be, want, per_expert, scratch.path() / "per_expert_out", options);
  const io::Checkpoint fused_out((scratch.path() / "fused_out").string());
  const io::Checkpoint per_expert_out((scratch.path() / "per_expert_out").string());
  const io::Checkpoint fused_in(fused.string()), per_expert_in(per_expert.string());
  EXPECT_EQ(names_of(fused_out), names_of(fused_in));
  EXPECT_EQ(names_of(per_expert_out), names_of(per_expert_in));
  for (const std::string& name : fused_names) {
    EXPECT_EQ(names_of(per_expert_out).count(name), 0u) << name;
    EXPECT_EQ(values_of(*be, fused_out, name), values_of(*be, fused_in, name)) << name;
  }
  for (const std::string& name : names_of(per_expert_in))
    EXPECT_EQ(values_of(*be, per_expert_out, name), values_of(*be, per_expert_in, name)) << name;
}

TEST(HfModelExport, MixtureOfExpertsModelsBuildOnABackendThatModelsAGpu) {
  // spindle plan's backend, modelling a GPU: qwen3_moe's ops have CUDA kernels (backend/cuda/moe.cu),
  // so its weights are built there as on the CPU, every expert a dense Parameter.
  plan::DryBackend gpu(Device{DeviceKind::CUDA, 0}, 512);
  const ModelConfig config = tiny_qwen3_moe().config();
  ModelWeights weights = ModelWeights::random(gpu, config, DType::BF16, 1);
  EXPECT_EQ(weights.layers.size(), static_cast<size_t>(config.num_layers));
  EXPECT_NE(weights.find("model.layers.0.mlp.experts.0.down_proj.weight"), nullptr);
}
