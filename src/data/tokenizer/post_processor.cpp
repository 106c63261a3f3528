#include "data/tokenizer/post_processor.h"

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace spindle::tokenizer {

PostProcessor PostProcessor::from_json(const nlohmann::json& config) {
  PostProcessor processor;
  processor.add_from_json(config);
  return processor;
}

void PostProcessor::add_from_json(const nlohmann::json& config) {
  if (config.is_null()) return;
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string())
    fail("tokenizer.json: a post_processor must be an object with a string \"type\"");
  const std::string type = config["type"].get<std::string>();
  if (type == "Sequence") {
    if (!config.contains("processors") || !config["processors"].is_array())
      fail("tokenizer.json: a Sequence post_processor needs a \"processors\" array");
    for (const auto& inner : config["processors"]) add_from_json(inner);
  } else if (type == "ByteLevel") {
    if (config.value("trim_offsets", true))
      {
      Step step;
      step.kind = Step::Kind::kTrimOffsets;
      step.add_prefix_space = config.value("add_prefix_space", true);
      steps_.push_back(std::move(step));
    }
  } else if (type == "TemplateProcessing") {
    if (!config.contains("single") || !config["single"].is_array())
      fail("tokenizer.json: TemplateProcessing needs a \"single\" template array");
    const auto& specials = config.contains("special_tokens") ? config["special_tokens"] : nlohmann::json::object();
    Step step;
    step.kind = Step::Kind::kTemplate;
    bool after_sequence = false;
    for (const auto& item : config["single"]) {
      if (item.contains("Sequence")) {
        const std::string which = item["Sequence"].value("id", std::string("A"));
        if (which != "A")
          fail("tokenizer.json: TemplateProcessing single template uses sequence '{}'; a single template can only "
               "use 'A'",
               which);
        if (after_sequence) fail("tokenizer.json: TemplateProcessing single template uses sequence 'A' twice");
        after_sequence = true;
      } else if (item.contains("SpecialToken")) {
        const std::string name = item["SpecialToken"].value("id", std::string());
        if (!specials.contains(name) || !specials[name].contains("ids") || !specials[name]["ids"].is_array())
          fail("tokenizer.json: TemplateProcessing uses special token '{}' but special_tokens has no ids for it", name);
        auto& target = after_sequence ? step.suffix : step.prefix;
        for (const auto& id : specials[name]["ids"]) target.push_back(id.get<int32_t>());
      } else {
        fail("tokenizer.json: TemplateProcessing item {} is neither a Sequence nor a SpecialToken", item.dump());
      }
    }
    steps_.push_back(std::move(step));
  } else {
    fail("tokenizer.json: post_processor type '{}' is not supported (spindle supports TemplateProcessing, ByteLevel "
         "and Sequence)",
         type);
  }
}

void PostProcessor::process(std::vector<int32_t>& ids, std::vector<ByteSpan>* offsets, bool add_special_tokens,
                            const std::function<std::string_view(int32_t)>& token_bytes) const {
  for (const Step& step : steps_) {
    if (step.kind == Step::Kind::kTemplate) {
      if (!add_special_tokens) continue;
      ids.insert(ids.begin(), step.prefix.begin(), step.prefix.end());
      ids.insert(ids.end(), step.suffix.begin(), step.suffix.end());
      if (offsets) {
        offsets->insert(offsets->begin(), step.prefix.size(), ByteSpan{0, 0});
        offsets->insert(offsets->end(), step.suffix.size(), ByteSpan{0, 0});
      }
      continue;
    }
    if (!offsets) continue;
    // ByteLevel(trim_offsets): offsets leave out the spaces a token starts or ends with.
    for (size_t i = 0; i < ids.size(); ++i) {
      const std::string_view bytes = token_bytes(ids[i]);
      size_t leading = 0, trailing = 0;
      while (leading < bytes.size() && bytes[leading] == ' ') ++leading;
      while (trailing < bytes.size() - leading && bytes[bytes.size() - 1 - trailing] == ' ') ++trailing;
      ByteSpan& span = (*offsets)[i];
      const bool first = i == 0 || span.begin == 0;
      if (first && step.add_prefix_space && leading == 1) leading = 0;
      if (leading > 0) span.begin = std::min(span.begin + leading, span.end);
      if (trailing > 0 && span.end >= trailing) span.end = std::max(span.end - trailing, span.begin);
    }
  }
}

std::vector<int32_t> PostProcessor::added_prefix() const {
  std::vector<int32_t> ids;
  for (const Step& step : steps_) ids.insert(ids.begin(), step.prefix.begin(), step.prefix.end());
  return ids;
}

std::vector<int32_t> PostProcessor::added_suffix() const {
  std::vector<int32_t> ids;
  for (const Step& step : steps_) ids.insert(ids.end(), step.suffix.begin(), step.suffix.end());
  return ids;
}

}  // namespace spindle::tokenizer
