#include <gtest/gtest.h>

#include <random>

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

namespace {

struct Outcome {
  std::optional<Document> doc;
  std::string error;  // set when parsing threw BadSample
};

Outcome tree_path(const std::string& line, const ReadOptions& options) {
  try {
    return {parse_pretokenized(parse_jsonl_line(line), options), ""};
  } catch (const BadSample& e) {
    return {std::nullopt, e.what()};
  }
}

bool same(const Document& a, const Document& b) {
  return a.input_ids == b.input_ids && a.labels == b.labels && a.loss_scale == b.loss_scale;
}

}  // namespace

TEST(PretokenizedFastPath, TakesTheCommonShapes) {
  for (const char* line : {R"({"input_ids": [1, 2, 3]})",
                           R"( { "input_ids" : [ 1 , 2 ] , "labels" : [ -100 , 2 ] } )",
                           R"({"id": "a\"b\\c\u00e9", "meta": {"x": [1, {"y": null}], "z": true}, "input_ids": [7]})",
                           R"({"input_ids": [1, 2], "loss_mask": [true, 0], "loss_scale": [0.5, 1e-3]})"}) {
    auto fast = parse_pretokenized_line(line);
    ASSERT_TRUE(fast.has_value()) << line;
    EXPECT_TRUE(same(*fast, *tree_path(line, {}).doc)) << line;
  }
  // Left to the JSON tree: non-ASCII text, nulls, another format's field, malformed JSON.
  for (const char* line : {R"({"input_ids": [1], "source": "é"})", R"({"input_ids": [1], "labels": null})",
                           R"({"input_ids": [1], "text": "a"})", R"({"input_ids": [1],})",
                           R"({"input_ids": [1]} x)", R"({"input_ids": [1.0]})", R"({"input_ids": [01]})",
                           R"({"input_ids": [1], "input_ids": [2]})", R"({"input_ids": [99999999999999999999]})",
                           R"({"input_ids": [1], "id": "\ud800"})"})
    EXPECT_FALSE(parse_pretokenized_line(line).has_value()) << line;
}

// Differential test: on random lines, whatever the fast path decides (a document or an error) is
// exactly what the JSON-tree path decides; it may only decline.
TEST(PretokenizedFastPath, AgreesWithTheJsonTreeOnRandomLines) {
  std::mt19937 rng(7);
  auto pick = [&](std::initializer_list<const char*> options) {
    return std::string(*(options.begin() + rng() % options.size()));
  };
  int accepted = 0, rejected = 0;
  for (int trial = 0; trial < 4000; ++trial) {
    const int n = static_cast<int>(rng() % 5);
    auto array = [&](std::initializer_list<const char*> values, int length) {
      std::string s = "[";
      for (int i = 0; i < length; ++i) s += (i ? pick({",", " , ", ","}) : "") + pick(values);
      return s + "]";
    };
    std::vector<std::string> fields;
    fields.push_back("\"input_ids\": " + array({"1", "2", "3", "1", "2", "3", "0", "-4", "7.5", "\"5\"", "2147483648", "9223372036854775808"}, n));
    if (rng() % 2) fields.push_back("\"labels\": " + array({"-100", "-100", "1", "2", "3", "-7", "1e2"}, n + (rng() % 8 == 0)));
    if (rng() % 3 == 0) fields.push_back("\"loss_mask\": " + array({"0", "1", "true", "false", "2", "0.5", "null"}, n));
    if (rng() % 3 == 0) fields.push_back("\"loss_scale\": " + array({"0.5", "1", "2E-1", "-1", "0", "1e400", "\"x\""}, n + (rng() % 8 == 0)));
    if (rng() % 5 == 0) fields.push_back("\"attention_mask\": " + array({"1", "1", "true", "0", "2"}, n));
    if (rng() % 4 == 0) fields.push_back(pick({"\"id\": \"x\\n\"", "\"meta\": {\"a\": [1, null]}", "\"n\": -0.5e3",
                                               "\"s\": \"\\u00e9\"", "\"bad\": tru", "\"labels\": null"}));
    std::shuffle(fields.begin(), fields.end(), rng);
    std::string line = pick({"{", " {", "{ "});
    for (size_t i = 0; i < fields.size(); ++i) line += (i ? pick({",", ", ", " ,"}) : "") + fields[i];
    line += pick({"}", " }", "} ", "}\t"});
    ReadOptions options;
    options.vocab_size = rng() % 2 ? 0 : 3;
    options.require_labels_match_input_ids = rng() % 2;

    const Outcome tree = tree_path(line, options);
    try {
      auto fast = parse_pretokenized_line(line, options);
      if (!fast) continue;
      ++accepted;
      ASSERT_TRUE(tree.doc.has_value()) << line << " — tree path: " << tree.error;
      EXPECT_TRUE(same(*fast, *tree.doc)) << line;
    } catch (const BadSample& e) {
      ++rejected;
      EXPECT_EQ(std::string(e.what()), tree.error) << line;
    }
  }
  // Both outcomes must be exercised for the comparison to mean anything.
  EXPECT_GT(accepted, 200);
  EXPECT_GT(rejected, 200);
}
