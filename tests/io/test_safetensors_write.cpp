// Writing single files and sharded model folders, read back through the reader.
#include <gtest/gtest.h>

#include <cstring>
#include <nlohmann/json.hpp>

#include "io/checkpoint.h"
#include "io/safetensors_file.h"
#include "io/write_safetensors.h"
#include "io_test_util.h"

using namespace spindle;
using namespace spindle::io;
using namespace spindle::io::testing;

namespace {

// Deterministic, non-zero, distinct bytes per tensor so a swapped or shifted tensor cannot pass.
Tensor patterned(Backend& backend, Shape shape, DType dtype, int seed) {
  Tensor t = backend.empty(shape, dtype);
  std::vector<unsigned char> bytes(t.bytes());
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<unsigned char>((i * 7 + seed * 31 + 1) & 0xff);
  backend.copy_from_host(backend.default_stream(), bytes.data(), t);
  return t;
}

void expect_same_bytes(Backend& backend, const Tensor& tensor, const TensorRecord& rec) {
  EXPECT_EQ(rec.dtype, tensor.dtype()) << rec.name;
  EXPECT_EQ(rec.shape, tensor.shape()) << rec.name;
  ASSERT_EQ(rec.bytes, tensor.bytes()) << rec.name;
  std::vector<unsigned char> host = to_host<unsigned char>(backend, tensor);
  EXPECT_EQ(std::memcmp(host.data(), rec.data, rec.bytes), 0) << rec.name;
}

}  // namespace

TEST(SafetensorsWrite, RoundTripsEveryDtype) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  NamedTensors tensors;
  const DType all[] = {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8};
  int seed = 0;
  for (DType dtype : all) {
    tensors.emplace_back(std::string("t.") + std::string(dtype_name(dtype)), patterned(*backend, Shape{3, 5}, dtype, seed++));
  }
  tensors.emplace_back("odd_length", patterned(*backend, Shape{7}, DType::U8, seed++));  // unaligns what follows
  tensors.emplace_back("after_odd", patterned(*backend, Shape{2, 1, 3}, DType::F32, seed++));
  tensors.emplace_back("empty", backend->empty(Shape{0, 4}, DType::F32));
  tensors.emplace_back("scalar", patterned(*backend, Shape{}, DType::F64, seed++));
  const std::string path = dir.file("all.safetensors");
  write_safetensors(path, tensors, *backend, {{"format", "pt"}, {"step", "12"}});

  SafetensorsFile file(path);
  std::vector<std::string> expected_names;
  for (const auto& [name, tensor] : tensors) expected_names.push_back(name);
  EXPECT_EQ(file.names(), expected_names);  // order as given
  for (const auto& [name, tensor] : tensors) {
    const TensorRecord* rec = file.find(name);
    ASSERT_NE(rec, nullptr) << name;
    expect_same_bytes(*backend, tensor, *rec);
  }
  EXPECT_EQ(file.metadata(), (std::map<std::string, std::string>{{"format", "pt"}, {"step", "12"}}));
}

TEST(SafetensorsWrite, HeaderIsPaddedWithSpacesToEightBytes) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  const std::string path = dir.file("p.safetensors");
  write_safetensors(path, {{"x", patterned(*backend, Shape{3}, DType::U8, 1)}}, *backend);
  const std::string bytes = read_bytes(path);
  uint64_t header_bytes = 0;
  std::memcpy(&header_bytes, bytes.data(), 8);
  EXPECT_EQ((8 + header_bytes) % 8, 0u);
  const std::string header = bytes.substr(8, header_bytes);
  const std::string json = R"({"x":{"dtype":"U8","shape":[3],"data_offsets":[0,3]}})";
  EXPECT_EQ(header.substr(0, json.size()), json);
  EXPECT_EQ(header.find_first_not_of(' ', json.size()), std::string::npos);
  EXPECT_EQ(bytes.size(), 8 + header_bytes + 3);
}

TEST(SafetensorsWrite, ReplacesAtomicallyAndLeavesNoTemporaryFile) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  const std::string path = dir.file("w.safetensors");
  write_safetensors(path, {{"a", patterned(*backend, Shape{4}, DType::F32, 1)}}, *backend);
  write_safetensors(path, {{"b", patterned(*backend, Shape{2}, DType::F32, 2)}}, *backend);
  SafetensorsFile file(path);
  EXPECT_EQ(file.names(), std::vector<std::string>{"b"});
  int entries = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    ++entries;
    EXPECT_EQ(entry.path().filename(), "w.safetensors");
  }
  EXPECT_EQ(entries, 1);
}

TEST(SafetensorsWrite, RejectsBadTensorListsWithoutTouchingTheFile) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  const std::string path = dir.file("keep.safetensors");
  write_safetensors(path, {{"original", patterned(*backend, Shape{2}, DType::U8, 1)}}, *backend);
  Tensor t = patterned(*backend, Shape{2}, DType::U8, 2);
  EXPECT_TRUE(contains(error_of([&] { write_safetensors(path, {{"a", t}, {"a", t}}, *backend); }),
                       "tensor name 'a' is given twice"));
  EXPECT_TRUE(contains(error_of([&] { write_safetensors(path, {{"__metadata__", t}}, *backend); }), "reserved"));
  EXPECT_TRUE(contains(error_of([&] { write_safetensors(path, {{"", t}}, *backend); }), "empty name"));
  EXPECT_TRUE(contains(error_of([&] { write_safetensors(path, {{"u", Tensor()}}, *backend); }),
                       "tensor 'u' is undefined"));
  EXPECT_TRUE(contains(error_of([&] { write_safetensors(path, {{"bad\xff", t}}, *backend); }), "UTF-8"));
  EXPECT_EQ(SafetensorsFile(path).names(), std::vector<std::string>{"original"});
  EXPECT_TRUE(contains(error_of([&] { write_safetensors("/nonexistent/spindle/x.safetensors", {{"a", t}}, *backend); }),
                       "cannot create /nonexistent/spindle/x.safetensors.tmp."));
}

TEST(SafetensorsWrite, ShardsInHuggingFaceLayout) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  NamedTensors tensors = {
      {"model.embed_tokens.weight", patterned(*backend, Shape{4, 4}, DType::F32, 1)},  // 64 bytes
      {"model.layers.0.w", patterned(*backend, Shape{8}, DType::F32, 2)},              // 32
      {"model.layers.0.b", patterned(*backend, Shape{8}, DType::BF16, 3)},             // 16
      {"model.big", patterned(*backend, Shape{40}, DType::F32, 4)},                    // 160 > max: own shard
      {"model.norm.weight", patterned(*backend, Shape{4}, DType::F32, 5)},             // 16
  };
  const std::string folder = dir.file("model");
  write_sharded_safetensors(folder, tensors, *backend, 100);

  const std::string names[] = {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                               "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors"};
  for (const std::string& name : names) EXPECT_TRUE(std::filesystem::exists(folder + "/" + name)) << name;
  EXPECT_FALSE(std::filesystem::exists(folder + "/model.safetensors"));

  const std::string index_text = read_bytes(folder + "/model.safetensors.index.json");
  nlohmann::json index = nlohmann::json::parse(index_text);
  EXPECT_EQ(index["metadata"]["total_size"], 64 + 32 + 16 + 160 + 16);
  EXPECT_EQ(index["weight_map"]["model.embed_tokens.weight"], names[0]);
  EXPECT_EQ(index["weight_map"]["model.layers.0.w"], names[0]);
  EXPECT_EQ(index["weight_map"]["model.layers.0.b"], names[1]);  // 64+32+16 > 100
  EXPECT_EQ(index["weight_map"]["model.big"], names[2]);
  EXPECT_EQ(index["weight_map"]["model.norm.weight"], names[3]);  // the oversized shard is already full
  EXPECT_EQ(index["weight_map"].size(), 5u);
  EXPECT_EQ(index_text.substr(0, 19), "{\n  \"metadata\": {\n ");  // json.dumps(indent=2) style
  EXPECT_EQ(index_text.back(), '\n');

  Checkpoint checkpoint(folder);
  EXPECT_EQ(checkpoint.files().size(), 4u);
  EXPECT_EQ(checkpoint.files()[0]->metadata().at("format"), "pt");
  std::vector<std::string> expected_names;
  for (const auto& [name, tensor] : tensors) {
    expected_names.push_back(name);
    const TensorRecord* rec = checkpoint.find(name);
    ASSERT_NE(rec, nullptr) << name;
    expect_same_bytes(*backend, tensor, *rec);
  }
  EXPECT_EQ(checkpoint.names(), expected_names);
}

TEST(SafetensorsWrite, SingleFileWhenEverythingFitsAndStaleShardsRemoved) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  const std::string folder = dir.file("model");
  NamedTensors tensors = {{"a", patterned(*backend, Shape{16}, DType::F32, 1)},
                          {"b", patterned(*backend, Shape{16}, DType::F32, 2)}};
  write_sharded_safetensors(folder, tensors, *backend, 64);  // two shards
  EXPECT_TRUE(std::filesystem::exists(folder + "/model-00002-of-00002.safetensors"));
  write_bytes(folder + "/config.json", "{}");

  write_sharded_safetensors(folder, tensors, *backend, 1000);  // now fits one file
  EXPECT_TRUE(std::filesystem::exists(folder + "/model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(folder + "/model.safetensors.index.json"));
  EXPECT_FALSE(std::filesystem::exists(folder + "/model-00001-of-00002.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(folder + "/model-00002-of-00002.safetensors"));
  EXPECT_TRUE(std::filesystem::exists(folder + "/config.json"));  // not a weight file: kept
  SafetensorsFile file(folder + "/model.safetensors");
  EXPECT_EQ(file.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(file.metadata().at("format"), "pt");

  write_sharded_safetensors(folder, tensors, *backend, 64);  // and back to shards
  EXPECT_FALSE(std::filesystem::exists(folder + "/model.safetensors"));
  EXPECT_EQ(Checkpoint(folder).names().size(), 2u);
  EXPECT_TRUE(contains(error_of([&] { write_sharded_safetensors(folder, tensors, *backend, 0); }),
                       "shard size must be positive"));
}
