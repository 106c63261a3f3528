// load_text_encoder: the Hugging Face tokenizer (spindle_tokenizer) and the model folder's chat
// templates (spindle_chat) behind the TextEncoder interface the dataset formats use.
#include "data/sample_encoder.h"
#include "data/tokenizer/tokenizer.h"

namespace spindle {

namespace {

class HfTextEncoder final : public TextEncoder {
 public:
  HfTextEncoder(Tokenizer tokenizer, const std::filesystem::path& model_dir)
      : tokenizer_(std::move(tokenizer)), chat_templates_(model_dir) {}
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override {
    return tokenizer_.encode(text, add_special_tokens);
  }
  void encode_with_offsets(std::string_view text, std::vector<int32_t>& ids,
                           std::vector<chat::ByteSpan>& offsets) const override {
    Encoding encoding = tokenizer_.encode_with_offsets(text, false);
    ids = std::move(encoding.ids);
    offsets.clear();
    offsets.reserve(encoding.offsets.size());
    for (const auto& span : encoding.offsets) offsets.push_back({span.begin, span.end});
  }
  const chat::ModelChatTemplate& chat_template(bool with_tools) const override {
    return chat_templates_.for_sample(with_tools);
  }
  std::optional<int32_t> eos_token_id() const override { return tokenizer_.eos_token_id(); }
  int64_t vocab_size() const override { return tokenizer_.vocab_size(); }

 private:
  Tokenizer tokenizer_;
  ModelChatTemplates chat_templates_;
};

}  // namespace

std::unique_ptr<TextEncoder> load_text_encoder(const std::filesystem::path& tokenizer_dir) {
  return std::make_unique<HfTextEncoder>(Tokenizer::load(tokenizer_dir.string()), tokenizer_dir);
}

}  // namespace spindle
