// The chat templates the new model families ship (testdata/chat_templates: Gemma 2 and 3, gpt-oss's
// harmony template, GLM-4.5, Mistral v0.1/v0.3/Nemo/Small 3.2, Phi-3.5): spindle renders them byte
// for byte as transformers 5.17 does (references.json, made by tests/chat/make_template_references.py
// with transformers' own renderer), raises where transformers raises, and supervises the bytes of
// each assistant turn that the model produces.
#include <gtest/gtest.h>

#include "chat_test_support.h"
#include "data/chat/assistant_spans.h"
#include "data/chat/chat_template.h"
#include "data/tokenizer/tokenizer.h"

#include <map>
#include <optional>

namespace spindle::chat {
namespace {

using nlohmann::ordered_json;

std::filesystem::path template_dir() { return std::filesystem::path(SPINDLE_SOURCE_DIR) / "testdata" / "chat_templates"; }

const ChatTemplate& family_template(const std::string& file) {
  static std::map<std::string, ChatTemplate> parsed;
  auto found = parsed.find(file);
  if (found == parsed.end()) found = parsed.emplace(file, ChatTemplate::parse(testing::read_text(template_dir() / file))).first;
  return found->second;
}

ordered_json references() { return ordered_json::parse(testing::read_text(template_dir() / "references.json")); }

TEST(FamilyTemplates, RenderLikeTransformers) {
  const auto cases = references();
  ASSERT_GE(cases.size(), 100u);
  size_t identical = 0, both_raise = 0;
  for (const auto& c : cases) {
    const std::string where = c["template"].get<std::string>() + " / " + c["conversation"].get<std::string>();
    std::optional<std::string> output;
    std::string error;
    try {
      output = family_template(c["template"]).render(c["context"], testing::fixed_clock());
    } catch (const TemplateError& e) {
      error = e.what();
    }
    if (c.contains("text")) {
      if (!output) {
        ADD_FAILURE() << where << ": spindle raised but transformers rendered: " << error;
        continue;
      }
      EXPECT_EQ(*output, c["text"].get<std::string>()) << where;
      identical += *output == c["text"].get<std::string>();
    } else {
      EXPECT_FALSE(output) << where << ": transformers raised (" << c["error"].get<std::string>() << ") but spindle rendered";
      both_raise += !output;
    }
  }
  std::cout << "[ families ] " << cases.size() << " renderings: " << identical << " byte-identical, " << both_raise
            << " raise in both\n";
}

struct SpanCase {
  std::string template_file;
  std::string conversation;
  std::string cue;  // what the text before each span ends with: the generation prompt
  std::vector<std::string> supervised;
  std::string cue_after_tool = "";  // the cue of a turn that follows a tool result, where it differs
};
void PrintTo(const SpanCase& c, std::ostream* os) { *os << c.template_file << "/" << c.conversation; }

class FamilySpans : public ::testing::TestWithParam<SpanCase> {};

// Each assistant turn is supervised from the end of the generation prompt to the end of what the
// full rendering holds for it (end marker included, a conversation trailer excluded).
TEST_P(FamilySpans, SuperviseWhatTheModelProduces) {
  const SpanCase& param = GetParam();
  ordered_json context;
  std::string expected_text;
  for (const auto& c : references())
    if (c["template"] == param.template_file && c["conversation"] == param.conversation) {
      context = c["context"];
      expected_text = c["text"];
    }
  ASSERT_FALSE(context.is_null()) << "no reference rendering";
  const AssistantSpans spans = render_with_assistant_spans(family_template(param.template_file), context,
                                                           testing::fixed_clock());
  EXPECT_EQ(spans.text, expected_text);
  std::vector<std::string> supervised;
  for (size_t k = 0; k < spans.spans.size(); ++k) {
    const ByteSpan span = spans.spans[k];
    supervised.push_back(spans.text.substr(span.begin, span.end - span.begin));
    const bool after_tool = context["messages"][spans.message_indices[k] - 1]["role"] == "tool";
    const std::string& cue = after_tool && !param.cue_after_tool.empty() ? param.cue_after_tool : param.cue;
    EXPECT_TRUE(spans.text.substr(0, span.begin).ends_with(cue))
        << "before the span: " << ordered_json(spans.text.substr(0, span.begin)).dump();
  }
  EXPECT_EQ(supervised, param.supervised);
}

INSTANTIATE_TEST_SUITE_P(
    Templates, FamilySpans,
    ::testing::Values(
        SpanCase{"gemma2.jinja", "multi", "<start_of_turn>model\n",
                 {"2 + 2 = 4.<end_of_turn>\n", "Zwei plus zwei ist vier.<end_of_turn>\n"}},
        SpanCase{"gemma3.jinja", "system", "<start_of_turn>model\n", {"Hello.<end_of_turn>\n", "Goodbye.<end_of_turn>\n"}},
        SpanCase{"gemma3.jinja", "content_parts", "<start_of_turn>model\n", {"A cat.<end_of_turn>\n"}},
        // gpt-oss ends the last turn with <|return|> and keeps its analysis; earlier turns end
        // with <|end|> and lose theirs.
        SpanCase{"gpt_oss.jinja", "multi", "<|start|>assistant",
                 {"<|channel|>final<|message|>  2 + 2 = 4.\n<|end|>",
                  "<|channel|>final<|message|>Zwei plus zwei ist vier.<|return|>"}},
        SpanCase{"gpt_oss.jinja", "thinking", "<|start|>assistant",
                 {"<|channel|>final<|message|>Yes, 17 is prime.<|end|>",
                  "<|channel|>analysis<|message|>21 = 3 * 7.<|end|><|start|>assistant<|channel|>final<|message|>No, 21 = "
                  "3 × 7.<|return|>"}},
        SpanCase{"gpt_oss.jinja", "tools", "<|start|>assistant",
                 {" to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\", \"days\": 2}<|call|>",
                  "<|channel|>final<|message|>It is 22.5 °C in Paris.<|return|>"}},
        // GLM-4.5 has no end-of-turn marker: the next role token closes the turn.
        SpanCase{"glm4_5.jinja", "thinking", "<|assistant|>",
                 {"\n<think></think>\nYes, 17 is prime.", "\n<think>21 = 3 * 7.</think>\nNo, 21 = 3 × 7."}},
        SpanCase{"glm4_5.jinja", "tools", "<|assistant|>",
                 {"\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
                  "<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
                  "\n<think></think>\nIt is 22.5 °C in Paris."}},
        SpanCase{"mistral_v0_1.jinja", "multi", "[/INST]", {"  2 + 2 = 4.\n</s> ", "Zwei plus zwei ist vier.</s> "}},
        SpanCase{"mistral_v0_3.jinja", "tools", "[/INST]",
                 {" [TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}, \"id\": "
                  "\"call12345\"}] </s>",
                  " It is 22.5 °C in Paris. </s>"},
                 "[/TOOL_RESULTS] "},
        // Nemo puts the system prompt into the last user message: earlier turns are placed by the
        // prompt that follows the message before them.
        SpanCase{"mistral_nemo.jinja", "system", "[/INST]", {"Hello.</s>", "Goodbye.</s>"}},
        SpanCase{"mistral_nemo.jinja", "tools", "[/INST]",
                 {"[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"days\": 2}, \"id\": "
                  "\"call12345\"}]</s>",
                  "It is 22.5 °C in Paris.</s>"},
                 "[/TOOL_RESULTS]"},
        SpanCase{"mistral_small_3_2.jinja", "tools", "[/INST]",
                 {"[TOOL_CALLS]get_weather[CALL_ID]call12345[ARGS]{\"city\": \"Paris\", \"days\": 2}</s>",
                  "It is 22.5 °C in Paris.</s>"},
                 "[/TOOL_RESULTS]"},
        // Phi-3.5 closes a conversation without a generation prompt with eos_token: not a turn's.
        SpanCase{"phi3_5.jinja", "multi", "<|assistant|>\n", {"  2 + 2 = 4.\n<|end|>\n", "Zwei plus zwei ist vier.<|end|>\n"}}),
    [](const auto& info) {
      std::string name = info.param.template_file.substr(0, info.param.template_file.find('.')) + "_" + info.param.conversation;
      return name;
    });

struct TokenCase {
  std::string template_file;
  std::string conversation;
  std::string tokenizer;  // a folder of testdata/tokenizers with the family's layout
  // Bytes before a span that a supervised token covers too: BPE merged them with the span's first
  // bytes (mistral v0.3 after a tool result: "[/TOOL_RESULTS] " + " It..." gives the token "▁▁").
  size_t spill_before = 0;
};
void PrintTo(const TokenCase& c, std::ostream* os) { *os << c.template_file << "/" << c.conversation; }

class FamilyTokens : public ::testing::TestWithParam<TokenCase> {};

// With the family's kind of tokenizer (SentencePiece-style or byte-level) the rendering tokenizes
// without added specials and a token is supervised when one of its bytes lies in a span
// (docs/chat_templates.md): the supervised tokens must cover each span exactly, the turn markers
// included and the prompt cue excluded.
TEST_P(FamilyTokens, SupervisedTokensCoverTheSpansExactly) {
  const TokenCase& param = GetParam();
  ordered_json context;
  for (const auto& c : references())
    if (c["template"] == param.template_file && c["conversation"] == param.conversation) context = c["context"];
  ASSERT_FALSE(context.is_null());
  const Tokenizer tokenizer =
      Tokenizer::load((std::filesystem::path(SPINDLE_SOURCE_DIR) / "testdata" / "tokenizers" / param.tokenizer).string());
  const AssistantSpans spans = render_with_assistant_spans(family_template(param.template_file), context,
                                                           testing::fixed_clock());
  ASSERT_FALSE(spans.spans.empty());
  const Encoding encoding = tokenizer.encode_with_offsets(spans.text, false);
  for (size_t k = 0; k < spans.spans.size(); ++k) {
    const ByteSpan span = spans.spans[k];
    const bool after_tool = context["messages"][spans.message_indices[k] - 1]["role"] == "tool";
    size_t covered_begin = SIZE_MAX, covered_end = 0, supervised = 0;
    for (const auto& offset : encoding.offsets) {
      if (offset.end <= span.begin || offset.begin >= span.end) continue;
      covered_begin = std::min(covered_begin, offset.begin);
      covered_end = std::max(covered_end, offset.end);
      ++supervised;
    }
    EXPECT_GT(supervised, 0u);
    EXPECT_EQ(covered_begin, span.begin - (after_tool ? param.spill_before : 0)) << ordered_json(spans.text.substr(span.begin, span.end - span.begin)).dump();
    EXPECT_EQ(covered_end, span.end) << ordered_json(spans.text.substr(span.begin, span.end - span.begin)).dump();
  }
}

INSTANTIATE_TEST_SUITE_P(Templates, FamilyTokens,
                         ::testing::Values(TokenCase{"gemma3.jinja", "system", "gemma"},
                                           TokenCase{"gemma2.jinja", "multi", "gemma"},
                                           TokenCase{"phi3_5.jinja", "system", "phi3_style"},
                                           TokenCase{"mistral_v0_1.jinja", "multi", "llama2_legacy"},
                                           TokenCase{"mistral_v0_3.jinja", "tools", "llama_first", 1},
                                           TokenCase{"mistral_nemo.jinja", "tools", "tekken_small"},
                                           TokenCase{"gpt_oss.jinja", "thinking", "o200k_small"}),
                         [](const auto& info) {
                           return info.param.template_file.substr(0, info.param.template_file.find('.')) + "_" +
                                  info.param.conversation;
                         });

}  // namespace
}  // namespace spindle::chat
