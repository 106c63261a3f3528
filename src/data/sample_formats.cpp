#include "data/sample_formats.h"

#include <cmath>

#include "data/jsonl_reader.h"

namespace spindle {

namespace {

using json = nlohmann::json;

bool has(const json& sample, const char* field) {
  auto it = sample.find(field);
  return it != sample.end() && !it->is_null();
}

std::string field_list(const json& sample) {
  std::string names;
  for (auto it = sample.begin(); it != sample.end(); ++it) names += (names.empty() ? "" : ", ") + it.key();
  return names.empty() ? "none" : names;
}

const std::string& string_field(const json& sample, const char* field, bool allow_empty) {
  if (!has(sample, field)) bad_sample("missing field '{}'", field);
  const json& value = sample.at(field);
  if (!value.is_string())
    bad_sample("field '{}' must be a string, found a JSON {}", field, value.type_name());
  if (!allow_empty && value.get_ref<const std::string&>().empty())
    bad_sample("field '{}' is an empty string", field);
  return value.get_ref<const std::string&>();
}

std::string optional_string(const json& sample, const char* field) {
  return has(sample, field) ? string_field(sample, field, true) : std::string();
}

// ShareGPT speaker names and OpenAI roles to OpenAI roles.
std::optional<std::string> normalize_role(std::string_view name) {
  if (name == "user" || name == "human") return "user";
  if (name == "assistant" || name == "gpt" || name == "model") return "assistant";
  if (name == "system") return "system";
  if (name == "tool" || name == "observation" || name == "function_response" || name == "ipython")
    return "tool";
  return std::nullopt;
}

// Content as text: a string, or OpenAI content parts of type "text" joined without separator.
std::string message_text(const json& content, const std::string& where) {
  if (content.is_string()) return content.get<std::string>();
  if (content.is_array()) {
    std::string text;
    for (size_t i = 0; i < content.size(); ++i) {
      const json& part = content[i];
      if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
          !part["text"].is_string())
        bad_sample("{} content[{}] is not a text part ({{\"type\": \"text\", \"text\": ...}}); "
                   "images, audio and other parts are not supported",
                   where, i);
      text += part["text"].get<std::string>();
    }
    return text;
  }
  bad_sample("{} content must be a string or a list of text parts, found a JSON {}", where,
             content.type_name());
}

void parse_message_loss_scale(const json& message, const std::string& where,
                              std::optional<float>& out) {
  if (has(message, "loss_scale")) {
    const json& v = message["loss_scale"];
    if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 0)
      bad_sample("{} loss_scale must be a finite number >= 0, found {}", where, v.dump());
    out = v.get<float>();
  } else if (has(message, "loss")) {
    const json& v = message["loss"];
    if (!v.is_boolean()) bad_sample("{} 'loss' must be true or false, found {}", where, v.dump());
    out = v.get<bool>() ? 1.0f : 0.0f;
  } else if (has(message, "weight")) {
    const json& v = message["weight"];
    if (!v.is_number() || (v.get<double>() != 0 && v.get<double>() != 1))
      bad_sample("{} 'weight' must be 0 or 1, found {}", where, v.dump());
    out = v.get<float>();
  }
}

ChatMessage parse_message(const json& message, const std::string& where) {
  if (!message.is_object())
    bad_sample("{} must be an object with a role and content, found a JSON {}", where,
               message.type_name());
  const bool sharegpt = message.contains("from");
  const char* role_key = sharegpt ? "from" : "role";
  const char* content_key = sharegpt ? "value" : "content";
  if (!has(message, role_key)) bad_sample("{} has no '{}'", where, role_key);
  if (!message[role_key].is_string())
    bad_sample("{} '{}' must be a string, found {}", where, role_key, message[role_key].dump());
  const std::string name = message[role_key].get<std::string>();
  auto role = normalize_role(name);
  if (!role)
    bad_sample("{} has unknown role '{}'; use system, user, assistant or tool (ShareGPT: human, gpt, "
               "system, observation)",
               where, name);

  ChatMessage result;
  result.role = *role;
  if (has(message, "tool_calls")) {
    if (result.role != "assistant") bad_sample("{} has tool_calls but is not an assistant message", where);
    if (!message["tool_calls"].is_array())
      bad_sample("{} tool_calls must be an array, found a JSON {}", where,
                 message["tool_calls"].type_name());
    result.tool_calls = message["tool_calls"];
  }
  if (has(message, content_key)) {
    result.content = message_text(message[content_key], where);
  } else if (result.tool_calls.is_null()) {
    bad_sample("{} has no '{}'", where, content_key);
  }
  if (has(message, "tool_call_id")) {
    if (!message["tool_call_id"].is_string()) bad_sample("{} tool_call_id must be a string", where);
    result.tool_call_id = message["tool_call_id"].get<std::string>();
  }
  parse_message_loss_scale(message, where, result.loss_scale);
  return result;
}

std::vector<ChatMessage> parse_message_list(const json& list, const char* field) {
  if (!list.is_array())
    bad_sample("field '{}' must be a list of messages, found a JSON {}", field, list.type_name());
  if (list.empty()) bad_sample("field '{}' is an empty conversation", field);
  std::vector<ChatMessage> messages;
  messages.reserve(list.size());
  for (size_t i = 0; i < list.size(); ++i)
    messages.push_back(parse_message(list[i], fmt::format("{}[{}]", field, i)));
  return messages;
}

json parse_tools(const json& sample) {
  if (!has(sample, "tools")) return nullptr;
  json tools = sample["tools"];
  // ShareGPT datasets often store the tool list as a JSON string.
  if (tools.is_string()) {
    try {
      tools = json::parse(tools.get<std::string>());
    } catch (const json::parse_error&) {
      bad_sample("field 'tools' is a string that does not hold a JSON list of tools");
    }
  }
  if (!tools.is_array()) bad_sample("field 'tools' must be a list of tool schemas, found a JSON {}", tools.type_name());
  return tools;
}

void prepend_system(Conversation& conversation, const json& sample) {
  std::string system = optional_string(sample, "system");
  if (system.empty()) return;
  if (!conversation.messages.empty() && conversation.messages.front().role == "system")
    bad_sample("both a top-level 'system' field and a system message; keep one");
  conversation.messages.insert(conversation.messages.begin(), ChatMessage{"system", system, nullptr, "", std::nullopt});
}

// A preference side: a list of messages, one message object, or a string (one assistant message).
std::vector<ChatMessage> parse_side(const json& value, const char* field) {
  if (value.is_string()) {
    if (value.get_ref<const std::string&>().empty()) bad_sample("field '{}' is an empty string", field);
    return {ChatMessage{"assistant", value.get<std::string>(), nullptr, "", std::nullopt}};
  }
  if (value.is_object()) return {parse_message(value, field)};
  return parse_message_list(value, field);
}

bool same_message(const ChatMessage& a, const ChatMessage& b) {
  return a.role == b.role && a.content == b.content && a.tool_calls == b.tool_calls &&
         a.tool_call_id == b.tool_call_id;
}

}  // namespace

SampleFormat parse_sample_format(std::string_view name) {
  for (auto format : {SampleFormat::kAuto, SampleFormat::kPretokenized, SampleFormat::kText,
                      SampleFormat::kPromptCompletion, SampleFormat::kAlpaca, SampleFormat::kMessages,
                      SampleFormat::kPreference})
    if (sample_format_name(format) == name) return format;
  fail("unknown --format '{}'; use auto, pretokenized, text, prompt-completion, alpaca, "
       "messages or preference",
       name);
}

std::string_view sample_format_name(SampleFormat format) {
  switch (format) {
    case SampleFormat::kAuto: return "auto";
    case SampleFormat::kPretokenized: return "pretokenized";
    case SampleFormat::kText: return "text";
    case SampleFormat::kPromptCompletion: return "prompt-completion";
    case SampleFormat::kAlpaca: return "alpaca";
    case SampleFormat::kMessages: return "messages";
    case SampleFormat::kPreference: return "preference";
  }
  return "?";
}

SampleFormat detect_sample_format(const nlohmann::json& sample) {
  if (!sample.is_object()) bad_sample("expected a JSON object, found a JSON {}", sample.type_name());
  if (has(sample, "chosen") || has(sample, "rejected") || has(sample, "rejected_response")) {
    if (has(sample, "input_ids"))
      bad_sample("pre-tokenized preference pairs are not supported; give 'chosen'/'rejected' as text "
                 "or messages");
    return SampleFormat::kPreference;
  }
  std::vector<std::pair<SampleFormat, const char*>> found;
  if (has(sample, "input_ids")) found.emplace_back(SampleFormat::kPretokenized, "input_ids");
  if (has(sample, "messages")) found.emplace_back(SampleFormat::kMessages, "messages");
  if (has(sample, "conversations")) found.emplace_back(SampleFormat::kMessages, "conversations");
  if (has(sample, "instruction")) found.emplace_back(SampleFormat::kAlpaca, "instruction");
  if (has(sample, "prompt")) found.emplace_back(SampleFormat::kPromptCompletion, "prompt");
  if (has(sample, "text")) found.emplace_back(SampleFormat::kText, "text");
  if (found.size() == 1) return found[0].first;
  if (found.empty())
    bad_sample("cannot tell the dataset format from the fields ({}); expected one of input_ids, "
               "messages, conversations, instruction/output, prompt/completion, text, chosen/rejected",
               field_list(sample));
  bad_sample("fields '{}' and '{}' select different formats; remove one, or choose with --format", found[0].second,
             found[1].second);
}

const std::vector<std::string>& sample_fields() {
  static const std::vector<std::string> fields = {
      "input_ids", "labels", "loss_mask", "loss_scale", "attention_mask",  // pre-tokenized
      "text", "prompt", "completion", "response",                           // text, prompt/completion
      "instruction", "input", "output", "system", "history",                // Alpaca (+ system of any)
      "messages", "conversations", "tools",                                 // conversations
      "chosen", "rejected", "rejected_response"};                           // preference pairs
  return fields;
}

const std::vector<std::string>& format_selecting_fields() {
  static const std::vector<std::string> fields = {"input_ids", "messages", "conversations", "instruction", "prompt",
                                                  "text", "chosen", "rejected", "rejected_response"};
  return fields;
}

nlohmann::json Conversation::messages_json() const {
  json list = json::array();
  for (const auto& m : messages) {
    json message = {{"role", m.role}, {"content", m.content}};
    if (!m.tool_calls.is_null()) message["tool_calls"] = m.tool_calls;
    if (!m.tool_call_id.empty()) message["tool_call_id"] = m.tool_call_id;
    list.push_back(std::move(message));
  }
  return list;
}

Conversation parse_conversation(const nlohmann::json& sample) {
  const bool has_messages = has(sample, "messages");
  const bool has_conversations = has(sample, "conversations");
  if (has_messages && has_conversations) bad_sample("both 'messages' and 'conversations'; keep one");
  if (!has_messages && !has_conversations) bad_sample("missing field 'messages' (or ShareGPT 'conversations')");
  const char* field = has_messages ? "messages" : "conversations";
  Conversation conversation;
  conversation.messages = parse_message_list(sample[field], field);
  conversation.tools = parse_tools(sample);
  prepend_system(conversation, sample);
  bool any_turn = false;
  for (const auto& m : conversation.messages) any_turn |= m.role != "system";
  if (!any_turn) bad_sample("field '{}' holds only system messages", field);
  return conversation;
}

Conversation parse_alpaca(const nlohmann::json& sample) {
  const std::string& instruction = string_field(sample, "instruction", false);
  const std::string input = optional_string(sample, "input");
  const std::string& output = string_field(sample, "output", false);
  Conversation conversation;
  if (has(sample, "history")) {
    const json& history = sample["history"];
    if (!history.is_array()) bad_sample("field 'history' must be a list of [instruction, response] pairs");
    for (size_t i = 0; i < history.size(); ++i) {
      const json& turn = history[i];
      if (!turn.is_array() || turn.size() != 2 || !turn[0].is_string() || !turn[1].is_string())
        bad_sample("history[{}] must be a pair of strings [instruction, response]", i);
      conversation.messages.push_back({"user", turn[0].get<std::string>(), nullptr, "", std::nullopt});
      conversation.messages.push_back({"assistant", turn[1].get<std::string>(), nullptr, "", std::nullopt});
    }
  }
  conversation.messages.push_back(
      {"user", input.empty() ? instruction : instruction + "\n" + input, nullptr, "", std::nullopt});
  conversation.messages.push_back({"assistant", output, nullptr, "", std::nullopt});
  prepend_system(conversation, sample);
  return conversation;
}

PromptCompletion parse_prompt_completion(const nlohmann::json& sample) {
  const bool has_completion = has(sample, "completion");
  const bool has_response = has(sample, "response");
  if (has_completion && has_response) bad_sample("both 'completion' and 'response'; keep one");
  if (!has_completion && !has_response) bad_sample("field 'prompt' needs a 'completion' (or 'response')");
  if (has(sample, "prompt") && sample["prompt"].is_array())
    bad_sample("a conversational 'prompt' (a list of messages) needs the chat template: use 'messages'");
  return PromptCompletion{string_field(sample, "prompt", true),
                          string_field(sample, has_completion ? "completion" : "response", false)};
}

std::string parse_text(const nlohmann::json& sample) { return string_field(sample, "text", false); }

PreferencePair parse_preference(const nlohmann::json& sample) {
  PreferencePair pair;
  if (has(sample, "rejected_response")) {  // ms-swift: messages end with the chosen answer
    Conversation conversation = parse_conversation(sample);
    if (conversation.messages.back().role != "assistant")
      bad_sample("with 'rejected_response', the last message must be the chosen assistant answer");
    pair.conversational = true;
    pair.chosen = {conversation.messages.back()};
    conversation.messages.pop_back();
    pair.prompt = std::move(conversation);
    pair.rejected = parse_side(sample["rejected_response"], "rejected_response");
  } else {
    if (!has(sample, "chosen")) bad_sample("missing field 'chosen' of a preference pair");
    if (!has(sample, "rejected")) bad_sample("missing field 'rejected' of a preference pair");
    const json& chosen = sample["chosen"];
    const json& rejected = sample["rejected"];
    const bool history = has(sample, "messages") || has(sample, "conversations");
    const bool prompt_messages = has(sample, "prompt") && sample["prompt"].is_array();
    if (!history && !prompt_messages && chosen.is_string() && rejected.is_string()) {
      pair.prompt_text = optional_string(sample, "prompt");
      pair.chosen_text = string_field(sample, "chosen", false);
      pair.rejected_text = string_field(sample, "rejected", false);
      if (pair.chosen_text == pair.rejected_text) bad_sample("'chosen' and 'rejected' are identical");
      return pair;
    }
    pair.conversational = true;
    if (history) {
      pair.prompt = parse_conversation(sample);
    } else if (prompt_messages) {
      pair.prompt.messages = parse_message_list(sample["prompt"], "prompt");
      pair.prompt.tools = parse_tools(sample);
    } else if (has(sample, "prompt")) {
      pair.prompt.messages = {ChatMessage{"user", string_field(sample, "prompt", false), nullptr, "", std::nullopt}};
    }
    pair.chosen = parse_side(chosen, "chosen");
    pair.rejected = parse_side(rejected, "rejected");
    if (!history && !has(sample, "prompt")) {
      // Implicit prompt: the history both sides share.
      size_t shared = 0;
      while (shared < pair.chosen.size() && shared < pair.rejected.size() &&
             same_message(pair.chosen[shared], pair.rejected[shared]))
        ++shared;
      pair.prompt.messages.assign(pair.chosen.begin(), pair.chosen.begin() + shared);
      pair.prompt.tools = parse_tools(sample);
      pair.chosen.erase(pair.chosen.begin(), pair.chosen.begin() + shared);
      pair.rejected.erase(pair.rejected.begin(), pair.rejected.begin() + shared);
    }
  }
  if (pair.chosen.empty() && pair.rejected.empty()) bad_sample("'chosen' and 'rejected' are identical");
  if (pair.chosen.empty()) bad_sample("'chosen' adds nothing to the shared history");
  if (pair.rejected.empty()) bad_sample("'rejected' adds nothing to the shared history");
  if (pair.chosen.size() == pair.rejected.size()) {
    bool identical = true;
    for (size_t i = 0; i < pair.chosen.size(); ++i) identical &= same_message(pair.chosen[i], pair.rejected[i]);
    if (identical) bad_sample("'chosen' and 'rejected' are identical");
  }
  return pair;
}

}  // namespace spindle
