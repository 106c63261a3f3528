// The CPU backend's grouped expert GEMMs (backend/backend.h, moe_grouped_gemm): each expert's rows
// as one gemm of the backend on row views, the calls a per-expert Linear makes, so the grouped
// path and the per-expert one give the same bits. The offsets are host memory on the CPU: reading
// them costs nothing.
#pragma once

#include <vector>

#include "backend/backend.h"

namespace spindle::cpu {

void moe_grouped_gemm(Backend& backend, const Tensor& x, const std::vector<Tensor>& weights, bool transpose_weight,
                      const Tensor& offsets, Tensor& y, bool accumulate);
void moe_grouped_gemm_weight_grad(Backend& backend, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                  std::vector<Tensor>& weight_grads);

}  // namespace spindle::cpu
