// Launchers of the gated delta rule with a state entering and leaving every run of tokens
// (backend.h: gated_delta_rule_forward_states / _backward_states), what ring sequence parallelism
// passes from rank to rank (parallel/sp_deltanet.h). Raw device pointers on the op's stream;
// cuda_backend.cpp checks the tensors against backend.h first. io: the compute dtype (F32 or BF16,
// storage only: F32 arithmetic); g, dg and the states are F32.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "backend/cuda/kernels.h"
#include "core/dtype.h"

namespace spindle::cuda {

struct DeltaStatesShape {
  int64_t tokens;
  int key_heads, value_heads;  // value head h reads key head h / (value_heads / key_heads)
  int dk, dv;                  // at most 128 each
  int64_t runs;                // N: runs of equal run_ids, one state each
};

// q, k [T, Hk, dk]; v, out [T, Hv, dv]; beta [T, Hv] (io); g F32 [T, Hv]; run_ids I32 [T];
// initial, finals F32 [N, Hv, dk, dv]. A run_ids that does not hold N runs is reported through err.
void gated_delta_rule_forward_states(cudaStream_t s, const DeltaStatesShape& sh, DType io, const void* q,
                                     const void* k, const void* v, const float* g, const void* beta,
                                     const int32_t* run_ids, float scale, const float* initial, void* out,
                                     float* finals, DeviceError* err);
// dq, dk, dv, dbeta (io), dg (F32) and d_initial F32 [N, Hv, dk, dv] overwritten from dout and
// d_final F32 [N, Hv, dk, dv].
void gated_delta_rule_backward_states(cudaStream_t s, const DeltaStatesShape& sh, DType io, const void* q,
                                      const void* k, const void* v, const float* g, const void* beta,
                                      const int32_t* run_ids, float scale, const float* initial, const void* dout,
                                      const float* d_final, void* dq, void* dk, void* dv, float* dg, void* dbeta,
                                      float* d_initial, DeviceError* err);

}  // namespace spindle::cuda
