// bitsandbytes' 4-bit format on the host; the header says what is reproduced and why.
// This file is compiled with -ffp-contract=off: an FMA would round the nested absmax (a product,
// then a sum) once where bitsandbytes rounds twice.
#include "backend/cpu/quant4_ops.h"

#include <omp.h>

#include <algorithm>
#include <bit>
#include <cfloat>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/error.h"

// The measured table of the GPU's reciprocal, 2²³ bits (backend/cpu/rcp_approx.cpp).
extern "C" const unsigned char spindle_rcp_approx_f32_table[];

namespace spindle::quant4 {

namespace {

// bitsandbytes' tables (its quant_map and the literals of its CUDA kernels).
constexpr float kNf4[16] = {-1.0f,
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
// NF4's decision thresholds: the midpoints of neighbouring table values, as the kernel's literals.
// A value exactly on one goes to the lower code (the comparisons are strict).
constexpr float kNf4Thresholds[15] = {-0.8480964004993439f, -0.6106329262256622f, -0.4599952697753906f,
                                      -0.33967943489551544f, -0.23460740596055984f, -0.13791173323988914f,
                                      -0.045525018125772476f, 0.03979014977812767f, 0.1202552504837513f,
                                      0.2035212516784668f, 0.2920137718319893f, 0.3893125355243683f,
                                      0.5016634166240692f, 0.6427869200706482f, 0.8614784181118011f};
// FP4 (1 sign bit, 3 bits of magnitude; the magnitudes as the dequantisation kernel's literals).
constexpr float kFp4Magnitude[8] = {0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f};
// The stored quant_map of FP4: magnitude with the sign bit applied (index 8 is +0: bitsandbytes
// builds it from the integer 0).
constexpr float kFp4[16] = {0.0f, 0.005208333333f, 0.66666667f, 1.0f, 0.33333333f, 0.5f, 0.16666667f, 0.25f,
                            0.0f, -0.005208333333f, -0.66666667f, -1.0f, -0.33333333f, -0.5f, -0.16666667f, -0.25f};
// The signed 8-bit dynamic map (bitsandbytes' create_dynamic_map(signed=True), as its checkpoints
// store it in nested_quant_map): sorted, 0 and 1.0 included.
constexpr float kDynamicMap[256] = {
    -0x1.fc66660000000p-1f, -0x1.f533340000000p-1f, -0x1.ee00000000000p-1f, -0x1.e6cccc0000000p-1f,
    -0x1.df999a0000000p-1f, -0x1.d866660000000p-1f, -0x1.d133340000000p-1f, -0x1.ca00000000000p-1f,
    -0x1.c2cccc0000000p-1f, -0x1.bb999a0000000p-1f, -0x1.b466660000000p-1f, -0x1.ad33340000000p-1f,
    -0x1.a600000000000p-1f, -0x1.9ecccc0000000p-1f, -0x1.97999a0000000p-1f, -0x1.9066660000000p-1f,
    -0x1.8933340000000p-1f, -0x1.8200000000000p-1f, -0x1.7acccc0000000p-1f, -0x1.73999a0000000p-1f,
    -0x1.6c66680000000p-1f, -0x1.6533340000000p-1f, -0x1.5e00000000000p-1f, -0x1.56cccc0000000p-1f,
    -0x1.4f999a0000000p-1f, -0x1.4866680000000p-1f, -0x1.4133340000000p-1f, -0x1.3a00000000000p-1f,
    -0x1.32cccc0000000p-1f, -0x1.2b999a0000000p-1f, -0x1.2466680000000p-1f, -0x1.1d33340000000p-1f,
    -0x1.1600000000000p-1f, -0x1.0ecccc0000000p-1f, -0x1.0799980000000p-1f, -0x1.0066660000000p-1f,
    -0x1.f266640000000p-2f, -0x1.e400000000000p-2f, -0x1.d599980000000p-2f, -0x1.c733340000000p-2f,
    -0x1.b8cccc0000000p-2f, -0x1.aa66660000000p-2f, -0x1.9c00000000000p-2f, -0x1.8d99980000000p-2f,
    -0x1.7f33340000000p-2f, -0x1.70cccc0000000p-2f, -0x1.6266660000000p-2f, -0x1.5400000000000p-2f,
    -0x1.4599980000000p-2f, -0x1.3733340000000p-2f, -0x1.28cccc0000000p-2f, -0x1.1a66680000000p-2f,
    -0x1.0c00000000000p-2f, -0x1.fb33320000000p-3f, -0x1.de66660000000p-3f, -0x1.c1999a0000000p-3f,
    -0x1.a4cccc0000000p-3f, -0x1.8800000000000p-3f, -0x1.6b33340000000p-3f, -0x1.4e66660000000p-3f,
    -0x1.31999a0000000p-3f, -0x1.14cccc0000000p-3f, -0x1.f000000000000p-4f, -0x1.b666680000000p-4f,
    -0x1.93d70a0000000p-4f, -0x1.8851ee0000000p-4f, -0x1.7cccce0000000p-4f, -0x1.7147ae0000000p-4f,
    -0x1.65c2900000000p-4f, -0x1.5a3d700000000p-4f, -0x1.4eb8540000000p-4f, -0x1.4333340000000p-4f,
    -0x1.37ae140000000p-4f, -0x1.2c28f60000000p-4f, -0x1.20a3d60000000p-4f, -0x1.151eba0000000p-4f,
    -0x1.09999a0000000p-4f, -0x1.fc28f60000000p-5f, -0x1.e51eba0000000p-5f, -0x1.ce147a0000000p-5f,
    -0x1.b70a3e0000000p-5f, -0x1.a000000000000p-5f, -0x1.88f5c20000000p-5f, -0x1.71eb860000000p-5f,
    -0x1.5ae1460000000p-5f, -0x1.43d70a0000000p-5f, -0x1.2cccce0000000p-5f, -0x1.15c2900000000p-5f,
    -0x1.fd70a40000000p-6f, -0x1.cf5c2a0000000p-6f, -0x1.a147ae0000000p-6f, -0x1.7333340000000p-6f,
    -0x1.451eba0000000p-6f, -0x1.170a3e0000000p-6f, -0x1.d1eb860000000p-7f, -0x1.75c2900000000p-7f,
    -0x1.3e76c80000000p-7f, -0x1.2c08300000000p-7f, -0x1.19999a0000000p-7f, -0x1.072b020000000p-7f,
    -0x1.e978d40000000p-8f, -0x1.c49ba60000000p-8f, -0x1.9fbe760000000p-8f, -0x1.7ae1480000000p-8f,
    -0x1.56041a0000000p-8f, -0x1.3126e80000000p-8f, -0x1.0c49ba0000000p-8f, -0x1.ced9140000000p-9f,
    -0x1.851eb80000000p-9f, -0x1.3b645a0000000p-9f, -0x1.e353f80000000p-10f, -0x1.4fdf3a0000000p-10f,
    -0x1.eecbfe0000000p-11f, -0x1.b3d07c0000000p-11f, -0x1.78d5000000000p-11f, -0x1.3dd9820000000p-11f,
    -0x1.02de020000000p-11f, -0x1.8fc5060000000p-12f, -0x1.19ce0a0000000p-12f, -0x1.47ae160000000p-13f,
    -0x1.743e960000000p-14f, -0x1.15df660000000p-14f, -0x1.6f00680000000p-15f, -0x1.64840c0000000p-16f,
    -0x1.040bfe0000000p-17f, -0x1.b435280000000p-19f, -0x1.27476e0000000p-21f, 0x0.0p+0f,
    0x1.27476e0000000p-21f, 0x1.b435280000000p-19f, 0x1.040bfe0000000p-17f, 0x1.64840c0000000p-16f,
    0x1.6f00680000000p-15f, 0x1.15df660000000p-14f, 0x1.743e960000000p-14f, 0x1.47ae160000000p-13f,
    0x1.19ce0a0000000p-12f, 0x1.8fc5060000000p-12f, 0x1.02de020000000p-11f, 0x1.3dd9820000000p-11f,
    0x1.78d5000000000p-11f, 0x1.b3d07c0000000p-11f, 0x1.eecbfe0000000p-11f, 0x1.4fdf3a0000000p-10f,
    0x1.e353f80000000p-10f, 0x1.3b645a0000000p-9f, 0x1.851eb80000000p-9f, 0x1.ced9140000000p-9f,
    0x1.0c49ba0000000p-8f, 0x1.3126e80000000p-8f, 0x1.56041a0000000p-8f, 0x1.7ae1480000000p-8f,
    0x1.9fbe760000000p-8f, 0x1.c49ba60000000p-8f, 0x1.e978d40000000p-8f, 0x1.072b020000000p-7f,
    0x1.19999a0000000p-7f, 0x1.2c08300000000p-7f, 0x1.3e76c80000000p-7f, 0x1.75c2900000000p-7f,
    0x1.d1eb860000000p-7f, 0x1.170a3e0000000p-6f, 0x1.451eba0000000p-6f, 0x1.7333340000000p-6f,
    0x1.a147ae0000000p-6f, 0x1.cf5c2a0000000p-6f, 0x1.fd70a40000000p-6f, 0x1.15c2900000000p-5f,
    0x1.2cccce0000000p-5f, 0x1.43d70a0000000p-5f, 0x1.5ae1460000000p-5f, 0x1.71eb860000000p-5f,
    0x1.88f5c20000000p-5f, 0x1.a000000000000p-5f, 0x1.b70a3e0000000p-5f, 0x1.ce147a0000000p-5f,
    0x1.e51eba0000000p-5f, 0x1.fc28f60000000p-5f, 0x1.09999a0000000p-4f, 0x1.151eba0000000p-4f,
    0x1.20a3d60000000p-4f, 0x1.2c28f60000000p-4f, 0x1.37ae140000000p-4f, 0x1.4333340000000p-4f,
    0x1.4eb8540000000p-4f, 0x1.5a3d700000000p-4f, 0x1.65c2900000000p-4f, 0x1.7147ae0000000p-4f,
    0x1.7cccce0000000p-4f, 0x1.8851ee0000000p-4f, 0x1.93d70a0000000p-4f, 0x1.b666680000000p-4f,
    0x1.f000000000000p-4f, 0x1.14cccc0000000p-3f, 0x1.31999a0000000p-3f, 0x1.4e66660000000p-3f,
    0x1.6b33340000000p-3f, 0x1.8800000000000p-3f, 0x1.a4cccc0000000p-3f, 0x1.c1999a0000000p-3f,
    0x1.de66660000000p-3f, 0x1.fb33320000000p-3f, 0x1.0c00000000000p-2f, 0x1.1a66680000000p-2f,
    0x1.28cccc0000000p-2f, 0x1.3733340000000p-2f, 0x1.4599980000000p-2f, 0x1.5400000000000p-2f,
    0x1.6266660000000p-2f, 0x1.70cccc0000000p-2f, 0x1.7f33340000000p-2f, 0x1.8d99980000000p-2f,
    0x1.9c00000000000p-2f, 0x1.aa66660000000p-2f, 0x1.b8cccc0000000p-2f, 0x1.c733340000000p-2f,
    0x1.d599980000000p-2f, 0x1.e400000000000p-2f, 0x1.f266640000000p-2f, 0x1.0066660000000p-1f,
    0x1.0799980000000p-1f, 0x1.0ecccc0000000p-1f, 0x1.1600000000000p-1f, 0x1.1d33340000000p-1f,
    0x1.2466680000000p-1f, 0x1.2b999a0000000p-1f, 0x1.32cccc0000000p-1f, 0x1.3a00000000000p-1f,
    0x1.4133340000000p-1f, 0x1.4866680000000p-1f, 0x1.4f999a0000000p-1f, 0x1.56cccc0000000p-1f,
    0x1.5e00000000000p-1f, 0x1.6533340000000p-1f, 0x1.6c66680000000p-1f, 0x1.73999a0000000p-1f,
    0x1.7acccc0000000p-1f, 0x1.8200000000000p-1f, 0x1.8933340000000p-1f, 0x1.9066660000000p-1f,
    0x1.97999a0000000p-1f, 0x1.9ecccc0000000p-1f, 0x1.a600000000000p-1f, 0x1.ad33340000000p-1f,
    0x1.b466660000000p-1f, 0x1.bb999a0000000p-1f, 0x1.c2cccc0000000p-1f, 0x1.ca00000000000p-1f,
    0x1.d133340000000p-1f, 0x1.d866660000000p-1f, 0x1.df999a0000000p-1f, 0x1.e6cccc0000000p-1f,
    0x1.ee00000000000p-1f, 0x1.f533340000000p-1f, 0x1.fc66660000000p-1f, 0x1.0000000000000p+0f,
};

bool is_denormal_or_zero(float x) { return std::fabs(x) < FLT_MIN; }
// Flush a denormal to the zero of its sign, as the GPU's .ftz modifier does.
float ftz(float x) { return is_denormal_or_zero(x) ? std::copysign(0.0f, x) : x; }
float add_ftz(float a, float b) { return ftz(ftz(a) + ftz(b)); }

// fmaxf as the kernels' max.ftz.f32: a NaN operand yields the other; denormals count as zero.
float fmax_ftz(float a, float b) { return std::fmax(ftz(a), ftz(b)); }

// dQuantizeNF4: how many thresholds lie strictly below x (NaN: none, code 0).
uint8_t nf4_code(float x) {
  uint8_t code = 0;
  for (float t : kNf4Thresholds) code += x > t ? 1 : 0;
  return code;
}

// dQuantizeFP4: sign bit, then the magnitude's branch of bitsandbytes' decision tree.
uint8_t fp4_code(float x) {
  const uint8_t sign = x < 0 ? 0b1000 : 0;
  x = std::fabs(x);
  if (x > 0.29166667f) {
    if (x > 0.583333f) return (x > 0.8333333f ? 0b0011 : 0b0010) + sign;
    return (x > 0.4166667f ? 0b0101 : 0b0100) + sign;
  }
  if (x > 0.0859375f) return (x > 0.20833333f ? 0b0111 : 0b0110) + sign;
  return (x > 0.00260417f ? 0b0001 : 0b0000) + sign;
}

float fp4_value(uint8_t code) {
  const float sign = 1.0f - 2.0f * static_cast<float>((code & 0b1000) >> 3);
  return mul_ftz(kFp4Magnitude[code & 0b111], sign);
}

// dQuantize<0>: the nearest entry of a sorted 256-entry map by binary search and midpoints, with the
// kernel's exact sequence of comparisons (its midpoints are computed in F32, so ties and
// near-ties resolve as on the GPU).
uint8_t map_code(const float* map, float x) {
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

// The block's max |v| as the kernels reduce it: from −FLT_MAX, through max.ftz; a partial block
// also reduces the zeros its load padded with.
float block_absmax(const float* x, int64_t count, int64_t blocksize) {
  float m = -FLT_MAX;
  for (int64_t i = 0; i < count; ++i) m = fmax_ftz(m, std::fabs(x[i]));
  if (count < blocksize) m = fmax_ftz(m, 0.0f);
  return m;
}

}  // namespace

const char* type_name(Type type) { return type == Type::NF4 ? "nf4" : "fp4"; }
const float* table(Type type) { return type == Type::NF4 ? kNf4 : kFp4; }
const float* dynamic_map() { return kDynamicMap; }

bool valid_blocksize(int64_t blocksize) {
  return blocksize >= 32 && blocksize <= 4096 && (blocksize & (blocksize - 1)) == 0;
}

float mul_ftz(float a, float b) { return ftz(ftz(a) * ftz(b)); }

const uint8_t* rcp_table() { return spindle_rcp_approx_f32_table; }

float rcp_approx_ftz(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t sign = bits & 0x80000000u, exponent = (bits >> 23) & 0xFFu, mantissa = bits & 0x7FFFFFu;
  if (exponent == 0) return std::bit_cast<float>(sign | 0x7F800000u);  // ±0 and (flushed) denormals: ±inf
  if (exponent == 0xFF) return mantissa ? std::bit_cast<float>(0x7FFFFFFFu) : std::bit_cast<float>(sign);
  // The reciprocal of the mantissa m ∈ [1, 2), correctly rounded; where the table says the GPU
  // returns the other float around 1/m, step to it (up when r lies below 1/m).
  const float m = std::bit_cast<float>(0x3F800000u | mantissa);
  float r = 1.0f / m;
  if ((spindle_rcp_approx_f32_table[mantissa >> 3] >> (mantissa & 7)) & 1) {
    const float residual = std::fma(-m, r, 1.0f);  // 1 − m·r, exact before rounding: its sign is right
    r = std::nextafter(r, residual > 0 ? 2.0f : 0.0f);
  }
  // 1/x = r·2^(127 − exponent), exactly (r's mantissa is kept); below the normal range it flushes.
  const uint32_t r_bits = std::bit_cast<uint32_t>(r);
  const int32_t out_exponent = static_cast<int32_t>((r_bits >> 23) & 0xFFu) + 127 - static_cast<int32_t>(exponent);
  if (out_exponent <= 0) return std::bit_cast<float>(sign);
  return std::bit_cast<float>(sign | (static_cast<uint32_t>(out_exponent) << 23) | (r_bits & 0x7FFFFFu));
}

void quantize(const float* x, int64_t n, int64_t blocksize, Type type, uint8_t* packed, float* absmax) {
  SPINDLE_CHECK(valid_blocksize(blocksize), "4-bit blocksize {}", blocksize);
  const int64_t blocks = num_blocks(n, blocksize);
#pragma omp parallel for schedule(static) if (blocks > 64)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * blocksize, count = std::min(blocksize, n - begin);
    const float m = block_absmax(x + begin, count, blocksize);
    absmax[b] = m;
    const float r = rcp_approx_ftz(m);
    // Element begin + i into nibble i of the block; blocks start on even elements (even blocksize),
    // and a missing last element is the kernel's zero padding.
    for (int64_t i = 0; i < count; i += 2) {
      const float v0 = x[begin + i], v1 = i + 1 < count ? x[begin + i + 1] : 0.0f;
      const float s0 = mul_ftz(v0, r), s1 = mul_ftz(v1, r);
      const uint8_t c0 = type == Type::NF4 ? nf4_code(s0) : fp4_code(s0);
      const uint8_t c1 = type == Type::NF4 ? nf4_code(s1) : fp4_code(s1);
      packed[(begin + i) / 2] = static_cast<uint8_t>((c0 << 4) | c1);
    }
  }
}

void dequantize(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize, Type type, float* out) {
  SPINDLE_CHECK(valid_blocksize(blocksize), "4-bit blocksize {}", blocksize);
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t byte = packed[j / 2];
    const uint8_t code = (j & 1) ? (byte & 0x0F) : (byte >> 4);
    const float value = type == Type::NF4 ? kNf4[code] : fp4_value(code);
    out[j] = mul_ftz(value, absmax[j / blocksize]);
  }
}

float absmax_mean(const float* absmax, int64_t k) {
  double sum = 0;
  for (int64_t i = 0; i < k; ++i) sum += absmax[i];
  return k ? static_cast<float>(sum / static_cast<double>(k)) : 0.0f;
}

void quantize_absmax(const float* absmax, int64_t k, float offset, int64_t blocksize2, uint8_t* codes,
                     float* absmax2) {
  quantize_absmax(absmax, k, offset, blocksize2, kDynamicMap, codes, absmax2);
}

void quantize_absmax(const float* absmax, int64_t k, float offset, int64_t blocksize2, const float* code_map,
                     uint8_t* codes, float* absmax2) {
  const int64_t blocks = num_blocks(k, blocksize2);
#pragma omp parallel for schedule(static) if (blocks > 16)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * blocksize2, count = std::min(blocksize2, k - begin);
    // absmax − offset in IEEE F32 (bitsandbytes subtracts with torch, outside its kernels).
    float centred[4096];
    SPINDLE_CHECK(count <= 4096, "nested blocksize {}", blocksize2);
    for (int64_t i = 0; i < count; ++i) centred[i] = absmax[begin + i] - offset;
    const float m = block_absmax(centred, count, blocksize2);
    absmax2[b] = m;
    const float r = rcp_approx_ftz(m);
    for (int64_t i = 0; i < count; ++i) codes[begin + i] = map_code(code_map, mul_ftz(centred[i], r));
  }
}

void dequantize_absmax(const uint8_t* codes, int64_t k, const float* code_map, const float* absmax2,
                       int64_t blocksize2, float offset, float* absmax) {
  for (int64_t i = 0; i < k; ++i) {
    const float scaled = mul_ftz(code_map[codes[i]], absmax2[i / blocksize2]);  // in the kernel
    absmax[i] = scaled + offset;                                                 // torch's add, IEEE
  }
}

}  // namespace spindle::quant4

namespace spindle::cpu {

namespace {

void require_host(const Tensor& t, DType dtype, const char* op, const char* what) {
  SPINDLE_CHECK(t.defined() && t.device().kind == DeviceKind::CPU, "{}: {} is not a CPU tensor", op, what);
  if (t.dtype() != dtype) fail("{}: {} must be {}, got {}", op, what, dtype_name(dtype), t.describe());
}

}  // namespace

void dequantize_4bit(const Tensor& packed, const Tensor& absmax, int64_t blocksize, quant4::Type type, Tensor& w) {
  require_host(packed, DType::U8, "dequantize_4bit", "packed");
  require_host(absmax, DType::F32, "dequantize_4bit", "absmax");
  const int64_t n = w.numel();
  if (!quant4::valid_blocksize(blocksize)) fail("dequantize_4bit: blocksize {} is not 32 … 4096, a power of two", blocksize);
  if (packed.numel() != (n + 1) / 2 || absmax.numel() != quant4::num_blocks(n, blocksize))
    fail("dequantize_4bit: {} weights of blocksize {} need {} packed bytes and {} absmax, got {} and {}", n, blocksize,
         (n + 1) / 2, quant4::num_blocks(n, blocksize), packed.describe(), absmax.describe());
  if (w.dtype() == DType::F32) {
    quant4::dequantize(packed.data_as<uint8_t>(), absmax.data_as<float>(), n, blocksize, type, w.data_as<float>());
    return;
  }
  if (w.dtype() != DType::F64) fail("dequantize_4bit: the CPU backend writes F32 or F64, got {}", w.describe());
  // The F32 products, widened: F64 runs compute with exactly the weights bitsandbytes' F32 has.
  std::vector<float> values(static_cast<size_t>(n));
  quant4::dequantize(packed.data_as<uint8_t>(), absmax.data_as<float>(), n, blocksize, type, values.data());
  double* out = w.data_as<double>();
  for (int64_t j = 0; j < n; ++j) out[j] = values[j];
}

void dequantize_absmax(const Tensor& codes, const Tensor& code_map, const Tensor& absmax2, int64_t blocksize2,
                       double offset, Tensor& absmax) {
  require_host(codes, DType::U8, "dequantize_absmax", "codes");
  require_host(code_map, DType::F32, "dequantize_absmax", "code_map");
  require_host(absmax2, DType::F32, "dequantize_absmax", "absmax2");
  require_host(absmax, DType::F32, "dequantize_absmax", "absmax");
  const int64_t k = codes.numel();
  if (code_map.numel() != 256 || absmax.numel() != k || blocksize2 <= 0 ||
      absmax2.numel() != quant4::num_blocks(k, blocksize2))
    fail("dequantize_absmax: {} codes of blocksize {} need a 256-entry map, {} nested absmax and {} outputs; got {}, "
         "{}, {}",
         k, blocksize2, quant4::num_blocks(k, std::max<int64_t>(blocksize2, 1)), k, code_map.describe(),
         absmax2.describe(), absmax.describe());
  quant4::dequantize_absmax(codes.data_as<uint8_t>(), k, code_map.data_as<float>(), absmax2.data_as<float>(),
                            blocksize2, static_cast<float>(offset), absmax.data_as<float>());
}

void quantize_4bit(const Tensor& w, int64_t blocksize, quant4::Type type, Tensor& packed, Tensor& absmax) {
  SPINDLE_CHECK(w.defined() && w.device().kind == DeviceKind::CPU, "quantize_4bit: w is not a CPU tensor");
  require_host(packed, DType::U8, "quantize_4bit", "packed");
  require_host(absmax, DType::F32, "quantize_4bit", "absmax");
  const int64_t n = w.numel();
  if (!quant4::valid_blocksize(blocksize)) fail("quantize_4bit: blocksize {} is not 32 … 4096, a power of two", blocksize);
  if (packed.numel() != (n + 1) / 2 || absmax.numel() != quant4::num_blocks(n, blocksize))
    fail("quantize_4bit: {} weights of blocksize {} need {} packed bytes and {} absmax, got {} and {}", n, blocksize,
         (n + 1) / 2, quant4::num_blocks(n, blocksize), packed.describe(), absmax.describe());
  if (w.dtype() == DType::F32) {
    quant4::quantize(w.data_as<float>(), n, blocksize, type, packed.data_as<uint8_t>(), absmax.data_as<float>());
    return;
  }
  // The F32 values the quantiser reads: exact for BF16/F16, rounded to nearest even from F64.
  std::vector<float> values(static_cast<size_t>(n));
  switch (w.dtype()) {
    case DType::F64:
      for (int64_t j = 0; j < n; ++j) values[j] = static_cast<float>(w.data_as<double>()[j]);
      break;
    case DType::BF16:
      for (int64_t j = 0; j < n; ++j) values[j] = bf16_to_f32(w.data_as<uint16_t>()[j]);
      break;
    case DType::F16:
      for (int64_t j = 0; j < n; ++j) values[j] = f16_to_f32(w.data_as<uint16_t>()[j]);
      break;
    default: fail("quantize_4bit: w must be F32, F64, BF16 or F16, got {}", w.describe());
  }
  quant4::quantize(values.data(), n, blocksize, type, packed.data_as<uint8_t>(), absmax.data_as<float>());
}

void quantize_absmax(const Tensor& absmax, const Tensor& code_map, double offset, int64_t blocksize2, Tensor& codes,
                     Tensor& absmax2) {
  require_host(absmax, DType::F32, "quantize_absmax", "absmax");
  require_host(code_map, DType::F32, "quantize_absmax", "code_map");
  require_host(codes, DType::U8, "quantize_absmax", "codes");
  require_host(absmax2, DType::F32, "quantize_absmax", "absmax2");
  const int64_t k = absmax.numel();
  if (code_map.numel() != 256 || codes.numel() != k || blocksize2 <= 0 || blocksize2 > 4096 ||
      absmax2.numel() != quant4::num_blocks(k, blocksize2))
    fail("quantize_absmax: {} absmax of blocksize {} (1 … 4096) need a 256-entry map, {} codes and {} nested absmax; "
         "got {}, {}, {}",
         k, blocksize2, k, quant4::num_blocks(k, std::max<int64_t>(blocksize2, 1)), code_map.describe(),
         codes.describe(), absmax2.describe());
  quant4::quantize_absmax(absmax.data_as<float>(), k, static_cast<float>(offset), blocksize2,
                          code_map.data_as<float>(), codes.data_as<uint8_t>(), absmax2.data_as<float>());
}

}  // namespace spindle::cpu
