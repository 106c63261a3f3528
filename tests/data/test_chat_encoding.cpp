// Conversations into training documents: token-to-span assignment, loss_scale per message,
// ShareGPT/Alpaca/DPO through the same path, errors with line numbers, and, on the three shipped
// tokenizers, ids and masks checked against Python (jinja2 in transformers' environment + HF
// `tokenizers`, and transformers' own assistant-mask algorithm for {% generation %} templates).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>

#include <nlohmann/json.hpp>

#include "byte_text_encoder.h"
#include "data/chat_encoding.h"
#include "data/prepared_dataset.h"
#include "data/sample_encoder.h"
#include "data/tokenizer/tokenizer.h"
#include "data_test_util.h"
#include "support/reference_data.h"

using namespace spindle;
using spindle::testing::byte_token;
using spindle::testing::ByteTextEncoder;
using spindle::testing::ScratchDir;
using json = nlohmann::json;
using ordered_json = nlohmann::ordered_json;
namespace fs = std::filesystem;

namespace {

constexpr int32_t X = kIgnoreIndex;

using spindle::test::kChatTemplateCorpus;
using spindle::test::kTokenizerFolders;
using spindle::test::missing_reference;
using spindle::test::reference_path;

// The folder of a published tokenizer (SPINDLE_TEST_TOKENIZERS), or empty when it is not supplied.
std::string shipped(const std::string& name) {
  const fs::path file = reference_path(kTokenizerFolders, fs::path(name) / "tokenizer.json");
  return file.empty() ? std::string() : file.parent_path().string();
}

// Why shipped(name) is empty and how to supply it.
std::string missing_shipped(const std::string& name) {
  return missing_reference(kTokenizerFolders, fs::path(name) / "tokenizer.json");
}

// strftime_now() on both sides of every comparison.
constexpr int kFixedDate[5] = {2025, 7, 10, 12, 0};
chat::RenderOptions fixed_clock() {
  std::tm tm{};
  tm.tm_year = kFixedDate[0] - 1900;
  tm.tm_mon = kFixedDate[1] - 1;
  tm.tm_mday = kFixedDate[2];
  tm.tm_hour = kFixedDate[3];
  tm.tm_min = kFixedDate[4];
  tm.tm_isdst = -1;
  chat::RenderOptions options;
  options.now = std::chrono::system_clock::from_time_t(std::mktime(&tm));
  return options;
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

struct ReferenceCase {
  std::string tokenizer_dir;
  std::optional<std::string> template_source;  // unset: the folder's chat template
  std::string sample;                          // a JSONL line
  bool add_generation_prompt = false;
};

// transformers' apply_chat_template(tokenize=True) for every case, from one Python process; unset
// (with the reason) when python3 with jinja2 and tokenizers or hfenv.py is missing.
std::optional<std::vector<json>> python_reference(const std::vector<ReferenceCase>& cases, std::string& why_not) {
  const fs::path hfenv = reference_path(kChatTemplateCorpus, "hfenv.py");
  if (hfenv.empty()) {
    why_not = missing_reference(kChatTemplateCorpus, "hfenv.py");
    return std::nullopt;
  }
  const fs::path hfenv_dir = hfenv.parent_path();
  if (std::system("python3 -c 'import jinja2, tokenizers' >/dev/null 2>&1") != 0) {
    why_not = "python3 with jinja2 and tokenizers is not installed: pip install jinja2 tokenizers";
    return std::nullopt;
  }
  ScratchDir scratch;
  ordered_json request;
  request["now"] = kFixedDate;
  request["cases"] = ordered_json::array();
  for (const auto& c : cases)
    request["cases"].push_back({{"tokenizer_dir", c.tokenizer_dir},
                                {"template", c.template_source ? ordered_json(*c.template_source) : ordered_json()},
                                {"sample", ordered_json::parse(c.sample)},
                                {"add_generation_prompt", c.add_generation_prompt}});
  scratch.write("request.json", request.dump());
  const std::string command = "python3 '" + std::string(SPINDLE_SOURCE_DIR) + "/tests/data/chat_reference.py' '" +
                              hfenv_dir.string() + "' '" + (scratch.path() / "request.json").string() + "' '" +
                              (scratch.path() / "out.json").string() + "'";
  if (std::system(command.c_str()) != 0) {
    ADD_FAILURE() << "chat_reference.py failed: " << command;
    return std::nullopt;
  }
  return json::parse(read_file(scratch.path() / "out.json")).get<std::vector<json>>();
}

// The text of each run of consecutive supervised tokens.
std::vector<std::string> supervised_runs(const Tokenizer& tokenizer, const Document& doc) {
  std::vector<std::string> runs;
  std::vector<int32_t> run;
  for (size_t k = 0; k <= doc.labels.size(); ++k) {
    if (k < doc.labels.size() && doc.labels[k] != X) {
      run.push_back(doc.labels[k]);
    } else if (!run.empty()) {
      runs.push_back(tokenizer.decode(run));
      run.clear();
    }
  }
  return runs;
}

EncodeOptions pinned_clock_options() {
  EncodeOptions options;
  options.chat_render = fixed_clock();
  return options;
}

// Conversations for the differential test: multi-turn, system, tools with tool calls (arguments
// in non-sorted key order), Qwen3 think blocks and reasoning_content, enable_thinking through
// chat_template_kwargs, Unicode, code and whitespace runs, a conversation ending with a user turn.
const std::vector<std::string> kConversations = {
    R"({"messages": [{"role": "user", "content": "Hello!"}, {"role": "assistant", "content": "Hi there. How can I help?"}]})",
    R"({"messages": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"},
                     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
                     {"role": "assistant", "content": "6, obviously."}]})",
    R"({"tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city",
                   "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                   "unit": {"type": "string", "enum": ["c", "f"]}}, "required": ["city"]}}}],
        "messages": [{"role": "user", "content": "Weather in Paris, in celsius?"},
                     {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function":
                       {"name": "get_weather", "arguments": {"unit": "c", "city": "Paris"}}}]},
                     {"role": "tool", "content": "{\"temperature\": 22}"},
                     {"role": "assistant", "content": "It is 22 \u00b0C in Paris."}]})",
    R"({"messages": [{"role": "user", "content": "Is 17 prime?"},
                     {"role": "assistant", "content": "<think>\nCheck 2, 3, 4.\n</think>\n\nYes, 17 is prime."},
                     {"role": "user", "content": "And 21?"},
                     {"role": "assistant", "content": "<think>\n21 = 3 * 7.\n</think>\n\nNo."}]})",
    R"({"messages": [{"role": "user", "content": "Why?"},
                     {"role": "assistant", "content": "Because.", "reasoning_content": "The user asks why."}]})",
    R"({"chat_template_kwargs": {"enable_thinking": false},
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]})",
    R"({"messages": [{"role": "user", "content": "\u00c9cris du code \ud83d\udc0d s'il te pla\u00eet\n\n"},
                     {"role": "assistant", "content": "  def f(x):\n      return x  # \u2713\n\n\t\u65e5\u672c\u8a9e 1234567   "}]})",
    R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                     {"role": "user", "content": "Bye"}]})",
};

}  // namespace

// ---------------------------------------------------------------------------------------------
// Token-to-span assignment.

TEST(TokensInSpans, ATokenIsSupervisedIffOneOfItsBytesIsInsideASpan) {
  const std::vector<chat::ByteSpan> spans = {{3, 7}, {10, 12}};
  // [0,3) before; [2,4) straddles the start; [4,6) inside; [6,9) straddles the end; [9,10) between;
  // [10,12) exactly the second span; [12,15) after.
  const std::vector<chat::ByteSpan> tokens = {{0, 3}, {2, 4}, {4, 6}, {6, 9}, {9, 10}, {10, 12}, {12, 15}};
  EXPECT_EQ(tokens_in_spans(tokens, spans), (std::vector<int32_t>{-1, 0, 0, 0, -1, 1, -1}));
  EXPECT_EQ(tokens_in_spans(tokens, {}), std::vector<int32_t>(tokens.size(), -1));
}

TEST(TokensInSpans, EmptyTokensBelongToTheSpanThatHoldsTheirPositionButNotItsStart) {
  // Offsets trimmed to nothing (ByteLevel trim_offsets) sit at the end of the bytes they had.
  const std::vector<chat::ByteSpan> spans = {{3, 7}};
  const std::vector<chat::ByteSpan> tokens = {{3, 3}, {5, 5}, {7, 7}, {8, 8}};
  EXPECT_EQ(tokens_in_spans(tokens, spans), (std::vector<int32_t>{-1, 0, 0, -1}));
}

// ---------------------------------------------------------------------------------------------
// The sample encoder on the byte tokenizer (one token per byte, so positions read as text).

namespace {

const std::string kTwoTurns = R"({"messages": [
    {"role": "system", "content": "s"},
    {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1", "loss_scale": 2.5},
    {"role": "user", "content": "q2"}, {"role": "assistant", "content": "a2"}]})";

// The rendered bytes of kTwoTurns in the byte template, and where each answer's span starts.
std::string two_turns_text() {
  return "<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
         "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\na2<|im_end|>\n";
}

}  // namespace

TEST(ChatSampleEncoder, LossScaleWeightsThatMessagesSupervisedTokens) {
  ByteTextEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  const Document d = encoder.encode(SampleEncoder::parse_sample(kTwoTurns));
  const std::string text = two_turns_text();
  ASSERT_EQ(d.input_ids, bytes.encode(text, false));
  const std::string turn_end = "<|im_end|>\n";
  const size_t a1 = text.find("a1"), a2 = text.find("a2");
  ASSERT_EQ(d.loss_scale.size(), text.size());
  for (size_t i = 0; i < text.size(); ++i) {
    const bool in_a1 = i >= a1 && i < a1 + 2 + turn_end.size();
    const bool in_a2 = i >= a2 && i < a2 + 2 + turn_end.size();
    EXPECT_EQ(d.labels[i], in_a1 || in_a2 ? d.input_ids[i] : X) << i;
    EXPECT_EQ(d.loss_scale[i], in_a1 ? 2.5f : in_a2 ? 1.0f : 0.0f) << i;
  }
}

TEST(ChatSampleEncoder, ZeroLossScaleLeavesATurnUnsupervisedAndUnitScalesLeaveNoWeights) {
  ByteTextEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  ordered_json sample = SampleEncoder::parse_sample(kTwoTurns);
  sample["messages"][2]["loss_scale"] = 0;
  const Document d = encoder.encode(sample);
  const std::string text = two_turns_text();
  const size_t a2 = text.find("a2");
  for (size_t i = 0; i < text.size(); ++i) EXPECT_EQ(d.labels[i], i >= a2 ? d.input_ids[i] : X) << i;
  EXPECT_TRUE(d.loss_scale.empty()) << "all supervised weights are 1";
  // ms-swift's "loss": false says the same.
  sample["messages"][2].erase("loss_scale");
  sample["messages"][2]["loss"] = false;
  EXPECT_EQ(encoder.encode(sample).labels, d.labels);
}

TEST(ChatSampleEncoder, LossScaleOnANonAssistantMessageIsABadSample) {
  ByteTextEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  EXPECT_THROW_WITH(encoder.encode(SampleEncoder::parse_sample(
                        R"({"messages": [{"role": "user", "content": "q", "loss_scale": 1},
                                         {"role": "assistant", "content": "a"}]})")),
                    BadSample, "message 0 (user) has loss_scale 1", "only assistant turns are supervised");
  // An explicit 0 on a user message says what is already so.
  EXPECT_NO_THROW(encoder.encode(SampleEncoder::parse_sample(
      R"({"messages": [{"role": "user", "content": "q", "loss_scale": 0}, {"role": "assistant", "content": "a"}]})")));
}

TEST(ChatSampleEncoder, ShareGptAlpacaAndMessagesGiveTheSameDocument) {
  ByteTextEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  const Document messages = encoder.encode(SampleEncoder::parse_sample(
      R"({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "do\nit"},
                       {"role": "assistant", "content": "done"}]})"));
  const Document sharegpt = encoder.encode(SampleEncoder::parse_sample(
      R"({"system": "s", "conversations": [{"from": "human", "value": "do\nit"}, {"from": "gpt", "value": "done"}]})"));
  const Document alpaca =
      encoder.encode(SampleEncoder::parse_sample(R"({"system": "s", "instruction": "do", "input": "it", "output": "done"})"));
  EXPECT_EQ(sharegpt.input_ids, messages.input_ids);
  EXPECT_EQ(sharegpt.labels, messages.labels);
  EXPECT_EQ(alpaca.input_ids, messages.input_ids);
  EXPECT_EQ(alpaca.labels, messages.labels);
}

TEST(ChatSampleEncoder, ToolsAndExtraMessageFieldsReachTheTemplateInTheDataOrder) {
  ByteTextEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  const auto encoded = encoder.encode_conversation(SampleEncoder::parse_sample(
      R"({"tools": [{"zeta": 1, "alpha": 2}], "messages": [{"role": "user", "content": "q"}]})"));
  EXPECT_NE(encoded.chat.text.find(R"(<tools>[{"zeta": 1, "alpha": 2}]</tools>)"), std::string::npos)
      << encoded.chat.text;
  // The variables: the sample's own message objects (role normalised), its tools, its kwargs.
  const ordered_json sample = SampleEncoder::parse_sample(
      R"({"system": "s", "tools": "[{\"b\": 1, \"a\": 2}]", "chat_template_kwargs": {"enable_thinking": false},
          "messages": [{"role": "human", "content": "q", "name": "x"}, {"role": "assistant", "content": "a"}]})");
  const auto variables =
      chat_template_variables(sample, SampleFormat::kMessages, parse_conversation(json(sample)));
  EXPECT_EQ(variables.dump(),
            R"({"messages":[{"role":"system","content":"s"},{"role":"user","content":"q","name":"x"},)"
            R"({"role":"assistant","content":"a"}],"tools":[{"b":1,"a":2}],"enable_thinking":false})");
  EXPECT_THROW_WITH(encoder.encode(SampleEncoder::parse_sample(
                        R"({"chat_template_kwargs": {"tools": []}, "messages": [{"role": "user", "content": "q"}]})")),
                    BadSample, "'chat_template_kwargs' sets 'tools'");
}

TEST(ChatSampleEncoder, GenerationPromptIsRenderedButNeverSupervised) {
  ByteTextEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  const auto encoded =
      encoder.encode_conversation(SampleEncoder::parse_sample(R"({"messages": [{"role": "user", "content": "q"}]})"), true);
  EXPECT_EQ(encoded.chat.text, "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n");
  EXPECT_EQ(encoded.document.labels, std::vector<int32_t>(encoded.chat.text.size(), X));
}

TEST(ChatSampleEncoder, ConversationalPreferencePairSupervisesOnlyEachSidesAnswer) {
  ByteTextEncoder bytes;
  SampleEncoder encoder(&bytes, {});
  const auto pair = encoder.encode_preference(SampleEncoder::parse_sample(
      R"({"prompt": [{"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
                     {"role": "user", "content": "q2"}],
          "chosen": [{"role": "assistant", "content": "good"}], "rejected": "bad"})"));
  const std::string history = "<|im_start|>user\nq1<|im_end|>\n<|im_start|>assistant\na1<|im_end|>\n"
                              "<|im_start|>user\nq2<|im_end|>\n<|im_start|>assistant\n";
  for (const auto& [doc, answer] : {std::pair{&pair.chosen, std::string("good")}, {&pair.rejected, std::string("bad")}}) {
    const std::string text = history + answer + "<|im_end|>\n";
    ASSERT_EQ(doc->input_ids, bytes.encode(text, false));
    for (size_t i = 0; i < text.size(); ++i)
      EXPECT_EQ(doc->labels[i], i >= history.size() ? doc->input_ids[i] : X) << answer << " " << i;
  }
}

TEST(ChatSampleEncoder, TemplateErrorsAreBadSamplesWithTheTemplateLine) {
  ByteTextEncoder bytes;
  // A template raising on its second line, as real templates do for unsupported roles.
  struct RaisingEncoder : ByteTextEncoder {
    RaisingEncoder() {
      raising.chat_template = chat::ChatTemplate::parse(
          "{% for m in messages %}{{ m.content }}\n"
          "{% if m.role == 'tool' %}{{ raise_exception('tools are not supported') }}{% endif %}{% endfor %}");
      raising.origin = "raising template";
    }
    const chat::ModelChatTemplate& chat_template(bool) const override { return raising; }
    chat::ModelChatTemplate raising;
  } raising;
  SampleEncoder encoder(&raising, {});
  EXPECT_THROW_WITH(encoder.encode(SampleEncoder::parse_sample(
                        R"({"messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "r"}]})")),
                    BadSample, "chat template line 2", "tools are not supported", "raising template");
}

// ---------------------------------------------------------------------------------------------
// Malformed conversations name their line, through spindle prepare's reader.

TEST(ChatPrepare, MalformedConversationsNameTheirLine) {
  ByteTextEncoder bytes;
  const std::string good = R"({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})";
  const std::vector<std::pair<std::string, std::vector<const char*>>> cases = {
      {R"({"messages": []})", {"empty conversation"}},
      {R"({"messages": [{"content": "q"}]})", {"messages[0] has no 'role'"}},
      {R"({"messages": [{"role": "user"}]})", {"messages[0] has no 'content'"}},
      {R"({"messages": [{"role": "user", "content": "q"}, {"role": "wizard", "content": "a"}]})",
       {"messages[1] has unknown role 'wizard'"}},
      {R"({"messages": [{"role": "user", "content": "q", "loss_scale": -1}]})", {"loss_scale must be"}},
  };
  for (const auto& [bad, fragments] : cases) {
    ScratchDir dir;
    PrepareOptions options;
    options.data = dir.write("d.jsonl", good + "\n" + good + "\n" + bad + "\n");
    options.output_dir = dir.path() / "out";
    options.fit.max_length = 1024;
    bool thrown = false;
    try {
      prepare_dataset(options, &bytes);
    } catch (const Error& e) {
      thrown = true;
      const std::string message = e.what();
      EXPECT_NE(message.find("d.jsonl:3: "), std::string::npos) << message;
      for (const char* fragment : fragments) EXPECT_NE(message.find(fragment), std::string::npos) << message;
    }
    EXPECT_TRUE(thrown) << bad;
  }
}

// ---------------------------------------------------------------------------------------------
// The shipped tokenizers against Python.

TEST(ChatShipped, IdsMatchApplyChatTemplateOnAllThreeFamilies) {
  const std::vector<std::string> families = {"qwen3", "qwen2_5", "llama3"};
  for (const auto& name : families)
    if (shipped(name).empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped(name));
  std::vector<ReferenceCase> cases;
  for (const auto& family : families) {
    for (const auto& conversation : kConversations) cases.push_back({shipped(family), std::nullopt, conversation, false});
    cases.push_back({shipped(family), std::nullopt, kConversations[7], true});
    cases.push_back({shipped(family), std::nullopt, kConversations[2], true});
  }
  std::string why_not;
  const auto reference = python_reference(cases, why_not);
  if (!reference) SPINDLE_SKIP_WITHOUT_REFERENCE(why_not);
  ASSERT_EQ(reference->size(), cases.size());
  std::map<std::string, std::unique_ptr<TextEncoder>> encoders;
  size_t compared = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const ReferenceCase& c = cases[i];
    auto& text_encoder = encoders[c.tokenizer_dir];
    if (!text_encoder) text_encoder = load_text_encoder(c.tokenizer_dir);
    SampleEncoder encoder(text_encoder.get(), pinned_clock_options());
    const json& expected = (*reference)[i];
    SCOPED_TRACE(c.tokenizer_dir + " case " + std::to_string(i) + (c.add_generation_prompt ? " +gen" : "") + ": " +
                 c.sample);
    if (expected.contains("error")) {
      EXPECT_THROW(encoder.encode_conversation(SampleEncoder::parse_sample(c.sample), c.add_generation_prompt), BadSample)
          << "Python raised " << expected["error"];
      continue;
    }
    const auto encoded = encoder.encode_conversation(SampleEncoder::parse_sample(c.sample), c.add_generation_prompt);
    EXPECT_EQ(encoded.chat.text, expected["text"].get<std::string>());
    EXPECT_EQ(encoded.document.input_ids, expected["ids"].get<std::vector<int32_t>>());
    ++compared;
  }
  EXPECT_GE(compared, cases.size() - 2) << "nearly every case renders in Python";
}

TEST(ChatShipped, SupervisedTokensAreExactlyTheAssistantTurns) {
  struct Expectation {
    const char* family;
    std::string conversation;
    std::vector<std::string> supervised;
  };
  const std::vector<Expectation> expectations = {
      {"qwen2_5", kConversations[1], {"4<|im_end|>\n", "6, obviously.<|im_end|>\n"}},
      {"qwen2_5", kConversations[2],
       {"<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"unit\": \"c\", \"city\": \"Paris\"}}\n</tool_call>"
        "<|im_end|>\n",
        "It is 22 \u00b0C in Paris.<|im_end|>\n"}},
      {"qwen3", kConversations[3],
       {"Yes, 17 is prime.<|im_end|>\n", "<think>\n21 = 3 * 7.\n</think>\n\nNo.<|im_end|>\n"}},
      {"qwen3", kConversations[4], {"<think>\nThe user asks why.\n</think>\n\nBecause.<|im_end|>\n"}},
      {"llama3", kConversations[1], {"4<|eot_id|>", "6, obviously.<|eot_id|>"}},
      {"llama3", kConversations[6], {"def f(x):\n      return x  # \u2713\n\n\t\u65e5\u672c\u8a9e 1234567<|eot_id|>"}},
  };
  for (const auto& e : expectations)
    if (shipped(e.family).empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped(e.family));
  for (const auto& e : expectations) {
    const std::string dir = shipped(e.family);
    SCOPED_TRACE(std::string(e.family) + ": " + e.conversation);
    const Tokenizer tokenizer = Tokenizer::load(dir);
    auto text_encoder = load_text_encoder(dir);
    SampleEncoder encoder(text_encoder.get(), pinned_clock_options());
    const Document doc = encoder.encode(SampleEncoder::parse_sample(e.conversation));
    EXPECT_EQ(supervised_runs(tokenizer, doc), e.supervised);
  }
}

// TRL-style training template: generation blocks around each assistant answer, one of them
// opening inside a word ("Answer" + "s ...") so that a BPE token straddles the block's start.
constexpr const char* kGenerationTemplate =
    "{% for m in messages %}{% if m.role == 'assistant' %}<|im_start|>assistant\nAnswer{% generation %}"
    "{{ m.content }}<|im_end|>\n{% endgeneration %}{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}";

TEST(ChatShipped, GenerationBlockMasksMatchTransformersAssistantMask) {
  const std::string dir = shipped("qwen2_5");
  if (dir.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped("qwen2_5"));
  const std::vector<std::string> samples = {
      R"({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "s are below."},
                       {"role": "user", "content": "More?"}, {"role": "assistant", "content": "ing done.  \n\n"}]})",
      R"({"messages": [{"role": "user", "content": "Code"}, {"role": "assistant", "content": ":\n    x = 1\n\t\u00e9t\u00e9"}]})",
  };
  std::vector<ReferenceCase> cases;
  for (const auto& s : samples) cases.push_back({dir, std::string(kGenerationTemplate), s, false});
  std::string why_not;
  const auto reference = python_reference(cases, why_not);
  if (!reference) SPINDLE_SKIP_WITHOUT_REFERENCE(why_not);
  const Tokenizer tokenizer = Tokenizer::load(dir);
  const chat::ChatTemplate generation_template = chat::ChatTemplate::parse(kGenerationTemplate);
  const OffsetTokenizer tokenize = [&](std::string_view text, std::vector<int32_t>& ids,
                                       std::vector<chat::ByteSpan>& offsets) {
    Encoding encoding = tokenizer.encode_with_offsets(text, false);
    ids = encoding.ids;
    offsets.clear();
    for (const auto& o : encoding.offsets) offsets.push_back({o.begin, o.end});
  };
  bool straddled = false;
  for (size_t i = 0; i < samples.size(); ++i) {
    SCOPED_TRACE(samples[i]);
    const json& expected = (*reference)[i];
    ASSERT_FALSE(expected.contains("error")) << expected["error"];
    ordered_json sample = ordered_json::parse(samples[i]);
    const ChatEncoding encoding = encode_chat(generation_template, chat::transformers_context(sample, ordered_json::object()),
                                              tokenize, fixed_clock());
    EXPECT_EQ(encoding.text, expected["text"].get<std::string>());
    ASSERT_EQ(encoding.ids, expected["ids"].get<std::vector<int32_t>>());
    std::vector<int> mask;
    for (size_t k = 0; k < encoding.ids.size(); ++k) mask.push_back(encoding.supervised(k));
    EXPECT_EQ(mask, expected["mask"].get<std::vector<int>>());
    // Assistant messages are 1 and 3: each supervised token is attributed to its message.
    for (size_t k = 0; k < encoding.ids.size(); ++k)
      if (encoding.supervised(k)) {
        EXPECT_TRUE(encoding.turn_of_token[k] == 1 || encoding.turn_of_token[k] == 3);
      }
    // The first answer's block opens inside "Answers": that token must be supervised whole.
    const std::string answers = "Answers";
    for (size_t k = 0; k < encoding.ids.size(); ++k)
      straddled |= tokenizer.decode(std::vector<int32_t>{encoding.ids[k]}).ends_with("Answers") && mask[k];
  }
  EXPECT_TRUE(straddled) << "the test should exercise a token straddling a block start";
}

// ---------------------------------------------------------------------------------------------
// spindle tokenize --chat.

namespace {

struct CliResult {
  int status;
  std::string out, err;
};

CliResult run_tokenize_chat(const std::string& dir, const std::string& input) {
  ScratchDir scratch;
  const auto in = scratch.write("in.jsonl", input);
  const auto out = scratch.path() / "out.jsonl", err = scratch.path() / "err.txt";
  const std::string command = std::string(SPINDLE_TOKENIZE_DRIVER) + " tokenize --chat --tokenizer '" + dir + "' < '" +
                              in.string() + "' > '" + out.string() + "' 2> '" + err.string() + "'";
  const int status = std::system(command.c_str());
  return CliResult{status, read_file(out), read_file(err)};
}

}  // namespace

TEST(TokenizeChatCli, WritesTextIdsAndMaskAsTrainingSeesThem) {
  const std::string dir = shipped("qwen3");
  if (dir.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped("qwen3"));
  ordered_json with_prompt = ordered_json::parse(kConversations[7]);
  with_prompt["add_generation_prompt"] = true;
  const std::vector<std::string> lines = {kConversations[2], kConversations[3], with_prompt.dump()};
  std::string input;
  for (const auto& line : lines) input += ordered_json::parse(line).dump() + "\n";
  const CliResult result = run_tokenize_chat(dir, input);
  ASSERT_EQ(result.status, 0) << result.err;
  auto text_encoder = load_text_encoder(dir);
  SampleEncoder encoder(text_encoder.get(), {});
  std::istringstream out(result.out);
  std::string line;
  for (size_t i = 0; i < lines.size(); ++i) {
    ASSERT_TRUE(std::getline(out, line));
    const json written = json::parse(line);
    const auto expected = encoder.encode_conversation(SampleEncoder::parse_sample(lines[i]), i == 2);
    EXPECT_EQ(written["text"].get<std::string>(), expected.chat.text);
    EXPECT_EQ(written["ids"].get<std::vector<int32_t>>(), expected.document.input_ids);
    std::vector<int> mask;
    for (int32_t label : expected.document.labels) mask.push_back(label != X);
    EXPECT_EQ(written["mask"].get<std::vector<int>>(), mask);
    EXPECT_FALSE(written.contains("loss_scale"));
  }
  EXPECT_TRUE(json::parse(result.out.substr(result.out.rfind('{', result.out.size() - 2)))["text"]
                  .get<std::string>()
                  .ends_with("<|im_start|>assistant\n"));
  EXPECT_FALSE(std::getline(out, line)) << "extra output line: " << line;
}

TEST(TokenizeChatCli, BadLinesNameTheirLineNumber) {
  const std::string dir = shipped("qwen2_5");
  if (dir.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped("qwen2_5"));
  const std::string good = ordered_json::parse(kConversations[0]).dump() + "\n";
  const std::vector<std::pair<std::string, const char*>> cases = {
      {R"({"messages": []})", "empty conversation"},
      {R"({"messages": [{"role": "user"}]})", "has no 'content'"},
      {R"({"messages": [{"role": "bot", "content": "x"}]})", "unknown role 'bot'"},
      {R"({"text": "plain"})", "must be a conversation"},
      {R"({"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": "yes"})", "true or false"},
      {R"({"messages": )", "not valid JSON"},
  };
  for (const auto& [bad, fragment] : cases) {
    const CliResult result = run_tokenize_chat(dir, good + good + bad + "\n" + good);
    EXPECT_NE(result.status, 0) << bad;
    EXPECT_NE(result.err.find("stdin line 3: "), std::string::npos) << result.err;
    EXPECT_NE(result.err.find(fragment), std::string::npos) << result.err;
  }
}

// ---------------------------------------------------------------------------------------------
// Training data: a messages JSONL prepared with the Qwen2.5 tokenizer.

TEST(ChatPrepare, MessagesJsonlPreparesWithAssistantLabelsAndWeights) {
  const std::string dir = shipped("qwen2_5");
  if (dir.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped("qwen2_5"));
  ScratchDir scratch;
  std::string jsonl;
  jsonl += ordered_json::parse(kConversations[1]).dump() + "\n";
  jsonl += R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A1", "loss_scale": 0.5},)"
           R"( {"role": "user", "content": "R"}, {"role": "assistant", "content": "A2"}]})" "\n";
  jsonl += R"({"conversations": [{"from": "human", "value": "Hey"}, {"from": "gpt", "value": "Hello!"}]})" "\n";
  jsonl += R"({"instruction": "Add", "input": "1 2", "output": "3"})" "\n";
  PrepareOptions options;
  options.data = scratch.write("chat.jsonl", jsonl);
  options.output_dir = scratch.path() / "prepared";
  options.fit.max_length = 4096;
  auto text_encoder = load_text_encoder(dir);
  const PrepareReport report = prepare_dataset(options, text_encoder.get());
  EXPECT_EQ(report.documents, 4);
  const PreparedDataset dataset = PreparedDataset::open(options.output_dir);
  ASSERT_EQ(dataset.num_documents(), 4);
  const Tokenizer tokenizer = Tokenizer::load(dir);
  auto document = [&](int64_t i) {
    const DocumentView view = dataset.document(i);
    Document doc;
    doc.input_ids.assign(view.input_ids.begin(), view.input_ids.end());
    doc.labels.assign(view.labels.begin(), view.labels.end());
    doc.loss_scale.assign(view.loss_scale.begin(), view.loss_scale.end());
    return doc;
  };
  const std::vector<std::vector<std::string>> expected = {{"4<|im_end|>\n", "6, obviously.<|im_end|>\n"},
                                                          {"A1<|im_end|>\n", "A2<|im_end|>\n"},
                                                          {"Hello!<|im_end|>\n"},
                                                          {"3<|im_end|>\n"}};
  for (int64_t i = 0; i < 4; ++i) {
    const Document doc = document(i);
    EXPECT_EQ(supervised_runs(tokenizer, doc), expected[i]) << "document " << i;
    EXPECT_EQ(tokenizer.decode(doc.input_ids).rfind("<|im_start|>system\nYou are", 0), 0u)
        << "Qwen2.5's template adds its default or the given system prompt";
  }
  // Document 1: the first answer weighs 0.5, the second 1; loss_scale is stored only there.
  EXPECT_TRUE(document(0).loss_scale.empty());
  const Document weighted = document(1);
  ASSERT_EQ(weighted.loss_scale.size(), weighted.input_ids.size());
  std::vector<float> supervised_weights;
  for (size_t k = 0; k < weighted.labels.size(); ++k)
    if (weighted.labels[k] != X) supervised_weights.push_back(weighted.loss_scale[k]);
  const size_t first_turn = tokenizer.encode("A1<|im_end|>\n", false).size();
  ASSERT_EQ(supervised_weights.size(), first_turn + tokenizer.encode("A2<|im_end|>\n", false).size());
  for (size_t k = 0; k < supervised_weights.size(); ++k) EXPECT_EQ(supervised_weights[k], k < first_turn ? 0.5f : 1.0f);
}

TEST(ChatPrepare, AFolderWithoutChatTemplateSaysSoForConversationsButTokenizesText) {
  const std::string shipped_dir = shipped("qwen2_5");
  if (shipped_dir.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped("qwen2_5"));
  ScratchDir scratch;
  fs::copy_file(fs::path(shipped_dir) / "tokenizer.json", scratch.path() / "tokenizer.json");
  json config = json::parse(read_file(fs::path(shipped_dir) / "tokenizer_config.json"));
  config.erase("chat_template");
  scratch.write("tokenizer_config.json", config.dump());
  auto text_encoder = load_text_encoder(scratch.path());
  SampleEncoder encoder(text_encoder.get(), {});
  EXPECT_FALSE(encoder.encode(json::parse(R"({"text": "base model data"})")).input_ids.empty());
  EXPECT_THROW_WITH(encoder.encode(SampleEncoder::parse_sample(kConversations[0])), Error,
                    "rendered with the model's chat template", "has no chat template");
}
