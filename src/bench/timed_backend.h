// A Backend decorator that reports every op, with its category, FLOPs and least bytes moved, to an
// observer: the device timer of `spindle bench`'s time split (OpRecorder), or the plan's step-time
// prediction (plan/step_cost.h), which observes the same ops on a backend that computes nothing. It
// is a separate object wrapped around the real backend only for the steps being observed: code that
// uses the plain backend pays nothing.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "backend/backend.h"
#include "bench/device_timer.h"

namespace spindle::bench {

// Communication: the groups' calls on the compute stream (the step waits for them);
// OverlappedCommunication: calls on another stream (ring exchanges), which run under compute.
enum class OpCategory { Attention, Gemm, Communication, OtherOps, OverlappedCommunication, kCount };
// "attention", "gemm", "communication", "other_ops", "overlapped_communication"
const char* category_name(OpCategory c);

// Time of one kind of op (name, and for GEMMs the shape M×N×K) over the recorded steps.
struct OpTime {
  std::string label;
  OpCategory category = OpCategory::OtherOps;
  int64_t calls = 0;
  double ms = 0;
  double flops = 0;  // matrix products (GEMMs, attention, the delta rule): their FLOPs (op_cost.h); 0 for the others
  double bytes = 0;  // the least bytes the calls move through device memory (op_cost.h)
};

// What TimedBackend reports each op to: begin before the op is enqueued, end after it.
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  // Returns the record's token for end(); records may interleave (comm and compute streams).
  virtual int begin(Stream stream, OpCategory category, const std::string& label, double flops, double bytes) = 0;
  virtual void end(Stream stream, int token) = 0;
  // The (query, key) pairs an attention call computes under `mask` and a sliding window of `window`
  // keys (0: none; backend/attention_rule.h), for its FLOPs: the plain causal count for a plain
  // causal mask, else half of all pairs, at most `window` per query (the masks' ids live on the
  // device). An observer that can read the ids (the plan's) counts them exactly.
  virtual double attention_pairs(const AttentionMask& mask, int64_t window, int64_t tq, int64_t tk);
};

// Records [begin, end) device marks per op; totals after the stream has been synchronized.
class OpRecorder final : public OpObserver {
 public:
  explicit OpRecorder(Backend& backend) : timer_(make_device_timer(backend)) {}
  int begin(Stream stream, OpCategory category, const std::string& label, double flops = 0, double bytes = 0) override;
  void end(Stream stream, int token) override { open_[static_cast<size_t>(token)].end = timer_->mark(stream); }
  // Milliseconds per category since the last reset(); call after synchronizing.
  std::array<double, static_cast<size_t>(OpCategory::kCount)> totals_ms();
  // Per label, the most time first; call after synchronizing.
  std::vector<OpTime> op_table();
  int64_t op_count() const { return static_cast<int64_t>(open_.size()); }
  void reset() {
    open_.clear();
    labels_.clear();
    label_index_.clear();
    timer_->clear();
  }

 private:
  struct Record {
    OpCategory category;
    int label;
    double flops, bytes;
    int begin, end;
  };
  std::unique_ptr<DeviceTimer> timer_;
  std::vector<Record> open_;
  std::vector<std::string> labels_;
  std::unordered_map<std::string, int> label_index_;
};

class TimedBackend final : public Backend {
 public:
  TimedBackend(Backend& inner, OpObserver& observer) : inner_(inner), observer_(observer) {}

  std::string name() const override { return inner_.name(); }
  Device device() const override { return inner_.device(); }
  bool computes() const override { return inner_.computes(); }
  Stream default_stream() override { return inner_.default_stream(); }
  void synchronize(Stream stream) override { inner_.synchronize(stream); }
  Stream comm_stream() override { return inner_.comm_stream(); }
  void stream_wait(Stream waiter, Stream signaller) override { inner_.stream_wait(waiter, signaller); }

  Tensor empty(Shape shape, DType dtype) override { return inner_.empty(shape, dtype); }
  void copy_from_host(Stream stream, const void* src, Tensor& dst) override;
  void copy_to_host(Stream stream, const Tensor& src, void* dst) override;
  void copy(Stream stream, const Tensor& src, Tensor& dst) override;
  void fill(Stream stream, Tensor& t, double value) override;
  void fill_random_uniform(Stream s, Tensor& t, uint64_t seed, uint64_t sequence, double half_width) override;
  MemoryStats memory_stats() override { return inner_.memory_stats(); }
  void reset_peak_memory() override { inner_.reset_peak_memory(); }
  // Activation offload's copies run on their own stream beside the ops; they are not timed as ops:
  // the inner backend times them and the waits for them (offload_stats).
  Tensor empty_host(Shape shape, DType dtype) override { return inner_.empty_host(shape, dtype); }
  void copy_host_device(Stream stream, const Tensor& src, Tensor& dst) override {
    inner_.copy_host_device(stream, src, dst);
  }
  Stream copy_stream() override { return inner_.copy_stream(); }
  void wait_for_copies(Stream waiter) override { inner_.wait_for_copies(waiter); }
  OffloadStats offload_stats() override { return inner_.offload_stats(); }
  void reset_offload_stats() override { inner_.reset_offload_stats(); }

  void scale(Stream stream, Tensor& x, double alpha) override;
  void axpy(Stream stream, double alpha, const Tensor& x, Tensor& y) override;
  void sum_squares(Stream stream, const Tensor& x, Tensor& out) override;
  void gemm(Stream stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
            double beta) override;
  void gemm_bias(Stream stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
                 double beta, const Tensor& bias) override;
  void lora_b_backward(Stream stream, const Tensor& dy, const Tensor& b, const Tensor& xa, double scaling, Tensor& dxa,
                       Tensor* db) override;
  void add_bias(Stream stream, Tensor& y, const Tensor& bias) override;
  void bias_backward(Stream stream, const Tensor& dy, Tensor& dbias) override;
  void embedding_forward(Stream stream, const Tensor& ids, const Tensor& table, Tensor& out) override;
  void embedding_backward(Stream stream, const Tensor& ids, const Tensor& dout, Tensor& dtable,
                          int64_t padding_id) override;
  void rmsnorm_forward(Stream stream, const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) override;
  void rmsnorm_backward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                        Tensor& dx, Tensor* dw, bool accumulate_dx) override;
  void rope(Stream stream, Tensor& x, const Tensor& positions, const Tensor& inv_freq, double attention_scale,
            int sign) override;
  void attention_forward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                         const AttentionLogits& logits, Tensor& out, Tensor& lse) override;
  void attention_backward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& dout, const Tensor& lse, const AttentionMask& mask,
                          const AttentionLogits& logits, Tensor& dq, Tensor& dk, Tensor& dv, bool accumulate) override;
  void attention_merge(Stream stream, Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b) override;
  void attention_sink_forward(Stream stream, Tensor& out, Tensor& lse, const Tensor& sinks) override;
  void attention_sink_backward(Stream stream, const Tensor& out, const Tensor& dout, const Tensor& lse,
                               const Tensor& sinks, Tensor& dsinks) override;
  void swiglu_forward(Stream stream, const Tensor& gate, const Tensor& up, Tensor& out) override;
  void geglu_tanh_forward(Stream stream, const Tensor& gate, const Tensor& up, Tensor& out) override;
  void geglu_tanh_backward(Stream stream, const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                           Tensor& dup) override;
  void softcap_forward(Stream stream, const Tensor& x, double cap, Tensor& y) override;
  void softcap_backward(Stream stream, const Tensor& y, double cap, Tensor& d) override;
  void swiglu_backward(Stream stream, const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                       Tensor& dup) override;
  void gather_rows(Stream stream, const Tensor& src, const Tensor& idx, Tensor& dst) override;
  void scatter_add_rows(Stream stream, const Tensor& src, const Tensor& idx, Tensor& dst) override;
  // 4-bit base weights: dequantised before every use, counted with the other ops (label dequantize_4bit).
  void dequantize_4bit(Stream s, const Tensor& packed, const Tensor& absmax, int64_t blocksize, Quant4Type type,
                       Tensor& w) override;
  void dequantize_absmax(Stream s, const Tensor& codes, const Tensor& code_map, const Tensor& absmax2,
                         int64_t blocksize2, double offset, Tensor& absmax) override;
  // Quantising at load (no step runs them; forwarded for completeness, labelled by name).
  void quantize_4bit(Stream s, const Tensor& w, int64_t blocksize, Quant4Type type, Tensor& packed,
                     Tensor& absmax) override;
  void quantize_absmax(Stream s, const Tensor& absmax, const Tensor& code_map, double offset, int64_t blocksize2,
                       Tensor& codes, Tensor& absmax2) override;
  // Mixture of experts: the grouped expert GEMMs count as GEMMs (label "moe_grouped_gemm …"), the
  // router, permutation and combine with the other ops under their own names.
  void moe_router_forward(Stream s, const Tensor& logits, int64_t top_k, bool normalize, Tensor& probs,
                          Tensor& topk_index, Tensor& topk_weight) override;
  void moe_router_backward(Stream s, const Tensor& probs, const Tensor& topk_index, const Tensor& d_topk_weight,
                           bool normalize, const Tensor& aux_grad, const Tensor& token_doc, Tensor& dlogits) override;
  void moe_router_statistics(Stream s, const Tensor& probs, const Tensor& topk_index, const Tensor& token_doc,
                             Tensor& counts, Tensor& prob_sums) override;
  void moe_sigmoid_router_forward(Stream s, const Tensor& logits, const Tensor& correction_bias,
                                  const SigmoidRouting& routing, Tensor& scores, Tensor& topk_index,
                                  Tensor& topk_weight) override;
  void moe_sigmoid_router_backward(Stream s, const Tensor& scores, const Tensor& topk_index, const Tensor& d_topk_weight,
                                   const SigmoidRouting& routing, Tensor& dlogits) override;
  void moe_permute(Stream s, const Tensor& topk_index, int64_t num_experts, Tensor& rows_token, Tensor& row_of_slot,
                   Tensor& offsets) override;
  void moe_grouped_gemm(Stream s, const Tensor& x, const std::vector<Tensor>& weights, bool transpose_weight,
                        const Tensor& offsets, Tensor& y, bool accumulate) override;
  void moe_grouped_gemm_weight_grad(Stream s, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                    std::vector<Tensor>& weight_grads) override;
  void moe_combine(Stream s, const Tensor& y, const Tensor& row_of_slot, const Tensor& topk_index,
                   const Tensor& topk_weight, Tensor& out) override;
  void moe_combine_backward(Stream s, const Tensor& dout, const Tensor& y, const Tensor& row_of_slot,
                            const Tensor& topk_weight, Tensor& dy, Tensor& d_topk_weight) override;
  void clamped_swiglu_forward(Stream stream, const Tensor& gate_up, double alpha, double limit, Tensor& out) override;
  void clamped_swiglu_backward(Stream stream, const Tensor& gate_up, const Tensor& dout, double alpha, double limit,
                               Tensor& d_gate_up) override;
  // Gated attention, gated DeltaNet and the shared expert's gate: the delta rule (the DeltaNet layers'
  // sequence mixer) counts as attention, the rest with the other ops under their own names.
  void copy_columns(Stream stream, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col,
                    int64_t width) override;
  void rope_partial(Stream stream, Tensor& x, const Tensor& positions, const Tensor& inv_freq, int64_t rotary_dim,
                    double attention_scale, int sign) override;
  void sigmoid_gate_forward(Stream stream, const Tensor& x, const Tensor& gate, Tensor& out) override;
  void sigmoid_gate_backward(Stream stream, const Tensor& x, const Tensor& gate, const Tensor& dout, Tensor& dx,
                             Tensor& dgate) override;
  void causal_conv1d_silu_forward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids,
                                  Tensor& y) override;
  void causal_conv1d_silu_backward(Stream stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids,
                                   const Tensor& dy, Tensor& dx, Tensor* dw) override;
  void l2norm_forward(Stream stream, const Tensor& x, double eps, Tensor& y, Tensor& rstd) override;
  void l2norm_backward(Stream stream, const Tensor& y, const Tensor& rstd, const Tensor& dy, Tensor& dx) override;
  void deltanet_conv_split_forward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                   double eps, Tensor& q, Tensor& k, Tensor& v, Tensor& q_rstd,
                                   Tensor& k_rstd) override;
  void deltanet_conv_split_backward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                    const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv, Tensor& d_qkv,
                                    Tensor* dw) override;
  void gated_delta_gates_forward(Stream stream, const Tensor& a, const Tensor& b, const Tensor& a_log,
                                 const Tensor& dt_bias, Tensor& g, Tensor& beta) override;
  void gated_delta_gates_backward(Stream stream, const Tensor& a, const Tensor& beta, const Tensor& a_log,
                                  const Tensor& dt_bias, const Tensor& g, const Tensor& dg, const Tensor& dbeta,
                                  Tensor& da, Tensor& db, Tensor* da_log, Tensor* ddt_bias) override;
  void gated_delta_rule_forward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& doc_ids, double scale, int64_t chunk_size,
                                Tensor& out) override;
  void gated_delta_rule_backward(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                 const Tensor& beta, const Tensor& doc_ids, double scale, int64_t chunk_size,
                                 const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dg,
                                 Tensor& dbeta) override;
  void gated_delta_rule_forward_states(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                       const Tensor& g, const Tensor& beta, const Tensor& run_ids, double scale,
                                       int64_t chunk_size, const Tensor& initial_states, Tensor& out,
                                       Tensor& final_states) override;
  void gated_delta_rule_backward_states(Stream stream, const Tensor& q, const Tensor& k, const Tensor& v,
                                        const Tensor& g, const Tensor& beta, const Tensor& run_ids, double scale,
                                        int64_t chunk_size, const Tensor& initial_states, const Tensor& dout,
                                        const Tensor& d_final_states, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dg,
                                        Tensor& dbeta, Tensor& d_initial_states) override;
  void gated_rmsnorm_forward(Stream stream, const Tensor& x, const Tensor& z, const Tensor& w, double eps, Tensor& y,
                             Tensor& rstd) override;
  void gated_rmsnorm_backward(Stream stream, const Tensor& x, const Tensor& z, const Tensor& w, const Tensor& rstd,
                              const Tensor& dy, Tensor& dx, Tensor& dz, Tensor* dw) override;
  void shared_expert_gate_forward(Stream stream, const Tensor& shared, const Tensor& gate, Tensor& out) override;
  void shared_expert_gate_backward(Stream stream, const Tensor& shared, const Tensor& gate, const Tensor& dout,
                                   Tensor& d_shared, Tensor& d_gate) override;
  void cross_entropy(Stream stream, Tensor& logits, const Tensor& targets, const Tensor& weights, double loss_scale,
                     double grad_scale, Tensor& loss_sum, Tensor& token_ce) override;
  void adamw_step(Stream stream, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& hp) override;

 private:
  template <typename Op>
  void timed(Stream stream, OpCategory category, const std::string& label, double flops, double bytes, Op&& op) {
    const int token = observer_.begin(stream, category, label, flops, bytes);
    op();
    observer_.end(stream, token);
  }

  // An attention call's FLOPs (QKᵀ and PV over the pairs the observer counts).
  double attention_flops(const Tensor& q, const Tensor& k, const AttentionMask& mask, const AttentionLogits& logits);

  Backend& inner_;
  OpObserver& observer_;
};

}  // namespace spindle::bench
