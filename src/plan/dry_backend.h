// A backend that computes nothing and allocates nothing: tensors it hands out have a shape and a
// byte count but no memory, and every op returns at once. `spindle plan` runs the engine's own
// setup and training step on it, so the prediction comes from the same code that allocates a real
// step (weights, LoRA, gradients, FSDP shards and gathers, activation records, recompute scratch,
// logits chunks, attention and communication buffers), not from a second description of it.
//
// Every allocation is counted under the phase current when it was made (set_phase), and the live
// bytes of each phase are saved whenever the total reaches a new peak, so a plan can say what the
// peak consists of and when it happens.
//
// Every Backend op must have an override here that does nothing (an op left to its throwing
// default makes plans of the models that use it fail with that op's name).
//
// Two things go beyond counting tensors:
// - Planning for the CUDA backend, the ops whose CUDA kernels take large device scratch from the
//   same memory pool for the length of a call allocate that scratch here too, under the part
//   kWorkspacePhase: the gated delta rule's, sized by the functions its kernels size it with, and
//   the attention backward's F32 accumulators, as the largest any of its kernels holds.
// - Values the host reads back. A tensor gets host memory when something writes it (copy_from_host,
//   copy and fill of integers, an all-gather of DryCommunicator, moe_permute); reads of tensors never
//   written give zeros. So the batch's document ids and positions reach sequence-parallel code that
//   plans its pieces from them on the host (the DeltaNet state passing), and a mixture-of-experts
//   layer whose experts are not grouped GEMMs (4-bit experts), which reads each expert's first row
//   from moe_permute's offsets, finds a balanced routing there (every expert ⌊N/E⌋ or ⌈N/E⌉ rows)
//   and sizes every expert's work as a real routing would (docs/memory.md).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace spindle::plan {

class DryBackend final : public Backend {
 public:
  // The part of the peak that the modelled backend's per-call scratch takes (CUDA only).
  static constexpr const char* kWorkspacePhase = "backend workspaces";
  // The host memory behind a dry tensor (zeros when first asked for), for ops that write values the
  // host reads back; null for a tensor of another backend.
  static void* host_memory(const Tensor& t);

  // `modelled`: the device the plan is for (its kind decides the dtypes callers choose).
  // `alignment`: allocations round up to this many bytes, as the modelled allocator does.
  // `multiprocessors`: the modelled GPU's SM count (the LoRA B backward's scratch grows with it).
  DryBackend(Device modelled, int64_t alignment, int multiprocessors = 132);
  ~DryBackend() override;

  // Allocations from now on count under `phase` (what they are: "weights", "step", ...).
  void set_phase(const std::string& phase);
  const std::string& phase() const { return phase_; }
  int64_t live_bytes() const { return live_; }
  int64_t peak_bytes() const { return peak_; }
  // Live bytes per phase at the moment the peak was reached (sums to peak_bytes()).
  const std::map<std::string, int64_t>& peak_by_phase() const { return peak_by_phase_; }
  // The phase in which the peak was reached (the one whose allocation reached it).
  const std::string& peak_phase() const { return peak_phase_; }

  std::string name() const override { return "plan"; }
  Device device() const override { return device_; }
  bool computes() const override { return false; }
  Stream default_stream() override { return Stream{}; }
  void synchronize(Stream) override {}
  Stream comm_stream() override { return Stream{}; }
  void stream_wait(Stream, Stream) override {}

  Tensor empty(Shape shape, DType dtype) override;
  void copy_from_host(Stream, const void* src, Tensor& dst) override;
  void copy_to_host(Stream, const Tensor& src, void* dst) override;  // zeros unless something wrote it
  void copy(Stream, const Tensor& src, Tensor& dst) override;        // values of the same dtype
  void fill(Stream, Tensor& t, double value) override;               // I32 values; others nothing
  void fill_random_uniform(Stream, Tensor&, uint64_t, uint64_t, double) override {}
  MemoryStats memory_stats() override;
  void reset_peak_memory() override;
  // Activation offload: host tensors count apart from the device's (no phases: they are all offload).
  Tensor empty_host(Shape shape, DType dtype) override;
  void copy_host_device(Stream, const Tensor&, Tensor&) override {}
  void wait_for_copies(Stream) override {}
  OffloadStats offload_stats() override { return {}; }  // nothing runs, so nothing is timed
  void reset_offload_stats() override {}
  int64_t host_live_bytes() const { return host_live_; }
  int64_t host_peak_bytes() const { return host_peak_; }

  void scale(Stream, Tensor&, double) override {}
  void axpy(Stream, double, const Tensor&, Tensor&) override {}
  void sum_squares(Stream, const Tensor&, Tensor&) override {}
  void gemm(Stream, const Tensor&, bool, const Tensor&, bool, Tensor&, double, double) override {}
  void gemm_bias(Stream, const Tensor&, bool, const Tensor&, bool, Tensor&, double, double, const Tensor&) override {}
  void lora_b_backward(Stream, const Tensor& dy, const Tensor& b, const Tensor&, double, Tensor&, Tensor* db) override;
  void add_bias(Stream, Tensor&, const Tensor&) override {}
  void bias_backward(Stream, const Tensor&, Tensor&) override {}
  void embedding_forward(Stream, const Tensor&, const Tensor&, Tensor&) override {}
  void embedding_backward(Stream, const Tensor&, const Tensor&, Tensor&, int64_t) override {}
  void rmsnorm_forward(Stream, const Tensor&, const Tensor&, double, Tensor&, Tensor&) override {}
  void rmsnorm_backward(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor*,
                        bool) override {}
  void rope(Stream, Tensor&, const Tensor&, const Tensor&, double, int) override {}
  void attention_forward(Stream, const Tensor&, const Tensor&, const Tensor&, const AttentionMask&,
                         const AttentionLogits&, Tensor&, Tensor&) override {}
  // CUDA: the most scratch any backward kernel the backend may pick holds (backend/cuda/attention_scratch.h).
  void attention_backward(Stream, const Tensor& q, const Tensor& k, const Tensor&, const Tensor&, const Tensor&,
                          const Tensor&, const AttentionMask&, const AttentionLogits&, Tensor&, Tensor&, Tensor&,
                          bool accumulate) override;
  void attention_merge(Stream, Tensor&, Tensor&, const Tensor&, const Tensor&) override {}
  void attention_sink_forward(Stream, Tensor&, Tensor&, const Tensor&) override {}
  void attention_sink_backward(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&) override {}
  void swiglu_forward(Stream, const Tensor&, const Tensor&, Tensor&) override {}
  void geglu_tanh_forward(Stream, const Tensor&, const Tensor&, Tensor&) override {}
  void geglu_tanh_backward(Stream, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) override {}
  void softcap_forward(Stream, const Tensor&, double, Tensor&) override {}
  void softcap_backward(Stream, const Tensor&, double, Tensor&) override {}
  void swiglu_backward(Stream, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) override {}
  void gather_rows(Stream, const Tensor&, const Tensor&, Tensor&) override {}
  void scatter_add_rows(Stream, const Tensor&, const Tensor&, Tensor&) override {}
  // Gated DeltaNet and gated attention (qwen3_5).
  void copy_columns(Stream, const Tensor&, int64_t, Tensor&, int64_t, int64_t) override {}
  void rope_partial(Stream, Tensor&, const Tensor&, const Tensor&, int64_t, double, int) override {}
  void sigmoid_gate_forward(Stream, const Tensor&, const Tensor&, Tensor&) override {}
  void sigmoid_gate_backward(Stream, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) override {}
  void causal_conv1d_silu_forward(Stream, const Tensor&, const Tensor&, const Tensor&, Tensor&) override {}
  void causal_conv1d_silu_backward(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&,
                                   Tensor*) override {}
  void l2norm_forward(Stream, const Tensor&, double, Tensor&, Tensor&) override {}
  void l2norm_backward(Stream, const Tensor&, const Tensor&, const Tensor&, Tensor&) override {}
  // The fused conv and split hold nothing but the dw partial sums (backend/cuda/deltanet_conv_shape.h);
  // where the CUDA kernels do not take the shape, and on the CPU, the separate ops run (their buffers).
  void deltanet_conv_split_forward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                   double eps, Tensor& q, Tensor& k, Tensor& v, Tensor& q_rstd,
                                   Tensor& k_rstd) override;
  void deltanet_conv_split_backward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                    const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv, Tensor& d_qkv,
                                    Tensor* dw) override;
  void gated_delta_gates_forward(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&,
                                 Tensor&) override {}
  void gated_delta_gates_backward(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                  const Tensor&, const Tensor&, Tensor&, Tensor&, Tensor*, Tensor*) override {}
  // CUDA: the kernels' F32 scratch (backend/cuda/gated_delta_scratch.h) for the length of the call.
  void gated_delta_rule_forward(Stream, const Tensor& q, const Tensor&, const Tensor& v, const Tensor&, const Tensor&,
                                const Tensor&, double, int64_t chunk_size, Tensor&) override;
  void gated_delta_rule_backward(Stream, const Tensor& q, const Tensor&, const Tensor& v, const Tensor&,
                                 const Tensor&, const Tensor&, double, int64_t chunk_size, const Tensor&, Tensor&,
                                 Tensor&, Tensor&, Tensor&, Tensor&) override;
  void gated_delta_rule_forward_states(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                       const Tensor&, const Tensor&, double, int64_t, const Tensor&, Tensor&,
                                       Tensor&) override {}
  void gated_delta_rule_backward_states(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                                        const Tensor&, const Tensor&, double, int64_t, const Tensor&, const Tensor&,
                                        const Tensor&, Tensor&, Tensor&, Tensor&, Tensor&, Tensor&,
                                        Tensor&) override {}
  void gated_rmsnorm_forward(Stream, const Tensor&, const Tensor&, const Tensor&, double, Tensor&, Tensor&) override {}
  void gated_rmsnorm_backward(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                              Tensor&, Tensor&, Tensor*) override {}
  // A shared expert's sigmoid gate (qwen3_5_moe).
  void shared_expert_gate_forward(Stream, const Tensor&, const Tensor&, Tensor&) override {}
  void shared_expert_gate_backward(Stream, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) override {}
  // Mixture of experts: moe_permute writes a balanced routing's offsets (see above); the rest do nothing.
  void moe_grouped_gemm(Stream, const Tensor&, const std::vector<Tensor>&, bool, const Tensor&, Tensor&,
                        bool) override {}
  void moe_grouped_gemm_weight_grad(Stream, const Tensor&, const Tensor&, const Tensor&,
                                    std::vector<Tensor>&) override {}
  void moe_router_forward(Stream, const Tensor&, int64_t, bool, Tensor&, Tensor&, Tensor&) override {}
  void moe_router_backward(Stream, const Tensor&, const Tensor&, const Tensor&, bool, const Tensor&, const Tensor&,
                           Tensor&) override {}
  void moe_router_statistics(Stream, const Tensor&, const Tensor&, const Tensor&, Tensor&, Tensor&) override {}
  void moe_permute(Stream, const Tensor& topk_index, int64_t num_experts, Tensor& rows_token, Tensor& row_of_slot,
                   Tensor& offsets) override;
  void moe_combine(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&) override {}
  void moe_combine_backward(Stream, const Tensor&, const Tensor&, const Tensor&, const Tensor&, Tensor&,
                            Tensor&) override {}
  void moe_sigmoid_router_forward(Stream, const Tensor&, const Tensor&, const SigmoidRouting&, Tensor&, Tensor&,
                                  Tensor&) override {}
  void moe_sigmoid_router_backward(Stream, const Tensor&, const Tensor&, const Tensor&, const SigmoidRouting&,
                                   Tensor&) override {}
  void clamped_swiglu_forward(Stream, const Tensor&, double, double, Tensor&) override {}
  void clamped_swiglu_backward(Stream, const Tensor&, const Tensor&, double, double, Tensor&) override {}
  // 4-bit base weights (QLoRA).
  void dequantize_4bit(Stream, const Tensor&, const Tensor&, int64_t, Quant4Type, Tensor&) override {}
  void dequantize_absmax(Stream, const Tensor&, const Tensor&, const Tensor&, int64_t, double, Tensor&) override {}
  // Quantising at load: the dense matrix it reads is freed before any step, so it is never live
  // at a step's peak.
  void quantize_4bit(Stream, const Tensor&, int64_t, Quant4Type, Tensor&, Tensor&) override {}
  void quantize_absmax(Stream, const Tensor&, const Tensor&, double, int64_t, Tensor&, Tensor&) override {}
  void cross_entropy(Stream, Tensor&, const Tensor&, const Tensor&, double, double, Tensor&, Tensor&) override {}
  void adamw_step(Stream, Tensor&, const Tensor&, Tensor&, Tensor&, const AdamW&) override {}

 private:
  struct Allocation;
  static void release(void* data, void* context);
  void on_release(const Allocation& a);
  // Allocates scratch of these byte counts under kWorkspacePhase and frees it again (CUDA only).
  void scratch(const std::vector<size_t>& bytes);

  Device device_;
  int64_t alignment_;
  int multiprocessors_;
  std::string phase_ = "setup";
  int64_t live_ = 0, peak_ = 0;
  std::map<std::string, int64_t> live_by_phase_, peak_by_phase_;
  std::string peak_phase_;
  int64_t host_live_ = 0, host_peak_ = 0;
  // Tensors outliving the backend must not call back into it.
  std::shared_ptr<DryBackend*> self_;
};

}  // namespace spindle::plan
