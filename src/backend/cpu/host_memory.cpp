#include "backend/cpu/host_memory.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>

#include "core/error.h"

namespace spindle::cpu {

namespace {

std::atomic<int64_t> g_host_bytes{0}, g_peak_host_bytes{0};

void release_host(void* data, void* padded_bytes) {
  std::free(data);
  g_host_bytes -= static_cast<int64_t>(reinterpret_cast<uintptr_t>(padded_bytes));
}

}  // namespace

Tensor empty_host_tensor(Shape shape, DType dtype) {
  auto storage = std::make_shared<Storage>();
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  const size_t padded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  storage->data = std::aligned_alloc(64, padded);
  if (!storage->data) fail("out of host memory allocating {} bytes of offloaded {}", bytes, shape.str());
  storage->bytes = bytes;
  storage->device = Device{DeviceKind::CPU, 0};
  storage->release = release_host;
  storage->release_context = reinterpret_cast<void*>(static_cast<uintptr_t>(padded));
  const int64_t live = g_host_bytes += static_cast<int64_t>(padded);
  for (int64_t peak = g_peak_host_bytes; live > peak && !g_peak_host_bytes.compare_exchange_weak(peak, live);) {
  }
  return Tensor(std::move(storage), 0, shape, dtype);
}

void copy_host_tensor(const Tensor& src, Tensor& dst) {
  SPINDLE_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(), "copy_host_device {} -> {}",
                src.describe(), dst.describe());
  std::memcpy(dst.data(), src.data(), src.bytes());
}

void OffloadCopies::copy(const Tensor& src, Tensor& dst) {
  const auto start = std::chrono::steady_clock::now();
  copy_host_tensor(src, dst);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  ++stats_.copies;
  stats_.bytes += static_cast<int64_t>(src.bytes());
  stats_.copy_seconds += seconds;
  stats_.wait_seconds += seconds;
}

int64_t host_tensor_bytes() { return g_host_bytes; }
int64_t peak_host_tensor_bytes() { return std::max(g_host_bytes.load(), g_peak_host_bytes.load()); }
void reset_peak_host_tensor_bytes() { g_peak_host_bytes = g_host_bytes.load(); }

}  // namespace spindle::cpu
