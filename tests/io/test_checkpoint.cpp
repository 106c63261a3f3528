// Model folders (single file and sharded) and loading tensors onto a backend with dtype conversion.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "io/checkpoint.h"
#include "io/load_tensor.h"
#include "io/write_safetensors.h"
#include "io_test_util.h"

using namespace spindle;
using namespace spindle::io;
using namespace spindle::io::testing;

namespace {

// Two shards written by hand: a.safetensors holds x, y; b.safetensors holds z.
void write_two_shards(const ScratchDir& dir) {
  write_bytes(dir.file("a.safetensors"),
              raw_safetensors(R"({"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("y":{"dtype":"U8","shape":[3],"data_offsets":[8,11]}})", 11));
  write_bytes(dir.file("b.safetensors"), raw_safetensors(R"({"z":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]}})", 8));
}

const char* kTwoShardIndex =
    R"({"metadata":{"total_size":19},"weight_map":{"x":"a.safetensors","y":"a.safetensors","z":"b.safetensors"}})";

}  // namespace

TEST(Checkpoint, OpensSingleFileFolderAndFilePath) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  Tensor t = host_tensor<float>(*backend, Shape{2, 2}, DType::F32, {1.5f, -2, 3, 4});
  write_safetensors(dir.file("model.safetensors"), {{"w", t}}, *backend);
  for (const std::string& path : {dir.path().string(), dir.file("model.safetensors")}) {
    Checkpoint checkpoint(path);
    EXPECT_EQ(checkpoint.names(), std::vector<std::string>{"w"});
    EXPECT_EQ(checkpoint.require("w", Shape{2, 2}).shape, (Shape{2, 2}));
    EXPECT_EQ(checkpoint.find("nope"), nullptr);
  }
}

TEST(Checkpoint, OpensShardIndexFromFolderOrPath) {
  ScratchDir dir;
  write_two_shards(dir);
  write_bytes(dir.file("model.safetensors.index.json"), kTwoShardIndex);
  for (const std::string& path : {dir.path().string(), dir.file("model.safetensors.index.json")}) {
    Checkpoint checkpoint(path);
    EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"x", "y", "z"}));
    EXPECT_EQ(checkpoint.find("z")->file, dir.file("b.safetensors"));
    EXPECT_EQ(checkpoint.require("z", Shape{2, 2}).dtype, DType::BF16);
  }
}

TEST(Checkpoint, TensorsOutsideTheIndexAreIgnored) {
  ScratchDir dir;
  write_two_shards(dir);
  write_bytes(dir.file("model.safetensors.index.json"),
              R"({"weight_map":{"x":"a.safetensors","z":"b.safetensors"}})");
  Checkpoint checkpoint(dir.path().string());
  EXPECT_EQ(checkpoint.names(), (std::vector<std::string>{"x", "z"}));
  EXPECT_EQ(checkpoint.find("y"), nullptr);
}

TEST(Checkpoint, MissingShard) {
  ScratchDir dir;
  write_two_shards(dir);
  std::filesystem::remove(dir.file("b.safetensors"));
  write_bytes(dir.file("model.safetensors.index.json"), kTwoShardIndex);
  std::string message = error_of([&] { Checkpoint checkpoint(dir.path().string()); });
  EXPECT_TRUE(contains(message, "shard " + dir.file("b.safetensors") + " is missing"));
  EXPECT_TRUE(contains(message, "'z'"));
  EXPECT_TRUE(contains(message, "incomplete"));
}

TEST(Checkpoint, IndexNamesATensorItsShardLacks) {
  ScratchDir dir;
  write_two_shards(dir);
  write_bytes(dir.file("model.safetensors.index.json"),
              R"({"weight_map":{"x":"a.safetensors","z":"a.safetensors"}})");
  std::string message = error_of([&] { Checkpoint checkpoint(dir.path().string()); });
  EXPECT_TRUE(contains(message, "tensor 'z' is in " + dir.file("a.safetensors")));
  EXPECT_TRUE(contains(message, "no such tensor"));
}

TEST(Checkpoint, BadIndex) {
  ScratchDir dir;
  write_two_shards(dir);
  const std::string index = dir.file("model.safetensors.index.json");
  write_bytes(index, R"({"weight_map": )");
  EXPECT_TRUE(contains(error_of([&] { Checkpoint c(dir.path().string()); }), "is not valid JSON"));
  write_bytes(index, R"({"metadata": {}})");
  EXPECT_TRUE(contains(error_of([&] { Checkpoint c(dir.path().string()); }), "no \"weight_map\""));
  write_bytes(index, R"({"weight_map": {}})");
  EXPECT_TRUE(contains(error_of([&] { Checkpoint c(dir.path().string()); }), "\"weight_map\" is empty"));
  write_bytes(index, R"({"weight_map": {"x": 3}})");
  EXPECT_TRUE(contains(error_of([&] { Checkpoint c(dir.path().string()); }), "entry for 'x' must be a shard"));
  write_bytes(index, R"({"weight_map": {"x": "../a.safetensors"}})");
  EXPECT_TRUE(contains(error_of([&] { Checkpoint c(dir.path().string()); }), "not a file name inside"));
}

TEST(Checkpoint, CorruptShardIsNamed) {
  ScratchDir dir;
  write_two_shards(dir);
  write_bytes(dir.file("b.safetensors"), "short");
  write_bytes(dir.file("model.safetensors.index.json"), kTwoShardIndex);
  std::string message = error_of([&] { Checkpoint checkpoint(dir.path().string()); });
  EXPECT_TRUE(contains(message, dir.file("b.safetensors")));
  EXPECT_TRUE(contains(message, "truncated"));
}

TEST(Checkpoint, FolderWithoutWeights) {
  ScratchDir dir;
  write_bytes(dir.file("pytorch_model.bin"), "x");
  std::string message = error_of([&] { Checkpoint checkpoint(dir.path().string()); });
  EXPECT_TRUE(contains(message, "neither model.safetensors nor model.safetensors.index.json"));
  EXPECT_TRUE(contains(error_of([&] { Checkpoint c(dir.file("absent")); }), "does not exist"));
}

TEST(Checkpoint, RequireNamesMissingTensor) {
  ScratchDir dir;
  write_two_shards(dir);
  write_bytes(dir.file("model.safetensors.index.json"), kTwoShardIndex);
  Checkpoint checkpoint(dir.path().string());
  std::string message = error_of([&] { checkpoint.require("lm_head.weight", Shape{10, 2}); });
  EXPECT_TRUE(contains(message, "no tensor 'lm_head.weight'"));
  EXPECT_TRUE(contains(message, "[10, 2]"));
  EXPECT_TRUE(contains(message, "'x', 'y', 'z'"));
}

TEST(Checkpoint, RequireNamesWrongShapeAndHintsAtConfig) {
  ScratchDir dir;
  write_two_shards(dir);
  write_bytes(dir.file("model.safetensors.index.json"), kTwoShardIndex);
  Checkpoint checkpoint(dir.path().string());
  std::string message = error_of([&] { checkpoint.require("z", Shape{4, 2}); });
  EXPECT_TRUE(contains(message, "tensor 'z'"));
  EXPECT_TRUE(contains(message, "has shape [2, 2], but the model expects [4, 2]"));
  EXPECT_TRUE(contains(message, "config.json"));
  EXPECT_TRUE(contains(message, dir.file("b.safetensors")));
}

TEST(LoadTensor, ConvertsBetweenFloatDtypes) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  // Values exact in every float dtype, so each conversion has one right answer.
  const std::vector<double> values = {0.0, -1.5, 3.25, 1024.0, -0.0078125, 61440.0};
  NamedTensors tensors;
  const DType floats[] = {DType::F32, DType::F64, DType::BF16, DType::F16};
  auto staged = host_tensor<double>(*backend, Shape{2, 3}, DType::F64, values);
  for (DType dtype : floats) {
    Tensor t = backend->empty(Shape{2, 3}, dtype);
    backend->copy(backend->default_stream(), staged, t);
    tensors.emplace_back(std::string(dtype_name(dtype)), t);
  }
  write_safetensors(dir.file("model.safetensors"), tensors, *backend);
  Checkpoint checkpoint(dir.path().string());
  for (DType source : floats) {
    for (DType target : floats) {
      Tensor loaded = load_tensor(*backend, checkpoint.require(dtype_name(source), Shape{2, 3}), target);
      EXPECT_EQ(loaded.dtype(), target);
      EXPECT_EQ(loaded.shape(), (Shape{2, 3}));
      Tensor as_f64 = backend->empty(Shape{2, 3}, DType::F64);
      backend->copy(backend->default_stream(), loaded, as_f64);
      std::vector<double> back = to_host<double>(*backend, as_f64);
      EXPECT_EQ(back, values) << dtype_name(source) << " -> " << dtype_name(target);
    }
  }
}

TEST(LoadTensor, RoundsToNearestEvenIntoBf16) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  // 1 + 2^-8 is halfway between two bf16 values: it rounds to the even one, 1.0; 1 + 3·2^-8 rounds up.
  Tensor t = host_tensor<float>(*backend, Shape{2}, DType::F32, {1.0f + 0.00390625f, 1.0f + 3 * 0.00390625f});
  write_safetensors(dir.file("r.safetensors"), {{"r", t}}, *backend);
  Checkpoint checkpoint(dir.file("r.safetensors"));
  Tensor bf = load_tensor(*backend, *checkpoint.find("r"), DType::BF16);
  std::vector<uint16_t> bits = to_host<uint16_t>(*backend, bf);
  EXPECT_EQ(bf16_to_f32(bits[0]), 1.0f);
  EXPECT_EQ(bf16_to_f32(bits[1]), 1.015625f);
}

TEST(LoadTensor, LargeTensorConvertsAcrossChunks) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  const int64_t n = (int64_t{4} << 20) + 1000;  // crosses the 4Mi-element conversion chunk
  std::vector<uint16_t> bits(n);
  for (int64_t i = 0; i < n; ++i) bits[i] = f32_to_bf16(static_cast<float>(i % 251) - 125.0f);
  write_safetensors(dir.file("big.safetensors"), {{"big", host_tensor<uint16_t>(*backend, Shape{n}, DType::BF16, bits)}},
                    *backend);
  Checkpoint checkpoint(dir.file("big.safetensors"));
  std::vector<float> loaded = to_host<float>(*backend, load_tensor(*backend, *checkpoint.find("big"), DType::F32));
  int64_t wrong = 0;
  for (int64_t i = 0; i < n; ++i) wrong += loaded[i] != static_cast<float>(i % 251) - 125.0f;
  EXPECT_EQ(wrong, 0);
}

TEST(LoadTensor, IntegersLoadOnlyAsThemselves) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  Tensor ids = host_tensor<int64_t>(*backend, Shape{3}, DType::I64, {7, -2, 1'000'000'000'000});
  write_safetensors(dir.file("i.safetensors"), {{"ids", ids}}, *backend);
  Checkpoint checkpoint(dir.file("i.safetensors"));
  const TensorRecord& rec = checkpoint.require("ids", Shape{3});
  EXPECT_EQ(to_host<int64_t>(*backend, load_tensor(*backend, rec, DType::I64)),
            (std::vector<int64_t>{7, -2, 1'000'000'000'000}));
  std::string message = error_of([&] { load_tensor(*backend, rec, DType::F32); });
  EXPECT_TRUE(contains(message, "tensor 'ids'"));
  EXPECT_TRUE(contains(message, "is I64 and cannot be loaded as F32"));
}

TEST(LoadTensor, IntoPreallocatedTensorChecksElementCount) {
  auto backend = make_cpu_backend(1);
  ScratchDir dir;
  write_safetensors(dir.file("m.safetensors"),
                    {{"m", host_tensor<float>(*backend, Shape{2, 2}, DType::F32, {1, 2, 3, 4})}}, *backend);
  Checkpoint checkpoint(dir.file("m.safetensors"));
  Tensor flat = backend->empty(Shape{4}, DType::F64);
  load_tensor_into(*backend, *checkpoint.find("m"), flat);
  EXPECT_EQ(to_host<double>(*backend, flat), (std::vector<double>{1, 2, 3, 4}));
  Tensor wrong = backend->empty(Shape{5}, DType::F32);
  std::string message = error_of([&] { load_tensor_into(*backend, *checkpoint.find("m"), wrong); });
  EXPECT_TRUE(contains(message, "tensor 'm'"));
  EXPECT_TRUE(contains(message, "F32[5]"));
}
