#include "plan/dry_backend.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "backend/cpu/deltanet_conv_ops.h"
#include "backend/cuda/attention_scratch.h"
#include "backend/cuda/deltanet_conv_shape.h"
#include "backend/cuda/gated_delta_scratch.h"
#include "backend/cuda/lora_scratch.h"

namespace spindle::plan {

struct DryBackend::Allocation {
  std::shared_ptr<DryBackend*> backend;  // null inside once the backend is gone
  int64_t bytes = 0;
  std::string phase;
  bool host = false;  // from empty_host
  std::vector<char> contents;  // once a dry op wrote the tensor: its bytes (see host_memory)
};

DryBackend::DryBackend(Device modelled, int64_t alignment, int multiprocessors)
    : device_(modelled),
      alignment_(alignment > 0 ? alignment : 1),
      multiprocessors_(multiprocessors > 0 ? multiprocessors : 1),
      self_(std::make_shared<DryBackend*>(this)) {}

DryBackend::~DryBackend() { *self_ = nullptr; }

void DryBackend::set_phase(const std::string& phase) { phase_ = phase; }

Tensor DryBackend::empty(Shape shape, DType dtype) {
  const int64_t bytes = shape.numel() * static_cast<int64_t>(dtype_size(dtype));
  auto* a = new Allocation{self_, (bytes + alignment_ - 1) / alignment_ * alignment_, phase_, false, {}};
  live_ += a->bytes;
  live_by_phase_[a->phase] += a->bytes;
  if (live_ > peak_) {
    peak_ = live_;
    peak_by_phase_ = live_by_phase_;
    peak_phase_ = phase_;
  }
  auto storage = std::make_shared<Storage>();
  storage->bytes = static_cast<size_t>(bytes);
  storage->device = device_;
  storage->release = &DryBackend::release;
  storage->release_context = a;
  return Tensor(std::move(storage), 0, shape, dtype);
}

Tensor DryBackend::empty_host(Shape shape, DType dtype) {
  const int64_t bytes = shape.numel() * static_cast<int64_t>(dtype_size(dtype));
  // Host allocations pad as the CPU backend's do (64 bytes); pinned pages on CUDA are not modelled.
  auto* a = new Allocation{self_, std::max<int64_t>(64, (bytes + 63) / 64 * 64), phase_, true, {}};
  host_live_ += a->bytes;
  host_peak_ = std::max(host_peak_, host_live_);
  auto storage = std::make_shared<Storage>();
  storage->bytes = static_cast<size_t>(bytes);
  storage->device = Device{DeviceKind::CPU, 0};
  storage->release = &DryBackend::release;
  storage->release_context = a;
  return Tensor(std::move(storage), 0, shape, dtype);
}

void DryBackend::release(void*, void* context) {
  auto* a = static_cast<Allocation*>(context);
  if (DryBackend* b = *a->backend) b->on_release(*a);
  delete a;
}

void DryBackend::on_release(const Allocation& a) {
  if (a.host) {
    host_live_ -= a.bytes;
    return;
  }
  live_ -= a.bytes;
  live_by_phase_[a.phase] -= a.bytes;
}

void* DryBackend::host_memory(const Tensor& t) {
  Storage* storage = t.storage();
  if (!storage || storage->release != &DryBackend::release) return nullptr;  // not a dry tensor
  if (!storage->data) {
    auto* a = static_cast<Allocation*>(storage->release_context);
    a->contents.assign(storage->bytes, 0);
    storage->data = a->contents.data();
  }
  return t.data();
}

void DryBackend::copy_from_host(Stream, const void* src, Tensor& dst) {
  if (dst.bytes()) std::memcpy(host_memory(dst), src, dst.bytes());
}

void DryBackend::copy_to_host(Stream, const Tensor& src, void* dst) {
  if (!src.bytes()) return;
  if (src.storage()->data) std::memcpy(dst, src.data(), src.bytes());
  else std::memset(dst, 0, src.bytes());
}

void DryBackend::copy(Stream, const Tensor& src, Tensor& dst) {
  // Same dtype only: the values followed are integers (ids, positions, offsets), never converted.
  if (!src.bytes() || src.dtype() != dst.dtype() || src.bytes() != dst.bytes()) return;
  if (src.storage()->data) std::memcpy(host_memory(dst), src.data(), src.bytes());
  else if (dst.storage()->data) std::memset(dst.data(), 0, dst.bytes());
}

void DryBackend::fill(Stream, Tensor& t, double value) {
  if (t.dtype() != DType::I32 || !t.numel() || (value == 0 && !t.storage()->data)) return;  // unwritten = zeros
  auto* p = static_cast<int32_t*>(host_memory(t));
  std::fill(p, p + t.numel(), static_cast<int32_t>(value));
}

void DryBackend::moe_permute(Stream, const Tensor& topk_index, int64_t num_experts, Tensor&, Tensor&,
                             Tensor& offsets) {
  // A balanced routing: expert e's rows start at ⌊N·e/E⌋ of the N = T·k routed rows.
  if (offsets.dtype() != DType::I32 || offsets.numel() != num_experts + 1 || num_experts < 1) return;
  auto* first = static_cast<int32_t*>(host_memory(offsets));
  const int64_t rows = topk_index.numel();
  for (int64_t e = 0; e <= num_experts; ++e) first[e] = static_cast<int32_t>(rows * e / num_experts);
}

void DryBackend::scratch(const std::vector<size_t>& bytes) {
  if (device_.kind != DeviceKind::CUDA) return;  // the CPU backend's own buffers are not tensors
  const std::string phase = phase_;
  phase_ = kWorkspacePhase;
  std::vector<Tensor> held;
  for (size_t b : bytes)
    if (b) held.push_back(empty(Shape{static_cast<int64_t>(b)}, DType::U8));
  phase_ = phase;
}

namespace {

cuda::DeltaRuleShape delta_rule_shape(const Tensor& q, const Tensor& v, int64_t chunk_size) {
  // As the CUDA backend builds it (cuda_backend.cpp): the kernels' chunk is at most kDeltaRuleMaxChunk.
  return {q.dim(0),
          static_cast<int>(q.dim(1)),
          static_cast<int>(v.dim(1)),
          static_cast<int>(q.dim(2)),
          static_cast<int>(v.dim(2)),
          static_cast<int>(std::clamp<int64_t>(chunk_size, 1, cuda::kDeltaRuleMaxChunk))};
}

}  // namespace

void DryBackend::attention_backward(Stream, const Tensor& q, const Tensor& k, const Tensor&, const Tensor&,
                                    const Tensor&, const Tensor&, const AttentionMask&, const AttentionLogits&,
                                    Tensor&, Tensor&, Tensor&, bool accumulate) {
  if (q.rank() != 3 || k.rank() != 3) return;  // q [Tq, Hq, D], k [Tk, Hkv, D]
  scratch({cuda::attention_backward_scratch_bound(q.dim(0), k.dim(0), q.dim(1), k.dim(1), q.dim(2),
                                                  q.dtype() == DType::BF16, accumulate)});
}

void DryBackend::lora_b_backward(Stream, const Tensor& dy, const Tensor& b, const Tensor&, double, Tensor&,
                                 Tensor* db) {
  // The CUDA backend's fused kernel (BF16, out features a multiple of 128, rank 16/32/64) keeps dB's
  // F32 partial sums per strip of rows for the call; the two-GEMM path it falls back to keeps nothing.
  if (dy.rank() != 2 || b.rank() != 2 || dy.dtype() != DType::BF16 ||
      !cuda::lora_b_backward_shape_supported(dy.dim(1), b.dim(1)))
    return;
  scratch({cuda::lora_b_backward_scratch_bytes(dy.dim(0), dy.dim(1), b.dim(1), multiprocessors_, db != nullptr)});
}

void DryBackend::gated_delta_rule_forward(Stream, const Tensor& q, const Tensor&, const Tensor& v, const Tensor&,
                                          const Tensor&, const Tensor&, double, int64_t chunk_size, Tensor&) {
  if (q.rank() != 3 || v.rank() != 3 || q.dim(0) == 0) return;
  const cuda::DeltaRuleShape sh = delta_rule_shape(q, v, chunk_size);
  const bool tensor_cores = q.dtype() == DType::BF16 && cuda::delta_rule_tensor_core_shape(sh);
  scratch(tensor_cores ? cuda::delta_rule_mma_scratch(sh).forward() : cuda::delta_rule_scratch(sh).forward());
}

void DryBackend::gated_delta_rule_backward(Stream, const Tensor& q, const Tensor&, const Tensor& v, const Tensor&,
                                           const Tensor&, const Tensor&, double, int64_t chunk_size, const Tensor&,
                                           Tensor&, Tensor&, Tensor&, Tensor&, Tensor&) {
  if (q.rank() != 3 || v.rank() != 3 || q.dim(0) == 0) return;
  const cuda::DeltaRuleShape sh = delta_rule_shape(q, v, chunk_size);
  const bool tensor_cores = q.dtype() == DType::BF16 && cuda::delta_rule_tensor_core_shape(sh);
  scratch(tensor_cores ? cuda::delta_rule_mma_scratch(sh).backward() : cuda::delta_rule_scratch(sh).backward());
}

void DryBackend::deltanet_conv_split_forward(Stream stream, const Tensor& qkv, const Tensor& w,
                                             const Tensor& doc_ids, double eps, Tensor& q, Tensor& k, Tensor& v,
                                             Tensor& q_rstd, Tensor& k_rstd) {
  if (qkv.rank() != 2 || q.rank() != 3 || qkv.dim(1) == 0) return;
  if (device_.kind == DeviceKind::CUDA &&
      cuda::conv_split_fused_shape(qkv.dim(1), w.numel() / qkv.dim(1), q.dim(2)))
    return;
  deltanet_conv_split_forward_by_parts(*this, stream, qkv, w, doc_ids, eps, q, k, v, q_rstd, k_rstd);
}

void DryBackend::deltanet_conv_split_backward(Stream stream, const Tensor& qkv, const Tensor& w,
                                              const Tensor& doc_ids, const Tensor& q, const Tensor& k,
                                              const Tensor& q_rstd, const Tensor& k_rstd, const Tensor& dq,
                                              const Tensor& dk, const Tensor& dv, Tensor& d_qkv, Tensor* dw) {
  if (qkv.rank() != 2 || q.rank() != 3 || qkv.dim(1) == 0) return;
  const int64_t width = w.numel() / qkv.dim(1);
  if (device_.kind == DeviceKind::CUDA && cuda::conv_split_fused_shape(qkv.dim(1), width, q.dim(2))) {
    if (dw && qkv.dim(0) > 0) scratch({cuda::conv_backward_scratch_bytes(qkv.dim(0), qkv.dim(1), width)});
    return;
  }
  deltanet_conv_split_backward_by_parts(*this, stream, qkv, w, doc_ids, q, k, q_rstd, k_rstd, dq, dk, dv, d_qkv, dw);
}

MemoryStats DryBackend::memory_stats() {
  MemoryStats m;
  m.allocated_bytes = m.reserved_bytes = live_;
  m.peak_allocated_bytes = m.peak_reserved_bytes = peak_;
  m.host_allocated_bytes = host_live_;
  m.peak_host_allocated_bytes = host_peak_;
  return m;
}

void DryBackend::reset_peak_memory() {
  peak_ = live_;
  peak_by_phase_ = live_by_phase_;
  peak_phase_ = phase_;
  host_peak_ = host_live_;
}

}  // namespace spindle::plan
