// Turns one JSONL sample of any format into training documents (token ids, labels in HF alignment,
// per-token loss_scale).
//
// Text formats are tokenized as TRL's SFTTrainer does: `text` is encode(text) + EOS, all
// supervised; prompt/completion is encode(prompt) (special tokens added, not supervised) followed
// by encode(completion, no special tokens) + EOS (supervised). Encoding the two parts separately
// keeps the prompt/completion boundary exact. EOS is not appended when the text already ends with
// it or the tokenizer names none.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/document.h"
#include "data/jsonl_reader.h"
#include "data/sample_formats.h"

namespace spindle {

// The part of a tokenizer the dataset formats need; tests use a fake one.
class TextEncoder {
 public:
  virtual ~TextEncoder() = default;
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const = 0;
  virtual std::optional<int32_t> eos_token_id() const = 0;
  virtual int64_t vocab_size() const = 0;
};

// The tokenizer of a Hugging Face model folder (tokenizer.json, tokenizer_config.json).
std::unique_ptr<TextEncoder> load_text_encoder(const std::filesystem::path& tokenizer_dir);

struct EncodeOptions {
  SampleFormat format = SampleFormat::kAuto;
  bool append_eos = true;
  ReadOptions read;  // pre-tokenized validation; vocab_size 0 takes the tokenizer's
};

// A DPO pair as two documents with the same prompt; only each side's answer is supervised.
struct PreferenceDocuments {
  Document chosen;
  Document rejected;
};

class SampleEncoder {
 public:
  // `text_encoder` may be null: then only pre-tokenized samples can be encoded.
  SampleEncoder(const TextEncoder* text_encoder, EncodeOptions options);

  // The format this sample is read as (the forced one, or the one its fields select).
  SampleFormat format_of(const nlohmann::json& sample) const;

  // One supervised-fine-tuning document. Throws BadSample for bad content; Error when the format
  // needs something this run lacks (a tokenizer, the chat template) or is a preference pair.
  Document encode(const nlohmann::json& sample) const;

  PreferenceDocuments encode_preference(const nlohmann::json& sample) const;

  // Pre-tokenized validation in effect (vocab_size filled in from the tokenizer).
  const ReadOptions& read_options() const { return options_.read; }

 private:
  const TextEncoder& require_text_encoder(SampleFormat format) const;
  std::vector<int32_t> encode_text(std::string_view text, bool add_special_tokens) const;

  const TextEncoder* text_encoder_;
  EncodeOptions options_;
};

}  // namespace spindle
