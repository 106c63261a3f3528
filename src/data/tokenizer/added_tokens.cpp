#include "data/tokenizer/added_tokens.h"

#include <algorithm>

#include "data/tokenizer/utf8.h"

namespace spindle::tokenizer {

AddedTokenMatcher::AddedTokenMatcher(std::vector<AddedToken> tokens, std::vector<std::string> patterns)
    : tokens_(std::move(tokens)) {
  trie_.emplace_back();
  for (size_t index = 0; index < patterns.size(); ++index) {
    const std::string& pattern = patterns[index];
    if (pattern.empty()) continue;  // an empty token can never be found (HF skips it too)
    first_bytes_.set(static_cast<unsigned char>(pattern[0]));
    int32_t node = 0;
    for (unsigned char byte : pattern) {
      auto& children = trie_[node].children;
      auto it = std::lower_bound(children.begin(), children.end(), byte,
                                 [](const auto& child, unsigned char b) { return child.first < b; });
      if (it != children.end() && it->first == byte) {
        node = it->second;
      } else {
        const int32_t created = static_cast<int32_t>(trie_.size());
        children.insert(it, {byte, created});
        trie_.emplace_back();  // may reallocate: `children` is not used after this
        node = created;
      }
    }
    if (trie_[node].token < 0) trie_[node].token = static_cast<int32_t>(index);
  }
}

std::pair<int32_t, size_t> AddedTokenMatcher::longest_at(std::string_view text, size_t pos) const {
  int32_t node = 0, best = -1;
  size_t best_end = pos;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto& children = trie_[node].children;
    const auto byte = static_cast<unsigned char>(text[i]);
    auto it = std::lower_bound(children.begin(), children.end(), byte,
                               [](const auto& child, unsigned char b) { return child.first < b; });
    if (it == children.end() || it->first != byte) break;
    node = it->second;
    if (trie_[node].token >= 0) {
      best = trie_[node].token;
      best_end = i + 1;
    }
  }
  return {best, best_end};
}

namespace {

bool ends_with_word(std::string_view text) {
  if (text.empty()) return false;
  size_t pos = text.size();
  return is_unicode_alphanumeric(previous_code_point(text, pos));
}

bool starts_with_word(std::string_view text) {
  if (text.empty()) return false;
  size_t pos = 0;
  return is_unicode_alphanumeric(next_code_point(text, pos));
}

}  // namespace

void AddedTokenMatcher::split(std::string_view text, size_t origin, std::vector<AddedSplit>& splits) const {
  size_t emitted_up_to = 0;
  size_t search_from = 0;
  while (search_from < text.size()) {
    size_t pos = search_from;
    std::pair<int32_t, size_t> found{-1, 0};
    for (; pos < text.size(); ++pos) {
      if (!first_bytes_.test(static_cast<unsigned char>(text[pos]))) continue;
      found = longest_at(text, pos);
      if (found.first >= 0) break;
    }
    if (found.first < 0) break;
    const AddedToken& token = tokens_[found.first];
    size_t start = pos, stop = found.second;
    // The scan resumes after the match itself, even when stripping widens the token's span.
    search_from = stop;
    if (token.single_word && (ends_with_word(text.substr(0, start)) || starts_with_word(text.substr(stop)))) continue;
    if (token.lstrip) {
      size_t back = start;
      while (back > 0) {
        size_t previous = back;
        if (!is_unicode_whitespace(previous_code_point(text, previous))) break;
        back = previous;
      }
      start = std::max(back, emitted_up_to);
    }
    if (token.rstrip) {
      while (stop < text.size()) {
        size_t next = stop;
        if (!is_unicode_whitespace(next_code_point(text, next))) break;
        stop = next;
      }
    }
    if (emitted_up_to < start) splits.push_back({-1, origin + emitted_up_to, origin + start});
    splits.push_back({token.id, origin + start, origin + stop});
    emitted_up_to = stop;
  }
  if (emitted_up_to < text.size()) splits.push_back({-1, origin + emitted_up_to, origin + text.size()});
}

}  // namespace spindle::tokenizer
