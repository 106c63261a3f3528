// Page-locked host memory and the copy stream of activation offload on CUDA (Backend::empty_host,
// copy_host_device, copy_stream). Pinned memory is what lets cudaMemcpyAsync run as DMA on a copy
// engine beside the kernels; pinning gigabytes takes long (the driver locks every page) and
// cudaFreeHost synchronises the device, so freed blocks are cached by size for the next step (a
// training step offloads the same shapes every time; a shorter row reuses a block up to a quarter
// larger) and given back only when a request finds no such block (a new length) or when the last
// user is gone. The copies are timed with events (Backend::offload_stats): each one between two
// events on its stream, and each wait of compute for them by an event on either stream.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "backend/backend.h"
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

  // dst = src (`bytes`, one side pinned host memory) enqueued on `stream` between two timing events.
  void copy(cudaStream_t stream, void* dst, const void* src, size_t bytes);
  // `waiter` waits for everything enqueued on copy_stream() so far. An event on each stream marks
  // when `waiter` reaches the wait and when the copies are done; the stall is the second minus the
  // first when positive.
  void wait_for_copies(cudaStream_t waiter);
  // Totals since construction or reset_stats(); waits for the recorded events to complete.
  OffloadStats stats();
  void reset_stats();

 private:
  friend Tensor make_pinned_tensor(const std::shared_ptr<HostMemory>& memory, Shape shape, DType dtype);
  static void release(void* data, void* context);
  // At least `bytes`; block_bytes receives the block's size (what give_back takes).
  void* allocate(size_t bytes, size_t& block_bytes);
  void give_back(void* data, size_t bytes);
  void free_cached();

  // Timing: pairs of events not yet read, oldest first, and events free for reuse.
  struct Interval {
    cudaEvent_t begin, end;
    int64_t bytes;  // a copy's; -1 for a wait (begin: the waiter arrived, end: the copies were done)
  };
  cudaEvent_t timing_event();
  // Adds finished intervals to stats_, oldest first: every one (`block`: waiting for them), or
  // those complete now.
  void settle(bool block);

  int device_;
  cudaStream_t copy_stream_ = nullptr;
  std::mutex mutex_;
  std::multimap<size_t, void*> cached_;  // freed blocks by size
  int64_t live_ = 0, peak_ = 0;
  std::vector<Interval> pending_;
  std::vector<cudaEvent_t> free_events_;
  OffloadStats stats_;
};

// An uninitialised host tensor in pinned memory of `memory` (device kind CPU); it keeps `memory`
// alive and returns its block to the cache when the last view goes.
Tensor make_pinned_tensor(const std::shared_ptr<HostMemory>& memory, Shape shape, DType dtype);

}  // namespace spindle::cuda
