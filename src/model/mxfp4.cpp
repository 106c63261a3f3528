#include "model/mxfp4.h"

#include <cmath>

namespace spindle {

float mxfp4_code_value(uint8_t code) {
  static constexpr float kMagnitudes[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  const float magnitude = kMagnitudes[code & 7];
  return code & 8 ? -magnitude : magnitude;
}

std::vector<float> dequantize_mxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t rows, int64_t groups) {
  constexpr int64_t kBlockBytes = 16, kBlockValues = 32;
  std::vector<float> out(static_cast<size_t>(rows * groups * kBlockValues));
  for (int64_t b = 0; b < rows * groups; ++b) {
    const int exponent = static_cast<int>(scales[b]) - 127;
    const uint8_t* bytes = blocks + b * kBlockBytes;
    float* values = out.data() + b * kBlockValues;
    for (int64_t j = 0; j < kBlockBytes; ++j) {
      values[2 * j] = std::ldexp(mxfp4_code_value(bytes[j] & 0x0F), exponent);
      values[2 * j + 1] = std::ldexp(mxfp4_code_value(bytes[j] >> 4), exponent);
    }
  }
  return out;
}

}  // namespace spindle
