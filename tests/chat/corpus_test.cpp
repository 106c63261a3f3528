// The 196-template corpus: every template parses, the 53 expected renderings match, and every
// template renders byte-identically to Python jinja2 (transformers' environment) on a shared set
// of conversations.
#include <gtest/gtest.h>

#include <algorithm>

#include "chat_test_support.h"
#include "data/chat/chat_template.h"
#include "data/chat/model_folder.h"

namespace spindle::chat {
namespace {

using nlohmann::ordered_json;
std::vector<std::filesystem::path> corpus_templates() {
  std::vector<std::filesystem::path> paths;
  const auto dir = testing::reference_path(testing::kChatTemplateCorpus, "templates");
  if (dir.empty()) return paths;
  for (const auto& entry : std::filesystem::directory_iterator(dir))
    if (entry.path().extension() == ".jinja") paths.push_back(entry.path());
  std::sort(paths.begin(), paths.end());
  return paths;
}

TEST(ChatCorpus, EveryTemplateParses) {
  auto paths = corpus_templates();
  if (paths.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(testing::missing_reference(testing::kChatTemplateCorpus, "templates"));
  EXPECT_EQ(paths.size(), 196u);
  std::vector<std::string> failures;
  for (const auto& path : paths) {
    try {
      ChatTemplate::parse(testing::read_text(path));
    } catch (const std::exception& e) {
      failures.push_back(path.filename().string() + ": " + e.what());
    }
  }
  for (const auto& f : failures) ADD_FAILURE() << f;
}

// Cases whose expected output in e2e_with_expected.json came from @huggingface/jinja and differs
// from Python jinja2: there the Python rendering is the truth.
bool javascript_target_differs_from_python(const std::string& name) {
  return name == "MadeAgents/Hammer2.1";  // JS prints a list of dicts as JSON, Python as repr
}

TEST(ChatCorpus, ExpectedRenderingsMatch) {
  const auto path = testing::reference_path(testing::kChatTemplateCorpus, "e2e_with_expected.json");
  if (path.empty())
    SPINDLE_SKIP_WITHOUT_REFERENCE(testing::missing_reference(testing::kChatTemplateCorpus, "e2e_with_expected.json"));
  auto cases = ordered_json::parse(testing::read_text(path));
  ASSERT_EQ(cases.size(), 53u);
  std::vector<testing::ReferenceCase> divergent;
  std::vector<std::string> divergent_outputs;
  int compared = 0;
  for (const auto& c : cases) {
    std::string name = c["name"];
    auto t = ChatTemplate::parse(c["chat_template"].get<std::string>());
    std::string output;
    try {
      output = t.render(c["data"], testing::fixed_clock());
    } catch (const std::exception& e) {
      ADD_FAILURE() << name << " raised: " << e.what();
      continue;
    }
    if (javascript_target_differs_from_python(name)) {
      divergent.push_back({c["chat_template"], c["data"]});
      divergent_outputs.push_back(output);
      EXPECT_NE(output, c["target"].get<std::string>()) << name << " no longer differs from the JS target";
      continue;
    }
    EXPECT_EQ(output, c["target"].get<std::string>()) << name;
    ++compared;
  }
  EXPECT_EQ(compared, 52);
  std::string why;
  auto reference = testing::python_reference(divergent, why);
  if (!reference) SPINDLE_SKIP_WITHOUT_REFERENCE("Python reference unavailable for the JS-divergent case: " + why);
  for (size_t i = 0; i < divergent.size(); ++i) {
    ASSERT_TRUE((*reference)[i].text) << (*reference)[i].error;
    EXPECT_EQ(divergent_outputs[i], *(*reference)[i].text);
  }
}

ordered_json weather_tool() {
  return ordered_json::parse(R"({"type": "function", "function": {"name": "get_current_weather",
    "description": "Get the current weather in a given location.",
    "parameters": {"type": "object", "properties": {
      "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
      "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
      "days": {"type": "integer", "description": "Forecast days", "default": 1}},
      "required": ["location"]}}})");
}

// The shared conversations every template is rendered with (both sides).
std::vector<std::pair<std::string, ordered_json>> conversations() {
  std::vector<std::pair<std::string, ordered_json>> out;
  auto add = [&](std::string name, const char* messages_json, bool tools, bool generation_prompt,
                 ordered_json extra = ordered_json::object()) {
    ordered_json sample;
    sample["messages"] = ordered_json::parse(messages_json);
    if (tools) sample["tools"] = ordered_json::array({weather_tool()});
    sample["add_generation_prompt"] = generation_prompt;
    for (const auto& [k, v] : extra.items()) sample[k] = v;
    ordered_json tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}, {"unk_token", "<unk>"}, {"pad_token", "<pad>"}};
    out.emplace_back(std::move(name), transformers_context(sample, tokens));
  };
  const char* single = R"([{"role": "user", "content": "Hello! How are you?"}])";
  const char* multi = R"([
    {"role": "system", "content": "You are a helpful assistant. Answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "  2 + 2 = 4.\n"},
    {"role": "user", "content": "Und auf Deutsch? Straße — “quotes” 😀 'single' \"double\""},
    {"role": "assistant", "content": "Zwei plus zwei ist vier."}])";
  const char* no_system = R"([
    {"role": "user", "content": "Hi"},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Tell me a joke."}])";
  const char* tool_calls = R"([
    {"role": "system", "content": "You can call tools."},
    {"role": "user", "content": "What's the weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [{"id": "call12345", "type": "function",
      "function": {"name": "get_current_weather", "arguments": {"location": "Paris, France", "unit": "celsius"}}}]},
    {"role": "tool", "tool_call_id": "call12345", "name": "get_current_weather", "content": "{\"temperature\": 22.5, \"unit\": \"celsius\"}"},
    {"role": "assistant", "content": "It is 22.5 °C in Paris."}])";
  const char* thinking = R"([
    {"role": "user", "content": "Is 17 prime?"},
    {"role": "assistant", "content": "<think>\nCheck divisors up to 4.\n</think>\n\nYes, 17 is prime."},
    {"role": "user", "content": "And 21?"},
    {"role": "assistant", "content": "<think>\n21 = 3 * 7.\n</think>\n\nNo, 21 = 3 × 7."}])";
  add("single_user_prompt", single, false, true);
  add("single_user", single, false, false);
  add("multi_turn", multi, false, false);
  add("multi_turn_prompt", R"([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}])", false, true);
  add("no_system_prompt", no_system, false, true);
  add("tools_prompt", R"([{"role": "user", "content": "What's the weather in Paris?"}])", true, true);
  add("tool_calls", tool_calls, true, false);
  add("tool_calls_prompt", tool_calls, true, true);
  add("thinking", thinking, false, false);
  add("thinking_disabled_prompt", single, false, true, {{"enable_thinking", false}});
  return out;
}

TEST(ChatCorpus, EveryTemplateMatchesPythonJinja) {
  auto paths = corpus_templates();
  if (paths.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(testing::missing_reference(testing::kChatTemplateCorpus, "templates"));
  auto convs = conversations();
  std::vector<testing::ReferenceCase> cases;
  for (const auto& path : paths) {
    std::string source = testing::read_text(path);
    for (const auto& [name, context] : convs) cases.push_back({source, context});
  }
  std::string why;
  auto reference = testing::python_reference(cases, why);
  if (!reference) SPINDLE_SKIP_WITHOUT_REFERENCE(why);
  ASSERT_EQ(reference->size(), cases.size());
  size_t index = 0, identical = 0, both_raise = 0, mismatches = 0;
  for (const auto& path : paths) {
    auto t = ChatTemplate::parse(testing::read_text(path));
    for (const auto& [name, context] : convs) {
      const auto& expected = (*reference)[index++];
      std::optional<std::string> output;
      std::string error;
      try {
        output = t.render(context, testing::fixed_clock());
      } catch (const std::exception& e) {
        error = e.what();
      }
      std::string where = path.filename().string() + " / " + name;
      if (expected.text && output && *expected.text == *output) {
        ++identical;
      } else if (!expected.text && !output) {
        ++both_raise;
      } else {
        ++mismatches;
        if (expected.text && output)
          ADD_FAILURE() << where << ": rendering differs\n--- jinja2:\n" << *expected.text << "\n--- spindle:\n" << *output;
        else if (expected.text)
          ADD_FAILURE() << where << ": spindle raised but jinja2 rendered: " << error;
        else
          ADD_FAILURE() << where << ": jinja2 raised (" << expected.error << ") but spindle rendered";
      }
    }
  }
  std::cout << "[ corpus ] " << paths.size() << " templates x " << convs.size() << " conversations: " << identical
            << " byte-identical, " << both_raise << " raise in both, " << mismatches << " mismatches\n";
}

}  // namespace
}  // namespace spindle::chat
