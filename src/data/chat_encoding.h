// Conversations as the model sees them. The model's chat template renders the messages exactly as
// transformers' apply_chat_template does; the rendering is tokenized as apply_chat_template(...,
// tokenize=True) tokenizes it (no special tokens added: the template writes them itself); and the
// supervised byte spans of each assistant turn (docs/chat_templates.md) become per-token
// supervision, by the rule transformers' return_assistant_tokens_mask applies.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/chat/chat_template.h"
#include "data/chat/model_folder.h"
#include "data/sample_formats.h"

namespace spindle {

// Tokenizes `text` with no special tokens added, giving each token's [begin, end) bytes in `text`.
using OffsetTokenizer =
    std::function<void(std::string_view text, std::vector<int32_t>& ids, std::vector<chat::ByteSpan>& offsets)>;

// Values of ChatEncoding::turn_of_token besides a message index.
inline constexpr int32_t kPromptToken = -1;  // not supervised
// Supervised by a {% generation %} block that cannot be tied to one message (the template has a
// different number of blocks than the conversation has assistant messages).
inline constexpr int32_t kUnattributedTurn = -2;

struct ChatEncoding {
  std::string text;          // the rendering, byte-identical to apply_chat_template(tokenize=False)
  std::vector<int32_t> ids;  // = apply_chat_template(tokenize=True)
  // Per token: the index in the context's messages of the assistant message whose supervised span
  // holds the token, kPromptToken, or kUnattributedTurn.
  std::vector<int32_t> turn_of_token;

  bool supervised(size_t token) const { return turn_of_token[token] != kPromptToken; }
};

// Which span holds each token: the index into `spans` (ascending, non-overlapping), or -1.
// A token belongs to a span iff at least one of its bytes lies inside it, so a text token that
// BPE merged across a span boundary is supervised. This is transformers' rule (it marks the tokens
// from char_to_token(first character) through char_to_token(last character), i.e. every token
// holding a character of the span), stated per byte; where the two could differ spindle is the
// stricter about covering the span: a token holding the second half of the span's last character
// is supervised too (transformers marks only the token of the character's first byte), and a span
// whose first character no token claims (ByteLevel trim_offsets) is still supervised where
// transformers stops marking the rest of the sequence. A token with an empty span (offsets trimmed
// to nothing) belongs to the span that holds its position, excluding the span's start.
std::vector<int32_t> tokens_in_spans(const std::vector<chat::ByteSpan>& token_offsets,
                                     const std::vector<chat::ByteSpan>& spans);

// Renders `context` (see chat::transformers_context), tokenizes the text and locates each
// assistant turn's supervised tokens. Throws chat::TemplateError for template errors (with the
// template line) and Error when the spans cannot be derived for this template.
ChatEncoding encode_chat(const chat::ChatTemplate& chat_template, const nlohmann::ordered_json& context,
                         const OffsetTokenizer& tokenize, const chat::RenderOptions& options = {});

// The variables a conversation sample gives the chat template, before the special tokens:
// "messages" (OpenAI-style: the sample's own message objects for `messages` data, keeping fields
// such as reasoning_content or tool_calls, with roles normalised and a top-level "system"
// prepended; the normalised conversation for ShareGPT and Alpaca), "tools" when the sample has
// them, and the entries of a "chat_template_kwargs" object (e.g. enable_thinking), as TRL passes
// them. `conversation` is parse_conversation/parse_alpaca of the same sample.
nlohmann::ordered_json chat_template_variables(const nlohmann::ordered_json& sample, SampleFormat format,
                                               const Conversation& conversation);

// A model folder's chat templates. transformers picks the template per call: a named list in
// tokenizer_config.json offers "tool_use" for calls with tools, "default" otherwise.
class ModelChatTemplates {
 public:
  // Never throws: a folder without a usable chat template (a base model's) keeps the reason,
  // which for_sample() reports when a conversation needs it, so text data still works.
  explicit ModelChatTemplates(const std::filesystem::path& model_dir);
  // Throws Error naming the folder when it has no chat template or the template does not parse.
  const chat::ModelChatTemplate& for_sample(bool with_tools) const;

 private:
  std::optional<chat::ModelChatTemplate> without_tools_, with_tools_;
  std::string unavailable_reason_;
};

}  // namespace spindle
