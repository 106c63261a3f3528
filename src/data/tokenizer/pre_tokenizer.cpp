#include "data/tokenizer/pre_tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <algorithm>
#include <cctype>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer/utf8.h"

namespace spindle::tokenizer {

namespace {

// GPT-2's pattern, which ByteLevel(use_regex=true) applies.
constexpr const char* kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Per-thread matching state, so that concurrent encodes share only the read-only compiled code.
struct MatchState {
  pcre2_match_data* data;
  pcre2_match_context* context;
  pcre2_jit_stack* jit_stack;
  MatchState() {
    data = pcre2_match_data_create(1, nullptr);
    context = pcre2_match_context_create(nullptr);
    // Long whitespace runs make `\s+(?!\S)` backtrack deeply; the default 32 KiB JIT stack is small.
    jit_stack = pcre2_jit_stack_create(32 * 1024, 64 * 1024 * 1024, nullptr);
    if (jit_stack) pcre2_jit_stack_assign(context, nullptr, jit_stack);
  }
  ~MatchState() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(context);
    if (jit_stack) pcre2_jit_stack_free(jit_stack);
  }
};

MatchState& match_state() {
  thread_local MatchState state;
  return state;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

// True when a (?i:...) body holds only literal text and alternation, so that spelling out the
// case of its ASCII letters gives the same language.
bool is_literal_alternation(std::string_view body) {
  for (char c : body)
    if (std::string_view("\\[](){}.*+?^$").find(c) != std::string_view::npos) return false;
  return true;
}

SplitBehavior behavior_from_json(const nlohmann::json& value) {
  const std::string name = value.is_string() ? value.get<std::string>() : value.dump();
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  fail("tokenizer.json: Split behavior '{}' is unknown (expected Removed, Isolated, MergedWithPrevious, "
       "MergedWithNext or Contiguous)",
       name);
}

bool bool_field(const nlohmann::json& config, const char* name, bool fallback) {
  if (!config.contains(name) || config[name].is_null()) return fallback;
  if (!config[name].is_boolean()) fail("tokenizer.json: field \"{}\" must be true or false, got {}", name, config[name].dump());
  return config[name].get<bool>();
}

struct Segment {
  uint32_t begin, end;
  bool is_match;
};

// HF tokenizers' SplitDelimiterBehavior, on the segments (matches and the gaps between them).
void apply_behavior(std::vector<Segment>& segments, SplitBehavior behavior) {
  std::vector<Segment> out;
  out.reserve(segments.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      return;
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments)
        if (!s.is_match) out.push_back(s);
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Segment& s : segments) {
        if (s.is_match && !previous_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->is_match && !previous_match && !out.empty())
          out.back().begin = it->begin;
        else
          out.push_back(*it);
        previous_match = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
    case SplitBehavior::kContiguous:
      for (const Segment& s : segments) {
        if (s.is_match == previous_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        previous_match = s.is_match;
      }
      break;
  }
  segments.swap(out);
}

}  // namespace

std::string translate_oniguruma_pattern(const std::string& pattern) {
  std::string out;
  out.reserve(pattern.size() + 16);
  bool in_class = false;
  size_t class_start = 0;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const char c = pattern[i];
    if (c == '\\' && i + 1 < pattern.size()) {
      const char escaped = pattern[++i];
      if (escaped == 's') {
        out += in_class ? R"(\s\x{85})" : R"([\s\x{85}])";
      } else if (escaped == 'S' && !in_class) {
        out += R"([^\s\x{85}])";
      } else {
        out += '\\';
        out += escaped;
      }
      continue;
    }
    if (in_class) {
      // A ']' right after '[' or '[^' is a literal.
      if (c == ']' && i > class_start + 1 && !(i == class_start + 2 && pattern[class_start + 1] == '^'))
        in_class = false;
      out += c;
      continue;
    }
    if (c == '[') {
      in_class = true;
      class_start = i;
      out += c;
      continue;
    }
    if (pattern.compare(i, 4, "(?i:") == 0) {
      const size_t close = pattern.find(')', i + 4);
      if (close != std::string::npos && is_literal_alternation(std::string_view(pattern).substr(i + 4, close - i - 4))) {
        out += "(?:";
        for (size_t j = i + 4; j < close; ++j) {
          const char letter = pattern[j];
          const bool lower = letter >= 'a' && letter <= 'z', upper = letter >= 'A' && letter <= 'Z';
          if (lower || upper) {
            out += '[';
            out += static_cast<char>(letter | 0x20);
            out += static_cast<char>(letter & ~0x20);
            out += ']';
          } else {
            out += letter;
          }
        }
        out += ')';
        i = close;
        continue;
      }
    }
    out += c;
  }
  return out;
}

namespace {

// PCRE2_LITERAL cannot be combined with PCRE2_UTF, so a literal is escaped instead.
std::string escape_literal(const std::string& text) {
  std::string out;
  for (char c : text) {
    const auto byte = static_cast<unsigned char>(c);
    if (byte < 0x80 && !std::isalnum(byte)) out += '\\';
    out += c;
  }
  return out;
}

}  // namespace

Regex::Regex(const std::string& pattern, bool literal) : pattern_(pattern) {
  const std::string source = literal ? escape_literal(pattern) : translate_oniguruma_pattern(pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const uint32_t options = PCRE2_UTF | PCRE2_UCP;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options,
                                   &error_code, &error_offset, nullptr);
  if (!code)
    fail("tokenizer.json: the pre-tokenizer pattern '{}' does not compile with PCRE2 at offset {}: {}", pattern,
         error_offset, pcre2_message(error_code));
  // Without JIT (unsupported platform) pcre2_match interprets: slower, same results.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
  code_ = code;
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::find_all(std::string_view text, std::vector<std::pair<uint32_t, uint32_t>>& matches) const {
  MatchState& state = match_state();
  auto* code = static_cast<const pcre2_code*>(code_);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  PCRE2_SIZE start = 0;
  while (start < text.size()) {
    // The text was validated as UTF-8 on entry; checking again per match would cost O(n²).
    const int rc = pcre2_match(code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, state.data, state.context);
    if (rc == PCRE2_ERROR_NOMATCH) return;
    if (rc < 0)
      fail("pre-tokenizer pattern '{}' failed on a text of {} bytes: {}", pattern_, text.size(), pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(state.data);
    if (ovector[1] > ovector[0]) {
      matches.emplace_back(static_cast<uint32_t>(ovector[0]), static_cast<uint32_t>(ovector[1]));
      start = ovector[1];
    } else {
      // An empty match yields no piece; step over one code point as Oniguruma's iterator does.
      size_t pos = ovector[0];
      if (pos >= text.size()) return;
      next_code_point(text, pos);
      start = pos;
    }
  }
}

PreTokenizer PreTokenizer::from_json(const nlohmann::json& config) {
  PreTokenizer pre_tokenizer;
  pre_tokenizer.add_from_json(config);
  return pre_tokenizer;
}

void PreTokenizer::add_from_json(const nlohmann::json& config) {
  if (config.is_null()) return;
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string())
    fail("tokenizer.json: a pre_tokenizer must be an object with a string \"type\", got {}", config.dump().substr(0, 200));
  const std::string type = config["type"].get<std::string>();
  if (has_byte_level_)
    fail("tokenizer.json: pre-tokenizer '{}' comes after ByteLevel; spindle supports ByteLevel only as the last "
         "pre-tokenizer (as Qwen and Llama 3 use it)",
         type);
  if (type == "Sequence") {
    if (!config.contains("pretokenizers") || !config["pretokenizers"].is_array())
      fail("tokenizer.json: a Sequence pre_tokenizer needs a \"pretokenizers\" array");
    for (const auto& inner : config["pretokenizers"]) add_from_json(inner);
  } else if (type == "Split") {
    if (!config.contains("pattern") || !config["pattern"].is_object())
      fail("tokenizer.json: a Split pre_tokenizer needs a \"pattern\" object ({{\"Regex\": ...}} or {{\"String\": ...}})");
    const auto& pattern = config["pattern"];
    Step step;
    step.kind = Step::Kind::kSplit;
    if (pattern.contains("Regex") && pattern["Regex"].is_string())
      step.regex = std::make_shared<Regex>(pattern["Regex"].get<std::string>(), false);
    else if (pattern.contains("String") && pattern["String"].is_string())
      step.regex = std::make_shared<Regex>(pattern["String"].get<std::string>(), true);
    else
      fail("tokenizer.json: Split pattern must be {{\"Regex\": \"...\"}} or {{\"String\": \"...\"}}, got {}", pattern.dump());
    step.behavior = behavior_from_json(config.value("behavior", nlohmann::json("Isolated")));
    step.invert = bool_field(config, "invert", false);
    steps_.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    has_byte_level_ = true;
    if (bool_field(config, "add_prefix_space", true)) {
      Step step;
      step.kind = Step::Kind::kPrefixSpace;
      steps_.push_back(std::move(step));
    }
    if (bool_field(config, "use_regex", true)) {
      Step step;
    step.kind = Step::Kind::kSplit;
      step.regex = std::make_shared<Regex>(kByteLevelPattern, false);
      steps_.push_back(std::move(step));
    }
  } else {
    fail("tokenizer.json: pre_tokenizer type '{}' is not supported (spindle supports Split, ByteLevel and Sequence, "
         "as byte-level BPE models use)",
         type);
  }
}

void PreTokenizer::split(std::string_view text, std::vector<Piece>& pieces) const {
  pieces.clear();
  if (text.empty()) return;
  pieces.push_back({0, static_cast<uint32_t>(text.size()), false});
  thread_local std::vector<Piece> next;
  thread_local std::vector<std::pair<uint32_t, uint32_t>> matches;
  thread_local std::vector<Segment> segments;
  thread_local std::string with_space;
  for (const Step& step : steps_) {
    if (step.kind == Step::Kind::kPrefixSpace) {
      for (Piece& piece : pieces)
        if (!piece.prefix_space && piece.begin < piece.end && text[piece.begin] != ' ') piece.prefix_space = true;
      continue;
    }
    next.clear();
    for (const Piece& piece : pieces) {
      std::string_view subject = text.substr(piece.begin, piece.end - piece.begin);
      if (piece.prefix_space) {
        with_space.assign(1, ' ');
        with_space.append(subject);
        subject = with_space;
      }
      matches.clear();
      step.regex->find_all(subject, matches);
      segments.clear();
      uint32_t previous = 0;
      for (const auto& [begin, end] : matches) {
        if (previous != begin) segments.push_back({previous, begin, step.invert});
        segments.push_back({begin, end, !step.invert});
        previous = end;
      }
      if (previous != subject.size()) segments.push_back({previous, static_cast<uint32_t>(subject.size()), step.invert});
      apply_behavior(segments, step.behavior);
      // Back to offsets in `text`; the virtual space, if any, is byte 0 of the subject.
      const uint32_t shift = piece.prefix_space ? 1 : 0;
      for (const Segment& s : segments) {
        if (s.end == s.begin) continue;
        if (shift && s.begin == 0)
          next.push_back({piece.begin, piece.begin + s.end - 1, true});
        else
          next.push_back({piece.begin + s.begin - shift, piece.begin + s.end - shift, false});
      }
    }
    pieces.swap(next);
  }
}

}  // namespace spindle::tokenizer
