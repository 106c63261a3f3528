// The shared expert's sigmoid gate of a qwen3_5_moe layer (backend.h, shared_expert_gate_*):
// out[t] += σ(g[t])·shared[t] and its backward. Both are pure memory traffic (a few flops per
// element): the forward moves 3·T·H elements (shared and out read, out written), the backward
// 3·T·H + 2·T (shared and dout read, d_shared written; the logit read, its gradient written), so
// they are written to stream rows at the bandwidth: one warp per token row, 16-byte vectors when
// the row allows, σ(g) computed once per row, the dot product ⟨dout, shared⟩ summed in F32 over
// the warp in a fixed order (deterministic).
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/moe.h"

namespace spindle::cuda {
namespace {

constexpr int kGateWarps = 8;  // token rows per block

__device__ __forceinline__ float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// shared, out [T, H]; gate [T] (one logit per token). Vector: H a multiple of kVecWidth<T> and
// every row 16-byte aligned (checked on the host).
template <typename T, bool Vector>
__global__ void gate_forward_kernel(const T* shared, const T* gate, int64_t tokens, int64_t hidden, T* out) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kGateWarps + warp;
  if (t >= tokens) return;
  const float scale = sigmoid(to_f32(gate[t]));
  const T* src = shared + t * hidden;
  T* dst = out + t * hidden;
  if constexpr (Vector) {
    constexpr int V = kVecWidth<T>;
    for (int64_t h = static_cast<int64_t>(lane) * V; h < hidden; h += 32 * V) {
      float s[V], o[V];
      load_vec(src + h, s);
      load_vec(dst + h, o);
#pragma unroll
      for (int i = 0; i < V; ++i) o[i] += scale * s[i];
      store_vec(dst + h, o);
    }
  } else {
    for (int64_t h = lane; h < hidden; h += 32) dst[h] = from_f32<T>(to_f32(dst[h]) + scale * to_f32(src[h]));
  }
}

// d_shared [T, H] = σ(g)·dout; d_gate [T] = σ(g)(1 − σ(g))·⟨dout[t], shared[t]⟩, the dot in F32.
template <typename T, bool Vector>
__global__ void gate_backward_kernel(const T* shared, const T* gate, const T* dout, int64_t tokens, int64_t hidden,
                                     T* d_shared, T* d_gate) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kGateWarps + warp;
  if (t >= tokens) return;
  const float logit = to_f32(gate[t]);
  const float scale = sigmoid(logit);
  // σ' = σ(x)·σ(−x): 1 − σ(x) would lose the digits of a saturated gate.
  const float slope = scale * sigmoid(-logit);
  const T* s_row = shared + t * hidden;
  const T* g_row = dout + t * hidden;
  T* d_row = d_shared + t * hidden;
  float dot = 0;
  if constexpr (Vector) {
    constexpr int V = kVecWidth<T>;
    for (int64_t h = static_cast<int64_t>(lane) * V; h < hidden; h += 32 * V) {
      float s[V], g[V], d[V];
      load_vec(s_row + h, s);
      load_vec(g_row + h, g);
#pragma unroll
      for (int i = 0; i < V; ++i) {
        dot += g[i] * s[i];
        d[i] = scale * g[i];
      }
      store_vec(d_row + h, d);
    }
  } else {
    for (int64_t h = lane; h < hidden; h += 32) {
      const float g = to_f32(g_row[h]);
      dot += g * to_f32(s_row[h]);
      d_row[h] = from_f32<T>(scale * g);
    }
  }
  dot = warp_sum(dot);
  if (lane == 0) d_gate[t] = from_f32<T>(dot * slope);
}

template <typename T>
bool rows_vectorisable(int64_t hidden, std::initializer_list<const void*> ptrs) {
  if (hidden % kVecWidth<T>) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16) return false;
  return true;
}

unsigned gate_blocks(int64_t tokens, const char* op) {
  const int64_t blocks = (tokens + kGateWarps - 1) / kGateWarps;
  if (blocks > 0x7fffffffLL) throw_message(op, "too many tokens");
  return static_cast<unsigned>(blocks);
}

}  // namespace

void shared_expert_gate_forward(cudaStream_t s, const void* shared, const void* gate, int64_t tokens, int64_t hidden,
                                void* out, DType t) {
  if (tokens == 0 || hidden == 0) return;
  const unsigned blocks = gate_blocks(tokens, "shared_expert_gate_forward");
  dispatch_compute(t, "shared_expert_gate_forward", [&](auto z) {
    using T = decltype(z);
    const T* sh = static_cast<const T*>(shared);
    const T* g = static_cast<const T*>(gate);
    T* o = static_cast<T*>(out);
    if (rows_vectorisable<T>(hidden, {shared, out}))
      gate_forward_kernel<T, true><<<blocks, 32 * kGateWarps, 0, s>>>(sh, g, tokens, hidden, o);
    else
      gate_forward_kernel<T, false><<<blocks, 32 * kGateWarps, 0, s>>>(sh, g, tokens, hidden, o);
    CUDA_CHECK_LAUNCH();
  });
}

void shared_expert_gate_backward(cudaStream_t s, const void* shared, const void* gate, const void* dout,
                                 int64_t tokens, int64_t hidden, void* d_shared, void* d_gate, DType t) {
  if (tokens == 0) return;
  const unsigned blocks = gate_blocks(tokens, "shared_expert_gate_backward");
  dispatch_compute(t, "shared_expert_gate_backward", [&](auto z) {
    using T = decltype(z);
    const T* sh = static_cast<const T*>(shared);
    const T* g = static_cast<const T*>(gate);
    const T* dy = static_cast<const T*>(dout);
    T* ds = static_cast<T*>(d_shared);
    T* dg = static_cast<T*>(d_gate);
    if (rows_vectorisable<T>(hidden, {shared, dout, d_shared}))
      gate_backward_kernel<T, true><<<blocks, 32 * kGateWarps, 0, s>>>(sh, g, dy, tokens, hidden, ds, dg);
    else
      gate_backward_kernel<T, false><<<blocks, 32 * kGateWarps, 0, s>>>(sh, g, dy, tokens, hidden, ds, dg);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
