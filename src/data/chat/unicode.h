// Python str semantics on UTF-8 bytes: templates index, slice, strip and case-map strings by
// code point, and every one of those must agree with CPython for the output to be byte-identical.
#pragma once

#include <string>
#include <string_view>

namespace spindle::chat::unicode {

std::u32string decode(std::string_view utf8);
std::string encode(std::u32string_view code_points);
void append_code_point(std::string& out, char32_t code_point);
size_t code_point_count(std::string_view utf8);

// str.isspace(): the 29 code points CPython and the `re` module's \s agree on.
bool is_space(char32_t c);
// str.isprintable(), which decides whether repr() escapes a character.
bool is_printable(char32_t c);
// str.isupper/islower/istitle character classes (letters with case), used by str.title().
bool is_cased(char32_t c);
bool is_alnum(char32_t c);

std::string to_upper(std::string_view s);
std::string to_lower(std::string_view s);
std::string title_case_code_point(char32_t c);  // first letter of a word in str.title()
std::string python_title(std::string_view s);       // str.title()
std::string python_capitalize(std::string_view s);  // str.capitalize()

// str.strip/lstrip/rstrip; `chars` null means Python's default (Unicode whitespace).
std::string strip(std::string_view s, const std::string* chars, bool left, bool right);

}  // namespace spindle::chat::unicode
