// Element types. Storage types (bf16, f16) and compute types (f32, f64) share one enum;
// which ops accept which is the backend's business.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace spindle {

enum class DType : uint8_t { F32, F64, BF16, F16, I32, I64, U8 };

size_t dtype_size(DType t);
std::string_view dtype_name(DType t);  // safetensors spelling: "F32", "BF16", ...
bool dtype_from_name(std::string_view name, DType* out);
inline bool is_float(DType t) { return t == DType::F32 || t == DType::F64 || t == DType::BF16 || t == DType::F16; }

// bf16 / f16 <-> f32 on the host (round to nearest even, NaN kept NaN).
float bf16_to_f32(uint16_t v);
uint16_t f32_to_bf16(float v);
float f16_to_f32(uint16_t v);
uint16_t f32_to_f16(float v);

}  // namespace spindle
