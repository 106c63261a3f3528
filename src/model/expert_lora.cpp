#include "model/expert_lora.h"

#include <cstring>

#include "core/error.h"

namespace spindle {

namespace {

// A's rows of each expert: E views [r, in] of `a` [E·r, in] (a value or a gradient).
std::vector<Tensor> per_expert_a(const Tensor& a, int64_t experts, int64_t rank) {
  std::vector<Tensor> out;
  out.reserve(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e) out.push_back(a.rows(e * rank, (e + 1) * rank));
  return out;
}

// Rows begin … end − 1 of each expert's B_e: E views [end − begin, r] of `b` [E, out, r].
std::vector<Tensor> per_expert_b(const Tensor& b, int64_t experts, int64_t out_features, int64_t rank,
                                 int64_t begin, int64_t end) {
  std::vector<Tensor> out;
  out.reserve(static_cast<size_t>(experts));
  for (int64_t e = 0; e < experts; ++e)
    out.push_back(b.flat((e * out_features + begin) * rank, (end - begin) * rank).reshape(Shape{end - begin, rank}));
  return out;
}

// Moves elements between PEFT's [out, r·E] (column j·E + e) and [E, out, r], either way.
void permute_b(const Tensor& src, Tensor& dst, bool from_peft) {
  SPINDLE_CHECK(src.defined() && dst.defined() && src.device().kind == DeviceKind::CPU &&
                    dst.device().kind == DeviceKind::CPU && src.dtype() == dst.dtype() && src.numel() == dst.numel(),
                "expert LoRA B layout: {} and {} must be host tensors of one dtype and size", src.describe(),
                dst.describe());
  const Tensor& experts_layout = from_peft ? dst : src;
  SPINDLE_CHECK(experts_layout.rank() == 3, "expert LoRA B layout: {} is not [E, out, r]", experts_layout.describe());
  const int64_t experts = experts_layout.dim(0), out = experts_layout.dim(1), rank = experts_layout.dim(2);
  const size_t elem = dtype_size(src.dtype());
  const char* from = static_cast<const char*>(src.data());
  char* to = static_cast<char*>(dst.data());
  for (int64_t e = 0; e < experts; ++e)
    for (int64_t o = 0; o < out; ++o)
      for (int64_t j = 0; j < rank; ++j) {
        const int64_t peft = o * rank * experts + j * experts + e, ours = (e * out + o) * rank + j;
        const int64_t s = from_peft ? peft : ours, d = from_peft ? ours : peft;
        std::memcpy(to + static_cast<size_t>(d) * elem, from + static_cast<size_t>(s) * elem, elem);
      }
}

}  // namespace

std::vector<std::string> expert_target_parameters(const std::string& target) {
  static const std::string gate_up = "mlp.experts.gate_up_proj", down = "mlp.experts.down_proj";
  if (target == "experts") return {gate_up, down};
  if (target == "experts.gate_up_proj" || target == gate_up) return {gate_up};
  if (target == "experts.down_proj" || target == down) return {down};
  return {};
}

bool ExpertLora::matches(const std::string& target_parameter) const {
  const std::string full = key();
  return full == target_parameter ||
         (full.size() > target_parameter.size() && full.ends_with(target_parameter) &&
          full[full.size() - target_parameter.size() - 1] == '.');
}

std::vector<Parameter*> ExpertLora::parameters() const {
  if (!adapted()) return {};
  return {a, b};
}

void ExpertLora::down_project(Backend& be, Stream st, const Tensor& x, const Tensor& offsets, Tensor& xs) const {
  be.moe_grouped_gemm(st, x, per_expert_a(a->value, experts, rank), true, offsets, xs, false);
  be.scale(st, xs, scaling);
}

void ExpertLora::up_project(Backend& be, Stream st, const Tensor& xs, const Tensor& offsets, int64_t begin,
                            int64_t end, Tensor& y) const {
  be.moe_grouped_gemm(st, xs, per_expert_b(b->value, experts, out, rank, begin, end), true, offsets, y, true);
}

void ExpertLora::backward(Backend& be, Stream st, const Tensor& x, const Tensor& xs, const Tensor& offsets,
                          const std::vector<OutputGrad>& dys, Tensor* dx) const {
  // dB_e[begin:end] += dyᵀ·xs, and dxs = Σ dy·B_e[begin:end] (the gradient of xs).
  Tensor dxs = be.empty(xs.shape(), xs.dtype());  // [N, r]
  bool first = true;
  for (const OutputGrad& part : dys) {
    if (b->trainable) {
      std::vector<Tensor> grads = per_expert_b(b->grad, experts, out, rank, part.begin, part.end);
      be.moe_grouped_gemm_weight_grad(st, *part.dy, xs, offsets, grads);
    }
    be.moe_grouped_gemm(st, *part.dy, per_expert_b(b->value, experts, out, rank, part.begin, part.end), false,
                        offsets, dxs, !first);
    first = false;
  }
  // xs = s·x·Aᵀ: the gradient of x·Aᵀ is s·dxs.
  be.scale(st, dxs, scaling);
  if (a->trainable) {
    std::vector<Tensor> grads = per_expert_a(a->grad, experts, rank);
    be.moe_grouped_gemm_weight_grad(st, dxs, x, offsets, grads);
  }
  if (dx) be.moe_grouped_gemm(st, dxs, per_expert_a(a->value, experts, rank), false, offsets, *dx, true);
}

void expert_lora_b_from_peft(const Tensor& peft, Tensor& experts) { permute_b(peft, experts, true); }
void expert_lora_b_to_peft(const Tensor& experts, Tensor& peft) { permute_b(experts, peft, false); }

}  // namespace spindle
