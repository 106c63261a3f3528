// Finding a model's chat template and special tokens the way transformers does, and building the
// variables apply_chat_template passes to the template.
#pragma once

#include <filesystem>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "data/chat/chat_template.h"

namespace spindle::chat {

struct ModelChatTemplate {
  ChatTemplate chat_template;
  std::string origin;                    // e.g. "tokenizer_config.json chat_template 'tool_use'"
  nlohmann::ordered_json special_tokens;  // {"bos_token": "...", "eos_token": "...", ...}, set ones only
};

// Order (transformers): chat_template.jinja; then additional_chat_templates/<name>.jinja for a
// named template; then tokenizer_config.json "chat_template" (a string, or a list of
// {"name", "template"}); then chat_template.json. A named list picks `template_name`, else
// "tool_use" when `with_tools` and present, else "default".
ModelChatTemplate load_model_chat_template(const std::filesystem::path& model_dir,
                                           const std::optional<std::string>& template_name = std::nullopt,
                                           bool with_tools = false);

// The variables apply_chat_template passes: special tokens, then the sample's keys (messages,
// tools, documents, add_generation_prompt, extra kwargs such as enable_thinking) overriding them;
// `tools` and `documents` are always defined (null when absent), add_generation_prompt defaults
// to false.
nlohmann::ordered_json transformers_context(const nlohmann::ordered_json& sample,
                                            const nlohmann::ordered_json& special_tokens);

}  // namespace spindle::chat
