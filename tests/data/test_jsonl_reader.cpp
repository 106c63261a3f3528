#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "data/jsonl_reader.h"
#include "data_test_util.h"

using namespace spindle;
using spindle::testing::ScratchDir;

namespace {

std::vector<std::string> all_lines(const std::filesystem::path& file, size_t block) {
  JsonlReader reader(file, block);
  std::vector<std::string> lines;
  std::string_view line;
  while (reader.next_line(line)) {
    lines.emplace_back(line);
    EXPECT_EQ(reader.line_number(), static_cast<int64_t>(lines.size()));
  }
  EXPECT_EQ(reader.bytes_consumed(), reader.file_bytes());
  return lines;
}

}  // namespace

TEST(JsonlReader, SplitsLinesAcrossBlockBoundariesAndGrowsForLongLines) {
  ScratchDir dir;
  std::string content;
  std::vector<std::string> expected;
  for (int i = 0; i < 200; ++i) {
    expected.push_back(std::string(static_cast<size_t>(i * 7 % 53), 'a' + i % 26));
    content += expected.back() + (i % 3 == 0 ? "\r\n" : "\n");
  }
  expected.push_back("last line without newline, longer than the smallest block size");
  content += expected.back();
  auto file = dir.write("lines.jsonl", content);
  // Block sizes smaller than a line force the grow path; the largest reads all at once.
  for (size_t block : {16, 17, 64, 1000, 1 << 20}) EXPECT_EQ(all_lines(file, block), expected) << block;
}

TEST(JsonlReader, IgnoresByteOrderMarkAndHandlesEmptyFile) {
  ScratchDir dir;
  EXPECT_EQ(all_lines(dir.write("bom.jsonl", "\xEF\xBB\xBF{\"a\":1}\n{}\n"), 64),
            (std::vector<std::string>{"{\"a\":1}", "{}"}));
  EXPECT_TRUE(all_lines(dir.write("empty.jsonl", ""), 64).empty());
}

TEST(JsonlReader, MissingFileAndDirectoryAreClearErrors) {
  ScratchDir dir;
  EXPECT_THROW_WITH(JsonlReader(dir.path() / "nope.jsonl"), Error, "cannot open dataset",
                    "nope.jsonl");
  EXPECT_THROW_WITH(JsonlReader(dir.path()), Error, "is a directory");
}

TEST(ForEachJsonlSample, ReportsFileAndLineOfMalformedJson) {
  ScratchDir dir;
  auto file = dir.write("bad.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"b\",}\n{\"text\": \"c\"}\n");
  ReadStats stats;
  int seen = 0;
  EXPECT_THROW_WITH(for_each_jsonl_sample(file, {}, stats,
                                          [&](const nlohmann::json&, int64_t) { ++seen; }),
                    Error, "bad.jsonl:3:", "not valid JSON", "--skip-bad-samples");
  EXPECT_EQ(seen, 1);
}

TEST(ForEachJsonlSample, SkipPolicyCountsEveryKindOfBadLine) {
  ScratchDir dir;
  auto file = dir.write("mixed.jsonl",
                        "{\"text\": \"ok\"}\n"
                        "not json\n"
                        "[1, 2]\n"
                        "   \n"
                        "{\"text\": \"\xff\xfe\"}\n"  // invalid UTF-8 inside a string
                        "{\"other\": 1}\n"            // rejected by the handler
                        "{\"text\": 1e400}\n"         // number overflow
                        "{\"text\": \"fine\"}");
  ReadOptions options;
  options.on_bad_sample = BadSamplePolicy::kSkip;
  ReadStats stats;
  std::vector<std::pair<std::string, int64_t>> accepted;
  for_each_jsonl_sample(file, options, stats, [&](const nlohmann::json& sample, int64_t line) {
    if (!sample.contains("text")) bad_sample("missing field 'text'");
    accepted.emplace_back(sample["text"].get<std::string>(), line);
  });
  EXPECT_EQ(accepted, (std::vector<std::pair<std::string, int64_t>>{{"ok", 1}, {"fine", 8}}));
  EXPECT_EQ(stats.lines, 8);
  EXPECT_EQ(stats.blank_lines, 1);
  EXPECT_EQ(stats.samples, 2);
  EXPECT_EQ(stats.skipped, 5);
  ASSERT_EQ(stats.skip_examples.size(), 5u);
  EXPECT_NE(stats.skip_examples[0].find("mixed.jsonl:2: not valid JSON"), std::string::npos);
  EXPECT_NE(stats.skip_examples[1].find("mixed.jsonl:3: expected a JSON object"), std::string::npos);
  EXPECT_NE(stats.skip_examples[2].find("mixed.jsonl:5:"), std::string::npos);
  EXPECT_NE(stats.skip_examples[2].find("UTF-8"), std::string::npos) << stats.skip_examples[2];
  EXPECT_NE(stats.skip_examples[3].find("mixed.jsonl:6: missing field 'text'"), std::string::npos);
  EXPECT_NE(stats.skip_examples[4].find("mixed.jsonl:7: not valid JSON (number overflow"), std::string::npos)
      << stats.skip_examples[4];
  EXPECT_NE(stats.summary().find("skipped 5 bad samples"), std::string::npos) << stats.summary();
}

TEST(ForEachJsonlSample, OtherErrorsAreNeverSkipped) {
  ScratchDir dir;
  auto file = dir.write("a.jsonl", "{}\n{}\n");
  ReadOptions options;
  options.on_bad_sample = BadSamplePolicy::kSkip;
  ReadStats stats;
  EXPECT_THROW_WITH(for_each_jsonl_sample(file, options, stats,
                                          [](const nlohmann::json&, int64_t) { fail("disk full"); }),
                    Error, "disk full");
  EXPECT_EQ(stats.skipped, 0);
}

TEST(WithThousands, GroupsDigits) {
  EXPECT_EQ(with_thousands(0), "0");
  EXPECT_EQ(with_thousands(999), "999");
  EXPECT_EQ(with_thousands(1000), "1,000");
  EXPECT_EQ(with_thousands(-1234567), "-1,234,567");
}
