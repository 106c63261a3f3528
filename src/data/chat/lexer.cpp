#include "data/chat/lexer.h"

#include <algorithm>

#include "data/chat/template_fail.h"
#include "data/chat/unicode.h"

namespace spindle::chat {
namespace {

// Length in bytes of the Unicode whitespace run (Python \s) starting at `pos`.
size_t whitespace_run(const std::string& s, size_t pos) {
  size_t end = pos;
  while (end < s.size()) {
    size_t next = end;
    auto byte = static_cast<unsigned char>(s[next]);
    int len = byte < 0x80 ? 1 : byte < 0xE0 ? 2 : byte < 0xF0 ? 3 : 4;
    if (next + len > s.size()) break;
    char32_t c = unicode::decode(std::string_view(s).substr(next, len))[0];
    if (!unicode::is_space(c)) break;
    end += len;
  }
  return end - pos;
}

bool all_whitespace(const std::string& s) {
  return !s.empty() && whitespace_run(s, 0) == s.size();
}

int count_newlines(std::string_view s) { return static_cast<int>(std::count(s.begin(), s.end(), '\n')); }

std::string normalize_newlines(const std::string& source) {
  std::string out;
  out.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      out.push_back('\n');
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      out.push_back(source[i]);
    }
  }
  // keep_trailing_newline=False: exactly one final newline of the template is not output.
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

int hex_value(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Python's "unicode-escape" decoding, which jinja2 applies to every string literal.
std::string decode_string_literal(const std::string& body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out.push_back(c);
      continue;
    }
    char e = body[++i];
    auto read_hex = [&](int digits) {
      char32_t value = 0;
      for (int k = 1; k <= digits; ++k) {
        int h = i + k < body.size() ? hex_value(body[i + k]) : -1;
        if (h < 0) template_fail(line, "malformed \\{} escape in a string literal", e);
        value = value * 16 + h;
      }
      i += digits;
      unicode::append_code_point(out, value);
    };
    switch (e) {
      case '\\': out.push_back('\\'); break;
      case '\'': out.push_back('\''); break;
      case '"': out.push_back('"'); break;
      case 'a': out.push_back('\a'); break;
      case 'b': out.push_back('\b'); break;
      case 'f': out.push_back('\f'); break;
      case 'n': out.push_back('\n'); break;
      case 'r': out.push_back('\r'); break;
      case 't': out.push_back('\t'); break;
      case 'v': out.push_back('\v'); break;
      case '\n': break;  // backslash-newline is a line continuation
      case 'x': read_hex(2); break;
      case 'u': read_hex(4); break;
      case 'U': read_hex(8); break;
      case 'N':
        template_fail(line, "\\N{{...}} named escapes in string literals are not supported; write the "
             "character itself or a \\u escape");
      default:
        if (e >= '0' && e <= '7') {
          int value = e - '0';
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k)
            value = value * 8 + (body[++i] - '0');
          unicode::append_code_point(out, static_cast<char32_t>(value));
        } else {
          out.push_back('\\');
          out.push_back(e);
        }
    }
  }
  return out;
}

bool is_name_start(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
bool is_digit(char c) { return c >= '0' && c <= '9'; }

class Lexer {
 public:
  explicit Lexer(const std::string& source) : src_(normalize_newlines(source)) {}

  std::vector<Token> run() {
    while (pos_ < src_.size()) lex_data_and_tag();
    tokens_.push_back({TokenType::End, "", line_});
    return std::move(tokens_);
  }

 private:
  void lex_data_and_tag() {
    size_t tag = src_.find('{', pos_);
    while (tag != std::string::npos && tag + 1 < src_.size() && src_[tag + 1] != '{' && src_[tag + 1] != '%' &&
           src_[tag + 1] != '#')
      tag = src_.find('{', tag + 1);
    if (tag == std::string::npos || tag + 1 >= src_.size()) {
      emit_data(src_.substr(pos_));
      pos_ = src_.size();
      return;
    }
    char kind = src_[tag + 1];
    char sign = tag + 2 < src_.size() && (src_[tag + 2] == '-' || src_[tag + 2] == '+') ? src_[tag + 2] : 0;
    std::string text = src_.substr(pos_, tag - pos_);
    int text_newlines = count_newlines(text);
    if (sign == '-') {
      text = unicode::strip(text, nullptr, false, true);
    } else if (sign != '+' && kind != '{') {
      size_t line_begin = text.rfind('\n');
      line_begin = line_begin == std::string::npos ? 0 : line_begin + 1;
      if ((line_begin > 0 || line_starting_) && all_whitespace(text.substr(line_begin))) text.resize(line_begin);
    }
    emit_data(text);
    line_ += text_newlines;
    pos_ = tag + 2 + (sign ? 1 : 0);
    line_starting_ = false;
    if (kind == '#')
      lex_comment();
    else if (kind == '%' && lex_raw_if_present())
      return;
    else
      lex_tag(kind == '{');
  }

  void emit_data(const std::string& text) {
    if (!text.empty()) tokens_.push_back({TokenType::Data, text, line_});
  }

  // After `-%}`/`-}}`/`-#}`: all whitespace; after `%}`/`#}`: one newline (trim_blocks).
  void consume_after_tag_end(char sign, bool is_variable) {
    size_t skip = 0;
    if (sign == '-')
      skip = whitespace_run(src_, pos_);
    else if (sign != '+' && !is_variable && pos_ < src_.size() && src_[pos_] == '\n')
      skip = 1;
    line_ += count_newlines(std::string_view(src_).substr(pos_, skip));
    pos_ += skip;
    line_starting_ = skip > 0 && src_[pos_ - 1] == '\n';
  }

  void lex_comment() {
    int start_line = line_;
    size_t end = src_.find("#}", pos_);
    if (end == std::string::npos) template_fail(start_line, "comment {{# is never closed with #}}");
    char sign = end > pos_ && (src_[end - 1] == '-' || src_[end - 1] == '+') ? src_[end - 1] : 0;
    line_ += count_newlines(std::string_view(src_).substr(pos_, end + 2 - pos_));
    pos_ = end + 2;
    consume_after_tag_end(sign, false);
  }

  bool lex_raw_if_present() {
    size_t p = pos_ + whitespace_run(src_, pos_);
    if (src_.compare(p, 3, "raw") != 0 || (p + 3 < src_.size() && (is_name_start(src_[p + 3]) || is_digit(src_[p + 3]))))
      return false;
    p += 3;
    p += whitespace_run(src_, p);
    char sign = 0;
    if (p < src_.size() && src_[p] == '-') sign = '-', ++p;
    if (src_.compare(p, 2, "%}") != 0) return false;
    line_ += count_newlines(std::string_view(src_).substr(pos_, p + 2 - pos_));
    pos_ = p + 2;
    if (sign == '-') pos_ += whitespace_run(src_, pos_);
    // Raw body runs until {% endraw %}; its content is data, verbatim.
    size_t search = pos_;
    while (true) {
      size_t open = src_.find("{%", search);
      if (open == std::string::npos) template_fail(line_, "{{% raw %}} is never closed with {{% endraw %}}");
      size_t q = open + 2;
      char open_sign = q < src_.size() && (src_[q] == '-' || src_[q] == '+') ? src_[q] : 0;
      if (open_sign) ++q;
      q += whitespace_run(src_, q);
      if (src_.compare(q, 6, "endraw") != 0) {
        search = open + 2;
        continue;
      }
      q += 6;
      q += whitespace_run(src_, q);
      char close_sign = 0;
      if (q < src_.size() && (src_[q] == '-' || src_[q] == '+')) close_sign = src_[q++];
      if (src_.compare(q, 2, "%}") != 0) {
        search = open + 2;
        continue;
      }
      std::string body = src_.substr(pos_, open - pos_);
      int body_newlines = count_newlines(body);
      if (open_sign == '-') body = unicode::strip(body, nullptr, false, true);
      emit_data(body);
      line_ += body_newlines;
      pos_ = q + 2;
      consume_after_tag_end(close_sign, false);
      return true;
    }
  }

  void lex_tag(bool is_variable) {
    int start_line = line_;
    tokens_.push_back({is_variable ? TokenType::VariableBegin : TokenType::BlockBegin, "", line_});
    std::vector<char> balance;
    const char* close = is_variable ? "}}" : "%}";
    while (true) {
      if (pos_ >= src_.size())
        template_fail(start_line, "tag opened with {} is never closed with {}", is_variable ? "{{" : "{%",
             close);
      if (balance.empty()) {
        char sign = 0;
        size_t p = pos_;
        if (src_[p] == '-' || (src_[p] == '+' && !is_variable)) sign = src_[p++];
        if (src_.compare(p, 2, close) == 0) {
          pos_ = p + 2;
          tokens_.push_back({is_variable ? TokenType::VariableEnd : TokenType::BlockEnd, "", line_});
          consume_after_tag_end(sign, is_variable);
          return;
        }
      }
      size_t ws = whitespace_run(src_, pos_);
      if (ws) {
        line_ += count_newlines(std::string_view(src_).substr(pos_, ws));
        pos_ += ws;
        continue;
      }
      char c = src_[pos_];
      if (is_digit(c)) {
        lex_number();
      } else if (is_name_start(c)) {
        size_t end = pos_;
        while (end < src_.size() && (is_name_start(src_[end]) || is_digit(src_[end]))) ++end;
        tokens_.push_back({TokenType::Name, src_.substr(pos_, end - pos_), line_});
        pos_ = end;
      } else if (c == '\'' || c == '"') {
        lex_string(c);
      } else {
        lex_operator(balance);
      }
    }
  }

  void lex_number() {
    size_t end = pos_;
    auto digits = [&] {
      while (end < src_.size() && (is_digit(src_[end]) || (src_[end] == '_' && end + 1 < src_.size() && is_digit(src_[end + 1]))))
        ++end;
    };
    digits();
    bool is_float = false;
    if (end + 1 < src_.size() && src_[end] == '.' && is_digit(src_[end + 1])) {
      ++end;
      digits();
      is_float = true;
    }
    if (end < src_.size() && (src_[end] == 'e' || src_[end] == 'E')) {
      size_t e = end + 1;
      if (e < src_.size() && (src_[e] == '+' || src_[e] == '-')) ++e;
      if (e < src_.size() && is_digit(src_[e])) {
        end = e;
        digits();
        is_float = true;
      }
    }
    std::string text;
    for (size_t i = pos_; i < end; ++i)
      if (src_[i] != '_') text.push_back(src_[i]);
    tokens_.push_back({is_float ? TokenType::Float : TokenType::Integer, text, line_});
    pos_ = end;
  }

  void lex_string(char quote) {
    size_t p = pos_ + 1;
    while (p < src_.size() && src_[p] != quote) p += src_[p] == '\\' ? 2 : 1;
    if (p >= src_.size()) template_fail(line_, "string literal starting with {} is never closed", quote);
    std::string body = src_.substr(pos_ + 1, p - pos_ - 1);
    tokens_.push_back({TokenType::String, decode_string_literal(body, line_), line_});
    line_ += count_newlines(body);
    pos_ = p + 1;
  }

  void lex_operator(std::vector<char>& balance) {
    static const char* two_char[] = {"//", "**", "==", "!=", ">=", "<="};
    for (const char* op : two_char)
      if (src_.compare(pos_, 2, op) == 0) {
        tokens_.push_back({TokenType::Operator, op, line_});
        pos_ += 2;
        return;
      }
    char c = src_[pos_];
    static const std::string single = "+-/*%~[](){}><=.:|,;";
    if (single.find(c) == std::string::npos)
      template_fail(line_, "unexpected character '{}' inside a tag", std::string(1, c));
    if (c == '(' || c == '[' || c == '{') balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
    if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) template_fail(line_, "unexpected '{}'", std::string(1, c));
      if (balance.back() != c)
        template_fail(line_, "unexpected '{}', expected '{}'", std::string(1, c), std::string(1, balance.back()));
      balance.pop_back();
    }
    tokens_.push_back({TokenType::Operator, std::string(1, c), line_});
    ++pos_;
  }

  std::string src_;
  size_t pos_ = 0;
  int line_ = 1;
  bool line_starting_ = true;
  std::vector<Token> tokens_;
};

}  // namespace

std::vector<Token> tokenize(const std::string& source) { return Lexer(source).run(); }

}  // namespace spindle::chat
