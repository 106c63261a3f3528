// Shared helpers of the chat template tests: where the template corpus and the published tokenizer
// folders are (SPINDLE_TEST_CHAT_TEMPLATES, SPINDLE_TEST_TOKENIZERS: tests/support/reference_data.h),
// the pinned clock, and one batched call of Python jinja2 (transformers' environment) for reference
// renderings.
#pragma once

#include <chrono>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/chat/chat_template.h"
#include "support/reference_data.h"

namespace spindle::chat::testing {

using spindle::test::kChatTemplateCorpus;
using spindle::test::kTokenizerFolders;
using spindle::test::missing_reference;
using spindle::test::reference_path;

inline std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

// The date strftime_now() returns in tests, on both sides of every comparison.
inline constexpr int kFixedDate[5] = {2025, 7, 10, 12, 0};

inline RenderOptions fixed_clock() {
  std::tm tm{};
  tm.tm_year = kFixedDate[0] - 1900;
  tm.tm_mon = kFixedDate[1] - 1;
  tm.tm_mday = kFixedDate[2];
  tm.tm_hour = kFixedDate[3];
  tm.tm_min = kFixedDate[4];
  tm.tm_isdst = -1;
  RenderOptions options;
  options.now = std::chrono::system_clock::from_time_t(std::mktime(&tm));
  return options;
}

struct ReferenceCase {
  std::string template_source;
  nlohmann::ordered_json context;
};

struct ReferenceResult {
  std::optional<std::string> text;  // unset when jinja2 raised
  std::string error;
};

// Renders all cases with Python jinja2 in one process. Returns nullopt (and a reason) when
// python3 or jinja2 is unavailable.
inline std::optional<std::vector<ReferenceResult>> python_reference(const std::vector<ReferenceCase>& cases,
                                                                    std::string& why_unavailable) {
  const auto hfenv = reference_path(kChatTemplateCorpus, "hfenv.py");
  if (hfenv.empty()) {
    why_unavailable = missing_reference(kChatTemplateCorpus, "hfenv.py");
    return std::nullopt;
  }
  if (std::system("python3 -c 'import jinja2' >/dev/null 2>&1") != 0) {
    why_unavailable = "python3 with jinja2 is not installed: pip install jinja2";
    return std::nullopt;
  }
  auto dir = std::filesystem::temp_directory_path() /
             ("spindle_chat_ref_" + std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::create_directories(dir);
  nlohmann::ordered_json request;
  request["now"] = kFixedDate;
  request["cases"] = nlohmann::ordered_json::array();
  for (const auto& c : cases) request["cases"].push_back({{"template", c.template_source}, {"context", c.context}});
  std::ofstream(dir / "cases.json") << request.dump();
  std::string command = "python3 '" + std::string(SPINDLE_SOURCE_DIR) + "/tests/chat/render_reference.py' '" +
                        hfenv.parent_path().string() + "' '" + (dir / "cases.json").string() + "' '" +
                        (dir / "out.json").string() + "'";
  if (std::system(command.c_str()) != 0) {
    why_unavailable = "render_reference.py failed: " + command;
    return std::nullopt;
  }
  auto out = nlohmann::json::parse(read_text(dir / "out.json"));
  std::filesystem::remove_all(dir);
  std::vector<ReferenceResult> results;
  for (const auto& r : out) {
    ReferenceResult result;
    if (r.contains("text"))
      result.text = r["text"].get<std::string>();
    else
      result.error = r["error"].get<std::string>();
    results.push_back(std::move(result));
  }
  return results;
}

}  // namespace spindle::chat::testing
