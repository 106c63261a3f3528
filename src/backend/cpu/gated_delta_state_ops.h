// The CPU backend's gated delta rule with states entering and leaving each run of tokens
// (Backend::gated_delta_rule_forward_states / _backward_states): what sequence parallelism needs
// to continue a document's recurrence from one rank to the next (parallel/sp_deltanet.h).
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace spindle::cpu {

void gated_delta_rule_forward_states(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, const Tensor& run_ids, double scale, int64_t chunk_size,
                                     const Tensor& initial_states, Tensor& out, Tensor& final_states);
void gated_delta_rule_backward_states(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                      const Tensor& beta, const Tensor& run_ids, double scale, int64_t chunk_size,
                                      const Tensor& initial_states, const Tensor& dout, const Tensor& d_final_states,
                                      Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dg, Tensor& dbeta,
                                      Tensor& d_initial_states);

}  // namespace spindle::cpu
