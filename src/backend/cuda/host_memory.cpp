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
           "{}; offload fewer layers (--recompute-layers) or add host memory",
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
