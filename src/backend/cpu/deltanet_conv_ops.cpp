#include "backend/cpu/deltanet_conv_ops.h"

#include "core/error.h"

namespace spindle {

namespace {

// q, k [T, Hk, dk], v [T, Hv, dv] against qkv [T, 2·Hk·dk + Hv·dv]; returns Hk·dk.
int64_t split_key_columns(const Tensor& qkv, const Tensor& q, const Tensor& k, const Tensor& v, const char* op) {
  SPINDLE_CHECK(qkv.rank() == 2 && q.rank() == 3 && k.shape() == q.shape() && v.rank() == 3 &&
                    q.dim(0) == qkv.dim(0) && v.dim(0) == qkv.dim(0) &&
                    2 * q.dim(1) * q.dim(2) + v.dim(1) * v.dim(2) == qkv.dim(1),
                "{}: qkv {} does not split into q {}, k {} and v {}", op, qkv.describe(), q.describe(), k.describe(),
                v.describe());
  return q.dim(1) * q.dim(2);
}

}  // namespace

void deltanet_conv_split_forward_by_parts(Backend& be, Stream st, const Tensor& qkv, const Tensor& w,
                                          const Tensor& doc_ids, double eps, Tensor& q, Tensor& k, Tensor& v,
                                          Tensor& q_rstd, Tensor& k_rstd) {
  const int64_t key = split_key_columns(qkv, q, k, v, "deltanet_conv_split_forward");
  const int64_t t = qkv.dim(0), value = qkv.dim(1) - 2 * key;
  Tensor mixed = be.empty(qkv.shape(), qkv.dtype());  // [T, C]
  be.causal_conv1d_silu_forward(st, qkv, w, doc_ids, mixed);
  Tensor q_raw = be.empty(Shape{t, key}, qkv.dtype()), k_raw = be.empty(Shape{t, key}, qkv.dtype());
  Tensor v_flat = v.reshape(Shape{t, value});
  be.copy_columns(st, mixed, 0, q_raw, 0, key);
  be.copy_columns(st, mixed, key, k_raw, 0, key);
  be.copy_columns(st, mixed, 2 * key, v_flat, 0, value);
  be.l2norm_forward(st, q_raw.reshape(q.shape()), eps, q, q_rstd);
  be.l2norm_forward(st, k_raw.reshape(k.shape()), eps, k, k_rstd);
}

void deltanet_conv_split_backward_by_parts(Backend& be, Stream st, const Tensor& qkv, const Tensor& w,
                                           const Tensor& doc_ids, const Tensor& q, const Tensor& k,
                                           const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& dq,
                                           const Tensor& dk, const Tensor& dv, Tensor& d_qkv, Tensor* dw) {
  const int64_t key = split_key_columns(qkv, q, k, dv, "deltanet_conv_split_backward");
  const int64_t t = qkv.dim(0), value = qkv.dim(1) - 2 * key;
  Tensor d_mixed = be.empty(qkv.shape(), qkv.dtype());  // [T, C]
  Tensor dq_raw = be.empty(q.shape(), qkv.dtype()), dk_raw = be.empty(k.shape(), qkv.dtype());
  be.l2norm_backward(st, q, q_rstd, dq, dq_raw);
  be.l2norm_backward(st, k, k_rstd, dk, dk_raw);
  be.copy_columns(st, dq_raw.reshape(Shape{t, key}), 0, d_mixed, 0, key);
  be.copy_columns(st, dk_raw.reshape(Shape{t, key}), 0, d_mixed, key, key);
  be.copy_columns(st, dv.reshape(Shape{t, value}), 0, d_mixed, 2 * key, value);
  be.causal_conv1d_silu_backward(st, qkv, w, doc_ids, d_mixed, d_qkv, dw);
}

}  // namespace spindle
