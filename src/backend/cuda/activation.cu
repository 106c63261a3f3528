// SwiGLU: out = silu(gate)·up and its backward, in f32 registers over bf16/f32 storage.
#include "backend/cuda/elementwise.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

// expf, not __expf: the fast one loses accuracy for large |x|.
struct SwigluForward {
  __device__ void operator()(const float (&in)[2], float (&o)[1]) const {
    o[0] = in[0] / (1.0f + expf(-in[0])) * in[1];
  }
};

struct SwigluBackward {
  __device__ void operator()(const float (&in)[3], float (&o)[2]) const {
    const float x = in[0], u = in[1], g = in[2];
    const float sig = 1.0f / (1.0f + expf(-x));
    o[0] = g * u * sig * (1.0f + x * (1.0f - sig));  // d/dx [x·σ(x)] = σ(x)(1 + x(1 − σ(x)))
    o[1] = g * x * sig;
  }
};

}  // namespace

void swiglu_forward(cudaStream_t s, const void* gate, const void* up, void* out, DType t, int64_t n) {
  dispatch_compute(t, "swiglu_forward", [&](auto z) {
    using T = decltype(z);
    launch_elementwise<T, 2, 1>(s, {{static_cast<const T*>(gate), static_cast<const T*>(up)}},
                                {{static_cast<T*>(out)}}, n, SwigluForward{});
  });
}

void swiglu_backward(cudaStream_t s, const void* gate, const void* up, const void* dout, void* dgate, void* dup,
                     DType t, int64_t n) {
  dispatch_compute(t, "swiglu_backward", [&](auto z) {
    using T = decltype(z);
    launch_elementwise<T, 3, 2>(
        s, {{static_cast<const T*>(gate), static_cast<const T*>(up), static_cast<const T*>(dout)}},
        {{static_cast<T*>(dgate), static_cast<T*>(dup)}}, n, SwigluBackward{});
  });
}

}  // namespace spindle::cuda
