#include <gtest/gtest.h>

#include <filesystem>

#include "data/sample_encoder.h"
#include "byte_text_encoder.h"
#include "data_test_util.h"
#include "support/reference_data.h"

using namespace spindle;
using json = nlohmann::json;

namespace {

constexpr int32_t X = kIgnoreIndex;

using ByteEncoder = spindle::testing::ByteTextEncoder;

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

TEST(SampleEncoder, ConversationsAreRenderedWithTheChatTemplateAndBadContentIsABadSample) {
  ByteEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  const Document d = encoder.encode(json::parse(R"({"messages": [{"role": "user", "content": "q"},
                                                                {"role": "assistant", "content": "a"}]})"));
  const std::string text = "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\na<|im_end|>\n";
  ASSERT_EQ(d.input_ids, bytes.encode(text, false)) << "no BOS or EOS added: the template writes the turns";
  const size_t answer = text.find("a<|im_end|>");
  for (size_t i = 0; i < text.size(); ++i) EXPECT_EQ(d.labels[i], i >= answer ? d.input_ids[i] : X) << i;
  EXPECT_THROW_WITH(encoder.encode(json::parse(R"({"messages": []})")), BadSample, "empty conversation");
  EXPECT_EQ(encoder.encode(json::parse(R"({"instruction": "q", "output": "a"})")).input_ids, d.input_ids);
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

// With the published Qwen3 tokenizer (no BOS, EOS "<|im_end|>"), when SPINDLE_TEST_TOKENIZERS supplies it.
TEST(SampleEncoder, RealTokenizerPromptCompletion) {
  const auto file = test::reference_path(test::kTokenizerFolders, "qwen3/tokenizer.json");
  if (file.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(test::missing_reference(test::kTokenizerFolders, "qwen3/tokenizer.json"));
  const std::filesystem::path dir = file.parent_path();
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
