// load_text_encoder: the Hugging Face tokenizer (spindle_tokenizer) behind the TextEncoder
// interface the dataset formats use.
#include "data/sample_encoder.h"
#include "data/tokenizer/tokenizer.h"

namespace spindle {

namespace {

class HfTextEncoder final : public TextEncoder {
 public:
  explicit HfTextEncoder(Tokenizer tokenizer) : tokenizer_(std::move(tokenizer)) {}
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override {
    return tokenizer_.encode(text, add_special_tokens);
  }
  std::optional<int32_t> eos_token_id() const override { return tokenizer_.eos_token_id(); }
  int64_t vocab_size() const override { return tokenizer_.vocab_size(); }

 private:
  Tokenizer tokenizer_;
};

}  // namespace

std::unique_ptr<TextEncoder> load_text_encoder(const std::filesystem::path& tokenizer_dir) {
  return std::make_unique<HfTextEncoder>(Tokenizer::load(tokenizer_dir.string()));
}

}  // namespace spindle
