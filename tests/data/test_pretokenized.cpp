#include <gtest/gtest.h>

#include "data/pretokenized.h"
#include "data_test_util.h"

using namespace spindle;
using spindle::testing::ScratchDir;
using json = nlohmann::json;

namespace {
constexpr int32_t X = kIgnoreIndex;
}

TEST(Pretokenized, InputIdsOnlyIsAllSupervised) {
  Document doc = parse_pretokenized(json::parse(R"({"input_ids": [5, 6, 7], "id": "x"})"));
  EXPECT_EQ(doc.input_ids, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_EQ(doc.labels, (std::vector<int32_t>{5, 6, 7}));
  EXPECT_TRUE(doc.loss_scale.empty());
}

TEST(Pretokenized, LabelsKeepHuggingFaceAlignment) {
  Document doc =
      parse_pretokenized(json::parse(R"({"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]})"));
  EXPECT_EQ(doc.labels, (std::vector<int32_t>{X, X, 7, 8}));
}

TEST(Pretokenized, LossMaskSelectsSupervisedTokens) {
  Document doc = parse_pretokenized(
      json::parse(R"({"input_ids": [5, 6, 7, 8], "loss_mask": [0, 1, true, false]})"));
  EXPECT_EQ(doc.labels, (std::vector<int32_t>{X, 6, 7, X}));
}

TEST(Pretokenized, LossScalePerToken) {
  Document doc = parse_pretokenized(json::parse(
      R"({"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1], "loss_scale": [0, 0.5, 2]})"));
  EXPECT_EQ(doc.loss_scale, (std::vector<float>{0.0f, 0.5f, 2.0f}));
}

TEST(Pretokenized, RejectsEveryMalformedSampleWithTheFieldAtFault) {
  struct Case {
    const char* sample;
    const char* message;
  };
  const Case cases[] = {
      {R"({"text": "a"})", "missing field 'input_ids'"},
      {R"({"input_ids": []})", "'input_ids' is empty"},
      {R"({"input_ids": "1 2 3"})", "'input_ids' must be an array"},
      {R"({"input_ids": [1, 2.5]})", "input_ids[1] must be an integer"},
      {R"({"input_ids": [1, "2"]})", "input_ids[1] must be an integer"},
      {R"({"input_ids": [1, -3]})", "input_ids[1] = -3 is not a valid token id"},
      {R"({"input_ids": [1, 4294967296]})", "input_ids[1] = 4294967296"},
      {R"({"input_ids": [1, 2], "labels": [1]})", "'labels' has 1 entries but 'input_ids' has 2"},
      {R"({"input_ids": [1, 2], "labels": [-100, -5]})", "labels[1] = -5 is neither -100"},
      {R"({"input_ids": [1, 2, 3], "labels": [2, 3, -100]})", "labels[0] = 2 differs from input_ids[0] = 1"},
      {R"({"input_ids": [1, 2], "loss_mask": [0, 2]})", "loss_mask[1] = 2 must be 0 or 1"},
      {R"({"input_ids": [1, 2], "loss_mask": [0]})", "'loss_mask' has 1 entries"},
      {R"({"input_ids": [1, 2], "labels": [1, 2], "loss_mask": [1, 1]})", "not both"},
      {R"({"input_ids": [1, 2], "loss_scale": [1, -1]})", "loss_scale[1] = -1 must be finite and >= 0"},
      {R"({"input_ids": [1, 2], "loss_scale": [1, "x"]})", "loss_scale[1] must be a number"},
      {R"({"input_ids": [1, 2], "loss_scale": [1]})", "'loss_scale' has 1 entries"},
      {R"({"input_ids": [1, 2], "attention_mask": [1, 0]})", "attention_mask[1] = 0: padded samples"},
  };
  for (const auto& c : cases)
    EXPECT_THROW_WITH(parse_pretokenized(json::parse(c.sample)), BadSample, c.message);
}

TEST(Pretokenized, VocabularyBoundAndLabelMismatchOptIn) {
  ReadOptions options;
  options.vocab_size = 10;
  EXPECT_THROW_WITH(parse_pretokenized(json::parse(R"({"input_ids": [1, 10]})"), options), BadSample,
                    "input_ids[1] = 10 is outside the vocabulary [0, 10)");
  EXPECT_NO_THROW(parse_pretokenized(json::parse(R"({"input_ids": [1, 9]})"), options));
  options.require_labels_match_input_ids = false;
  Document doc = parse_pretokenized(json::parse(R"({"input_ids": [1, 2], "labels": [3, -100]})"), options);
  EXPECT_EQ(doc.labels, (std::vector<int32_t>{3, X}));
  EXPECT_NO_THROW(parse_pretokenized(json::parse(R"({"input_ids": [1], "attention_mask": [1]})")));
}

TEST(Pretokenized, ReadsFileWithSkipsCountedAndNothingElseLost) {
  ScratchDir dir;
  auto file = dir.write("pre.jsonl",
                        "{\"input_ids\": [1, 2, 3]}\n"
                        "{\"input_ids\": [1, 2], \"labels\": [1]}\n"
                        "{\"input_ids\": [4], \"loss_mask\": [1]}\n");
  EXPECT_THROW_WITH(read_pretokenized_jsonl(file), Error, "pre.jsonl:2:", "'labels' has 1 entries");
  ReadOptions options;
  options.on_bad_sample = BadSamplePolicy::kSkip;
  ReadStats stats;
  auto docs = read_pretokenized_jsonl(file, options, &stats);
  ASSERT_EQ(docs.size(), 2u);
  EXPECT_EQ(docs[0].input_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(docs[1].input_ids, (std::vector<int32_t>{4}));
  EXPECT_EQ(stats.samples, 2);
  EXPECT_EQ(stats.skipped, 1);
}
