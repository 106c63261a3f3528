#include "model/linear.h"

#include "core/error.h"

namespace spindle {

namespace {

// y = a·bᵀ·alpha + beta·y (+ bias)
void gemm_maybe_bias(Backend& be, Stream st, const Tensor& a, const Tensor& b, Tensor& y, double alpha, double beta,
                     const Parameter* bias) {
  if (bias) be.gemm_bias(st, a, false, b, true, y, alpha, beta, bias->value);
  else be.gemm(st, a, false, b, true, y, alpha, beta);
}

// In BF16 the rank-r product of a LoRA projection goes first and the large GEMM adds onto it: adding
// a rank-r product to a finished y would read and write all of y once more (and round y twice
// more), while the large GEMM reads y for a fraction of that (H200, Qwen2.5-1.5B at 32k: 20 ms
// less GEMM time per step, the bias pass gone). F32 and F64, the reference precisions, keep PEFT's
// order — base, bias, then the LoRA term — so they match its rounding.
bool lora_term_first(const Tensor& y) { return y.dtype() == DType::BF16; }

}  // namespace

Tensor Linear::dense_weight(Backend& be, Stream st, DType dtype) const {
  if (format == WeightFormat::Dense) return weight->value;
  SPINDLE_CHECK(quant.packed && quant.absmax && quant.packed->value.defined(), "{}: quantised weight not loaded",
                prefix);
  Tensor absmax = quant.absmax->value;
  if (quant.nested()) {  // the absmax themselves are 8-bit codes: decode them first
    absmax = be.empty(quant.absmax->value.shape(), DType::F32);
    be.dequantize_absmax(st, quant.absmax->value, quant.nested_code, quant.nested_absmax->value,
                         quant.nested_blocksize, quant.offset, absmax);
  }
  Tensor w = be.empty(Shape{out, in}, dtype);
  be.dequantize_4bit(st, quant.packed->value, absmax, quant.blocksize,
                     format == WeightFormat::NF4 ? Quant4Type::NF4 : Quant4Type::FP4, w);
  return w;
}

std::vector<Parameter*> Linear::parameters() const {
  std::vector<Parameter*> out;
  for (Parameter* p : {weight, quant.packed, quant.absmax, quant.nested_absmax, bias, lora_a, lora_b})
    if (p) out.push_back(p);
  return out;
}

void Linear::allocate(Backend& backend, LinearActivations& a, int64_t tokens, DType dtype) const {
  if (lora_a && (!a.xa.defined() || a.xa.dim(0) != tokens)) a.xa = backend.empty(Shape{tokens, lora_rank()}, dtype);
}

void Linear::forward(Backend& be, Stream st, const Tensor& x, Tensor& y, LinearActivations& a) const {
  const Tensor w = dense_weight(be, st, x.dtype());
  if (lora_a && lora_term_first(y)) {
    be.gemm(st, x, false, lora_a->value, true, a.xa, 1.0, 0.0);
    gemm_maybe_bias(be, st, a.xa, lora_b->value, y, lora_scaling, 0.0, bias);
    be.gemm(st, x, false, w, true, y, 1.0, 1.0);
    return;
  }
  gemm_maybe_bias(be, st, x, w, y, 1.0, 0.0, bias);
  if (lora_a) {
    be.gemm(st, x, false, lora_a->value, true, a.xa, 1.0, 0.0);
    be.gemm(st, a.xa, false, lora_b->value, true, y, lora_scaling, 1.0);
  }
}

void Linear::save_for_backward(Backend& be, Stream st, const Tensor& x, LinearActivations& a) const {
  if (lora_a) be.gemm(st, x, false, lora_a->value, true, a.xa, 1.0, 0.0);
}

// In BF16 the rank-r term of dx goes first, as in the forward.
void Linear::backward(Backend& be, Stream st, const Tensor& x, const Tensor& dy, const LinearActivations& a,
                      Tensor* dx, bool accumulate_dx) const {
  // A quantised base weight is frozen: no weight gradient, and dx uses its dequantised values.
  const Tensor w = dx ? dense_weight(be, st, dy.dtype()) : Tensor();
  if (weight && weight->trainable) be.gemm(st, dy, true, x, false, weight->grad, 1.0, 1.0);
  if (bias && bias->trainable) be.bias_backward(st, dy, bias->grad);
  const bool lora_first = lora_a && dx && lora_term_first(*dx);
  if (dx && !lora_first) be.gemm(st, dy, false, w, false, *dx, 1.0, accumulate_dx ? 1.0 : 0.0);
  if (lora_a) {
    Tensor dxa = be.empty(a.xa.shape(), a.xa.dtype());
    be.lora_b_backward(st, dy, lora_b->value, a.xa, lora_scaling, dxa, trainable_grad(*lora_b));  // dxa, dB += s·dyᵀ·xa
    if (lora_a->trainable) be.gemm(st, dxa, true, x, false, lora_a->grad, 1.0, 1.0);             // dA += dxaᵀ·x
    if (dx) {
      const bool onto = !lora_first || accumulate_dx;
      be.gemm(st, dxa, false, lora_a->value, false, *dx, 1.0, onto ? 1.0 : 0.0);  // dx (+)= dxa·A
    }
  }
  if (lora_first) be.gemm(st, dy, false, w, false, *dx, 1.0, 1.0);  // dx += dy·W
}

}  // namespace spindle
