// Patterns of tokenizer.json ({"Regex": ...} or {"String": ...}, as Split pre-tokenizers and
// Replace normalizers and decoders write them), compiled with PCRE2 in the regex dialect of HF
// tokenizers (Oniguruma).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace spindle::tokenizer {

// A compiled PCRE2 pattern (UTF + UCP, JIT when available) with the regex dialect of HF
// tokenizers (Oniguruma) where the two differ.
class Regex {
 public:
  Regex(const std::string& pattern, bool literal);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  // From a tokenizer.json pattern object: {"Regex": "..."} or {"String": "..."} (matched
  // literally). `where` names the component in errors, e.g. "Split pre_tokenizer".
  static std::shared_ptr<const Regex> from_json(const nlohmann::json& pattern, std::string_view where);

  // Appends [begin, end) of every non-empty match of `text`, leftmost first, to `matches`.
  void find_all(std::string_view text, std::vector<std::pair<uint32_t, uint32_t>>& matches) const;

  // Every non-empty match replaced by `content`.
  std::string replace_all(std::string_view text, std::string_view content) const;

  // The literal text when the pattern was {"String": ...}, which callers search for directly.
  const std::string* literal() const { return literal_ ? &pattern_ : nullptr; }

 private:
  void* code_;  // pcre2_code_8*, kept out of the header
  std::string pattern_;
  bool literal_;
};

// The pattern with Oniguruma's meaning in PCRE2: \s also matches U+0085, and (?i:...) groups of
// literals match ASCII case only (PCRE2 would also let "s" match "ſ" U+017F).
std::string translate_oniguruma_pattern(const std::string& pattern);

}  // namespace spindle::tokenizer
