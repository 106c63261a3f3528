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
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer/pre_tokenizer.h"
#include "data/tokenizer/tokenizer.h"
#include "data/tokenizer/utf8.h"
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

// Every line of a JSONL file, parsed.
inline std::vector<nlohmann::json> read_jsonl(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << "cannot read " << path;
  std::vector<nlohmann::json> rows;
  std::string line;
  while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

// The "text" of every line of a JSONL file.
inline std::vector<std::string> read_texts(const std::filesystem::path& path) {
  std::vector<std::string> texts;
  for (const auto& row : read_jsonl(path)) texts.push_back(row["text"].get<std::string>());
  return texts;
}

inline std::vector<std::string> corpus_texts() {
  return read_texts(std::string(SPINDLE_SOURCE_DIR) + "/tests/tokenizer/corpus.jsonl");
}

// HF's Oniguruma knows Unicode 16; the system PCRE2 (10.42) knows Unicode 14. Characters assigned
// since then are letters to HF and unassigned to spindle, so random text keeps to code points
// that PCRE2 knows (docs/formats.md, Tokenizer: Unicode version).
inline bool assigned_in_pcre2_unicode(char32_t cp) {
  static const tokenizer::Regex unassigned(R"(\p{Cn})", false);
  std::string text;
  tokenizer::append_utf8(text, cp);
  std::vector<std::pair<uint32_t, uint32_t>> matches;
  unassigned.find_all(text, matches);
  return matches.empty();
}

// Random strings from a fixed seed, drawn from the character classes where tokenizers disagree:
// whitespace kinds, combining marks, Hangul jamo, emoji with ZWJ and skin tones, digits of many
// scripts, apostrophes and 'ſ', fragments of special tokens, and arbitrary scalar values.
inline std::vector<std::string> fuzz_texts(size_t count, uint32_t seed) {
  std::mt19937 rng(seed);
  const std::vector<std::vector<char32_t>> classes = {
      {'a', 'b', 'e', 's', 't', 'S', 'T', 'L', 'x', 'Z'},
      {'0', '1', '5', '9', 0x0663, 0x0966, 0x0E53, 0xFF11, 0x2460, 0x00BD},
      {' ', ' ', ' ', '\t', '\n', '\r', 0x0B, 0x0C, 0x85, 0xA0, 0x3000, 0x2028, 0x2009, 0x200B},
      {'\'', 0x2019, 0x017F, '.', ',', '!', '?', '-', '_', '(', ')', '"', '#', '<', '|', '>'},
      {0x0300, 0x0301, 0x0308, 0x0323, 0x0327, 0x0345, 0x20DD, 0x3099, 0x302A},
      {0x1100, 0x1161, 0x11A8, 0xAC00, 0xAC01, 0x0B47, 0x0B3E, 0x212B, 0x2126, 0xFB01, 0x00C5},
      {0x1F600, 0x1F44D, 0x1F3FD, 0x200D, 0x1F469, 0x1F4BB, 0xFE0F, 0x2764, 0x1F1FA, 0x1F1F8},
      {0x4E2D, 0x6587, 0x3042, 0x30AB, 0x0410, 0x0430, 0x03A3, 0x03C2, 0x0627, 0x0928, 0x0E01, 0x1780},
  };
  const std::vector<std::string> fragments = {
      "<|im_start|>", "<|im_end|>", "<|im_sta", "|>", "<|", "<|begin_of_text|>", "<|endoftext|>", "<think>", "'ll",
      "'S", "<s>", "</s>", "[INST]", "[/INST]", "<bos>", "<start_of_turn>", "<|user|>", "<|end|>", "<|start|>",
      "<|return|>", "<0x41>", "\u2581"};
  std::vector<std::string> texts;
  for (size_t n = 0; n < count; ++n) {
    std::string text;
    const int length = std::uniform_int_distribution<int>(0, 40)(rng);
    for (int i = 0; i < length; ++i) {
      const int kind = std::uniform_int_distribution<int>(0, 11)(rng);
      if (kind < 8) {
        const auto& cls = classes[kind];
        tokenizer::append_utf8(text, cls[std::uniform_int_distribution<size_t>(0, cls.size() - 1)(rng)]);
      } else if (kind == 8) {
        text += fragments[std::uniform_int_distribution<size_t>(0, fragments.size() - 1)(rng)];
      } else {
        // Any scalar value: skip surrogates, which UTF-8 cannot carry.
        char32_t cp;
        do {
          cp = kind == 9 ? std::uniform_int_distribution<char32_t>(0x20, 0x2FFF)(rng)
                         : std::uniform_int_distribution<char32_t>(0x20, 0x10FFFF)(rng);
        } while ((cp >= 0xD800 && cp <= 0xDFFF) || !assigned_in_pcre2_unicode(cp));
        tokenizer::append_utf8(text, cp);
      }
    }
    texts.push_back(std::move(text));
  }
  return texts;
}

inline bool is_char_boundary(const std::string& text, size_t pos) {
  return pos >= text.size() || (static_cast<unsigned char>(text[pos]) & 0xC0) != 0x80;
}

// Compares ids (with and without special tokens), decodings and offsets of every text with what
// HF gave (hf_oracle.py's format); reports at most a few mismatching texts in full.
inline void expect_matches_hf(const Tokenizer& tokenizer, const std::vector<std::string>& texts,
                              const std::vector<nlohmann::json>& expected, const std::string& tag,
                              bool compare_offsets = true) {
  ASSERT_EQ(expected.size(), texts.size()) << tag;
  int reported = 0;
  size_t checked_tokens = 0;
  for (size_t i = 0; i < texts.size() && reported < 5; ++i) {
    const std::string& text = texts[i];
    const nlohmann::json& want = expected[i];
    const Encoding encoding = tokenizer.encode_with_offsets(text);
    const auto ids_want = want["ids"].get<std::vector<int32_t>>();
    checked_tokens += ids_want.size();
    if (encoding.ids != ids_want) {
      ADD_FAILURE() << tag << " text #" << i << " " << nlohmann::json(text).dump() << "\n  spindle: "
                    << nlohmann::json(encoding.ids).dump() << "\n  HF:      " << want["ids"].dump();
      ++reported;
      continue;
    }
    EXPECT_EQ(tokenizer.encode(text), ids_want) << tag << " text #" << i;
    EXPECT_EQ(tokenizer.encode(text, false), want["ids_plain"].get<std::vector<int32_t>>()) << tag << " text #" << i;
    EXPECT_EQ(tokenizer.decode(encoding.ids, false), want["decoded"].get<std::string>()) << tag << " text #" << i;
    EXPECT_EQ(tokenizer.decode(encoding.ids, true), want["decoded_skip"].get<std::string>()) << tag << " text #" << i;
    if (!compare_offsets) continue;
    ASSERT_EQ(encoding.offsets.size(), encoding.ids.size());
    // HF offsets count characters, so a token holding part of a character gets the whole
    // character; spindle's byte spans are exact. Where normalization changed the text both are
    // approximate in different ways, so only ids are compared there.
    const std::string normalized_check = tokenizer.decode(tokenizer.encode(text, false), false);
    const bool unchanged_by_normalizer = normalized_check == text;
    for (size_t t = 0; t < encoding.ids.size(); ++t) {
      const ByteSpan ours = encoding.offsets[t];
      const auto theirs = want["offsets"][t];
      const size_t begin = theirs[0].get<size_t>(), end = theirs[1].get<size_t>();
      ASSERT_LE(ours.begin, ours.end) << tag << " text #" << i << " token " << t;
      ASSERT_LE(ours.end, text.size()) << tag << " text #" << i << " token " << t;
      if (!unchanged_by_normalizer) continue;
      const bool whole_chars = is_char_boundary(text, ours.begin) && is_char_boundary(text, ours.end);
      if (whole_chars && ours.begin != ours.end) {
        EXPECT_EQ(ours, (ByteSpan{begin, end})) << tag << " text #" << i << " " << nlohmann::json(text).dump()
                                                << " token " << t << " id " << encoding.ids[t];
      } else if (ours.begin != ours.end) {
        EXPECT_TRUE(begin <= ours.begin && ours.end <= end)
            << tag << " text #" << i << " token " << t << ": [" << ours.begin << "," << ours.end << ") not inside ["
            << begin << "," << end << ")";
      }
    }
  }
  EXPECT_GT(checked_tokens, texts.size()) << "the oracle returned almost no tokens: the comparison proves nothing";
}


// The same against HF `tokenizers` run now through hf_oracle.py (skips without Python).
inline void expect_same_as_hf(const std::string& dir, const std::vector<std::string>& texts, const std::string& tag,
                              bool compare_offsets = true) {
  if (!python_tokenizers_available()) SPINDLE_SKIP_WITHOUT_REFERENCE(kNoPythonTokenizers);
  auto expected = oracle_encode(dir, texts, tag);
  if (!expected) SPINDLE_SKIP_WITHOUT_REFERENCE(kNoPythonTokenizers);
  expect_matches_hf(cached_tokenizer(dir), texts, *expected, tag, compare_offsets);
}

}  // namespace spindle::test
