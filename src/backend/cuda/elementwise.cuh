// A generic elementwise kernel over NIN inputs and NOUT outputs of one dtype, with 16-byte vector
// loads and stores when every pointer allows them. Used by elementwise.cu, activation.cu, adamw.cu.
#pragma once

#include <cstdint>

#include "backend/cuda/device_util.cuh"

namespace spindle::cuda {

template <typename T, int N>
struct PtrArray {
  T* p[N > 0 ? N : 1];
};

template <typename T, int VEC>
struct alignas(sizeof(T) * VEC) Pack {
  T v[VEC];
};

// op(const float (&in)[NIN], float (&out)[NOUT]) computes one element in f32. Outputs may alias
// inputs (in-place ops): each element is read before it is written by the same thread.
template <typename T, int VEC, int NIN, int NOUT, typename Op>
__global__ void elementwise_kernel(PtrArray<const T, NIN> in, PtrArray<T, NOUT> out, int64_t n, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nvec = n / VEC;
  for (int64_t i = first; i < nvec; i += stride) {
    Pack<T, VEC> a[NIN > 0 ? NIN : 1], b[NOUT];
#pragma unroll
    for (int k = 0; k < NIN; ++k) a[k] = reinterpret_cast<const Pack<T, VEC>*>(in.p[k])[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) {
      float x[NIN > 0 ? NIN : 1], y[NOUT];
#pragma unroll
      for (int k = 0; k < NIN; ++k) x[k] = to_f32(a[k].v[j]);
      op(x, y);
#pragma unroll
      for (int k = 0; k < NOUT; ++k) b[k].v[j] = from_f32<T>(y[k]);
    }
#pragma unroll
    for (int k = 0; k < NOUT; ++k) reinterpret_cast<Pack<T, VEC>*>(out.p[k])[i] = b[k];
  }
  for (int64_t i = nvec * VEC + first; i < n; i += stride) {  // the tail that does not fill a vector
    float x[NIN > 0 ? NIN : 1], y[NOUT];
#pragma unroll
    for (int k = 0; k < NIN; ++k) x[k] = to_f32(in.p[k][i]);
    op(x, y);
#pragma unroll
    for (int k = 0; k < NOUT; ++k) out.p[k][i] = from_f32<T>(y[k]);
  }
}

template <typename T, int NIN, int NOUT, typename Op>
void launch_elementwise(cudaStream_t s, PtrArray<const T, NIN> in, PtrArray<T, NOUT> out, int64_t n, Op op) {
  if (n == 0) return;
  bool aligned = true;
  for (int k = 0; k < NIN; ++k) aligned &= reinterpret_cast<uintptr_t>(in.p[k]) % 16 == 0;
  for (int k = 0; k < NOUT; ++k) aligned &= reinterpret_cast<uintptr_t>(out.p[k]) % 16 == 0;
  constexpr int kThreads = 256;
  constexpr int kVec = 16 / sizeof(T);
  if (aligned) {
    elementwise_kernel<T, kVec, NIN, NOUT><<<grid_for(n / kVec + 1, kThreads), kThreads, 0, s>>>(in, out, n, op);
  } else {
    elementwise_kernel<T, 1, NIN, NOUT><<<grid_for(n, kThreads), kThreads, 0, s>>>(in, out, n, op);
  }
  CUDA_CHECK_LAUNCH();
}

}  // namespace spindle::cuda
