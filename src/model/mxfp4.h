// MXFP4, the format gpt-oss's released checkpoints store their experts in (transformers'
// integrations/mxfp4.py, _convert_moe_packed_tensors): each row of a weight is cut into blocks of
// 32 consecutive input-dim values; a block is 16 bytes of 4-bit E2M1 codes (byte j: element 2j in
// its low nibble, 2j + 1 in its high one) and one U8 scale s, every element being
// value(code)·2^(s − 127). spindle trains such experts dense: they are dequantised once, at load.
#pragma once

#include <cstdint>
#include <vector>

namespace spindle {

// The E2M1 value of a 4-bit code: 0, 0.5, 1, 1.5, 2, 3, 4, 6 for codes 0–7, their negatives for 8–15.
float mxfp4_code_value(uint8_t code);

// blocks U8 [R, G, 16] and scales U8 [R, G] (R rows of G·32 values) -> F32 [R, G·32], each value
// exact (an E2M1 value times a power of two, as torch.ldexp gives it in BF16).
std::vector<float> dequantize_mxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t rows, int64_t groups);

}  // namespace spindle
