#include "data/tokenizer/decoder.h"

#include <optional>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer/byte_level.h"
#include "data/tokenizer/regex.h"
#include "data/tokenizer/utf8.h"

namespace spindle::tokenizer {

namespace {

// One character, as HF reads a `char` field from JSON.
std::string single_character(const nlohmann::json& config, const char* field, const char* decoder) {
  if (!config.contains(field) || !config[field].is_string())
    fail("tokenizer.json: the {} decoder needs a one-character string \"{}\"", decoder, field);
  const std::string text = config[field].get<std::string>();
  size_t length = 0;
  if (!text.empty() && find_invalid_utf8(text) == std::string::npos) next_code_point(text, length);
  if (text.empty() || length != text.size())
    fail("tokenizer.json: the {} decoder's \"{}\" must be one character, got \"{}\"", decoder, field, text);
  return text;
}

size_t count_field(const nlohmann::json& config, const char* field, const char* decoder) {
  if (!config.contains(field) || !config[field].is_number_unsigned())
    fail("tokenizer.json: the {} decoder needs a non-negative integer \"{}\"", decoder, field);
  return config[field].get<size_t>();
}

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// The byte a ByteFallback token stands for: six bytes "<0x" + two digits + ">", the digits read as
// Rust's u8::from_str_radix(_, 16) reads them (either case; "+" then one digit also parses).
std::optional<unsigned char> fallback_byte(const std::string& token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return std::nullopt;
  if (token[3] == '+') {
    const int digit = hex_digit(token[4]);
    if (digit < 0) return std::nullopt;
    return static_cast<unsigned char>(digit);
  }
  const int high = hex_digit(token[3]), low = hex_digit(token[4]);
  if (high < 0 || low < 0) return std::nullopt;
  return static_cast<unsigned char>(high * 16 + low);
}

std::vector<char32_t> code_points(const std::string& text) {
  std::vector<char32_t> out;
  for (size_t pos = 0; pos < text.size();) out.push_back(next_code_point(text, pos));
  return out;
}

}  // namespace

Decoder Decoder::from_json(const nlohmann::json& config) {
  Decoder decoder;
  decoder.add_from_json(config);
  return decoder;
}

void Decoder::add_from_json(const nlohmann::json& config) {
  if (config.is_null()) return;
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string())
    fail("tokenizer.json: a decoder must be an object with a string \"type\", got {}", config.dump().substr(0, 200));
  const std::string type = config["type"].get<std::string>();
  Step step;
  if (type == "Sequence") {
    if (!config.contains("decoders") || !config["decoders"].is_array())
      fail("tokenizer.json: a Sequence decoder needs a \"decoders\" array");
    for (const auto& inner : config["decoders"]) add_from_json(inner);
    return;
  } else if (type == "ByteLevel") {
    step.kind = Step::Kind::kByteLevel;
  } else if (type == "Replace") {
    if (!config.contains("pattern") || !config.contains("content") || !config["content"].is_string())
      fail("tokenizer.json: a Replace decoder needs a \"pattern\" and a string \"content\", got {}", config.dump());
    step.kind = Step::Kind::kReplace;
    step.pattern = Regex::from_json(config["pattern"], "Replace decoder");
    step.content = config["content"].get<std::string>();
    require_valid_utf8(step.content, "Replace decoder content");
  } else if (type == "ByteFallback") {
    step.kind = Step::Kind::kByteFallback;
  } else if (type == "Fuse") {
    step.kind = Step::Kind::kFuse;
  } else if (type == "Strip") {
    step.kind = Step::Kind::kStrip;
    step.content = single_character(config, "content", "Strip");
    step.start = count_field(config, "start", "Strip");
    step.stop = count_field(config, "stop", "Strip");
  } else if (type == "Metaspace") {
    step.kind = Step::Kind::kMetaspace;
    step.content = single_character(config, "replacement", "Metaspace");
    std::string scheme = "always";
    if (config.contains("prepend_scheme") && config["prepend_scheme"].is_string())
      scheme = config["prepend_scheme"].get<std::string>();
    if (scheme != "always" && scheme != "first" && scheme != "never")
      fail("tokenizer.json: Metaspace decoder prepend_scheme '{}' is unknown (expected always, first or never)", scheme);
    if (config.contains("add_prefix_space") && config["add_prefix_space"].is_boolean() &&
        !config["add_prefix_space"].get<bool>() && scheme != "never")
      fail("tokenizer.json: Metaspace decoder add_prefix_space=false does not match prepend_scheme '{}' (HF refuses "
           "this file too)",
           scheme);
    step.keep_first_marker = scheme == "never";
  } else {
    fail("tokenizer.json: decoder type '{}' is not supported (spindle supports ByteLevel, Replace, ByteFallback, Fuse, "
         "Strip, Metaspace and Sequence of them)",
         type);
  }
  steps_.push_back(std::move(step));
}

bool Decoder::is_byte_level() const { return steps_.size() == 1 && steps_[0].kind == Step::Kind::kByteLevel; }

std::string Decoder::decode(std::vector<std::string> tokens) const {
  if (steps_.empty()) {
    std::string joined;
    for (size_t i = 0; i < tokens.size(); ++i) {
      if (i > 0) joined += ' ';
      joined += tokens[i];
    }
    return joined;
  }
  std::vector<std::string> next;
  for (const Step& step : steps_) {
    switch (step.kind) {
      case Step::Kind::kByteLevel: {
        const ByteLevelAlphabet& alphabet = ByteLevelAlphabet::get();
        std::string bytes;
        for (const std::string& token : tokens) {
          if (auto decoded = alphabet.decode(token))
            bytes += *decoded;
          else
            bytes += token;
        }
        tokens.assign(1, utf8_lossy(bytes));
        break;
      }
      case Step::Kind::kReplace:
        for (std::string& token : tokens) token = step.pattern->replace_all(token, step.content);
        break;
      case Step::Kind::kByteFallback: {
        next.clear();
        std::string run;
        auto flush = [&] {
          if (run.empty()) return;
          if (find_invalid_utf8(run) == std::string::npos) {
            next.push_back(run);
          } else {
            for (size_t i = 0; i < run.size(); ++i) next.emplace_back("\xEF\xBF\xBD");  // U+FFFD per byte
          }
          run.clear();
        };
        for (std::string& token : tokens) {
          if (auto byte = fallback_byte(token)) {
            run += static_cast<char>(*byte);
            continue;
          }
          flush();
          next.push_back(std::move(token));
        }
        flush();
        tokens.swap(next);
        break;
      }
      case Step::Kind::kFuse: {
        std::string joined;
        for (const std::string& token : tokens) joined += token;
        tokens.assign(1, std::move(joined));
        break;
      }
      case Step::Kind::kStrip: {
        size_t length = 0;
        const char32_t content = next_code_point(step.content, length);
        for (std::string& token : tokens) {
          const std::vector<char32_t> characters = code_points(token);
          size_t start_cut = 0;
          for (size_t i = 0; i < step.start && i < characters.size() && characters[i] == content; ++i) start_cut = i + 1;
          size_t stop_cut = characters.size();
          for (size_t i = 0; i < step.stop && i < characters.size() && characters[characters.size() - i - 1] == content; ++i)
            stop_cut = characters.size() - i - 1;
          std::string stripped;
          for (size_t i = start_cut; i < stop_cut; ++i) append_utf8(stripped, characters[i]);
          token = std::move(stripped);
        }
        break;
      }
      case Step::Kind::kMetaspace:
        for (size_t index = 0; index < tokens.size(); ++index) {
          std::string& token = tokens[index];
          std::string out;
          size_t from = 0;
          for (size_t at = token.find(step.content); at != std::string::npos; at = token.find(step.content, from)) {
            out.append(token, from, at - from);
            if (index > 0 || step.keep_first_marker) out += ' ';
            from = at + step.content.size();
          }
          out.append(token, from, std::string::npos);
          token = std::move(out);
        }
        break;
    }
  }
  std::string text;
  for (const std::string& token : tokens) text += token;
  return text;
}

}  // namespace spindle::tokenizer
