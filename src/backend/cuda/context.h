// Per-backend CUDA state: the device, its stream, the cuBLASLt handle and workspace, the GEMM plan
// cache and the bad-input word kernels write to. Owned through a shared_ptr by the backend and by
// every tensor it allocated, so memory can be released after the backend object is gone.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <memory>

#include "backend/cuda/kernels.h"

namespace spindle::cuda {

class GemmCache;

class Context {
 public:
  explicit Context(int device);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;

  int device() const { return device_; }
  cudaStream_t stream() const { return stream_; }
  // The side stream (Backend::comm_stream), non-blocking like stream(); created on first use.
  cudaStream_t comm_stream();
  // Work enqueued on `waiter` from now on waits for everything enqueued on `signaller` so far.
  void stream_wait(cudaStream_t waiter, cudaStream_t signaller);
  cublasLtHandle_t lt() const { return lt_; }
  void* workspace() const { return workspace_; }
  size_t workspace_bytes() const { return workspace_bytes_; }
  GemmCache& gemm_cache() { return *gemm_cache_; }
  // Device-visible pointer to the error word (pinned, mapped host memory).
  DeviceError* device_error() const { return error_device_; }
  // Throws the first bad-input error a kernel reported (and clears it). Call after a synchronize.
  void check_device_error();
  // Makes this context's device current on the calling thread (cheap when it already is).
  void activate() const;

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
  cudaStream_t comm_stream_ = nullptr;
  // One event serves every stream_wait: cudaStreamWaitEvent captures the event's latest record when
  // it is called, so re-recording it for the next wait cannot change an earlier one.
  cudaEvent_t order_event_ = nullptr;
  cublasLtHandle_t lt_ = nullptr;
  void* workspace_ = nullptr;
  size_t workspace_bytes_ = 0;
  DeviceError* error_host_ = nullptr;
  DeviceError* error_device_ = nullptr;
  std::unique_ptr<GemmCache> gemm_cache_;
};

}  // namespace spindle::cuda
