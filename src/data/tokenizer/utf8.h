// UTF-8 helpers shared by the tokenizer stages. Text reaching the tokenizer is validated once, so
// the stages after validation may decode without re-checking.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace spindle::tokenizer {

// Throws spindle::Error naming the byte offset of the first invalid sequence.
void require_valid_utf8(std::string_view text, std::string_view what);

// Byte offset of the first invalid sequence, or npos when the text is valid UTF-8.
size_t find_invalid_utf8(std::string_view text);

// Decodes the code point starting at text[pos] of valid UTF-8 and advances pos past it.
inline char32_t next_code_point(std::string_view text, size_t& pos) {
  const auto lead = static_cast<unsigned char>(text[pos]);
  if (lead < 0x80) {
    ++pos;
    return lead;
  }
  auto cont = [&](size_t i) { return static_cast<char32_t>(static_cast<unsigned char>(text[pos + i]) & 0x3F); };
  char32_t cp;
  if (lead < 0xE0) {
    cp = (static_cast<char32_t>(lead & 0x1F) << 6) | cont(1);
    pos += 2;
  } else if (lead < 0xF0) {
    cp = (static_cast<char32_t>(lead & 0x0F) << 12) | (cont(1) << 6) | cont(2);
    pos += 3;
  } else {
    cp = (static_cast<char32_t>(lead & 0x07) << 18) | (cont(1) << 12) | (cont(2) << 6) | cont(3);
    pos += 4;
  }
  return cp;
}

// Decodes the code point that ends at text[pos - 1] of valid UTF-8 and moves pos back to its start.
char32_t previous_code_point(std::string_view text, size_t& pos);

void append_utf8(std::string& out, char32_t cp);

// Bytes to text the way Rust's String::from_utf8_lossy does it (what HF decode returns): each
// maximal invalid subsequence becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// Unicode White_Space property (Rust char::is_whitespace).
bool is_unicode_whitespace(char32_t cp);

// Rust char::is_alphanumeric: Alphabetic or Numeric (approximated by general categories L*, N*).
bool is_unicode_alphanumeric(char32_t cp);

}  // namespace spindle::tokenizer
