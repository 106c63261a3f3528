// A gated DeltaNet layer's conv and split (backend/backend.h, deltanet_conv_split_*) composed of the
// separate ops of any backend: the CPU reference runs it, and the CUDA backend falls back to it for
// shapes its fused kernels do not take. Bit for bit what the separate calls give.
#pragma once

#include "backend/backend.h"

namespace spindle {

// mixed = conv(qkv) [T, C]; q, k = l2norm of its first two Hk·dk column blocks, v the rest.
void deltanet_conv_split_forward_by_parts(Backend& be, Stream stream, const Tensor& qkv, const Tensor& w,
                                          const Tensor& doc_ids, double eps, Tensor& q, Tensor& k, Tensor& v,
                                          Tensor& q_rstd, Tensor& k_rstd);
// d_mixed = [l2norm_backward(q, dq) | l2norm_backward(k, dk) | dv], then the conv's backward.
void deltanet_conv_split_backward_by_parts(Backend& be, Stream stream, const Tensor& qkv, const Tensor& w,
                                           const Tensor& doc_ids, const Tensor& q, const Tensor& k,
                                           const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& dq,
                                           const Tensor& dk, const Tensor& dv, Tensor& d_qkv, Tensor* dw);

}  // namespace spindle
