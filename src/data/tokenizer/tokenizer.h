// spindle::Tokenizer: the BPE tokenizer of a Hugging Face model folder (tokenizer.json plus
// tokenizer_config.json), giving the ids and decodings HF `tokenizers` gives: byte-level files
// (Qwen2/2.5/3, Llama 3, Mistral Tekken, gpt-oss) and SentencePiece-style ones (Llama 2, Mistral,
// Phi-3, Gemma: byte fallback, the ▁ word marker).
//
// Text must be valid UTF-8: HF takes a Python str, which cannot hold invalid bytes, so invalid
// input is an error (spindle::Error naming the byte offset) rather than a silent replacement.
// Every const method may be called from many threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/tokenizer/post_processor.h"

namespace spindle {

using tokenizer::ByteSpan;

// Ids with, for each, the bytes [begin, end) of the input it came from. Tokens added by the
// post-processor (a BOS) have the empty span {0, 0}. A token that holds part of a multi-byte
// character spans exactly its bytes; where the normalizer changed the text (NFC composing a letter
// and its accent) every token of the changed stretch spans the whole original stretch.
struct Encoding {
  std::vector<int32_t> ids;
  std::vector<ByteSpan> offsets;
};

class Tokenizer {
 public:
  // Loads `dir`/tokenizer.json and, when present, `dir`/tokenizer_config.json.
  static Tokenizer load(const std::string& dir);
  // From the file contents; `config_json` may be empty. `origin` names the source in errors.
  static Tokenizer from_json(std::string_view tokenizer_json, std::string_view config_json,
                             const std::string& origin = "tokenizer.json");

  // = HF `Tokenizer.encode(text, add_special_tokens=...).ids`.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  Encoding encode_with_offsets(std::string_view text, bool add_special_tokens = true) const;
  // = HF `Tokenizer.decode(ids, skip_special_tokens=...)`, except that an id outside the vocab is
  // an error (HF drops it silently).
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // The token as written in tokenizer.json (byte-level stand-ins: "Ġthe"); nullopt if unknown.
  std::optional<std::string> id_to_token(int32_t id) const;
  // One more than the largest id, added tokens included: the embedding rows a model needs.
  int32_t vocab_size() const;
  bool is_special(int32_t id) const;

  // Special tokens named by tokenizer_config.json (nullopt when it names none or is absent).
  const std::optional<std::string>& bos_token() const;
  const std::optional<std::string>& eos_token() const;
  const std::optional<std::string>& pad_token() const;
  std::optional<int32_t> bos_token_id() const;
  std::optional<int32_t> eos_token_id() const;
  std::optional<int32_t> pad_token_id() const;

  struct Impl;

 private:
  explicit Tokenizer(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

}  // namespace spindle
