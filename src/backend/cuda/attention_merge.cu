// Ring attention: merge one key block's partial result into the f32 accumulator with the
// log-sum-exp rule of docs/design.md §2.9 (stable sigmoid form), rows with −inf ignored, never NaN.
#include <cmath>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

// One warp per (token, head) row. out f32 [tq, hq, d]; out_b [tq, hq, d]; lse, lse_b f32 [hq, tq].
template <typename TB>
__global__ void merge_kernel(float* out, float* lse, const TB* out_b, const float* lse_b, int64_t tq, int hq, int d) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) >> 5;
  const int lane = threadIdx.x & 31;
  if (row >= tq * hq) return;
  const int64_t i = row / hq, h = row % hq;
  const int64_t l_at = h * tq + i;
  const float lb = lse_b[l_at];
  if (lb == -INFINITY) return;  // the block saw no key for this row
  const float la = lse[l_at];
  float* o = out + row * d;
  const TB* ob = out_b + row * d;
  if (la == -INFINITY) {
    for (int e = lane; e < d; e += 32) o[e] = to_f32(ob[e]);
  } else {
    const float sig = 1.0f / (1.0f + expf(la - lb));  // σ(lse_b − lse)
    for (int e = lane; e < d; e += 32) o[e] -= sig * (o[e] - to_f32(ob[e]));
  }
  __syncwarp();  // every lane has read `la` before lane 0 replaces it
  if (lane == 0)
    lse[l_at] = la == -INFINITY ? lb : fmaxf(la, lb) + log1pf(expf(-fabsf(la - lb)));
}

}  // namespace

void attention_merge(cudaStream_t s, float* out, float* lse, const void* out_b, DType tb, const float* lse_b,
                     int64_t tq, int hq, int d) {
  const int64_t rows = tq * hq;
  if (rows == 0) return;
  const unsigned blocks = static_cast<unsigned>((rows * 32 + 255) / 256);
  dispatch_compute(tb, "attention_merge", [&](auto z) {
    using TB = decltype(z);
    merge_kernel<<<blocks, 256, 0, s>>>(out, lse, static_cast<const TB*>(out_b), lse_b, tq, hq, d);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
