// The CUDA backend: checks every op's tensors against backend.h, then hands raw pointers to the
// kernel launchers (kernels.h). All work is enqueued on the op's stream; nothing here waits except
// synchronize() and copy_to_host(), which also report bad input that a kernel found (a token id
// outside the vocabulary, ...): such errors surface at the next synchronization point, not at the
// op that found them.
//
// Memory: tensors come from cudaMallocAsync on the backend's stream (the device's default pool,
// freed blocks kept cached) and are freed with cudaFreeAsync on that stream when the last view
// goes away. A tensor used on another stream (comm_stream) must be kept alive by its user until
// the backend's stream has waited for that use (stream_wait, backend.h), so the free is ordered
// after it.
#include "backend/cuda/cuda_backend.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <map>
#include <set>
#include <string>
#include <tuple>

#include "backend/cpu/deltanet_conv_ops.h"
#include "backend/cpu/quant4_ops.h"
#include "backend/cuda/attention_cudnn.h"
#include "backend/cuda/context.h"
#include "backend/cuda/gated_delta.h"
#include "backend/cuda/gated_delta_states.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/host_memory.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/moe.h"
#include "core/error.h"

namespace spindle {
namespace {

using cuda::Context;

struct Allocation {
  std::shared_ptr<Context> ctx;
};

void release_device(void* data, void* context) {
  auto* alloc = static_cast<Allocation*>(context);
  cudaFreeAsync(data, alloc->ctx->stream());  // destructors cannot throw; a failure shows at the next call
  delete alloc;
}

bool is_compute(DType t) { return t == DType::F32 || t == DType::BF16; }

bool aligned16(const Tensor& t) { return reinterpret_cast<uintptr_t>(t.data()) % 16 == 0; }

// How the attention choice (cuda_options.h) maps onto the kernels: the implementation every call
// runs (Auto: per call, see pick_impl), and whether plain causal rows may go to cuDNN.
struct AttentionChoice {
  cuda::AttentionImpl impl = cuda::AttentionImpl::Auto;
  bool cudnn_for_plain_causal = true;
};

AttentionChoice attention_choice(CudaAttention a) {
  switch (a) {
    case CudaAttention::Auto: return {cuda::AttentionImpl::Auto, cuda::attention_cudnn_built()};
    case CudaAttention::Own: return {cuda::AttentionImpl::Auto, false};
    case CudaAttention::Simple: return {cuda::AttentionImpl::Simple, false};
    case CudaAttention::Mma: return {cuda::AttentionImpl::Mma, false};
    case CudaAttention::Wgmma: return {cuda::AttentionImpl::Wgmma, false};
    case CudaAttention::Cudnn:
      if (!cuda::attention_cudnn_built())
        fail("--attention cudnn: this spindle was built without cuDNN (cudnn.h / libcudnn were not found when "
             "configuring); install cuDNN 9 and rebuild, or choose --attention auto or own");
      return {cuda::AttentionImpl::Cudnn, false};
  }
  fail("unknown CUDA attention choice {}", static_cast<int>(a));
}

class CudaBackend final : public Backend {
 public:
  CudaBackend(int device, const CudaBackendOptions& options) {
    const AttentionChoice c = attention_choice(options.attention);  // before the device starts: fail fast
    ctx_ = std::make_shared<Context>(device);
    attention_impl_ = c.impl;
    cudnn_for_plain_causal_ = c.cudnn_for_plain_causal;
  }

  std::string name() const override { return "cuda"; }
  Device device() const override { return Device{DeviceKind::CUDA, ctx_->device()}; }
  Stream default_stream() override { return Stream{ctx_->stream()}; }

  void synchronize(Stream stream) override {
    CUDA_CHECK(cudaStreamSynchronize(s(stream)));
    ctx_->check_device_error();
  }

  Stream comm_stream() override { return Stream{ctx_->comm_stream()}; }
  void stream_wait(Stream waiter, Stream signaller) override { ctx_->stream_wait(s(waiter), s(signaller)); }

  // ---- memory -----------------------------------------------------------------------------------
  Tensor empty(Shape shape, DType dtype) override {
    ctx_->activate();
    auto storage = std::make_shared<Storage>();
    const size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
    void* p = nullptr;
    cudaError_t e = cudaMallocAsync(&p, bytes ? bytes : 1, ctx_->stream());
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the sticky-free error state
      // The pool keeps freed blocks mapped (context.cpp: release threshold "all"). A request larger
      // than every free block makes it map more, which fails on a full device although enough is
      // free in pieces — at hundreds of thousands of tokens single tensors are 10+ GB and such
      // pieces many GiB. Once every pending free has landed, hand the unused blocks back to the
      // driver and ask once more.
      CUDA_CHECK(cudaDeviceSynchronize());
      cudaMemPool_t pool;
      CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, ctx_->device()));
      CUDA_CHECK(cudaMemPoolTrimTo(pool, 0));
      e = cudaMallocAsync(&p, bytes ? bytes : 1, ctx_->stream());
    }
    if (e == cudaErrorMemoryAllocation) {
      cudaGetLastError();
      size_t free_b = 0, total_b = 0;
      cudaMemGetInfo(&free_b, &total_b);
      fail("out of GPU memory allocating {} bytes for {} {} on cuda:{} ({} of {} bytes free)", bytes,
           dtype_name(dtype), shape.str(), ctx_->device(), free_b, total_b);
    }
    CUDA_CHECK(e);
    storage->data = p;
    storage->bytes = bytes;
    storage->device = device();
    storage->release = release_device;
    storage->release_context = new Allocation{ctx_};
    return Tensor(std::move(storage), 0, shape, dtype);
  }

  // The pool is the device's default one (every backend on this device in this process, and the
  // NCCL communicator's scratch, allocate from it); cuBLASLt's workspace and NCCL's own buffers
  // live outside it and show only in device_used_bytes.
  MemoryStats memory_stats() override {
    ctx_->activate();
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, ctx_->device()));
    auto attribute = [&](cudaMemPoolAttr a) {
      uint64_t v = 0;
      CUDA_CHECK(cudaMemPoolGetAttribute(pool, a, &v));
      return static_cast<int64_t>(v);
    };
    MemoryStats m;
    m.allocated_bytes = attribute(cudaMemPoolAttrUsedMemCurrent);
    m.peak_allocated_bytes = attribute(cudaMemPoolAttrUsedMemHigh);
    m.reserved_bytes = attribute(cudaMemPoolAttrReservedMemCurrent);
    m.peak_reserved_bytes = attribute(cudaMemPoolAttrReservedMemHigh);
    size_t free_b = 0, total_b = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b));
    m.device_used_bytes = static_cast<int64_t>(total_b - free_b);
    m.device_total_bytes = static_cast<int64_t>(total_b);
    if (host_) {
      m.host_allocated_bytes = host_->live_bytes();
      m.peak_host_allocated_bytes = host_->peak_bytes();
    }
    return m;
  }

  void reset_peak_memory() override {
    ctx_->activate();
    cudaMemPool_t pool;
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, ctx_->device()));
    uint64_t zero = 0;  // the only value these attributes accept: "restart from the current value"
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &zero));
    CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &zero));
    if (host_) host_->reset_peak();
  }

  // ---- activation offload: pinned host tensors, copies on their own stream (host_memory.h) -------
  Tensor empty_host(Shape shape, DType dtype) override {
    return cuda::make_pinned_tensor(host_memory(), shape, dtype);
  }
  void copy_host_device(Stream stream, const Tensor& src, Tensor& dst) override {
    SPINDLE_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel() &&
                      (src.device().kind == DeviceKind::CPU) != (dst.device().kind == DeviceKind::CPU),
                  "copy_host_device {} -> {}: same dtype and size, one host and one device tensor", src.describe(),
                  dst.describe());
    ctx_->activate();
    host_memory()->copy(s(stream), dst.data(), src.data(), src.bytes());
  }
  Stream copy_stream() override { return Stream{host_memory()->copy_stream()}; }
  void wait_for_copies(Stream waiter) override {
    ctx_->activate();
    host_memory()->wait_for_copies(s(waiter));
  }
  OffloadStats offload_stats() override { return host_ ? host_->stats() : OffloadStats{}; }
  void reset_offload_stats() override {
    if (host_) host_->reset_stats();
  }

  void copy_from_host(Stream stream, const void* src, Tensor& dst) override {
    require_device(dst, "copy_from_host");
    // From pageable memory the call returns once `src` has been staged, so the caller may reuse it.
    CUDA_CHECK(cudaMemcpyAsync(dst.data(), src, dst.bytes(), cudaMemcpyHostToDevice, s(stream)));
  }

  void copy_to_host(Stream stream, const Tensor& src, void* dst) override {
    require_device(src, "copy_to_host");
    CUDA_CHECK(cudaMemcpyAsync(dst, src.data(), src.bytes(), cudaMemcpyDeviceToHost, s(stream)));
    synchronize(stream);
  }

  void copy(Stream stream, const Tensor& src, Tensor& dst) override {
    require_device(src, "copy");
    require_device(dst, "copy");
    SPINDLE_CHECK(src.numel() == dst.numel(), "copy {} -> {}", src.describe(), dst.describe());
    cuda::convert(s(stream), src.data(), src.dtype(), dst.data(), dst.dtype(), src.numel());
  }

  void fill(Stream stream, Tensor& t, double value) override {
    require_device(t, "fill");
    cuda::fill(s(stream), t.data(), t.dtype(), t.numel(), value);
  }

  // random.cu: the CPU reference's bits (core/random_hash.h).
  void fill_random_uniform(Stream stream, Tensor& t, uint64_t seed, uint64_t sequence, double half_width) override {
    require_device(t, "fill_random_uniform");
    if (!is_float(t.dtype()))
      fail("fill_random_uniform: {} is not a float tensor (F32, F64, BF16 or F16)", t.describe());
    cuda::fill_random_uniform(s(stream), t.data(), t.dtype(), t.numel(), seed, sequence, half_width);
  }

  // ---- elementwise and reductions ---------------------------------------------------------------
  void scale(Stream stream, Tensor& x, double alpha) override {
    require_compute(x, "scale");
    cuda::scale(s(stream), x.data(), x.dtype(), x.numel(), alpha);
  }

  void axpy(Stream stream, double alpha, const Tensor& x, Tensor& y) override {
    require_compute(x, "axpy");
    require_same(x, y, "axpy");
    SPINDLE_CHECK(x.numel() == y.numel(), "axpy {} vs {}", x.describe(), y.describe());
    cuda::axpy(s(stream), alpha, x.data(), y.data(), x.dtype(), x.numel());
  }

  void sum_squares(Stream stream, const Tensor& x, Tensor& out) override {
    require_compute(x, "sum_squares");
    require_stat(out, 1, "sum_squares");
    cuda::sum_squares(s(stream), x.data(), x.dtype(), x.numel(), out.data_as<float>());
  }

  // ---- dense algebra ----------------------------------------------------------------------------
  // C = alpha·op(A)·op(B) + beta·C (+ bias[N] by the epilogue when bias is set).
  void run_gemm(Stream stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
                double beta, const void* bias) {
    require_compute(a, "gemm");
    require_same(a, b, "gemm");
    require_device(c, "gemm");
    // BF16 inputs may write an F32 C (f32 logits or gradient buffers); F32 inputs write F32.
    if (!(c.dtype() == a.dtype() || (a.dtype() == DType::BF16 && c.dtype() == DType::F32)))
      fail("gemm: C {} does not fit inputs {}: BF16 inputs write BF16 or F32, F32 inputs write F32", c.describe(),
           a.describe());
    const auto [m, n, k] = gemm_shape(a, trans_a, b, trans_b, c);
    if (m == 0 || n == 0) return;
    if (k == 0) {
      cuda::scale(s(stream), c.data(), c.dtype(), c.numel(), beta);
      return;
    }
    cuda::GemmArgs args{m,        n,        k,        trans_a,  trans_b,  a.dtype(), c.dtype(), a.data(),
                        b.data(), c.data(), a.dim(1), b.dim(1), static_cast<float>(alpha), static_cast<float>(beta),
                        bias};
    ctx_->gemm_cache().run(s(stream), args);
  }

  void gemm(Stream stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
            double beta) override {
    run_gemm(stream, a, trans_a, b, trans_b, c, alpha, beta, nullptr);
  }

  void gemm_bias(Stream stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
                 double beta, const Tensor& bias) override {
    require_same(c, bias, "gemm_bias");
    const auto [m, n, k] = gemm_shape(a, trans_a, b, trans_b, c);
    SPINDLE_CHECK(bias.numel() == n, "gemm_bias: bias {} for C {}", bias.describe(), c.describe());
    // cuBLASLt's epilogue wants a 16-byte aligned bias and a real product.
    if (m == 0 || n == 0 || k == 0 || reinterpret_cast<uintptr_t>(bias.data()) % 16 != 0) {
      Backend::gemm_bias(stream, a, trans_a, b, trans_b, c, alpha, beta, bias);
      return;
    }
    run_gemm(stream, a, trans_a, b, trans_b, c, alpha, beta, bias.data());
  }

  void lora_b_backward(Stream stream, const Tensor& dy, const Tensor& b, const Tensor& xa, double scaling, Tensor& dxa,
                       Tensor* db) override {
    // The fused kernel: BF16 throughout, contiguous 2-D, 16-byte aligned, out a multiple of 128, rank
    // 16, 32 or 64; anything else (F32, other shapes) is the two GEMMs.
    bool fused = dy.rank() == 2 && b.rank() == 2 && cuda::lora_b_backward_supported(dy.dim(1), b.dim(1));
    for (const Tensor* x : std::initializer_list<const Tensor*>{&dy, &b, &xa, &dxa, db})
      if (x) fused = fused && x->defined() && x->dtype() == DType::BF16 && x->device() == device() && aligned16(*x);
    if (!fused) {
      Backend::lora_b_backward(stream, dy, b, xa, scaling, dxa, db);
      return;
    }
    const int64_t t = dy.dim(0), n = dy.dim(1), r = b.dim(1);
    SPINDLE_CHECK(b.dim(0) == n && xa.shape() == Shape({t, r}) && dxa.shape() == xa.shape() &&
                      (!db || db->shape() == b.shape()),
                  "lora_b_backward: dy {} b {} xa {} dxa {} db {}", dy.describe(), b.describe(), xa.describe(),
                  dxa.describe(), db ? db->describe() : std::string("none"));
    cuda::lora_b_backward(s(stream), dy.data(), b.data(), xa.data(), t, n, r, static_cast<float>(scaling), dxa.data(),
                          db ? db->data() : nullptr);
  }

  void add_bias(Stream stream, Tensor& y, const Tensor& bias) override {
    require_compute(y, "add_bias");
    require_same(y, bias, "add_bias");
    const int64_t n = bias.numel(), rows = n ? y.numel() / n : 0;
    SPINDLE_CHECK(rows * n == y.numel(), "add_bias {} + {}", y.describe(), bias.describe());
    cuda::add_bias(s(stream), y.data(), bias.data(), y.dtype(), rows, n);
  }

  void bias_backward(Stream stream, const Tensor& dy, Tensor& dbias) override {
    require_compute(dy, "bias_backward");
    require_same(dy, dbias, "bias_backward");
    const int64_t n = dbias.numel(), rows = n ? dy.numel() / n : 0;
    SPINDLE_CHECK(rows * n == dy.numel(), "bias_backward {} -> {}", dy.describe(), dbias.describe());
    cuda::bias_backward(s(stream), dy.data(), dbias.data(), dy.dtype(), rows, n);
  }

  // ---- model ops --------------------------------------------------------------------------------
  void embedding_forward(Stream stream, const Tensor& ids, const Tensor& table, Tensor& out) override {
    require_i32(ids, "embedding_forward");
    require_compute(table, "embedding_forward");
    require_same(table, out, "embedding_forward");
    SPINDLE_CHECK(table.rank() == 2 && out.numel() == ids.numel() * table.dim(1), "embedding_forward: ids {} table {} out {}",
                  ids.describe(), table.describe(), out.describe());
    cuda::gather_rows(s(stream), table.data(), table.dim(0), ids.data_as<int32_t>(), ids.numel(), out.data(),
                      static_cast<size_t>(table.dim(1)) * dtype_size(table.dtype()), ctx_->device_error(),
                      cuda::kErrTokenId);
  }

  void embedding_backward(Stream stream, const Tensor& ids, const Tensor& dout, Tensor& dtable,
                          int64_t padding_id) override {
    require_i32(ids, "embedding_backward");
    require_compute(dout, "embedding_backward");
    require_same(dout, dtable, "embedding_backward");
    SPINDLE_CHECK(dtable.rank() == 2 && dout.numel() == ids.numel() * dtable.dim(1),
                  "embedding_backward: ids {} dout {} dtable {}", ids.describe(), dout.describe(), dtable.describe());
    cuda::scatter_add_rows(s(stream), dout.data(), ids.data_as<int32_t>(), ids.numel(), dtable.data(), dtable.dim(0),
                           dtable.dim(1), dtable.dtype(), ctx_->device_error(), static_cast<int32_t>(padding_id));
  }

  void rmsnorm_forward(Stream stream, const Tensor& x, const Tensor& w, double eps, Tensor& y,
                       Tensor& rstd) override {
    require_compute(x, "rmsnorm_forward");
    require_same(x, w, "rmsnorm_forward");
    require_same(x, y, "rmsnorm_forward");
    const int64_t c = w.numel(), rows = c ? x.numel() / c : 0;
    require_stat(rstd, rows, "rmsnorm_forward rstd");
    SPINDLE_CHECK(rows * c == x.numel() && y.numel() == x.numel(), "rmsnorm_forward {} {} {}", x.describe(),
                  w.describe(), y.describe());
    cuda::rmsnorm_forward(s(stream), x.data(), w.data(), y.data(), rstd.data_as<float>(), x.dtype(), rows, c,
                          static_cast<float>(eps));
  }

  void rmsnorm_backward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                        Tensor& dx, Tensor* dw, bool accumulate_dx) override {
    require_compute(x, "rmsnorm_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&w, &dy, &dx}) require_same(x, *t, "rmsnorm_backward");
    if (dw) require_same(x, *dw, "rmsnorm_backward");
    const int64_t c = w.numel(), rows = c ? x.numel() / c : 0;
    require_stat(rstd, rows, "rmsnorm_backward rstd");
    SPINDLE_CHECK(rows * c == x.numel() && dy.numel() == x.numel() && dx.numel() == x.numel() && (!dw || dw->numel() == c),
                  "rmsnorm_backward {} {} {} {}", x.describe(), dy.describe(), dx.describe(),
                  dw ? dw->describe() : std::string("(no dw)"));
    cuda::rmsnorm_backward(s(stream), x.data(), w.data(), rstd.data_as<float>(), dy.data(), dx.data(),
                           dw ? dw->data() : nullptr, x.dtype(), rows, c, accumulate_dx);
  }

  void rope(Stream stream, Tensor& x, const Tensor& positions, const Tensor& inv_freq, double attention_scale,
            int sign) override {
    require_compute(x, "rope");
    require_i32(positions, "rope");
    require_device(inv_freq, "rope");
    SPINDLE_CHECK(inv_freq.dtype() == DType::F32, "rope: inv_freq must be F32");
    SPINDLE_CHECK(x.rank() == 3, "rope wants x [T, heads, D], got {}", x.describe());
    const int64_t t = x.dim(0), heads = x.dim(1), d = x.dim(2);
    SPINDLE_CHECK(inv_freq.numel() == d / 2 && positions.numel() == t, "rope: {} {} {}", x.describe(),
                  positions.describe(), inv_freq.describe());
    cuda::rope(s(stream), x.data(), x.dtype(), t, heads, d, positions.data_as<int32_t>(), inv_freq.data_as<float>(),
               attention_scale, sign);
  }

  void attention_forward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                         const AttentionLogits& logits, Tensor& out, Tensor& lse) override {
    require_compute(q, "attention_forward");
    require_kernel_logits(logits, "attention_forward");
    const double scale = logits.scale;
    require_same(q, k, "attention_forward");
    require_same(q, v, "attention_forward");
    require_device(out, "attention_forward");
    // BF16 inputs may write an F32 out: ring attention merges partial outputs in F32.
    if (!(out.dtype() == q.dtype() || (q.dtype() == DType::BF16 && out.dtype() == DType::F32)))
      fail("attention_forward: out {} does not fit q {}", out.describe(), q.describe());
    const cuda::AttentionShape sh = attn_shape(q, k, v, mask);
    SPINDLE_CHECK(out.shape() == q.shape(), "attention_forward: out {} vs q {}", out.describe(), q.describe());
    require_stat(lse, sh.tq * sh.hq, "attention_forward lse");
    if (attention_impl_ == cuda::AttentionImpl::Cudnn) {
      const cuda::CudnnMask m = cudnn_mask(stream, sh, q.dtype(), out.dtype(), mask, logits, "attention_forward");
      cuda::attention_forward_cudnn(s(stream), sh, m, q.data(), k.data(), v.data(), static_cast<float>(scale),
                                    out.data(), lse.data_as<float>());
      return;
    }
    if (cudnn_takes(sh, q.dtype(), out.dtype(), mask, logits, {&q, &k, &v, &out})) {
      try {
        cuda::attention_forward_cudnn(s(stream), sh, cuda::CudnnMask::Causal, q.data(), k.data(), v.data(),
                                      static_cast<float>(scale), out.data(), lse.data_as<float>());
        return;
      } catch (const Error& e) {
        give_up_cudnn(e, sh.d);  // nothing was written that our kernel does not overwrite
      }
    }
    cuda::attention_forward(s(stream), pick_impl(sh, q.dtype(), {&q, &k, &v}), sh, q.dtype(), q.data(), k.data(),
                            v.data(), mask_ptrs(mask, logits), static_cast<float>(scale), out.data(), out.dtype(),
                            lse.data_as<float>());
  }

  void attention_backward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& dout, const Tensor& lse, const AttentionMask& mask,
                          const AttentionLogits& logits, Tensor& dq, Tensor& dk, Tensor& dv, bool accumulate) override {
    require_compute(q, "attention_backward");
    require_kernel_logits(logits, "attention_backward");
    const double scale = logits.scale;
    for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v, &out, &dout}) require_same(q, *t, "attention_backward");
    // BF16 inputs may write F32 gradients (ring attention sums its blocks' partials in F32).
    const DType grad = dq.dtype();
    for (const Tensor* t : std::initializer_list<const Tensor*>{&dq, &dk, &dv}) {
      require_device(*t, "attention_backward");
      if (!(t->dtype() == grad && (grad == q.dtype() || (q.dtype() == DType::BF16 && grad == DType::F32))))
        fail("attention_backward: gradients dq {} dk {} dv {} do not fit q {} (same dtype as q, or all F32 for BF16 q)",
             dq.describe(), dk.describe(), dv.describe(), q.describe());
    }
    const cuda::AttentionShape sh = attn_shape(q, k, v, mask);
    SPINDLE_CHECK(out.shape() == q.shape() && dout.shape() == q.shape() && dq.shape() == q.shape() &&
                      dk.shape() == k.shape() && dv.shape() == v.shape(),
                  "attention_backward: out {} dout {} dq {} dk {} dv {}", out.describe(), dout.describe(),
                  dq.describe(), dk.describe(), dv.describe());
    require_stat(lse, sh.tq * sh.hq, "attention_backward lse");
    if (attention_impl_ == cuda::AttentionImpl::Cudnn) {
      const cuda::CudnnMask m = cudnn_mask(stream, sh, q.dtype(), grad, mask, logits, "attention_backward");
      cuda::attention_backward_cudnn(s(stream), sh, m, q.data(), k.data(), v.data(), out.data(), dout.data(),
                                     lse.data_as<float>(), static_cast<float>(scale), dq.data(), dk.data(),
                                     dv.data(), accumulate);
      return;
    }
    if (cudnn_takes(sh, q.dtype(), grad, mask, logits, {&q, &k, &v, &out, &dout, &dq, &dk, &dv})) {
      try {
        cuda::attention_backward_cudnn(s(stream), sh, cuda::CudnnMask::Causal, q.data(), k.data(), v.data(),
                                       out.data(), dout.data(), lse.data_as<float>(), static_cast<float>(scale),
                                       dq.data(), dk.data(), dv.data(), accumulate);
        return;
      } catch (const Error& e) {
        // A failure comes from building the plan or launching it, before the accumulate step:
        // dq/dk/dv are either untouched or fully overwritten by our kernel below.
        give_up_cudnn(e, sh.d);
      }
    }
    cuda::attention_backward(s(stream), pick_impl(sh, q.dtype(), {&q, &k, &v, &dout}), sh, q.dtype(), q.data(),
                             k.data(), v.data(), out.data(), dout.data(), lse.data_as<float>(), mask_ptrs(mask, logits),
                             static_cast<float>(scale), grad, dq.data(), dk.data(), dv.data(), accumulate);
  }

  void attention_merge(Stream stream, Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b) override {
    require_device(out, "attention_merge");
    require_compute(out_b, "attention_merge");
    SPINDLE_CHECK(out.dtype() == DType::F32, "attention_merge: the accumulator must be F32, got {}", out.describe());
    SPINDLE_CHECK(out.rank() == 3 && out_b.numel() == out.numel(), "attention_merge: out {} out_b {}",
                  out.describe(), out_b.describe());
    const int64_t rows = out.dim(0) * out.dim(1);
    require_stat(lse, rows, "attention_merge lse");
    require_stat(lse_b, rows, "attention_merge lse_b");
    cuda::attention_merge(s(stream), out.data_as<float>(), lse.data_as<float>(), out_b.data(), out_b.dtype(),
                          lse_b.data_as<float>(), out.dim(0), static_cast<int>(out.dim(1)),
                          static_cast<int>(out.dim(2)));
  }

  // ---- gated attention and gated DeltaNet (gated_ops.cu, gated_delta.cu) --------------------------
  void copy_columns(Stream stream, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                    int64_t width) override {
    require_device(src, "copy_columns");
    require_same(src, dst, "copy_columns");
    SPINDLE_CHECK(src.rank() == 2 && dst.rank() == 2 && src.dim(0) == dst.dim(0) && src_col >= 0 && dst_col >= 0 &&
                      width >= 0 && src_col + width <= src.dim(1) && dst_col + width <= dst.dim(1),
                  "copy_columns: [{}, {}) of {} into column {} of {}", src_col, src_col + width, src.describe(),
                  dst_col, dst.describe());
    cuda::copy_columns(s(stream), src.data(), src.dim(1), src_col, dst.data(), dst.dim(1), dst_col, src.dim(0), width,
                       dtype_size(src.dtype()));
  }

  void rope_partial(Stream stream, Tensor& x, const Tensor& positions, const Tensor& inv_freq, int64_t rotary_dim,
                    double attention_scale, int sign) override {
    require_compute(x, "rope_partial");
    require_i32(positions, "rope_partial");
    require_device(inv_freq, "rope_partial");
    SPINDLE_CHECK(x.rank() == 3 && rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= x.dim(2) &&
                      inv_freq.dtype() == DType::F32 && inv_freq.numel() == rotary_dim / 2 &&
                      positions.numel() == x.dim(0),
                  "rope_partial: x {} positions {} inv_freq {} rotary_dim {}", x.describe(), positions.describe(),
                  inv_freq.describe(), rotary_dim);
    cuda::rope_partial(s(stream), x.data(), x.dtype(), x.dim(0), x.dim(1), x.dim(2), rotary_dim,
                       positions.data_as<int32_t>(), inv_freq.data_as<float>(), attention_scale, sign);
  }

  void sigmoid_gate_forward(Stream stream, const Tensor& x, const Tensor& gate, Tensor& out) override {
    require_compute(x, "sigmoid_gate_forward");
    require_same(x, gate, "sigmoid_gate_forward");
    require_same(x, out, "sigmoid_gate_forward");
    SPINDLE_CHECK(gate.numel() == x.numel() && out.numel() == x.numel(), "sigmoid_gate_forward: {} {} {}",
                  x.describe(), gate.describe(), out.describe());
    cuda::sigmoid_gate_forward(s(stream), x.data(), gate.data(), out.data(), x.dtype(), x.numel());
  }

  void sigmoid_gate_backward(Stream stream, const Tensor& x, const Tensor& gate, const Tensor& dout, Tensor& dx,
                             Tensor& dgate) override {
    require_compute(x, "sigmoid_gate_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&gate, &dout, &dx, &dgate}) {
      require_same(x, *t, "sigmoid_gate_backward");
      SPINDLE_CHECK(t->numel() == x.numel(), "sigmoid_gate_backward: {} vs {}", t->describe(), x.describe());
    }
    cuda::sigmoid_gate_backward(s(stream), x.data(), gate.data(), dout.data(), dx.data(), dgate.data(), x.dtype(),
                                x.numel());
  }

  void causal_conv1d_silu_forward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids,
                                  Tensor& y) override {
    require_compute(x, "causal_conv1d_silu_forward");
    require_same(x, y, "causal_conv1d_silu_forward");
    require_compute(w, "causal_conv1d_silu_forward weight");
    require_i32(doc_ids, "causal_conv1d_silu_forward");
    SPINDLE_CHECK(x.rank() == 2 && y.shape() == x.shape() && w.rank() >= 1 && w.dim(0) == x.dim(1) &&
                      w.numel() % x.dim(1) == 0 && doc_ids.numel() == x.dim(0),
                  "causal_conv1d_silu_forward: x {} w {} doc_ids {} y {}", x.describe(), w.describe(),
                  doc_ids.describe(), y.describe());
    cuda::causal_conv1d_silu_forward(s(stream), x.data(), w.data(), w.dtype(), doc_ids.data_as<int32_t>(), y.data(),
                                     x.dtype(), x.dim(0), x.dim(1), x.dim(1) ? w.numel() / x.dim(1) : 0);
  }

  void causal_conv1d_silu_backward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids,
                                   const Tensor& dy, Tensor& dx, Tensor* dw) override {
    require_compute(x, "causal_conv1d_silu_backward");
    require_same(x, dy, "causal_conv1d_silu_backward");
    require_same(x, dx, "causal_conv1d_silu_backward");
    require_compute(w, "causal_conv1d_silu_backward weight");
    if (dw) require_same(w, *dw, "causal_conv1d_silu_backward dw");
    require_i32(doc_ids, "causal_conv1d_silu_backward");
    SPINDLE_CHECK(x.rank() == 2 && dy.shape() == x.shape() && dx.shape() == x.shape() && w.rank() >= 1 &&
                      w.dim(0) == x.dim(1) && w.numel() % x.dim(1) == 0 && doc_ids.numel() == x.dim(0) &&
                      (!dw || dw->shape() == w.shape()),
                  "causal_conv1d_silu_backward: x {} w {} dy {} dx {}", x.describe(), w.describe(), dy.describe(),
                  dx.describe());
    cuda::causal_conv1d_silu_backward(s(stream), x.data(), w.data(), w.dtype(), doc_ids.data_as<int32_t>(), dy.data(),
                                      dx.data(), dw ? dw->data() : nullptr, x.dtype(), x.dim(0), x.dim(1),
                                      x.dim(1) ? w.numel() / x.dim(1) : 0);
  }

  void l2norm_forward(Stream stream, const Tensor& x, double eps, Tensor& y, Tensor& rstd) override {
    require_compute(x, "l2norm_forward");
    require_same(x, y, "l2norm_forward");
    SPINDLE_CHECK(x.rank() >= 1 && y.shape() == x.shape(), "l2norm_forward: x {} y {}", x.describe(), y.describe());
    const int64_t c = x.dim(x.rank() - 1), rows = c ? x.numel() / c : 0;
    require_stat(rstd, rows, "l2norm_forward rstd");
    cuda::l2norm_forward(s(stream), x.data(), y.data(), rstd.data_as<float>(), x.dtype(), rows, c,
                         static_cast<float>(eps));
  }

  void l2norm_backward(Stream stream, const Tensor& y, const Tensor& rstd, const Tensor& dy, Tensor& dx) override {
    require_compute(y, "l2norm_backward");
    require_same(y, dy, "l2norm_backward");
    require_same(y, dx, "l2norm_backward");
    SPINDLE_CHECK(y.rank() >= 1 && dy.shape() == y.shape() && dx.shape() == y.shape(),
                  "l2norm_backward: y {} dy {} dx {}", y.describe(), dy.describe(), dx.describe());
    const int64_t c = y.dim(y.rank() - 1), rows = c ? y.numel() / c : 0;
    require_stat(rstd, rows, "l2norm_backward rstd");
    cuda::l2norm_backward(s(stream), y.data(), rstd.data_as<float>(), dy.data(), dx.data(), y.dtype(), rows, c);
  }

  // The shapes the conv + split forward and backward share: qkv [T, 2·Hk·dk + Hv·dv] split into q, k
  // [T, Hk, dk] and v (or dv) [T, Hv, dv]; w's first dim the channels, its taps a whole number per
  // channel; one document id per token.
  static bool conv_split_shapes_match(const Tensor& qkv, const Tensor& w, const Tensor& doc_ids, const Tensor& q,
                                      const Tensor& k, const Tensor& v) {
    return qkv.rank() == 2 && q.rank() == 3 && k.shape() == q.shape() && v.rank() == 3 && q.dim(0) == qkv.dim(0) &&
           v.dim(0) == qkv.dim(0) && 2 * q.dim(1) * q.dim(2) + v.dim(1) * v.dim(2) == qkv.dim(1) && w.rank() >= 1 &&
           w.dim(0) == qkv.dim(1) && qkv.dim(1) > 0 && w.numel() % qkv.dim(1) == 0 && doc_ids.numel() == qkv.dim(0);
  }

  void deltanet_conv_split_forward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                   double eps, Tensor& q, Tensor& k, Tensor& v, Tensor& q_rstd,
                                   Tensor& k_rstd) override {
    const char* op = "deltanet_conv_split_forward";
    require_compute(qkv, op);
    for (const Tensor* t : {&q, &k, &v}) require_same(qkv, *t, op);
    require_compute(w, "deltanet_conv_split_forward weight");
    require_i32(doc_ids, op);
    SPINDLE_CHECK(conv_split_shapes_match(qkv, w, doc_ids, q, k, v),
                  "{}: qkv {} w {} doc_ids {} into q {} k {} v {}", op, qkv.describe(), w.describe(),
                  doc_ids.describe(), q.describe(), k.describe(), v.describe());
    const int64_t t = qkv.dim(0), key = q.dim(1) * q.dim(2), value = v.dim(1) * v.dim(2);
    require_stat(q_rstd, t * q.dim(1), "deltanet_conv_split_forward q_rstd");
    require_stat(k_rstd, t * q.dim(1), "deltanet_conv_split_forward k_rstd");
    const bool fused = cuda::deltanet_conv_split_forward(
        s(stream), qkv.data(), w.data(), w.dtype(), doc_ids.data_as<int32_t>(), q.data(), k.data(), v.data(),
        q_rstd.data_as<float>(), k_rstd.data_as<float>(), qkv.dtype(), t, key, value, q.dim(2),
        w.numel() / qkv.dim(1), static_cast<float>(eps));
    if (!fused) deltanet_conv_split_forward_by_parts(*this, stream, qkv, w, doc_ids, eps, q, k, v, q_rstd, k_rstd);
  }

  void deltanet_conv_split_backward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                    const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv, Tensor& d_qkv,
                                    Tensor* dw) override {
    const char* op = "deltanet_conv_split_backward";
    require_compute(qkv, op);
    for (const Tensor* t : {&q, &k, &dq, &dk, &dv, static_cast<const Tensor*>(&d_qkv)}) require_same(qkv, *t, op);
    require_compute(w, "deltanet_conv_split_backward weight");
    if (dw) require_same(w, *dw, "deltanet_conv_split_backward dw");
    require_i32(doc_ids, op);
    SPINDLE_CHECK(conv_split_shapes_match(qkv, w, doc_ids, q, k, dv) && d_qkv.shape() == qkv.shape() &&
                      dq.shape() == q.shape() && dk.shape() == q.shape() && (!dw || dw->shape() == w.shape()),
                  "{}: qkv {} w {} doc_ids {} q {} dv {} d_qkv {}", op, qkv.describe(), w.describe(),
                  doc_ids.describe(), q.describe(), dv.describe(), d_qkv.describe());
    const int64_t t = qkv.dim(0), key = q.dim(1) * q.dim(2), value = dv.dim(1) * dv.dim(2);
    require_stat(q_rstd, t * q.dim(1), "deltanet_conv_split_backward q_rstd");
    require_stat(k_rstd, t * q.dim(1), "deltanet_conv_split_backward k_rstd");
    const bool fused = cuda::deltanet_conv_split_backward(
        s(stream), qkv.data(), w.data(), w.dtype(), doc_ids.data_as<int32_t>(), q.data(), k.data(),
        q_rstd.data_as<float>(), k_rstd.data_as<float>(), dq.data(), dk.data(), dv.data(), d_qkv.data(),
        dw ? dw->data() : nullptr, qkv.dtype(), t, key, value, q.dim(2), w.numel() / qkv.dim(1));
    if (!fused)
      deltanet_conv_split_backward_by_parts(*this, stream, qkv, w, doc_ids, q, k, q_rstd, k_rstd, dq, dk, dv, d_qkv,
                                            dw);
  }

  void gated_delta_gates_forward(Stream stream, const Tensor& a, const Tensor& b, const Tensor& a_log,
                                 const Tensor& dt_bias, Tensor& g, Tensor& beta) override {
    require_compute(a, "gated_delta_gates_forward");
    require_same(a, b, "gated_delta_gates_forward");
    require_same(a, beta, "gated_delta_gates_forward beta");
    require_compute(a_log, "gated_delta_gates_forward A_log");
    require_same(a_log, dt_bias, "gated_delta_gates_forward dt_bias");
    const int64_t heads = a_log.numel(), tokens = heads ? a.numel() / heads : 0;
    SPINDLE_CHECK(tokens * heads == a.numel() && b.numel() == a.numel() && dt_bias.numel() == heads &&
                      beta.numel() == a.numel(),
                  "gated_delta_gates_forward: a {} b {} A_log {} dt_bias {} beta {}", a.describe(), b.describe(),
                  a_log.describe(), dt_bias.describe(), beta.describe());
    require_stat(g, a.numel(), "gated_delta_gates_forward g");
    cuda::gated_delta_gates_forward(s(stream), a.data(), b.data(), a_log.data(), dt_bias.data(), a_log.dtype(),
                                    g.data_as<float>(), beta.data(), a.dtype(), tokens, heads);
  }

  void gated_delta_gates_backward(Stream stream, const Tensor& a, const Tensor& beta, const Tensor& a_log,
                                  const Tensor& dt_bias, const Tensor& g, const Tensor& dg, const Tensor& dbeta,
                                  Tensor& da, Tensor& db, Tensor* da_log, Tensor* ddt_bias) override {
    require_compute(a, "gated_delta_gates_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&beta, &dbeta, &da, &db})
      require_same(a, *t, "gated_delta_gates_backward");
    require_compute(a_log, "gated_delta_gates_backward A_log");
    require_same(a_log, dt_bias, "gated_delta_gates_backward dt_bias");
    if (da_log) require_same(a_log, *da_log, "gated_delta_gates_backward dA_log");
    if (ddt_bias) require_same(a_log, *ddt_bias, "gated_delta_gates_backward ddt_bias");
    const int64_t heads = a_log.numel(), tokens = heads ? a.numel() / heads : 0;
    SPINDLE_CHECK(tokens * heads == a.numel() && beta.numel() == a.numel() && dbeta.numel() == a.numel() &&
                      da.numel() == a.numel() && db.numel() == a.numel() && dt_bias.numel() == heads &&
                      (!da_log || da_log->numel() == heads) && (!ddt_bias || ddt_bias->numel() == heads),
                  "gated_delta_gates_backward: a {} A_log {} dt_bias {}", a.describe(), a_log.describe(),
                  dt_bias.describe());
    require_stat(g, a.numel(), "gated_delta_gates_backward g");
    require_stat(dg, a.numel(), "gated_delta_gates_backward dg");
    cuda::gated_delta_gates_backward(s(stream), a.data(), beta.data(), a_log.data(), dt_bias.data(), a_log.dtype(),
                                     g.data_as<float>(), dg.data_as<float>(), dbeta.data(), da.data(), db.data(),
                                     da_log ? da_log->data() : nullptr, ddt_bias ? ddt_bias->data() : nullptr,
                                     a.dtype(), tokens, heads);
  }

  void gated_delta_rule_forward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& doc_ids, double scale, int64_t chunk_size,
                                Tensor& out) override {
    const cuda::DeltaRuleShape sh = delta_rule_shape(q, k, v, g, beta, doc_ids, chunk_size, "gated_delta_rule_forward");
    require_same(q, out, "gated_delta_rule_forward out");
    SPINDLE_CHECK(out.shape() == v.shape(), "gated_delta_rule_forward: out {} for v {}", out.describe(), v.describe());
    cuda::gated_delta_rule_forward(s(stream), sh, q.dtype(), q.data(), k.data(), v.data(), g.data_as<float>(),
                                   beta.data(), doc_ids.data_as<int32_t>(), static_cast<float>(scale), out.data());
  }

  void gated_delta_rule_backward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                 const Tensor& beta, const Tensor& doc_ids, double scale, int64_t chunk_size,
                                 const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dg,
                                 Tensor& dbeta) override {
    const cuda::DeltaRuleShape sh =
        delta_rule_shape(q, k, v, g, beta, doc_ids, chunk_size, "gated_delta_rule_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&dout, &dq, &dk, &dv, &dbeta})
      require_same(q, *t, "gated_delta_rule_backward");
    SPINDLE_CHECK(dout.shape() == v.shape() && dq.shape() == q.shape() && dk.shape() == k.shape() &&
                      dv.shape() == v.shape() && dbeta.numel() == beta.numel(),
                  "gated_delta_rule_backward: dout {} dq {} dk {} dv {} dbeta {}", dout.describe(), dq.describe(),
                  dk.describe(), dv.describe(), dbeta.describe());
    require_stat(dg, g.numel(), "gated_delta_rule_backward dg");
    cuda::gated_delta_rule_backward(s(stream), sh, q.dtype(), q.data(), k.data(), v.data(), g.data_as<float>(),
                                    beta.data(), doc_ids.data_as<int32_t>(), static_cast<float>(scale), dout.data(),
                                    dq.data(), dk.data(), dv.data(), dg.data_as<float>(), dbeta.data());
  }

  // The state-passing delta rule (gated_delta_states.cu): token by token, the chunk size only checked.
  void gated_delta_rule_forward_states(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& g, const Tensor& beta, const Tensor& run_ids, double scale,
                                       int64_t chunk_size, const Tensor& initial_states, Tensor& out,
                                       Tensor& final_states) override {
    const char* op = "gated_delta_rule_forward_states";
    const cuda::DeltaStatesShape sh = delta_states_shape(q, k, v, g, beta, run_ids, chunk_size, initial_states, op);
    require_same(q, out, op);
    SPINDLE_CHECK(out.shape() == v.shape(), "{}: out {} for v {}", op, out.describe(), v.describe());
    require_stat(final_states, initial_states.numel(), op);
    cuda::gated_delta_rule_forward_states(s(stream), sh, q.dtype(), q.data(), k.data(), v.data(), g.data_as<float>(),
                                          beta.data(), run_ids.data_as<int32_t>(), static_cast<float>(scale),
                                          initial_states.data_as<float>(), out.data(), final_states.data_as<float>(),
                                          ctx_->device_error());
  }

  void gated_delta_rule_backward_states(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& g, const Tensor& beta, const Tensor& run_ids, double scale,
                                        int64_t chunk_size, const Tensor& initial_states, const Tensor& dout,
                                        const Tensor& d_final_states, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dg,
                                        Tensor& dbeta, Tensor& d_initial_states) override {
    const char* op = "gated_delta_rule_backward_states";
    const cuda::DeltaStatesShape sh = delta_states_shape(q, k, v, g, beta, run_ids, chunk_size, initial_states, op);
    for (const Tensor* t : std::initializer_list<const Tensor*>{&dout, &dq, &dk, &dv, &dbeta}) require_same(q, *t, op);
    SPINDLE_CHECK(dout.shape() == v.shape() && dq.shape() == q.shape() && dk.shape() == k.shape() &&
                      dv.shape() == v.shape() && dbeta.numel() == beta.numel(),
                  "{}: dout {} dq {} dk {} dv {} dbeta {}", op, dout.describe(), dq.describe(), dk.describe(),
                  dv.describe(), dbeta.describe());
    require_stat(dg, g.numel(), op);
    require_stat(d_final_states, initial_states.numel(), op);
    require_stat(d_initial_states, initial_states.numel(), op);
    cuda::gated_delta_rule_backward_states(
        s(stream), sh, q.dtype(), q.data(), k.data(), v.data(), g.data_as<float>(), beta.data(),
        run_ids.data_as<int32_t>(), static_cast<float>(scale), initial_states.data_as<float>(), dout.data(),
        d_final_states.data_as<float>(), dq.data(), dk.data(), dv.data(), dg.data_as<float>(), dbeta.data(),
        d_initial_states.data_as<float>(), ctx_->device_error());
  }

  void gated_rmsnorm_forward(Stream stream, const Tensor& x, const Tensor& z, const Tensor& w, double eps, Tensor& y,
                             Tensor& rstd) override {
    require_compute(x, "gated_rmsnorm_forward");
    require_same(x, z, "gated_rmsnorm_forward");
    require_same(x, y, "gated_rmsnorm_forward");
    require_compute(w, "gated_rmsnorm_forward weight");
    const int64_t c = w.numel(), rows = c ? x.numel() / c : 0;
    SPINDLE_CHECK(rows * c == x.numel() && z.numel() == x.numel() && y.numel() == x.numel(),
                  "gated_rmsnorm_forward: x {} z {} w {} y {}", x.describe(), z.describe(), w.describe(),
                  y.describe());
    require_stat(rstd, rows, "gated_rmsnorm_forward rstd");
    cuda::gated_rmsnorm_forward(s(stream), x.data(), z.data(), w.data(), w.dtype(), y.data(), rstd.data_as<float>(),
                                x.dtype(), rows, c, static_cast<float>(eps));
  }

  void gated_rmsnorm_backward(Stream stream, const Tensor& x, const Tensor& z, const Tensor& w, const Tensor& rstd,
                              const Tensor& dy, Tensor& dx, Tensor& dz, Tensor* dw) override {
    require_compute(x, "gated_rmsnorm_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&z, &dy, &dx, &dz})
      require_same(x, *t, "gated_rmsnorm_backward");
    require_compute(w, "gated_rmsnorm_backward weight");
    if (dw) require_same(w, *dw, "gated_rmsnorm_backward dw");
    const int64_t c = w.numel(), rows = c ? x.numel() / c : 0;
    SPINDLE_CHECK(rows * c == x.numel() && z.numel() == x.numel() && dy.numel() == x.numel() &&
                      dx.numel() == x.numel() && dz.numel() == x.numel() && (!dw || dw->numel() == c),
                  "gated_rmsnorm_backward: x {} w {}", x.describe(), w.describe());
    require_stat(rstd, rows, "gated_rmsnorm_backward rstd");
    cuda::gated_rmsnorm_backward(s(stream), x.data(), z.data(), w.data(), w.dtype(), rstd.data_as<float>(), dy.data(),
                                 dx.data(), dz.data(), dw ? dw->data() : nullptr, x.dtype(), rows, c);
  }

  // ---- 4-bit weights (quant4.cu) ------------------------------------------------------------------
  void dequantize_4bit(Stream stream, const Tensor& packed, const Tensor& absmax, int64_t blocksize, Quant4Type type,
                       Tensor& w) override {
    require_compute(w, "dequantize_4bit");
    require_device(packed, "dequantize_4bit");
    require_device(absmax, "dequantize_4bit");
    const int64_t n = w.numel();
    if (packed.dtype() != DType::U8 || absmax.dtype() != DType::F32)
      fail("dequantize_4bit: packed must be U8 and absmax F32, got {} and {}", packed.describe(), absmax.describe());
    if (blocksize < 32 || blocksize > 4096 || (blocksize & (blocksize - 1)) != 0)
      fail("dequantize_4bit: blocksize {} is not 32 ... 4096, a power of two", blocksize);
    if (packed.numel() != (n + 1) / 2 || absmax.numel() != (n + blocksize - 1) / blocksize)
      fail("dequantize_4bit: {} weights of blocksize {} need {} packed bytes and {} absmax, got {} and {}", n,
           blocksize, (n + 1) / 2, (n + blocksize - 1) / blocksize, packed.describe(), absmax.describe());
    cuda::dequantize_4bit(s(stream), packed.data(), absmax.data(), w.data(), w.dtype(), n, blocksize,
                          type == Quant4Type::NF4);
  }
  void dequantize_absmax(Stream stream, const Tensor& codes, const Tensor& code_map, const Tensor& absmax2,
                         int64_t blocksize2, double offset, Tensor& absmax) override {
    for (const Tensor* t : {&codes, &code_map, &absmax2, static_cast<const Tensor*>(&absmax)})
      require_device(*t, "dequantize_absmax");
    const int64_t k = codes.numel();
    if (codes.dtype() != DType::U8 || code_map.dtype() != DType::F32 || absmax2.dtype() != DType::F32 ||
        absmax.dtype() != DType::F32 || code_map.numel() != 256 || absmax.numel() != k || blocksize2 <= 0 ||
        absmax2.numel() != (k + blocksize2 - 1) / blocksize2)
      fail("dequantize_absmax: {} codes (U8) of blocksize {} need a 256-entry F32 map, F32 nested absmax and F32 "
           "outputs; got {}, {}, {}, {}",
           k, blocksize2, codes.describe(), code_map.describe(), absmax2.describe(), absmax.describe());
    cuda::dequantize_absmax(s(stream), codes.data(), code_map.data(), absmax2.data(), absmax.data(), k, blocksize2,
                            static_cast<float>(offset));
  }
  // Quantising at load (quant4.cu): the host quantiser's bytes, with its reciprocal table on the device.
  void quantize_4bit(Stream stream, const Tensor& w, int64_t blocksize, Quant4Type type, Tensor& packed,
                     Tensor& absmax) override {
    require_device(w, "quantize_4bit");
    require_device(packed, "quantize_4bit");
    require_device(absmax, "quantize_4bit");
    const int64_t n = w.numel();
    if (!is_float(w.dtype()) || packed.dtype() != DType::U8 || absmax.dtype() != DType::F32)
      fail("quantize_4bit: w must be a float tensor, packed U8 and absmax F32, got {}, {} and {}", w.describe(),
           packed.describe(), absmax.describe());
    if (!quant4::valid_blocksize(blocksize))
      fail("quantize_4bit: blocksize {} is not 32 ... 4096, a power of two", blocksize);
    if (packed.numel() != (n + 1) / 2 || absmax.numel() != quant4::num_blocks(n, blocksize))
      fail("quantize_4bit: {} weights of blocksize {} need {} packed bytes and {} absmax, got {} and {}", n,
           blocksize, (n + 1) / 2, quant4::num_blocks(n, blocksize), packed.describe(), absmax.describe());
    cuda::quantize_4bit(s(stream), w.data(), w.dtype(), n, blocksize, type == Quant4Type::NF4, rcp_table(),
                        packed.data(), absmax.data());
  }
  void quantize_absmax(Stream stream, const Tensor& absmax, const Tensor& code_map, double offset, int64_t blocksize2,
                       Tensor& codes, Tensor& absmax2) override {
    for (const Tensor* t : {&absmax, &code_map, static_cast<const Tensor*>(&codes), static_cast<const Tensor*>(&absmax2)})
      require_device(*t, "quantize_absmax");
    const int64_t k = absmax.numel();
    if (absmax.dtype() != DType::F32 || code_map.dtype() != DType::F32 || codes.dtype() != DType::U8 ||
        absmax2.dtype() != DType::F32 || code_map.numel() != 256 || codes.numel() != k || blocksize2 <= 0 ||
        blocksize2 > 4096 || absmax2.numel() != quant4::num_blocks(k, blocksize2))
      fail("quantize_absmax: {} F32 absmax of blocksize {} (1 ... 4096) need a 256-entry F32 map, {} U8 codes and {} "
           "F32 nested absmax; got {}, {}, {}, {}",
           k, blocksize2, k, quant4::num_blocks(k, std::max<int64_t>(blocksize2, 1)), absmax.describe(),
           code_map.describe(), codes.describe(), absmax2.describe());
    cuda::quantize_absmax(s(stream), absmax.data(), code_map.data(), static_cast<float>(offset), k, blocksize2,
                          rcp_table(), codes.data(), absmax2.data());
  }

  void swiglu_forward(Stream stream, const Tensor& gate, const Tensor& up, Tensor& out) override {
    require_compute(gate, "swiglu_forward");
    require_same(gate, up, "swiglu_forward");
    require_same(gate, out, "swiglu_forward");
    SPINDLE_CHECK(up.numel() == gate.numel() && out.numel() == gate.numel(), "swiglu_forward {} {} {}",
                  gate.describe(), up.describe(), out.describe());
    cuda::swiglu_forward(s(stream), gate.data(), up.data(), out.data(), gate.dtype(), gate.numel());
  }

  void swiglu_backward(Stream stream, const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                       Tensor& dup) override {
    require_compute(gate, "swiglu_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&up, &dout, &dgate, &dup}) {
      require_same(gate, *t, "swiglu_backward");
      SPINDLE_CHECK(t->numel() == gate.numel(), "swiglu_backward {} vs {}", t->describe(), gate.describe());
    }
    cuda::swiglu_backward(s(stream), gate.data(), up.data(), dout.data(), dgate.data(), dup.data(), gate.dtype(),
                          gate.numel());
  }

  // ---- rows ---------------------------------------------------------------------------------------
  void gather_rows(Stream stream, const Tensor& src, const Tensor& idx, Tensor& dst) override {
    require_i32(idx, "gather_rows");
    require_device(src, "gather_rows");
    require_device(dst, "gather_rows");
    SPINDLE_CHECK(src.dtype() == dst.dtype(), "gather_rows dtype {} vs {}", src.describe(), dst.describe());
    const int64_t n = idx.numel(), rows = src.dim(0), row_elems = rows ? src.numel() / rows : 0;
    SPINDLE_CHECK(dst.numel() == n * row_elems, "gather_rows: dst {} for {} rows of {}", dst.describe(), n,
                  src.describe());
    cuda::gather_rows(s(stream), src.data(), rows, idx.data_as<int32_t>(), n, dst.data(),
                      static_cast<size_t>(row_elems) * dtype_size(src.dtype()), ctx_->device_error(),
                      cuda::kErrGatherIndex);
  }

  void scatter_add_rows(Stream stream, const Tensor& src, const Tensor& idx, Tensor& dst) override {
    require_i32(idx, "scatter_add_rows");
    require_compute(src, "scatter_add_rows");
    require_same(src, dst, "scatter_add_rows");
    const int64_t n = idx.numel(), rows = dst.dim(0), row_elems = rows ? dst.numel() / rows : 0;
    SPINDLE_CHECK(src.numel() == n * row_elems, "scatter_add_rows shapes: src {} idx {} dst {}", src.describe(),
                  idx.describe(), dst.describe());
    cuda::scatter_add_rows(s(stream), src.data(), idx.data_as<int32_t>(), n, dst.data(), rows, row_elems,
                           src.dtype(), ctx_->device_error());
  }

  // ---- mixture of experts (moe.cu, moe_grouped_gemm.cu) -----------------------------------------
  void moe_router_forward(Stream stream, const Tensor& logits, int64_t top_k, bool normalize, Tensor& probs,
                          Tensor& topk_index, Tensor& topk_weight) override {
    require_compute(logits, "moe_router_forward");
    SPINDLE_CHECK(logits.rank() == 2, "moe_router_forward: logits {} are not [T, E]", logits.describe());
    const int64_t t = logits.dim(0), e = logits.dim(1);
    SPINDLE_CHECK(top_k >= 1 && top_k <= e, "moe_router_forward: top_k {} of {} experts", top_k, e);
    require_stat(probs, t * e, "moe_router_forward probs");
    require_i32(topk_index, "moe_router_forward topk_index");
    require_stat(topk_weight, t * top_k, "moe_router_forward topk_weight");
    SPINDLE_CHECK(topk_index.numel() == t * top_k, "moe_router_forward: topk_index {} for [{}, {}]",
                  topk_index.describe(), t, top_k);
    cuda::moe_router_forward(s(stream), logits.data(), logits.dtype(), t, static_cast<int>(e),
                             static_cast<int>(top_k), normalize, probs.data_as<float>(),
                             topk_index.data_as<int32_t>(), topk_weight.data_as<float>());
  }

  void moe_router_backward(Stream stream, const Tensor& probs, const Tensor& topk_index, const Tensor& d_topk_weight,
                           bool normalize, const Tensor& aux_grad, const Tensor& token_doc, Tensor& dlogits) override {
    require_compute(dlogits, "moe_router_backward");
    SPINDLE_CHECK(probs.rank() == 2 && topk_index.rank() == 2, "moe_router_backward: probs {} topk_index {}",
                  probs.describe(), topk_index.describe());
    const int64_t t = probs.dim(0), e = probs.dim(1), k = topk_index.dim(1);
    require_stat(probs, t * e, "moe_router_backward probs");
    require_i32(topk_index, "moe_router_backward topk_index");
    require_stat(d_topk_weight, t * k, "moe_router_backward d_topk_weight");
    SPINDLE_CHECK(topk_index.dim(0) == t && dlogits.shape() == probs.shape(),
                  "moe_router_backward: topk_index {} dlogits {} for probs {}", topk_index.describe(),
                  dlogits.describe(), probs.describe());
    if (aux_grad.defined()) require_stat(aux_grad, e, "moe_router_backward aux_grad");
    if (token_doc.defined()) {
      require_i32(token_doc, "moe_router_backward token_doc");
      SPINDLE_CHECK(token_doc.numel() == t, "moe_router_backward: token_doc {} for {} tokens", token_doc.describe(), t);
    }
    cuda::moe_router_backward(s(stream), probs.data_as<float>(), topk_index.data_as<int32_t>(),
                              d_topk_weight.data_as<float>(), t, static_cast<int>(e), static_cast<int>(k), normalize,
                              aux_grad.defined() ? aux_grad.data_as<float>() : nullptr,
                              token_doc.defined() ? token_doc.data_as<int32_t>() : nullptr, dlogits.data(),
                              dlogits.dtype());
  }

  void moe_router_statistics(Stream stream, const Tensor& probs, const Tensor& topk_index, const Tensor& token_doc,
                             Tensor& counts, Tensor& prob_sums) override {
    SPINDLE_CHECK(probs.rank() == 2 && topk_index.rank() == 2 && topk_index.dim(0) == probs.dim(0),
                  "moe_router_statistics: probs {} topk_index {}", probs.describe(), topk_index.describe());
    const int64_t t = probs.dim(0), e = probs.dim(1), k = topk_index.dim(1);
    require_stat(probs, t * e, "moe_router_statistics probs");
    require_i32(topk_index, "moe_router_statistics topk_index");
    require_stat(counts, e, "moe_router_statistics counts");
    require_stat(prob_sums, e, "moe_router_statistics prob_sums");
    if (token_doc.defined()) {
      require_i32(token_doc, "moe_router_statistics token_doc");
      SPINDLE_CHECK(token_doc.numel() == t, "moe_router_statistics: token_doc {} for {} tokens", token_doc.describe(),
                    t);
    }
    cuda::moe_router_statistics(s(stream), probs.data_as<float>(), topk_index.data_as<int32_t>(),
                                token_doc.defined() ? token_doc.data_as<int32_t>() : nullptr, t, static_cast<int>(e),
                                static_cast<int>(k), counts.data_as<float>(), prob_sums.data_as<float>());
  }

  void moe_permute(Stream stream, const Tensor& topk_index, int64_t num_experts, Tensor& rows_token,
                   Tensor& row_of_slot, Tensor& offsets) override {
    for (const Tensor* x : {&topk_index, &static_cast<const Tensor&>(rows_token),
                            &static_cast<const Tensor&>(row_of_slot), &static_cast<const Tensor&>(offsets)})
      require_i32(*x, "moe_permute");
    SPINDLE_CHECK(topk_index.rank() == 2, "moe_permute: topk_index {} is not [T, k]", topk_index.describe());
    const int64_t n = topk_index.numel();
    SPINDLE_CHECK(num_experts >= 1 && rows_token.numel() == n && row_of_slot.numel() == n &&
                      offsets.numel() == num_experts + 1,
                  "moe_permute: topk_index {} experts {}: rows_token {} row_of_slot {} offsets {}",
                  topk_index.describe(), num_experts, rows_token.describe(), row_of_slot.describe(),
                  offsets.describe());
    cuda::moe_permute(s(stream), topk_index.data_as<int32_t>(), topk_index.dim(0), static_cast<int>(topk_index.dim(1)),
                      static_cast<int>(num_experts), rows_token.data_as<int32_t>(), row_of_slot.data_as<int32_t>(),
                      offsets.data_as<int32_t>(), ctx_->device_error());
  }

  void moe_combine(Stream stream, const Tensor& y, const Tensor& row_of_slot, const Tensor& topk_index,
                   const Tensor& topk_weight, Tensor& out) override {
    require_compute(y, "moe_combine");
    require_same(y, out, "moe_combine");
    require_i32(row_of_slot, "moe_combine row_of_slot");
    require_i32(topk_index, "moe_combine topk_index");
    SPINDLE_CHECK(topk_index.rank() == 2 && out.rank() == 2 && y.rank() == 2, "moe_combine: y {} topk_index {} out {}",
                  y.describe(), topk_index.describe(), out.describe());
    const int64_t t = topk_index.dim(0), k = topk_index.dim(1), h = out.dim(1);
    require_stat(topk_weight, t * k, "moe_combine topk_weight");
    SPINDLE_CHECK(out.dim(0) == t && y.shape() == Shape({t * k, h}) && row_of_slot.numel() == t * k,
                  "moe_combine: y {} row_of_slot {} out {} for topk_index {}", y.describe(), row_of_slot.describe(),
                  out.describe(), topk_index.describe());
    cuda::moe_combine(s(stream), y.data(), row_of_slot.data_as<int32_t>(), topk_index.data_as<int32_t>(),
                      topk_weight.data_as<float>(), t, static_cast<int>(k), h, out.data(), y.dtype());
  }

  void moe_combine_backward(Stream stream, const Tensor& dout, const Tensor& y, const Tensor& row_of_slot,
                            const Tensor& topk_weight, Tensor& dy, Tensor& d_topk_weight) override {
    require_compute(dout, "moe_combine_backward");
    require_same(dout, y, "moe_combine_backward");
    require_same(dout, dy, "moe_combine_backward");
    require_i32(row_of_slot, "moe_combine_backward row_of_slot");
    SPINDLE_CHECK(topk_weight.rank() == 2 && dout.rank() == 2, "moe_combine_backward: topk_weight {} dout {}",
                  topk_weight.describe(), dout.describe());
    const int64_t t = topk_weight.dim(0), k = topk_weight.dim(1), h = dout.dim(1);
    require_stat(topk_weight, t * k, "moe_combine_backward topk_weight");
    require_stat(d_topk_weight, t * k, "moe_combine_backward d_topk_weight");
    SPINDLE_CHECK(dout.dim(0) == t && y.shape() == Shape({t * k, h}) && dy.shape() == y.shape() &&
                      row_of_slot.numel() == t * k,
                  "moe_combine_backward: dout {} y {} dy {} row_of_slot {} for topk_weight {}", dout.describe(),
                  y.describe(), dy.describe(), row_of_slot.describe(), topk_weight.describe());
    cuda::moe_combine_backward(s(stream), dout.data(), y.data(), row_of_slot.data_as<int32_t>(),
                               topk_weight.data_as<float>(), t, static_cast<int>(k), h, dy.data(),
                               d_topk_weight.data_as<float>(), dout.dtype());
  }

  // The shared expert's gate: shared, out [T, H] and the logits [T, 1] (or [T]) of one compute dtype.
  void shared_expert_gate_forward(Stream stream, const Tensor& shared, const Tensor& gate, Tensor& out) override {
    const int64_t hidden = shared_gate_shape(shared, gate, out, "shared_expert_gate_forward");
    cuda::shared_expert_gate_forward(s(stream), shared.data(), gate.data(), shared.dim(0), hidden, out.data(),
                                     shared.dtype());
  }

  void shared_expert_gate_backward(Stream stream, const Tensor& shared, const Tensor& gate, const Tensor& dout,
                                   Tensor& d_shared, Tensor& d_gate) override {
    const char* op = "shared_expert_gate_backward";
    const int64_t hidden = shared_gate_shape(shared, gate, dout, op);
    require_same(shared, d_shared, op);
    require_same(shared, d_gate, op);
    SPINDLE_CHECK(d_shared.shape() == shared.shape() && d_gate.numel() == gate.numel(), "{}: d_shared {} d_gate {}",
                  op, d_shared.describe(), d_gate.describe());
    cuda::shared_expert_gate_backward(s(stream), shared.data(), gate.data(), dout.data(), shared.dim(0), hidden,
                                      d_shared.data(), d_gate.data(), shared.dtype());
  }

  void moe_grouped_gemm(Stream stream, const Tensor& x, const std::vector<Tensor>& weights, bool transpose_weight,
                        const Tensor& offsets, Tensor& y, bool accumulate) override {
    const char* op = "moe_grouped_gemm";
    require_compute(x, op);
    require_same(x, y, op);
    const int64_t experts = static_cast<int64_t>(weights.size());
    require_expert_offsets(offsets, experts, op);
    SPINDLE_CHECK(x.rank() == 2 && y.rank() == 2 && x.dim(0) == y.dim(0), "{}: x {} and y {} need the same rows", op,
                  x.describe(), y.describe());
    const int64_t k = x.dim(1), n = y.dim(1);
    cuda::ExpertPointers table{};
    for (int64_t e = 0; e < experts; ++e) {
      const Tensor& w = weights[static_cast<size_t>(e)];
      require_same(x, w, op);
      // The forward's W_e is [n, k] (used transposed); the input gradient's is [k, n].
      const Shape expect = transpose_weight ? Shape{n, k} : Shape{k, n};
      SPINDLE_CHECK(w.shape() == expect, "{}: expert {} weight {} for x {} and y {} (expected {})", op, e,
                    w.describe(), x.describe(), y.describe(), expect.str());
      table.p[e] = w.data();
    }
    cuda::moe_grouped_gemm(s(stream), x.dtype(), x.data(), x.dim(0), k, table, static_cast<int>(experts),
                           transpose_weight, offsets.data_as<int32_t>(), y.data(), n, accumulate);
  }

  void moe_grouped_gemm_weight_grad(Stream stream, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                    std::vector<Tensor>& weight_grads) override {
    const char* op = "moe_grouped_gemm_weight_grad";
    require_compute(dy, op);
    require_same(dy, x, op);
    const int64_t experts = static_cast<int64_t>(weight_grads.size());
    require_expert_offsets(offsets, experts, op);
    SPINDLE_CHECK(dy.rank() == 2 && x.rank() == 2 && dy.dim(0) == x.dim(0), "{}: dy {} and x {} need the same rows",
                  op, dy.describe(), x.describe());
    const int64_t m = dy.dim(1), n = x.dim(1);
    cuda::ExpertPointers table{};
    DType grad = dy.dtype();
    bool first = true;
    for (int64_t e = 0; e < experts; ++e) {
      Tensor& g = weight_grads[static_cast<size_t>(e)];
      if (!g.defined()) continue;  // a frozen expert
      require_device(g, op);
      if (first) grad = g.dtype();
      first = false;
      if (!(g.dtype() == grad && (grad == dy.dtype() || (dy.dtype() == DType::BF16 && grad == DType::F32))))
        fail("{}: expert {} gradient {} does not fit dy {} (the compute dtype, or F32 for BF16, one for all)", op, e,
             g.describe(), dy.describe());
      SPINDLE_CHECK(g.shape() == Shape({m, n}), "{}: expert {} gradient {} for dy {} and x {}", op, e, g.describe(),
                    dy.describe(), x.describe());
      table.p[e] = g.data();
    }
    if (first) return;  // every expert frozen
    cuda::moe_grouped_gemm_weight_grad(s(stream), dy.dtype(), dy.data(), x.data(), dy.dim(0), m, n,
                                       offsets.data_as<int32_t>(), table, static_cast<int>(experts), grad);
  }

  // ---- loss ---------------------------------------------------------------------------------------
  void cross_entropy(Stream stream, Tensor& logits, const Tensor& targets, const Tensor& weights, double loss_scale,
                     double grad_scale, Tensor& loss_sum, Tensor& token_ce) override {
    require_compute(logits, "cross_entropy");
    require_i32(targets, "cross_entropy");
    require_compute(weights, "cross_entropy weights");
    SPINDLE_CHECK(logits.rank() == 2 && targets.numel() == logits.dim(0) && weights.numel() == logits.dim(0),
                  "cross_entropy: logits {} targets {} weights {}", logits.describe(), targets.describe(),
                  weights.describe());
    require_stat(loss_sum, 1, "cross_entropy loss_sum");
    if (token_ce.defined()) require_stat(token_ce, logits.dim(0), "cross_entropy token_ce");
    cuda::cross_entropy(s(stream), logits.data(), logits.dtype(), logits.dim(0), logits.dim(1),
                        targets.data_as<int32_t>(), weights.data(), weights.dtype(), loss_scale, grad_scale,
                        loss_sum.data_as<float>(), token_ce.defined() ? token_ce.data_as<float>() : nullptr,
                        ctx_->device_error());
  }

  // ---- optimizer ----------------------------------------------------------------------------------
  void adamw_step(Stream stream, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& hp) override {
    require_device(param, "adamw_step");
    SPINDLE_CHECK(param.dtype() == DType::F32, "adamw_step: master parameters must be F32, got {}", param.describe());
    for (const Tensor* t : std::initializer_list<const Tensor*>{&grad, &m, &v}) {
      require_same(param, *t, "adamw_step");
      SPINDLE_CHECK(t->numel() == param.numel(), "adamw_step {} vs {}", t->describe(), param.describe());
    }
    cuda::AdamWParams p{static_cast<float>(hp.lr),
                        static_cast<float>(hp.beta1),
                        static_cast<float>(hp.beta2),
                        static_cast<float>(hp.eps),
                        static_cast<float>(hp.weight_decay),
                        static_cast<float>(hp.grad_scale),
                        static_cast<float>(1.0 - std::pow(hp.beta1, static_cast<double>(hp.step))),
                        static_cast<float>(1.0 - std::pow(hp.beta2, static_cast<double>(hp.step)))};
    cuda::adamw(s(stream), param.data_as<float>(), grad.data_as<float>(), m.data_as<float>(), v.data_as<float>(),
                param.numel(), p);
  }

 private:
  cudaStream_t s(Stream stream) const {
    return stream.handle ? static_cast<cudaStream_t>(stream.handle) : ctx_->stream();
  }

  void require_device(const Tensor& t, const char* what) const {
    SPINDLE_CHECK(t.defined(), "{}: tensor not allocated", what);
    if (t.device() != device()) fail("{}: tensor {} is not on {}", what, t.describe(), device().str());
  }
  void require_compute(const Tensor& t, const char* what) const {
    require_device(t, what);
    if (!is_compute(t.dtype()))
      fail("{}: the CUDA backend computes in F32 or BF16, got {}; convert with copy() first", what, t.describe());
  }
  void require_same(const Tensor& a, const Tensor& b, const char* what) const {
    require_device(b, what);
    SPINDLE_CHECK(a.dtype() == b.dtype(), "{}: dtype mismatch {} vs {}", what, a.describe(), b.describe());
  }
  void require_i32(const Tensor& t, const char* what) const {
    require_device(t, what);
    SPINDLE_CHECK(t.dtype() == DType::I32, "{}: index tensor must be I32, got {}", what, t.describe());
  }
  // Statistics (rstd, lse, loss sums) are F32 on this backend.
  void require_stat(const Tensor& t, int64_t numel, const char* what) const {
    require_device(t, what);
    if (t.dtype() != DType::F32) fail("{}: statistics are F32 on the CUDA backend, got {}", what, t.describe());
    SPINDLE_CHECK(t.numel() == numel, "{}: {} elements expected, got {}", what, numel, t.describe());
  }

  // The experts' row offsets of a grouped GEMM: I32 [E + 1] on this device, E within the kernels' table.
  void require_expert_offsets(const Tensor& offsets, int64_t experts, const char* what) const {
    require_i32(offsets, what);
    if (experts < 1 || experts > cuda::kMaxGroupedExperts)
      fail("{}: {} experts; the CUDA grouped GEMM takes 1 … {}", what, experts, cuda::kMaxGroupedExperts);
    SPINDLE_CHECK(offsets.numel() == experts + 1, "{}: offsets {} for {} experts", what, offsets.describe(), experts);
  }

  // [T, H] `shared` and `other`, one logit per token in `gate`, all of one compute dtype: returns H.
  int64_t shared_gate_shape(const Tensor& shared, const Tensor& gate, const Tensor& other, const char* op) const {
    require_compute(shared, op);
    require_same(shared, gate, op);
    require_same(shared, other, op);
    SPINDLE_CHECK(shared.rank() == 2 && other.shape() == shared.shape() && gate.numel() == shared.dim(0),
                  "{}: shared {} gate {} (one logit per token) and {}", op, shared.describe(), gate.describe(),
                  other.describe());
    return shared.dim(1);
  }

  // The delta rule's shapes as delta_rule_shape checks them, and N runs from the F32 states
  // [N, Hv, dk, dv] (the kernels check on the device that run_ids holds that many).
  cuda::DeltaStatesShape delta_states_shape(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                            const Tensor& beta, const Tensor& run_ids, int64_t chunk_size,
                                            const Tensor& initial_states, const char* op) const {
    const cuda::DeltaRuleShape rule = delta_rule_shape(q, k, v, g, beta, run_ids, chunk_size, op);
    const int64_t state = static_cast<int64_t>(rule.value_heads) * rule.dk * rule.dv;
    require_device(initial_states, op);
    if (initial_states.dtype() != DType::F32)
      fail("{}: states are F32 on the CUDA backend, got {}", op, initial_states.describe());
    SPINDLE_CHECK(state > 0 && initial_states.numel() % state == 0 &&
                      (rule.tokens == 0) == (initial_states.numel() == 0),
                  "{}: initial_states {} are not [runs, {}, {}, {}] for {} tokens", op, initial_states.describe(),
                  rule.value_heads, rule.dk, rule.dv, rule.tokens);
    return {rule.tokens, rule.key_heads, rule.value_heads, rule.dk, rule.dv, initial_states.numel() / state};
  }

  // The delta rule's shapes (backend.h): q, k [T, Hk, dk], v [T, Hv, dv], beta [T, Hv] of one compute
  // dtype, g F32 [T, Hv], doc_ids I32 [T]. Chunks longer than the kernels' 64 tokens run as 64:
  // the result does not depend on the chunk size beyond rounding.
  cuda::DeltaRuleShape delta_rule_shape(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& beta, const Tensor& doc_ids, int64_t chunk_size,
                                        const char* what) const {
    require_compute(q, what);
    for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v, &beta}) require_same(q, *t, what);
    require_i32(doc_ids, what);
    SPINDLE_CHECK(q.rank() == 3 && k.shape() == q.shape() && v.rank() == 3 && v.dim(0) == q.dim(0),
                  "{}: q {} k {} v {}", what, q.describe(), k.describe(), v.describe());
    SPINDLE_CHECK(q.dim(1) > 0 && v.dim(1) % q.dim(1) == 0, "{}: {} value heads are not a multiple of {} key heads",
                  what, v.dim(1), q.dim(1));
    if (q.dim(2) > cuda::kDeltaRuleMaxDim || v.dim(2) > cuda::kDeltaRuleMaxDim)
      fail("{}: key head dim {} and value head dim {} must be at most {} on the CUDA backend", what, q.dim(2),
           v.dim(2), cuda::kDeltaRuleMaxDim);
    SPINDLE_CHECK(chunk_size >= 1, "{}: chunk size {} must be positive", what, chunk_size);
    const int64_t t = q.dim(0), hv = v.dim(1);
    SPINDLE_CHECK(beta.numel() == t * hv && doc_ids.numel() == t, "{}: beta {} doc_ids {} for {} tokens of {} heads",
                  what, beta.describe(), doc_ids.describe(), t, hv);
    require_stat(g, t * hv, what);
    return {t,
            static_cast<int>(q.dim(1)),
            static_cast<int>(hv),
            static_cast<int>(q.dim(2)),
            static_cast<int>(v.dim(2)),
            static_cast<int>(std::min<int64_t>(chunk_size, cuda::kDeltaRuleMaxChunk))};
  }

  cuda::AttentionShape attn_shape(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask) const {
    SPINDLE_CHECK(q.rank() == 3 && k.rank() == 3 && v.rank() == 3, "attention wants [T, heads, D]: {} {} {}",
                  q.describe(), k.describe(), v.describe());
    cuda::AttentionShape sh{q.dim(0), k.dim(0), static_cast<int>(q.dim(1)), static_cast<int>(k.dim(1)),
                            static_cast<int>(q.dim(2))};
    SPINDLE_CHECK(sh.hkv > 0 && sh.hq % sh.hkv == 0, "attention: {} query heads not a multiple of {} kv heads",
                  sh.hq, sh.hkv);
    SPINDLE_CHECK(k.dim(2) == sh.d && v.shape() == k.shape(), "attention: k {} v {} vs q {}", k.describe(),
                  v.describe(), q.describe());
    if (sh.d > 256) fail("attention: head dim {} above 256 is not supported by the CUDA backend", sh.d);
    for (const Tensor* t : {&mask.q_doc, &mask.q_pos, &mask.k_doc, &mask.k_pos}) require_i32(*t, "attention mask");
    SPINDLE_CHECK(mask.q_doc.numel() == sh.tq && mask.q_pos.numel() == sh.tq && mask.k_doc.numel() == sh.tk &&
                      mask.k_pos.numel() == sh.tk,
                  "attention mask lengths do not match q/k");
    return sh;
  }

  static cuda::AttentionMaskPtrs mask_ptrs(const AttentionMask& m, const AttentionLogits& logits) {
    return {m.q_doc.data_as<int32_t>(), m.q_pos.data_as<int32_t>(), m.k_doc.data_as<int32_t>(),
            m.k_pos.data_as<int32_t>(), static_cast<int>(logits.window)};
  }

  // The engine's own kernels take any window (backend/attention_rule.h); a soft-capped logit they
  // do not compute, and no family that has one is offered on this backend (model/family.cpp).
  static void require_kernel_logits(const AttentionLogits& logits, const char* op) {
    if (logits.softcap != 0)
      fail("{}: soft-capped attention logits (attn_logit_softcapping) are computed by the CPU backend only; run "
           "with --device cpu",
           op);
    if (logits.window < 0 || logits.window > INT32_MAX) fail("{}: window {} out of range", op, logits.window);
  }

  // The mask case for --attention cudnn, or an error naming why cuDNN cannot take it.
  cuda::CudnnMask cudnn_mask(Stream stream, const cuda::AttentionShape& sh, DType io, DType outs,
                             const AttentionMask& mask, const AttentionLogits& logits, const char* op) {
    if (!logits.plain())
      fail("{}: --attention cudnn takes no sliding window (window {}); choose --attention auto or own", op,
           logits.window);
    // The caller's host-side fact spares reading the mask on the device (a stream synchronisation).
    const cuda::CudnnMask m = mask.plain_causal && sh.tq == sh.tk
                                  ? cuda::CudnnMask::Causal
                                  : cuda::attention_cudnn_classify(s(stream), sh, mask_ptrs(mask, logits));
    std::string why;
    if (!cuda::attention_cudnn_supports(sh, io, outs, m, &why))
      fail("{}: --attention cudnn cannot take q [{}, {}, {}] k [{}, {}, {}]: {} (choose --attention auto or own "
           "for this workload)",
           op, sh.tq, sh.hq, sh.d, sh.tk, sh.hkv, sh.d, why);
    return m;
  }

  // Whether the default choice sends this call to cuDNN: the caller's host-side fact says one plain
  // causal document, the dtypes, head dim and 16-byte alignment suit cuDNN's fused engines, and the
  // shape is worth a plan (worth_a_cudnn_plan).
  bool cudnn_takes(const cuda::AttentionShape& sh, DType io, DType outs, const AttentionMask& mask,
                   const AttentionLogits& logits, std::initializer_list<const Tensor*> tensors) {
    if (!cudnn_for_plain_causal_ || attention_impl_ != cuda::AttentionImpl::Auto || !mask.plain_causal) return false;
    if (!logits.plain()) return false;
    if (cudnn_refused_head_dims_.count(sh.d)) return false;
    if (!cuda::attention_cudnn_supports(sh, io, outs, cuda::CudnnMask::Causal)) return false;
    for (const Tensor* t : tensors)
      if (!aligned16(*t)) return false;
    return worth_a_cudnn_plan(sh, io);
  }

  // cuDNN builds a plan per shape: 90–150 ms for a forward and a backward on an H200, measured
  // (tests/cuda/bench_cuda --attention, docs/perf.md), while it saves ≈ 3.2 ms per layer at 32k
  // tokens of 12 heads. Rows of varying length bring a new shape every step, so a shape gets
  // cuDNN when one step's calls repay the plan — a score count hq·tq·tk at least that of 12 heads
  // at 40k tokens, about the break-even of a 28-layer model — or when it recurs: more calls than
  // a step of a 32-layer model makes (fixed-length rows, where the rest of the run gains).
  // A head dim the engine has no tensor-core kernels for (256: Qwen3.5/3.6) would run the simple
  // FMA kernels, kSimpleKernelSlowdown times slower than its tensor-core kernels by estimate (FMA
  // against tensor-core rates; not measured at 256 yet), so a plan pays for itself on that many
  // times fewer scores.
  static constexpr double kCudnnScoresWorthAPlan = 12.0 * 40000.0 * 40000.0;
  static constexpr double kSimpleKernelSlowdown = 32.0;
  static constexpr int kCudnnCallsWorthAPlan = 64;
  bool worth_a_cudnn_plan(const cuda::AttentionShape& sh, DType io) {
    const double worth = cuda::attention_own_tensor_cores(io, sh.d) ? kCudnnScoresWorthAPlan
                                                                     : kCudnnScoresWorthAPlan / kSimpleKernelSlowdown;
    if (double(sh.hq) * double(sh.tq) * double(sh.tk) >= worth) return true;
    if (calls_per_shape_.size() > 4096) calls_per_shape_.clear();  // bounded under ever-new lengths
    int& calls = calls_per_shape_[{sh.tq, sh.tk, sh.hq, sh.hkv, sh.d}];
    return ++calls > kCudnnCallsWorthAPlan;
  }

  // cuDNN could not take a call it should have (no engine on this GPU or cuDNN version, which
  // depends on the head dim: 256 needs Hopper): say so once and use the engine's own kernels for
  // this head dim from now on.
  void give_up_cudnn(const Error& e, int head_dim) {
    cudnn_refused_head_dims_.insert(head_dim);
    std::fprintf(stderr,
                 "spindle: cuDNN attention unavailable for head dim %d, using the engine's own kernels: %s\n",
                 head_dim, e.what());
  }

  // The tensor-core kernels load 16-byte pieces; unaligned views fall back to the simple kernels.
  cuda::AttentionImpl pick_impl(const cuda::AttentionShape&, DType, std::initializer_list<const Tensor*> loaded) const {
    if (attention_impl_ != cuda::AttentionImpl::Auto) return attention_impl_;
    for (const Tensor* t : loaded)
      if (!aligned16(*t)) return cuda::AttentionImpl::Simple;
    return cuda::AttentionImpl::Auto;
  }

  std::shared_ptr<Context> ctx_;
  // The quantiser's reciprocal table (quant4::rcp_table, U8 [2^20]), uploaded on first use.
  Tensor rcp_table_;
  const uint8_t* rcp_table() {
    if (!rcp_table_.defined()) {
      rcp_table_ = empty(Shape{quant4::kRcpTableBytes}, DType::U8);
      copy_from_host(default_stream(), quant4::rcp_table(), rcp_table_);
      synchronize(default_stream());  // once: then any stream may read it
    }
    return rcp_table_.data_as<uint8_t>();
  }
  // Pinned host memory and the copy stream of activation offload, made on first use (host_memory.h).
  std::shared_ptr<cuda::HostMemory> host_;
  const std::shared_ptr<cuda::HostMemory>& host_memory() {
    if (!host_) host_ = std::make_shared<cuda::HostMemory>(ctx_->device());
    return host_;
  }
  cuda::AttentionImpl attention_impl_ = cuda::AttentionImpl::Auto;
  bool cudnn_for_plain_causal_ = false;
  std::set<int> cudnn_refused_head_dims_;  // give_up_cudnn
  std::map<std::tuple<int64_t, int64_t, int, int, int>, int> calls_per_shape_;  // worth_a_cudnn_plan
};

}  // namespace

std::unique_ptr<Backend> make_cuda_backend(int device_index, const CudaBackendOptions& options) {
  return std::make_unique<CudaBackend>(device_index, options);
}

int cuda_device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // no driver / no device: not an error for the caller
    return 0;
  }
  return count;
}

}  // namespace spindle
