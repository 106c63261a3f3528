// Row gathers and scatter-adds: the embedding lookup and its gradient, and selecting the rows of
// supervised tokens (selective logits). Bad indices are reported through DeviceError.
#include <cub/device/device_radix_sort.cuh>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

__device__ void report(DeviceError* err, int code, long long index, long long value, long long limit) {
  if (atomicCAS(&err->code, 0, code) == 0) {
    err->index = index;
    err->value = value;
    err->limit = limit;
    __threadfence_system();
  }
}

// One block per destination row; W is the widest word that divides the row and both bases.
template <typename W>
__global__ void gather_kernel(const W* src, int64_t src_rows, const int32_t* idx, W* dst, int64_t words,
                              DeviceError* err, int code) {
  const int64_t r = blockIdx.x;
  const int32_t i = idx[r];
  W* out = dst + r * words;
  if (i < 0 || i >= src_rows) {
    if (threadIdx.x == 0) report(err, code, r, i, src_rows);
    for (int64_t e = threadIdx.x; e < words; e += blockDim.x) out[e] = W{};
    return;
  }
  const W* in = src + static_cast<int64_t>(i) * words;
  for (int64_t e = threadIdx.x; e < words; e += blockDim.x) out[e] = in[e];
}

__global__ void iota_kernel(int32_t* p, int64_t n) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < n) p[i] = static_cast<int32_t>(i);
}

// After a stable sort of the indices: the block at the first position of each run of equal
// indices sums that run's source rows in f32 (in token order) and adds the sum to dst once.
template <typename T>
__global__ void scatter_runs_kernel(const T* src, const int32_t* keys, const int32_t* order, int64_t n, T* dst,
                                    int64_t dst_rows, int64_t row_elems, DeviceError* err, int32_t skip_index) {
  const int64_t first = blockIdx.x;
  const int32_t key = keys[first];
  if (first > 0 && keys[first - 1] == key) return;  // not the start of a run
  if (skip_index >= 0 && key == skip_index) return;
  if (key < 0 || key >= dst_rows) {
    if (threadIdx.x == 0) report(err, kErrScatterIndex, order[first], key, dst_rows);
    return;
  }
  int64_t end = first + 1;
  while (end < n && keys[end] == key) ++end;
  T* out = dst + static_cast<int64_t>(key) * row_elems;
  for (int64_t e = threadIdx.x; e < row_elems; e += blockDim.x) {
    float acc = 0;
    for (int64_t j = first; j < end; ++j) acc += to_f32(src[static_cast<int64_t>(order[j]) * row_elems + e]);
    out[e] = from_f32<T>(to_f32(out[e]) + acc);
  }
}

template <typename W>
bool try_gather(cudaStream_t s, const void* src, int64_t src_rows, const int32_t* idx, int64_t n, void* dst,
                size_t row_bytes, DeviceError* err, int code) {
  if (row_bytes % sizeof(W) || reinterpret_cast<uintptr_t>(src) % sizeof(W) ||
      reinterpret_cast<uintptr_t>(dst) % sizeof(W))
    return false;
  const int64_t words = static_cast<int64_t>(row_bytes / sizeof(W));
  const int threads = words >= 256 ? 256 : 64;
  gather_kernel<W><<<static_cast<unsigned>(n), threads, 0, s>>>(static_cast<const W*>(src), src_rows, idx,
                                                                 static_cast<W*>(dst), words, err, code);
  CUDA_CHECK_LAUNCH();
  return true;
}

}  // namespace

void gather_rows(cudaStream_t s, const void* src, int64_t src_rows, const int32_t* idx, int64_t n, void* dst,
                 size_t row_bytes, DeviceError* err, int code) {
  if (n == 0 || row_bytes == 0) return;
  if (n > 0x7fffffff) throw_message("gather_rows", "more than 2^31 rows");
  try_gather<uint4>(s, src, src_rows, idx, n, dst, row_bytes, err, code) ||
      try_gather<uint32_t>(s, src, src_rows, idx, n, dst, row_bytes, err, code) ||
      try_gather<uint16_t>(s, src, src_rows, idx, n, dst, row_bytes, err, code) ||
      try_gather<uint8_t>(s, src, src_rows, idx, n, dst, row_bytes, err, code);
}

void scatter_add_rows(cudaStream_t s, const void* src, const int32_t* idx, int64_t n, void* dst, int64_t dst_rows,
                      int64_t row_elems, DType t, DeviceError* err, int32_t skip_index) {
  if (n == 0 || row_elems == 0) return;
  if (n > 0x7fffffff) throw_message("scatter_add_rows", "more than 2^31 rows");
  const int count = static_cast<int>(n);
  // [keys_out | order_in | order_out] i32 [n] each, then the sort's own temporary storage.
  size_t sort_bytes = 0;
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(nullptr, sort_bytes, static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), static_cast<const int32_t*>(nullptr),
                                             static_cast<int32_t*>(nullptr), count, 0, 32, s));
  const size_t arrays = (3 * static_cast<size_t>(n) * sizeof(int32_t) + 255) / 256 * 256;
  Scratch scratch(s, arrays + sort_bytes);
  int32_t* keys = scratch.as<int32_t>();
  int32_t* order_in = keys + n;
  int32_t* order = order_in + n;
  iota_kernel<<<static_cast<unsigned>((n + 255) / 256), 256, 0, s>>>(order_in, n);
  CUDA_CHECK_LAUNCH();
  // LSD radix sort is stable: equal indices keep token order, so the sums are reproducible.
  CUDA_CHECK(cub::DeviceRadixSort::SortPairs(scratch.as<char>() + arrays, sort_bytes, idx, keys, order_in, order,
                                             count, 0, 32, s));
  dispatch_compute(t, "scatter_add_rows", [&](auto z) {
    using T = decltype(z);
    const int threads = row_elems >= 256 ? 256 : 64;
    scatter_runs_kernel<<<static_cast<unsigned>(n), threads, 0, s>>>(static_cast<const T*>(src), keys, order, n,
                                                                     static_cast<T*>(dst), dst_rows, row_elems, err,
                                                                     skip_index);
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
