// Host tensors of the CPU backend for activation offload (Backend::empty_host): a separate
// allocation, counted apart from the backend's tensor bytes, so a CPU run shows what offload moves
// off the "device" and `spindle plan --device cpu` can be checked against it.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/tensor.h"

namespace spindle::cpu {

// Uninitialised, 64-byte aligned; bytes counted in host_tensor_bytes() while alive.
Tensor empty_host_tensor(Shape shape, DType dtype);
// dst = src (same dtype and element count; a byte copy: offload is exact).
void copy_host_tensor(const Tensor& src, Tensor& dst);
// Bytes in live host tensors of the process (padded as allocated) and their high-water mark.
int64_t host_tensor_bytes();
int64_t peak_host_tensor_bytes();
void reset_peak_host_tensor_bytes();

// One backend's offload copies (Backend::offload_stats): they run in the caller, one after the
// other, so each one's wall time is both its copy time and the time it adds to the step.
class OffloadCopies {
 public:
  void copy(const Tensor& src, Tensor& dst);  // copy_host_tensor, timed
  const OffloadStats& stats() const { return stats_; }
  void reset() { stats_ = {}; }

 private:
  OffloadStats stats_;
};

}  // namespace spindle::cpu
