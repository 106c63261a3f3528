// Turns one JSONL sample of any format into training documents (token ids, labels in HF alignment,
// per-token loss_scale).
//
// Text formats are tokenized as TRL's SFTTrainer does: `text` is encode(text) + EOS, all
// supervised; prompt/completion is encode(prompt) (special tokens added, not supervised) followed
// by encode(completion, no special tokens) + EOS (supervised). Encoding the two parts separately
// keeps the prompt/completion boundary exact. EOS is not appended when the text already ends with
// it or the tokenizer names none.
//
// Conversations (messages, ShareGPT, Alpaca) are rendered with the model's chat template and
// tokenized as apply_chat_template(..., tokenize=True) does (chat_encoding.h); the assistant turns
// (content and end-of-turn marker, docs/chat_templates.md) are supervised, weighted by each
// message's loss_scale; nothing is appended (the template writes the end of every turn).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/chat/model_folder.h"
#include "data/chat_encoding.h"
#include "data/document.h"
#include "data/jsonl_reader.h"
#include "data/sample_formats.h"

namespace spindle {

// The part of a tokenizer the dataset formats need; tests use a fake one.
class TextEncoder {
 public:
  virtual ~TextEncoder() = default;
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const = 0;
  // The ids of encode(text, add_special_tokens=false) with each token's [begin, end) bytes in
  // `text`: how chat renderings are tokenized and their supervised spans mapped to tokens.
  virtual void encode_with_offsets(std::string_view text, std::vector<int32_t>& ids,
                                   std::vector<chat::ByteSpan>& offsets) const = 0;
  // The model's chat template (and special tokens) for a sample with or without tools. Throws
  // Error saying why when the tokenizer folder has none (e.g. a base model).
  virtual const chat::ModelChatTemplate& chat_template(bool with_tools) const = 0;
  virtual std::optional<int32_t> eos_token_id() const = 0;
  virtual int64_t vocab_size() const = 0;
};

// The tokenizer of a Hugging Face model folder (tokenizer.json, tokenizer_config.json) and its
// chat template (chat_template.jinja or tokenizer_config.json; optional until a conversation
// needs it).
std::unique_ptr<TextEncoder> load_text_encoder(const std::filesystem::path& tokenizer_dir);

struct EncodeOptions {
  SampleFormat format = SampleFormat::kAuto;
  bool append_eos = true;
  ReadOptions read;  // pre-tokenized validation; vocab_size 0 takes the tokenizer's
  chat::RenderOptions chat_render;  // the clock strftime_now() reads (unset: the real one)
};

// A DPO pair as two documents with the same prompt; only each side's answer is supervised.
struct PreferenceDocuments {
  Document chosen;
  Document rejected;
};

// A conversation as rendered and tokenized, and the training document made of it.
struct ConversationEncoding {
  ChatEncoding chat;
  Document document;  // labels where supervised and loss_scale > 0
};

class SampleEncoder {
 public:
  // `text_encoder` may be null: then only pre-tokenized samples can be encoded.
  SampleEncoder(const TextEncoder* text_encoder, EncodeOptions options);

  // A JSONL line as a sample, keeping its keys in order: chat templates print tool schemas and
  // tool-call arguments with tojson in the order the data gives them, as Python's json does.
  // Throws BadSample as parse_jsonl_line does.
  static nlohmann::ordered_json parse_sample(std::string_view line);

  // The format this sample is read as (the forced one, or the one its fields select).
  SampleFormat format_of(const nlohmann::ordered_json& sample) const;
  SampleFormat format_of(const nlohmann::json& sample) const;

  // One supervised-fine-tuning document. Throws BadSample for bad content (chat template errors
  // included, as "chat template line N: reason"); Error when the format needs something this run
  // lacks (a tokenizer, a chat template) or is a preference pair. A nlohmann::json sample has
  // lost its key order (see parse_sample); the ordered form renders exactly.
  Document encode(const nlohmann::ordered_json& sample) const;
  Document encode(const nlohmann::json& sample) const;

  // A conversation sample (messages, ShareGPT conversations, Alpaca) rendered with the model's
  // chat template. `add_generation_prompt` appends the prompt of the next assistant turn, as at
  // inference (spindle tokenize --chat shows it); training renders without it.
  ConversationEncoding encode_conversation(const nlohmann::ordered_json& sample,
                                           bool add_generation_prompt = false) const;

  // Conversational pairs render the shared history followed by each side; only the side's
  // assistant turns are supervised.
  PreferenceDocuments encode_preference(const nlohmann::ordered_json& sample) const;
  PreferenceDocuments encode_preference(const nlohmann::json& sample) const;

  // Pre-tokenized validation in effect (vocab_size filled in from the tokenizer).
  const ReadOptions& read_options() const { return options_.read; }

 private:
  const TextEncoder& require_text_encoder(SampleFormat format) const;
  std::vector<int32_t> encode_text(std::string_view text, bool add_special_tokens) const;
  // Renders `messages` (aligned with `variables["messages"]`) and makes the document in which the
  // assistant turns from `first_trained_message` on are supervised.
  ConversationEncoding encode_messages(const nlohmann::ordered_json& variables, const std::vector<ChatMessage>& messages,
                                       size_t first_trained_message, bool add_generation_prompt) const;

  const TextEncoder* text_encoder_;
  EncodeOptions options_;
};

}  // namespace spindle
