// Every CUDA runtime / cuBLASLt call goes through these macros: a failure becomes a spindle::Error
// naming the call, the file and the line (library code never exits). The throwing functions live
// in context.cpp so that .cu files need not compile fmt.
#pragma once

#include <cublasLt.h>
#include <cuda_runtime.h>

#include "core/dtype.h"

namespace spindle::cuda {

[[noreturn]] void throw_cuda(cudaError_t e, const char* call, const char* file, int line);
[[noreturn]] void throw_cublas(cublasStatus_t s, const char* call, const char* file, int line);
// cudnnStatus_t as an int, so that this header does not need cudnn.h (cuDNN is optional; the
// function lives in attention_cudnn.cpp, which is only compiled into the library with cuDNN).
[[noreturn]] void throw_cudnn(int status, const char* call, const char* file, int line);
// A kernel family asked for a dtype it does not implement.
[[noreturn]] void throw_dtype(const char* op, DType t);
// Any other precondition that a launcher checks (shape limits of a kernel).
[[noreturn]] void throw_message(const char* op, const char* message);

}  // namespace spindle::cuda

#define CUDA_CHECK(call)                                                                              \
  do {                                                                                                \
    cudaError_t spindle_err_ = (call);                                                                \
    if (spindle_err_ != cudaSuccess) ::spindle::cuda::throw_cuda(spindle_err_, #call, __FILE__, __LINE__); \
  } while (0)

#define CUBLAS_CHECK(call)                                                                            \
  do {                                                                                                \
    cublasStatus_t spindle_st_ = (call);                                                              \
    if (spindle_st_ != CUBLAS_STATUS_SUCCESS)                                                         \
      ::spindle::cuda::throw_cublas(spindle_st_, #call, __FILE__, __LINE__);                          \
  } while (0)

// Only in files compiled with cuDNN (SPINDLE_HAVE_CUDNN): CUDNN_STATUS_SUCCESS is 0.
#define CUDNN_CHECK(call)                                                                             \
  do {                                                                                                \
    const int spindle_dnn_ = static_cast<int>(call);                                                  \
    if (spindle_dnn_ != 0) ::spindle::cuda::throw_cudnn(spindle_dnn_, #call, __FILE__, __LINE__);     \
  } while (0)

// After each kernel launch: bad launch configurations surface here, at the launching line.
#define CUDA_CHECK_LAUNCH() CUDA_CHECK(cudaGetLastError())
