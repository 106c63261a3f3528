// The JSONL sample formats users already have, recognised by their fields and normalised before
// tokenization:
//
//   pre-tokenized   {"input_ids": [...], "labels"|"loss_mask": [...], "loss_scale": [...]}
//   text            {"text": "..."}                                     all supervised
//   prompt/completion {"prompt": "...", "completion"|"response": "..."}  prompt not supervised
//   Alpaca          {"instruction", "input"?, "output", "system"?, "history"?}  → a conversation
//   messages        {"messages": [{"role", "content", "loss_scale"?}], "tools"?}
//   ShareGPT        {"conversations": [{"from", "value"}], "system"?, "tools"?} → messages
//   preference      {"chosen", "rejected"} with "prompt", or shared message history (DPO)
//
// Conversations are normalised to OpenAI-style messages (roles system, user, assistant, tool),
// each with an optional per-message loss_scale; the chat template turns them into text.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

namespace spindle {

enum class SampleFormat {
  kAuto,  // detect per sample from its fields
  kPretokenized,
  kText,
  kPromptCompletion,
  kAlpaca,
  kMessages,  // `messages` or ShareGPT `conversations`
  kPreference,
};
// "auto", "pretokenized", "text", "prompt-completion", "alpaca", "messages", "preference".
SampleFormat parse_sample_format(std::string_view name);
std::string_view sample_format_name(SampleFormat format);

// The format a sample's fields select. Throws BadSample when no format matches, or when the fields
// of two formats are present (e.g. both "text" and "messages"), naming the fields found.
SampleFormat detect_sample_format(const nlohmann::json& sample);

// The top-level fields any format reads, and those of them that select a format (detect_sample_format).
// A table (Parquet, Arrow) is read as these columns only: its other columns are never decoded.
const std::vector<std::string>& sample_fields();
const std::vector<std::string>& format_selecting_fields();

struct ChatMessage {
  std::string role;  // system, user, assistant or tool
  std::string content;
  nlohmann::json tool_calls;  // OpenAI tool_calls of an assistant message; null when absent
  std::string tool_call_id;   // of a tool message; empty when absent
  // Weight of this message's tokens in the loss. Unset: 1 for assistant messages, 0 otherwise.
  // Set by "loss_scale" (number >= 0), "loss" (true/false, as ms-swift) or "weight" (0/1, as
  // Axolotl's ShareGPT).
  std::optional<float> loss_scale;

  float effective_loss_scale() const { return loss_scale.value_or(role == "assistant" ? 1.0f : 0.0f); }
  bool operator==(const ChatMessage&) const = default;
};

struct Conversation {
  std::vector<ChatMessage> messages;
  nlohmann::json tools;  // OpenAI tool schemas; null when absent

  // The OpenAI-style JSON a chat template receives as `messages`.
  nlohmann::json messages_json() const;
};

// Normalises "messages" (OpenAI) or "conversations" (ShareGPT) plus optional top-level "system"
// and "tools". Throws BadSample for a missing or empty list, a message without role or content, an
// unknown role, non-text content parts, or a bad loss_scale, naming the message index.
Conversation parse_conversation(const nlohmann::json& sample);

// Alpaca to a conversation: system?, history pairs, then user = instruction + "\n" + input (input
// omitted when empty) and assistant = output, as LLaMA-Factory converts it.
Conversation parse_alpaca(const nlohmann::json& sample);

struct PromptCompletion {
  std::string prompt;  // not supervised
  std::string completion;
};
// {"prompt", "completion"} or {"prompt", "response"}; both strings (the prompt may be empty).
PromptCompletion parse_prompt_completion(const nlohmann::json& sample);

// {"text": "..."}: a non-empty string.
std::string parse_text(const nlohmann::json& sample);

// One DPO pair. Text pairs hold strings; conversational pairs hold the shared history (`prompt`)
// and each side's continuation (usually one assistant message).
struct PreferencePair {
  bool conversational = false;
  std::string prompt_text, chosen_text, rejected_text;
  Conversation prompt;
  std::vector<ChatMessage> chosen, rejected;
};

// Accepts:
//   {"prompt": "...", "chosen": "...", "rejected": "..."}               text (prompt optional)
//   {"prompt": [msgs], "chosen": [msgs] | msg | "...", "rejected": ...}  explicit history
//   {"chosen": [msgs], "rejected": [msgs]}                              shared history = longest
//                                                                       common prefix
//   {"messages": [... , assistant], "rejected_response": "..."}         ms-swift
//   {"conversations": [...], "chosen": {from, value}, "rejected": {...}} LLaMA-Factory ShareGPT
// Throws BadSample when a side is missing or empty, or chosen and rejected are identical.
PreferencePair parse_preference(const nlohmann::json& sample);

}  // namespace spindle
