// Pre-tokenizers of tokenizer.json: Split (regex or literal, all five behaviours, invert),
// ByteLevel (add_prefix_space, use_regex) and Sequence. They cut normalized text into the pieces
// that BPE encodes one by one.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace spindle::tokenizer {

// A span of the normalized text; prefix_space means ByteLevel(add_prefix_space) put a space in
// front of it that is not in the text.
struct Piece {
  uint32_t begin;
  uint32_t end;
  bool prefix_space;
};

// A compiled PCRE2 pattern (UTF + UCP, JIT when available) with the regex dialect of HF
// tokenizers (Oniguruma) where the two differ.
class Regex {
 public:
  Regex(const std::string& pattern, bool literal);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // Appends [begin, end) of every non-empty match of `text`, leftmost first, to `matches`.
  void find_all(std::string_view text, std::vector<std::pair<uint32_t, uint32_t>>& matches) const;

 private:
  void* code_;  // pcre2_code_8*, kept out of the header
  std::string pattern_;
};

// The pattern with Oniguruma's meaning in PCRE2: \s also matches U+0085, and (?i:...) groups of
// literals match ASCII case only (PCRE2 would also let "s" match "ſ" U+017F).
std::string translate_oniguruma_pattern(const std::string& pattern);

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

class PreTokenizer {
 public:
  // From the "pre_tokenizer" entry of tokenizer.json.
  static PreTokenizer from_json(const nlohmann::json& config);

  bool has_byte_level() const { return has_byte_level_; }
  // Replaces `pieces` with the pieces of `text`.
  void split(std::string_view text, std::vector<Piece>& pieces) const;

 private:
  struct Step {
    enum class Kind { kSplit, kPrefixSpace } kind = Kind::kSplit;
    std::shared_ptr<const Regex> regex;
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;
  };
  void add_from_json(const nlohmann::json& config);
  std::vector<Step> steps_;
  bool has_byte_level_ = false;
};

}  // namespace spindle::tokenizer
