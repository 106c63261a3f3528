#include "io/load_tensor.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace spindle::io {

namespace {

// File data may be unaligned inside the mapping, so every element is read with memcpy.
template <DType T>
constexpr size_t sizeof_dtype() {
  return T == DType::F64 ? 8 : T == DType::F32 ? 4 : 2;
}

template <typename T>
T read_unaligned(const char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

template <DType T>
double read_element(const char* p) {
  if constexpr (T == DType::F32) return read_unaligned<float>(p);
  else if constexpr (T == DType::F64) return read_unaligned<double>(p);
  else if constexpr (T == DType::BF16) return bf16_to_f32(read_unaligned<uint16_t>(p));
  else return f16_to_f32(read_unaligned<uint16_t>(p));
}

template <DType T>
void write_element(char* p, double v) {
  if constexpr (T == DType::F32) {
    float f = static_cast<float>(v);
    std::memcpy(p, &f, 4);
  } else if constexpr (T == DType::F64) {
    std::memcpy(p, &v, 8);
  } else {
    // Through f32: exact for values that came from bf16/f16/f32, which is every case in practice.
    uint16_t h = T == DType::BF16 ? f32_to_bf16(static_cast<float>(v)) : f32_to_f16(static_cast<float>(v));
    std::memcpy(p, &h, 2);
  }
}

template <DType S, DType T>
void convert(const char* src, char* dst, size_t count) {
  for (size_t i = 0; i < count; ++i)
    write_element<T>(dst + i * sizeof_dtype<T>(), read_element<S>(src + i * sizeof_dtype<S>()));
}

template <DType S>
void convert_from(const char* src, char* dst, DType target, size_t count) {
  switch (target) {
    case DType::F32: return convert<S, DType::F32>(src, dst, count);
    case DType::F64: return convert<S, DType::F64>(src, dst, count);
    case DType::BF16: return convert<S, DType::BF16>(src, dst, count);
    case DType::F16: return convert<S, DType::F16>(src, dst, count);
    default: SPINDLE_CHECK(false, "conversion to {}", dtype_name(target));
  }
}

// One switch per chunk, not per element: a 7B checkpoint is billions of elements.
void convert_floats(const char* src, DType source, char* dst, DType target, size_t count) {
  switch (source) {
    case DType::F32: return convert_from<DType::F32>(src, dst, target, count);
    case DType::F64: return convert_from<DType::F64>(src, dst, target, count);
    case DType::BF16: return convert_from<DType::BF16>(src, dst, target, count);
    case DType::F16: return convert_from<DType::F16>(src, dst, target, count);
    default: SPINDLE_CHECK(false, "conversion from {}", dtype_name(source));
  }
}

// Host memory used for conversion stays bounded whatever the tensor's size.
constexpr size_t kChunkElements = size_t{4} << 20;

}  // namespace

Tensor load_tensor(Backend& backend, const TensorRecord& rec, DType target) {
  Tensor t = backend.empty(rec.shape, target);
  load_tensor_into(backend, rec, t);
  return t;
}

void load_tensor_into(Backend& backend, const TensorRecord& rec, Tensor& destination) {
  if (destination.numel() != rec.shape.numel())
    fail("tensor '{}' in {} has shape {} ({} elements) but is being loaded into {}; the model's config.json does "
         "not match these weights", rec.name, rec.file, rec.shape.str(), rec.shape.numel(), destination.describe());
  const DType source = rec.dtype, target = destination.dtype();
  SPINDLE_CHECK(rec.bytes == static_cast<size_t>(rec.shape.numel()) * dtype_size(source), "record '{}' size",
                rec.name);
  Stream stream = backend.default_stream();
  if (source == target) {
    backend.copy_from_host(stream, rec.data, destination);
    backend.synchronize(stream);  // the caller may unmap the file as soon as we return
    return;
  }
  if (!is_float(source) || !is_float(target))
    fail("tensor '{}' in {} is {} and cannot be loaded as {}; only float dtypes (F32, F64, BF16, F16) convert "
         "into each other", rec.name, rec.file, rec.stored_dtype, dtype_name(target));

  const size_t total = static_cast<size_t>(rec.shape.numel());
  const size_t source_size = dtype_size(source), target_size = dtype_size(target);
  std::vector<char> converted(std::min(total, kChunkElements) * target_size);
  Tensor flat = destination.reshape(Shape{static_cast<int64_t>(total)});
  const char* src = static_cast<const char*>(rec.data);
  for (size_t begin = 0; begin < total; begin += kChunkElements) {
    const size_t count = std::min(kChunkElements, total - begin);
    convert_floats(src + begin * source_size, source, converted.data(), target, count);
    Tensor chunk = flat.flat(static_cast<int64_t>(begin), static_cast<int64_t>(count));
    backend.copy_from_host(stream, converted.data(), chunk);
    backend.synchronize(stream);  // `converted` is refilled next round
  }
}

}  // namespace spindle::io
