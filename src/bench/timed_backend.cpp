#include "bench/timed_backend.h"

namespace spindle::bench {

const char* category_name(OpCategory c) {
  switch (c) {
    case OpCategory::Attention: return "attention";
    case OpCategory::Gemm: return "gemm";
    case OpCategory::Communication: return "communication";
    case OpCategory::OtherOps: return "other_ops";
    case OpCategory::kCount: break;
  }
  return "?";
}

std::array<double, static_cast<size_t>(OpCategory::kCount)> OpRecorder::totals_ms() {
  std::array<double, static_cast<size_t>(OpCategory::kCount)> totals{};
  for (const Record& r : open_) totals[static_cast<size_t>(r.category)] += timer_->elapsed_ms(r.begin, r.end);
  return totals;
}

using C = OpCategory;

void TimedBackend::copy_from_host(Stream s, const void* src, Tensor& dst) {
  timed(s, C::OtherOps, [&] { inner_.copy_from_host(s, src, dst); });
}
void TimedBackend::copy_to_host(Stream s, const Tensor& src, void* dst) {
  timed(s, C::OtherOps, [&] { inner_.copy_to_host(s, src, dst); });
}
void TimedBackend::copy(Stream s, const Tensor& src, Tensor& dst) {
  timed(s, C::OtherOps, [&] { inner_.copy(s, src, dst); });
}
void TimedBackend::fill(Stream s, Tensor& t, double value) {
  timed(s, C::OtherOps, [&] { inner_.fill(s, t, value); });
}
void TimedBackend::scale(Stream s, Tensor& x, double alpha) {
  timed(s, C::OtherOps, [&] { inner_.scale(s, x, alpha); });
}
void TimedBackend::axpy(Stream s, double alpha, const Tensor& x, Tensor& y) {
  timed(s, C::OtherOps, [&] { inner_.axpy(s, alpha, x, y); });
}
void TimedBackend::sum_squares(Stream s, const Tensor& x, Tensor& out) {
  timed(s, C::OtherOps, [&] { inner_.sum_squares(s, x, out); });
}
void TimedBackend::gemm(Stream s, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                        double alpha, double beta) {
  timed(s, C::Gemm, [&] { inner_.gemm(s, a, trans_a, b, trans_b, c, alpha, beta); });
}
void TimedBackend::add_bias(Stream s, Tensor& y, const Tensor& bias) {
  timed(s, C::OtherOps, [&] { inner_.add_bias(s, y, bias); });
}
void TimedBackend::bias_backward(Stream s, const Tensor& dy, Tensor& dbias) {
  timed(s, C::OtherOps, [&] { inner_.bias_backward(s, dy, dbias); });
}
void TimedBackend::embedding_forward(Stream s, const Tensor& ids, const Tensor& table, Tensor& out) {
  timed(s, C::OtherOps, [&] { inner_.embedding_forward(s, ids, table, out); });
}
void TimedBackend::embedding_backward(Stream s, const Tensor& ids, const Tensor& dout, Tensor& dtable) {
  timed(s, C::OtherOps, [&] { inner_.embedding_backward(s, ids, dout, dtable); });
}
void TimedBackend::rmsnorm_forward(Stream s, const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  timed(s, C::OtherOps, [&] { inner_.rmsnorm_forward(s, x, w, eps, y, rstd); });
}
void TimedBackend::rmsnorm_backward(Stream s, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                                    Tensor& dx, Tensor& dw, bool accumulate_dx) {
  timed(s, C::OtherOps, [&] { inner_.rmsnorm_backward(s, x, w, rstd, dy, dx, dw, accumulate_dx); });
}
void TimedBackend::rope(Stream s, Tensor& x, const Tensor& positions, const Tensor& inv_freq, double attention_scale,
                        int sign) {
  timed(s, C::OtherOps, [&] { inner_.rope(s, x, positions, inv_freq, attention_scale, sign); });
}
void TimedBackend::attention_forward(Stream s, const Tensor& q, const Tensor& k, const Tensor& v,
                                     const AttentionMask& mask, double scale, Tensor& out, Tensor& lse) {
  timed(s, C::Attention, [&] { inner_.attention_forward(s, q, k, v, mask, scale, out, lse); });
}
void TimedBackend::attention_backward(Stream s, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                      const Tensor& dout, const Tensor& lse, const AttentionMask& mask, double scale,
                                      Tensor& dq, Tensor& dk, Tensor& dv, bool accumulate) {
  timed(s, C::Attention, [&] { inner_.attention_backward(s, q, k, v, out, dout, lse, mask, scale, dq, dk, dv, accumulate); });
}
void TimedBackend::attention_merge(Stream s, Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b) {
  timed(s, C::Attention, [&] { inner_.attention_merge(s, out, lse, out_b, lse_b); });
}
void TimedBackend::swiglu_forward(Stream s, const Tensor& gate, const Tensor& up, Tensor& out) {
  timed(s, C::OtherOps, [&] { inner_.swiglu_forward(s, gate, up, out); });
}
void TimedBackend::swiglu_backward(Stream s, const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                                   Tensor& dup) {
  timed(s, C::OtherOps, [&] { inner_.swiglu_backward(s, gate, up, dout, dgate, dup); });
}
void TimedBackend::gather_rows(Stream s, const Tensor& src, const Tensor& idx, Tensor& dst) {
  timed(s, C::OtherOps, [&] { inner_.gather_rows(s, src, idx, dst); });
}
void TimedBackend::scatter_add_rows(Stream s, const Tensor& src, const Tensor& idx, Tensor& dst) {
  timed(s, C::OtherOps, [&] { inner_.scatter_add_rows(s, src, idx, dst); });
}
void TimedBackend::cross_entropy(Stream s, Tensor& logits, const Tensor& targets, const Tensor& weights,
                                 double loss_scale, double grad_scale, Tensor& loss_sum, Tensor& token_ce) {
  timed(s, C::OtherOps,
        [&] { inner_.cross_entropy(s, logits, targets, weights, loss_scale, grad_scale, loss_sum, token_ce); });
}
void TimedBackend::adamw_step(Stream s, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& hp) {
  timed(s, C::OtherOps, [&] { inner_.adamw_step(s, param, grad, m, v, hp); });
}

}  // namespace spindle::bench
