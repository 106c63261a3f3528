#include "data/tokenizer/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <cctype>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer/utf8.h"

namespace spindle::tokenizer {

namespace {

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

Regex::Regex(const std::string& pattern, bool literal) : pattern_(pattern), literal_(literal) {
  const std::string source = literal ? escape_literal(pattern) : translate_oniguruma_pattern(pattern);
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  const uint32_t options = PCRE2_UTF | PCRE2_UCP;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(source.data()), source.size(), options,
                                   &error_code, &error_offset, nullptr);
  if (!code)
    fail("tokenizer.json: the pattern '{}' does not compile with PCRE2 at offset {}: {}", pattern,
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
      fail("tokenizer pattern '{}' failed on a text of {} bytes: {}", pattern_, text.size(), pcre2_message(rc));
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

std::shared_ptr<const Regex> Regex::from_json(const nlohmann::json& pattern, std::string_view where) {
  if (pattern.is_object() && pattern.contains("Regex") && pattern["Regex"].is_string())
    return std::make_shared<Regex>(pattern["Regex"].get<std::string>(), false);
  if (pattern.is_object() && pattern.contains("String") && pattern["String"].is_string()) {
    if (pattern["String"].get_ref<const std::string&>().empty())
      fail("tokenizer.json: the {} pattern {{\"String\": \"\"}} is empty; it would match between every character", where);
    return std::make_shared<Regex>(pattern["String"].get<std::string>(), true);
  }
  fail("tokenizer.json: the {} pattern must be {{\"Regex\": \"...\"}} or {{\"String\": \"...\"}}, got {}", where,
       pattern.dump());
}

std::string Regex::replace_all(std::string_view text, std::string_view content) const {
  std::string out;
  out.reserve(text.size());
  if (literal_) {
    size_t from = 0;
    for (size_t at = text.find(pattern_); at != std::string_view::npos; at = text.find(pattern_, from)) {
      out.append(text.substr(from, at - from));
      out.append(content);
      from = at + pattern_.size();
    }
    out.append(text.substr(from));
    return out;
  }
  thread_local std::vector<std::pair<uint32_t, uint32_t>> matches;
  matches.clear();
  find_all(text, matches);
  size_t from = 0;
  for (const auto& [begin, end] : matches) {
    out.append(text.substr(from, begin - from));
    out.append(content);
    from = end;
  }
  out.append(text.substr(from));
  return out;
}

}  // namespace spindle::tokenizer
