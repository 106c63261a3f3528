// The CUDA backend: bf16 storage with f32 accumulation (F32 works everywhere too), cuBLASLt GEMMs,
// fused kernels and a flash-style attention that returns the log-sum-exp. Same op semantics as
// the CPU reference (backend/cpu), which the tests in tests/cuda compare it against.
#pragma once

#include <memory>

#include "backend/backend.h"
#include "backend/cuda/cuda_options.h"

namespace spindle {

// A backend on CUDA device `device_index`, with its own non-blocking stream, cuBLASLt handle and
// workspace, running the attention `options` choose (cuda_options.h). Throws spindle::Error when the
// device does not exist, CUDA cannot start, or the options ask for cuDNN in a build without it.
std::unique_ptr<Backend> make_cuda_backend(int device_index = 0, const CudaBackendOptions& options = {});

// Number of CUDA devices visible to this process (0 when there is no driver or no GPU).
int cuda_device_count();

}  // namespace spindle
