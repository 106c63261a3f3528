// The CUDA backend's options: which attention implementation runs. Plain C++ (no CUDA headers,
// header-only) so that the commands parse and validate `--attention` in every build, with or
// without the CUDA backend, before any work starts.
#pragma once

#include <string>
#include <string_view>

#include "core/error.h"

namespace spindle {

// Auto (default): cuDNN's fused SDPA for the calls the caller declares one plain causal document
//   (AttentionMask::plain_causal; BF16, head dim 64, 128 or 256) when the shape is worth a cuDNN
//   plan, the engine's own kernels for everything else (docs/usage.md, "Attention kernels").
// Own: the engine's own kernels only (wgmma on Hopper, else mma.sync; simple ones for the rest).
// Cudnn: cuDNN for every call; a call it cannot take (packed documents, ring blocks partly in the
//   future, F32, head dims other than 64, 128 and 256) fails with the reason.
// Simple, Mma, Wgmma: one of the engine's kernels forced — for the kernel tests and benchmarks
//   (tests/cuda), not offered on the command line.
enum class CudaAttention { Auto, Own, Cudnn, Simple, Mma, Wgmma };

struct CudaBackendOptions {
  CudaAttention attention = CudaAttention::Auto;
};

inline std::string_view cuda_attention_name(CudaAttention a) {
  switch (a) {
    case CudaAttention::Auto: return "auto";
    case CudaAttention::Own: return "own";
    case CudaAttention::Cudnn: return "cudnn";
    case CudaAttention::Simple: return "simple";
    case CudaAttention::Mma: return "mma";
    case CudaAttention::Wgmma: return "wgmma";
  }
  return "?";
}

// `--attention VALUE` (sft, dpo, check, bench; YAML key `attention`): auto, own or cudnn.
inline CudaAttention parse_cuda_attention(std::string_view value) {
  for (CudaAttention a : {CudaAttention::Auto, CudaAttention::Own, CudaAttention::Cudnn})
    if (value == cuda_attention_name(a)) return a;
  fail("--attention must be auto, own or cudnn, got \"{}\" (auto: cuDNN for long plain causal rows, the "
       "engine's own kernels elsewhere; own: never cuDNN; cudnn: cuDNN for every call)",
       value);
}

// A choice other than auto for a run that computes on the CPU (`where` says why it does: "--device
// cpu", ...) is an error: the CPU reference has one attention, and a silently ignored choice would
// hide a misconfigured job.
inline void check_cuda_attention_off_gpu(CudaAttention a, std::string_view where) {
  if (a != CudaAttention::Auto)
    fail("--attention {} chooses among the CUDA backend's attention kernels, but this run computes on the CPU "
         "({}), whose reference attention has one implementation: leave --attention at auto",
         cuda_attention_name(a), where);
}

}  // namespace spindle
