// Interoperability with the reference implementation (Python safetensors): files it writes read
// here, files written here load there, and the bytes of both writers agree.
#include <gtest/gtest.h>

#include <cmath>

#include "io/checkpoint.h"
#include "io/load_tensor.h"
#include "io/write_safetensors.h"
#include "io_test_util.h"

using namespace spindle;
using namespace spindle::io;
using namespace spindle::io::testing;

namespace {

#define REQUIRE_PYTHON_SAFETENSORS()                                                        \
  if (!python_safetensors_available())                                                      \
  GTEST_SKIP() << "python3 with numpy and safetensors is not installed (pip install numpy " \
                  "safetensors); skipping the interoperability check"

// Values both sides compute the same way: exact in every dtype they are stored in.
double value_at(int64_t i) { return static_cast<double>(i % 13) * 0.25 - 1.5; }

}  // namespace

TEST(PythonInterop, ReadsFileWrittenByPython) {
  REQUIRE_PYTHON_SAFETENSORS();
  ScratchDir dir;
  const std::string script = R"(
import sys, numpy as np
from safetensors.numpy import save_file
v = lambda n: (np.arange(n) % 13) * 0.25 - 1.5
save_file({
    "f32": v(12).reshape(3, 4).astype(np.float32),
    "f64": v(5).astype(np.float64),
    "f16": v(6).reshape(1, 2, 3).astype(np.float16),
    "i32": (np.arange(4) * -7).astype(np.int32),
    "i64": (np.arange(3) * 10**12).astype(np.int64),
    "u8": np.arange(5).astype(np.uint8) * 50,
    "flags": np.array([True, False, True]),
    "empty": np.zeros((0, 3), np.float32),
}, sys.argv[1], metadata={"format": "pt", "origin": "numpy"})
)";
  std::string output;
  ASSERT_EQ(run_python(dir, script, "'" + dir.file("py.safetensors") + "'", &output), 0) << output;

  auto backend = make_cpu_backend(1);
  Checkpoint checkpoint(dir.file("py.safetensors"));
  EXPECT_EQ(checkpoint.names().size(), 8u);
  EXPECT_EQ(checkpoint.files()[0]->metadata().at("origin"), "numpy");
  for (const auto& [name, shape] : std::vector<std::pair<std::string, Shape>>{
           {"f32", Shape{3, 4}}, {"f64", Shape{5}}, {"f16", Shape{1, 2, 3}}}) {
    std::vector<double> got = to_host<double>(*backend, load_tensor(*backend, checkpoint.require(name, shape), DType::F64));
    for (int64_t i = 0; i < shape.numel(); ++i) EXPECT_EQ(got[i], value_at(i)) << name << "[" << i << "]";
  }
  EXPECT_EQ(to_host<int32_t>(*backend, load_tensor(*backend, checkpoint.require("i32", Shape{4}), DType::I32)),
            (std::vector<int32_t>{0, -7, -14, -21}));
  EXPECT_EQ(to_host<int64_t>(*backend, load_tensor(*backend, checkpoint.require("i64", Shape{3}), DType::I64)),
            (std::vector<int64_t>{0, 1'000'000'000'000, 2'000'000'000'000}));
  EXPECT_EQ(to_host<uint8_t>(*backend, load_tensor(*backend, checkpoint.require("u8", Shape{5}), DType::U8)),
            (std::vector<uint8_t>{0, 50, 100, 150, 200}));
  EXPECT_EQ(to_host<uint8_t>(*backend, load_tensor(*backend, checkpoint.require("flags", Shape{3}), DType::U8)),
            (std::vector<uint8_t>{1, 0, 1}));
  EXPECT_EQ(checkpoint.require("empty", Shape{0, 3}).bytes, 0u);
}

TEST(PythonInterop, PythonLoadsFileWrittenHere) {
  REQUIRE_PYTHON_SAFETENSORS();
  ScratchDir dir;
  auto backend = make_cpu_backend(1);
  auto values = [](int64_t n) {
    std::vector<double> v(n);
    for (int64_t i = 0; i < n; ++i) v[i] = value_at(i);
    return v;
  };
  auto as = [&](Shape shape, DType dtype) {
    Tensor staged = host_tensor<double>(*backend, shape, DType::F64, values(shape.numel()));
    Tensor t = backend->empty(shape, dtype);
    backend->copy(backend->default_stream(), staged, t);
    return t;
  };
  NamedTensors tensors = {
      {"f32", as(Shape{3, 4}, DType::F32)},
      {"f64", as(Shape{5}, DType::F64)},
      {"f16", as(Shape{1, 2, 3}, DType::F16)},
      {"i32", host_tensor<int32_t>(*backend, Shape{4}, DType::I32, {0, -7, -14, -21})},
      {"i64", host_tensor<int64_t>(*backend, Shape{3}, DType::I64, {0, 1'000'000'000'000, 2'000'000'000'000})},
      {"u8", host_tensor<uint8_t>(*backend, Shape{5}, DType::U8, {0, 50, 100, 150, 200})},
      {"empty", backend->empty(Shape{0, 3}, DType::F32)},
  };
  write_safetensors(dir.file("cpp.safetensors"), tensors, *backend, {{"format", "pt"}, {"origin", "spindle"}});
  write_safetensors(dir.file("bf16.safetensors"), {{"b", as(Shape{2, 7}, DType::BF16)}}, *backend);

  // numpy has no bfloat16: that file goes through the raw deserializer, which still runs the
  // reference validation of the header and layout.
  const std::string script = R"(
import sys, numpy as np
from safetensors import safe_open, deserialize
from safetensors.numpy import load_file
v = lambda n: (np.arange(n) % 13) * 0.25 - 1.5
t = load_file(sys.argv[1])
expected = {
    "f32": v(12).reshape(3, 4).astype(np.float32),
    "f64": v(5).astype(np.float64),
    "f16": v(6).reshape(1, 2, 3).astype(np.float16),
    "i32": (np.arange(4) * -7).astype(np.int32),
    "i64": (np.arange(3) * 10**12).astype(np.int64),
    "u8": np.arange(5).astype(np.uint8) * 50,
    "empty": np.zeros((0, 3), np.float32),
}
assert sorted(t) == sorted(expected), sorted(t)
for name, want in expected.items():
    assert t[name].dtype == want.dtype, (name, t[name].dtype)
    assert t[name].shape == want.shape, (name, t[name].shape)
    assert np.array_equal(t[name], want), (name, t[name])
with safe_open(sys.argv[1], framework="numpy") as f:
    assert f.metadata() == {"format": "pt", "origin": "spindle"}, f.metadata()
[(name, info)] = deserialize(open(sys.argv[2], "rb").read())
assert name == "b" and info["dtype"] == "BF16" and list(info["shape"]) == [2, 7], info
bits = (v(14).astype(np.float32).view(np.uint32) >> 16).astype("<u2").tobytes()
assert bytes(info["data"]) == bits
print("python checks passed")
)";
  std::string output;
  ASSERT_EQ(run_python(dir, script, "'" + dir.file("cpp.safetensors") + "' '" + dir.file("bf16.safetensors") + "'",
                       &output),
            0)
      << output;
  EXPECT_TRUE(contains(output, "python checks passed"));
}

TEST(PythonInterop, SameBytesAsPythonWriter) {
  REQUIRE_PYTHON_SAFETENSORS();
  ScratchDir dir;
  // The Python writer orders tensors by dtype alignment, then name; given in that order, the two
  // writers must produce identical files (header spacing, padding, offsets).
  const std::string script = R"(
import sys, numpy as np
from safetensors.numpy import save_file
save_file({"a.weight": np.arange(6, dtype=np.float32).reshape(2, 3),
           "b": np.arange(3, dtype=np.float32) - 7},
          sys.argv[1], metadata={"format": "pt"})
)";
  std::string output;
  ASSERT_EQ(run_python(dir, script, "'" + dir.file("py.safetensors") + "'", &output), 0) << output;
  auto backend = make_cpu_backend(1);
  write_safetensors(dir.file("cpp.safetensors"),
                    {{"a.weight", host_tensor<float>(*backend, Shape{2, 3}, DType::F32, {0, 1, 2, 3, 4, 5})},
                     {"b", host_tensor<float>(*backend, Shape{3}, DType::F32, {-7, -6, -5})}},
                    *backend, {{"format", "pt"}});
  EXPECT_EQ(read_bytes(dir.file("cpp.safetensors")), read_bytes(dir.file("py.safetensors")));
}

TEST(PythonInterop, PythonReadsShardedFolderWrittenHere) {
  REQUIRE_PYTHON_SAFETENSORS();
  ScratchDir dir;
  auto backend = make_cpu_backend(1);
  NamedTensors tensors;
  for (int i = 0; i < 5; ++i) {
    std::vector<float> v(8);
    for (int j = 0; j < 8; ++j) v[j] = static_cast<float>(i * 10 + j);
    tensors.emplace_back("model.layers." + std::to_string(i) + ".w", host_tensor<float>(*backend, Shape{8}, DType::F32, v));
  }
  const std::string folder = dir.file("model");
  write_sharded_safetensors(folder, tensors, *backend, 64);
  // What transformers does with a sharded folder: follow the index, open each shard, check format.
  const std::string script = R"(
import sys, json, os, numpy as np
from safetensors import safe_open
folder = sys.argv[1]
index = json.load(open(os.path.join(folder, "model.safetensors.index.json")))
assert index["metadata"]["total_size"] == 5 * 32, index
assert len(set(index["weight_map"].values())) == 3, index
for name, shard in index["weight_map"].items():
    with safe_open(os.path.join(folder, shard), framework="numpy") as f:
        assert f.metadata()["format"] == "pt"
        i = int(name.split(".")[2])
        assert np.array_equal(f.get_tensor(name), np.arange(8, dtype=np.float32) + 10 * i), name
print("python checks passed")
)";
  std::string output;
  ASSERT_EQ(run_python(dir, script, "'" + folder + "'", &output), 0) << output;
  EXPECT_TRUE(contains(output, "python checks passed"));
}
