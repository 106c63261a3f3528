// Differential tests: spindle's ids, offsets and decodings against HF `tokenizers` (run at test
// time through hf_oracle.py) on the committed corpus and on random Unicode strings, for the three
// shipped tokenizers and for variants that exercise the features those files leave unused.
#include <gtest/gtest.h>

#include <fstream>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/tokenizer/pre_tokenizer.h"
#include "data/tokenizer/utf8.h"
#include "tokenizer_test_util.h"

namespace spindle::test {
namespace {

std::vector<std::string> corpus_texts() {
  std::ifstream in(std::string(SPINDLE_SOURCE_DIR) + "/tests/tokenizer/corpus.jsonl", std::ios::binary);
  std::vector<std::string> texts;
  std::string line;
  while (std::getline(in, line)) texts.push_back(nlohmann::json::parse(line)["text"].get<std::string>());
  return texts;
}

// HF's Oniguruma knows Unicode 16; the system PCRE2 (10.42) knows Unicode 14. Characters assigned
// since then are letters to HF and unassigned to spindle, so random text keeps to code points
// that PCRE2 knows (docs/formats.md, Tokenizer: Unicode version).
bool assigned_in_pcre2_unicode(char32_t cp) {
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
std::vector<std::string> fuzz_texts(size_t count, uint32_t seed) {
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
  const std::vector<std::string> fragments = {"<|im_start|>", "<|im_end|>", "<|im_sta", "|>", "<|",
                                              "<|begin_of_text|>", "<|endoftext|>", "<think>", "'ll", "'S"};
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

bool is_char_boundary(const std::string& text, size_t pos) {
  return pos >= text.size() || (static_cast<unsigned char>(text[pos]) & 0xC0) != 0x80;
}

// Compares everything for every text; reports at most a few mismatches in full.
void expect_same_as_hf(const std::string& dir, const std::vector<std::string>& texts, const std::string& tag,
                       bool compare_offsets = true) {
  if (!python_tokenizers_available()) SPINDLE_SKIP_WITHOUT_REFERENCE(kNoPythonTokenizers);
  auto expected = oracle_encode(dir, texts, tag);
  if (!expected) SPINDLE_SKIP_WITHOUT_REFERENCE(kNoPythonTokenizers);
  ASSERT_EQ(expected->size(), texts.size());
  const Tokenizer& tokenizer = cached_tokenizer(dir);
  int reported = 0;
  size_t checked_tokens = 0;
  for (size_t i = 0; i < texts.size() && reported < 5; ++i) {
    const std::string& text = texts[i];
    const nlohmann::json& want = (*expected)[i];
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

class ShippedTokenizer : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    folder = find_shipped(GetParam());
    if (folder.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped(GetParam()));
  }
  std::string folder;
};

TEST_P(ShippedTokenizer, CorpusMatchesHf) { expect_same_as_hf(folder, corpus_texts(), GetParam() + "_corpus"); }

TEST_P(ShippedTokenizer, RandomUnicodeMatchesHf) {
  expect_same_as_hf(folder, fuzz_texts(3000, 1234567), GetParam() + "_fuzz");
}

TEST_P(ShippedTokenizer, LongInputsMatchHf) {
  const auto texts = corpus_texts();
  std::string joined;
  for (const auto& text : texts) joined += text;
  std::vector<std::string> long_texts = {joined, std::string(100000, ' ') + "x", std::string(20000, '\n'),
                                         std::string(30000, '7'), "a" + std::string(5000, 'b')};
  expect_same_as_hf(folder, long_texts, GetParam() + "_long");
}

INSTANTIATE_TEST_SUITE_P(Families, ShippedTokenizer, ::testing::Values("qwen3", "qwen2_5", "llama3"));

struct VariantCase {
  std::string base;
  std::string variant;
};
// Readable test names in ctest instead of a byte dump.
void PrintTo(const VariantCase& c, std::ostream* os) { *os << c.base << "/" << c.variant; }

class VariantTokenizer : public ::testing::TestWithParam<VariantCase> {};

TEST_P(VariantTokenizer, MatchesHf) {
  const auto& param = GetParam();
  const std::string base = find_shipped(param.base);
  if (base.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped(param.base));
  if (!python_tokenizers_available()) SPINDLE_SKIP_WITHOUT_REFERENCE(kNoPythonTokenizers);
  const std::string dir = oracle_variant(base, param.variant);
  ASSERT_FALSE(dir.empty());
  auto texts = corpus_texts();
  const auto fuzz = fuzz_texts(800, 99);
  texts.insert(texts.end(), fuzz.begin(), fuzz.end());
  expect_same_as_hf(dir, texts, param.base + "_" + param.variant);
}

INSTANTIATE_TEST_SUITE_P(
    Features, VariantTokenizer,
    ::testing::Values(VariantCase{"qwen2_5", "added_flags"}, VariantCase{"llama3", "bos_template"},
                      VariantCase{"qwen3", "split_Removed"}, VariantCase{"qwen3", "split_Isolated_invert"},
                      VariantCase{"qwen3", "split_MergedWithPrevious"}, VariantCase{"qwen3", "split_MergedWithNext"},
                      VariantCase{"llama3", "split_Contiguous"}, VariantCase{"qwen2_5", "nfkc_trim"}),
    [](const auto& info) { return info.param.base + "_" + info.param.variant; });

}  // namespace
}  // namespace spindle::test
