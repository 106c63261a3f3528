// The CPU backend's shared-expert gate (backend/backend.h, shared_expert_gate_*), forwarded to by
// the CpuBackend class. F32 and F64 tensors; computed in double, stored once in the output's dtype.
#pragma once

#include "core/tensor.h"

namespace spindle::cpu {

void shared_expert_gate_forward(const Tensor& shared, const Tensor& gate, Tensor& out);
void shared_expert_gate_backward(const Tensor& shared, const Tensor& gate, const Tensor& dout, Tensor& d_shared,
                                 Tensor& d_gate);

}  // namespace spindle::cpu
