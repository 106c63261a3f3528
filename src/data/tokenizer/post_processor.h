// Post-processors of tokenizer.json: TemplateProcessing (the BOS of Llama 3), ByteLevel (offset
// trimming only; ids untouched) and Sequence.
#pragma once

#include <cstdint>
#include <functional>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace spindle::tokenizer {

struct ByteSpan {
  size_t begin;
  size_t end;
  bool operator==(const ByteSpan&) const = default;
};

class PostProcessor {
 public:
  // From the "post_processor" entry of tokenizer.json (null means none).
  static PostProcessor from_json(const nlohmann::json& config);

  // Applies the steps to one encoded sequence. `token_bytes` gives what a token id stands for
  // (used to trim whitespace from offsets); offsets may be null when the caller does not want them.
  void process(std::vector<int32_t>& ids, std::vector<ByteSpan>* offsets, bool add_special_tokens,
               const std::function<std::string_view(int32_t)>& token_bytes) const;

  // Ids the post-processor adds around a sequence when add_special_tokens is true.
  std::vector<int32_t> added_prefix() const;
  std::vector<int32_t> added_suffix() const;

 private:
  struct Step {
    enum class Kind { kTemplate, kTrimOffsets } kind = Kind::kTemplate;
    std::vector<int32_t> prefix, suffix;  // kTemplate: ids before and after the sequence
    bool add_prefix_space = false;        // kTrimOffsets: keep one leading space of the first token
  };
  void add_from_json(const nlohmann::json& config);
  std::vector<Step> steps_;
};

}  // namespace spindle::tokenizer
