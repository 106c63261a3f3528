// The backend op set. Model, loss and parallel code call these on device-resident tensors and
// never touch element data on the host. Each backend (backend/cpu, backend/cuda) implements every
// op; tests/backend checks each op of each backend against the CPU backend.
//
// Conventions for every op:
//  - Tensors are contiguous and row-major; shapes in the comments use T = tokens, H = hidden,
//    D = head dim, Hq/Hkv = query/key-value heads, F = MLP width, V = vocab, R = rows.
//  - Float tensors share one dtype per call (the "compute tensors"): F32/F64 on the CPU backend,
//    BF16 (storage) with F32 accumulation on CUDA. Index tensors are I32. Statistics that must
//    stay precise (rstd, lse, loss accumulators) are F32 (F64 when the compute dtype is F64).
//  - Ops named *_backward accumulate into parameter gradients (+=) and either overwrite or
//    accumulate into input gradients as their `accumulate` flag says.
//  - Every op is issued on the given stream; results are ready after synchronize(stream).
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "backend/attention_rule.h"
#include "core/error.h"
#include "core/tensor.h"

namespace spindle {

// An opaque execution queue (cudaStream_t on CUDA; ignored on the CPU, which runs in order).
struct Stream {
  void* handle = nullptr;
};

// Where the tokens of an attention call lie: each query's and key's document and position. Which
// keys a query sees follows from these and the layer's window by the one rule of
// backend/attention_rule.h (same document, causal, inside the window); it covers causal, packed
// documents, padding (its own document id), sliding windows and any ring block of a zigzag layout.
struct AttentionMask {
  Tensor q_doc, q_pos;  // I32 [Tq]
  Tensor k_doc, k_pos;  // I32 [Tk]
  // A fact the caller knows on the host, optional: q and k are the same T tokens, one document at
  // positions 0 … T−1, i.e. the plain causal mask (before any window). A backend with a faster path
  // for that mask (cuDNN's) may take it without reading the tensors; false says nothing.
  bool plain_causal = false;
};

// How a layer's attention turns q·k into the logits of its softmax (one per layer: model/config.h
// AttentionSpec holds it with the layer's sinks):
//   logit = scale·q·k, then softcap·tanh(logit / softcap) when softcap > 0 (Gemma 2), then −∞ for a
//   key the query does not see (backend/attention_rule.h; window > 0: the `window` latest keys of
//   the query's document, itself included).
struct AttentionLogits {
  double scale = 1.0;
  double softcap = 0;
  int64_t window = 0;
  bool plain() const { return softcap == 0 && window == 0; }
};

// Memory held by a backend's process, for progress lines, metrics and `spindle bench`.
// CUDA: the stream-ordered pool tensors come from (shared by every backend on that device in this
// process, NCCL scratch too), plus the whole device as the driver sees it. CPU: the process's
// bytes in live tensors (allocated) and the resident set (reserved), device fields 0.
struct MemoryStats {
  int64_t allocated_bytes = 0;       // in live tensors now
  int64_t peak_allocated_bytes = 0;  // high-water mark since start or reset_peak_memory()
  int64_t reserved_bytes = 0;        // held by the allocator, cached free blocks included
  int64_t peak_reserved_bytes = 0;
  int64_t device_used_bytes = 0;     // device memory in use by everyone (CUDA context, cuBLAS, NCCL, other processes)
  int64_t device_total_bytes = 0;
  // Host memory in live tensors from empty_host (activation offload) and its high-water mark since
  // start or reset_peak_memory(); not part of the fields above.
  int64_t host_allocated_bytes = 0;
  int64_t peak_host_allocated_bytes = 0;
};

// Activation offload's copies (Backend::offload_stats) since start or reset_offload_stats(): the
// copy bandwidth (bytes / copy_seconds) and the time offload adds to a step (wait_seconds), as
// spindle bench and the training progress line report them.
struct OffloadStats {
  int64_t copies = 0;        // copy_host_device calls
  int64_t bytes = 0;         // bytes they moved, both directions
  double copy_seconds = 0;   // Σ of each copy's duration (CUDA: events before and after it on its stream)
  // How long compute waited for copies: CUDA, Σ over wait_for_copies of how much later the copies it
  // waits for finished than the waiting stream reached the wait (0 when they were done first); CPU,
  // the copies' own time, which they spend inside the step (copy_seconds).
  double wait_seconds = 0;
};

// The two 4-bit codes of bitsandbytes' weight format (docs/qlora.md): NormalFloat4 and FP4.
enum class Quant4Type : uint8_t { NF4, FP4 };

// glm4_moe's router choice (transformers' Glm4MoeTopkRouter; Backend::moe_sigmoid_router_forward):
// k experts per token among the `top_groups` best of `groups` equal groups of experts; the weights
// renormalised when `normalize`, then times `scaling` (routed_scaling_factor).
struct SigmoidRouting {
  int64_t top_k = 1;
  int64_t groups = 1, top_groups = 1;  // n_group, topk_group
  bool normalize = true;               // norm_topk_prob
  double scaling = 1.0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  virtual Device device() const = 0;
  // False for a backend that only counts (spindle plan's): host work that would only produce values
  // for it, such as drawing LoRA's initial A matrices, can be skipped; its allocations cannot.
  virtual bool computes() const { return true; }
  virtual Stream default_stream() = 0;
  virtual void synchronize(Stream stream) = 0;

  // ---- a second queue, for communication that overlaps compute ----------------------------------
  // Work on different streams may run concurrently; stream_wait is the only ordering between them.
  // CPU: one queue in all but name (every op runs inside its call, in program order), so both
  // functions cost nothing and the handles are ignored.
  //
  // The side stream of this backend, for collectives and copies that should run while compute
  // continues on default_stream() (ring attention's K/V transfer, FSDP's next all-gather). The
  // backend creates it on first use and destroys it with itself; every call returns the same
  // handle, so its users share one queue and their work on it runs in program order. Not for
  // gemm: cuBLASLt's workspace is per backend and gemms on two streams at once would share it.
  virtual Stream comm_stream() = 0;
  // Orders two streams without blocking the host: work enqueued on `waiter` after this call starts
  // only after all work enqueued on `signaller` before this call has finished. Later work on
  // `signaller` is not waited for. waiter == signaller is allowed (nothing to do).
  //
  // Memory and streams (CUDA): tensors are allocated and freed in the order of default_stream()
  // (stream-ordered pool). So a tensor that another stream touches must be (1) allocated, and
  // written by default_stream(), before stream_wait(other, default_stream()) and only then used
  // there, and (2) kept alive until stream_wait(default_stream(), other) has been called after
  // that use; otherwise its memory can be handed to the next allocation while still in use.
  virtual void stream_wait(Stream waiter, Stream signaller) = 0;

  // ---- memory ---------------------------------------------------------------------------------
  // Uninitialised memory; callers fill or overwrite it.
  virtual Tensor empty(Shape shape, DType dtype) = 0;
  Tensor zeros(Shape shape, DType dtype) {  // empty + fill(0) on the default stream
    Tensor t = empty(shape, dtype);
    fill(default_stream(), t, 0.0);
    return t;
  }
  virtual void copy_from_host(Stream stream, const void* src, Tensor& dst) = 0;  // dst.bytes() read
  virtual void copy_to_host(Stream stream, const Tensor& src, void* dst) = 0;    // synchronous
  // dst = src converted to dst's dtype (same element count; shapes may differ).
  virtual void copy(Stream stream, const Tensor& src, Tensor& dst) = 0;
  virtual void fill(Stream stream, Tensor& t, double value) = 0;
  // t (any float dtype) [n] = the counter-based uniform values of core/random_hash.h: v_i of stream
  // (seed, sequence) on ±half_width, computed in double, then stored as copy() stores a double (F64
  // as is; F32 rounded to nearest even; BF16/F16 through that F32, rounded to nearest even). Every
  // backend writes the same bits (ModelWeights::random draws its weights on the backend this way).
  virtual void fill_random_uniform(Stream stream, Tensor& t, uint64_t seed, uint64_t sequence, double half_width) = 0;
  virtual MemoryStats memory_stats() = 0;
  virtual void reset_peak_memory() = 0;  // peaks restart from the current values

  // ---- host memory, for activation offload (--offload activations, model/decoder.h) -----------
  // A tensor in host memory that copy_host_device moves to and from this backend's tensors. CUDA:
  // page-locked (pinned) memory, cached for reuse, so copies are DMA beside compute; CPU: an
  // allocation outside the tensor bytes it reports as allocated (its "device"), so the offload's
  // saving is measurable there. Counted in MemoryStats::host_allocated_bytes.
  virtual Tensor empty_host(Shape shape, DType dtype) = 0;
  // dst = src, same dtype and element count, one of them from empty_host and the other from
  // empty, enqueued on `stream` (CUDA: asynchronous). Both must stay alive, and unused by other
  // streams, until the stream that frees them has waited for `stream` (stream_wait).
  virtual void copy_host_device(Stream stream, const Tensor& src, Tensor& dst) = 0;
  // The queue for those copies: beside compute and beside comm_stream's collectives on CUDA (a
  // copy engine of its own); ordered with the others by stream_wait only.
  virtual Stream copy_stream() { return comm_stream(); }
  // stream_wait(waiter, copy_stream()), also counting how long `waiter` stalls there
  // (OffloadStats::wait_seconds).
  virtual void wait_for_copies(Stream waiter) = 0;
  // The copies and waits since start or reset_offload_stats(); call after synchronizing.
  virtual OffloadStats offload_stats() = 0;
  virtual void reset_offload_stats() = 0;

  // ---- elementwise and reductions ------------------------------------------------------------
  virtual void scale(Stream stream, Tensor& x, double alpha) = 0;                      // x *= alpha
  virtual void axpy(Stream stream, double alpha, const Tensor& x, Tensor& y) = 0;      // y += alpha·x
  // out[i] = Σ x[i]² accumulated into a one-element F32/F64 tensor (out += ...).
  virtual void sum_squares(Stream stream, const Tensor& x, Tensor& out) = 0;

  // ---- dense algebra -------------------------------------------------------------------------
  // C = alpha·op(A)·op(B) + beta·C, op(X) = Xᵀ when trans. C [M, N], op(A) [M, K], op(B) [K, N].
  virtual void gemm(Stream stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                    double alpha, double beta) = 0;
  // C = alpha·op(A)·op(B) + beta·C + bias[N] (broadcast over rows; bias has C's dtype). A backend
  // that can add the bias inside the GEMM (cuBLASLt's epilogue) saves a pass over C; this default
  // is the GEMM, then add_bias.
  virtual void gemm_bias(Stream stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c,
                         double alpha, double beta, const Tensor& bias) {
    gemm(stream, a, trans_a, b, trans_b, c, alpha, beta);
    add_bias(stream, c, bias);
  }
  // The backward of a LoRA projection's B product y += s·xa·Bᵀ, for dy [T, out], B [out, r] and the
  // forward's xa [T, r]: dxa [T, r] = s·dy·B and, when db is given, db [out, r] += s·dyᵀ·xa. Both
  // read all of dy; a backend that forms them from one read of it (CUDA, BF16) saves a pass over
  // the largest tensor of the projection's backward. This default is the two GEMMs.
  virtual void lora_b_backward(Stream stream, const Tensor& dy, const Tensor& b, const Tensor& xa, double scaling,
                               Tensor& dxa, Tensor* db) {
    if (db) gemm(stream, dy, true, xa, false, *db, scaling, 1.0);
    gemm(stream, dy, false, b, false, dxa, scaling, 0.0);
  }
  // y[R, N] += bias[N] (broadcast over rows).
  virtual void add_bias(Stream stream, Tensor& y, const Tensor& bias) = 0;
  // dbias[N] += Σ_rows dy[R, N].
  virtual void bias_backward(Stream stream, const Tensor& dy, Tensor& dbias) = 0;

  // ---- model ops -------------------------------------------------------------------------------
  // out[T, H] = table[ids[t], :]; ids I32 [T].
  virtual void embedding_forward(Stream stream, const Tensor& ids, const Tensor& table, Tensor& out) = 0;
  // dtable[ids[t], :] += dout[t, :] for every t with ids[t] != padding_id (transformers' padding_idx:
  // that row gets no gradient from its lookups); padding_id −1: every token adds.
  virtual void embedding_backward(Stream stream, const Tensor& ids, const Tensor& dout, Tensor& dtable,
                                  int64_t padding_id) = 0;

  // y[R, C] = x / sqrt(mean(x²) + eps) · w[C]; rstd[R] (F32) saved for backward.
  virtual void rmsnorm_forward(Stream stream, const Tensor& x, const Tensor& w, double eps, Tensor& y,
                               Tensor& rstd) = 0;
  // dx (= or += by accumulate_dx), *dw += ; dw null: a frozen weight, no weight gradient (without
  // the column sums the CUDA op took 12.1 instead of 20.6 ms per 64k step of the 1.5B model).
  virtual void rmsnorm_backward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                                Tensor& dx, Tensor* dw, bool accumulate_dx) = 0;

  // In place on x [T, heads, D], HF "rotate_half" layout: pairs (i, i + D/2) rotated by
  // angle pos[t]·inv_freq[i] (times sign: +1 forward, −1 is the exact backward / inverse).
  // inv_freq F32 [D/2] already holds any RoPE scaling; cos and sin are scaled by attention_scale.
  virtual void rope(Stream stream, Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                    double attention_scale, int sign) = 0;

  // Attention with grouped query heads (Hq a multiple of Hkv), logits as `logits` says.
  // q [Tq, Hq, D], k/v [Tk, Hkv, D] -> out [Tq, Hq, D], lse F32 [Hq, Tq] (natural log of the
  // softmax denominator). A query row with no visible key gets out = 0 and lse = −inf.
  virtual void attention_forward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                 const AttentionMask& mask, const AttentionLogits& logits, Tensor& out,
                                 Tensor& lse) = 0;
  // Given the final out and lse (which may come from merging several key blocks), the exact
  // partial gradients for this key block: dq/dk/dv (= or += by accumulate). Backends with 16-bit
  // compute (CUDA) may write F32 dq/dk/dv for BF16 inputs: ring attention sums the partial
  // gradients of its blocks, which cancel each other, in F32.
  virtual void attention_backward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                  const Tensor& out, const Tensor& dout, const Tensor& lse,
                                  const AttentionMask& mask, const AttentionLogits& logits, Tensor& dq,
                                  Tensor& dk, Tensor& dv, bool accumulate) = 0;
  // Merge a partial attention result into an accumulator (ring attention), in F32:
  // out ← out − σ(lse_b − lse)·(out − out_b), lse ← lse − log σ(lse − lse_b); −inf rows are
  // ignored, never NaN. out/out_b [Tq, Hq, D] (out F32), lse/lse_b F32 [Hq, Tq].
  virtual void attention_merge(Stream stream, Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b) = 0;
  // Attention sinks (gpt-oss): one learned logit σ_h per query head joins every row's softmax
  // denominator and contributes no value. Once the blocks of a row are merged (out, lse final over
  // the keys): out ← out·σ(lse − σ_h), lse ← log(e^lse + e^σ_h); a row with no visible key stays
  // out = 0 and gets lse = σ_h. out [Tq, Hq, D], lse [Hq, Tq], sinks [Hq] (out's or the stat dtype).
  // attention_backward then takes the lse with the sink in it and needs nothing else.
  virtual void attention_sink_forward(Stream stream, Tensor& out, Tensor& lse, const Tensor& sinks) {
    fail("{}: attention sinks (gpt-oss) run on the CPU backend only; run with --device cpu", name());
  }
  // dsinks[h] += −Σ_i e^(σ_h − lse_i)·(dout_i·out_i) over this call's rows (the final out and lse).
  virtual void attention_sink_backward(Stream stream, const Tensor& out, const Tensor& dout, const Tensor& lse,
                                       const Tensor& sinks, Tensor& dsinks) {
    fail("{}: attention sinks (gpt-oss) run on the CPU backend only; run with --device cpu", name());
  }

  // out[T, F] = silu(gate) · up.
  virtual void swiglu_forward(Stream stream, const Tensor& gate, const Tensor& up, Tensor& out) = 0;
  // GeGLU with the tanh approximation of GELU (transformers' gelu_pytorch_tanh, Gemma):
  // out[T, F] = gelu_tanh(gate) · up, gelu_tanh(x) = x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³))).
  virtual void geglu_tanh_forward(Stream stream, const Tensor& gate, const Tensor& up, Tensor& out) {
    fail("{}: the GELU-tanh gated MLP (Gemma) runs on the CPU backend only; run with --device cpu", name());
  }
  // dgate, dup (overwritten) from dout.
  virtual void geglu_tanh_backward(Stream stream, const Tensor& gate, const Tensor& up, const Tensor& dout,
                                   Tensor& dgate, Tensor& dup) {
    fail("{}: the GELU-tanh gated MLP (Gemma) runs on the CPU backend only; run with --device cpu", name());
  }
  // Soft-capped logits (Gemma 2's final_logit_softcapping): y = cap·tanh(x / cap), elementwise; and the
  // backward from y alone, in place: d ← d·(1 − (y / cap)²).
  virtual void softcap_forward(Stream stream, const Tensor& x, double cap, Tensor& y) {
    fail("{}: soft-capped logits (Gemma 2) run on the CPU backend only; run with --device cpu", name());
  }
  virtual void softcap_backward(Stream stream, const Tensor& y, double cap, Tensor& d) {
    fail("{}: soft-capped logits (Gemma 2) run on the CPU backend only; run with --device cpu", name());
  }
  // dgate, dup (overwritten) from dout.
  virtual void swiglu_backward(Stream stream, const Tensor& gate, const Tensor& up, const Tensor& dout,
                               Tensor& dgate, Tensor& dup) = 0;
  // ---- rows ------------------------------------------------------------------------------------
  // dst[n, :] = src[idx[n], :]; idx I32 [N].
  virtual void gather_rows(Stream stream, const Tensor& src, const Tensor& idx, Tensor& dst) = 0;
  // dst[idx[n], :] += src[n, :].
  virtual void scatter_add_rows(Stream stream, const Tensor& src, const Tensor& idx, Tensor& dst) = 0;

  // ---- gated attention and gated DeltaNet (qwen3_5; model/blocks/gated_deltanet.h) -------------
  // Sizes: T tokens, Hk key heads of dk, Hv value heads of dv (a multiple of
  // Hk: value head h reads key head h / (Hv/Hk)), C channels.
  //
  // dst[r, dst_col + j] = src[r, src_col + j] for j < width; src [R, Cs], dst [R, Cd] of one dtype:
  // splits fused projections (q_proj's per-head query and gate, in_proj_qkv's q, k and v) and puts
  // their gradients back together.
  virtual void copy_columns(Stream stream, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                            int64_t width) = 0;
  // rope() on the first rotary_dim of each head's D dims (partial RoPE): pairs (i, i + rotary_dim/2),
  // inv_freq F32 [rotary_dim/2], cos and sin scaled by attention_scale; dims rotary_dim … D−1 pass
  // through unscaled.
  virtual void rope_partial(Stream stream, Tensor& x, const Tensor& positions, const Tensor& inv_freq,
                            int64_t rotary_dim, double attention_scale, int sign) = 0;
  // out = x·σ(gate), elementwise (gated attention's output gate); the backward overwrites
  // dx = dout·σ(gate) and dgate = dout·x·σ(gate)·(1 − σ(gate)).
  virtual void sigmoid_gate_forward(Stream stream, const Tensor& x, const Tensor& gate, Tensor& out) = 0;
  virtual void sigmoid_gate_backward(Stream stream, const Tensor& x, const Tensor& gate, const Tensor& dout,
                                     Tensor& dx, Tensor& dgate) = 0;
  // Depthwise causal conv1d with SiLU over packed documents: y[t, c] = silu(Σ_j w[c, j]·x[t−K+1+j, c])
  // where a tap before the start of t's document reads zero (the window restarts at every document:
  // runs of equal doc_ids I32 [T]). x, y [T, C]; w [C, 1, K] as the checkpoint stores it.
  virtual void causal_conv1d_silu_forward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids,
                                          Tensor& y) = 0;
  // dx [T, C] overwritten, *dw += (null: frozen); the pre-activation is recomputed from x and w.
  virtual void causal_conv1d_silu_backward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids,
                                           const Tensor& dy, Tensor& dx, Tensor* dw) = 0;
  // Per row of the last dim: y = x·rstd, rstd = (Σ x² + eps)^-½ saved (stat dtype, one per row);
  // the backward overwrites dx = rstd·(dy − y·(y·dy)).
  virtual void l2norm_forward(Stream stream, const Tensor& x, double eps, Tensor& y, Tensor& rstd) = 0;
  virtual void l2norm_backward(Stream stream, const Tensor& y, const Tensor& rstd, const Tensor& dy, Tensor& dx) = 0;
  // A gated DeltaNet layer's conv and split in one op, with the results of the separate ops (each
  // stored in its dtype before the next reads it): mixed = causal_conv1d_silu(qkv) [T, C] with
  // C = 2·Hk·dk + Hv·dv, then q = l2norm(mixed[:, 0, Hk·dk)), k = l2norm(mixed[:, Hk·dk, 2·Hk·dk)),
  // v = mixed[:, 2·Hk·dk, C). q, k [T, Hk, dk]; v [T, Hv, dv]; q_rstd, k_rstd [T·Hk] (stat dtype).
  // Fused, mixed and the unnormalised q and k never reach memory.
  virtual void deltanet_conv_split_forward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                           double eps, Tensor& q, Tensor& k, Tensor& v, Tensor& q_rstd,
                                           Tensor& k_rstd) = 0;
  // Its backward: d_mixed = [l2norm_backward(q, dq) | l2norm_backward(k, dk) | dv] (stored in the io
  // dtype), then causal_conv1d_silu_backward(qkv, w, d_mixed): d_qkv [T, C] overwritten, *dw +=.
  virtual void deltanet_conv_split_backward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                            const Tensor& q, const Tensor& k, const Tensor& q_rstd,
                                            const Tensor& k_rstd, const Tensor& dq, const Tensor& dk,
                                            const Tensor& dv, Tensor& d_qkv, Tensor* dw) = 0;
  // The gates of a gated DeltaNet: g [T, Hv] (stat dtype, log decay ≤ 0) = −exp(A_log)·softplus(a +
  // dt_bias) and beta [T, Hv] = σ(b); a, b [T, Hv], A_log and dt_bias [Hv]. The backward overwrites
  // da and db and adds into *dA_log and *ddt_bias (null: frozen).
  virtual void gated_delta_gates_forward(Stream stream, const Tensor& a, const Tensor& b, const Tensor& a_log,
                                         const Tensor& dt_bias, Tensor& g, Tensor& beta) = 0;
  virtual void gated_delta_gates_backward(Stream stream, const Tensor& a, const Tensor& beta, const Tensor& a_log,
                                          const Tensor& dt_bias, const Tensor& g, const Tensor& dg,
                                          const Tensor& dbeta, Tensor& da, Tensor& db, Tensor* da_log,
                                          Tensor* ddt_bias) = 0;
  // The gated delta rule over packed documents, per value head h with its key head h / (Hv/Hk) and a
  // state S [dk, dv] that starts at zero in every document (runs of equal doc_ids I32 [T]):
  //   S_t = exp(g_t)·(I − β_t·k_t·k_tᵀ)·S_{t−1} + β_t·k_t·v_tᵀ,   out_t = S_tᵀ·(scale·q_t)
  // q, k [T, Hk, dk]; v, out [T, Hv, dv]; g [T, Hv] stat dtype; beta [T, Hv]. Computed in chunks of
  // chunk_size tokens (a triangular solve inside a chunk, the state carried across chunks at the
  // stat precision or better); the result does not depend on the chunk size beyond rounding.
  virtual void gated_delta_rule_forward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& g, const Tensor& beta, const Tensor& doc_ids, double scale,
                                        int64_t chunk_size, Tensor& out) = 0;
  // dq, dk, dv, dg, dbeta overwritten from dout; the chunk states are recomputed from the inputs.
  virtual void gated_delta_rule_backward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                         const Tensor& g, const Tensor& beta, const Tensor& doc_ids, double scale,
                                         int64_t chunk_size, const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv,
                                         Tensor& dg, Tensor& dbeta) = 0;
  // The gated delta rule as above with a state entering and leaving every run of equal run_ids
  // I32 [T] (runs play the documents' part): run n starts from initial_states[n] instead of zero
  // and leaves its last state in final_states[n]; both [N, Hv, dk, dv] in the stat dtype, N runs.
  // Sequence parallelism continues a document's recurrence across ranks through these
  // (parallel/sp_deltanet.h).
  virtual void gated_delta_rule_forward_states(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                               const Tensor& g, const Tensor& beta, const Tensor& run_ids,
                                               double scale, int64_t chunk_size, const Tensor& initial_states,
                                               Tensor& out, Tensor& final_states) = 0;
  // dq, dk, dv, dg, dbeta and d_initial_states [N, Hv, dk, dv] overwritten from dout and
  // d_final_states = ∂L/∂final_states (what later tokens, on other ranks, make of each run's last state).
  virtual void gated_delta_rule_backward_states(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                                const Tensor& g, const Tensor& beta, const Tensor& run_ids,
                                                double scale, int64_t chunk_size, const Tensor& initial_states,
                                                const Tensor& dout, const Tensor& d_final_states, Tensor& dq,
                                                Tensor& dk, Tensor& dv, Tensor& dg, Tensor& dbeta,
                                                Tensor& d_initial_states) = 0;
  // Gated RMSNorm: y[R, C] = x·rstd·w[C]·silu(z), rstd[R] = (mean x² + eps)^-½ saved (stat dtype);
  // the backward overwrites dx and dz and adds into *dw (null: frozen).
  virtual void gated_rmsnorm_forward(Stream stream, const Tensor& x, const Tensor& z, const Tensor& w, double eps,
                                     Tensor& y, Tensor& rstd) = 0;
  virtual void gated_rmsnorm_backward(Stream stream, const Tensor& x, const Tensor& z, const Tensor& w,
                                      const Tensor& rstd, const Tensor& dy, Tensor& dx, Tensor& dz, Tensor* dw) = 0;

  // ---- 4-bit weights (bitsandbytes' NF4/FP4 layout, docs/qlora.md) ------------------------------
  // w [n] (any shape of n elements, compute dtype) = table[code of element j] · absmax[j / blocksize],
  // the product in F32 as bitsandbytes' fast-math kernel forms it (denormal inputs and results
  // flushed to zero), then rounded to w's dtype. packed U8 [(n+1)/2]: element 2k in the high nibble of
  // byte k, 2k+1 in the low one; absmax F32 [ceil(n/blocksize)]; blocksize 32 … 4096, a power of two.
  virtual void dequantize_4bit(Stream stream, const Tensor& packed, const Tensor& absmax, int64_t blocksize,
                               Quant4Type type, Tensor& w) = 0;
  // Double-quantised absmax: absmax[k] (F32 [K]) = f32(f32(code_map[codes[k]] · absmax2[k / blocksize2]) +
  // offset), two roundings as bitsandbytes forms them. codes U8 [K], code_map F32 [256], absmax2 F32
  // [ceil(K/blocksize2)].
  virtual void dequantize_absmax(Stream stream, const Tensor& codes, const Tensor& code_map, const Tensor& absmax2,
                                 int64_t blocksize2, double offset, Tensor& absmax) = 0;
  // The inverse, as bitsandbytes' quantize_4bit computes it (its fast-math arithmetic, the GPU's
  // approximate reciprocal included: backend/cpu/quant4_ops.h): w [n] (F32, BF16 or F16, read
  // exactly; F64 is rounded to F32 first) -> packed U8 [(n+1)/2] and absmax F32 [ceil(n/blocksize)],
  // the layout above. Quantising a model's projections at load runs this on the device.
  virtual void quantize_4bit(Stream stream, const Tensor& w, int64_t blocksize, Quant4Type type, Tensor& packed,
                             Tensor& absmax) = 0;
  // Double quantisation of absmax F32 [K] (bitsandbytes' compress_statistics) around `offset` (an
  // F32 value: the absmax' mean, which the caller forms on the host, quant4::absmax_mean, in the
  // order torch's reference has): codes U8 [K] and absmax2 F32 [ceil(K/blocksize2)] such that
  // dequantize_absmax with the same code_map F32 [256] (the sorted signed dynamic map) gives them back.
  virtual void quantize_absmax(Stream stream, const Tensor& absmax, const Tensor& code_map, double offset,
                               int64_t blocksize2, Tensor& codes, Tensor& absmax2) = 0;

  // ---- mixture of experts (routed SwiGLU experts) ----------------------------------------------
  // T tokens, E experts, k experts per token, N = T·k routed rows. Per-expert sizes stay in device
  // tensors (offsets), so a backend can run the experts as grouped GEMMs without reading them on
  // the host.
  //
  // Router: probs [T, E] (stat dtype) = softmax(logits [T, E]) computed at the stat precision;
  // topk_index I32 [T, k] the k largest probabilities in descending order (ties: lower expert
  // first); topk_weight [T, k] (stat dtype) their probabilities, divided by their sum when
  // `normalize` (norm_topk_prob).
  virtual void moe_router_forward(Stream stream, const Tensor& logits, int64_t top_k, bool normalize, Tensor& probs,
                                  Tensor& topk_index, Tensor& topk_weight) = 0;
  // dlogits [T, E] (overwritten) from d_topk_weight [T, k] (stat dtype) through the top-k
  // (renormalised when `normalize`) and the softmax. aux_grad (stat dtype [E], optional: pass an
  // undefined Tensor) adds ∂L/∂probs[t, e] = aux_grad[e] for every token whose token_doc[t] ≥ 0
  // (I32 [T]; padding is −1), the router load-balancing loss's gradient.
  virtual void moe_router_backward(Stream stream, const Tensor& probs, const Tensor& topk_index,
                                   const Tensor& d_topk_weight, bool normalize, const Tensor& aux_grad,
                                   const Tensor& token_doc, Tensor& dlogits) = 0;
  // Load-balancing statistics over the tokens with token_doc[t] ≥ 0: counts[e] += how many of them
  // route to e, prob_sums[e] += Σ_t probs[t, e]. counts and prob_sums: stat dtype [E].
  virtual void moe_router_statistics(Stream stream, const Tensor& probs, const Tensor& topk_index,
                                     const Tensor& token_doc, Tensor& counts, Tensor& prob_sums) = 0;
  // The routed rows sorted by expert, stably (by token, then slot): rows_token I32 [N] the token of
  // each routed row, row_of_slot I32 [T·k] the routed row of (token t, slot j) at t·k + j, offsets
  // I32 [E + 1] the first row of each expert (offsets[E] = N).
  virtual void moe_permute(Stream stream, const Tensor& topk_index, int64_t num_experts, Tensor& rows_token,
                           Tensor& row_of_slot, Tensor& offsets) = 0;
  // The experts' GEMMs over the routed rows sorted by expert, sized on the device: expert e owns
  // rows offsets[e] … offsets[e+1]−1 (offsets I32 [E+1] from moe_permute), so a backend need not
  // read them on the host. weights: the E expert matrices W_e [out, in], one dtype with x and y.
  // transpose_weight (the forward): y [N, out] (=, or += when accumulate) x [N, in]·W_eᵀ per expert;
  // otherwise (the input gradient): y [N, in] (=/+=) x [N, out]·W_e. Empty experts write nothing.
  virtual void moe_grouped_gemm(Stream stream, const Tensor& x, const std::vector<Tensor>& weights,
                                bool transpose_weight, const Tensor& offsets, Tensor& y, bool accumulate) = 0;
  // The experts' weight gradients: weight_grads[e] [out, in] += dy[rows of e]ᵀ·x[rows of e] for
  // dy [N, out], x [N, in]; an undefined weight_grads[e] (a frozen expert) is skipped. The
  // gradients have the compute dtype, or F32 for BF16 inputs (as gemm's C).
  virtual void moe_grouped_gemm_weight_grad(Stream stream, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                            std::vector<Tensor>& weight_grads) = 0;
  // out[t] (overwritten, [T, H]) = Σ_j topk_weight[t, j] · y[row_of_slot[t·k + j]], the slots summed
  // in ascending expert order; y [N, H] the experts' outputs.
  virtual void moe_combine(Stream stream, const Tensor& y, const Tensor& row_of_slot, const Tensor& topk_index,
                           const Tensor& topk_weight, Tensor& out) = 0;
  // The backward of moe_combine, both overwritten: dy [N, H] (row of (t, j) = topk_weight[t, j] ·
  // dout[t]) and d_topk_weight [T, k] (stat dtype) = ⟨y[row of (t, j)], dout[t]⟩.
  virtual void moe_combine_backward(Stream stream, const Tensor& dout, const Tensor& y, const Tensor& row_of_slot,
                                    const Tensor& topk_weight, Tensor& dy, Tensor& d_topk_weight) = 0;
  // gpt_oss's clamped SwiGLU over interleaved projections: gate_up [N, 2I] holds gate k at column
  // 2k and up k at 2k + 1; out [N, I] = (clamp(up, −limit, limit) + 1) · g · σ(alpha·g) with
  // g = min(gate, limit). A clamped input passes no gradient (inclusive bounds, as torch.clamp).
  virtual void clamped_swiglu_forward(Stream stream, const Tensor& gate_up, double alpha, double limit, Tensor& out) {
    fail("{}: the clamped SwiGLU of gpt_oss's experts runs on the CPU backend only; run with --device cpu",
         name());
  }
  // d_gate_up [N, 2I] (overwritten, interleaved as gate_up) from dout [N, I].
  virtual void clamped_swiglu_backward(Stream stream, const Tensor& gate_up, const Tensor& dout, double alpha,
                                       double limit, Tensor& d_gate_up) {
    fail("{}: the clamped SwiGLU of gpt_oss's experts runs on the CPU backend only; run with --device cpu",
         name());
  }

  // glm4_moe's router, at the stat precision (its dtype; F32 rounding as transformers' F32 router):
  // scores [T, E] = σ(logits [T, E]); the choice c = scores + correction_bias [E] (stat dtype, used for
  // the choice only). The E experts form routing.groups groups of E/groups (at least 2) in expert
  // order; a group scores the sum of its two largest c, and only the experts of the top_groups best
  // groups are candidates. topk_index I32 [T, k] the k candidates of largest c in descending c (ties:
  // lower expert first); topk_weight [T, k] (stat dtype) their scores (not c), divided by (their sum +
  // 1e-20) when routing.normalize, times routing.scaling.
  virtual void moe_sigmoid_router_forward(Stream stream, const Tensor& logits, const Tensor& correction_bias,
                                          const SigmoidRouting& routing, Tensor& scores, Tensor& topk_index,
                                          Tensor& topk_weight) {
    fail("{}: glm4_moe's sigmoid router runs on the CPU backend only; run with --device cpu", name());
  }
  // dlogits [T, E] (overwritten) from d_topk_weight [T, k] (stat dtype) through the scaling, the
  // renormalisation and the sigmoid of the chosen experts; the others (and the correction bias, a
  // constant of the choice) get none.
  virtual void moe_sigmoid_router_backward(Stream stream, const Tensor& scores, const Tensor& topk_index,
                                           const Tensor& d_topk_weight, const SigmoidRouting& routing,
                                           Tensor& dlogits) {
    fail("{}: glm4_moe's sigmoid router runs on the CPU backend only; run with --device cpu", name());
  }

  // A shared expert's gate (qwen3_5_moe): out[t] += σ(gate[t])·shared[t] for out, shared [T, H] and
  // gate [T, 1] (one logit per token). The backward overwrites d_shared [T, H] = σ(gate[t])·dout[t]
  // and d_gate [T, 1] = σ'(gate[t])·⟨dout[t], shared[t]⟩.
  virtual void shared_expert_gate_forward(Stream stream, const Tensor& shared, const Tensor& gate, Tensor& out) = 0;
  virtual void shared_expert_gate_backward(Stream stream, const Tensor& shared, const Tensor& gate, const Tensor& dout,
                                           Tensor& d_shared, Tensor& d_gate) = 0;

  // ---- loss ------------------------------------------------------------------------------------
  // Cross-entropy on a chunk of logits [N, V] (weights: stat dtype, F32 or F64), in place: logits become
  // dlogits = grad_scale · weight[n] · (softmax − onehot(target[n])).
  // loss_sum (one F32/F64 element) += Σ_n weight[n] · CE_n · loss_scale.
  // token_ce (F32 [N], optional: pass an undefined Tensor) gets the unweighted CE_n.
  virtual void cross_entropy(Stream stream, Tensor& logits, const Tensor& targets, const Tensor& weights,
                             double loss_scale, double grad_scale, Tensor& loss_sum, Tensor& token_ce) = 0;

  // ---- optimizer -------------------------------------------------------------------------------
  // Decoupled AdamW on F32 master parameters; m, v F32; grad F32.
  struct AdamW {
    double lr, beta1, beta2, eps, weight_decay;
    int64_t step;  // 1-based, for bias correction
    double grad_scale;  // grad is multiplied by this first (clipping)
  };
  virtual void adamw_step(Stream stream, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v,
                          const AdamW& hp) = 0;
};

// The sizes of C = op(A)·op(B), checked: every backend's gemm validates its arguments the same way.
struct GemmShape {
  int64_t m, n, k;
};
GemmShape gemm_shape(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c);

// The CPU backend is always available; it is the reference every other backend is tested against.
std::unique_ptr<Backend> make_cpu_backend(int threads = 0);

}  // namespace spindle
