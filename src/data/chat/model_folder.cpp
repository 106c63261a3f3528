#include "data/chat/model_folder.h"

#include <fstream>
#include <sstream>

namespace spindle::chat {
namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read {}", path.string());
  std::stringstream buffer;
  buffer << in.rdbuf();
  return buffer.str();
}

nlohmann::ordered_json read_json(const std::filesystem::path& path) {
  try {
    return nlohmann::ordered_json::parse(read_file(path));
  } catch (const nlohmann::json::exception& e) {
    fail("{} is not valid JSON: {}", path.string(), e.what());
  }
}

ChatTemplate parse_with_origin(const std::string& source, const std::string& origin) {
  try {
    return ChatTemplate::parse(source);
  } catch (const TemplateError& e) {
    throw TemplateError(e.line(), e.reason() + " (in " + origin + ")");
  }
}

}  // namespace

ModelChatTemplate load_model_chat_template(const std::filesystem::path& dir, const std::optional<std::string>& name,
                                           bool with_tools) {
  ModelChatTemplate result;
  auto config_path = dir / "tokenizer_config.json";
  nlohmann::ordered_json config = std::filesystem::exists(config_path) ? read_json(config_path) : nlohmann::ordered_json::object();

  // Special tokens: tokenizer_config.json, else special_tokens_map.json; AddedToken objects carry
  // the text in "content"; unset (null) tokens are not passed, so templates see them undefined.
  nlohmann::ordered_json token_source = config;
  auto map_path = dir / "special_tokens_map.json";
  if (std::filesystem::exists(map_path)) {
    nlohmann::ordered_json map = read_json(map_path);
    for (const auto& [k, v] : map.items())
      if (!token_source.contains(k) || token_source[k].is_null()) token_source[k] = v;
  }
  result.special_tokens = nlohmann::ordered_json::object();
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"}) {
    if (!token_source.contains(key)) continue;
    const auto& t = token_source[key];
    if (t.is_string())
      result.special_tokens[key] = t;
    else if (t.is_object() && t.contains("content") && t["content"].is_string())
      result.special_tokens[key] = t["content"];
  }

  auto jinja_path = dir / "chat_template.jinja";
  if (!name && std::filesystem::exists(jinja_path)) {
    result.chat_template = parse_with_origin(read_file(jinja_path), jinja_path.string());
    result.origin = jinja_path.string();
    return result;
  }
  std::string wanted = name ? *name : "";
  if (!wanted.empty()) {
    auto named = dir / "additional_chat_templates" / (wanted + ".jinja");
    if (std::filesystem::exists(named)) {
      result.chat_template = parse_with_origin(read_file(named), named.string());
      result.origin = named.string();
      return result;
    }
  }
  nlohmann::ordered_json field;
  std::string field_origin;
  if (config.contains("chat_template") && !config["chat_template"].is_null()) {
    field = config["chat_template"];
    field_origin = config_path.string();
  } else if (std::filesystem::exists(dir / "chat_template.json")) {
    auto legacy = read_json(dir / "chat_template.json");
    if (legacy.contains("chat_template")) field = legacy["chat_template"];
    field_origin = (dir / "chat_template.json").string();
  }
  if (field.is_null()) {
    if (std::filesystem::exists(jinja_path) && name)
      fail("{} has no chat template named '{}' (only chat_template.jinja)", dir.string(), *name);
    fail("{} has no chat template: expected chat_template.jinja, or \"chat_template\" in tokenizer_config.json or "
         "chat_template.json; pass a folder of a chat (instruct) model or set the template explicitly",
         dir.string());
  }
  if (field.is_string()) {
    if (name && *name != "default")
      fail("{} has a single chat template, not one named '{}'", field_origin, *name);
    result.chat_template = parse_with_origin(field.get<std::string>(), field_origin + " chat_template");
    result.origin = field_origin + " chat_template";
    return result;
  }
  if (!field.is_array()) fail("{}: \"chat_template\" must be a string or a list of {{name, template}}", field_origin);
  std::vector<std::string> names;
  for (const auto& entry : field)
    if (entry.is_object() && entry.contains("name") && entry["name"].is_string()) names.push_back(entry["name"]);
  if (wanted.empty()) {
    bool has_tool_use = std::find(names.begin(), names.end(), "tool_use") != names.end();
    wanted = with_tools && has_tool_use ? "tool_use" : "default";
  }
  for (const auto& entry : field) {
    if (entry.value("name", "") == wanted && entry.contains("template") && entry["template"].is_string()) {
      std::string origin = field_origin + " chat_template '" + wanted + "'";
      result.chat_template = parse_with_origin(entry["template"].get<std::string>(), origin);
      result.origin = origin;
      return result;
    }
  }
  std::string available;
  for (const auto& n : names) available += (available.empty() ? "" : ", ") + n;
  fail("{} has no chat template named '{}' (available: {}); choose one of those names", field_origin, wanted, available);
}

nlohmann::ordered_json transformers_context(const nlohmann::ordered_json& sample,
                                            const nlohmann::ordered_json& special_tokens) {
  if (!sample.is_object()) fail("a chat sample must be a JSON object with \"messages\"");
  nlohmann::ordered_json context = special_tokens.is_object() ? special_tokens : nlohmann::ordered_json::object();
  for (const auto& [k, v] : sample.items()) context[k] = v;
  if (!context.contains("tools")) context["tools"] = nullptr;
  if (!context.contains("documents")) context["documents"] = nullptr;
  if (!context.contains("add_generation_prompt")) context["add_generation_prompt"] = false;
  return context;
}

}  // namespace spindle::chat
