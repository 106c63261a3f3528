#include "data/chat/assistant_spans.h"

#include <algorithm>

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

nlohmann::ordered_json with_sentinel_content(const nlohmann::ordered_json& message) {
  nlohmann::ordered_json m = message;
  if (m.contains("content") && m["content"].is_array()) {
    // Multimodal content: replace the text of every text part, keep the structure.
    for (auto& part : m["content"])
      if (part.is_object() && part.contains("text")) part["text"] = kSentinelContent;
  } else {
    m["content"] = kSentinelContent;
  }
  return m;
}

class SpanDeriver {
 public:
  SpanDeriver(const ChatTemplate& t, const nlohmann::ordered_json& context, const RenderOptions& options)
      : template_(t), context_(context), options_(options), messages_(context["messages"]) {
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
    nlohmann::ordered_json sentinel = with_sentinel_content(messages_[i]);
    nlohmann::ordered_json perturbed_messages = messages_;
    perturbed_messages[i] = sentinel;
    nlohmann::ordered_json perturbed_context = context_;
    perturbed_context["messages"] = perturbed_messages;
    std::string perturbed = template_.render(perturbed_context, options_);
    if (perturbed == full) fail_at(i, "its content does not appear in the rendering");
    size_t content_begin = common_prefix(full, perturbed);
    size_t content_end = full.size() - common_suffix(full, perturbed, std::min(full.size(), perturbed.size()) - content_begin);

    // The conversation before this turn must render identically inside the full conversation.
    std::string before = render_messages(head(i), false, i);
    if (full.compare(0, before.size(), before) != 0)
      fail_at(i, "the conversation before it renders differently once later messages exist");
    // Supervision starts where the prompt seen at inference (with the generation prompt) stops
    // matching, or at the content, whichever comes first: a generation prompt that the full
    // rendering lacks (DeepSeek-R1's "<think>\n") is thereby never supervised text.
    std::string prompt = render_messages(head(i), true, i);
    size_t begin = std::max(before.size(), std::min(common_prefix(prompt, full), content_begin));

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
    if (content_end + tail > full.size() || full.compare(content_end, tail, ending, tail_begin, tail) != 0)
      fail_at(i, "the end of its turn (\"{}\") does not follow its content in the full rendering",
              ending.substr(tail_begin, tail));
    ByteSpan span{begin, content_end + tail};
    if (span.begin > span.end) fail_at(i, "its derived start lies after its end");
    return span;
  }

  const ChatTemplate& template_;
  const nlohmann::ordered_json& context_;
  const RenderOptions& options_;
  const nlohmann::ordered_json& messages_;
  std::string unconditional_trailer_;
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
