#include "comm/host_reduce.h"

#include <cstdint>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace spindle::comm {

namespace {

template <typename T>
void sum_native(const char* blocks, size_t stride, int count, size_t elements, void* out_bytes) {
  T* out = static_cast<T*>(out_bytes);
  std::memmove(out, blocks, elements * sizeof(T));
  for (int j = 1; j < count; ++j) {
    const T* block = reinterpret_cast<const T*>(blocks + j * stride);
    for (size_t i = 0; i < elements; ++i) out[i] += block[i];
  }
}

template <float (*to_f32)(uint16_t), uint16_t (*from_f32)(float)>
void sum_half(const char* blocks, size_t stride, int count, size_t elements, void* out_bytes) {
  std::vector<float> accumulator(elements);
  for (int j = 0; j < count; ++j) {
    const uint16_t* block = reinterpret_cast<const uint16_t*>(blocks + j * stride);
    if (j == 0)
      for (size_t i = 0; i < elements; ++i) accumulator[i] = to_f32(block[i]);
    else
      for (size_t i = 0; i < elements; ++i) accumulator[i] += to_f32(block[i]);
  }
  uint16_t* out = static_cast<uint16_t*>(out_bytes);
  for (size_t i = 0; i < elements; ++i) out[i] = from_f32(accumulator[i]);
}

}  // namespace

void sum_blocks_in_rank_order(DType dtype, const void* blocks_void, size_t stride, int count, size_t elements,
                              void* out) {
  const char* blocks = static_cast<const char*>(blocks_void);
  switch (dtype) {
    case DType::F32: return sum_native<float>(blocks, stride, count, elements, out);
    case DType::F64: return sum_native<double>(blocks, stride, count, elements, out);
    case DType::I32: return sum_native<int32_t>(blocks, stride, count, elements, out);
    case DType::I64: return sum_native<int64_t>(blocks, stride, count, elements, out);
    case DType::BF16: return sum_half<bf16_to_f32, f32_to_bf16>(blocks, stride, count, elements, out);
    case DType::F16: return sum_half<f16_to_f32, f32_to_f16>(blocks, stride, count, elements, out);
    default:
      fail("sum reductions support F32, F64, BF16, F16, I32 and I64, not {}", dtype_name(dtype));
  }
}

}  // namespace spindle::comm
