// The CPU backend's ops for gated DeltaNet layers and gated attention (qwen3_5): what
// backend/backend.h declares under "linear attention", implemented here and forwarded to by the
// CpuBackend class. F32 and F64 tensors; every sum accumulates in double.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace spindle::cpu {

void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width);
void rope_partial(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int64_t rotary_dim, double attention_scale,
                  int sign);
void sigmoid_gate_forward(const Tensor& x, const Tensor& gate, Tensor& out);
void sigmoid_gate_backward(const Tensor& x, const Tensor& gate, const Tensor& dout, Tensor& dx, Tensor& dgate);

void causal_conv1d_silu_forward(const Tensor& x, const Tensor& w, const Tensor& doc_ids, Tensor& y);
void causal_conv1d_silu_backward(const Tensor& x, const Tensor& w, const Tensor& doc_ids, const Tensor& dy, Tensor& dx,
                                 Tensor* dw);
void l2norm_forward(const Tensor& x, double eps, Tensor& y, Tensor& rstd);
void l2norm_backward(const Tensor& y, const Tensor& rstd, const Tensor& dy, Tensor& dx);
void gated_delta_gates_forward(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias, Tensor& g,
                               Tensor& beta);
void gated_delta_gates_backward(const Tensor& a, const Tensor& beta, const Tensor& a_log, const Tensor& dt_bias,
                                const Tensor& g, const Tensor& dg, const Tensor& dbeta, Tensor& da, Tensor& db,
                                Tensor* da_log, Tensor* ddt_bias);
void gated_delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                              const Tensor& doc_ids, double scale, int64_t chunk_size, Tensor& out);
void gated_delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const Tensor& doc_ids, double scale, int64_t chunk_size, const Tensor& dout, Tensor& dq,
                               Tensor& dk, Tensor& dv, Tensor& dg, Tensor& dbeta);
void gated_rmsnorm_forward(const Tensor& x, const Tensor& z, const Tensor& w, double eps, Tensor& y, Tensor& rstd);
void gated_rmsnorm_backward(const Tensor& x, const Tensor& z, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                            Tensor& dx, Tensor& dz, Tensor* dw);

}  // namespace spindle::cpu
