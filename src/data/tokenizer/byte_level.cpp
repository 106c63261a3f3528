#include "data/tokenizer/byte_level.h"

#include "data/tokenizer/utf8.h"

namespace spindle::tokenizer {

const ByteLevelAlphabet& ByteLevelAlphabet::get() {
  static const ByteLevelAlphabet alphabet;
  return alphabet;
}

ByteLevelAlphabet::ByteLevelAlphabet() {
  // Printable Latin-1 bytes stand for themselves; the other 68 bytes take U+0100 upwards in byte
  // order, so that no stand-in is whitespace or a control character.
  char32_t next_shifted = 0x100;
  for (int byte = 0; byte < 256; ++byte) {
    const bool printable = (byte >= 0x21 && byte <= 0x7E) || (byte >= 0xA1 && byte <= 0xAC) || (byte >= 0xAE);
    if (printable) {
      byte_to_code_point_[byte] = static_cast<char32_t>(byte);
    } else {
      shifted_to_byte_[next_shifted - 0x100] = static_cast<unsigned char>(byte);
      byte_to_code_point_[byte] = next_shifted++;
    }
  }
}

std::optional<std::string> ByteLevelAlphabet::decode(std::string_view mapped) const {
  std::string bytes;
  bytes.reserve(mapped.size());
  size_t pos = 0;
  while (pos < mapped.size()) {
    const char32_t cp = next_code_point(mapped, pos);
    if (cp >= 0x21 && cp <= 0xFF && cp != 0xAD && (cp <= 0x7E || cp >= 0xA1)) {
      bytes.push_back(static_cast<char>(cp));
    } else if (cp >= 0x100 && cp < 0x100 + 68) {
      bytes.push_back(static_cast<char>(shifted_to_byte_[cp - 0x100]));
    } else {
      return std::nullopt;
    }
  }
  return bytes;
}

std::string ByteLevelAlphabet::encode(std::string_view bytes) const {
  std::string mapped;
  mapped.reserve(bytes.size() * 2);
  for (unsigned char byte : bytes) append_utf8(mapped, byte_to_code_point_[byte]);
  return mapped;
}

}  // namespace spindle::tokenizer
