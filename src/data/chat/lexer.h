// Tokenizer with jinja2's exact whitespace rules as transformers configures them: trim_blocks,
// lstrip_blocks, `-`/`+` markers, CRLF normalisation and the dropped final newline.
#pragma once

#include <string>
#include <vector>

namespace spindle::chat {

enum class TokenType { Data, VariableBegin, VariableEnd, BlockBegin, BlockEnd, Name, String, Integer, Float, Operator, End };

struct Token {
  TokenType type;
  std::string text;  // data text, name, decoded string literal, number digits or operator
  int line;
};

// Throws spindle::Error naming the template line for unterminated tags, comments and strings.
std::vector<Token> tokenize(const std::string& source);

}  // namespace spindle::chat
