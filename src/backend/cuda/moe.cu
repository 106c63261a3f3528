// The mixture-of-experts kernels around the expert GEMMs: the router's softmax and top-k, its
// backward and load-balancing statistics, the permutation of the routed rows by expert and the
// weighted combine. Every result is deterministic: no floating-point atomics except adds of whole
// numbers (exact), fixed summation orders elsewhere.
#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/moe.h"

namespace spindle::cuda {
namespace {

constexpr int kRouterWarps = 4;  // tokens per block of the router kernels

// The better of two (probability, expert) candidates: larger probability, then lower expert.
__device__ __forceinline__ bool better(float pa, int ea, float pb, int eb) {
  return pa > pb || (pa == pb && ea < eb);
}

// One warp per token. shared: kRouterWarps × experts floats (that warp's probabilities, taken
// ones overwritten with −1 as they are selected).
template <typename T>
__global__ void router_forward_kernel(const T* logits, int64_t tokens, int experts, int top_k, bool normalize,
                                      float* probs, int32_t* topk_index, float* topk_weight) {
  extern __shared__ float router_shared[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + warp;
  if (t >= tokens) return;
  float* p = router_shared + warp * experts;
  const T* row = logits + t * experts;
  float peak = -INFINITY;
  for (int e = lane; e < experts; e += 32) {
    const float v = to_f32(row[e]);
    p[e] = v;
    peak = fmaxf(peak, v);
  }
  peak = warp_max(peak);
  float z = 0;
  for (int e = lane; e < experts; e += 32) z += expf(p[e] - peak);
  z = warp_sum(z);
  const float inv_z = 1.0f / z;
  float* out = probs + t * experts;
  for (int e = lane; e < experts; e += 32) {
    const float v = expf(p[e] - peak) * inv_z;
    p[e] = v;
    out[e] = v;
  }
  __syncwarp();
  // k rounds of a warp arg-max; the winner's lane is the one that owns it (e % 32). The raw
  // probabilities go to topk_weight first and are scaled once their sum is known.
  float sum = 0;
  for (int j = 0; j < top_k; ++j) {
    float bp = -2.0f;
    int be = experts;  // stays out of range only for NaN logits; moe_permute reports it
    for (int e = lane; e < experts; e += 32)
      if (better(p[e], e, bp, be)) bp = p[e], be = e;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float op = __shfl_xor_sync(0xffffffffu, bp, o);
      const int oe = __shfl_xor_sync(0xffffffffu, be, o);
      if (better(op, oe, bp, be)) bp = op, be = oe;
    }
    sum += bp;
    if (be < experts && lane == (be & 31)) p[be] = -1.0f;
    if (lane == 0) {
      topk_index[t * top_k + j] = be;
      topk_weight[t * top_k + j] = bp;
    }
    __syncwarp();
  }
  if (normalize)
    for (int j = lane; j < top_k; j += 32) topk_weight[t * top_k + j] /= sum;
}

// One warp per token; shared: kRouterWarps × experts floats of ∂L/∂probs.
template <typename T>
__global__ void router_backward_kernel(const float* probs, const int32_t* topk_index, const float* d_topk_weight,
                                       int64_t tokens, int experts, int top_k, bool normalize, const float* aux_grad,
                                       const int32_t* token_doc, T* dlogits) {
  extern __shared__ float router_shared[];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kRouterWarps + warp;
  if (t >= tokens) return;
  float* dp = router_shared + warp * experts;
  const float* p = probs + t * experts;
  const int32_t* index = topk_index + t * top_k;
  const float* dw = d_topk_weight + t * top_k;
  // w_j = s_j / S: ∂L/∂s_j = (∂L/∂w_j − Σ_m ∂L/∂w_m·w_m) / S.
  float sum = 0, weighted = 0;
  for (int j = lane; j < top_k; j += 32) sum += p[index[j]];
  sum = warp_sum(sum);
  if (normalize) {
    for (int j = lane; j < top_k; j += 32) weighted += dw[j] * p[index[j]] / sum;
    weighted = warp_sum(weighted);
  }
  const bool aux = aux_grad && (!token_doc || token_doc[t] >= 0);
  for (int e = lane; e < experts; e += 32) dp[e] = aux ? aux_grad[e] : 0.0f;
  __syncwarp();
  for (int j = lane; j < top_k; j += 32) dp[index[j]] += normalize ? (dw[j] - weighted) / sum : dw[j];
  __syncwarp();
  float dot = 0;
  for (int e = lane; e < experts; e += 32) dot += p[e] * dp[e];
  dot = warp_sum(dot);
  T* out = dlogits + t * experts;
  for (int e = lane; e < experts; e += 32) out[e] = from_f32<T>(p[e] * (dp[e] - dot));
}

// counts: one thread per slot adds 1 (whole numbers: exact in any order below 2^24).
__global__ void router_counts_kernel(const int32_t* topk_index, const int32_t* token_doc, int64_t slots, int top_k,
                                     int experts, float* counts) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= slots) return;
  if (token_doc && token_doc[i / top_k] < 0) return;
  const int e = topk_index[i];
  if (e >= 0 && e < experts) atomicAdd(counts + e, 1.0f);
}

// prob_sums: a block per 32 experts, warps over tokens, then the warps' sums in warp order.
__global__ void router_prob_sums_kernel(const float* probs, const int32_t* token_doc, int64_t tokens, int experts,
                                        float* prob_sums) {
  __shared__ float partial[32][33];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const int e = blockIdx.x * 32 + lane;
  float acc = 0;
  if (e < experts)
    for (int64_t t = warp; t < tokens; t += warps)
      if (!token_doc || token_doc[t] >= 0) acc += probs[t * experts + e];
  partial[warp][lane] = acc;
  __syncthreads();
  if (warp == 0 && e < experts) {
    float total = 0;
    for (int w = 0; w < warps; ++w) total += partial[w][lane];
    prob_sums[e] += total;
  }
}

__global__ void iota_kernel(int32_t* p, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) p[i] = static_cast<int32_t>(i);
}

__global__ void check_experts_kernel(const int32_t* topk_index, int64_t slots, int experts, DeviceError* err) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= slots) return;
  const int e = topk_index[i];
  if ((e < 0 || e >= experts) && atomicCAS(&err->code, 0, kErrExpertIndex) == 0) {
    err->index = i;
    err->value = e;
    err->limit = experts;
    __threadfence_system();
  }
}

// After the stable sort: row r holds slot order[r]; the first row of each expert's run writes the
// offsets of that expert and of any empty experts before it (the last row: those after it).
__global__ void permute_finish_kernel(const int32_t* sorted_experts, const int32_t* order, int64_t rows, int top_k,
                                      int experts, int32_t* rows_token, int32_t* row_of_slot, int32_t* offsets) {
  const int64_t r = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (r >= rows) return;
  const int32_t slot = order[r];
  rows_token[r] = slot / top_k;
  row_of_slot[slot] = static_cast<int32_t>(r);
  const int e = min(max(sorted_experts[r], 0), experts - 1);
  const int before = r == 0 ? -1 : min(max(sorted_experts[r - 1], 0), experts - 1);
  for (int x = before + 1; x <= e; ++x) offsets[x] = static_cast<int32_t>(r);
  if (r == rows - 1)
    for (int x = e + 1; x <= experts; ++x) offsets[x] = static_cast<int32_t>(rows);
}

// The k slots of token t in ascending expert order (insertion sort; k is small). Stable: equal
// experts (never produced by the router) keep slot order.
__device__ void slots_by_expert(const int32_t* index, int top_k, int* order) {
  for (int j = 0; j < top_k; ++j) {
    int i = j;
    while (i > 0 && index[order[i - 1]] > index[j]) {
      order[i] = order[i - 1];
      --i;
    }
    order[i] = j;
  }
}

constexpr int kMaxCombineK = 64;

// One block per token over the hidden dim, V elements per thread step (16-byte vectors when the
// row allows it, V = 1 otherwise).
template <typename T, bool Vector>
__global__ void combine_kernel(const T* y, const int32_t* row_of_slot, const int32_t* topk_index,
                               const float* topk_weight, int top_k, int64_t hidden, T* out) {
  __shared__ int order[kMaxCombineK];
  __shared__ int64_t rows[kMaxCombineK];
  __shared__ float weights[kMaxCombineK];
  const int64_t t = blockIdx.x;
  if (threadIdx.x == 0) {
    slots_by_expert(topk_index + t * top_k, top_k, order);
    for (int j = 0; j < top_k; ++j) {
      rows[j] = row_of_slot[t * top_k + order[j]];
      weights[j] = topk_weight[t * top_k + order[j]];
    }
  }
  __syncthreads();
  T* dst = out + t * hidden;
  if constexpr (Vector) {
    constexpr int V = kVecWidth<T>;
    for (int64_t h = threadIdx.x * V; h < hidden; h += blockDim.x * V) {
      float acc[V] = {};
      for (int j = 0; j < top_k; ++j) {
        float v[V];
        load_vec(y + rows[j] * hidden + h, v);
#pragma unroll
        for (int i = 0; i < V; ++i) acc[i] += weights[j] * v[i];
      }
      store_vec(dst + h, acc);
    }
  } else {
    for (int64_t h = threadIdx.x; h < hidden; h += blockDim.x) {
      float acc = 0;
      for (int j = 0; j < top_k; ++j) acc += weights[j] * to_f32(y[rows[j] * hidden + h]);
      dst[h] = from_f32<T>(acc);
    }
  }
}

// One block per token, one warp per slot at a time: dy row = w·dout, and the dot product.
template <typename T, bool Vector>
__global__ void combine_backward_kernel(const T* dout, const T* y, const int32_t* row_of_slot,
                                        const float* topk_weight, int top_k, int64_t hidden, T* dy,
                                        float* d_topk_weight) {
  const int64_t t = blockIdx.x;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, warps = blockDim.x >> 5;
  const T* g = dout + t * hidden;
  for (int j = warp; j < top_k; j += warps) {
    const int64_t r = row_of_slot[t * top_k + j];
    const float w = topk_weight[t * top_k + j];
    const T* yr = y + r * hidden;
    T* dyr = dy + r * hidden;
    float dot = 0;
    if constexpr (Vector) {
      constexpr int V = kVecWidth<T>;
      for (int64_t h = lane * V; h < hidden; h += 32 * V) {
        float gv[V], yv[V], dv[V];
        load_vec(g + h, gv);
        load_vec(yr + h, yv);
#pragma unroll
        for (int i = 0; i < V; ++i) {
          dot += yv[i] * gv[i];
          dv[i] = w * gv[i];
        }
        store_vec(dyr + h, dv);
      }
    } else {
      for (int64_t h = lane; h < hidden; h += 32) {
        const float gv = to_f32(g[h]);
        dot += to_f32(yr[h]) * gv;
        dyr[h] = from_f32<T>(w * gv);
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) d_topk_weight[t * top_k + j] = dot;
  }
}

template <typename T>
bool rows_vectorisable(int64_t hidden, std::initializer_list<const void*> ptrs) {
  if (hidden % kVecWidth<T>) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16) return false;
  return true;
}

void check_router_sizes(const char* op, int64_t tokens, int experts, int top_k) {
  if (tokens > 0x7fffffffLL * kRouterWarps) throw_message(op, "too many tokens");
  if (experts < 1 || top_k < 1 || top_k > experts) throw_message(op, "needs 1 ≤ top_k ≤ experts");
  // The per-warp row of probabilities must fit the block's shared memory (48 KiB without opting in).
  if (static_cast<size_t>(experts) * kRouterWarps * sizeof(float) > 48 * 1024)
    throw_message(op, "more than 3072 experts");
}

}  // namespace

void moe_router_forward(cudaStream_t s, const void* logits, DType t, int64_t tokens, int experts, int top_k,
                        bool normalize, float* probs, int32_t* topk_index, float* topk_weight) {
  check_router_sizes("moe_router_forward", tokens, experts, top_k);
  if (tokens == 0) return;
  const unsigned blocks = static_cast<unsigned>((tokens + kRouterWarps - 1) / kRouterWarps);
  const size_t shared = static_cast<size_t>(experts) * kRouterWarps * sizeof(float);
  dispatch_compute(t, "moe_router_forward", [&](auto z) {
    using T = decltype(z);
    router_forward_kernel<T><<<blocks, 32 * kRouterWarps, shared, s>>>(
        static_cast<const T*>(logits), tokens, experts, top_k, normalize, probs, topk_index, topk_weight);
    CUDA_CHECK_LAUNCH();
  });
}

void moe_router_backward(cudaStream_t s, const float* probs, const int32_t* topk_index, const float* d_topk_weight,
                         int64_t tokens, int experts, int top_k, bool normalize, const float* aux_grad,
                         const int32_t* token_doc, void* dlogits, DType t) {
  check_router_sizes("moe_router_backward", tokens, experts, top_k);
  if (tokens == 0) return;
  const unsigned blocks = static_cast<unsigned>((tokens + kRouterWarps - 1) / kRouterWarps);
  const size_t shared = static_cast<size_t>(experts) * kRouterWarps * sizeof(float);
  dispatch_compute(t, "moe_router_backward", [&](auto z) {
    using T = decltype(z);
    router_backward_kernel<T><<<blocks, 32 * kRouterWarps, shared, s>>>(
        probs, topk_index, d_topk_weight, tokens, experts, top_k, normalize, aux_grad, token_doc,
        static_cast<T*>(dlogits));
    CUDA_CHECK_LAUNCH();
  });
}

void moe_router_statistics(cudaStream_t s, const float* probs, const int32_t* topk_index, const int32_t* token_doc,
                           int64_t tokens, int experts, int top_k, float* counts, float* prob_sums) {
  if (tokens == 0) return;
  const int64_t slots = tokens * top_k;
  router_counts_kernel<<<static_cast<unsigned>((slots + 255) / 256), 256, 0, s>>>(topk_index, token_doc, slots,
                                                                                   top_k, experts, counts);
  CUDA_CHECK_LAUNCH();
  router_prob_sums_kernel<<<static_cast<unsigned>((experts + 31) / 32), 1024, 0, s>>>(probs, token_doc, tokens,
                                                                                       experts, prob_sums);
  CUDA_CHECK_LAUNCH();
}

void moe_permute(cudaStream_t s, const int32_t* topk_index, int64_t tokens, int top_k, int experts,
                 int32_t* rows_token, int32_t* row_of_slot, int32_t* offsets, DeviceError* err) {
  const int64_t rows = tokens * top_k;
  if (rows > 0x7fffffff) throw_message("moe_permute", "more than 2^31 routed rows");
  if (rows == 0) {
    CUDA_CHECK(cudaMemsetAsync(offsets, 0, (static_cast<size_t>(experts) + 1) * sizeof(int32_t), s));
    return;
  }
  const int count = static_cast<int>(rows);
  int bits = 1;
  while ((1LL << bits) < experts) ++bits;
  // [sorted experts | order in | order out] I32 [rows] each, then the sort's temporary storage.
  size_t sort_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), count, 0, bits, s));
  const size_t arrays = (3 * static_cast<size_t>(rows) * sizeof(int32_t) + 255) / 256 * 256;
  Scratch scratch(s, arrays + sort_bytes);
  int32_t* sorted = scratch.as<int32_t>();
  int32_t* order_in = sorted + rows;
  int32_t* order = order_in + rows;
  const unsigned blocks = static_cast<unsigned>((rows + 255) / 256);
  check_experts_kernel<<<blocks, 256, 0, s>>>(topk_index, rows, experts, err);
  CUDA_CHECK_LAUNCH();
  iota_kernel<<<blocks, 256, 0, s>>>(order_in, rows);
  CUDA_CHECK_LAUNCH();
  // LSD radix sort is stable: within an expert the slots keep (token, slot) order.
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch.as<char>() + arrays, sort_bytes, topk_index, sorted, order_in,
                                             order, count, 0, bits, s));
  permute_finish_kernel<<<blocks, 256, 0, s>>>(sorted, order, rows, top_k, experts, rows_token, row_of_slot,
                                               offsets);
  CUDA_CHECK_LAUNCH();
}

void moe_combine(cudaStream_t s, const void* y, const int32_t* row_of_slot, const int32_t* topk_index,
                 const float* topk_weight, int64_t tokens, int top_k, int64_t hidden, void* out, DType t) {
  if (top_k > kMaxCombineK) throw_message("moe_combine", "more than 64 experts per token");
  if (tokens == 0 || hidden == 0) return;
  if (tokens > 0x7fffffff) throw_message("moe_combine", "more than 2^31 tokens");
  dispatch_compute(t, "moe_combine", [&](auto z) {
    using T = decltype(z);
    const int threads = hidden >= 2048 ? 256 : 128;
    if (rows_vectorisable<T>(hidden, {y, out}))
      combine_kernel<T, true><<<static_cast<unsigned>(tokens), threads, 0, s>>>(
          static_cast<const T*>(y), row_of_slot, topk_index, topk_weight, top_k, hidden, static_cast<T*>(out));
    else
      combine_kernel<T, false><<<static_cast<unsigned>(tokens), threads, 0, s>>>(
          static_cast<const T*>(y), row_of_slot, topk_index, topk_weight, top_k, hidden, static_cast<T*>(out));
    CUDA_CHECK_LAUNCH();
  });
}

void moe_combine_backward(cudaStream_t s, const void* dout, const void* y, const int32_t* row_of_slot,
                          const float* topk_weight, int64_t tokens, int top_k, int64_t hidden, void* dy,
                          float* d_topk_weight, DType t) {
  if (tokens == 0) return;
  if (tokens > 0x7fffffff) throw_message("moe_combine_backward", "more than 2^31 tokens");
  const int threads = 32 * (top_k < 8 ? top_k : 8);
  dispatch_compute(t, "moe_combine_backward", [&](auto z) {
    using T = decltype(z);
    if (rows_vectorisable<T>(hidden, {dout, y, dy}))
      combine_backward_kernel<T, true><<<static_cast<unsigned>(tokens), threads, 0, s>>>(
          static_cast<const T*>(dout), static_cast<const T*>(y), row_of_slot, topk_weight, top_k, hidden,
          static_cast<T*>(dy), d_topk_weight);
    else
      combine_backward_kernel<T, false><<<static_cast<unsigned>(tokens), threads, 0, s>>>(
          static_cast<const T*>(dout), static_cast<const T*>(y), row_of_slot, topk_weight, top_k, hidden,
          static_cast<T*>(dy), d_topk_weight);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
