// Helpers shared by the io tests: scratch folders, hand-made safetensors files (to build the corrupt
// ones no writer would produce) and a Python runner for the reference library.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"

namespace spindle::io::testing {

// A fresh folder per test under the system temp dir, removed afterwards.
class ScratchDir {
 public:
  ScratchDir() {
    static std::atomic<int> counter{0};
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = std::filesystem::temp_directory_path() /
            ("spindle_io_" + std::to_string(::getpid()) + "_" + std::to_string(counter++) + "_" +
             (info ? std::string(info->name()) : "x"));
    std::filesystem::create_directories(path_);
  }
  ~ScratchDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  std::string file(const std::string& name) const { return (path_ / name).string(); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline void write_bytes(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

inline std::string read_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// 8-byte length + header text + `data_bytes` bytes of data (byte i holds i & 0xff).
inline std::string raw_safetensors(const std::string& header, size_t data_bytes) {
  std::string out(8, '\0');
  uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  out += header;
  for (size_t i = 0; i < data_bytes; ++i) out.push_back(static_cast<char>(i & 0xff));
  return out;
}

// Substring check whose failure shows the whole text (error messages are the thing under test).
inline ::testing::AssertionResult contains(const std::string& text, const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << "\"" << part << "\" not found in \"" << text << "\"";
}

// The message of the spindle::Error that `body` throws ("" if it throws none).
template <typename F>
std::string error_of(F&& body) {
  try {
    body();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

template <typename T>
Tensor host_tensor(Backend& backend, Shape shape, DType dtype, const std::vector<T>& values) {
  Tensor t = backend.empty(shape, dtype);
  EXPECT_EQ(values.size() * sizeof(T), t.bytes());
  backend.copy_from_host(backend.default_stream(), values.data(), t);
  return t;
}

template <typename T>
std::vector<T> to_host(Backend& backend, const Tensor& t) {
  std::vector<T> out(t.bytes() / sizeof(T));
  backend.copy_to_host(backend.default_stream(), t, out.data());
  return out;
}

inline bool python_safetensors_available() {
  return std::system("python3 -c 'import numpy, safetensors.numpy' >/dev/null 2>&1") == 0;
}

// Runs `script` with python3 in `dir`, arguments appended; returns its exit status and output.
inline int run_python(const ScratchDir& dir, const std::string& script, const std::string& args, std::string* output) {
  const std::string script_path = dir.file("script.py"), output_path = dir.file("python_output.txt");
  write_bytes(script_path, script);
  int status = std::system(("python3 '" + script_path + "' " + args + " >'" + output_path + "' 2>&1").c_str());
  *output = read_bytes(output_path);
  return status;
}

}  // namespace spindle::io::testing
