// Supervision spans on the three shipped templates (Qwen3 with <think> history stripping,
// Qwen2.5 with tool calls, Llama 3), checked as exact supervised substrings, and generation
// blocks checked against transformers' own assistant indices.
#include <gtest/gtest.h>

#include "chat_test_support.h"
#include "data/chat/assistant_spans.h"
#include "data/chat/model_folder.h"

namespace spindle::chat {
namespace {

using nlohmann::ordered_json;

std::vector<std::string> supervised(const AssistantSpans& spans) {
  std::vector<std::string> out;
  for (const ByteSpan& s : spans.spans) out.push_back(spans.text.substr(s.begin, s.end - s.begin));
  return out;
}

struct Shipped {
  ModelChatTemplate model;
  bool available = false;
  std::string missing;  // why not available, and how to supply it
};

Shipped shipped(const std::string& name) {
  Shipped s;
  const std::filesystem::path config = std::filesystem::path(name) / "tokenizer_config.json";
  const auto path = testing::reference_path(testing::kTokenizerFolders, config);
  if (path.empty()) {
    s.missing = testing::missing_reference(testing::kTokenizerFolders, config);
    return s;
  }
  s.model = load_model_chat_template(path.parent_path());
  s.available = true;
  return s;
}

ordered_json context_for(const Shipped& s, const char* messages, ordered_json extra = ordered_json::object()) {
  ordered_json sample = extra;
  sample["messages"] = ordered_json::parse(messages);
  return transformers_context(sample, s.model.special_tokens);
}

TEST(AssistantSpans, Qwen3SupervisesThinkingOnlyWhereTheRenderingKeepsIt) {
  auto qwen3 = shipped("qwen3");
  if (!qwen3.available) SPINDLE_SKIP_WITHOUT_REFERENCE(qwen3.missing);
  auto context = context_for(qwen3, R"([
    {"role": "user", "content": "Is 17 prime?"},
    {"role": "assistant", "content": "<think>\nCheck 2, 3.\n</think>\n\nYes."},
    {"role": "user", "content": "And 21?"},
    {"role": "assistant", "content": "<think>\n21 = 3 * 7.\n</think>\n\nNo."}])");
  auto spans = render_with_assistant_spans(qwen3.model.chat_template, context);
  EXPECT_EQ(spans.method, SpanMethod::ConversationDiff);
  EXPECT_EQ(spans.text, qwen3.model.chat_template.render(context));
  // The first turn's reasoning is dropped from the rendering once a later user turn exists, so
  // only its answer is supervised; the last turn keeps its <think> block.
  EXPECT_EQ(supervised(spans), (std::vector<std::string>{"Yes.<|im_end|>\n",
                                                         "<think>\n21 = 3 * 7.\n</think>\n\nNo.<|im_end|>\n"}));
  EXPECT_EQ(spans.message_indices, (std::vector<size_t>{1, 3}));
  EXPECT_EQ(spans.text.substr(0, spans.spans[0].begin), "<|im_start|>user\nIs 17 prime?<|im_end|>\n<|im_start|>assistant\n");
}

TEST(AssistantSpans, Qwen3ToolChainKeepsReasoningOfTheActiveTurn) {
  auto qwen3 = shipped("qwen3");
  if (!qwen3.available) SPINDLE_SKIP_WITHOUT_REFERENCE(qwen3.missing);
  auto context = context_for(qwen3, R"([
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "reasoning_content": "Need the tool.",
     "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "22C"},
    {"role": "assistant", "content": "It is 22C."}])");
  auto spans = render_with_assistant_spans(qwen3.model.chat_template, context);
  EXPECT_EQ(supervised(spans),
            (std::vector<std::string>{"<think>\nNeed the tool.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
                                      "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call><|im_end|>\n",
                                      "<think>\n\n</think>\n\nIt is 22C.<|im_end|>\n"}));
}

TEST(AssistantSpans, Qwen3WithThinkingDisabledLeavesTheEmptyThinkBlockInThePrompt) {
  auto qwen3 = shipped("qwen3");
  if (!qwen3.available) SPINDLE_SKIP_WITHOUT_REFERENCE(qwen3.missing);
  auto context = context_for(qwen3, R"([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}])",
                             {{"enable_thinking", false}});
  auto spans = render_with_assistant_spans(qwen3.model.chat_template, context);
  EXPECT_EQ(supervised(spans), (std::vector<std::string>{"Hello!<|im_end|>\n"}));
  EXPECT_NE(spans.text.find("<think>\n\n</think>\n\nHello!"), std::string::npos);
}

TEST(AssistantSpans, Qwen25ToolCallsAndDefaultSystemPrompt) {
  auto qwen25 = shipped("qwen2_5");
  if (!qwen25.available) SPINDLE_SKIP_WITHOUT_REFERENCE(qwen25.missing);
  auto context = context_for(qwen25, R"([
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
      "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
    {"role": "tool", "content": "22C"},
    {"role": "assistant", "content": "It is 22C."},
    {"role": "user", "content": "Thanks"}])");
  auto spans = render_with_assistant_spans(qwen25.model.chat_template, context);
  EXPECT_EQ(supervised(spans),
            (std::vector<std::string>{"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n"
                                      "</tool_call><|im_end|>\n",
                                      "It is 22C.<|im_end|>\n"}));
  EXPECT_EQ(spans.text.rfind("<|im_start|>user\nThanks<|im_end|>\n"), spans.spans[1].end);
}

TEST(AssistantSpans, Llama3SupervisesContentAndEotOnly) {
  auto llama3 = shipped("llama3");
  if (!llama3.available) SPINDLE_SKIP_WITHOUT_REFERENCE(llama3.missing);
  auto context = context_for(llama3, R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "  Hello!  "},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Goodbye."}])");
  auto spans = render_with_assistant_spans(llama3.model.chat_template, context);
  EXPECT_EQ(supervised(spans), (std::vector<std::string>{"Hello!<|eot_id|>", "Goodbye.<|eot_id|>"}));
  const std::string header = "<|start_header_id|>assistant<|end_header_id|>\n\n";
  EXPECT_EQ(spans.text.substr(spans.spans[0].begin - header.size(), header.size()), header);
}

TEST(AssistantSpans, GenerationBlocksMatchTransformersIndices) {
  // Phi-4-reasoning style: the header outside the block, content and end marker inside.
  auto t = ChatTemplate::parse(
      "{% for message in messages %}{% if message['role'] == 'assistant' %}{{'<|im_start|>assistant<|im_sep|>'}}"
      "{% generation %}{{message['content'] + '<|im_end|>'}}{% endgeneration %}{% else %}"
      "{{'<|im_start|>' + message['role'] + '<|im_sep|>' + message['content'] + '<|im_end|>'}}{% endif %}{% endfor %}");
  ordered_json context = {{"messages", ordered_json::parse(R"([{"role": "user", "content": "Grüße"},
      {"role": "assistant", "content": "Hallo 😀"}, {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}])")}};
  auto spans = render_with_assistant_spans(t, context);
  EXPECT_EQ(spans.method, SpanMethod::GenerationBlocks);
  EXPECT_EQ(supervised(spans), (std::vector<std::string>{"Hallo 😀<|im_end|>", "y<|im_end|>"}));
}

TEST(AssistantSpans, NonPrefixStableTemplateIsAnExplicitError) {
  // EOS only after the final turn (the Olmo-3 pattern): earlier turns end differently in the
  // full rendering than when the conversation stops there.
  auto t = ChatTemplate::parse(
      "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% if loop.last %}</s>{% else %}\n{% endif %}{% endfor %}");
  ordered_json context = {{"messages", ordered_json::parse(R"([{"role": "user", "content": "a"},
      {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d"}])")}};
  try {
    render_with_assistant_spans(t, context);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("assistant message 1"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("generation"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace spindle::chat
