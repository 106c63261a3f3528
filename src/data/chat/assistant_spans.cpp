#include "data/chat/assistant_spans.h"

#include <algorithm>
#include <string_view>

namespace spindle::chat {
namespace {

// A byte no real content starts or ends with, so the first and last differing bytes of a render
// with this content substituted are exactly where the original content's rendering begins/ends.
constexpr const char* kSentinelContent = "\x01";

size_t common_prefix(const std::string& a, const std::string& b) {
  size_t n = std::min(a.size(), b.size()), i = 0;
  while (i < n && a[i] == b[i]) ++i;
  return i;
}

size_t common_suffix(const std::string& a, const std::string& b, size_t limit) {
  size_t n = std::min({a.size(), b.size(), limit}), i = 0;
  while (i < n && a[a.size() - 1 - i] == b[b.size() - 1 - i]) ++i;
  return i;
}

// The message with the text the model writes replaced by the sentinel: the content (or the text of
// each content part), the reasoning fields and each tool call's argument values, and with
// `tool_names` the tool calls' names as well. The first and last bytes where a rendering with this
// message differs from the original then bound what the model produced in the turn, also for a
// turn that is only tool calls. Names come last because templates may repeat them in later
// messages (gpt-oss heads a tool result with the call's name).
nlohmann::ordered_json with_sentinel_text(const nlohmann::ordered_json& message, bool tool_names) {
  nlohmann::ordered_json m = message;
  if (m.contains("content") && m["content"].is_array()) {
    // Multimodal content: replace the text of every text part, keep the structure.
    for (auto& part : m["content"])
      if (part.is_object() && part.contains("text")) part["text"] = kSentinelContent;
  } else if (!m.contains("content") || m["content"].is_string() || m["content"].is_null()) {
    m["content"] = kSentinelContent;
  }
  for (const char* field : {"thinking", "reasoning_content"})
    if (m.contains(field) && m[field].is_string()) m[field] = kSentinelContent;
  if (m.contains("tool_calls") && m["tool_calls"].is_array()) {
    for (auto& call : m["tool_calls"]) {
      if (!call.is_object()) continue;
      auto& function = call.contains("function") && call["function"].is_object() ? call["function"] : call;
      if (tool_names && function.contains("name") && function["name"].is_string()) function["name"] = kSentinelContent;
      if (function.contains("arguments")) {
        auto& arguments = function["arguments"];
        if (arguments.is_object())
          for (auto& [key, value] : arguments.items()) value = kSentinelContent;
        else if (arguments.is_string())
          arguments = kSentinelContent;
      }
    }
  }
  return m;
}

class SpanDeriver {
 public:
  SpanDeriver(const ChatTemplate& t, const nlohmann::ordered_json& context, const RenderOptions& options)
      : template_(t), context_(context), options_(options), messages_(context["messages"]) {
    if (context_.contains("eos_token") && context_["eos_token"].is_string()) eos_token_ = context_["eos_token"].get<std::string>();
    // Text some templates append after the last message whatever it is (the shipped Llama 3
    // template always ends with the assistant header): it belongs to no turn.
    try {
      nlohmann::ordered_json empty = context_;
      empty["messages"] = nlohmann::ordered_json::array();
      empty["add_generation_prompt"] = false;
      std::string without_prompt = template_.render(empty, options_);
      empty["add_generation_prompt"] = true;
      if (template_.render(empty, options_) == without_prompt) unconditional_trailer_ = without_prompt;
    } catch (const Error&) {
      // Templates that require messages have no such trailer to detect; nothing to strip.
    }
  }

  AssistantSpans run() {
    AssistantSpans result;
    result.method = SpanMethod::ConversationDiff;
    result.text = template_.render(context_, options_);
    const std::string& full = result.text;
    size_t previous_end = 0;
    for (size_t i = 0; i < messages_.size(); ++i) {
      if (!messages_[i].is_object() || messages_[i].value("role", "") != "assistant") continue;
      ByteSpan span = derive(i, full);
      if (span.begin < previous_end)
        fail_at(i, "its span starts at byte {} inside the previous assistant turn (ends at {})", span.begin, previous_end);
      result.spans.push_back(span);
      result.message_indices.push_back(i);
      previous_end = span.end;
    }
    return result;
  }

 private:
  template <typename... Args>
  [[noreturn]] void fail_at(size_t index, fmt::format_string<Args...> format, Args&&... args) {
    fail("cannot derive the supervised span of assistant message {} (0-based) for this chat template: {}. The "
         "template is not prefix-stable for this conversation; use a template with {{% generation %}} blocks "
         "(e.g. TRL's *_training.jinja) for exact masks",
         index, fmt::format(format, std::forward<Args>(args)...));
  }

  std::string render_messages(const nlohmann::ordered_json& messages, bool add_generation_prompt, size_t index) {
    nlohmann::ordered_json ctx = context_;
    ctx["messages"] = messages;
    ctx["add_generation_prompt"] = add_generation_prompt;
    try {
      return template_.render(ctx, options_);
    } catch (const TemplateError& e) {
      fail_at(index, "rendering a partial conversation raised \"{}\"", e.what());
    }
  }

  nlohmann::ordered_json head(size_t count, const nlohmann::ordered_json* replace_last = nullptr) {
    nlohmann::ordered_json out = nlohmann::ordered_json::array();
    for (size_t k = 0; k < count; ++k) out.push_back(replace_last && k + 1 == count ? *replace_last : messages_[k]);
    return out;
  }

  ByteSpan derive(size_t i, const std::string& full) {
    nlohmann::ordered_json sentinel = with_sentinel_text(messages_[i], false);
    nlohmann::ordered_json perturbed_context = context_;
    perturbed_context["messages"][i] = sentinel;
    std::string perturbed = template_.render(perturbed_context, options_);
    if (perturbed == full) {
      sentinel = with_sentinel_text(messages_[i], true);
      perturbed_context["messages"][i] = sentinel;
      perturbed = template_.render(perturbed_context, options_);
    }
    if (perturbed == full) fail_at(i, "nothing it holds (content, reasoning, tool calls) appears in the rendering");
    size_t content_begin = common_prefix(full, perturbed);
    size_t content_end = full.size() - common_suffix(full, perturbed, std::min(full.size(), perturbed.size()) - content_begin);

    // The conversation before this turn must render identically inside the full conversation.
    // Templates that close a conversation without a generation prompt with eos_token (Phi-3.5)
    // have it after `before` only: it is a trailer, not part of the conversation.
    std::string before = render_messages(head(i), false, i);
    std::string prompt = render_messages(head(i), true, i);
    const bool eos_trailer = !eos_token_.empty() && before.ends_with(eos_token_) &&
                             prompt.starts_with(std::string_view(before).substr(0, before.size() - eos_token_.size()));
    if (eos_trailer) before.resize(before.size() - eos_token_.size());
    // Supervision starts where the prompt seen at inference (with the generation prompt) stops
    // matching, or at the content, whichever comes first: a generation prompt that the full
    // rendering lacks (DeepSeek-R1's "<think>\n") is thereby never supervised text.
    size_t begin = 0;
    if (full.compare(0, before.size(), before) == 0)
      begin = std::max(before.size(), std::min(common_prefix(prompt, full), content_begin));
    else
      begin = begin_after_previous_message(i, prompt, full, content_begin);

    // The turn's tail (tool calls, end-of-turn marker) is what follows the content when the
    // conversation ends with this turn; it must follow the content in the full rendering too.
    std::string ending = render_messages(head(i + 1), false, i);
    std::string ending_perturbed = render_messages(head(i + 1, &sentinel), false, i);
    size_t ending_prefix = common_prefix(ending, ending_perturbed);
    size_t tail = common_suffix(ending, ending_perturbed, std::min(ending.size(), ending_perturbed.size()) - ending_prefix);
    size_t tail_begin = ending.size() - tail;
    const std::string& trailer = unconditional_trailer_;
    if (!trailer.empty() && tail >= trailer.size() && ending.compare(ending.size() - trailer.size(), trailer.size(), trailer) == 0)
      tail -= trailer.size();
    if (eos_trailer && tail >= eos_token_.size() && ending.ends_with(eos_token_)) tail -= eos_token_.size();
    if (content_end + tail <= full.size() && full.compare(content_end, tail, ending, tail_begin, tail) == 0)
      return checked_span(i, begin, content_end + tail);
    // A template may end the last turn differently from the turns before it (gpt-oss: <|return|>
    // after the last, <|end|> after the others). The tail of a turn that others follow is what
    // comes after its content when a generation prompt follows it instead of the end.
    const std::string final_tail = ending.substr(tail_begin, tail);
    if (prompt.starts_with(before)) {
      const std::string generation_prompt = prompt.substr(before.size());
      std::string continued = render_messages(head(i + 1), true, i);
      std::string continued_perturbed = render_messages(head(i + 1, &sentinel), true, i);
      const size_t continued_prefix = common_prefix(continued, continued_perturbed);
      const size_t after = common_suffix(continued, continued_perturbed,
                                         std::min(continued.size(), continued_perturbed.size()) - continued_prefix);
      if (continued.ends_with(generation_prompt) && after >= generation_prompt.size()) {
        const size_t middle_tail = after - generation_prompt.size();
        const size_t middle_begin = continued.size() - after;
        if (content_end + middle_tail <= full.size() &&
            full.compare(content_end, middle_tail, continued, middle_begin, middle_tail) == 0)
          return checked_span(i, begin, content_end + middle_tail);
      }
    }
    fail_at(i, "the end of its turn (\"{}\") does not follow its content in the full rendering", final_tail);
  }

  // Templates that place the system prompt or the tools with the last user message (Mistral Nemo,
  // Small 3.x) render the conversation before an earlier turn differently once later messages
  // exist. The prompt is then matched locally: what the inference prompt has after the previous
  // message's content (its end marker, the generation prompt) must follow that content in the
  // full rendering, and supervision starts where it stops matching there.
  size_t begin_after_previous_message(size_t i, const std::string& prompt, const std::string& full, size_t content_begin) {
    if (i == 0) fail_at(i, "the conversation before it renders differently once later messages exist");
    const nlohmann::ordered_json previous = with_sentinel_text(messages_[i - 1], false);
    const std::string prompt_perturbed = render_messages(head(i, &previous), true, i);
    nlohmann::ordered_json perturbed_context = context_;
    perturbed_context["messages"][i - 1] = previous;
    const std::string full_perturbed = template_.render(perturbed_context, options_);
    const size_t prompt_prefix = common_prefix(prompt, prompt_perturbed);
    const size_t full_prefix = common_prefix(full, full_perturbed);
    if (prompt_prefix == prompt.size() || full_prefix == full.size())
      fail_at(i, "the conversation before it renders differently once later messages exist, and the message "
                 "before it does not show in the rendering");
    const size_t prompt_after = prompt.size() - common_suffix(prompt, prompt_perturbed,
                                                              std::min(prompt.size(), prompt_perturbed.size()) - prompt_prefix);
    const size_t full_after = full.size() - common_suffix(full, full_perturbed,
                                                          std::min(full.size(), full_perturbed.size()) - full_prefix);
    const std::string cue = prompt.substr(prompt_after);
    const size_t matched = common_prefix(cue, full.substr(full_after));
    if (full_after > content_begin || (matched < cue.size() && full_after + matched < content_begin))
      fail_at(i, "the conversation before it renders differently once later messages exist, and the prompt after "
                 "the message before it (\"{}\") does not lead to its content",
              cue);
    return std::min(full_after + matched, content_begin);
  }

  ByteSpan checked_span(size_t i, size_t begin, size_t end) {
    if (begin > end) fail_at(i, "its derived start lies after its end");
    return ByteSpan{begin, end};
  }

  const ChatTemplate& template_;
  const nlohmann::ordered_json& context_;
  const RenderOptions& options_;
  const nlohmann::ordered_json& messages_;
  std::string unconditional_trailer_;
  std::string eos_token_;  // the context's eos_token, empty when it names none
};

}  // namespace

AssistantSpans render_with_assistant_spans(const ChatTemplate& chat_template, const nlohmann::ordered_json& context,
                                           const RenderOptions& options) {
  if (!context.is_object() || !context.contains("messages") || !context["messages"].is_array())
    fail("render_with_assistant_spans needs a context with a \"messages\" list");
  if (chat_template.has_generation_blocks()) {
    auto rendered = chat_template.render_with_generation_spans(context, options);
    AssistantSpans result;
    result.text = std::move(rendered.text);
    result.method = SpanMethod::GenerationBlocks;
    for (const ByteSpan& s : rendered.generation_spans)
      if (s.end > s.begin) result.spans.push_back(s);
    return result;
  }
  return SpanDeriver(chat_template, context, options).run();
}

}  // namespace spindle::chat
