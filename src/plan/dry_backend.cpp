#include "plan/dry_backend.h"

#include <algorithm>
#include <cstring>

namespace spindle::plan {

struct DryBackend::Allocation {
  std::shared_ptr<DryBackend*> backend;  // null inside once the backend is gone
  int64_t bytes = 0;
  std::string phase;
  bool host = false;  // from empty_host
};

DryBackend::DryBackend(Device modelled, int64_t alignment)
    : device_(modelled), alignment_(alignment > 0 ? alignment : 1), self_(std::make_shared<DryBackend*>(this)) {}

DryBackend::~DryBackend() { *self_ = nullptr; }

void DryBackend::set_phase(const std::string& phase) { phase_ = phase; }

Tensor DryBackend::empty(Shape shape, DType dtype) {
  const int64_t bytes = shape.numel() * static_cast<int64_t>(dtype_size(dtype));
  auto* a = new Allocation{self_, (bytes + alignment_ - 1) / alignment_ * alignment_, phase_};
  live_ += a->bytes;
  live_by_phase_[a->phase] += a->bytes;
  if (live_ > peak_) {
    peak_ = live_;
    peak_by_phase_ = live_by_phase_;
    peak_phase_ = phase_;
  }
  auto storage = std::make_shared<Storage>();
  storage->bytes = static_cast<size_t>(bytes);
  storage->device = device_;
  storage->release = &DryBackend::release;
  storage->release_context = a;
  return Tensor(std::move(storage), 0, shape, dtype);
}

Tensor DryBackend::empty_host(Shape shape, DType dtype) {
  const int64_t bytes = shape.numel() * static_cast<int64_t>(dtype_size(dtype));
  // Host allocations pad as the CPU backend's do (64 bytes); pinned pages on CUDA are not modelled.
  auto* a = new Allocation{self_, std::max<int64_t>(64, (bytes + 63) / 64 * 64), phase_, true};
  host_live_ += a->bytes;
  host_peak_ = std::max(host_peak_, host_live_);
  auto storage = std::make_shared<Storage>();
  storage->bytes = static_cast<size_t>(bytes);
  storage->device = Device{DeviceKind::CPU, 0};
  storage->release = &DryBackend::release;
  storage->release_context = a;
  return Tensor(std::move(storage), 0, shape, dtype);
}

void DryBackend::release(void*, void* context) {
  auto* a = static_cast<Allocation*>(context);
  if (DryBackend* b = *a->backend) b->on_release(*a);
  delete a;
}

void DryBackend::on_release(const Allocation& a) {
  if (a.host) {
    host_live_ -= a.bytes;
    return;
  }
  live_ -= a.bytes;
  live_by_phase_[a.phase] -= a.bytes;
}

void DryBackend::copy_to_host(Stream, const Tensor& src, void* dst) { std::memset(dst, 0, src.bytes()); }

MemoryStats DryBackend::memory_stats() {
  MemoryStats m;
  m.allocated_bytes = m.reserved_bytes = live_;
  m.peak_allocated_bytes = m.peak_reserved_bytes = peak_;
  m.host_allocated_bytes = host_live_;
  m.peak_host_allocated_bytes = host_peak_;
  return m;
}

void DryBackend::reset_peak_memory() {
  peak_ = live_;
  peak_by_phase_ = live_by_phase_;
  peak_phase_ = phase_;
  host_peak_ = host_live_;
}

}  // namespace spindle::plan
