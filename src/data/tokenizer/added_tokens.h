// Added (and special) tokens of tokenizer.json, found in the text before anything else touches it,
// with HF's flags: lstrip/rstrip swallow neighbouring whitespace, single_word requires word
// boundaries, normalized says whether the token is matched on the normalized or the raw text.
#pragma once

#include <bitset>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace spindle::tokenizer {

struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = false;
  bool special = false;
};

// A stretch of text: an added token (id ≥ 0) or text for the model (id = -1).
struct AddedSplit {
  int32_t id;
  size_t begin;
  size_t end;
};

// Leftmost-longest matching of a set of added tokens (HF uses Aho-Corasick with the same rule).
class AddedTokenMatcher {
 public:
  AddedTokenMatcher() = default;
  // `patterns[i]` is what is searched for `tokens[i]` (its content, normalized when the token is).
  AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns);

  bool empty() const { return tokens_.empty(); }
  // Cuts `text` into added tokens and the text between them; appends to `splits` with offsets
  // shifted by `origin`.
  void split(std::string_view text, size_t origin, std::vector<AddedSplit>& splits) const;

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int32_t>> children;  // sorted by byte
    int32_t token = -1;  // index into tokens_ of the pattern ending here
  };
  // Longest pattern starting at text[pos]: (token index, end) or (-1, pos).
  std::pair<int32_t, size_t> longest_at(std::string_view text, size_t pos) const;

  std::vector<AddedToken> tokens_;
  std::vector<Node> trie_;
  std::bitset<256> first_bytes_;
};

}  // namespace spindle::tokenizer
