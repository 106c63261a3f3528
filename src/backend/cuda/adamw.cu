// Decoupled AdamW on f32 master weights, moments and gradients (one fused pass, 16-byte loads).
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

struct AdamWOp {
  AdamWParams h;
  float step, inv_sqrt_bc2, decay;
  // in: param, grad, m, v; out: param, m, v
  __device__ void operator()(const float (&in)[4], float (&o)[3]) const {
    const float g = in[1] * h.grad_scale;
    const float mi = h.beta1 * in[2] + (1.0f - h.beta1) * g;
    const float vi = h.beta2 * in[3] + (1.0f - h.beta2) * g * g;
    o[0] = in[0] * decay - step * mi / (sqrtf(vi) * inv_sqrt_bc2 + h.eps);
    o[1] = mi;
    o[2] = vi;
  }
};

}  // namespace

void adamw(cudaStream_t s, float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& hp) {
  const AdamWOp op{hp, hp.lr / hp.bias_correction1, 1.0f / sqrtf(hp.bias_correction2), 1.0f - hp.lr * hp.weight_decay};
  launch_elementwise<float, 4, 3>(s, {{param, grad, m, v}}, {{param, m, v}}, n, op);
}

}  // namespace spindle::cuda
