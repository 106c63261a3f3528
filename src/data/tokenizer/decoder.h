// Decoders of tokenizer.json, which turn tokens back into text the way HF `tokenizers` does:
// ByteLevel (the GPT-2 byte alphabet), Replace (literal or regex, per token), ByteFallback (runs
// of <0xNN> tokens to UTF-8, one U+FFFD per byte of an invalid run), Fuse (all tokens into one),
// Strip (a character off the start and end of each token), Metaspace (the word marker back to a
// space, dropped at the start of the first token) and Sequence of them.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace spindle::tokenizer {

class Regex;

class Decoder {
 public:
  // From the "decoder" entry of tokenizer.json (null means none: tokens joined with spaces).
  static Decoder from_json(const nlohmann::json& config);

  bool empty() const { return steps_.empty(); }
  // True when the decoder is ByteLevel alone (or a Sequence of just it), which maps every token
  // to the bytes it stands for.
  bool is_byte_level() const;
  // The text of `tokens` (as written in the vocab, added tokens as their content); invalid UTF-8
  // that byte-level decoding produces becomes U+FFFD as in Rust's from_utf8_lossy.
  std::string decode(std::vector<std::string> tokens) const;

 private:
  struct Step {
    enum class Kind { kByteLevel, kReplace, kByteFallback, kFuse, kStrip, kMetaspace } kind = Kind::kFuse;
    std::shared_ptr<const Regex> pattern;  // kReplace
    std::string content;                   // kReplace: the replacement; kStrip, kMetaspace: the character
    size_t start = 0, stop = 0;            // kStrip: at most this many from each end
    bool keep_first_marker = false;        // kMetaspace: prepend_scheme "never"
  };
  void add_from_json(const nlohmann::json& config);
  std::vector<Step> steps_;
};

}  // namespace spindle::tokenizer
