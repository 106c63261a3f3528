// bitsandbytes' 4-bit weight format (NF4 and FP4, blockwise absmax, optionally double-quantised),
// computed on the host exactly as bitsandbytes' CUDA kernels compute it (docs/qlora.md, "Exactness").
//
// Layout of n weights quantised with blocksize B (32 … 4096, a power of two):
//   packed  U8  [(n+1)/2]  byte k holds element 2k in its high nibble and 2k+1 in its low nibble
//   absmax  F32 [ceil(n/B)] max |w| of each block of B consecutive (flattened, row-major) elements
// element j = table[nibble(j)] · absmax[j / B], the product in F32.
//
// Double quantisation (bitsandbytes' compress_statistics) stores the absmax themselves in 8 bits:
//   codes   U8  [K]            K = ceil(n/B), blockwise 8-bit codes of (absmax − offset)
//   absmax2 F32 [ceil(K/256)]  max |absmax − offset| of each block of 256 codes
//   offset  F32                the mean of the absmax
// absmax[k] = f32(f32(dynamic_map[codes[k]] · absmax2[k/256]) + offset): two roundings, no FMA.
//
// bitsandbytes builds its kernels with --use_fast_math, so its arithmetic is not IEEE's: 1/absmax is
// the GPU's approximate reciprocal (rcp.approx.ftz.f32, which is faithful but not always correctly
// rounded: rcp_approx_ftz reproduces it from a table measured on an H100-class GPU), and every product
// flushes denormal inputs and results to zero. The functions below reproduce that bit for bit.
#pragma once

#include <cstdint>

#include "backend/backend.h"
#include "core/tensor.h"

namespace spindle::quant4 {

using Type = Quant4Type;  // backend/backend.h
const char* type_name(Type type);  // "nf4", "fp4"

// The 16 values of each 4-bit code (bitsandbytes' quant_map) and the 256 of the signed 8-bit
// dynamic map that double quantisation uses (its nested_quant_map), F32.
const float* table(Type type);
const float* dynamic_map();
inline constexpr int64_t kNestedBlocksize = 256;

// True for the blocksizes bitsandbytes' 4-bit kernels accept: 32, 64, …, 4096.
bool valid_blocksize(int64_t blocksize);
inline int64_t num_blocks(int64_t n, int64_t blocksize) { return (n + blocksize - 1) / blocksize; }

// The GPU's rcp.approx.ftz.f32 (what `1.0f / x` compiles to under --use_fast_math).
float rcp_approx_ftz(float x);
// The table behind it: bit (m & 7) of byte m >> 3 is set where the GPU's reciprocal of the mantissa
// 1 + m·2⁻²³ is the float on the other side of 1/x from the correctly rounded one (the CUDA
// backend's quantiser uploads it and reproduces rcp_approx_ftz with it).
inline constexpr int64_t kRcpTableBytes = int64_t{1} << 20;
const uint8_t* rcp_table();
// The GPU's mul.ftz.f32: a·b with denormal inputs and result flushed to sign-preserving zero.
float mul_ftz(float a, float b);

// Quantises x [n] (values already in F32; bf16/f16 weights convert exactly) into packed [(n+1)/2]
// and absmax [ceil(n/blocksize)], as bitsandbytes' quantize_4bit.
void quantize(const float* x, int64_t n, int64_t blocksize, Type type, uint8_t* packed, float* absmax);
// out [n] = table[nibble]·absmax as F32 (bitsandbytes' dequantize_4bit to float32).
void dequantize(const uint8_t* packed, const float* absmax, int64_t n, int64_t blocksize, Type type, float* out);

// Double quantisation. offset: the mean of absmax [k], accumulated in double and rounded once
// (bitsandbytes takes torch's float mean, whose last bit depends on the GPU's reduction order).
float absmax_mean(const float* absmax, int64_t k);
// codes [k], absmax2 [ceil(k/blocksize2)] from absmax [k] and offset, as bitsandbytes'
// quantize_blockwise(absmax − offset, dynamic map, blocksize2).
void quantize_absmax(const float* absmax, int64_t k, float offset, int64_t blocksize2, uint8_t* codes,
                     float* absmax2);
// The same with another sorted 256-entry code map (the backend op's code_map).
void quantize_absmax(const float* absmax, int64_t k, float offset, int64_t blocksize2, const float* code_map,
                     uint8_t* codes, float* absmax2);
// absmax [k] back from the codes (bitsandbytes' dequantize_blockwise, then + offset).
void dequantize_absmax(const uint8_t* codes, int64_t k, const float* code_map, const float* absmax2,
                       int64_t blocksize2, float offset, float* absmax);

}  // namespace spindle::quant4

namespace spindle::cpu {

// The CPU backend's ops (backend/backend.h, "4-bit weights"): w any float compute dtype.
void dequantize_4bit(const Tensor& packed, const Tensor& absmax, int64_t blocksize, quant4::Type type, Tensor& w);
void dequantize_absmax(const Tensor& codes, const Tensor& code_map, const Tensor& absmax2, int64_t blocksize2,
                       double offset, Tensor& absmax);
// w: F32, F64 (rounded to F32), BF16 or F16.
void quantize_4bit(const Tensor& w, int64_t blocksize, quant4::Type type, Tensor& packed, Tensor& absmax);
void quantize_absmax(const Tensor& absmax, const Tensor& code_map, double offset, int64_t blocksize2, Tensor& codes,
                     Tensor& absmax2);

}  // namespace spindle::cpu
