#include "loss/lm_head_loss.h"

#include <algorithm>

#include "core/error.h"

namespace spindle {

int64_t lm_head_chunk_rows(int64_t vocab, DType dtype, size_t budget_bytes) {
  const size_t row_bytes = static_cast<size_t>(vocab) * dtype_size(dtype);
  return std::max<int64_t>(1, static_cast<int64_t>(budget_bytes / std::max<size_t>(row_bytes, 1)));
}

void lm_head_cross_entropy(Backend& backend, Stream stream, const LmHeadLossArgs& a) {
  const int64_t n = a.hidden->dim(0), vocab = a.weight->dim(0);
  SPINDLE_CHECK(a.hidden->dim(1) == a.weight->dim(1), "hidden {} vs lm_head {}", a.hidden->describe(),
                a.weight->describe());
  SPINDLE_CHECK(a.loss_sum != nullptr, "lm_head_cross_entropy needs a loss accumulator");
  if (n == 0) return;  // a shard without supervised tokens contributes nothing (but still joins collectives upstream)
  const bool backward = a.dhidden || a.dweight;
  const int64_t chunk = std::min<int64_t>(std::max<int64_t>(1, a.chunk_rows), n);
  const double cap = a.logit_softcap;
  Tensor logits_buffer = backend.empty(Shape{chunk, vocab}, a.hidden->dtype());
  Tensor raw_buffer;  // [chunk, V] the logits before the soft-cap (soft-capped only)
  if (cap > 0) raw_buffer = backend.empty(Shape{chunk, vocab}, a.hidden->dtype());
  for (int64_t begin = 0; begin < n; begin += chunk) {
    const int64_t end = std::min(n, begin + chunk), rows = end - begin;
    Tensor logits = logits_buffer.rows(0, rows);
    const Tensor h = a.hidden->rows(begin, end);
    if (cap > 0) {
      Tensor raw = raw_buffer.rows(0, rows);
      backend.gemm(stream, h, false, *a.weight, true, raw, 1.0, 0.0);  // [rows, V] = h · Wᵀ
      backend.softcap_forward(stream, raw, cap, logits);
    } else {
      backend.gemm(stream, h, false, *a.weight, true, logits, 1.0, 0.0);  // [rows, V] = h · Wᵀ
    }
    Tensor token_ce = a.token_ce ? a.token_ce->rows(begin, end) : Tensor();
    backend.cross_entropy(stream, logits, a.targets->rows(begin, end), a.weights->rows(begin, end), a.loss_scale,
                          backward ? a.loss_scale : 0.0, *a.loss_sum, token_ce);
    if (!backward) continue;
    // logits now hold dlogits (of the capped logits: through the cap's derivative, from the capped
    // values made again in the raw buffer)
    if (cap > 0) {
      Tensor raw = raw_buffer.rows(0, rows);
      backend.softcap_forward(stream, raw, cap, raw);
      backend.softcap_backward(stream, raw, cap, logits);
    }
    if (a.dhidden) {
      Tensor dh = a.dhidden->rows(begin, end);
      backend.gemm(stream, logits, false, *a.weight, false, dh, 1.0, 0.0);  // [rows, H] = dlogits · W
    }
    if (a.dweight) backend.gemm(stream, logits, true, h, false, *a.dweight, 1.0, 1.0);  // [V, H] += dlogitsᵀ · h
  }
}

}  // namespace spindle
