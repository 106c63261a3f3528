// spindle tokenize: JSONL of {"text": ...} on stdin → JSONL of {"ids": [...]} on stdout, one line
// for one line, with the ids HF `Tokenizer.encode(text)` gives. With --chat, conversations in →
// {"text", "ids", "mask"}: the chat template's rendering, its ids as
// apply_chat_template(tokenize=True) gives them, and which tokens training supervises.
#include <cstdio>
#include <iostream>
#include <memory>
#include <optional>
#include <string>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "cli/commands.h"
#include "core/error.h"
#include "data/sample_encoder.h"
#include "data/tokenizer/tokenizer.h"

namespace spindle::cli {

namespace {

struct TokenizeOptions {
  std::string tokenizer_dir;
  bool no_special_tokens = false;
  bool chat = false;
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

// One conversation line as training sees it: the same rendering, ids and supervision as
// `spindle prepare` and training, plus the generation prompt when the line asks for it.
std::string chat_line(const SampleEncoder& encoder, const std::string& line) {
  const nlohmann::ordered_json sample = SampleEncoder::parse_sample(line);
  bool add_generation_prompt = false;
  if (sample.contains("add_generation_prompt")) {
    if (!sample["add_generation_prompt"].is_boolean())
      fail("\"add_generation_prompt\" must be true or false, got {}", sample["add_generation_prompt"].dump());
    add_generation_prompt = sample["add_generation_prompt"].get<bool>();
  }
  const SampleFormat format = encoder.format_of(sample);
  if (format != SampleFormat::kMessages && format != SampleFormat::kAlpaca)
    fail("with --chat each line must be a conversation like {{\"messages\": [{{\"role\": \"user\", \"content\": "
         "\"...\"}}]}}, got {} data",
         sample_format_name(format));
  const ConversationEncoding encoded = encoder.encode_conversation(sample, add_generation_prompt);
  nlohmann::ordered_json out;
  out["text"] = encoded.chat.text;
  out["ids"] = encoded.document.input_ids;
  std::vector<int> mask(encoded.document.labels.size());
  for (size_t i = 0; i < mask.size(); ++i) mask[i] = encoded.document.labels[i] != kIgnoreIndex;
  out["mask"] = mask;
  if (!encoded.document.loss_scale.empty()) out["loss_scale"] = encoded.document.loss_scale;
  return out.dump() + "\n";
}

int run_tokenize(const TokenizeOptions& options) {
  if (options.chat && options.no_special_tokens)
    fail("--chat adds no special tokens already (the chat template writes them); drop --no-special-tokens");
  std::optional<Tokenizer> tokenizer;
  std::unique_ptr<TextEncoder> text_encoder;
  std::optional<SampleEncoder> chat_encoder;
  if (!options.chat) {
    tokenizer.emplace(Tokenizer::load(options.tokenizer_dir));
  } else {
    text_encoder = load_text_encoder(options.tokenizer_dir);
    text_encoder->chat_template(false);  // no chat template in the folder: say so before reading input
    chat_encoder.emplace(text_encoder.get(), EncodeOptions{});
  }
  std::ios::sync_with_stdio(false);
  std::string line;
  fmt::memory_buffer out;
  size_t line_number = 0;
  while (std::getline(std::cin, line)) {
    ++line_number;
    if (!line.empty() && line.back() == '\r') line.pop_back();
    out.clear();
    try {
      if (chat_encoder) {
        const std::string written = chat_line(*chat_encoder, line);
        out.append(written.data(), written.data() + written.size());
      } else {
        const std::vector<int32_t> ids =
            tokenizer->encode(text_of_line(line, line_number), !options.no_special_tokens);
        fmt::format_to(std::back_inserter(out), "{{\"ids\": [{}]}}\n", fmt::join(ids, ", "));
      }
    } catch (const Error& e) {
      const std::string message = e.what();
      if (message.rfind("stdin line", 0) == 0) throw;
      fail("stdin line {}: {}", line_number, message);
    }
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
      "tokenize",
      "Tokenize JSONL {\"text\": ...} lines from stdin into {\"ids\": [...]} lines on stdout (--chat: conversations)");
  command->add_option("--tokenizer", options->tokenizer_dir, "Folder with tokenizer.json (a HF model folder)")
      ->required();
  command->add_flag("--no-special-tokens", options->no_special_tokens,
                    "Do not add the post-processor's special tokens (BOS), as add_special_tokens=False");
  command->add_flag("--chat", options->chat,
                    "Lines are conversations ({\"messages\": [...]} with optional \"tools\" and "
                    "\"add_generation_prompt\"; ShareGPT and Alpaca too): write the chat template's "
                    "\"text\", its \"ids\" (as apply_chat_template(tokenize=True)) and the training "
                    "\"mask\" (1 = supervised)");
  commands.push_back({command, [options] { return run_tokenize(*options); }});
}

}  // namespace spindle::cli
