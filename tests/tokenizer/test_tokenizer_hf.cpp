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
