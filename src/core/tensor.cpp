#include "core/tensor.h"

#include "core/error.h"

namespace spindle {

std::string Device::str() const {
  return kind == DeviceKind::CPU ? std::string("cpu") : fmt::format("cuda:{}", index);
}

Shape::Shape(std::initializer_list<int64_t> dims) {
  for (int64_t d : dims) push(d);
}

void Shape::push(int64_t d) {
  SPINDLE_CHECK(rank_ < kMaxDims, "tensor rank above {}", kMaxDims);
  SPINDLE_CHECK(d >= 0, "negative dimension {}", d);
  dims_[rank_++] = d;
}

int64_t Shape::numel() const {
  int64_t n = 1;
  for (int i = 0; i < rank_; ++i) n *= dims_[i];
  return n;
}

bool Shape::operator==(const Shape& o) const {
  if (rank_ != o.rank_) return false;
  for (int i = 0; i < rank_; ++i)
    if (dims_[i] != o.dims_[i]) return false;
  return true;
}

std::string Shape::str() const {
  std::string s = "[";
  for (int i = 0; i < rank_; ++i) s += (i ? ", " : "") + std::to_string(dims_[i]);
  return s + "]";
}

Tensor::Tensor(std::shared_ptr<Storage> storage, size_t offset_bytes, Shape shape, DType dtype)
    : storage_(std::move(storage)), offset_(offset_bytes), shape_(shape), dtype_(dtype) {
  SPINDLE_CHECK(!storage_ || offset_ + bytes() <= storage_->bytes, "view {} past its storage", shape_.str());
}

Tensor Tensor::reshape(Shape shape) const {
  SPINDLE_CHECK(shape.numel() == numel(), "reshape {} -> {}", shape_.str(), shape.str());
  return Tensor(storage_, offset_, shape, dtype_);
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  SPINDLE_CHECK(rank() >= 1 && 0 <= begin && begin <= end && end <= dim(0), "rows [{}, {}) of {}", begin, end,
                shape_.str());
  Shape s;
  s.push(end - begin);
  for (int i = 1; i < rank(); ++i) s.push(dim(i));
  int64_t row_elems = dim(0) ? numel() / dim(0) : 0;
  return Tensor(storage_, offset_ + static_cast<size_t>(begin * row_elems) * dtype_size(dtype_), s, dtype_);
}

Tensor Tensor::flat(int64_t begin, int64_t count) const {
  SPINDLE_CHECK(0 <= begin && begin + count <= numel(), "flat [{}, +{}) of {}", begin, count, shape_.str());
  return Tensor(storage_, offset_ + static_cast<size_t>(begin) * dtype_size(dtype_), Shape{count}, dtype_);
}

Tensor Tensor::view_bytes_as(DType dtype, Shape shape) const {
  SPINDLE_CHECK(static_cast<size_t>(shape.numel()) * dtype_size(dtype) == bytes(), "view {} as {}{}", describe(),
                dtype_name(dtype), shape.str());
  SPINDLE_CHECK((reinterpret_cast<uintptr_t>(data()) % dtype_size(dtype)) == 0, "view {} as {}: misaligned",
                describe(), dtype_name(dtype));
  return Tensor(storage_, offset_, shape, dtype);
}

std::string Tensor::describe() const {
  return fmt::format("{}{} on {}", dtype_name(dtype_), shape_.str(), device().str());
}

}  // namespace spindle
