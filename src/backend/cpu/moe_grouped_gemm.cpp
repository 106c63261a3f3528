#include "backend/cpu/moe_grouped_gemm.h"

#include "core/error.h"

namespace spindle::cpu {

namespace {

// The expert boundaries, checked: E + 1 non-decreasing offsets from 0 to rows.
const int32_t* expert_offsets(const char* op, const Tensor& offsets, size_t experts, int64_t rows) {
  SPINDLE_CHECK(offsets.defined() && offsets.device().kind == DeviceKind::CPU && offsets.dtype() == DType::I32 &&
                    offsets.rank() == 1 && static_cast<size_t>(offsets.numel()) == experts + 1,
                "{}: offsets must be I32 [{}] on the CPU, got {}", op, experts + 1,
                offsets.defined() ? offsets.describe() : std::string("none"));
  const int32_t* first = offsets.data_as<int32_t>();
  SPINDLE_CHECK(first[0] == 0 && first[experts] == rows, "{}: offsets run from {} to {} for {} rows", op, first[0],
                first[experts], rows);
  for (size_t e = 0; e < experts; ++e)
    SPINDLE_CHECK(first[e] <= first[e + 1], "{}: offsets decrease at expert {}", op, e);
  return first;
}

}  // namespace

void moe_grouped_gemm(Backend& be, const Tensor& x, const std::vector<Tensor>& weights, bool transpose_weight,
                      const Tensor& offsets, Tensor& y, bool accumulate) {
  const char* op = "moe_grouped_gemm";
  SPINDLE_CHECK(!weights.empty(), "{}: no expert weights", op);
  SPINDLE_CHECK(x.rank() == 2 && y.rank() == 2 && x.dim(0) == y.dim(0), "{}: x {} and y {} need the same rows", op,
                x.describe(), y.describe());
  const int32_t* first = expert_offsets(op, offsets, weights.size(), x.dim(0));
  for (size_t e = 0; e < weights.size(); ++e) {
    if (first[e] == first[e + 1]) continue;
    const Tensor xe = x.rows(first[e], first[e + 1]);
    Tensor ye = y.rows(first[e], first[e + 1]);
    be.gemm(be.default_stream(), xe, false, weights[e], transpose_weight, ye, 1.0, accumulate ? 1.0 : 0.0);
  }
}

void moe_grouped_gemm_weight_grad(Backend& be, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                  std::vector<Tensor>& weight_grads) {
  const char* op = "moe_grouped_gemm_weight_grad";
  SPINDLE_CHECK(!weight_grads.empty(), "{}: no expert gradients", op);
  SPINDLE_CHECK(dy.rank() == 2 && x.rank() == 2 && dy.dim(0) == x.dim(0), "{}: dy {} and x {} need the same rows", op,
                dy.describe(), x.describe());
  const int32_t* first = expert_offsets(op, offsets, weight_grads.size(), x.dim(0));
  for (size_t e = 0; e < weight_grads.size(); ++e) {
    if (!weight_grads[e].defined() || first[e] == first[e + 1]) continue;
    be.gemm(be.default_stream(), dy.rows(first[e], first[e + 1]), true, x.rows(first[e], first[e + 1]), false,
            weight_grads[e], 1.0, 1.0);
  }
}

}  // namespace spindle::cpu
