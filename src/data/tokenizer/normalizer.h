// Normalizers of tokenizer.json: the Unicode forms (NFC, NFD, NFKC, NFKD), Replace (literal or
// regex) and Prepend (the SentencePiece word marker), and Sequences of them, keeping an alignment
// from normalized bytes back to the original bytes so that token offsets point into the caller's
// text.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace spindle::tokenizer {

// A normalized segment of the caller's text. Where normalization changed nothing the mapping is
// exact byte for byte; inside a changed stretch (a base letter and its combining marks, a space
// replaced by "▁", a prepended "▁") every normalized byte maps to the whole original stretch.
class NormalizedText {
 public:
  std::string_view text() const { return changed_ ? std::string_view(storage_) : original_; }
  size_t original_begin(size_t normalized_pos) const;  // original offset of a token starting here
  size_t original_end(size_t normalized_pos) const;    // original offset of a token ending here

 private:
  friend class Normalizer;
  struct Chunk {
    size_t normalized_begin, normalized_end, original_begin, original_end;
    bool exact;
  };
  // Makes `text` (with `chunks` mapping it onto the current text) the normalized text, mapped
  // onto the original through the current chunks.
  void compose(std::string& text, const std::vector<Chunk>& chunks);  // takes `text`'s contents
  std::string_view original_;
  size_t origin_ = 0;  // offset of original_ in the caller's text
  bool changed_ = false;
  std::string storage_;
  std::vector<Chunk> chunks_;
};

class Regex;

class Normalizer {
 public:
  enum class Form { kNFC, kNFD, kNFKC, kNFKD };

  // From the "normalizer" entry of tokenizer.json (null means none).
  static Normalizer from_json(const nlohmann::json& config);

  bool empty() const { return steps_.empty(); }
  // `origin` is the offset of `text` inside the caller's full text.
  void normalize(std::string_view text, size_t origin, NormalizedText& out) const;
  std::string normalize(std::string_view text) const;

 private:
  struct Step {
    enum class Kind { kForms, kReplace, kPrepend } kind = Kind::kForms;
    std::vector<Form> forms;              // kForms: applied in order
    std::shared_ptr<const Regex> pattern;  // kReplace
    std::string content;                  // kReplace: the replacement; kPrepend: the prefix
  };
  void add_from_json(const nlohmann::json& config);
  // Each returns false when it leaves `text` as it is; otherwise fills `out` and `chunks`
  // (mapping `out` onto `text`).
  bool apply_forms(const std::vector<Form>& forms, std::string_view text, std::string& out,
                   std::vector<NormalizedText::Chunk>& chunks) const;
  static bool apply_replace(const Step& step, std::string_view text, std::string& out,
                            std::vector<NormalizedText::Chunk>& chunks);
  static bool apply_prepend(const Step& step, std::string_view text, std::string& out,
                            std::vector<NormalizedText::Chunk>& chunks);
  std::vector<Step> steps_;
};

}  // namespace spindle::tokenizer
