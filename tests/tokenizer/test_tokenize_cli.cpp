// `spindle tokenize`: JSONL in, ids out, one line per line; malformed lines name their number.
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "tokenizer_test_util.h"

namespace spindle::test {
namespace {

struct CliResult {
  int status;
  std::string out, err;
};

CliResult run_tokenize(const std::string& dir, const std::string& input, const std::string& flags = "") {
  const auto scratch = scratch_dir("cli");
  const auto in = scratch / "in.jsonl", out = scratch / "out.jsonl", err = scratch / "err.txt";
  std::ofstream(in, std::ios::binary) << input;
  const int status = run_shell(std::string(SPINDLE_TOKENIZE_DRIVER) + " tokenize --tokenizer '" + dir + "' " + flags + " < '" +
                               in.string() + "' > '" + out.string() + "' 2> '" + err.string() + "'");
  auto slurp = [](const std::filesystem::path& path) {
    std::ifstream file(path, std::ios::binary);
    std::stringstream buffer;
    buffer << file.rdbuf();
    return buffer.str();
  };
  CliResult result{status, slurp(out), slurp(err)};
  std::filesystem::remove_all(scratch);
  return result;
}

TEST(TokenizeCli, WritesTheIdsOfEachLine) {
  const std::string dir = find_shipped("llama3");
  if (dir.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped("llama3"));
  const Tokenizer& tokenizer = cached_tokenizer(dir);
  const std::vector<std::string> texts = {"Hello world", "<|begin_of_text|>3333 \u4F60\u597D", ""};
  std::string input;
  for (const auto& text : texts) input += nlohmann::json({{"text", text}}).dump() + "\n";
  for (const bool special : {true, false}) {
    const CliResult result = run_tokenize(dir, input, special ? "" : "--no-special-tokens");
    ASSERT_EQ(result.status, 0) << result.err;
    std::istringstream lines(result.out);
    std::string line;
    for (const auto& text : texts) {
      ASSERT_TRUE(std::getline(lines, line));
      EXPECT_EQ(nlohmann::json::parse(line)["ids"].get<std::vector<int32_t>>(), tokenizer.encode(text, special));
    }
    EXPECT_FALSE(std::getline(lines, line)) << "extra output line: " << line;
  }
}

TEST(TokenizeCli, MalformedLinesAreErrorsWithTheirLineNumber) {
  const std::string dir = find_shipped("qwen2_5");
  if (dir.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped("qwen2_5"));
  const std::string good = "{\"text\": \"ok\"}\n";
  struct Case {
    std::string input, expected;
  };
  for (const Case& c : {Case{good + good + "{\"text\": \"unterminated}\n", "line 3"},
                        Case{good + "{\"content\": \"x\"}\n", "line 2: expected an object with a \"text\""},
                        Case{"{\"text\": 5}\n", "line 1: \"text\" must be a string"},
                        Case{good + "{\"text\": \"bad \xFF byte\"}\n", "line 2"}}) {
    const CliResult result = run_tokenize(dir, c.input);
    EXPECT_NE(result.status, 0);
    EXPECT_NE(result.err.find(c.expected), std::string::npos) << "stderr: " << result.err;
  }
}

}  // namespace
}  // namespace spindle::test
