#include <gtest/gtest.h>

#include <filesystem>

#include "data/sample_encoder.h"
#include "data_test_util.h"

using namespace spindle;
using json = nlohmann::json;

namespace {

constexpr int32_t X = kIgnoreIndex;

// One token per byte (id = byte value + 10); BOS 1 when special tokens are added; EOS 2.
class ByteEncoder final : public TextEncoder {
 public:
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int32_t> ids;
    if (add_special_tokens) ids.push_back(1);
    for (unsigned char c : text) ids.push_back(c + 10);
    return ids;
  }
  std::optional<int32_t> eos_token_id() const override { return 2; }
  int64_t vocab_size() const override { return 266; }
};

int32_t t(char c) { return static_cast<unsigned char>(c) + 10; }

}  // namespace

TEST(SampleEncoder, TextIsAllSupervisedWithEos) {
  ByteEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  Document d = encoder.encode(json::parse(R"({"text": "ab"})"));
  EXPECT_EQ(d.input_ids, (std::vector<int32_t>{1, t('a'), t('b'), 2}));
  EXPECT_EQ(d.labels, d.input_ids);
  EXPECT_TRUE(d.loss_scale.empty());
  EncodeOptions no_eos;
  no_eos.append_eos = false;
  EXPECT_EQ(SampleEncoder(&bytes, no_eos).encode(json::parse(R"({"text": "ab"})")).input_ids,
            (std::vector<int32_t>{1, t('a'), t('b')}));
}

TEST(SampleEncoder, PromptIsNotSupervised) {
  ByteEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  Document d = encoder.encode(json::parse(R"({"prompt": "Q", "completion": "A"})"));
  EXPECT_EQ(d.input_ids, (std::vector<int32_t>{1, t('Q'), t('A'), 2}));
  EXPECT_EQ(d.labels, (std::vector<int32_t>{X, X, t('A'), 2}));
}

TEST(SampleEncoder, PretokenizedNeedsNoTokenizerButIsCheckedAgainstItsVocabulary) {
  SampleEncoder without(nullptr, {});
  EXPECT_EQ(without.encode(json::parse(R"({"input_ids": [300, 4]})")).input_ids,
            (std::vector<int32_t>{300, 4}));
  ByteEncoder bytes;
  SampleEncoder with(&bytes, {});
  EXPECT_THROW_WITH(with.encode(json::parse(R"({"input_ids": [300, 4]})")), BadSample,
                    "outside the vocabulary [0, 266)");
  EXPECT_THROW_WITH(without.encode(json::parse(R"({"text": "a"})")), Error, "need a tokenizer",
                    "--tokenizer");
}

TEST(SampleEncoder, ConversationsSayRenderingIsNotAvailableYetAfterCheckingContent) {
  ByteEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  EXPECT_THROW_WITH(encoder.encode(json::parse(R"({"messages": [{"role": "user", "content": "q"}]})")),
                    Error, "messages samples are rendered with the model's chat template",
                    "not available");
  EXPECT_THROW_WITH(encoder.encode(json::parse(R"({"messages": []})")), BadSample, "empty conversation");
  EXPECT_THROW_WITH(encoder.encode(json::parse(R"({"instruction": "q", "output": "a"})")), Error,
                    "alpaca samples");
}

TEST(SampleEncoder, ForcedFormatAndPreferenceMismatch) {
  ByteEncoder bytes;
  EncodeOptions options;
  options.format = SampleFormat::kText;
  SampleEncoder encoder(&bytes, options);
  // Forced text ignores the other fields.
  EXPECT_EQ(encoder.encode(json::parse(R"({"text": "a", "prompt": "p"})")).input_ids,
            (std::vector<int32_t>{1, t('a'), 2}));
  SampleEncoder auto_encoder(&bytes, {});
  EXPECT_THROW_WITH(auto_encoder.encode(json::parse(R"({"prompt": "p", "chosen": "a", "rejected": "b"})")),
                    Error, "preference pair");
  EXPECT_THROW_WITH(auto_encoder.encode_preference(json::parse(R"({"text": "a"})")), Error,
                    "expected preference pairs", "text data");
}

TEST(SampleEncoder, PreferenceTextPairSharesThePrompt) {
  ByteEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  auto pair = encoder.encode_preference(json::parse(R"({"prompt": "P", "chosen": "c", "rejected": "rr"})"));
  EXPECT_EQ(pair.chosen.input_ids, (std::vector<int32_t>{1, t('P'), t('c'), 2}));
  EXPECT_EQ(pair.chosen.labels, (std::vector<int32_t>{X, X, t('c'), 2}));
  EXPECT_EQ(pair.rejected.input_ids, (std::vector<int32_t>{1, t('P'), t('r'), t('r'), 2}));
  EXPECT_EQ(pair.rejected.labels, (std::vector<int32_t>{X, X, t('r'), t('r'), 2}));
}

// With the real Qwen3 tokenizer (no BOS, EOS "<|im_end|>"), when the shared test data is present.
TEST(SampleEncoder, RealTokenizerPromptCompletion) {
  const std::filesystem::path dir = std::filesystem::path(SPINDLE_SOURCE_DIR) / "../shared/tokenizers/qwen3";
  if (!std::filesystem::exists(dir / "tokenizer.json")) GTEST_SKIP() << "no " << dir;
  auto tokenizer = load_text_encoder(dir);
  SampleEncoder encoder(tokenizer.get(), {});
  Document d = encoder.encode(json::parse(R"({"prompt": "Hello", "completion": " world"})"));
  const auto prompt = tokenizer->encode("Hello", true);
  const auto completion = tokenizer->encode(" world", false);
  ASSERT_TRUE(tokenizer->eos_token_id());
  ASSERT_EQ(d.input_ids.size(), prompt.size() + completion.size() + 1);
  EXPECT_EQ(d.input_ids.back(), *tokenizer->eos_token_id());
  for (size_t i = 0; i < prompt.size(); ++i) EXPECT_EQ(d.labels[i], X);
  for (size_t i = prompt.size(); i < d.input_ids.size(); ++i) EXPECT_EQ(d.labels[i], d.input_ids[i]);
}
