#include "backend/cpu/moe_ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "core/error.h"

namespace spindle::cpu {

namespace {

void require_on_cpu(const Tensor& t, const char* op, const char* what) {
  SPINDLE_CHECK(t.defined(), "{}: {} not allocated", op, what);
  SPINDLE_CHECK(t.device().kind == DeviceKind::CPU, "{}: {} {} is not on the CPU", op, what, t.describe());
}

void require_float(const Tensor& t, const char* op, const char* what) {
  require_on_cpu(t, op, what);
  if (t.dtype() != DType::F32 && t.dtype() != DType::F64)
    fail("{}: {} must be F32 or F64 on the CPU backend, got {}", op, what, t.describe());
}

void require_index(const Tensor& t, const char* op, const char* what) {
  require_on_cpu(t, op, what);
  SPINDLE_CHECK(t.dtype() == DType::I32, "{}: {} must be I32, got {}", op, what, t.describe());
}

void require_shape(const Tensor& t, const Shape& shape, const char* op, const char* what) {
  SPINDLE_CHECK(t.shape() == shape, "{}: {} is {}, expected {}", op, what, t.describe(), shape.str());
}

// Element access to an F32 or F64 tensor through doubles.
double load(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data_as<double>()[i] : static_cast<double>(t.data_as<float>()[i]);
}
void store(Tensor& t, int64_t i, double v) {
  if (t.dtype() == DType::F64) t.data_as<double>()[i] = v;
  else t.data_as<float>()[i] = static_cast<float>(v);
}

// A token counts for the load-balancing statistics unless it is padding (document −1).
bool real_token(const Tensor& token_doc, int64_t t) {
  return !token_doc.defined() || token_doc.data_as<int32_t>()[t] >= 0;
}

}  // namespace

void moe_router_forward(const Tensor& logits, int64_t top_k, bool normalize, Tensor& probs, Tensor& topk_index,
                        Tensor& topk_weight) {
  const char* op = "moe_router_forward";
  require_float(logits, op, "logits");
  require_float(probs, op, "probs");
  require_index(topk_index, op, "topk_index");
  require_float(topk_weight, op, "topk_weight");
  SPINDLE_CHECK(logits.rank() == 2, "{}: logits {}", op, logits.describe());
  const int64_t tokens = logits.dim(0), experts = logits.dim(1);
  SPINDLE_CHECK(top_k >= 1 && top_k <= experts, "{}: top_k {} of {} experts", op, top_k, experts);
  require_shape(probs, Shape{tokens, experts}, op, "probs");
  require_shape(topk_index, Shape{tokens, top_k}, op, "topk_index");
  require_shape(topk_weight, Shape{tokens, top_k}, op, "topk_weight");
  int32_t* index = topk_index.data_as<int32_t>();
#pragma omp parallel for if (tokens > 64)
  for (int64_t t = 0; t < tokens; ++t) {
    double peak = -INFINITY;
    for (int64_t e = 0; e < experts; ++e) peak = std::max(peak, load(logits, t * experts + e));
    double z = 0;
    for (int64_t e = 0; e < experts; ++e) z += std::exp(load(logits, t * experts + e) - peak);
    for (int64_t e = 0; e < experts; ++e) store(probs, t * experts + e, std::exp(load(logits, t * experts + e) - peak) / z);
    // Selection on the stored probabilities (what transformers ranks: its F32 softmax).
    std::vector<int32_t> order(static_cast<size_t>(experts));
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(), [&](int32_t a, int32_t b) {
      const double pa = load(probs, t * experts + a), pb = load(probs, t * experts + b);
      return pa > pb || (pa == pb && a < b);
    });
    double sum = 0;
    for (int64_t j = 0; j < top_k; ++j) sum += load(probs, t * experts + order[j]);
    for (int64_t j = 0; j < top_k; ++j) {
      index[t * top_k + j] = order[j];
      const double p = load(probs, t * experts + order[j]);
      store(topk_weight, t * top_k + j, normalize ? p / sum : p);
    }
  }
}

void moe_router_backward(const Tensor& probs, const Tensor& topk_index, const Tensor& d_topk_weight, bool normalize,
                         const Tensor& aux_grad, const Tensor& token_doc, Tensor& dlogits) {
  const char* op = "moe_router_backward";
  require_float(probs, op, "probs");
  require_index(topk_index, op, "topk_index");
  require_float(d_topk_weight, op, "d_topk_weight");
  require_float(dlogits, op, "dlogits");
  const int64_t tokens = probs.dim(0), experts = probs.dim(1), top_k = topk_index.dim(1);
  require_shape(topk_index, Shape{tokens, top_k}, op, "topk_index");
  require_shape(d_topk_weight, Shape{tokens, top_k}, op, "d_topk_weight");
  require_shape(dlogits, Shape{tokens, experts}, op, "dlogits");
  if (aux_grad.defined()) {
    require_float(aux_grad, op, "aux_grad");
    require_shape(aux_grad, Shape{experts}, op, "aux_grad");
  }
  if (token_doc.defined()) {
    require_index(token_doc, op, "token_doc");
    require_shape(token_doc, Shape{tokens}, op, "token_doc");
  }
  const int32_t* index = topk_index.data_as<int32_t>();
#pragma omp parallel for if (tokens > 64)
  for (int64_t t = 0; t < tokens; ++t) {
    // w_j = s_j / S with s_j the selected probabilities, S = Σ s: ∂L/∂s_j = (∂L/∂w_j − Σ_m ∂L/∂w_m w_m) / S.
    double sum = 0, weighted = 0;
    for (int64_t j = 0; j < top_k; ++j) sum += load(probs, t * experts + index[t * top_k + j]);
    if (normalize)
      for (int64_t j = 0; j < top_k; ++j)
        weighted += load(d_topk_weight, t * top_k + j) * load(probs, t * experts + index[t * top_k + j]) / sum;
    std::vector<double> dp(static_cast<size_t>(experts), 0.0);
    if (aux_grad.defined() && real_token(token_doc, t))
      for (int64_t e = 0; e < experts; ++e) dp[e] = load(aux_grad, e);
    for (int64_t j = 0; j < top_k; ++j) {
      const double dw = load(d_topk_weight, t * top_k + j);
      dp[index[t * top_k + j]] += normalize ? (dw - weighted) / sum : dw;
    }
    // Softmax: ∂L/∂z_e = p_e (∂L/∂p_e − Σ_e' p_e' ∂L/∂p_e').
    double dot = 0;
    for (int64_t e = 0; e < experts; ++e) dot += load(probs, t * experts + e) * dp[e];
    for (int64_t e = 0; e < experts; ++e) store(dlogits, t * experts + e, load(probs, t * experts + e) * (dp[e] - dot));
  }
}

void moe_sigmoid_router_forward(const Tensor& logits, const Tensor& correction_bias, const SigmoidRouting& routing,
                                Tensor& scores, Tensor& topk_index, Tensor& topk_weight) {
  const char* op = "moe_sigmoid_router_forward";
  require_float(logits, op, "logits");
  require_float(correction_bias, op, "correction_bias");
  require_float(scores, op, "scores");
  require_index(topk_index, op, "topk_index");
  require_float(topk_weight, op, "topk_weight");
  SPINDLE_CHECK(logits.rank() == 2, "{}: logits {}", op, logits.describe());
  const int64_t tokens = logits.dim(0), experts = logits.dim(1), top_k = routing.top_k;
  const int64_t groups = routing.groups, per_group = groups > 0 ? experts / groups : 0;
  SPINDLE_CHECK(groups >= 1 && experts % groups == 0 && per_group >= 2, "{}: {} experts in {} groups", op, experts,
                groups);
  SPINDLE_CHECK(routing.top_groups >= 1 && routing.top_groups <= groups && top_k >= 1 &&
                    top_k <= routing.top_groups * per_group,
                "{}: top_k {} from {} of {} groups of {} experts", op, top_k, routing.top_groups, groups, per_group);
  require_shape(correction_bias, Shape{experts}, op, "correction_bias");
  require_shape(scores, Shape{tokens, experts}, op, "scores");
  require_shape(topk_index, Shape{tokens, top_k}, op, "topk_index");
  require_shape(topk_weight, Shape{tokens, top_k}, op, "topk_weight");
  // The choice is ranked in the stat dtype's own arithmetic: in F32, the F32 sums transformers forms.
  const bool single = scores.dtype() == DType::F32;
  auto in_stat = [single](double v) { return single ? static_cast<double>(static_cast<float>(v)) : v; };
  int32_t* index = topk_index.data_as<int32_t>();
#pragma omp parallel for if (tokens > 64)
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<double> choice(static_cast<size_t>(experts));
    for (int64_t e = 0; e < experts; ++e) {
      store(scores, t * experts + e, 1.0 / (1.0 + std::exp(-load(logits, t * experts + e))));
      choice[e] = in_stat(load(scores, t * experts + e) + load(correction_bias, e));
    }
    // Each group's score, the sum of its two largest choices; the best top_groups groups stay.
    std::vector<double> group_score(static_cast<size_t>(groups));
    for (int64_t g = 0; g < groups; ++g) {
      double first = -INFINITY, second = -INFINITY;
      for (int64_t e = g * per_group; e < (g + 1) * per_group; ++e) {
        if (choice[e] > first) {
          second = first;
          first = choice[e];
        } else if (choice[e] > second) {
          second = choice[e];
        }
      }
      group_score[g] = in_stat(first + second);
    }
    std::vector<int32_t> group_order(static_cast<size_t>(groups));
    std::iota(group_order.begin(), group_order.end(), 0);
    std::partial_sort(group_order.begin(), group_order.begin() + routing.top_groups, group_order.end(),
                      [&](int32_t a, int32_t b) {
                        return group_score[a] > group_score[b] || (group_score[a] == group_score[b] && a < b);
                      });
    std::vector<int32_t> candidates;
    candidates.reserve(static_cast<size_t>(routing.top_groups * per_group));
    for (int64_t i = 0; i < routing.top_groups; ++i)
      for (int64_t e = group_order[i] * per_group; e < (group_order[i] + 1) * per_group; ++e)
        candidates.push_back(static_cast<int32_t>(e));
    std::partial_sort(candidates.begin(), candidates.begin() + top_k, candidates.end(), [&](int32_t a, int32_t b) {
      return choice[a] > choice[b] || (choice[a] == choice[b] && a < b);
    });
    double sum = 0;
    for (int64_t j = 0; j < top_k; ++j) sum += load(scores, t * experts + candidates[j]);
    const double denominator = in_stat(in_stat(sum) + 1e-20);
    for (int64_t j = 0; j < top_k; ++j) {
      index[t * top_k + j] = candidates[j];
      const double s = load(scores, t * experts + candidates[j]);
      store(topk_weight, t * top_k + j, (routing.normalize ? in_stat(s / denominator) : s) * routing.scaling);
    }
  }
}

void moe_sigmoid_router_backward(const Tensor& scores, const Tensor& topk_index, const Tensor& d_topk_weight,
                                 const SigmoidRouting& routing, Tensor& dlogits) {
  const char* op = "moe_sigmoid_router_backward";
  require_float(scores, op, "scores");
  require_index(topk_index, op, "topk_index");
  require_float(d_topk_weight, op, "d_topk_weight");
  require_float(dlogits, op, "dlogits");
  const int64_t tokens = scores.dim(0), experts = scores.dim(1), top_k = topk_index.dim(1);
  require_shape(topk_index, Shape{tokens, top_k}, op, "topk_index");
  require_shape(d_topk_weight, Shape{tokens, top_k}, op, "d_topk_weight");
  require_shape(dlogits, Shape{tokens, experts}, op, "dlogits");
  const int32_t* index = topk_index.data_as<int32_t>();
#pragma omp parallel for if (tokens > 64)
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t e = 0; e < experts; ++e) store(dlogits, t * experts + e, 0.0);
    // w_j = c·s_j / D, D = Σ_m s_m + 1e-20 (c·s_j without renormalisation):
    // ∂L/∂s_j = (c/D)·(∂L/∂w_j − Σ_m ∂L/∂w_m·s_m / D); then through σ, ∂s/∂z = s·(1 − s).
    double denominator = 1e-20, weighted = 0;
    for (int64_t j = 0; j < top_k; ++j) denominator += load(scores, t * experts + index[t * top_k + j]);
    for (int64_t j = 0; j < top_k; ++j)
      weighted += load(d_topk_weight, t * top_k + j) * load(scores, t * experts + index[t * top_k + j]);
    for (int64_t j = 0; j < top_k; ++j) {
      const int32_t e = index[t * top_k + j];
      const double s = load(scores, t * experts + e), dw = load(d_topk_weight, t * top_k + j);
      const double ds = routing.normalize ? routing.scaling / denominator * (dw - weighted / denominator)
                                          : routing.scaling * dw;
      store(dlogits, t * experts + e, load(dlogits, t * experts + e) + ds * s * (1.0 - s));
    }
  }
}

void moe_router_statistics(const Tensor& probs, const Tensor& topk_index, const Tensor& token_doc, Tensor& counts,
                           Tensor& prob_sums) {
  const char* op = "moe_router_statistics";
  require_float(probs, op, "probs");
  require_index(topk_index, op, "topk_index");
  require_float(counts, op, "counts");
  require_float(prob_sums, op, "prob_sums");
  const int64_t tokens = probs.dim(0), experts = probs.dim(1), top_k = topk_index.dim(1);
  require_shape(topk_index, Shape{tokens, top_k}, op, "topk_index");
  require_shape(counts, Shape{experts}, op, "counts");
  require_shape(prob_sums, Shape{experts}, op, "prob_sums");
  if (token_doc.defined()) {
    require_index(token_doc, op, "token_doc");
    require_shape(token_doc, Shape{tokens}, op, "token_doc");
  }
  std::vector<double> count(static_cast<size_t>(experts), 0.0), mass(static_cast<size_t>(experts), 0.0);
  const int32_t* index = topk_index.data_as<int32_t>();
  for (int64_t t = 0; t < tokens; ++t) {
    if (!real_token(token_doc, t)) continue;
    for (int64_t j = 0; j < top_k; ++j) count[index[t * top_k + j]] += 1;
    for (int64_t e = 0; e < experts; ++e) mass[e] += load(probs, t * experts + e);
  }
  for (int64_t e = 0; e < experts; ++e) {
    store(counts, e, load(counts, e) + count[e]);
    store(prob_sums, e, load(prob_sums, e) + mass[e]);
  }
}

void moe_permute(const Tensor& topk_index, int64_t num_experts, Tensor& rows_token, Tensor& row_of_slot,
                 Tensor& offsets) {
  const char* op = "moe_permute";
  require_index(topk_index, op, "topk_index");
  require_index(rows_token, op, "rows_token");
  require_index(row_of_slot, op, "row_of_slot");
  require_index(offsets, op, "offsets");
  const int64_t tokens = topk_index.dim(0), top_k = topk_index.dim(1), rows = tokens * top_k;
  require_shape(rows_token, Shape{rows}, op, "rows_token");
  require_shape(row_of_slot, Shape{rows}, op, "row_of_slot");
  require_shape(offsets, Shape{num_experts + 1}, op, "offsets");
  const int32_t* index = topk_index.data_as<int32_t>();
  int32_t* first = offsets.data_as<int32_t>();
  // Counting sort of the (token, slot) pairs by expert; within an expert, in (token, slot) order.
  std::vector<int64_t> next(static_cast<size_t>(num_experts) + 1, 0);
  for (int64_t i = 0; i < rows; ++i) {
    SPINDLE_CHECK(index[i] >= 0 && index[i] < num_experts, "{}: expert {} of {}", op, index[i], num_experts);
    ++next[static_cast<size_t>(index[i]) + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) next[e + 1] += next[e];
  for (int64_t e = 0; e <= num_experts; ++e) first[e] = static_cast<int32_t>(next[e]);
  int32_t* token = rows_token.data_as<int32_t>();
  int32_t* row = row_of_slot.data_as<int32_t>();
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t r = next[index[i]]++;
    token[r] = static_cast<int32_t>(i / top_k);
    row[i] = static_cast<int32_t>(r);
  }
}

void moe_combine(const Tensor& y, const Tensor& row_of_slot, const Tensor& topk_index, const Tensor& topk_weight,
                 Tensor& out) {
  const char* op = "moe_combine";
  require_float(y, op, "y");
  require_index(row_of_slot, op, "row_of_slot");
  require_index(topk_index, op, "topk_index");
  require_float(topk_weight, op, "topk_weight");
  require_float(out, op, "out");
  SPINDLE_CHECK(y.dtype() == out.dtype(), "{}: y {} and out {} differ in dtype", op, y.describe(), out.describe());
  const int64_t tokens = topk_index.dim(0), top_k = topk_index.dim(1), hidden = out.numel() / std::max<int64_t>(1, tokens);
  require_shape(out, Shape{tokens, hidden}, op, "out");
  require_shape(y, Shape{tokens * top_k, hidden}, op, "y");
  require_shape(row_of_slot, Shape{tokens * top_k}, op, "row_of_slot");
  require_shape(topk_weight, Shape{tokens, top_k}, op, "topk_weight");
  const int32_t* index = topk_index.data_as<int32_t>();
  const int32_t* row = row_of_slot.data_as<int32_t>();
#pragma omp parallel for if (tokens > 64)
  for (int64_t t = 0; t < tokens; ++t) {
    // transformers adds the experts' contributions in expert order (its loop over experts).
    std::vector<int64_t> slots(static_cast<size_t>(top_k));
    std::iota(slots.begin(), slots.end(), 0);
    std::sort(slots.begin(), slots.end(), [&](int64_t a, int64_t b) { return index[t * top_k + a] < index[t * top_k + b]; });
    for (int64_t h = 0; h < hidden; ++h) {
      double acc = 0;
      for (int64_t j : slots) acc += load(topk_weight, t * top_k + j) * load(y, row[t * top_k + j] * hidden + h);
      store(out, t * hidden + h, acc);
    }
  }
}

void moe_combine_backward(const Tensor& dout, const Tensor& y, const Tensor& row_of_slot, const Tensor& topk_weight,
                          Tensor& dy, Tensor& d_topk_weight) {
  const char* op = "moe_combine_backward";
  require_float(dout, op, "dout");
  require_float(y, op, "y");
  require_index(row_of_slot, op, "row_of_slot");
  require_float(topk_weight, op, "topk_weight");
  require_float(dy, op, "dy");
  require_float(d_topk_weight, op, "d_topk_weight");
  const int64_t tokens = topk_weight.dim(0), top_k = topk_weight.dim(1), hidden = dout.numel() / std::max<int64_t>(1, tokens);
  require_shape(dout, Shape{tokens, hidden}, op, "dout");
  require_shape(y, Shape{tokens * top_k, hidden}, op, "y");
  require_shape(dy, Shape{tokens * top_k, hidden}, op, "dy");
  require_shape(row_of_slot, Shape{tokens * top_k}, op, "row_of_slot");
  require_shape(d_topk_weight, Shape{tokens, top_k}, op, "d_topk_weight");
  const int32_t* row = row_of_slot.data_as<int32_t>();
#pragma omp parallel for if (tokens > 64)
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t r = row[t * top_k + j];
      const double w = load(topk_weight, t * top_k + j);
      double dot = 0;
      for (int64_t h = 0; h < hidden; ++h) {
        const double g = load(dout, t * hidden + h);
        dot += load(y, r * hidden + h) * g;
        store(dy, r * hidden + h, w * g);
      }
      store(d_topk_weight, t * top_k + j, dot);
    }
}

void clamped_swiglu_forward(const Tensor& gate_up, double alpha, double limit, Tensor& out) {
  require_float(gate_up, "clamped_swiglu_forward", "gate_up");
  require_float(out, "clamped_swiglu_forward", "out");
  const int64_t rows = gate_up.dim(0), width = gate_up.dim(1) / 2;
  SPINDLE_CHECK(gate_up.shape().rank() == 2 && gate_up.dim(1) == 2 * width, "clamped_swiglu_forward: gate_up {}",
                gate_up.describe());
  require_shape(out, Shape{rows, width}, "clamped_swiglu_forward", "out");
  for (int64_t i = 0; i < rows * width; ++i) {
    const double g = std::min(load(gate_up, 2 * i), limit);
    const double u = std::clamp(load(gate_up, 2 * i + 1), -limit, limit);
    store(out, i, (u + 1.0) * g / (1.0 + std::exp(-alpha * g)));
  }
}

void clamped_swiglu_backward(const Tensor& gate_up, const Tensor& dout, double alpha, double limit, Tensor& d_gate_up) {
  require_float(gate_up, "clamped_swiglu_backward", "gate_up");
  require_float(dout, "clamped_swiglu_backward", "dout");
  require_float(d_gate_up, "clamped_swiglu_backward", "d_gate_up");
  const int64_t rows = gate_up.dim(0), width = gate_up.dim(1) / 2;
  require_shape(dout, Shape{rows, width}, "clamped_swiglu_backward", "dout");
  require_shape(d_gate_up, gate_up.shape(), "clamped_swiglu_backward", "d_gate_up");
  for (int64_t i = 0; i < rows * width; ++i) {
    const double gate = load(gate_up, 2 * i), up = load(gate_up, 2 * i + 1), d = load(dout, i);
    const double g = std::min(gate, limit), u = std::clamp(up, -limit, limit);
    const double sig = 1.0 / (1.0 + std::exp(-alpha * g));
    // ∂out/∂g = (u + 1)·(σ + alpha·g·σ·(1 − σ)), ∂out/∂u = g·σ; zero where a clamp holds (torch.clamp's
    // gradient passes at the bounds themselves).
    store(d_gate_up, 2 * i, gate <= limit ? d * (u + 1.0) * sig * (1.0 + alpha * g * (1.0 - sig)) : 0.0);
    store(d_gate_up, 2 * i + 1, up >= -limit && up <= limit ? d * g * sig : 0.0);
  }
}

}  // namespace spindle::cpu
