#include "data/tokenizer/utf8.h"

#include <cstring>

#include <utf8proc.h>

#include "core/error.h"

namespace spindle::tokenizer {

namespace {

// Length of the valid sequence starting at bytes[pos], or 0 when the sequence there is invalid.
// Follows Unicode Table 3-7 (well-formed byte sequences): no overlongs, no surrogates, ≤ U+10FFFF.
size_t valid_sequence_length(std::string_view bytes, size_t pos) {
  const auto b0 = static_cast<unsigned char>(bytes[pos]);
  const size_t left = bytes.size() - pos;
  auto at = [&](size_t i) { return static_cast<unsigned char>(bytes[pos + i]); };
  auto is_cont = [&](size_t i) { return i < left && (at(i) & 0xC0) == 0x80; };
  if (b0 < 0x80) return 1;
  if (b0 >= 0xC2 && b0 <= 0xDF) return is_cont(1) ? 2 : 0;
  if (b0 >= 0xE0 && b0 <= 0xEF) {
    if (left < 2) return 0;
    const unsigned char lo = b0 == 0xE0 ? 0xA0 : 0x80;
    const unsigned char hi = b0 == 0xED ? 0x9F : 0xBF;
    if (at(1) < lo || at(1) > hi) return 0;
    return is_cont(2) ? 3 : 0;
  }
  if (b0 >= 0xF0 && b0 <= 0xF4) {
    if (left < 2) return 0;
    const unsigned char lo = b0 == 0xF0 ? 0x90 : 0x80;
    const unsigned char hi = b0 == 0xF4 ? 0x8F : 0xBF;
    if (at(1) < lo || at(1) > hi) return 0;
    return is_cont(2) && is_cont(3) ? 4 : 0;
  }
  return 0;
}

// Length of the longest prefix at bytes[pos] that could still start a valid sequence (≥ 1): the
// "maximal subpart" that Rust and the Unicode standard replace with a single U+FFFD.
size_t maximal_invalid_subpart(std::string_view bytes, size_t pos) {
  const auto b0 = static_cast<unsigned char>(bytes[pos]);
  const size_t left = bytes.size() - pos;
  auto at = [&](size_t i) { return static_cast<unsigned char>(bytes[pos + i]); };
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 2;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 3;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 4;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;
  } else {
    return 1;
  }
  size_t n = 1;
  if (n < left && at(1) >= lo && at(1) <= hi) {
    ++n;
    while (n < need && n < left && (at(n) & 0xC0) == 0x80) ++n;
  }
  return n;
}

}  // namespace

size_t find_invalid_utf8(std::string_view text) {
  size_t pos = 0;
  const size_t size = text.size();
  while (pos < size) {
    // Most training text is ASCII: check eight bytes at a time.
    if (pos + 8 <= size) {
      uint64_t chunk;
      std::memcpy(&chunk, text.data() + pos, 8);
      if ((chunk & 0x8080808080808080ULL) == 0) {
        pos += 8;
        continue;
      }
    }
    const size_t length = valid_sequence_length(text, pos);
    if (length == 0) return pos;
    pos += length;
  }
  return std::string_view::npos;
}

void require_valid_utf8(std::string_view text, std::string_view what) {
  const size_t bad = find_invalid_utf8(text);
  if (bad == std::string_view::npos) return;
  fail("{} is not valid UTF-8: invalid byte 0x{:02X} at byte offset {}; the tokenizer accepts only "
       "Unicode text (as HF tokenizers, which takes a Python str) — re-encode the input as UTF-8 or "
       "replace the invalid bytes",
       what, static_cast<unsigned char>(text[bad]), bad);
}

char32_t previous_code_point(std::string_view text, size_t& pos) {
  size_t start = pos - 1;
  while (start > 0 && (static_cast<unsigned char>(text[start]) & 0xC0) == 0x80) --start;
  size_t cursor = start;
  const char32_t cp = next_code_point(text, cursor);
  pos = start;
  return cp;
}

void append_utf8(std::string& out, char32_t cp) {
  if (cp < 0x80) {
    out.push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

std::string utf8_lossy(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size());
  size_t pos = 0;
  while (pos < bytes.size()) {
    const size_t length = valid_sequence_length(bytes, pos);
    if (length > 0) {
      out.append(bytes.substr(pos, length));
      pos += length;
    } else {
      out.append("\xEF\xBF\xBD");
      pos += maximal_invalid_subpart(bytes, pos);
    }
  }
  return out;
}

bool is_unicode_whitespace(char32_t cp) {
  switch (cp) {
    case 0x09: case 0x0A: case 0x0B: case 0x0C: case 0x0D: case 0x20: case 0x85: case 0xA0:
    case 0x1680: case 0x2028: case 0x2029: case 0x202F: case 0x205F: case 0x3000:
      return true;
    default:
      return cp >= 0x2000 && cp <= 0x200A;
  }
}

bool is_unicode_alphanumeric(char32_t cp) {
  if (cp < 0x80) return (cp >= '0' && cp <= '9') || ((cp | 0x20) >= 'a' && (cp | 0x20) <= 'z');
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(cp))) {
    case UTF8PROC_CATEGORY_LU: case UTF8PROC_CATEGORY_LL: case UTF8PROC_CATEGORY_LT:
    case UTF8PROC_CATEGORY_LM: case UTF8PROC_CATEGORY_LO: case UTF8PROC_CATEGORY_NL:
    case UTF8PROC_CATEGORY_ND: case UTF8PROC_CATEGORY_NO:
      return true;
    default:
      return false;
  }
}

}  // namespace spindle::tokenizer
