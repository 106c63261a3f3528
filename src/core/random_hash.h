// The counter-based values of ModelWeights::random (spindle bench's weights, the tests' random
// models), shared by the host and the CUDA kernels so that every backend writes the same bits.
//
// Value i of stream (seed, sequence) is
//   u_i = (mix(key + i) >> 11)·2⁻⁵³ ∈ [0, 1),   key = mix(seed ^ mix(sequence))
//   v_i = half_width·(2·u_i − 1)                (double; uniform on ±half_width)
// with mix = splitmix64's finaliser. Every step but the last product is exact in double (u_i has
// 53 bits, 2·u_i − 1 too), and that product is one correctly rounded multiplication: the device
// spells it __dmul_rn so no compiler contraction can change it.
//
// This header is compiled by the host compiler and by nvcc (C++17): no C++20 here.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SPINDLE_HOST_DEVICE __host__ __device__
#else
#define SPINDLE_HOST_DEVICE
#endif

namespace spindle::random_hash {

SPINDLE_HOST_DEVICE inline uint64_t mix(uint64_t x) {  // splitmix64's finaliser
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// The key of stream `sequence` under `seed` (ModelWeights::random: a parameter's place in the
// order of declaration, from 1).
SPINDLE_HOST_DEVICE inline uint64_t stream_key(uint64_t seed, uint64_t sequence) { return mix(seed ^ mix(sequence)); }

// v_i of the stream with key `key`.
SPINDLE_HOST_DEVICE inline double uniform(uint64_t key, uint64_t i, double half_width) {
  const double u = static_cast<double>(mix(key + i) >> 11) * 0x1.0p-53;  // exact: 53 bits times a power of two
#if defined(__CUDA_ARCH__)
  return __dmul_rn(half_width, __dadd_rn(__dmul_rn(2.0, u), -1.0));
#else
  return half_width * (2.0 * u - 1.0);
#endif
}

}  // namespace spindle::random_hash
