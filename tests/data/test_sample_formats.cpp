#include <gtest/gtest.h>

#include "data/jsonl_reader.h"
#include "data/sample_formats.h"
#include "data_test_util.h"

using namespace spindle;
using json = nlohmann::json;

namespace {
ChatMessage msg(std::string role, std::string content, std::optional<float> scale = std::nullopt) {
  return ChatMessage{std::move(role), std::move(content), nullptr, "", scale};
}
}  // namespace

TEST(SampleFormats, DetectedFromFields) {
  EXPECT_EQ(detect_sample_format(json::parse(R"({"input_ids": [1], "id": 3})")), SampleFormat::kPretokenized);
  EXPECT_EQ(detect_sample_format(json::parse(R"({"text": "a"})")), SampleFormat::kText);
  EXPECT_EQ(detect_sample_format(json::parse(R"({"prompt": "a", "completion": "b"})")),
            SampleFormat::kPromptCompletion);
  EXPECT_EQ(detect_sample_format(json::parse(R"({"instruction": "a", "input": "", "output": "b"})")),
            SampleFormat::kAlpaca);
  EXPECT_EQ(detect_sample_format(json::parse(R"({"messages": []})")), SampleFormat::kMessages);
  EXPECT_EQ(detect_sample_format(json::parse(R"({"conversations": []})")), SampleFormat::kMessages);
  EXPECT_EQ(detect_sample_format(json::parse(R"({"prompt": "a", "chosen": "b", "rejected": "c"})")),
            SampleFormat::kPreference);
  EXPECT_EQ(detect_sample_format(json::parse(R"({"messages": [], "rejected_response": "c"})")),
            SampleFormat::kPreference);
  EXPECT_EQ(detect_sample_format(json::parse(R"({"text": null, "prompt": "a"})")),
            SampleFormat::kPromptCompletion);
  EXPECT_THROW_WITH(detect_sample_format(json::parse(R"({"body": "a", "title": "b"})")), BadSample,
                    "cannot tell the dataset format", "body, title");
  EXPECT_THROW_WITH(detect_sample_format(json::parse(R"({"messages": [], "text": "a"})")), BadSample,
                    "'messages' and 'text' select different formats", "--format");
  EXPECT_EQ(parse_sample_format("prompt-completion"), SampleFormat::kPromptCompletion);
  EXPECT_THROW_WITH(parse_sample_format("sharegpt"), Error, "unknown --format 'sharegpt'");
}

TEST(SampleFormats, OpenAiMessagesWithPerMessageLossScale) {
  Conversation c = parse_conversation(json::parse(R"({"messages": [
      {"role": "system", "content": "be brief"},
      {"role": "user", "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}]},
      {"role": "assistant", "content": "a", "loss_scale": 0.5},
      {"role": "user", "content": "b", "loss": true},
      {"role": "assistant", "content": "c", "loss": false}]})"));
  EXPECT_EQ(c.messages, (std::vector<ChatMessage>{msg("system", "be brief"), msg("user", "hi there"),
                                                  msg("assistant", "a", 0.5f), msg("user", "b", 1.0f),
                                                  msg("assistant", "c", 0.0f)}));
  EXPECT_EQ(c.messages[0].effective_loss_scale(), 0.0f);
  EXPECT_EQ(c.messages[1].effective_loss_scale(), 0.0f);
  EXPECT_EQ(c.messages[2].effective_loss_scale(), 0.5f);
  EXPECT_EQ(c.messages[3].effective_loss_scale(), 1.0f);
  EXPECT_EQ(msg("assistant", "x").effective_loss_scale(), 1.0f);
  EXPECT_TRUE(c.tools.is_null());
  EXPECT_EQ(c.messages_json()[1], json::parse(R"({"role": "user", "content": "hi there"})"));
}

TEST(SampleFormats, ShareGptNormalizesToOpenAiRoles) {
  Conversation c = parse_conversation(json::parse(R"({"system": "sys",
      "tools": "[{\"name\": \"f\"}]",
      "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "weight": 0},
                        {"from": "observation", "value": "o"}, {"from": "gpt", "value": "b"}]})"));
  EXPECT_EQ(c.messages, (std::vector<ChatMessage>{msg("system", "sys"), msg("user", "q"),
                                                  msg("assistant", "a", 0.0f), msg("tool", "o"),
                                                  msg("assistant", "b")}));
  EXPECT_EQ(c.tools, json::parse(R"([{"name": "f"}])"));
}

TEST(SampleFormats, ToolCallsPassThrough) {
  Conversation c = parse_conversation(json::parse(R"({"messages": [
      {"role": "user", "content": "weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "w"}}]},
      {"role": "tool", "content": "sunny", "tool_call_id": "c1"}]})"));
  EXPECT_EQ(c.messages[1].tool_calls.size(), 1u);
  EXPECT_EQ(c.messages[2].tool_call_id, "c1");
  EXPECT_EQ(c.messages_json()[1]["tool_calls"][0]["function"]["name"], "w");
}

TEST(SampleFormats, BadConversationsNameTheMessage) {
  struct Case {
    const char* sample;
    const char* message;
  };
  const Case cases[] = {
      {R"({"messages": []})", "'messages' is an empty conversation"},
      {R"({"conversations": {}})", "'conversations' must be a list of messages"},
      {R"({"messages": [{"role": "user"}]})", "messages[0] has no 'content'"},
      {R"({"messages": [{"content": "x"}]})", "messages[0] has no 'role'"},
      {R"({"messages": [{"role": "narrator", "content": "x"}]})", "messages[0] has unknown role 'narrator'"},
      {R"({"conversations": [{"from": "human", "value": 3}]})", "conversations[0] content must be a string"},
      {R"({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]})", "content[0] is not a text part"},
      {R"({"messages": [{"role": "assistant", "content": "a", "loss_scale": -1}]})", "loss_scale must be a finite number >= 0"},
      {R"({"messages": [{"role": "assistant", "content": "a", "loss": 1}]})", "'loss' must be true or false"},
      {R"({"messages": [{"role": "system", "content": "a"}]})", "only system messages"},
      {R"({"messages": [{"role": "user", "content": "a"}], "tools": "nope"})", "'tools' is a string that does not hold"},
      {R"({"system": "s", "messages": [{"role": "system", "content": "a"}, {"role": "user", "content": "b"}]})", "keep one"},
      {R"({"messages": "hello"})", "must be a list of messages"},
  };
  for (const auto& c : cases) EXPECT_THROW_WITH(parse_conversation(json::parse(c.sample)), BadSample, c.message);
}

TEST(SampleFormats, AlpacaBecomesAConversation) {
  Conversation c = parse_alpaca(json::parse(
      R"({"instruction": "Translate", "input": "chat", "output": "cat", "system": "s",
          "history": [["q1", "a1"]]})"));
  EXPECT_EQ(c.messages, (std::vector<ChatMessage>{msg("system", "s"), msg("user", "q1"), msg("assistant", "a1"),
                                                  msg("user", "Translate\nchat"), msg("assistant", "cat")}));
  c = parse_alpaca(json::parse(R"({"instruction": "Say hi", "input": "", "output": "hi"})"));
  EXPECT_EQ(c.messages, (std::vector<ChatMessage>{msg("user", "Say hi"), msg("assistant", "hi")}));
  EXPECT_THROW_WITH(parse_alpaca(json::parse(R"({"instruction": "x"})")), BadSample, "missing field 'output'");
  EXPECT_THROW_WITH(parse_alpaca(json::parse(R"({"instruction": "x", "output": ""})")), BadSample,
                    "'output' is an empty string");
  EXPECT_THROW_WITH(parse_alpaca(json::parse(R"({"instruction": "x", "output": "y", "history": [["a"]]})")),
                    BadSample, "history[0] must be a pair");
}

TEST(SampleFormats, PromptCompletionAndText) {
  auto pc = parse_prompt_completion(json::parse(R"({"prompt": "Q: ", "response": "A"})"));
  EXPECT_EQ(pc.prompt, "Q: ");
  EXPECT_EQ(pc.completion, "A");
  EXPECT_THROW_WITH(parse_prompt_completion(json::parse(R"({"prompt": "Q"})")), BadSample, "needs a 'completion'");
  EXPECT_THROW_WITH(parse_prompt_completion(json::parse(R"({"prompt": 1, "completion": "a"})")), BadSample,
                    "'prompt' must be a string");
  EXPECT_EQ(parse_text(json::parse(R"({"text": "abc"})")), "abc");
  EXPECT_THROW_WITH(parse_text(json::parse(R"({"text": ""})")), BadSample, "'text' is an empty string");
  EXPECT_THROW_WITH(parse_text(json::parse(R"({"text": ["a"]})")), BadSample, "'text' must be a string");
}

TEST(SampleFormats, PreferenceTextPair) {
  auto p = parse_preference(json::parse(R"({"prompt": "2+2=", "chosen": "4", "rejected": "5"})"));
  EXPECT_FALSE(p.conversational);
  EXPECT_EQ(p.prompt_text, "2+2=");
  EXPECT_EQ(p.chosen_text, "4");
  EXPECT_EQ(p.rejected_text, "5");
  EXPECT_THROW_WITH(parse_preference(json::parse(R"({"prompt": "p", "chosen": "4", "rejected": "4"})")),
                    BadSample, "identical");
  EXPECT_THROW_WITH(parse_preference(json::parse(R"({"prompt": "p", "chosen": "4"})")), BadSample,
                    "missing field 'rejected'");
}

TEST(SampleFormats, PreferenceWithExplicitMessagePrompt) {
  auto p = parse_preference(json::parse(R"({"prompt": [{"role": "user", "content": "hi"}],
      "chosen": [{"role": "assistant", "content": "hello"}], "rejected": "go away"})"));
  EXPECT_TRUE(p.conversational);
  EXPECT_EQ(p.prompt.messages, (std::vector<ChatMessage>{msg("user", "hi")}));
  EXPECT_EQ(p.chosen, (std::vector<ChatMessage>{msg("assistant", "hello")}));
  EXPECT_EQ(p.rejected, (std::vector<ChatMessage>{msg("assistant", "go away")}));
}

TEST(SampleFormats, PreferenceSharedHistoryIsTheCommonPrefix) {
  auto p = parse_preference(json::parse(R"({
      "chosen": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                 {"role": "user", "content": "q2"}, {"role": "assistant", "content": "good"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"},
                   {"role": "user", "content": "q2"}, {"role": "assistant", "content": "bad"}]})"));
  EXPECT_EQ(p.prompt.messages.size(), 3u);
  EXPECT_EQ(p.prompt.messages[2], msg("user", "q2"));
  EXPECT_EQ(p.chosen, (std::vector<ChatMessage>{msg("assistant", "good")}));
  EXPECT_EQ(p.rejected, (std::vector<ChatMessage>{msg("assistant", "bad")}));
  EXPECT_THROW_WITH(parse_preference(json::parse(R"({"chosen": [{"role": "user", "content": "q"}],
      "rejected": [{"role": "user", "content": "q"}]})")), BadSample, "identical");
  EXPECT_THROW_WITH(parse_preference(json::parse(R"({"chosen": [{"role": "user", "content": "q"}],
      "rejected": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})")),
                    BadSample, "'chosen' adds nothing");
}

TEST(SampleFormats, PreferenceMsSwiftAndLlamaFactoryForms) {
  auto p = parse_preference(json::parse(R"({"messages": [{"role": "user", "content": "q"},
      {"role": "assistant", "content": "good"}], "rejected_response": "bad"})"));
  EXPECT_EQ(p.prompt.messages, (std::vector<ChatMessage>{msg("user", "q")}));
  EXPECT_EQ(p.chosen, (std::vector<ChatMessage>{msg("assistant", "good")}));
  EXPECT_EQ(p.rejected, (std::vector<ChatMessage>{msg("assistant", "bad")}));
  EXPECT_THROW_WITH(parse_preference(json::parse(R"({"messages": [{"role": "user", "content": "q"}],
      "rejected_response": "bad"})")), BadSample, "last message must be the chosen assistant answer");

  p = parse_preference(json::parse(R"({"conversations": [{"from": "human", "value": "q"}],
      "chosen": {"from": "gpt", "value": "good"}, "rejected": {"from": "gpt", "value": "bad"}})"));
  EXPECT_EQ(p.prompt.messages, (std::vector<ChatMessage>{msg("user", "q")}));
  EXPECT_EQ(p.chosen, (std::vector<ChatMessage>{msg("assistant", "good")}));
  EXPECT_EQ(p.rejected, (std::vector<ChatMessage>{msg("assistant", "bad")}));
}
