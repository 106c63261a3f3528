// The CPU backend's mixture-of-experts ops (backend/backend.h, "mixture of experts"), implemented
// here and forwarded to by the CpuBackend class. F32 and F64 compute tensors, stat tensors F32 or
// F64; every sum accumulates in double.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/tensor.h"

namespace spindle::cpu {

void moe_router_forward(const Tensor& logits, int64_t top_k, bool normalize, Tensor& probs, Tensor& topk_index,
                        Tensor& topk_weight);
void moe_router_backward(const Tensor& probs, const Tensor& topk_index, const Tensor& d_topk_weight, bool normalize,
                         const Tensor& aux_grad, const Tensor& token_doc, Tensor& dlogits);
// glm4_moe's sigmoid router with its correction bias and group-limited choice (backend.h).
void moe_sigmoid_router_forward(const Tensor& logits, const Tensor& correction_bias, const SigmoidRouting& routing,
                                Tensor& scores, Tensor& topk_index, Tensor& topk_weight);
void moe_sigmoid_router_backward(const Tensor& scores, const Tensor& topk_index, const Tensor& d_topk_weight,
                                 const SigmoidRouting& routing, Tensor& dlogits);
void moe_router_statistics(const Tensor& probs, const Tensor& topk_index, const Tensor& token_doc, Tensor& counts,
                           Tensor& prob_sums);
void moe_permute(const Tensor& topk_index, int64_t num_experts, Tensor& rows_token, Tensor& row_of_slot,
                 Tensor& offsets);
void moe_combine(const Tensor& y, const Tensor& row_of_slot, const Tensor& topk_index, const Tensor& topk_weight,
                 Tensor& out);
void moe_combine_backward(const Tensor& dout, const Tensor& y, const Tensor& row_of_slot, const Tensor& topk_weight,
                          Tensor& dy, Tensor& d_topk_weight);
// gpt_oss's clamped SwiGLU over interleaved gate/up columns (backend.h): gate_up [N, 2I] -> out [N, I],
// and its backward d_gate_up [N, 2I] from dout [N, I].
void clamped_swiglu_forward(const Tensor& gate_up, double alpha, double limit, Tensor& out);
void clamped_swiglu_backward(const Tensor& gate_up, const Tensor& dout, double alpha, double limit, Tensor& d_gate_up);

}  // namespace spindle::cpu
