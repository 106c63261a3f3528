// Tensors: a typed, row-major, contiguous view into device memory owned by a Storage.
// Model code passes tensors to backend ops and never dereferences their data on the host; only
// backends (and tests, through explicit copies) touch elements.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

#include "core/dtype.h"

namespace spindle {

enum class DeviceKind : uint8_t { CPU, CUDA };

struct Device {
  DeviceKind kind = DeviceKind::CPU;
  int index = 0;
  bool operator==(const Device&) const = default;
  std::string str() const;
};

class Shape {
 public:
  static constexpr int kMaxDims = 6;
  Shape() = default;
  Shape(std::initializer_list<int64_t> dims);
  template <typename It>
  Shape(It begin, It end) {
    for (; begin != end; ++begin) push(static_cast<int64_t>(*begin));
  }
  int rank() const { return rank_; }
  int64_t operator[](int i) const { return dims_[i < 0 ? i + rank_ : i]; }
  int64_t numel() const;
  void push(int64_t d);
  bool operator==(const Shape& o) const;
  std::string str() const;  // "[4, 128]"

 private:
  std::array<int64_t, kMaxDims> dims_{};
  int rank_ = 0;
};

// A block of memory on one device. Freed by the deleter the allocating backend installed.
struct Storage {
  void* data = nullptr;
  size_t bytes = 0;
  Device device;
  void (*release)(void* data, void* context) = nullptr;
  void* release_context = nullptr;
  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (release) release(data, release_context);
  }
};

class Tensor {
 public:
  Tensor() = default;
  Tensor(std::shared_ptr<Storage> storage, size_t offset_bytes, Shape shape, DType dtype);

  bool defined() const { return storage_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int64_t dim(int i) const { return shape_[i]; }
  int rank() const { return shape_.rank(); }
  int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }
  Device device() const { return storage_ ? storage_->device : Device{}; }

  // Raw device pointer. Backends only.
  void* data() const { return static_cast<char*>(storage_->data) + offset_; }
  // The memory block this tensor views (its allocating backend's record). Backends only.
  Storage* storage() const { return storage_.get(); }
  template <typename T>
  T* data_as() const { return static_cast<T*>(data()); }

  // Same memory, another shape with the same element count.
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) along dimension 0; stays contiguous.
  Tensor rows(int64_t begin, int64_t end) const;
  // Flat elements [begin, begin+count) as a 1-D tensor.
  Tensor flat(int64_t begin, int64_t count) const;
  // The same bytes read as another dtype and shape (equal byte counts; the start aligned for the
  // dtype): for data that travels as bytes, e.g. a 4-bit weight's absmax through FSDP.
  Tensor view_bytes_as(DType dtype, Shape shape) const;

  std::string describe() const;  // "BF16[4, 128] on cuda:0"

 private:
  std::shared_ptr<Storage> storage_;
  size_t offset_ = 0;
  Shape shape_;
  DType dtype_ = DType::F32;
};

}  // namespace spindle
