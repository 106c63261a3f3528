#include "backend/cuda/host_memory.h"

#include <algorithm>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

namespace spindle::cuda {

namespace {

struct PinnedBlock {
  std::shared_ptr<HostMemory> memory;
  size_t bytes = 0;
};

}  // namespace

HostMemory::HostMemory(int device) : device_(device) {}

HostMemory::~HostMemory() {
  // Destructors cannot throw: errors are ignored (the driver may be gone at exit).
  cudaSetDevice(device_);
  if (copy_stream_) cudaStreamSynchronize(copy_stream_);
  for (const Interval& i : pending_) {
    cudaEventSynchronize(i.end);
    free_events_.push_back(i.begin);
    free_events_.push_back(i.end);
  }
  for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
  for (auto& [bytes, p] : cached_) cudaFreeHost(p);
  if (copy_stream_) cudaStreamDestroy(copy_stream_);
}

cudaStream_t HostMemory::copy_stream() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!copy_stream_) {
    CUDA_CHECK(cudaSetDevice(device_));
    CUDA_CHECK(cudaStreamCreateWithFlags(&copy_stream_, cudaStreamNonBlocking));
  }
  return copy_stream_;
}

cudaEvent_t HostMemory::timing_event() {
  if (free_events_.empty()) {
    cudaEvent_t e = nullptr;
    CUDA_CHECK(cudaEventCreate(&e));  // with timing (cudaEventDefault)
    return e;
  }
  cudaEvent_t e = free_events_.back();
  free_events_.pop_back();
  return e;
}

void HostMemory::settle(bool block) {
  size_t done = 0;
  for (; done < pending_.size(); ++done) {
    const Interval& i = pending_[done];
    if (block) {
      CUDA_CHECK(cudaEventSynchronize(i.end));
      CUDA_CHECK(cudaEventSynchronize(i.begin));
    } else {
      const cudaError_t e = cudaEventQuery(i.end), b = cudaEventQuery(i.begin);
      if (e == cudaErrorNotReady || b == cudaErrorNotReady) {
        cudaGetLastError();  // not ready is no error: leave nothing behind for the next check
        break;
      }
      CUDA_CHECK(e);
      CUDA_CHECK(b);
    }
    float ms = 0;
    CUDA_CHECK(cudaEventElapsedTime(&ms, i.begin, i.end));
    if (i.bytes >= 0) {
      ++stats_.copies;
      stats_.bytes += i.bytes;
      stats_.copy_seconds += std::max(0.0f, ms) / 1000.0;
    } else {
      stats_.wait_seconds += std::max(0.0f, ms) / 1000.0;  // negative: the copies were done before the waiter came
    }
    free_events_.push_back(i.begin);
    free_events_.push_back(i.end);
  }
  pending_.erase(pending_.begin(), pending_.begin() + static_cast<std::ptrdiff_t>(done));
}

void HostMemory::copy(cudaStream_t stream, void* dst, const void* src, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  CUDA_CHECK(cudaSetDevice(device_));
  if (pending_.size() >= 256) settle(false);  // a run that never reads the stats keeps few events
  const cudaEvent_t begin = timing_event(), end = timing_event();
  CUDA_CHECK(cudaEventRecord(begin, stream));
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
  CUDA_CHECK(cudaEventRecord(end, stream));
  pending_.push_back({begin, end, static_cast<int64_t>(bytes)});
}

void HostMemory::wait_for_copies(cudaStream_t waiter) {
  const cudaStream_t copies = copy_stream();
  if (waiter == copies) return;
  std::lock_guard<std::mutex> lock(mutex_);
  CUDA_CHECK(cudaSetDevice(device_));
  if (pending_.size() >= 256) settle(false);
  const cudaEvent_t arrived = timing_event(), done = timing_event();
  CUDA_CHECK(cudaEventRecord(arrived, waiter));
  CUDA_CHECK(cudaEventRecord(done, copies));
  CUDA_CHECK(cudaStreamWaitEvent(waiter, done, 0));
  pending_.push_back({arrived, done, -1});
}

OffloadStats HostMemory::stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  CUDA_CHECK(cudaSetDevice(device_));
  settle(true);
  return stats_;
}

void HostMemory::reset_stats() {
  std::lock_guard<std::mutex> lock(mutex_);
  CUDA_CHECK(cudaSetDevice(device_));
  settle(true);
  stats_ = {};
}

void HostMemory::free_cached() {
  if (cached_.empty()) return;
  // A cached block may still be the source of a copy in flight (its tensor is released once the
  // freeing stream waits, which the host does not): let the device finish first.
  CUDA_CHECK(cudaSetDevice(device_));
  CUDA_CHECK(cudaDeviceSynchronize());
  for (auto& [bytes, p] : cached_) CUDA_CHECK(cudaFreeHost(p));
  cached_.clear();
}

void* HostMemory::allocate(size_t bytes, size_t& block_bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  void* p = nullptr;
  // The smallest cached block that holds it and wastes at most a quarter (rows of another length
  // reuse the blocks of a longer one).
  if (auto it = cached_.lower_bound(bytes); it != cached_.end() && it->first - bytes <= bytes / 4) {
    block_bytes = it->first;
    p = it->second;
    cached_.erase(it);
  } else {
    free_cached();  // sizes this run no longer asks for (a previous length's)
    block_bytes = std::max<size_t>(bytes, 1);
    const cudaError_t e = cudaHostAlloc(&p, block_bytes, cudaHostAllocPortable);
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail("out of pinned host memory allocating {} bytes for activation offload ({} bytes offloaded already): "
           "{}; offload fewer layers (--offload-layers) or add host memory",
           bytes, live_, cudaGetErrorString(e));
    }
  }
  live_ += static_cast<int64_t>(block_bytes);
  peak_ = std::max(peak_, live_);
  return p;
}

void HostMemory::give_back(void* data, size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  cached_.emplace(bytes, data);
  live_ -= static_cast<int64_t>(bytes);
}

void HostMemory::release(void* data, void* context) {
  auto* block = static_cast<PinnedBlock*>(context);
  block->memory->give_back(data, block->bytes);
  delete block;
}

Tensor make_pinned_tensor(const std::shared_ptr<HostMemory>& memory, Shape shape, DType dtype) {
  const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
  auto storage = std::make_shared<Storage>();
  size_t block_bytes = 0;
  storage->data = memory->allocate(bytes, block_bytes);
  storage->bytes = bytes;
  storage->device = Device{DeviceKind::CPU, 0};
  storage->release = &HostMemory::release;
  storage->release_context = new PinnedBlock{memory, block_bytes};
  return Tensor(std::move(storage), 0, shape, dtype);
}

}  // namespace spindle::cuda
