// A TextEncoder for data tests whose ids can be read at a glance: one token per byte (id = byte +
// 10), BOS 1 when asked to add special tokens (if `adds_bos`), EOS 2, and a minimal ChatML chat
// template whose assistant turns are supervised from the content through "<|im_end|>\n".
#pragma once

#include "data/chat/chat_template.h"
#include "data/sample_encoder.h"

namespace spindle::testing {

inline constexpr const char* kByteChatTemplate =
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

inline int32_t byte_token(char c) { return static_cast<unsigned char>(c) + 10; }

class ByteTextEncoder : public TextEncoder {
 public:
  explicit ByteTextEncoder(bool adds_bos = true) : adds_bos_(adds_bos) {
    chat_.chat_template = chat::ChatTemplate::parse(kByteChatTemplate);
    chat_.origin = "byte test template";
  }
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens) const override {
    std::vector<int32_t> ids;
    if (add_special_tokens && adds_bos_) ids.push_back(1);
    for (char c : text) ids.push_back(byte_token(c));
    return ids;
  }
  void encode_with_offsets(std::string_view text, std::vector<int32_t>& ids,
                           std::vector<chat::ByteSpan>& offsets) const override {
    ids = encode(text, false);
    offsets.clear();
    for (size_t i = 0; i < text.size(); ++i) offsets.push_back({i, i + 1});
  }
  const chat::ModelChatTemplate& chat_template(bool) const override { return chat_; }
  std::optional<int32_t> eos_token_id() const override { return 2; }
  int64_t vocab_size() const override { return 266; }

 private:
  bool adds_bos_;
  chat::ModelChatTemplate chat_;
};

}  // namespace spindle::testing
