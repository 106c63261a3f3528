// Launchers of the gated-attention and gated-DeltaNet kernels (gated_ops.cu, gated_delta.cu). Like
// kernels.h: raw device pointers and the op's stream; cuda_backend.cpp checks shapes and dtypes
// against backend.h first. `io` is the compute dtype (F32 or BF16: storage only, F32 arithmetic);
// statistics (rstd, g, dg) are F32; `wt` is the dtype of a weight (conv, norm, A_log, dt_bias),
// F32 or BF16 independently of io.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>

#include <cuda_runtime.h>

#include "backend/cuda/gated_delta_scratch.h"
#include "core/dtype.h"

namespace spindle::cuda {

// ---- gated_ops.cu -------------------------------------------------------------------------------
// dst[r, dst_col + j] = src[r, src_col + j], j < width; elements of elem_bytes (2, 4 or 8).
void copy_columns(cudaStream_t s, const void* src, int64_t src_cols, int64_t src_col, void* dst, int64_t dst_cols,
                  int64_t dst_col, int64_t rows, int64_t width, size_t elem_bytes);
// x [tokens, heads, d]: the first rotary_dim dims of each head rotated (pairs i, i + rotary_dim/2),
// cos and sin times attention_scale.
void rope_partial(cudaStream_t s, void* x, DType io, int64_t tokens, int64_t heads, int64_t d, int64_t rotary_dim,
                  const int32_t* pos, const float* inv_freq, double attention_scale, int sign);
void sigmoid_gate_forward(cudaStream_t s, const void* x, const void* gate, void* out, DType io, int64_t n);
void sigmoid_gate_backward(cudaStream_t s, const void* x, const void* gate, const void* dout, void* dx, void* dgate,
                           DType io, int64_t n);
// x, y [tokens, channels]; w [channels, width] of dtype wt; doc_ids I32 [tokens]; dw (null: frozen) +=.
// (deltanet_conv.cu)
void causal_conv1d_silu_forward(cudaStream_t s, const void* x, const void* w, DType wt, const int32_t* doc_ids,
                                void* y, DType io, int64_t tokens, int64_t channels, int64_t width);
void causal_conv1d_silu_backward(cudaStream_t s, const void* x, const void* w, DType wt, const int32_t* doc_ids,
                                 const void* dy, void* dx, void* dw, DType io, int64_t tokens, int64_t channels,
                                 int64_t width);
// The row-wise kernels alone (any shape): what the two above run where their register-window kernels
// do not take the shape (deltanet_conv_shape.h); bench_gated_delta compares the two.
void causal_conv1d_silu_forward_rowwise(cudaStream_t s, const void* x, const void* w, DType wt, const int32_t* doc_ids,
                                        void* y, DType io, int64_t tokens, int64_t channels, int64_t width);
void causal_conv1d_silu_backward_rowwise(cudaStream_t s, const void* x, const void* w, DType wt,
                                         const int32_t* doc_ids, const void* dy, void* dx, void* dw, DType io,
                                         int64_t tokens, int64_t channels, int64_t width);
// The conv with the gated DeltaNet's split fused (backend.h: deltanet_conv_split_*): qkv, d_qkv
// [tokens, 2·key + value]; q, k, dq, dk [tokens, key] in heads of head_dim; v, dv [tokens, value];
// rstd F32 [tokens·key/head_dim]. They return false, having launched nothing, for a shape the fused
// kernels do not take (deltanet_conv_shape.h; or tensors not aligned to 4 elements): the caller then
// runs the separate ops. (deltanet_conv.cu)
bool deltanet_conv_split_forward(cudaStream_t s, const void* qkv, const void* w, DType wt, const int32_t* doc_ids,
                                 void* q, void* k, void* v, float* q_rstd, float* k_rstd, DType io, int64_t tokens,
                                 int64_t key, int64_t value, int64_t head_dim, int64_t width, float eps);
bool deltanet_conv_split_backward(cudaStream_t s, const void* qkv, const void* w, DType wt, const int32_t* doc_ids,
                                  const void* q, const void* k, const float* q_rstd, const float* k_rstd,
                                  const void* dq, const void* dk, const void* dv, void* d_qkv, void* dw, DType io,
                                  int64_t tokens, int64_t key, int64_t value, int64_t head_dim, int64_t width);
// x, y [rows, c]; rstd F32 [rows].
void l2norm_forward(cudaStream_t s, const void* x, void* y, float* rstd, DType io, int64_t rows, int64_t c, float eps);
void l2norm_backward(cudaStream_t s, const void* y, const float* rstd, const void* dy, void* dx, DType io,
                     int64_t rows, int64_t c);
// a, b, beta, da, db [tokens, heads] (io); g, dg F32 [tokens, heads]; a_log, dt_bias and their
// gradients (null: frozen, else +=) [heads] of dtype wt.
void gated_delta_gates_forward(cudaStream_t s, const void* a, const void* b, const void* a_log, const void* dt_bias,
                               DType wt, float* g, void* beta, DType io, int64_t tokens, int64_t heads);
void gated_delta_gates_backward(cudaStream_t s, const void* a, const void* beta, const void* a_log,
                                const void* dt_bias, DType wt, const float* g, const float* dg, const void* dbeta,
                                void* da, void* db, void* da_log, void* ddt_bias, DType io, int64_t tokens,
                                int64_t heads);
// x, z, y [rows, c] (io); w [c] (wt); rstd F32 [rows]; dw (null: frozen) += (wt).
void gated_rmsnorm_forward(cudaStream_t s, const void* x, const void* z, const void* w, DType wt, void* y,
                           float* rstd, DType io, int64_t rows, int64_t c, float eps);
void gated_rmsnorm_backward(cudaStream_t s, const void* x, const void* z, const void* w, DType wt, const float* rstd,
                            const void* dy, void* dx, void* dz, void* dw, DType io, int64_t rows, int64_t c);

// ---- gated_delta.cu: the chunked gated delta rule ------------------------------------------------
// DeltaRuleShape, kDeltaRuleMaxDim, kDeltaRuleMaxChunk and the scratch sizes: gated_delta_scratch.h.
// q, k [T, Hk, dk]; v, out [T, Hv, dv]; beta [T, Hv] (io); g F32 [T, Hv]; doc_ids I32 [T].
void gated_delta_rule_forward(cudaStream_t s, const DeltaRuleShape& sh, DType io, const void* q, const void* k,
                              const void* v, const float* g, const void* beta, const int32_t* doc_ids, float scale,
                              void* out);
// dq, dk, dv, dbeta (io) and dg (F32) overwritten.
void gated_delta_rule_backward(cudaStream_t s, const DeltaRuleShape& sh, DType io, const void* q, const void* k,
                               const void* v, const float* g, const void* beta, const int32_t* doc_ids, float scale,
                               const void* dout, void* dq, void* dk, void* dv, float* dg, void* dbeta);

// ---- gated_delta_mma.cu: the same op on tensor cores --------------------------------------------
// gated_delta_rule_forward/backward above pick these for BF16 tensors whenever
// gated_delta_rule_mma_supported says yes (head dims and chunk multiples of 8, every tensor 16-byte
// aligned, the shared memory the grads kernel needs); F32 tensors and other shapes keep the F32-FMA
// kernels of gated_delta.cu. Same arguments and results as the two functions above (BF16 only).
bool gated_delta_rule_mma_supported(const DeltaRuleShape& sh, DType io, std::initializer_list<const void*> tensors);
void gated_delta_rule_forward_mma(cudaStream_t s, const DeltaRuleShape& sh, const void* q, const void* k,
                                  const void* v, const float* g, const void* beta, const int32_t* doc_ids,
                                  float scale, void* out);
void gated_delta_rule_backward_mma(cudaStream_t s, const DeltaRuleShape& sh, const void* q, const void* k,
                                   const void* v, const float* g, const void* beta, const int32_t* doc_ids,
                                   float scale, const void* dout, void* dq, void* dk, void* dv, float* dg,
                                   void* dbeta);

}  // namespace spindle::cuda
