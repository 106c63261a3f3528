// Shared helpers of the tokenizer tests: the published tokenizer folders (SPINDLE_TEST_TOKENIZERS,
// tests/support/reference_data.h), loaded once per process, and the HF `tokenizers` oracle
// (tests/tokenizer/hf_oracle.py) run as a subprocess.
#pragma once

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer/tokenizer.h"
#include "support/reference_data.h"

namespace spindle::test {

// The published tokenizer folder `name` (qwen3, qwen2_5, llama3), or empty when it is not supplied.
inline std::string find_shipped(const std::string& name) {
  const auto file = reference_path(kTokenizerFolders, std::filesystem::path(name) / "tokenizer.json");
  return file.empty() ? std::string() : file.parent_path().string();
}

// Why find_shipped(name) is empty and how to supply the folder.
inline std::string missing_shipped(const std::string& name) {
  return missing_reference(kTokenizerFolders, std::filesystem::path(name) / "tokenizer.json");
}

inline constexpr const char* kNoPythonTokenizers =
    "python3 with the 'tokenizers' package (the HF oracle) is not available: pip install tokenizers";

// Loading a real tokenizer.json takes a while; tests share one instance per folder.
inline const Tokenizer& cached_tokenizer(const std::string& dir) {
  static std::mutex mutex;
  static std::map<std::string, std::unique_ptr<Tokenizer>> loaded;
  std::lock_guard lock(mutex);
  auto& slot = loaded[dir];
  if (!slot) slot = std::make_unique<Tokenizer>(Tokenizer::load(dir));
  return *slot;
}

inline std::filesystem::path scratch_dir(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() /
             ("spindle_tokenizer_test_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::create_directories(dir);
  return dir;
}

inline std::string oracle_script() { return std::string(SPINDLE_SOURCE_DIR) + "/tests/tokenizer/hf_oracle.py"; }

// Runs a shell command; returns its exit status.
inline int run_shell(const std::string& command) {
  const int status = std::system(command.c_str());
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// nullopt when Python or its `tokenizers` package is missing (the caller skips).
inline std::optional<std::vector<nlohmann::json>> oracle_encode(const std::string& tokenizer_dir,
                                                                const std::vector<std::string>& texts,
                                                                const std::string& tag) {
  const auto dir = scratch_dir(tag);
  const auto input = dir / "texts.jsonl", output = dir / "expected.jsonl";
  {
    std::ofstream out(input, std::ios::binary);
    for (const std::string& text : texts) out << nlohmann::json({{"text", text}}).dump() << "\n";
  }
  const int rc = run_shell("python3 " + oracle_script() + " encode --tokenizer '" + tokenizer_dir + "' < '" +
                           input.string() + "' > '" + output.string() + "'");
  if (rc == 3 || rc == 127) return std::nullopt;
  EXPECT_EQ(rc, 0) << "hf_oracle.py encode failed for " << tokenizer_dir;
  std::vector<nlohmann::json> expected;
  std::ifstream in(output, std::ios::binary);
  std::string line;
  while (std::getline(in, line)) expected.push_back(nlohmann::json::parse(line));
  std::filesystem::remove_all(dir);
  return expected;
}

// A tokenizer folder made by the oracle from a shipped one with one feature changed; empty when
// the oracle is unavailable.
inline std::string oracle_variant(const std::string& base_dir, const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("spindle_tokenizer_variant_" + std::to_string(::getpid()) + "_" + name);
  if (std::filesystem::exists(dir / "tokenizer.json")) return dir.string();
  const int rc = run_shell("python3 " + oracle_script() + " variant --base '" + base_dir + "' --name " + name +
                           " --out '" + dir.string() + "'");
  if (rc == 3 || rc == 127) return {};
  EXPECT_EQ(rc, 0) << "hf_oracle.py variant " << name << " failed";
  return dir.string();
}

inline bool python_tokenizers_available() {
  static const bool available = run_shell("python3 -c 'import tokenizers' 2>/dev/null") == 0;
  return available;
}

}  // namespace spindle::test
