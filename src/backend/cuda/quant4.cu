// bitsandbytes' 4-bit weights (NF4/FP4, docs/qlora.md): dequantisation into the compute dtype, at
// memory bandwidth, before every GEMM that reads a quantised base weight. The arithmetic is
// bitsandbytes' exactly (its kernels are built with --use_fast_math): the product table · absmax
// in F32 with denormal inputs and result flushed (mul.rn.ftz), then rounded to nearest even; a
// double-quantised absmax is code · absmax2 (mul.rn.ftz) and then + offset as a separate IEEE add,
// never an FMA. The CPU reference is backend/cpu/quant4_ops.cpp; tests/cuda compares the two.
//
// Quantisation (a dense checkpoint's projections at load, spindle bench's random ones) is the CPU
// reference's arithmetic step by step, so its bytes are the host's: each block's max |w| through
// max.ftz from −FLT_MAX (an order-free reduction), its reciprocal as the GPU's rcp.approx.ftz
// returns it, reproduced from the measured table the host uses (uploaded by the backend: the
// bytes do not depend on which GPU runs this), then w·(1/absmax) with mul.rn.ftz and bitsandbytes'
// comparisons against its literals.
#include <cfloat>

#include "backend/cuda/device_util.cuh"
#include "backend/cuda/kernels.h"

namespace spindle::cuda {
namespace {

__constant__ float kNf4[16] = {-1.0f,
                               -0.6961928009986877f,
                               -0.5250730514526367f,
                               -0.39491748809814453f,
                               -0.28444138169288635f,
                               -0.18477343022823334f,
                               -0.09105003625154495f,
                               0.0f,
                               0.07958029955625534f,
                               0.16093020141124725f,
                               0.24611230194568634f,
                               0.33791524171829224f,
                               0.44070982933044434f,
                               0.5626170039176941f,
                               0.7229568362236023f,
                               1.0f};
// FP4: sign bit 3, magnitude from the low three bits.
__constant__ float kFp4Magnitude[8] = {0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f};

// Written in PTX so neither the build flags nor the compiler's contraction can change them.
__device__ __forceinline__ float mul_ftz(float a, float b) {
  float r;
  asm("mul.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
__device__ __forceinline__ float add_ieee(float a, float b) {
  float r;
  asm("add.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

__device__ __forceinline__ float add_ftz(float a, float b) {
  float r;
  asm("add.rn.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}
// A NaN operand yields the other; denormals count as zero.
__device__ __forceinline__ float max_ftz(float a, float b) {
  float r;
  asm("max.ftz.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
}

template <bool kNf4Type>
__device__ __forceinline__ float code_value(unsigned code) {
  if (kNf4Type) return kNf4[code];
  return mul_ftz(kFp4Magnitude[code & 7u], (code & 8u) ? -1.0f : 1.0f);
}

// One thread per packed byte: elements 2k (high nibble) and 2k+1 (low), of the same block because
// blocks hold an even number of elements. out [n]; the last byte of an odd n has one element.
template <typename T, bool kNf4Type>
__global__ void dequantize_4bit_kernel(const uint8_t* __restrict__ packed, const float* __restrict__ absmax, T* out,
                                       int64_t n, int block_shift) {
  const int64_t bytes = (n + 1) / 2, stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t k = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; k < bytes; k += stride) {
    const unsigned byte = packed[k];
    const int64_t j = 2 * k;
    const float scale = absmax[j >> block_shift];
    out[j] = from_f32<T>(mul_ftz(code_value<kNf4Type>(byte >> 4), scale));
    if (j + 1 < n) out[j + 1] = from_f32<T>(mul_ftz(code_value<kNf4Type>(byte & 15u), scale));
  }
}

__global__ void dequantize_absmax_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ code_map,
                                         const float* __restrict__ absmax2, float* absmax, int64_t k,
                                         int64_t blocksize2, float offset) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < k; i += stride)
    absmax[i] = add_ieee(mul_ftz(code_map[codes[i]], absmax2[i / blocksize2]), offset);
}

// ---- quantisation ------------------------------------------------------------------------------

// NF4's decision thresholds (bitsandbytes' literals; the CPU reference has the same): a value goes
// to the code of how many lie strictly below it.
__constant__ float kNf4Thresholds[15] = {-0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f,
                                         -0.33967943489551544f, -0.23460740596055984f, -0.13791173323988914f,
                                         -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,
                                         0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
                                         0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};

template <typename T>
__device__ __forceinline__ float load_f32(const T* p, int64_t i) { return to_f32(p[i]); }
template <>
__device__ __forceinline__ float load_f32<double>(const double* p, int64_t i) { return __double2float_rn(p[i]); }

__device__ __forceinline__ unsigned nf4_code(float x) {
  unsigned code = 0;
#pragma unroll
  for (int t = 0; t < 15; ++t) code += x > kNf4Thresholds[t] ? 1u : 0u;
  return code;
}

__device__ __forceinline__ unsigned fp4_code(float x) {
  const unsigned sign = x < 0 ? 0b1000u : 0u;
  x = fabsf(x);
  if (x > 0.29166667f) {
    if (x > 0.583333f) return (x > 0.8333333f ? 0b0011u : 0b0010u) + sign;
    return (x > 0.4166667f ? 0b0101u : 0b0100u) + sign;
  }
  if (x > 0.0859375f) return (x > 0.20833333f ? 0b0111u : 0b0110u) + sign;
  return (x > 0.00260417f ? 0b0001u : 0b0000u) + sign;
}

// quant4::rcp_approx_ftz (backend/cpu/quant4_ops.cpp) on the device: the correctly rounded
// reciprocal of the mantissa, stepped to its other neighbour where the table's bit is set.
// table: U8 [2²⁰], one bit per mantissa.
__device__ __forceinline__ float rcp_approx_ftz(float x, const uint8_t* __restrict__ table) {
  const uint32_t bits = __float_as_uint(x);
  const uint32_t sign = bits & 0x80000000u, exponent = (bits >> 23) & 0xFFu, mantissa = bits & 0x7FFFFFu;
  if (exponent == 0) return __uint_as_float(sign | 0x7F800000u);
  if (exponent == 0xFF) return mantissa ? __uint_as_float(0x7FFFFFFFu) : __uint_as_float(sign);
  const float m = __uint_as_float(0x3F800000u | mantissa);
  float r = __frcp_rn(m);
  if ((table[mantissa >> 3] >> (mantissa & 7)) & 1) {
    const float residual = __fmaf_rn(-m, r, 1.0f);
    r = nextafterf(r, residual > 0 ? 2.0f : 0.0f);
  }
  const uint32_t r_bits = __float_as_uint(r);
  const int32_t out_exponent = static_cast<int32_t>((r_bits >> 23) & 0xFFu) + 127 - static_cast<int32_t>(exponent);
  if (out_exponent <= 0) return __uint_as_float(sign);
  return __uint_as_float(sign | (static_cast<uint32_t>(out_exponent) << 23) | (r_bits & 0x7FFFFFu));
}

__device__ __forceinline__ float warp_max_ftz(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max_ftz(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

constexpr int kQuantWarps = 8;  // warps per thread block; one warp quantises one block of weights

// One warp per block of `blocksize` weights: its absmax, then its bytes. w [n], packed U8
// [(n+1)/2], absmax F32 [blocks]. A partial last block reduces the zeros bitsandbytes' load pads
// with, and a missing last element of an odd n is such a zero.
template <typename T, bool kNf4Type>
__global__ void quantize_4bit_kernel(const T* __restrict__ w, uint8_t* __restrict__ packed, float* __restrict__ absmax,
                                     int64_t n, int64_t blocksize, int64_t blocks,
                                     const uint8_t* __restrict__ rcp_table) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kQuantWarps;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5); b < blocks; b += warps) {
    const int64_t begin = b * blocksize, count = min(blocksize, n - begin);
    float m = -FLT_MAX;
    for (int64_t i = lane; i < count; i += 32) m = max_ftz(m, fabsf(load_f32(w, begin + i)));
    m = warp_max_ftz(m);
    if (count < blocksize) m = max_ftz(m, 0.0f);
    if (lane == 0) absmax[b] = m;
    const float r = rcp_approx_ftz(m, rcp_table);
    for (int64_t i = 2 * lane; i < count; i += 64) {
      const float v0 = load_f32(w, begin + i), v1 = i + 1 < count ? load_f32(w, begin + i + 1) : 0.0f;
      const float s0 = mul_ftz(v0, r), s1 = mul_ftz(v1, r);
      const unsigned c0 = kNf4Type ? nf4_code(s0) : fp4_code(s0), c1 = kNf4Type ? nf4_code(s1) : fp4_code(s1);
      packed[(begin + i) / 2] = static_cast<uint8_t>((c0 << 4) | c1);
    }
  }
}

// quant4's map_code: the nearest entry of the sorted 256-entry map by bitsandbytes' binary search,
// its midpoints formed with add.ftz and mul.ftz as its kernel does.
__device__ __forceinline__ uint8_t map_code(const float* __restrict__ map, float x) {
  int pivot = 127, upper_pivot = 255, lower_pivot = 0;
  float lower = -1.0f, upper = 1.0f;
  float val = map[pivot];
  for (int i = 64; i > 0; i >>= 1) {
    if (x > val) {
      lower_pivot = pivot;
      lower = val;
      pivot += i;
    } else {
      upper_pivot = pivot;
      upper = val;
      pivot -= i;
    }
    val = map[pivot];
  }
  if (upper_pivot == 255) upper = map[upper_pivot];
  if (lower_pivot == 0) lower = map[lower_pivot];
  if (x > val) return static_cast<uint8_t>(x > mul_ftz(add_ftz(upper, val), 0.5f) ? upper_pivot : pivot);
  return static_cast<uint8_t>(x < mul_ftz(add_ftz(lower, val), 0.5f) ? lower_pivot : pivot);
}

// One warp per nested block of the absmax [k]: (absmax − offset) in IEEE F32 (torch's subtraction,
// outside bitsandbytes' kernel), its max |·|, then each code. codes U8 [k], absmax2 F32 [blocks].
__global__ void quantize_absmax_kernel(const float* __restrict__ absmax, const float* __restrict__ code_map,
                                       float offset, int64_t k, int64_t blocksize2, int64_t blocks,
                                       uint8_t* __restrict__ codes, float* __restrict__ absmax2,
                                       const uint8_t* __restrict__ rcp_table) {
  const int lane = threadIdx.x & 31;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kQuantWarps;
  for (int64_t b = static_cast<int64_t>(blockIdx.x) * kQuantWarps + (threadIdx.x >> 5); b < blocks; b += warps) {
    const int64_t begin = b * blocksize2, count = min(blocksize2, k - begin);
    float m = -FLT_MAX;
    for (int64_t i = lane; i < count; i += 32) m = max_ftz(m, fabsf(add_ieee(absmax[begin + i], -offset)));
    m = warp_max_ftz(m);
    if (count < blocksize2) m = max_ftz(m, 0.0f);
    if (lane == 0) absmax2[b] = m;
    const float r = rcp_approx_ftz(m, rcp_table);
    for (int64_t i = lane; i < count; i += 32)
      codes[begin + i] = map_code(code_map, mul_ftz(add_ieee(absmax[begin + i], -offset), r));
  }
}

}  // namespace

void dequantize_4bit(cudaStream_t s, const void* packed, const void* absmax, void* out, DType t, int64_t n,
                     int64_t blocksize, bool nf4) {
  if (n == 0) return;
  int block_shift = 0;
  while ((int64_t{1} << block_shift) < blocksize) ++block_shift;
  const int64_t bytes = (n + 1) / 2;
  dispatch_compute(t, "dequantize_4bit", [&](auto z) {
    using T = decltype(z);
    auto* p = static_cast<const uint8_t*>(packed);
    auto* a = static_cast<const float*>(absmax);
    if (nf4) dequantize_4bit_kernel<T, true><<<grid_for(bytes, 256), 256, 0, s>>>(p, a, static_cast<T*>(out), n, block_shift);
    else dequantize_4bit_kernel<T, false><<<grid_for(bytes, 256), 256, 0, s>>>(p, a, static_cast<T*>(out), n, block_shift);
    CUDA_CHECK_LAUNCH();
  });
}

void dequantize_absmax(cudaStream_t s, const void* codes, const void* code_map, const void* absmax2, void* absmax,
                       int64_t k, int64_t blocksize2, float offset) {
  if (k == 0) return;
  dequantize_absmax_kernel<<<grid_for(k, 256), 256, 0, s>>>(
      static_cast<const uint8_t*>(codes), static_cast<const float*>(code_map), static_cast<const float*>(absmax2),
      static_cast<float*>(absmax), k, blocksize2, offset);
  CUDA_CHECK_LAUNCH();
}

void quantize_4bit(cudaStream_t s, const void* w, DType t, int64_t n, int64_t blocksize, bool nf4,
                   const uint8_t* rcp_table, void* packed, void* absmax) {
  if (n == 0) return;
  const int64_t blocks = (n + blocksize - 1) / blocksize;
  const unsigned grid = grid_for(blocks, kQuantWarps, int64_t{132} * 64);
  auto launch = [&](auto z) {
    using T = decltype(z);
    auto* in = static_cast<const T*>(w);
    auto* p = static_cast<uint8_t*>(packed);
    auto* a = static_cast<float*>(absmax);
    if (nf4) quantize_4bit_kernel<T, true><<<grid, 32 * kQuantWarps, 0, s>>>(in, p, a, n, blocksize, blocks, rcp_table);
    else quantize_4bit_kernel<T, false><<<grid, 32 * kQuantWarps, 0, s>>>(in, p, a, n, blocksize, blocks, rcp_table);
    CUDA_CHECK_LAUNCH();
  };
  switch (t) {
    case DType::F32: return launch(float{});
    case DType::BF16: return launch(bf16{});
    case DType::F16: return launch(__half{});
    case DType::F64: return launch(double{});
    default: throw_dtype("quantize_4bit", t);
  }
}

void quantize_absmax(cudaStream_t s, const void* absmax, const void* code_map, float offset, int64_t k,
                     int64_t blocksize2, const uint8_t* rcp_table, void* codes, void* absmax2) {
  if (k == 0) return;
  const int64_t blocks = (k + blocksize2 - 1) / blocksize2;
  quantize_absmax_kernel<<<grid_for(blocks, kQuantWarps, int64_t{132} * 64), 32 * kQuantWarps, 0, s>>>(
      static_cast<const float*>(absmax), static_cast<const float*>(code_map), offset, k, blocksize2, blocks,
      static_cast<uint8_t*>(codes), static_cast<float*>(absmax2), rcp_table);
  CUDA_CHECK_LAUNCH();
}

}  // namespace spindle::cuda
