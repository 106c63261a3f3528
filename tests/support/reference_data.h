// Reference inputs that do not live in the repository: the tokenizer folders published with Qwen3,
// Qwen2.5 and Llama 3 (about 27 MB, under their publishers' licences) and a corpus of 196 published
// chat templates with transformers' Jinja environment. Each is named by an environment variable; a
// test that needs one that is not there is skipped with a message saying which variable to set, so a
// fresh clone passes `make test`. Where the data is present (CI: .ci/run sets the variables to the
// folders beside the checkout) SPINDLE_TEST_REQUIRE_DATA=1 turns each such skip into a failure, so
// the HF differential tests cannot silently stop running.
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <string>

namespace spindle::test {

struct ReferenceData {
  const char* variable;  // the environment variable naming the folder
  const char* contents;  // what the folder holds, for the skip message
};

inline constexpr ReferenceData kTokenizerFolders{
    "SPINDLE_TEST_TOKENIZERS",
    "a folder holding the Hugging Face tokenizer folders qwen3/, qwen2_5/ and llama3/ (each with tokenizer.json and "
    "tokenizer_config.json as published with Qwen3, Qwen2.5 and Llama 3)"};

inline constexpr ReferenceData kChatTemplateCorpus{
    "SPINDLE_TEST_CHAT_TEMPLATES",
    "the chat template corpus: templates/*.jinja (196 published templates), e2e_with_expected.json and hfenv.py "
    "(transformers' Jinja environment)"};

// The folder the variable names, or an empty path when it is unset or empty.
inline std::filesystem::path reference_root(const ReferenceData& data) {
  const char* value = std::getenv(data.variable);
  return value && *value ? std::filesystem::path(value) : std::filesystem::path();
}

// root/relative when the variable is set and that path exists; empty otherwise.
inline std::filesystem::path reference_path(const ReferenceData& data, const std::filesystem::path& relative) {
  const std::filesystem::path root = reference_root(data);
  if (root.empty()) return {};
  std::filesystem::path path = root / relative;
  return std::filesystem::exists(path) ? path : std::filesystem::path();
}

// Why `relative` is not available and how to supply it.
inline std::string missing_reference(const ReferenceData& data, const std::filesystem::path& relative) {
  const std::filesystem::path root = reference_root(data);
  if (root.empty())
    return std::string(data.variable) + " is not set: set it to " + data.contents + " to run this test";
  return (root / relative).string() + " does not exist; " + data.variable + " must name " + data.contents;
}

// SPINDLE_TEST_REQUIRE_DATA=1: a missing reference (data or the Python oracle) fails the test.
inline bool reference_data_required() {
  const char* value = std::getenv("SPINDLE_TEST_REQUIRE_DATA");
  return value && std::string(value) == "1";
}

}  // namespace spindle::test

// Ends the current test (or helper) for a missing reference: skipped, or failed when
// SPINDLE_TEST_REQUIRE_DATA=1.
#define SPINDLE_SKIP_WITHOUT_REFERENCE(reason)                                                     \
  do {                                                                                             \
    if (::spindle::test::reference_data_required())                                                \
      GTEST_FAIL() << (reason) << " (SPINDLE_TEST_REQUIRE_DATA=1: the reference must be present)"; \
    else                                                                                           \
      GTEST_SKIP() << (reason);                                                                    \
  } while (0)
