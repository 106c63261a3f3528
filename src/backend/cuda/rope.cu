// Rotary position embedding in place, HF "rotate_half" layout. The angle is the f32 product
// float(pos)·inv_freq[i], rounded exactly as the CPU reference and transformers compute it; cos and
// sin of that f32 angle are taken in double (angles reach 1e5 rad at long context, where the f32
// sincos loses digits), then the rotation runs in f32.
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

// x [tokens, heads, d]; one thread per (token, pair i < d/2), looping over the heads.
template <typename T>
__global__ void rope_kernel(T* x, int64_t tokens, int64_t heads, int64_t d, const int32_t* pos,
                            const float* inv_freq, double attention_scale, int sign) {
  const int64_t half = d / 2;
  const int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (item >= tokens * half) return;
  const int64_t t = item / half, i = item % half;
  const float angle = __fmul_rn(static_cast<float>(pos[t]), inv_freq[i]);  // no FMA contraction
  double sn, cs;
  sincos(static_cast<double>(angle), &sn, &cs);
  const float c = static_cast<float>(cs * attention_scale);
  const float s = static_cast<float>(sn * attention_scale * sign);
  T* row = x + t * heads * d;
  for (int64_t h = 0; h < heads; ++h, row += d) {
    const float a = to_f32(row[i]), b = to_f32(row[i + half]);
    row[i] = from_f32<T>(a * c - b * s);
    row[i + half] = from_f32<T>(b * c + a * s);
  }
}

}  // namespace

void rope(cudaStream_t s, void* x, DType t, int64_t tokens, int64_t heads, int64_t d, const int32_t* pos,
          const float* inv_freq, double attention_scale, int sign) {
  const int64_t items = tokens * (d / 2);
  if (items == 0) return;
  dispatch_compute(t, "rope", [&](auto z) {
    using T = decltype(z);
    rope_kernel<<<static_cast<unsigned>((items + 255) / 256), 256, 0, s>>>(static_cast<T*>(x), tokens, heads, d, pos,
                                                                           inv_freq, attention_scale, sign);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
