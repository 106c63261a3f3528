#include "plan/step_cost.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>

#include "core/error.h"
#include "plan/dry_backend.h"

#ifdef SPINDLE_WITH_CUDA
#include <cuda_runtime.h>
#endif

namespace spindle::plan {

namespace {

// Rates inside training steps (under the 700 W cap), read off `spindle bench --profile-steps 1
// --op-table` (its TFLOP/s and GB/s columns, bench/timed_backend.cpp) and the time splits of
// docs/perf.md: on the H100, Qwen2.5-1.5B LoRA r16 at 32k (GEMMs with every dimension above 64:
// 727–737 TFLOP/s; cuDNN attention forward 567–578, backward 516–532; the memory-bound ops and
// LoRA's thin products together 2.4 TB/s; about 4 us per op of launch gaps and tails); on the
// H200, the attention of the 64k step (577 and 521 TFLOP/s) and the same GEMM rate (the same
// tensor cores and clocks), its memory-bound rate scaled from the H100's by the two GPUs' memory
// bandwidth (4.8 against 3.35 TB/s). The grouped-GEMM and delta-rule rates are the H200 kernels'
// of docs/perf.md. Host copies: 54–55 GB/s measured on the H200 (PCIe 5 on both). With these, the
// model predicted 26 H100 steps of the 1.5B and 7B at 16k–64k within −2.1 … +2.9 % and the
// H200's 1.5B 64k step (3.19–3.27 s) at 3.25 s (docs/perf.md, "--recompute auto on the H100 and
// the H200").
DeviceRates h200_rates() {
  DeviceRates r;
  r.kind = "h200";
  r.gemm_flops = 730e12;
  r.attention_forward_flops = 577e12;
  r.attention_backward_flops = 521e12;
  r.grouped_gemm_flops = 400e12;
  r.delta_rule_flops = 20e12;
  r.memory_bytes_per_s = 3.45e12;
  r.op_seconds = 4e-6;
  r.host_copy_bytes_per_s = 54e9;
  return r;
}

DeviceRates h100_rates() {
  DeviceRates r;
  r.kind = "h100";
  r.gemm_flops = 730e12;
  r.attention_forward_flops = 570e12;
  r.attention_backward_flops = 525e12;
  r.grouped_gemm_flops = 400e12;
  r.delta_rule_flops = 20e12;
  r.memory_bytes_per_s = 2.4e12;
  r.op_seconds = 4e-6;
  r.host_copy_bytes_per_s = 54e9;
  return r;
}

// The CPU backend (F32, OpenBLAS and threaded loops): only its balance matters for a ranking there.
DeviceRates cpu_rates() {
  DeviceRates r;
  r.kind = "cpu";
  r.gemm_flops = r.grouped_gemm_flops = 200e9;
  r.attention_forward_flops = r.attention_backward_flops = 50e9;
  r.delta_rule_flops = 20e9;
  r.memory_bytes_per_s = 10e9;
  r.op_seconds = 5e-6;
  r.host_copy_bytes_per_s = 10e9;
  r.copies_beside_compute = false;
  return r;
}

// Peak dense BF16 FLOPs per clock and multiprocessor (F32 accumulation) by compute capability:
// A100 2048, the Ada and consumer parts 512, Hopper 4096, Blackwell data-centre 8192.
double bf16_flops_per_clock(int compute_capability) {
  if (compute_capability >= 100 && compute_capability < 110) return 8192;
  if (compute_capability == 90) return 4096;
  if (compute_capability == 80) return 2048;
  return 512;
}

// The H100 SXM's peak figures, which its measured row is scaled from for other GPUs.
constexpr double kH100PeakFlops = 132 * 1.98e9 * 4096;
constexpr double kH100PeakBandwidth = 3.35e12;

bool is_attention_backward(const std::string& label) { return label == "attention_backward"; }

}  // namespace

std::vector<std::string> known_device_kinds() { return {"h100", "h200", "cpu"}; }

DeviceRates device_rates(const std::string& kind) {
  if (kind == "h100") return h100_rates();
  if (kind == "h200") return h200_rates();
  if (kind == "cpu") return cpu_rates();
  fail("--gpu {}: the step-time model has rates for h100, h200 and cpu", kind);
}

std::string device_kind_of(const std::string& device_name) {
  std::string n = device_name;
  std::transform(n.begin(), n.end(), n.begin(), [](unsigned char c) { return std::tolower(c); });
  if (n.find("h200") != std::string::npos) return "h200";
  // The SXM part (HBM3, 700 W); the PCIe and NVL parts run at lower clocks and power.
  if (n.find("h100") != std::string::npos && n.find("hbm3") != std::string::npos &&
      n.find("pcie") == std::string::npos && n.find("nvl") == std::string::npos)
    return "h100";
  return "";
}

DeviceRates estimated_rates(const GpuProperties& gpu) {
  DeviceRates r = h100_rates();
  const double compute =
      static_cast<double>(gpu.multiprocessors) * gpu.clock_hz * bf16_flops_per_clock(gpu.compute_capability) /
      kH100PeakFlops;
  const double bandwidth = gpu.memory_bytes_per_s / kH100PeakBandwidth;
  if (compute > 0) {
    r.gemm_flops *= compute;
    r.attention_forward_flops *= compute;
    r.attention_backward_flops *= compute;
    r.grouped_gemm_flops *= compute;
    r.delta_rule_flops *= compute;
  }
  if (bandwidth > 0) r.memory_bytes_per_s *= bandwidth;
  r.kind = "estimated: " + gpu.name;
  return r;
}

DeviceRates planning_rates(const std::string& device, const std::string& kind, int index) {
  if (!kind.empty()) return device_rates(kind);
  if (device == "cpu") return cpu_rates();
#ifdef SPINDLE_WITH_CUDA
  int count = 0;
  if (cudaGetDeviceCount(&count) == cudaSuccess && index >= 0 && index < count) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, index) == cudaSuccess) {
      const std::string known = device_kind_of(prop.name);
      if (!known.empty()) return device_rates(known);
      GpuProperties gpu;
      gpu.name = prop.name;
      gpu.compute_capability = prop.major * 10 + prop.minor;
      gpu.multiprocessors = prop.multiProcessorCount;
      int clock_khz = 0, memory_khz = 0, bus_bits = 0;
      cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, index);
      cudaDeviceGetAttribute(&memory_khz, cudaDevAttrMemoryClockRate, index);
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, index);
      gpu.clock_hz = clock_khz * 1e3;
      gpu.memory_bytes_per_s = 2.0 * memory_khz * 1e3 * bus_bits / 8;
      cudaGetLastError();
      return estimated_rates(gpu);
    }
  }
  cudaGetLastError();
#else
  (void)index;
#endif
  return h100_rates();
}

StepCostModel::StepCostModel(const DeviceRates& rates, int64_t num_layers) : rates_(rates) {
  time_.layer_forward_s.assign(static_cast<size_t>(std::max<int64_t>(num_layers, 0)), 0.0);
  time_.layer_backward_s = time_.layer_forward_s;
}

void StepCostModel::set_unit(int64_t layer, bool backward) {
  layer_ = layer >= 0 && layer < static_cast<int64_t>(time_.layer_forward_s.size()) ? layer : -1;
  backward_ = backward;
}

double StepCostModel::op_seconds(bench::OpCategory category, const std::string& label, double flops,
                                 double bytes) const {
  using bench::OpCategory;
  const double memory = bytes / rates_.memory_bytes_per_s;
  double rate = 0;
  if (category == OpCategory::Gemm)
    rate = label.starts_with("moe_grouped_gemm") ? rates_.grouped_gemm_flops : rates_.gemm_flops;
  else if (category == OpCategory::Attention)
    rate = label.starts_with("gated_delta_rule") ? rates_.delta_rule_flops
           : is_attention_backward(label)        ? rates_.attention_backward_flops
                                                 : rates_.attention_forward_flops;
  const double compute = flops > 0 && rate > 0 ? flops / rate : 0;
  return std::max(compute, memory);
}

int StepCostModel::begin(Stream, bench::OpCategory category, const std::string& label, double flops, double bytes) {
  using bench::OpCategory;
  if (category == OpCategory::Communication || category == OpCategory::OverlappedCommunication) return 0;
  const double seconds = op_seconds(category, label, flops, bytes);
  const bool compute_bound = seconds > bytes / rates_.memory_bytes_per_s;
  if (compute_bound && category == OpCategory::Attention) time_.attention_s += seconds;
  else if (compute_bound) time_.gemm_s += seconds;
  else time_.memory_s += seconds;
  time_.overhead_s += rates_.op_seconds;
  ++time_.ops;
  const double charged = seconds + rates_.op_seconds;
  if (layer_ < 0) time_.outside_layers_s += charged;
  else if (backward_) time_.layer_backward_s[static_cast<size_t>(layer_)] += charged;
  else time_.layer_forward_s[static_cast<size_t>(layer_)] += charged;
  return 0;
}

double StepCostModel::attention_pairs(const AttentionMask& mask, int64_t window, int64_t tq, int64_t tk) {
  if (mask.plain_causal) return bench::OpObserver::attention_pairs(mask, window, tq, tk);
  const Tensor* ids[] = {&mask.q_doc, &mask.q_pos, &mask.k_doc, &mask.k_pos};
  for (const Tensor* t : ids)
    if (!t->defined() || t->dtype() != DType::I32 || !t->storage() || !t->storage()->data)
      return bench::OpObserver::attention_pairs(mask, window, tq, tk);  // ids the plan never wrote
  if (mask.q_doc.numel() != tq || mask.k_doc.numel() != tk)
    return bench::OpObserver::attention_pairs(mask, window, tq, tk);
  const auto key =
      std::make_tuple(mask.q_doc.data(), mask.q_pos.data(), mask.k_doc.data(), mask.k_pos.data(), tq, tk, window);
  if (auto it = pairs_.find(key); it != pairs_.end()) return it->second;
  // A query sees the keys of its document at positions up to its own and, with a window, after its
  // position minus the window (backend/attention_rule.h): per document, the keys' positions sorted,
  // each query counts those in its range.
  const auto* q_doc = static_cast<const int32_t*>(mask.q_doc.data());
  const auto* q_pos = static_cast<const int32_t*>(mask.q_pos.data());
  const auto* k_doc = static_cast<const int32_t*>(mask.k_doc.data());
  const auto* k_pos = static_cast<const int32_t*>(mask.k_pos.data());
  std::unordered_map<int32_t, std::vector<int32_t>> keys;
  for (int64_t j = 0; j < tk; ++j) keys[k_doc[j]].push_back(k_pos[j]);
  for (auto& [doc, positions] : keys) std::sort(positions.begin(), positions.end());
  double pairs = 0;
  for (int64_t i = 0; i < tq; ++i) {
    auto it = keys.find(q_doc[i]);
    if (it == keys.end()) continue;
    const std::vector<int32_t>& p = it->second;
    auto last = std::upper_bound(p.begin(), p.end(), q_pos[i]);
    auto first = window > 0 ? std::upper_bound(p.begin(), last, static_cast<int32_t>(q_pos[i] - window)) : p.begin();
    pairs += static_cast<double>(last - first);
  }
  pairs_.emplace(key, pairs);
  return pairs;
}

}  // namespace spindle::plan
