#include "data/chat_encoding.h"

#include <algorithm>

#include "data/chat/assistant_spans.h"
#include "data/jsonl_reader.h"

namespace spindle {

namespace {

using ordered_json = nlohmann::ordered_json;

bool present(const ordered_json& object, const char* key) {
  auto it = object.find(key);
  return it != object.end() && !it->is_null();
}

}  // namespace

std::vector<int32_t> tokens_in_spans(const std::vector<chat::ByteSpan>& token_offsets,
                                     const std::vector<chat::ByteSpan>& spans) {
  std::vector<int32_t> result(token_offsets.size(), -1);
  for (size_t k = 0; k < token_offsets.size(); ++k) {
    const chat::ByteSpan& token = token_offsets[k];
    const bool empty = token.end <= token.begin;
    // The first span that ends after the token starts (for an empty token: at or after its
    // position); spans are ascending, so it is the only candidate.
    auto it = std::partition_point(spans.begin(), spans.end(), [&](const chat::ByteSpan& span) {
      return empty ? span.end < token.begin : span.end <= token.begin;
    });
    if (it == spans.end()) continue;
    const bool inside = empty ? it->begin < token.begin : it->begin < token.end;
    if (inside) result[k] = static_cast<int32_t>(it - spans.begin());
  }
  return result;
}

ChatEncoding encode_chat(const chat::ChatTemplate& chat_template, const ordered_json& context,
                         const OffsetTokenizer& tokenize, const chat::RenderOptions& options) {
  chat::AssistantSpans rendered = chat::render_with_assistant_spans(chat_template, context, options);
  ChatEncoding encoding;
  encoding.text = std::move(rendered.text);
  std::vector<chat::ByteSpan> offsets;
  tokenize(encoding.text, encoding.ids, offsets);
  SPINDLE_CHECK(offsets.size() == encoding.ids.size(), "the tokenizer gave {} offsets for {} ids", offsets.size(),
                encoding.ids.size());

  // Which assistant message each span supervises. Derived spans name it; {% generation %} blocks
  // are tied to the assistant messages in order when there is one block per assistant message.
  std::vector<int32_t> message_of_span(rendered.spans.size(), kUnattributedTurn);
  if (rendered.method == chat::SpanMethod::ConversationDiff) {
    for (size_t s = 0; s < rendered.spans.size(); ++s)
      message_of_span[s] = static_cast<int32_t>(rendered.message_indices[s]);
  } else {
    std::vector<int32_t> assistant_messages;
    const ordered_json& messages = context["messages"];
    for (size_t i = 0; i < messages.size(); ++i)
      if (messages[i].is_object() && messages[i].value("role", "") == "assistant")
        assistant_messages.push_back(static_cast<int32_t>(i));
    if (assistant_messages.size() == rendered.spans.size()) message_of_span = assistant_messages;
  }

  const std::vector<int32_t> span_of_token = tokens_in_spans(offsets, rendered.spans);
  encoding.turn_of_token.resize(span_of_token.size());
  for (size_t k = 0; k < span_of_token.size(); ++k)
    encoding.turn_of_token[k] = span_of_token[k] < 0 ? kPromptToken : message_of_span[span_of_token[k]];
  return encoding;
}

ordered_json chat_template_variables(const ordered_json& sample, SampleFormat format, const Conversation& conversation) {
  ordered_json variables = ordered_json::object();
  ordered_json messages = ordered_json::array();
  const char* list_field = present(sample, "messages") ? "messages" : "conversations";
  if (format == SampleFormat::kMessages && present(sample, list_field) && sample[list_field].is_array()) {
    const ordered_json& list = sample[list_field];
    // parse_conversation may have prepended a top-level "system" field as the first message.
    const size_t prepended = conversation.messages.size() - list.size();
    for (size_t i = 0; i < prepended; ++i)
      messages.push_back({{"role", conversation.messages[i].role}, {"content", conversation.messages[i].content}});
    for (size_t i = 0; i < list.size(); ++i) {
      const ordered_json& original = list[i];
      const std::string& role = conversation.messages[prepended + i].role;
      if (original.contains("from")) {
        // ShareGPT: the template expects role/content; other fields keep their place after them.
        ordered_json message = {{"role", role}, {"content", original.contains("value") ? original["value"] : ordered_json()}};
        for (const auto& [key, value] : original.items())
          if (key != "from" && key != "value") message[key] = value;
        messages.push_back(std::move(message));
      } else {
        // OpenAI messages go to the template as they are (as TRL passes them), role normalised.
        ordered_json message = original;
        message["role"] = role;
        messages.push_back(std::move(message));
      }
    }
  } else {
    for (const ChatMessage& m : conversation.messages) {
      ordered_json message = {{"role", m.role}, {"content", m.content}};
      if (!m.tool_calls.is_null()) message["tool_calls"] = m.tool_calls;
      if (!m.tool_call_id.empty()) message["tool_call_id"] = m.tool_call_id;
      messages.push_back(std::move(message));
    }
  }
  variables["messages"] = std::move(messages);

  if (present(sample, "tools")) {
    // From the sample itself rather than the parsed copy: key order is what tojson prints.
    const ordered_json& tools = sample["tools"];
    if (!tools.is_string()) {
      variables["tools"] = tools;
    } else {
      try {
        variables["tools"] = ordered_json::parse(tools.get<std::string>());
      } catch (const nlohmann::json::exception&) {
        bad_sample("field 'tools' is a string that does not hold a JSON list of tools");
      }
    }
  }
  if (present(sample, "chat_template_kwargs")) {
    const ordered_json& kwargs = sample["chat_template_kwargs"];
    if (!kwargs.is_object())
      bad_sample("'chat_template_kwargs' must be an object of template variables (e.g. {{\"enable_thinking\": false}}), "
                 "found a JSON {}",
                 kwargs.type_name());
    for (const auto& [key, value] : kwargs.items()) {
      // apply_chat_template's own arguments: passing them twice is a TypeError in Python too.
      if (key == "messages" || key == "tools" || key == "documents" || key == "add_generation_prompt")
        bad_sample("'chat_template_kwargs' sets '{}', which the sample itself determines", key);
      variables[key] = value;
    }
  }
  return variables;
}

ModelChatTemplates::ModelChatTemplates(const std::filesystem::path& model_dir) {
  try {
    without_tools_ = chat::load_model_chat_template(model_dir, std::nullopt, false);
    with_tools_ = chat::load_model_chat_template(model_dir, std::nullopt, true);
  } catch (const Error& e) {
    without_tools_.reset();
    with_tools_.reset();
    unavailable_reason_ = e.what();
  }
}

const chat::ModelChatTemplate& ModelChatTemplates::for_sample(bool with_tools) const {
  if (!without_tools_)
    fail("conversations are rendered with the model's chat template, and there is none to use: {}",
         unavailable_reason_);
  return with_tools ? *with_tools_ : *without_tools_;
}

}  // namespace spindle
