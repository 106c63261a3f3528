#include "data/chat/unicode.h"

#include <utf8proc.h>

namespace spindle::chat::unicode {

std::u32string decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    auto byte = static_cast<unsigned char>(s[i]);
    int extra = byte < 0x80 ? 0 : byte < 0xE0 ? 1 : byte < 0xF0 ? 2 : 3;
    char32_t c = extra == 0 ? byte : extra == 1 ? (byte & 0x1F) : extra == 2 ? (byte & 0x0F) : (byte & 0x07);
    // Malformed input is carried through one byte at a time instead of failing the render: the
    // JSON parser already rejects invalid UTF-8, so this only guards against template bytes.
    if (extra > 0 && i + extra >= s.size()) {
      out.push_back(byte);
      ++i;
      continue;
    }
    for (int k = 1; k <= extra; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3F);
    out.push_back(c);
    i += extra + 1;
  }
  return out;
}

void append_code_point(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string encode(std::u32string_view cps) {
  std::string out;
  out.reserve(cps.size());
  for (char32_t c : cps) append_code_point(out, c);
  return out;
}

size_t code_point_count(std::string_view s) {
  size_t n = 0;
  for (char ch : s)
    if ((static_cast<unsigned char>(ch) & 0xC0) != 0x80) ++n;
  return n;
}

bool is_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

bool is_printable(char32_t c) {
  if (c == ' ') return true;
  switch (utf8proc_category(static_cast<utf8proc_int32_t>(c))) {
    case UTF8PROC_CATEGORY_CC:
    case UTF8PROC_CATEGORY_CF:
    case UTF8PROC_CATEGORY_CS:
    case UTF8PROC_CATEGORY_CO:
    case UTF8PROC_CATEGORY_CN:
    case UTF8PROC_CATEGORY_ZS:
    case UTF8PROC_CATEGORY_ZL:
    case UTF8PROC_CATEGORY_ZP:
      return false;
    default:
      return true;
  }
}

bool is_cased(char32_t c) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT;
}

bool is_alnum(char32_t c) {
  auto cat = utf8proc_category(static_cast<utf8proc_int32_t>(c));
  return (cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO) ||
         (cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO);
}

namespace {

// The unconditional one-to-many mappings of SpecialCasing.txt that text actually contains;
// utf8proc only offers the one-to-one mappings.
bool append_special_upper(std::string& out, char32_t c) {
  switch (c) {
    case 0xDF: out += "SS"; return true;
    case 0xFB00: out += "FF"; return true;
    case 0xFB01: out += "FI"; return true;
    case 0xFB02: out += "FL"; return true;
    case 0xFB03: out += "FFI"; return true;
    case 0xFB04: out += "FFL"; return true;
    case 0xFB05:
    case 0xFB06: out += "ST"; return true;
    default: return false;
  }
}

void append_upper(std::string& out, char32_t c) {
  if (!append_special_upper(out, c)) append_code_point(out, utf8proc_toupper(static_cast<utf8proc_int32_t>(c)));
}

void append_lower(std::string& out, char32_t c) {
  if (c == 0x130) {  // İ lowercases to i + combining dot above
    out += "i\xCC\x87";
    return;
  }
  append_code_point(out, utf8proc_tolower(static_cast<utf8proc_int32_t>(c)));
}

}  // namespace

std::string to_upper(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : decode(s)) append_upper(out, c);
  return out;
}

std::string to_lower(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : decode(s)) append_lower(out, c);
  return out;
}

std::string title_case_code_point(char32_t c) {
  std::string out;
  switch (c) {
    case 0xDF: return "Ss";
    case 0xFB01: return "Fi";
    case 0xFB02: return "Fl";
    default: append_code_point(out, utf8proc_totitle(static_cast<utf8proc_int32_t>(c)));
  }
  return out;
}

std::string python_title(std::string_view s) {
  std::string out;
  bool previous_is_cased = false;
  for (char32_t c : decode(s)) {
    if (previous_is_cased)
      append_lower(out, c);
    else
      out += title_case_code_point(c);
    previous_is_cased = is_cased(c);
  }
  return out;
}

std::string python_capitalize(std::string_view s) {
  std::u32string cps = decode(s);
  std::string out;
  for (size_t i = 0; i < cps.size(); ++i) {
    if (i == 0)
      out += title_case_code_point(cps[0]);
    else
      append_lower(out, cps[i]);
  }
  return out;
}

std::string strip(std::string_view s, const std::string* chars, bool left, bool right) {
  std::u32string cps = decode(s);
  std::u32string set = chars ? decode(*chars) : std::u32string();
  auto strippable = [&](char32_t c) { return chars ? set.find(c) != std::u32string::npos : is_space(c); };
  size_t begin = 0, end = cps.size();
  if (left)
    while (begin < end && strippable(cps[begin])) ++begin;
  if (right)
    while (end > begin && strippable(cps[end - 1])) --end;
  return encode(std::u32string_view(cps).substr(begin, end - begin));
}

}  // namespace spindle::chat::unicode
