#include "bench/timed_backend.h"

#include <algorithm>

#include <fmt/format.h>

namespace spindle::bench {

const char* category_name(OpCategory c) {
  switch (c) {
    case OpCategory::Attention: return "attention";
    case OpCategory::Gemm: return "gemm";
    case OpCategory::Communication: return "communication";
    case OpCategory::OtherOps: return "other_ops";
    case OpCategory::OverlappedCommunication: return "overlapped_communication";
    case OpCategory::kCount: break;
  }
  return "?";
}

std::array<double, static_cast<size_t>(OpCategory::kCount)> OpRecorder::totals_ms() {
  std::array<double, static_cast<size_t>(OpCategory::kCount)> totals{};
  for (const Record& r : open_)
    if (r.end >= 0) totals[static_cast<size_t>(r.category)] += timer_->elapsed_ms(r.begin, r.end);
  return totals;
}

double OpObserver::attention_pairs(const AttentionMask& mask, int64_t window, int64_t tq, int64_t tk) {
  const double q = static_cast<double>(tq), k = static_cast<double>(tk);
  if (!mask.plain_causal) return window > 0 ? std::min(q * k / 2, q * static_cast<double>(window)) : q * k / 2;
  if (window <= 0 || window >= tq) return q * (q + 1) / 2;
  // Query i sees min(i + 1, W) keys.
  const double w = static_cast<double>(window);
  return w * (w + 1) / 2 + (q - w) * w;
}

int OpRecorder::begin(Stream stream, OpCategory category, const std::string& label, double flops, double bytes) {
  auto [it, inserted] = label_index_.try_emplace(label, static_cast<int>(labels_.size()));
  if (inserted) labels_.push_back(label);
  open_.push_back({category, it->second, flops, bytes, timer_->mark(stream), -1});
  return static_cast<int>(open_.size()) - 1;
}

std::vector<OpTime> OpRecorder::op_table() {
  std::vector<OpTime> table(labels_.size());
  for (size_t i = 0; i < labels_.size(); ++i) table[i].label = labels_[i];
  for (const Record& r : open_) {
    if (r.end < 0) continue;  // its call threw
    OpTime& t = table[static_cast<size_t>(r.label)];
    t.category = r.category;
    t.calls += 1;
    t.ms += timer_->elapsed_ms(r.begin, r.end);
    t.flops += r.flops;
    t.bytes += r.bytes;
  }
  std::stable_sort(table.begin(), table.end(), [](const OpTime& a, const OpTime& b) { return a.ms > b.ms; });
  return table;
}

using C = OpCategory;

namespace {

// The least bytes an op moves through device memory: each tensor it reads once, each it writes
// once (a tensor it reads and writes, such as an accumulated output, is listed twice). Undefined
// tensors and null pointers count nothing.
double bytes_of(std::initializer_list<const Tensor*> tensors) {
  double b = 0;
  for (const Tensor* t : tensors)
    if (t && t->defined()) b += static_cast<double>(t->bytes());
  return b;
}
double bytes_of(const std::vector<Tensor>& tensors) {
  double b = 0;
  for (const Tensor& t : tensors) b += static_cast<double>(t.bytes());
  return b;
}

// "gemm M×N×K op(A)op(B)[ +C][ +bias]" and 2·M·N·K.
std::pair<std::string, double> gemm_label(const Tensor& a, bool trans_a, const Tensor& c, bool trans_b, double beta,
                                          bool bias) {
  // C [M, N] = op(A) [M, K] · op(B) [K, N]
  const int64_t m = c.shape()[0], n = c.shape()[-1], k = trans_a ? a.shape()[0] : a.shape()[-1];
  return {fmt::format("gemm {}x{}x{} {}{}{}{}", m, n, k, trans_a ? 'T' : 'N', trans_b ? 'T' : 'N', beta != 0 ? " +C" : "",
                      bias ? " +bias" : ""),
          2.0 * m * n * k};
}

// The chunked gated delta rule's FLOPs forward, counted once (docs/perf.md): 2·(3·dk·dv + 2.5·C·dv)
// per token and value head; the backward recomputes the chunk states and costs three times that.
double delta_rule_flops(const Tensor& q, const Tensor& v, int64_t chunk_size) {
  if (q.rank() != 3 || v.rank() != 3) return 0;
  const double t = static_cast<double>(v.dim(0)), hv = static_cast<double>(v.dim(1));
  const double dk = static_cast<double>(q.dim(2)), dv = static_cast<double>(v.dim(2));
  return t * hv * 2 * (3 * dk * dv + 2.5 * static_cast<double>(chunk_size) * dv);
}

}  // namespace

double TimedBackend::attention_flops(const Tensor& q, const Tensor& k, const AttentionMask& mask,
                                     const AttentionLogits& logits) {
  if (q.rank() != 3 || k.rank() != 3) return 0;  // q [Tq, Hq, D]: QKᵀ and PV, 2 FLOPs per multiply-add each
  return 4.0 * static_cast<double>(q.dim(1) * q.dim(2)) *
         observer_.attention_pairs(mask, logits.window, q.dim(0), k.dim(0));
}

void TimedBackend::copy_from_host(Stream s, const void* src, Tensor& dst) {
  timed(s, C::OtherOps, "copy_from_host", 0, bytes_of({&dst}), [&] { inner_.copy_from_host(s, src, dst); });
}
void TimedBackend::copy_to_host(Stream s, const Tensor& src, void* dst) {
  timed(s, C::OtherOps, "copy_to_host", 0, bytes_of({&src}), [&] { inner_.copy_to_host(s, src, dst); });
}
void TimedBackend::copy(Stream s, const Tensor& src, Tensor& dst) {
  timed(s, C::OtherOps, "copy", 0, bytes_of({&src, &dst}), [&] { inner_.copy(s, src, dst); });
}
void TimedBackend::fill(Stream s, Tensor& t, double value) {
  timed(s, C::OtherOps, "fill", 0, bytes_of({&t}), [&] { inner_.fill(s, t, value); });
}
void TimedBackend::fill_random_uniform(Stream s, Tensor& t, uint64_t seed, uint64_t sequence, double half_width) {
  timed(s, C::OtherOps, "fill_random_uniform", 0, bytes_of({&t}),
        [&] { inner_.fill_random_uniform(s, t, seed, sequence, half_width); });
}
void TimedBackend::scale(Stream s, Tensor& x, double alpha) {
  timed(s, C::OtherOps, "scale", 0, bytes_of({&x, &x}), [&] { inner_.scale(s, x, alpha); });
}
void TimedBackend::axpy(Stream s, double alpha, const Tensor& x, Tensor& y) {
  timed(s, C::OtherOps, "axpy", 0, bytes_of({&x, &y, &y}), [&] { inner_.axpy(s, alpha, x, y); });
}
void TimedBackend::sum_squares(Stream s, const Tensor& x, Tensor& out) {
  timed(s, C::OtherOps, "sum_squares", 0, bytes_of({&x, &out}), [&] { inner_.sum_squares(s, x, out); });
}
void TimedBackend::gemm(Stream s, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                        double alpha, double beta) {
  const auto [label, flops] = gemm_label(a, trans_a, c, trans_b, beta, false);
  timed(s, C::Gemm, label, flops, bytes_of({&a, &b, &c, beta != 0 ? &c : nullptr}),
        [&] { inner_.gemm(s, a, trans_a, b, trans_b, c, alpha, beta); });
}
void TimedBackend::gemm_bias(Stream s, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                             double alpha, double beta, const Tensor& bias) {
  const auto [label, flops] = gemm_label(a, trans_a, c, trans_b, beta, true);
  timed(s, C::Gemm, label, flops, bytes_of({&a, &b, &c, &bias, beta != 0 ? &c : nullptr}),
        [&] { inner_.gemm_bias(s, a, trans_a, b, trans_b, c, alpha, beta, bias); });
}
void TimedBackend::lora_b_backward(Stream s, const Tensor& dy, const Tensor& b, const Tensor& xa, double scaling,
                                   Tensor& dxa, Tensor* db) {
  // "lora_b_backward T×out×r[ +dB]": 2·T·out·r FLOPs per product
  const int64_t t = dy.shape()[0], out = dy.shape()[-1], r = b.shape()[-1];
  const std::string label = fmt::format("lora_b_backward {}x{}x{}{}", t, out, r, db ? " +dB" : "");
  timed(s, C::Gemm, label, (db ? 4.0 : 2.0) * t * out * r, bytes_of({&dy, &b, &xa, &dxa, db, db}),
        [&] { inner_.lora_b_backward(s, dy, b, xa, scaling, dxa, db); });
}
void TimedBackend::add_bias(Stream s, Tensor& y, const Tensor& bias) {
  timed(s, C::OtherOps, "add_bias", 0, bytes_of({&y, &y, &bias}), [&] { inner_.add_bias(s, y, bias); });
}
void TimedBackend::bias_backward(Stream s, const Tensor& dy, Tensor& dbias) {
  timed(s, C::OtherOps, "bias_backward", 0, bytes_of({&dy, &dbias, &dbias}), [&] { inner_.bias_backward(s, dy, dbias); });
}
void TimedBackend::embedding_forward(Stream s, const Tensor& ids, const Tensor& table, Tensor& out) {
  // The rows read from the table are as many bytes as the output.
  timed(s, C::OtherOps, "embedding_forward", 0, bytes_of({&ids, &out, &out}),
        [&] { inner_.embedding_forward(s, ids, table, out); });
}
void TimedBackend::embedding_backward(Stream s, const Tensor& ids, const Tensor& dout, Tensor& dtable,
                                      int64_t padding_id) {
  timed(s, C::OtherOps, "embedding_backward", 0, bytes_of({&ids, &dout, &dout, &dout}),
        [&] { inner_.embedding_backward(s, ids, dout, dtable, padding_id); });
}
void TimedBackend::rmsnorm_forward(Stream s, const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  timed(s, C::OtherOps, "rmsnorm_forward", 0, bytes_of({&x, &w, &y, &rstd}),
        [&] { inner_.rmsnorm_forward(s, x, w, eps, y, rstd); });
}
void TimedBackend::rmsnorm_backward(Stream s, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                                    Tensor& dx, Tensor* dw, bool accumulate_dx) {
  timed(s, C::OtherOps, "rmsnorm_backward", 0,
        bytes_of({&x, &w, &rstd, &dy, &dx, accumulate_dx ? &dx : nullptr, dw}),
        [&] { inner_.rmsnorm_backward(s, x, w, rstd, dy, dx, dw, accumulate_dx); });
}
void TimedBackend::rope(Stream s, Tensor& x, const Tensor& positions, const Tensor& inv_freq, double attention_scale,
                        int sign) {
  timed(s, C::OtherOps, "rope", 0, bytes_of({&x, &x, &positions, &inv_freq}),
        [&] { inner_.rope(s, x, positions, inv_freq, attention_scale, sign); });
}
void TimedBackend::attention_forward(Stream s, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const AttentionMask& mask, const AttentionLogits& logits, Tensor& out,
                                     Tensor& lse) {
  timed(s, C::Attention, "attention_forward", attention_flops(q, k, mask, logits), bytes_of({&q, &k, &v, &out, &lse}),
        [&] { inner_.attention_forward(s, q, k, v, mask, logits, out, lse); });
}
void TimedBackend::attention_backward(Stream s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                      const Tensor& dout, const Tensor& lse, const AttentionMask& mask,
                                      const AttentionLogits& logits, Tensor& dq, Tensor& dk, Tensor& dv,
                                      bool accumulate) {
  // FlashAttention's convention: the backward's five products are 2.5 forwards.
  const Tensor* again = accumulate ? &dq : nullptr;
  timed(s, C::Attention, "attention_backward", 2.5 * attention_flops(q, k, mask, logits),
        bytes_of({&q, &k, &v, &out, &dout, &lse, &dq, &dk, &dv, again, accumulate ? &dk : nullptr,
                  accumulate ? &dv : nullptr}),
        [&] { inner_.attention_backward(s, q, k, v, out, dout, lse, mask, logits, dq, dk, dv, accumulate); });
}
void TimedBackend::attention_merge(Stream s, Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b) {
  timed(s, C::Attention, "attention_merge", 0, bytes_of({&out, &out, &lse, &lse, &out_b, &lse_b}),
        [&] { inner_.attention_merge(s, out, lse, out_b, lse_b); });
}
void TimedBackend::attention_sink_forward(Stream s, Tensor& out, Tensor& lse, const Tensor& sinks) {
  timed(s, C::Attention, "attention_sink_forward", 0, bytes_of({&out, &out, &lse, &lse, &sinks}),
        [&] { inner_.attention_sink_forward(s, out, lse, sinks); });
}
void TimedBackend::attention_sink_backward(Stream s, const Tensor& out, const Tensor& dout, const Tensor& lse,
                                           const Tensor& sinks, Tensor& dsinks) {
  timed(s, C::Attention, "attention_sink_backward", 0, bytes_of({&out, &dout, &lse, &sinks, &dsinks, &dsinks}),
        [&] { inner_.attention_sink_backward(s, out, dout, lse, sinks, dsinks); });
}
void TimedBackend::geglu_tanh_forward(Stream s, const Tensor& gate, const Tensor& up, Tensor& out) {
  timed(s, C::OtherOps, "geglu_tanh_forward", 0, bytes_of({&gate, &up, &out}),
        [&] { inner_.geglu_tanh_forward(s, gate, up, out); });
}
void TimedBackend::geglu_tanh_backward(Stream s, const Tensor& gate, const Tensor& up, const Tensor& dout,
                                       Tensor& dgate, Tensor& dup) {
  timed(s, C::OtherOps, "geglu_tanh_backward", 0, bytes_of({&gate, &up, &dout, &dgate, &dup}),
        [&] { inner_.geglu_tanh_backward(s, gate, up, dout, dgate, dup); });
}
void TimedBackend::softcap_forward(Stream s, const Tensor& x, double cap, Tensor& y) {
  timed(s, C::OtherOps, "softcap_forward", 0, bytes_of({&x, &y}), [&] { inner_.softcap_forward(s, x, cap, y); });
}
void TimedBackend::softcap_backward(Stream s, const Tensor& y, double cap, Tensor& d) {
  timed(s, C::OtherOps, "softcap_backward", 0, bytes_of({&y, &d, &d}),
        [&] { inner_.softcap_backward(s, y, cap, d); });
}
void TimedBackend::swiglu_forward(Stream s, const Tensor& gate, const Tensor& up, Tensor& out) {
  timed(s, C::OtherOps, "swiglu_forward", 0, bytes_of({&gate, &up, &out}),
        [&] { inner_.swiglu_forward(s, gate, up, out); });
}
void TimedBackend::swiglu_backward(Stream s, const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                                   Tensor& dup) {
  timed(s, C::OtherOps, "swiglu_backward", 0, bytes_of({&gate, &up, &dout, &dgate, &dup}),
        [&] { inner_.swiglu_backward(s, gate, up, dout, dgate, dup); });
}
void TimedBackend::copy_columns(Stream stream, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                                int64_t width) {
  const double copied = src.rank() == 2 ? 2.0 * static_cast<double>(src.dim(0) * width * dtype_size(src.dtype())) : 0;
  timed(stream, C::OtherOps, "copy_columns", 0, copied,
        [&] { inner_.copy_columns(stream, src, src_col, dst, dst_col, width); });
}
void TimedBackend::rope_partial(Stream stream, Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                                int64_t rotary_dim, double attention_scale, int sign) {
  timed(stream, C::OtherOps, "rope_partial", 0, bytes_of({&x, &x, &positions, &inv_freq}),
        [&] { inner_.rope_partial(stream, x, positions, inv_freq, rotary_dim, attention_scale, sign); });
}
void TimedBackend::sigmoid_gate_forward(Stream stream, const Tensor& x, const Tensor& gate, Tensor& out) {
  timed(stream, C::OtherOps, "sigmoid_gate_forward", 0, bytes_of({&x, &gate, &out}),
        [&] { inner_.sigmoid_gate_forward(stream, x, gate, out); });
}
void TimedBackend::sigmoid_gate_backward(Stream stream, const Tensor& x, const Tensor& gate, const Tensor& dout,
                                         Tensor& dx, Tensor& dgate) {
  timed(stream, C::OtherOps, "sigmoid_gate_backward", 0, bytes_of({&x, &gate, &dout, &dx, &dgate}),
        [&] { inner_.sigmoid_gate_backward(stream, x, gate, dout, dx, dgate); });
}
void TimedBackend::causal_conv1d_silu_forward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids,
                                              Tensor& y) {
  timed(stream, C::OtherOps, "causal_conv1d_silu_forward", 0, bytes_of({&x, &w, &doc_ids, &y}),
        [&] { inner_.causal_conv1d_silu_forward(stream, x, w, doc_ids, y); });
}
void TimedBackend::causal_conv1d_silu_backward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids,
                                               const Tensor& dy, Tensor& dx, Tensor* dw) {
  timed(stream, C::OtherOps, "causal_conv1d_silu_backward", 0, bytes_of({&x, &w, &doc_ids, &dy, &dx, dw}),
        [&] { inner_.causal_conv1d_silu_backward(stream, x, w, doc_ids, dy, dx, dw); });
}
void TimedBackend::l2norm_forward(Stream stream, const Tensor& x, double eps, Tensor& y, Tensor& rstd) {
  timed(stream, C::OtherOps, "l2norm_forward", 0, bytes_of({&x, &y, &rstd}),
        [&] { inner_.l2norm_forward(stream, x, eps, y, rstd); });
}
void TimedBackend::l2norm_backward(Stream stream, const Tensor& y, const Tensor& rstd, const Tensor& dy, Tensor& dx) {
  timed(stream, C::OtherOps, "l2norm_backward", 0, bytes_of({&y, &rstd, &dy, &dx}),
        [&] { inner_.l2norm_backward(stream, y, rstd, dy, dx); });
}
void TimedBackend::deltanet_conv_split_forward(Stream stream, const Tensor& qkv, const Tensor& w,
                                               const Tensor& doc_ids, double eps, Tensor& q, Tensor& k, Tensor& v,
                                               Tensor& q_rstd, Tensor& k_rstd) {
  timed(stream, C::OtherOps, "deltanet_conv_split_forward", 0,
        bytes_of({&qkv, &w, &doc_ids, &q, &k, &v, &q_rstd, &k_rstd}),
        [&] { inner_.deltanet_conv_split_forward(stream, qkv, w, doc_ids, eps, q, k, v, q_rstd, k_rstd); });
}
void TimedBackend::deltanet_conv_split_backward(Stream stream, const Tensor& qkv, const Tensor& w,
                                                const Tensor& doc_ids, const Tensor& q, const Tensor& k,
                                                const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& dq,
                                                const Tensor& dk, const Tensor& dv, Tensor& d_qkv, Tensor* dw) {
  timed(stream, C::OtherOps, "deltanet_conv_split_backward", 0,
        bytes_of({&qkv, &w, &doc_ids, &q, &k, &q_rstd, &k_rstd, &dq, &dk, &dv, &d_qkv, dw}), [&] {
          inner_.deltanet_conv_split_backward(stream, qkv, w, doc_ids, q, k, q_rstd, k_rstd, dq, dk, dv, d_qkv, dw);
        });
}
void TimedBackend::gated_delta_gates_forward(Stream stream, const Tensor& a, const Tensor& b, const Tensor& a_log,
                                             const Tensor& dt_bias, Tensor& g, Tensor& beta) {
  timed(stream, C::OtherOps, "gated_delta_gates_forward", 0, bytes_of({&a, &b, &a_log, &dt_bias, &g, &beta}),
        [&] { inner_.gated_delta_gates_forward(stream, a, b, a_log, dt_bias, g, beta); });
}
void TimedBackend::gated_delta_gates_backward(Stream stream, const Tensor& a, const Tensor& beta, const Tensor& a_log,
                                              const Tensor& dt_bias, const Tensor& g, const Tensor& dg,
                                              const Tensor& dbeta, Tensor& da, Tensor& db, Tensor* da_log,
                                              Tensor* ddt_bias) {
  timed(stream, C::OtherOps, "gated_delta_gates_backward", 0,
        bytes_of({&a, &beta, &a_log, &dt_bias, &g, &dg, &dbeta, &da, &db, da_log, ddt_bias}), [&] {
          inner_.gated_delta_gates_backward(stream, a, beta, a_log, dt_bias, g, dg, dbeta, da, db, da_log, ddt_bias);
        });
}
void TimedBackend::gated_delta_rule_forward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                            const Tensor& g, const Tensor& beta, const Tensor& doc_ids, double scale,
                                            int64_t chunk_size, Tensor& out) {
  timed(stream, C::Attention, "gated_delta_rule_forward", delta_rule_flops(q, v, chunk_size),
        bytes_of({&q, &k, &v, &g, &beta, &doc_ids, &out}),
        [&] { inner_.gated_delta_rule_forward(stream, q, k, v, g, beta, doc_ids, scale, chunk_size, out); });
}
void TimedBackend::gated_delta_rule_backward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                             const Tensor& g, const Tensor& beta, const Tensor& doc_ids, double scale,
                                             int64_t chunk_size, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                             Tensor& dg, Tensor& dbeta) {
  timed(stream, C::Attention, "gated_delta_rule_backward", 3 * delta_rule_flops(q, v, chunk_size),
        bytes_of({&q, &k, &v, &g, &beta, &doc_ids, &dout, &dq, &dk, &dv, &dg, &dbeta}), [&] {
          inner_.gated_delta_rule_backward(stream, q, k, v, g, beta, doc_ids, scale, chunk_size, dout, dq, dk, dv, dg,
                                           dbeta);
        });
}
void TimedBackend::gated_delta_rule_forward_states(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                                   const Tensor& g, const Tensor& beta, const Tensor& run_ids,
                                                   double scale, int64_t chunk_size, const Tensor& initial_states,
                                                   Tensor& out, Tensor& final_states) {
  timed(stream, C::Attention, "gated_delta_rule_forward_states", delta_rule_flops(q, v, chunk_size),
        bytes_of({&q, &k, &v, &g, &beta, &run_ids, &initial_states, &out, &final_states}), [&] {
          inner_.gated_delta_rule_forward_states(stream, q, k, v, g, beta, run_ids, scale, chunk_size, initial_states,
                                                 out, final_states);
        });
}
void TimedBackend::gated_delta_rule_backward_states(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                                    const Tensor& g, const Tensor& beta, const Tensor& run_ids,
                                                    double scale, int64_t chunk_size, const Tensor& initial_states,
                                                    const Tensor& dout, const Tensor& d_final_states, Tensor& dq,
                                                    Tensor& dk, Tensor& dv, Tensor& dg, Tensor& dbeta,
                                                    Tensor& d_initial_states) {
  timed(stream, C::Attention, "gated_delta_rule_backward_states", 3 * delta_rule_flops(q, v, chunk_size),
        bytes_of({&q, &k, &v, &g, &beta, &run_ids, &initial_states, &dout, &d_final_states, &dq, &dk, &dv, &dg, &dbeta,
                  &d_initial_states}),
        [&] {
          inner_.gated_delta_rule_backward_states(stream, q, k, v, g, beta, run_ids, scale, chunk_size, initial_states,
                                                  dout, d_final_states, dq, dk, dv, dg, dbeta, d_initial_states);
        });
}
void TimedBackend::gated_rmsnorm_forward(Stream stream, const Tensor& x, const Tensor& z, const Tensor& w, double eps,
                                         Tensor& y, Tensor& rstd) {
  timed(stream, C::OtherOps, "gated_rmsnorm_forward", 0, bytes_of({&x, &z, &w, &y, &rstd}),
        [&] { inner_.gated_rmsnorm_forward(stream, x, z, w, eps, y, rstd); });
}
void TimedBackend::gated_rmsnorm_backward(Stream stream, const Tensor& x, const Tensor& z, const Tensor& w,
                                          const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& dz, Tensor* dw) {
  timed(stream, C::OtherOps, "gated_rmsnorm_backward", 0, bytes_of({&x, &z, &w, &rstd, &dy, &dx, &dz, dw}),
        [&] { inner_.gated_rmsnorm_backward(stream, x, z, w, rstd, dy, dx, dz, dw); });
}
void TimedBackend::shared_expert_gate_forward(Stream stream, const Tensor& shared, const Tensor& gate, Tensor& out) {
  timed(stream, C::OtherOps, "shared_expert_gate_forward", 0, bytes_of({&shared, &gate, &out}),
        [&] { inner_.shared_expert_gate_forward(stream, shared, gate, out); });
}
void TimedBackend::shared_expert_gate_backward(Stream stream, const Tensor& shared, const Tensor& gate,
                                               const Tensor& dout, Tensor& d_shared, Tensor& d_gate) {
  timed(stream, C::OtherOps, "shared_expert_gate_backward", 0, bytes_of({&shared, &gate, &dout, &d_shared, &d_gate}),
        [&] { inner_.shared_expert_gate_backward(stream, shared, gate, dout, d_shared, d_gate); });
}
void TimedBackend::moe_router_forward(Stream s, const Tensor& logits, int64_t top_k, bool normalize, Tensor& probs,
                                      Tensor& topk_index, Tensor& topk_weight) {
  timed(s, C::OtherOps, "moe_router_forward", 0, bytes_of({&logits, &probs, &topk_index, &topk_weight}),
        [&] { inner_.moe_router_forward(s, logits, top_k, normalize, probs, topk_index, topk_weight); });
}
void TimedBackend::moe_router_backward(Stream s, const Tensor& probs, const Tensor& topk_index,
                                       const Tensor& d_topk_weight, bool normalize, const Tensor& aux_grad,
                                       const Tensor& token_doc, Tensor& dlogits) {
  timed(s, C::OtherOps, "moe_router_backward", 0,
        bytes_of({&probs, &topk_index, &d_topk_weight, &aux_grad, &token_doc, &dlogits}), [&] {
          inner_.moe_router_backward(s, probs, topk_index, d_topk_weight, normalize, aux_grad, token_doc, dlogits);
        });
}
void TimedBackend::moe_router_statistics(Stream s, const Tensor& probs, const Tensor& topk_index,
                                         const Tensor& token_doc, Tensor& counts, Tensor& prob_sums) {
  timed(s, C::OtherOps, "moe_router_statistics", 0, bytes_of({&probs, &topk_index, &token_doc, &counts, &prob_sums}),
        [&] { inner_.moe_router_statistics(s, probs, topk_index, token_doc, counts, prob_sums); });
}
void TimedBackend::moe_sigmoid_router_forward(Stream s, const Tensor& logits, const Tensor& correction_bias,
                                              const SigmoidRouting& routing, Tensor& scores, Tensor& topk_index,
                                              Tensor& topk_weight) {
  timed(s, C::OtherOps, "moe_sigmoid_router_forward", 0,
        bytes_of({&logits, &correction_bias, &scores, &topk_index, &topk_weight}),
        [&] { inner_.moe_sigmoid_router_forward(s, logits, correction_bias, routing, scores, topk_index, topk_weight); });
}
void TimedBackend::moe_sigmoid_router_backward(Stream s, const Tensor& scores, const Tensor& topk_index,
                                               const Tensor& d_topk_weight, const SigmoidRouting& routing,
                                               Tensor& dlogits) {
  timed(s, C::OtherOps, "moe_sigmoid_router_backward", 0, bytes_of({&scores, &topk_index, &d_topk_weight, &dlogits}),
        [&] { inner_.moe_sigmoid_router_backward(s, scores, topk_index, d_topk_weight, routing, dlogits); });
}
void TimedBackend::moe_permute(Stream s, const Tensor& topk_index, int64_t num_experts, Tensor& rows_token,
                               Tensor& row_of_slot, Tensor& offsets) {
  timed(s, C::OtherOps, "moe_permute", 0, bytes_of({&topk_index, &rows_token, &row_of_slot, &offsets}),
        [&] { inner_.moe_permute(s, topk_index, num_experts, rows_token, row_of_slot, offsets); });
}
// "moe_grouped_gemm N×n×k[ +=]" over all N routed rows: 2·N·n·k FLOPs, whatever the routing.
void TimedBackend::moe_grouped_gemm(Stream s, const Tensor& x, const std::vector<Tensor>& weights,
                                    bool transpose_weight, const Tensor& offsets, Tensor& y, bool accumulate) {
  const int64_t n = x.rank() == 2 ? x.dim(0) : 0, k = x.rank() == 2 ? x.dim(1) : 0, m = y.rank() == 2 ? y.dim(1) : 0;
  const std::string label = fmt::format("moe_grouped_gemm {}x{}x{}{}{}", n, m, k, transpose_weight ? "" : " (dx)",
                                        accumulate ? " +=" : "");
  timed(s, C::Gemm, label, 2.0 * static_cast<double>(n) * static_cast<double>(m) * static_cast<double>(k),
        bytes_of({&x, &offsets, &y, accumulate ? &y : nullptr}) + bytes_of(weights),
        [&] { inner_.moe_grouped_gemm(s, x, weights, transpose_weight, offsets, y, accumulate); });
}
void TimedBackend::moe_grouped_gemm_weight_grad(Stream s, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                                std::vector<Tensor>& weight_grads) {
  const int64_t n = x.rank() == 2 ? x.dim(0) : 0, k = x.rank() == 2 ? x.dim(1) : 0, m = dy.rank() == 2 ? dy.dim(1) : 0;
  const std::string label = fmt::format("moe_grouped_gemm_weight_grad {}x{}x{}", m, k, n);
  timed(s, C::Gemm, label, 2.0 * static_cast<double>(n) * static_cast<double>(m) * static_cast<double>(k),
        bytes_of({&dy, &x, &offsets}) + 2 * bytes_of(weight_grads),
        [&] { inner_.moe_grouped_gemm_weight_grad(s, dy, x, offsets, weight_grads); });
}
void TimedBackend::moe_combine(Stream s, const Tensor& y, const Tensor& row_of_slot, const Tensor& topk_index,
                               const Tensor& topk_weight, Tensor& out) {
  timed(s, C::OtherOps, "moe_combine", 0, bytes_of({&y, &row_of_slot, &topk_index, &topk_weight, &out}),
        [&] { inner_.moe_combine(s, y, row_of_slot, topk_index, topk_weight, out); });
}
void TimedBackend::moe_combine_backward(Stream s, const Tensor& dout, const Tensor& y, const Tensor& row_of_slot,
                                        const Tensor& topk_weight, Tensor& dy, Tensor& d_topk_weight) {
  timed(s, C::OtherOps, "moe_combine_backward", 0,
        bytes_of({&dout, &y, &row_of_slot, &topk_weight, &dy, &d_topk_weight}),
        [&] { inner_.moe_combine_backward(s, dout, y, row_of_slot, topk_weight, dy, d_topk_weight); });
}
void TimedBackend::clamped_swiglu_forward(Stream s, const Tensor& gate_up, double alpha, double limit, Tensor& out) {
  timed(s, C::OtherOps, "clamped_swiglu_forward", 0, bytes_of({&gate_up, &out}),
        [&] { inner_.clamped_swiglu_forward(s, gate_up, alpha, limit, out); });
}
void TimedBackend::clamped_swiglu_backward(Stream s, const Tensor& gate_up, const Tensor& dout, double alpha,
                                           double limit, Tensor& d_gate_up) {
  timed(s, C::OtherOps, "clamped_swiglu_backward", 0, bytes_of({&gate_up, &dout, &d_gate_up}),
        [&] { inner_.clamped_swiglu_backward(s, gate_up, dout, alpha, limit, d_gate_up); });
}
void TimedBackend::gather_rows(Stream s, const Tensor& src, const Tensor& idx, Tensor& dst) {
  // The rows read are as many bytes as the output.
  timed(s, C::OtherOps, "gather_rows", 0, bytes_of({&idx, &dst, &dst}), [&] { inner_.gather_rows(s, src, idx, dst); });
}
void TimedBackend::scatter_add_rows(Stream s, const Tensor& src, const Tensor& idx, Tensor& dst) {
  // The rows added to are read and written: as many bytes as src, twice.
  timed(s, C::OtherOps, "scatter_add_rows", 0, bytes_of({&src, &idx, &src, &src}),
        [&] { inner_.scatter_add_rows(s, src, idx, dst); });
}
void TimedBackend::dequantize_4bit(Stream s, const Tensor& packed, const Tensor& absmax, int64_t blocksize,
                                   Quant4Type type, Tensor& w) {
  timed(s, C::OtherOps, "dequantize_4bit", 0, bytes_of({&packed, &absmax, &w}),
        [&] { inner_.dequantize_4bit(s, packed, absmax, blocksize, type, w); });
}
void TimedBackend::dequantize_absmax(Stream s, const Tensor& codes, const Tensor& code_map, const Tensor& absmax2,
                                     int64_t blocksize2, double offset, Tensor& absmax) {
  timed(s, C::OtherOps, "dequantize_absmax", 0, bytes_of({&codes, &code_map, &absmax2, &absmax}),
        [&] { inner_.dequantize_absmax(s, codes, code_map, absmax2, blocksize2, offset, absmax); });
}
void TimedBackend::quantize_4bit(Stream s, const Tensor& w, int64_t blocksize, Quant4Type type, Tensor& packed,
                                 Tensor& absmax) {
  timed(s, C::OtherOps, "quantize_4bit", 0, bytes_of({&w, &packed, &absmax}),
        [&] { inner_.quantize_4bit(s, w, blocksize, type, packed, absmax); });
}
void TimedBackend::quantize_absmax(Stream s, const Tensor& absmax, const Tensor& code_map, double offset,
                                   int64_t blocksize2, Tensor& codes, Tensor& absmax2) {
  timed(s, C::OtherOps, "quantize_absmax", 0, bytes_of({&absmax, &code_map, &codes, &absmax2}),
        [&] { inner_.quantize_absmax(s, absmax, code_map, offset, blocksize2, codes, absmax2); });
}
void TimedBackend::cross_entropy(Stream s, Tensor& logits, const Tensor& targets, const Tensor& weights,
                                 double loss_scale, double grad_scale, Tensor& loss_sum, Tensor& token_ce) {
  // The logits are read and their gradient written in their place.
  timed(s, C::OtherOps, "cross_entropy", 0, bytes_of({&logits, &logits, &targets, &weights, &loss_sum, &token_ce}),
        [&] { inner_.cross_entropy(s, logits, targets, weights, loss_scale, grad_scale, loss_sum, token_ce); });
}
void TimedBackend::adamw_step(Stream s, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& hp) {
  timed(s, C::OtherOps, "adamw_step", 0, bytes_of({&param, &param, &grad, &m, &m, &v, &v}),
        [&] { inner_.adamw_step(s, param, grad, m, v, hp); });
}

}  // namespace spindle::bench
