// Unicode normalizers of tokenizer.json (NFC, NFD, NFKC, NFKD, and Sequences of them), keeping an
// alignment from normalized bytes back to the original bytes so that token offsets point into the
// caller's text.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace spindle::tokenizer {

// A normalized segment of the caller's text. Where normalization changed nothing the mapping is
// exact byte for byte; inside a changed stretch (a base letter and its combining marks, say) every
// normalized byte maps to the whole original stretch.
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
  std::string_view original_;
  size_t origin_ = 0;  // offset of original_ in the caller's text
  bool changed_ = false;
  std::string storage_;
  std::vector<Chunk> chunks_;
};

class Normalizer {
 public:
  enum class Form { kNFC, kNFD, kNFKC, kNFKD };

  // From the "normalizer" entry of tokenizer.json (null means none).
  static Normalizer from_json(const nlohmann::json& config);

  bool empty() const { return forms_.empty(); }
  // `origin` is the offset of `text` inside the caller's full text.
  void normalize(std::string_view text, size_t origin, NormalizedText& out) const;
  std::string normalize(std::string_view text) const;

 private:
  std::string apply_forms(std::string_view segment) const;
  std::vector<Form> forms_;
};

}  // namespace spindle::tokenizer
