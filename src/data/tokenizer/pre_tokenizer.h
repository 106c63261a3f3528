// Pre-tokenizers of tokenizer.json: Split (regex or literal, all five behaviours, invert),
// ByteLevel (add_prefix_space, use_regex), Metaspace (the SentencePiece word marker: replacement,
// prepend_scheme always/first/never, split) and Sequence. They cut normalized text into the pieces
// that BPE encodes one by one.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "data/tokenizer/regex.h"

namespace spindle::tokenizer {

// A span of the normalized text; `prefixed` means the pre-tokenizer put its prefix in front of it
// (PreTokenizer::prefix(): ByteLevel's space, Metaspace's replacement), which is not in the text.
struct Piece {
  uint32_t begin;
  uint32_t end;
  bool prefixed;
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

class PreTokenizer {
 public:
  // From the "pre_tokenizer" entry of tokenizer.json.
  static PreTokenizer from_json(const nlohmann::json& config);

  bool has_byte_level() const { return has_byte_level_; }
  // What a prefixed piece starts with: " " (ByteLevel) or the Metaspace replacement.
  std::string_view prefix() const { return metaspace_ ? std::string_view(metaspace_->replacement) : " "; }
  // What each space of a piece becomes before BPE sees it: the Metaspace replacement, or empty
  // when spaces stay spaces.
  std::string_view space_replacement() const {
    return metaspace_ ? std::string_view(metaspace_->replacement) : std::string_view();
  }
  // Replaces `pieces` with the pieces of `text`. `at_input_start` says that `text` begins at
  // offset 0 of the caller's input (Metaspace's "first" scheme prefixes only that piece).
  void split(std::string_view text, bool at_input_start, std::vector<Piece>& pieces) const;

 private:
  struct Step {
    enum class Kind { kSplit, kPrefixSpace } kind = Kind::kSplit;
    std::shared_ptr<const Regex> regex;
    SplitBehavior behavior = SplitBehavior::kIsolated;
    bool invert = false;
  };
  enum class PrependScheme { kAlways, kFirst, kNever };
  struct Metaspace {
    std::string replacement;
    PrependScheme scheme = PrependScheme::kAlways;
    bool split = true;
  };
  void add_from_json(const nlohmann::json& config);
  void metaspace_split(std::string_view text, bool at_input_start, std::vector<Piece>& pieces) const;
  std::vector<Step> steps_;
  bool has_byte_level_ = false;
  std::optional<Metaspace> metaspace_;
};

}  // namespace spindle::tokenizer
