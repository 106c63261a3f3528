#include "backend/cuda/context.h"

#include <cstdint>

#include "backend/cuda/gemm.h"
#include "core/error.h"

namespace spindle::cuda {

void throw_cuda(cudaError_t e, const char* call, const char* file, int line) {
  fail("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(e), cudaGetErrorString(e), call, file, line);
}
void throw_cublas(cublasStatus_t s, const char* call, const char* file, int line) {
  fail("cuBLASLt error {} ({}) in {} at {}:{}", static_cast<int>(s), cublasLtGetStatusName(s), call, file, line);
}
void throw_dtype(const char* op, DType t) {
  fail("{}: the CUDA backend computes in F32 or BF16, got {}; convert with copy() first", op, dtype_name(t));
}
void throw_message(const char* op, const char* message) { fail("{}: {}", op, message); }

namespace {
// cuBLASLt's recommended workspace on Hopper is 32 MiB (more lets it pick split-K kernels).
constexpr size_t kWorkspaceBytes = 32u << 20;
}  // namespace

Context::Context(int device) : device_(device) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0)
    fail("no CUDA device is available ({}); run on a GPU machine or use the CPU backend",
         e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
  if (device < 0 || device >= count) fail("CUDA device {} does not exist: this machine has {}", device, count);
  activate();
  CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  CUDA_CHECK(cudaEventCreateWithFlags(&order_event_, cudaEventDisableTiming));
  CUBLAS_CHECK(cublasLtCreate(&lt_));
  CUDA_CHECK(cudaMalloc(&workspace_, kWorkspaceBytes));
  workspace_bytes_ = kWorkspaceBytes;
  CUDA_CHECK(cudaHostAlloc(reinterpret_cast<void**>(&error_host_), sizeof(DeviceError), cudaHostAllocMapped));
  *error_host_ = DeviceError{};
  CUDA_CHECK(cudaHostGetDevicePointer(reinterpret_cast<void**>(&error_device_), error_host_, 0));
  // Tensors and scratch come from the device's default stream-ordered pool (cudaMallocAsync).
  // Keep freed blocks cached instead of returning them to the driver at every synchronize: a
  // training step frees and re-allocates the same sizes each time. (A planned arena replaces this.)
  cudaMemPool_t pool;
  CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device));
  uint64_t threshold = UINT64_MAX;
  CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  gemm_cache_ = std::make_unique<GemmCache>(*this);
}

Context::~Context() {
  // Destructors cannot throw: release what exists, ignoring errors (the process may be exiting
  // with the driver already torn down).
  cudaSetDevice(device_);
  gemm_cache_.reset();
  if (comm_stream_) cudaStreamSynchronize(comm_stream_);
  if (stream_) cudaStreamSynchronize(stream_);
  if (workspace_) cudaFree(workspace_);
  if (lt_) cublasLtDestroy(lt_);
  if (error_host_) cudaFreeHost(error_host_);
  if (order_event_) cudaEventDestroy(order_event_);
  if (comm_stream_) cudaStreamDestroy(comm_stream_);
  if (stream_) cudaStreamDestroy(stream_);
}

cudaStream_t Context::comm_stream() {
  if (!comm_stream_) {
    activate();
    // Non-blocking: no implicit ordering with the legacy default stream; only stream_wait orders it.
    CUDA_CHECK(cudaStreamCreateWithFlags(&comm_stream_, cudaStreamNonBlocking));
  }
  return comm_stream_;
}

void Context::stream_wait(cudaStream_t waiter, cudaStream_t signaller) {
  if (waiter == signaller) return;  // a stream is already ordered with itself
  activate();
  CUDA_CHECK(cudaEventRecord(order_event_, signaller));
  CUDA_CHECK(cudaStreamWaitEvent(waiter, order_event_, 0));
}

void Context::activate() const {
  int current = -1;
  CUDA_CHECK(cudaGetDevice(&current));
  if (current != device_) CUDA_CHECK(cudaSetDevice(device_));
}

void Context::check_device_error() {
  volatile DeviceError* e = error_host_;
  if (e->code == kErrNone) return;
  const DeviceError copy{e->code, 0, e->index, e->value, e->limit};
  e->code = kErrNone;
  switch (copy.code) {
    case kErrTokenId:
      fail("token id {} at position {} is outside the vocabulary [0, {})", copy.value, copy.index, copy.limit);
    case kErrGatherIndex:
      fail("gather_rows: index {} at row {} is outside [0, {})", copy.value, copy.index, copy.limit);
    case kErrScatterIndex:
      fail("scatter_add_rows: index {} at row {} is outside [0, {})", copy.value, copy.index, copy.limit);
    case kErrTarget:
      fail("cross_entropy: target {} at row {} is outside the vocabulary [0, {})", copy.value, copy.index,
           copy.limit);
    case kErrExpertIndex:
      fail("moe_permute: expert {} at slot {} is outside [0, {})", copy.value, copy.index, copy.limit);
    case kErrRunCount:
      fail("gated_delta_rule_*_states: run_ids hold {} runs of equal ids, but the states are given for {}", copy.value,
           copy.limit);
    default: fail("a CUDA kernel reported error code {}", copy.code);
  }
}

}  // namespace spindle::cuda
