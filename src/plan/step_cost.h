// The predicted time of a training step on a kind of device: every op the plan's dry step runs
// (plan.h), observed through bench::TimedBackend with its FLOPs and the least bytes it moves, costs
// max(FLOPs / the rate of its kind of op, bytes / the device's bandwidth for such ops) plus a fixed
// time per op, at rates measured inside training steps on that kind of device (docs/perf.md,
// "--recompute auto on the H100 and the H200"). `--recompute auto` ranks its candidates by this
// time (auto_recompute.h).
//
// What it leaves out: communication (collectives and their overlap) and the pool's allocation
// waits; the copies of activation offload are costed by auto_recompute.cpp against the compute they
// run beside.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <tuple>
#include <vector>

#include "bench/timed_backend.h"

namespace spindle::plan {

// Rates of one kind of device inside a training step (under its power cap, on the shapes a step
// runs), as docs/perf.md measured them.
struct DeviceRates {
  std::string kind;                         // "h100", "h200", "cpu", or "estimated: <device name>"
  double gemm_flops = 0;                    // BF16 matrix products (cuBLASLt), FLOP/s
  double attention_forward_flops = 0;       // causal attention, 4·D·Hq FLOPs per visible pair
  double attention_backward_flops = 0;      // 2.5 times the forward's FLOPs
  double grouped_gemm_flops = 0;            // mixture-of-experts grouped GEMMs
  double delta_rule_flops = 0;              // the gated delta rule, its nominal count (bench/timed_backend.cpp)
  double memory_bytes_per_s = 0;            // bytes/s of memory-bound ops (norms, RoPE, SwiGLU, LoRA's thin products)
  double op_seconds = 0;                    // fixed time per op: launch gaps, a kernel's ramp and tail
  double host_copy_bytes_per_s = 0;         // activation offload's copies between host and device
  // Whether those copies run beside the compute (a GPU's copy engine) or add to it (the CPU backend's
  // copies take the cores that compute).
  bool copies_beside_compute = true;
};

// The kinds with measured rows, for messages and --gpu.
std::vector<std::string> known_device_kinds();
// The row of a kind ("h100", "h200", "cpu"); throws naming the known kinds for any other.
DeviceRates device_rates(const std::string& kind);
// "h100" or "h200" for the CUDA device names of those kinds ("NVIDIA H100 80GB HBM3", "NVIDIA
// H200"); "" for any other device (an H100 PCIe or NVL runs at other clocks and power).
std::string device_kind_of(const std::string& device_name);

// What estimated_rates reads off a GPU it has no row for.
struct GpuProperties {
  std::string name;
  int compute_capability = 0;   // major·10 + minor
  int multiprocessors = 0;
  double clock_hz = 0;          // peak SM clock
  double memory_bytes_per_s = 0;  // peak: 2 · memory clock · bus width
};
// Rates for a GPU without a row: the H100 row's rates scaled by the GPU's peak dense BF16 rate
// (multiprocessors · clock · the architecture's FLOPs per clock and multiprocessor) and peak memory
// bandwidth against the H100's, so the ranking sees its balance of compute and bandwidth.
DeviceRates estimated_rates(const GpuProperties& gpu);

// The rates auto ranks with on this machine: `kind` when given (--gpu); else for "cpu" the CPU row;
// for "cuda" the row of CUDA device `index` when its kind is known, estimated from its properties
// when it is not, and the H100 row when spindle sees no GPU (a plan made away from the GPU).
DeviceRates planning_rates(const std::string& device, const std::string& kind, int index);

// Predicted seconds of a step, by kind of work and by where in the step.
struct StepTime {
  double gemm_s = 0, attention_s = 0, memory_s = 0, overhead_s = 0;
  int64_t ops = 0;
  // Per layer: its forward window, and its backward window (a recomputed layer's second forward
  // included); what runs outside the layers' windows (embedding, LM head and loss) apart.
  std::vector<double> layer_forward_s, layer_backward_s;
  double outside_layers_s = 0;
  double total_s() const { return gemm_s + attention_s + memory_s + overhead_s; }
};

// Observes a step's ops (bench::TimedBackend around the plan's DryBackend) and sums their predicted
// times, each to the decoder unit whose window it runs in (set_unit, from the plan's parameter hooks).
class StepCostModel final : public bench::OpObserver {
 public:
  StepCostModel(const DeviceRates& rates, int64_t num_layers);
  // Ops from now on run in layer `layer`'s forward or backward window (-1: outside the layers).
  void set_unit(int64_t layer, bool backward);
  int begin(Stream stream, bench::OpCategory category, const std::string& label, double flops, double bytes) override;
  void end(Stream, int) override {}
  // Reads the mask's document ids and positions where the plan wrote them (the batch's), so packed
  // rows and ring blocks count the pairs they compute.
  double attention_pairs(const AttentionMask& mask, int64_t window, int64_t tq, int64_t tk) override;
  const StepTime& time() const { return time_; }
  // The predicted seconds of one op (exposed for tests).
  double op_seconds(bench::OpCategory category, const std::string& label, double flops, double bytes) const;

 private:
  DeviceRates rates_;
  StepTime time_;
  int64_t layer_ = -1;
  bool backward_ = false;
  std::map<std::tuple<const void*, const void*, const void*, const void*, int64_t, int64_t, int64_t>, double> pairs_;
};

}  // namespace spindle::plan
