// The GPT-2 byte-to-unicode alphabet of byte-level BPE: every byte has a printable stand-in code
// point, and vocab/merges in tokenizer.json are written in those stand-ins ("Ġ" is the space byte).
#pragma once

#include <array>
#include <optional>
#include <string>
#include <string_view>

namespace spindle::tokenizer {

class ByteLevelAlphabet {
 public:
  static const ByteLevelAlphabet& get();

  char32_t code_point_of(unsigned char byte) const { return byte_to_code_point_[byte]; }
  // The raw bytes a stand-in string spells, or nullopt if it has a code point outside the alphabet.
  std::optional<std::string> decode(std::string_view mapped) const;
  std::string encode(std::string_view bytes) const;

 private:
  ByteLevelAlphabet();
  std::array<char32_t, 256> byte_to_code_point_{};
  std::array<unsigned char, 68> shifted_to_byte_{};  // stand-in U+0100+i → byte
};

}  // namespace spindle::tokenizer
