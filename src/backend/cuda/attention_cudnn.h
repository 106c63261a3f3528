// Attention through cuDNN's fused flash-attention engines (cuDNN 9 backend graph API, no
// cudnn-frontend). The CUDA backend sends it the calls whose mask the caller declares plain causal
// when the shape is worth a plan (cuda_backend.cpp, worth_a_cudnn_plan), and every call under
// --attention cudnn (CudaAttention::Cudnn). BF16 q/k/v/out/gradients, head dim 64, 128 or 256
// (Qwen3.5's and Qwen3.6's full-attention layers have 256; cuDNN 9 fuses up to 256 forward and
// backward on Hopper), GQA, and two mask cases:
//
//   Causal: one document, q and k the same tokens (tq == tk), positions p0, p0+1, ... on both
//           sides: key j visible to query i iff j <= i (cuDNN's causal mask, top-left diagonal).
//   None:   one document and every key at or before every query (max k_pos <= min q_pos): every
//           key visible to every query (no mask ops in the graph).
//
// Anything else (packed documents, ring blocks that are partly in the future, F32 ring partials)
// is rejected; the caller falls back or fails. So is a graph cuDNN has no engine for (a head dim
// of 256 on a GPU or cuDNN version without it): building its plan throws, naming what was tried.
//
// How a caller finds the case from an AttentionMask (q_doc/q_pos/k_doc/k_pos, I32 on the device):
// attention_cudnn_classify() below runs one small kernel and copies 16 bytes back (a stream
// synchronisation per call). The backend skips it when the caller says AttentionMask::plain_causal
// (the decoder does for a micro-batch that is one document at positions 0 … T−1, and the Ulysses
// strategy for a gathered row that is, see MicroBatch::one_causal_document).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "backend/cuda/kernels.h"
#include "core/dtype.h"

namespace spindle::cuda {

enum class CudnnMask { Unsupported, None, Causal };

// Whether this build has cuDNN (SPINDLE_HAVE_CUDNN). Without it every other function throws.
bool attention_cudnn_built();

// Reads the mask on the device (one tiny kernel + a 16-byte copy, synchronising `s`).
CudnnMask attention_cudnn_classify(cudaStream_t s, const AttentionShape& sh, const AttentionMaskPtrs& mask);

// Whether the cuDNN path takes this call; when not, *why (if given) says what is missing.
// `io`: q/k/v dtype; `outs`: the out (forward) or gradient (backward) dtype.
bool attention_cudnn_supports(const AttentionShape& sh, DType io, DType outs, CudnnMask mask,
                              std::string* why = nullptr);

// The workspace cuDNN's own execution plan asks for (bytes; building the plan if needed), without
// the F32 buffers the engine binds beside it. Measured per shape for `spindle plan`
// (attention_scratch.h; bench_cuda --cudnn-workspace).
int64_t attention_cudnn_workspace_bytes(const AttentionShape& sh, CudnnMask mask, bool backward);

// out [tq, hq, d] BF16, lse F32 [hq, tq] = natural log of the scaled softmax denominator
// (max_j s_ij + log Σ_j exp(s_ij − max), s = scale·q·kᵀ) — cuDNN's "Stats" output.
void attention_forward_cudnn(cudaStream_t s, const AttentionShape& sh, CudnnMask mask, const void* q,
                             const void* k, const void* v, float scale, void* out, float* lse);
// dq/dk/dv BF16 (= or, with `accumulate`, +=) from out, dout and the forward's lse.
void attention_backward_cudnn(cudaStream_t s, const AttentionShape& sh, CudnnMask mask, const void* q,
                              const void* k, const void* v, const void* out, const void* dout, const float* lse,
                              float scale, void* dq, void* dk, void* dv, bool accumulate);

}  // namespace spindle::cuda
