#include "backend/cpu/shared_expert_ops.h"

#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"

namespace spindle::cpu {

namespace {

void require_float(const Tensor& t, const char* what) {
  SPINDLE_CHECK(t.defined(), "{}: tensor not allocated", what);
  SPINDLE_CHECK(t.device().kind == DeviceKind::CPU, "{}: tensor {} is not on the CPU", what, t.describe());
  if (t.dtype() != DType::F32 && t.dtype() != DType::F64)
    fail("{}: the CPU backend computes in F32 or F64, got {}", what, t.describe());
}

std::vector<double> values(const Tensor& t, const char* what) {
  require_float(t, what);
  std::vector<double> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::F64) {
    std::memcpy(out.data(), t.data(), t.bytes());
  } else {
    const float* p = t.data_as<float>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = p[i];
  }
  return out;
}

void store(Tensor& t, const std::vector<double>& v, const char* what) {
  require_float(t, what);
  SPINDLE_CHECK(static_cast<int64_t>(v.size()) == t.numel(), "{}: {} values for {}", what, v.size(), t.describe());
  if (t.dtype() == DType::F64) {
    std::memcpy(t.data(), v.data(), t.bytes());
  } else {
    float* p = t.data_as<float>();
    for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<float>(v[i]);
  }
}

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

// [T, H] and the gate [T, 1] (or [T]) of the same T.
int64_t check_shapes(const Tensor& shared, const Tensor& gate, const Tensor& other, const char* what) {
  SPINDLE_CHECK(shared.rank() == 2 && other.shape() == shared.shape() && gate.numel() == shared.dim(0),
                "{}: shared {} gate {} (one logit per token) and {}", what, shared.describe(), gate.describe(),
                other.describe());
  return shared.dim(1);
}

}  // namespace

void shared_expert_gate_forward(const Tensor& shared, const Tensor& gate, Tensor& out) {
  const int64_t width = check_shapes(shared, gate, out, "shared_expert_gate_forward");
  const std::vector<double> s = values(shared, "shared_expert_gate shared"), g = values(gate, "shared_expert_gate gate");
  std::vector<double> o = values(out, "shared_expert_gate out");
  for (size_t t = 0; t < g.size(); ++t) {
    const double scale = sigmoid(g[t]);
    for (int64_t h = 0; h < width; ++h) o[t * width + h] += scale * s[t * width + h];
  }
  store(out, o, "shared_expert_gate out");
}

void shared_expert_gate_backward(const Tensor& shared, const Tensor& gate, const Tensor& dout, Tensor& d_shared,
                                 Tensor& d_gate) {
  const int64_t width = check_shapes(shared, gate, dout, "shared_expert_gate_backward");
  SPINDLE_CHECK(d_shared.shape() == shared.shape() && d_gate.numel() == gate.numel(),
                "shared_expert_gate_backward: d_shared {} d_gate {}", d_shared.describe(), d_gate.describe());
  const std::vector<double> s = values(shared, "shared_expert_gate shared"), g = values(gate, "shared_expert_gate gate"),
                            dy = values(dout, "shared_expert_gate dout");
  std::vector<double> ds(s.size()), dg(g.size());
  for (size_t t = 0; t < g.size(); ++t) {
    const double scale = sigmoid(g[t]);
    double dot = 0;
    for (int64_t h = 0; h < width; ++h) {
      ds[t * width + h] = scale * dy[t * width + h];
      dot += dy[t * width + h] * s[t * width + h];
    }
    dg[t] = dot * scale * (1.0 - scale);
  }
  store(d_shared, ds, "shared_expert_gate d_shared");
  store(d_gate, dg, "shared_expert_gate d_gate");
}

}  // namespace spindle::cpu
