// The device scratch of the fused LoRA B backward (lora.cu: dxa and dB from one read of dy), for
// `spindle plan` (plan/dry_backend.cpp). Plain C++, no CUDA headers.
//
// The kernel cuts the T rows of dy into strips of SUB tiles of 128 rows, one thread block per strip,
// and each block writes its F32 partial sum of dB [n, r] to the pool; a second kernel adds them in
// strip order. SUB is the largest of 4, 2 (rank 64: 2) that still gives ≥ 0.9 blocks per SM, else 1,
// so the partials take strips · n · r · 4 bytes: on an H200 (132 SMs) 128 strips from 32k tokens
// on, 128 · n · r · 4 bytes (Qwen2.5-7B's gate/up at r 16: 155 MB), alive during the call.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spindle::cuda {

constexpr int kLoraTile = 128;  // a tile of dy: 128 rows × 128 columns

// The fused kernel's shapes: out features a multiple of 128, rank 16, 32 or 64 (BF16, aligned).
inline bool lora_b_backward_shape_supported(int64_t n, int64_t r) {
  return n > 0 && n % kLoraTile == 0 && (r == 16 || r == 32 || r == 64);
}

// Row tiles per strip on a GPU of `multiprocessors` SMs.
inline int lora_b_tiles_per_strip(int64_t t, int r, int multiprocessors) {
  for (int sub = r == 64 ? 2 : 4; sub > 1; sub /= 2)
    if ((t + sub * kLoraTile - 1) / (sub * kLoraTile) * 10 >= static_cast<int64_t>(multiprocessors) * 9) return sub;
  return 1;
}

inline int64_t lora_b_strips(int64_t t, int sub) { return (t + sub * kLoraTile - 1) / (sub * kLoraTile); }

// dB's partial sums for t rows, n out features, rank r; none for a frozen B.
inline size_t lora_b_backward_scratch_bytes(int64_t t, int64_t n, int64_t r, int multiprocessors, bool db) {
  if (!db || t <= 0) return 0;
  const int sub = lora_b_tiles_per_strip(t, static_cast<int>(r), multiprocessors);
  return static_cast<size_t>(lora_b_strips(t, sub)) * static_cast<size_t>(n) * static_cast<size_t>(r) * sizeof(float);
}

}  // namespace spindle::cuda
