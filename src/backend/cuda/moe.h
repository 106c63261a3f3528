// Launchers of the mixture-of-experts kernels (moe.cu, shared_expert_gate.cu, moe_grouped_gemm.cu,
// moe_grouped_gemm_wgmma.cu):
// the router, the permutation of routed rows by expert, the weighted combine, the shared expert's
// gate and the grouped expert GEMMs. Raw
// device pointers on the op's stream; cuda_backend.cpp checks the tensors against backend.h.
// Routing statistics (probs, topk_weight, their gradients) are F32; activations F32 or BF16.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "backend/cuda/kernels.h"
#include "core/dtype.h"

namespace spindle::cuda {

// ---- moe.cu ------------------------------------------------------------------------------------
// One warp per token: softmax of logits [T, E] into probs, then the k largest (ties: lower expert).
void moe_router_forward(cudaStream_t s, const void* logits, DType t, int64_t tokens, int experts, int top_k,
                        bool normalize, float* probs, int32_t* topk_index, float* topk_weight);
// dlogits [T, E] (dtype t) overwritten; aux_grad [E] and token_doc [T] may be null.
void moe_router_backward(cudaStream_t s, const float* probs, const int32_t* topk_index, const float* d_topk_weight,
                         int64_t tokens, int experts, int top_k, bool normalize, const float* aux_grad,
                         const int32_t* token_doc, void* dlogits, DType t);
// counts [E] += routed real tokens, prob_sums [E] += Σ probs over real tokens; token_doc may be null.
void moe_router_statistics(cudaStream_t s, const float* probs, const int32_t* topk_index, const int32_t* token_doc,
                           int64_t tokens, int experts, int top_k, float* counts, float* prob_sums);
// A stable sort of the T·k slots by expert (ties in slot order); an expert outside [0, E) is
// reported through err (the outputs are then meaningless).
void moe_permute(cudaStream_t s, const int32_t* topk_index, int64_t tokens, int top_k, int experts,
                 int32_t* rows_token, int32_t* row_of_slot, int32_t* offsets, DeviceError* err);
// out [T, H] = Σ_j w[t, j]·y[row of (t, j)], slots in ascending expert order, summed in F32.
void moe_combine(cudaStream_t s, const void* y, const int32_t* row_of_slot, const int32_t* topk_index,
                 const float* topk_weight, int64_t tokens, int top_k, int64_t hidden, void* out, DType t);
// dy [N, H] = w·dout per slot; d_topk_weight [T, k] = ⟨y[row], dout[t]⟩ (F32).
void moe_combine_backward(cudaStream_t s, const void* dout, const void* y, const int32_t* row_of_slot,
                          const float* topk_weight, int64_t tokens, int top_k, int64_t hidden, void* dy,
                          float* d_topk_weight, DType t);

// ---- shared_expert_gate.cu ------------------------------------------------------------------------
// out [T, H] += σ(gate[t])·shared[t]; gate [T] one logit per token; all of dtype t.
void shared_expert_gate_forward(cudaStream_t s, const void* shared, const void* gate, int64_t tokens, int64_t hidden,
                                void* out, DType t);
// d_shared [T, H] = σ(gate[t])·dout[t]; d_gate [T] = σ'(gate[t])·⟨dout[t], shared[t]⟩ (summed in F32).
void shared_expert_gate_backward(cudaStream_t s, const void* shared, const void* gate, const void* dout,
                                 int64_t tokens, int64_t hidden, void* d_shared, void* d_gate, DType t);

// ---- moe_grouped_gemm.cu -------------------------------------------------------------------------
// The experts' matrices travel as a kernel argument (no device table to upload, nothing to wait
// for): 1024 pointers are 8 KiB, inside the 32 KiB that kernel arguments may take since CUDA 12.1.
constexpr int kMaxGroupedExperts = 1024;
struct ExpertPointers {
  void* p[kMaxGroupedExperts];
};

// y[rows of e] (+)= x[rows of e]·op(W_e) for the rows offsets[e] … offsets[e+1]−1 of each expert,
// offsets I32 [E+1] read on the device. transpose_weight: W_e [n, k], op(W) = Wᵀ (the forward);
// otherwise W_e [k, n] (the input gradient). x [rows, k], y [rows, n], all of dtype t.
void moe_grouped_gemm(cudaStream_t s, DType t, const void* x, int64_t rows, int64_t k, const ExpertPointers& weights,
                      int experts, bool transpose_weight, const int32_t* offsets, void* y, int64_t n,
                      bool accumulate);
// Which kernels run the grouped GEMMs, from the environment variable SPINDLE_MOE_GEMM, read at each
// call (docs/usage.md). Where the Hopper kernels (moe_grouped_gemm_wgmma.cu) apply (compute
// capability 9.x, BF16, the two non-ragged sizes multiples of 8 and at least 64): "auto" or unset
// takes them for the forward and the input gradients and mma.sync for the weight gradient (measured
// faster there, docs/perf.md); "wgmma" takes them for all three; "mma" never. Elsewhere mma.sync
// runs. Any other value is an error naming these.
enum class MoeGemmKernel { Auto, Mma, Wgmma };
MoeGemmKernel moe_gemm_kernel_choice();

// The Hopper kernel's launcher (moe_grouped_gemm.cu calls it when it applies: supports(), a 9.x
// device, 16-byte aligned pointers). tile_n: the tiles' width, 128 or 256 columns; 0 picks 256
// for n ≥ 256 (a 128 × 256 tile reads 1.5 bytes per multiply-add where 128 × 128 reads 2).
// staged_epilogue: tiles leave through shared memory in whole-row pieces; false stores from
// registers. Accumulating calls stage too only with staged_accumulate (F32 in shared memory, the
// old values added in whole-row pieces, one rounding as from registers; not measured yet, so off).
// These are for the tests and bench_moe to compare; the backend takes the defaults.
bool moe_grouped_gemm_wgmma_supports(DType t, int64_t k, int64_t n);
void moe_grouped_gemm_wgmma(cudaStream_t s, const void* x, int64_t rows, int64_t k, const ExpertPointers& weights,
                            int experts, bool transpose_weight, const int32_t* offsets, void* y, int64_t n,
                            bool accumulate, int tile_n = 0, bool staged_epilogue = true,
                            bool staged_accumulate = false);
// The same for moe_grouped_gemm_weight_grad (BF16 dy and x, m and n multiples of 8 and at least 64,
// dW of grad_dtype F32 or BF16): one CTA per (expert, 128-row tile of dW_e, tile_n-column tile).
void moe_grouped_gemm_weight_grad_wgmma(cudaStream_t s, const void* dy, const void* x, int64_t rows, int64_t m,
                                        int64_t n, const int32_t* offsets, const ExpertPointers& weight_grads,
                                        int experts, DType grad_dtype, int tile_n = 0);

// dW_e [m, n] += dy[rows of e]ᵀ·x[rows of e]; dy [rows, m], x [rows, n] of dtype t; dW of
// grad_dtype (t, or F32 for BF16 t); a null dW_e is skipped (a frozen expert).
void moe_grouped_gemm_weight_grad(cudaStream_t s, DType t, const void* dy, const void* x, int64_t rows, int64_t m,
                                  int64_t n, const int32_t* offsets, const ExpertPointers& weight_grads, int experts,
                                  DType grad_dtype);

}  // namespace spindle::cuda
