// spindle tokenize: JSONL of {"text": ...} on stdin → JSONL of {"ids": [...]} on stdout, one line
// for one line, with the ids HF `Tokenizer.encode(text)` gives.
#include <cstdio>
#include <iostream>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "data/tokenizer/tokenizer.h"

namespace spindle::cli {

namespace {

struct TokenizeOptions {
  std::string tokenizer_dir;
  bool no_special_tokens = false;
};

std::string text_of_line(const std::string& line, size_t line_number) {
  nlohmann::json record;
  try {
    record = nlohmann::json::parse(line);
  } catch (const nlohmann::json::parse_error& e) {
    fail("stdin line {}: not valid JSON ({}); each line must be one object like {{\"text\": \"...\"}}", line_number,
         e.what());
  }
  if (!record.is_object() || !record.contains("text"))
    fail("stdin line {}: expected an object with a \"text\" field, got {}", line_number, record.dump().substr(0, 120));
  if (!record["text"].is_string())
    fail("stdin line {}: \"text\" must be a string, got {}", line_number, record["text"].type_name());
  return record["text"].get<std::string>();
}

int run_tokenize(const TokenizeOptions& options) {
  const Tokenizer tokenizer = Tokenizer::load(options.tokenizer_dir);
  std::ios::sync_with_stdio(false);
  std::string line;
  fmt::memory_buffer out;
  size_t line_number = 0;
  while (std::getline(std::cin, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    std::vector<int32_t> ids;
    try {
      ids = tokenizer.encode(text_of_line(line, line_number), !options.no_special_tokens);
    } catch (const Error& e) {
      const std::string message = e.what();
      if (message.rfind("stdin line", 0) == 0) throw;
      fail("stdin line {}: {}", line_number, message);
    }
    out.clear();
    fmt::format_to(std::back_inserter(out), "{{\"ids\": [{}]}}\n", fmt::join(ids, ", "));
    if (std::fwrite(out.data(), 1, out.size(), stdout) != out.size())
      fail("cannot write to stdout (disk full or closed pipe)");
  }
  if (std::fflush(stdout) != 0) fail("cannot write to stdout (disk full or closed pipe)");
  return 0;
}

}  // namespace

void add_tokenize_command(CLI::App& app, CommandList& commands) {
  auto options = std::make_shared<TokenizeOptions>();
  CLI::App* command = app.add_subcommand(
      "tokenize", "Tokenize JSONL {\"text\": ...} lines from stdin into {\"ids\": [...]} lines on stdout");
  command->add_option("--tokenizer", options->tokenizer_dir, "Folder with tokenizer.json (a HF model folder)")
      ->required();
  command->add_flag("--no-special-tokens", options->no_special_tokens,
                    "Do not add the post-processor's special tokens (BOS), as add_special_tokens=False");
  commands.push_back({command, [options] { return run_tokenize(*options); }});
}

}  // namespace spindle::cli
