// Page-locked host memory and the copy stream of activation offload on CUDA (Backend::empty_host,
// copy_host_device, copy_stream). Pinned memory is what lets cudaMemcpyAsync run as DMA on a copy
// engine beside the kernels; pinning gigabytes takes long (the driver locks every page) and
// cudaFreeHost synchronises the device, so freed blocks are cached by size for the next step (a
// training step offloads the same shapes every time; a shorter row reuses a block up to a quarter
// larger) and given back only when a request finds no such block (a new length) or when the last
// user is gone.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>

#include "core/tensor.h"

namespace spindle::cuda {

class HostMemory {
 public:
  explicit HostMemory(int device);
  ~HostMemory();
  HostMemory(const HostMemory&) = delete;
  HostMemory& operator=(const HostMemory&) = delete;

  // The stream copies run on: non-blocking, created on first use.
  cudaStream_t copy_stream();
  int64_t live_bytes() const { return live_; }
  int64_t peak_bytes() const { return peak_; }
  void reset_peak() { peak_ = live_; }

 private:
  friend Tensor make_pinned_tensor(const std::shared_ptr<HostMemory>& memory, Shape shape, DType dtype);
  static void release(void* data, void* context);
  // At least `bytes`; block_bytes receives the block's size (what give_back takes).
  void* allocate(size_t bytes, size_t& block_bytes);
  void give_back(void* data, size_t bytes);
  void free_cached();

  int device_;
  cudaStream_t copy_stream_ = nullptr;
  std::mutex mutex_;
  std::multimap<size_t, void*> cached_;  // freed blocks by size
  int64_t live_ = 0, peak_ = 0;
};

// An uninitialised host tensor in pinned memory of `memory` (device kind CPU); it keeps `memory`
// alive and returns its block to the cache when the last view goes.
Tensor make_pinned_tensor(const std::shared_ptr<HostMemory>& memory, Shape shape, DType dtype);

}  // namespace spindle::cuda
