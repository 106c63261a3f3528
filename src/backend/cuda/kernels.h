// Launchers of the CUDA kernel families, one .cu file each. They take raw device pointers and the
// op's stream; cuda_backend.cpp checks shapes and dtypes against backend.h and calls them. Compute
// dtypes are F32 or BF16 (bf16 storage, f32 arithmetic inside every kernel); statistics are F32.
#pragma once

#include <cstddef>
#include <cstdint>

#include <cuda_runtime.h>

#include "backend/cuda/cuda_check.h"
#include "core/dtype.h"

namespace spindle::cuda {

// Bad input found by a kernel (a token id outside the vocabulary, ...). Lives in pinned, mapped
// host memory so the host can read it after a synchronize without a copy; the first error wins.
struct DeviceError {
  int code;          // ErrorCode
  int reserved;
  long long index;   // where (token / row number)
  long long value;   // the offending value
  long long limit;   // the allowed range [0, limit)
};
enum ErrorCode : int { kErrNone = 0, kErrTokenId = 1, kErrGatherIndex = 2, kErrScatterIndex = 3, kErrTarget = 4,
                     kErrExpertIndex = 5, kErrRunCount = 6 };

// Temporary device memory for one op, ordered on the op's stream: cudaMallocAsync now,
// cudaFreeAsync when it goes out of scope (after the kernels that use it were enqueued, which is
// all stream order needs). Served from the device's memory pool, so it costs no cudaMalloc.
class Scratch {
 public:
  Scratch(cudaStream_t stream, size_t bytes) : stream_(stream) {
    if (bytes) CUDA_CHECK(cudaMallocAsync(&ptr_, bytes, stream));
  }
  ~Scratch() {
    if (ptr_) cudaFreeAsync(ptr_, stream_);  // cannot throw from a destructor; a failure here means the
                                             // context is already broken and the next call reports it
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }

 private:
  cudaStream_t stream_;
  void* ptr_ = nullptr;
};

// ---- elementwise.cu ---------------------------------------------------------------------------
void fill(cudaStream_t s, void* p, DType t, int64_t n, double value);                       // any dtype
void convert(cudaStream_t s, const void* src, DType st, void* dst, DType dt, int64_t n);     // float/int dtypes
void scale(cudaStream_t s, void* x, DType t, int64_t n, double alpha);
void axpy(cudaStream_t s, double alpha, const void* x, void* y, DType t, int64_t n);
void add_bias(cudaStream_t s, void* y, const void* bias, DType t, int64_t rows, int64_t n);

// ---- reduce.cu ---------------------------------------------------------------------------------
void sum_squares(cudaStream_t s, const void* x, DType t, int64_t n, float* out);            // out[0] +=
void bias_backward(cudaStream_t s, const void* dy, void* dbias, DType t, int64_t rows, int64_t n);

// ---- activation.cu -----------------------------------------------------------------------------
void swiglu_forward(cudaStream_t s, const void* gate, const void* up, void* out, DType t, int64_t n);
void swiglu_backward(cudaStream_t s, const void* gate, const void* up, const void* dout, void* dgate, void* dup,
                     DType t, int64_t n);

// ---- quant4.cu: bitsandbytes' 4-bit weights ------------------------------------------------------
// out [n] (dtype t) = table[code]·absmax[j / blocksize]; packed U8 [(n+1)/2], absmax F32.
void dequantize_4bit(cudaStream_t s, const void* packed, const void* absmax, void* out, DType t, int64_t n,
                     int64_t blocksize, bool nf4);
// absmax F32 [k] = code_map[codes[i]]·absmax2[i / blocksize2] + offset (two roundings).
void dequantize_absmax(cudaStream_t s, const void* codes, const void* code_map, const void* absmax2, void* absmax,
                       int64_t k, int64_t blocksize2, float offset);
// The inverse of dequantize_4bit, bit-identical to the host quantiser (backend/cpu/quant4_ops.h): w [n] of
// dtype t (F32, BF16, F16; F64 rounded to F32) -> packed U8 [(n+1)/2], absmax F32 [ceil(n/blocksize)].
// rcp_table: quant4::rcp_table() on the device (U8 [2^20]).
void quantize_4bit(cudaStream_t s, const void* w, DType t, int64_t n, int64_t blocksize, bool nf4,
                   const uint8_t* rcp_table, void* packed, void* absmax);
// Double quantisation of absmax F32 [k] around offset: codes U8 [k], absmax2 F32 [ceil(k/blocksize2)],
// blocksize2 at most 4096; code_map F32 [256] sorted.
void quantize_absmax(cudaStream_t s, const void* absmax, const void* code_map, float offset, int64_t k,
                     int64_t blocksize2, const uint8_t* rcp_table, void* codes, void* absmax2);

// ---- random.cu: ModelWeights::random's values (core/random_hash.h) ------------------------------
// out [n] of dtype t (F32, F64, BF16, F16) = the uniform values of stream (seed, sequence) on ±half_width.
void fill_random_uniform(cudaStream_t s, void* out, DType t, int64_t n, uint64_t seed, uint64_t sequence,
                         double half_width);

// ---- adamw.cu ----------------------------------------------------------------------------------
struct AdamWParams {
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  float bias_correction1, bias_correction2;  // 1 − β^step, computed on the host in double
};
void adamw(cudaStream_t s, float* param, const float* grad, float* m, float* v, int64_t n, const AdamWParams& hp);

// ---- rows.cu -----------------------------------------------------------------------------------
// dst[r, :] = src[idx[r], :] for r < n; an index outside [0, src_rows) writes zeros and reports `code`.
void gather_rows(cudaStream_t s, const void* src, int64_t src_rows, const int32_t* idx, int64_t n, void* dst,
                 size_t row_bytes, DeviceError* err, int code);
// dst[idx[r], :] += src[r, :]. Rows with the same index are summed in f32 in a fixed order (stable
// sort of the indices), then added to dst once: deterministic, one rounding per destination row.
// Rows whose index is skip_index (>= 0) add nothing (the embedding's padding row).
void scatter_add_rows(cudaStream_t s, const void* src, const int32_t* idx, int64_t n, void* dst, int64_t dst_rows,
                      int64_t row_elems, DType t, DeviceError* err, int32_t skip_index = -1);

// ---- lora.cu -----------------------------------------------------------------------------------
// BF16, all contiguous: dy [t, n], b [n, r], xa [t, r] -> dxa [t, r] = scaling·dy·b and, when db is
// not null, db [n, r] += scaling·dyᵀ·xa (F32 sums, one rounding), from one read of dy. Only where
// lora_b_backward_supported(n, r) (n a multiple of 128, r 16, 32 or 64), with 16-byte aligned pointers.
bool lora_b_backward_supported(int64_t n, int64_t r);
void lora_b_backward(cudaStream_t s, const void* dy, const void* b, const void* xa, int64_t t, int64_t n, int64_t r,
                     float scaling, void* dxa, void* db);

// ---- rmsnorm.cu --------------------------------------------------------------------------------
void rmsnorm_forward(cudaStream_t s, const void* x, const void* w, void* y, float* rstd, DType t, int64_t rows,
                     int64_t c, float eps);
// dw null: no weight gradient.
void rmsnorm_backward(cudaStream_t s, const void* x, const void* w, const float* rstd, const void* dy, void* dx,
                      void* dw, DType t, int64_t rows, int64_t c, bool accumulate_dx);

// ---- rope.cu -----------------------------------------------------------------------------------
void rope(cudaStream_t s, void* x, DType t, int64_t tokens, int64_t heads, int64_t d, const int32_t* pos,
          const float* inv_freq, double attention_scale, int sign);

// ---- cross_entropy.cu --------------------------------------------------------------------------
void cross_entropy(cudaStream_t s, void* logits, DType t, int64_t n, int64_t vocab, const int32_t* targets,
                   const void* weights, DType wt, double loss_scale, double grad_scale, float* loss_sum,
                   float* token_ce, DeviceError* err);

// ---- attention_*.cu ----------------------------------------------------------------------------
struct AttentionShape {
  int64_t tq, tk;  // query / key tokens
  int hq, hkv, d;  // heads, head dim
};
struct AttentionMaskPtrs {
  const int32_t *q_doc, *q_pos, *k_doc, *k_pos;  // I32 [tq] / [tk]
  int window = 0;  // the layer's sliding window, 0: none (backend/attention_rule.h)
};
// Which attention kernels to use. Auto: on Hopper (sm_90) the wgmma kernels for BF16 with head dim
// 128, the tensor-core mma.sync kernels for BF16 with head dim 64 or 128 elsewhere, the simple
// f32-FMA kernels for everything else. The others force one (tests, measurements). Cudnn: cuDNN's
// fused SDPA (attention_cudnn.h), dispatched by the backend itself (not by attention_forward/
// backward below), for BF16, d = 64, 128 or 256, one causal document or a fully visible block only.
enum class AttentionImpl { Auto, Simple, Mma, Wgmma, Cudnn };
// Whether Auto runs one of the tensor-core kernels (wgmma or mma.sync) for this dtype and head dim;
// otherwise it runs the simple f32-FMA kernels (head dim 256 among them).
bool attention_own_tensor_cores(DType io, int d);

// out [tq, hq, d] (io dtype, or F32 for bf16 inputs), lse F32 [hq, tq].
void attention_forward(cudaStream_t s, AttentionImpl impl, const AttentionShape& sh, DType io, const void* q,
                       const void* k, const void* v, const AttentionMaskPtrs& mask, float scale, void* out,
                       DType out_dtype, float* lse);
// dq/dk/dv in `grad`: the io dtype, or F32 for bf16 inputs.
void attention_backward(cudaStream_t s, AttentionImpl impl, const AttentionShape& sh, DType io, const void* q,
                        const void* k, const void* v, const void* out, const void* dout, const float* lse,
                        const AttentionMaskPtrs& mask, float scale, DType grad, void* dq, void* dk, void* dv,
                        bool accumulate);
// out F32 [tq, hq, d], lse/lse_b F32 [hq, tq], out_b F32 or BF16.
void attention_merge(cudaStream_t s, float* out, float* lse, const void* out_b, DType tb, const float* lse_b,
                     int64_t tq, int hq, int d);

}  // namespace spindle::cuda
