// The mask test behind attention_cudnn_classify (attention_cudnn.h): compiled with or without
// cuDNN, it needs only CUDA.
#include <climits>

#include "backend/cuda/attention_cudnn.h"
#include "backend/cuda/cuda_check.h"

namespace spindle::cuda {
namespace {

// r[0]: 1 if any q_doc/k_doc differs from q_doc[0]; r[1]: 1 if the positions are not
// p0, p0+1, ... on both sides (or tq != tk); r[2]: max k_pos; r[3]: min q_pos.
__global__ void classify_kernel(AttentionMaskPtrs m, int64_t tq, int64_t tk, int* r) {
  const int doc = m.q_doc[0], p0 = m.q_pos[0];
  int bad_doc = 0, bad_causal = tq != tk, kmax = INT_MIN, qmin = INT_MAX;
  const int64_t n = tq > tk ? tq : tk;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
    if (i < tq) {
      const int qd = m.q_doc[i], qp = m.q_pos[i];
      bad_doc |= qd != doc;
      bad_causal |= qp != p0 + static_cast<int>(i);
      qmin = min(qmin, qp);
    }
    if (i < tk) {
      const int kd = m.k_doc[i], kp = m.k_pos[i];
      bad_doc |= kd != doc;
      bad_causal |= kp != p0 + static_cast<int>(i);
      kmax = max(kmax, kp);
    }
  }
  if (bad_doc) atomicOr(&r[0], 1);
  if (bad_causal) atomicOr(&r[1], 1);
  atomicMax(&r[2], kmax);
  atomicMin(&r[3], qmin);
}

}  // namespace

CudnnMask attention_cudnn_classify(cudaStream_t s, const AttentionShape& sh, const AttentionMaskPtrs& mask) {
  if (sh.tq <= 0 || sh.tk <= 0) return CudnnMask::Unsupported;
  Scratch dev(s, 4 * sizeof(int));
  const int init[4] = {0, 0, INT_MIN, INT_MAX};
  int host[4];
  CUDA_CHECK(cudaMemcpyAsync(dev.as<int>(), init, sizeof(init), cudaMemcpyHostToDevice, s));
  const int64_t n = sh.tq > sh.tk ? sh.tq : sh.tk;
  const int blocks = static_cast<int>((n + 255) / 256 < 264 ? (n + 255) / 256 : 264);
  classify_kernel<<<blocks, 256, 0, s>>>(mask, sh.tq, sh.tk, dev.as<int>());
  CUDA_CHECK_LAUNCH();
  CUDA_CHECK(cudaMemcpyAsync(host, dev.as<int>(), sizeof(host), cudaMemcpyDeviceToHost, s));
  CUDA_CHECK(cudaStreamSynchronize(s));
  if (host[0]) return CudnnMask::Unsupported;      // more than one document
  if (host[2] <= host[3]) return CudnnMask::None;  // every key at or before every query
  return host[1] ? CudnnMask::Unsupported : CudnnMask::Causal;
}

}  // namespace spindle::cuda
