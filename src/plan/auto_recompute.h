// `--recompute auto` (sft, bench, plan): the fastest recompute / keep-attention / per-layer /
// offload setting whose planned peak fits the device, chosen before the first step from the plan
// (plan.h) of each candidate, with the margin docs/memory.md justifies; when none fits, an error
// that names the smallest sequence-parallel mesh or the longest sequence that would.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "plan/plan.h"
#include "plan/step_cost.h"

namespace spindle::plan {

// "85899345920" (bytes), "80GiB", "80G", "512MiB", "512M", "1.5TiB" (binary units); throws naming
// `option` on anything else.
int64_t parse_memory_size(const std::string& text, const std::string& option = "--device-memory");
std::string format_bytes(int64_t bytes);  // "80.00 GiB"

// What the plan's peak may reach on a device of `device_bytes`: on CUDA the device minus what the
// plan does not count (CUDA context, cuBLASLt/cuDNN workspaces, NCCL, the pool's fragmentation);
// on the CPU all of it (the CPU backend's tensors are what the plan counts; docs/memory.md).
int64_t usable_memory(int64_t device_bytes, const std::string& device);

// The device memory of this machine as a plan for `device` sees it: physical memory for "cpu";
// for "cuda", the total of CUDA device `index` when spindle was built with CUDA and one is visible
// (0 otherwise: the caller asks for --device-memory).
int64_t machine_device_memory(const std::string& device, int index);

// The memory this process may use on this machine: physical memory, or less where its control
// group (a container, a SLURM job) caps it; 0 when unknown.
int64_t machine_host_memory();
// The tightest memory cap among the control groups of a process: `cgroup_of_process` is
// /proc/self/cgroup's text, `sysfs` the cgroup file system's mount (/sys/fs/cgroup). Reads cgroup v2
// memory.max and v1 memory/memory.limit_in_bytes of the process's group and of every group above it
// ("max", or v1's near-2^63 "no limit", count as none); 0 when none caps it.
int64_t cgroup_memory_limit(const std::string& sysfs, const std::string& cgroup_of_process);

// The SM count of CUDA device `index` (some kernels size their scratch by it), or that of an H100/H200
// (132) when spindle was built without CUDA or sees no GPU.
constexpr int kDefaultMultiprocessors = 132;
int machine_multiprocessors(int index);

// RecomputeSetting::offload_layers of a search: the fewest first layers whose offload makes the
// device peak fit, found per length (plan_fits).
constexpr int64_t kFewestOffloadLayers = -2;

struct RecomputeSetting {
  std::string recompute = "none";  // none | all | keep-attention
  int64_t recompute_layers = -1;   // first N layers (-1: all)
  bool offload = false;            // --offload activations
  int64_t offload_layers = -1;     // --offload-layers: the first N layers offload (-1: all; kFewestOffloadLayers)
  int64_t mlp_tile_tokens = 0;     // --mlp-tile-tokens (0: untiled)
  int64_t checkpoint_stride = 1;   // --checkpoint-stride (recompute all only)
  std::string describe() const;    // "all, activations of the first 13 layers offloaded to host memory"
};

// The setting that needs least memory on the device and the host together: recompute all, with
// --mlp-tile-tokens auto the MLP in kAutoMlpTileTokens-token tiles (the one given otherwise), and
// offload on the fewest first layers that make the device peak fit (kFewestOffloadLayers): offloading
// more layers moves bytes from the device to the host, so the longest row that fits is where both
// are full.
RecomputeSetting most_frugal_setting(const PlanOptions& base);
// The checkpoint strides --recompute auto and `plan --max-seq --recompute auto` try beyond 1 (every
// layer's input kept), in this order: each holds fewer layer inputs and runs more layers forward
// again (bench/flops.h); past 4 the regenerated inputs a group holds at its top outgrow the saving.
constexpr int64_t kAutoCheckpointStrides[] = {2, 3, 4};

// The plan of `setting` at `seq` (peak of the largest rank and its host memory of offload), and
// whether it fits `usable_bytes` on the device and three quarters of the host's memory. With
// offload_layers == kFewestOffloadLayers the first M >= min_offload_layers layers offload, M the
// fewest whose device peak fits (a bisection: the device peak falls and the host memory grows with
// M), and `setting` receives M (offload off when M is 0, -1 when M is every recomputed layer but
// the last). `plans` counts the plans run.
struct Planned {
  int64_t peak = 0, host = 0;
  StepTime time;  // predicted (step_cost.h), of the slowest rank
};
bool plan_fits(const PlanOptions& base, RecomputeSetting& setting, int64_t seq, int64_t usable_bytes, Planned& planned,
               int& plans, int64_t min_offload_layers = 0);

struct AutoChoice {
  RecomputeSetting setting;
  int64_t peak_bytes = 0;           // the plan's peak per device (largest rank) with that setting
  int64_t host_bytes = 0;           // host memory of offload at its peak (per process)
  int64_t device_bytes = 0, usable_bytes = 0;
  int candidates_planned = 0;
  double predicted_step_s = 0;      // the step time the ranking predicted for the choice
  std::string device_kind;          // whose rates predicted it (DeviceRates::kind)
  std::string summary(int64_t num_layers) const;  // one line for logs
};

// `base` with its recompute, recompute_layers and offload replaced by each candidate, for one length
// `seq`, fastest first by the predicted step time on base.gpu's device (step_cost.h, the rates of
// this machine's GPU when empty); the first whose peak fits usable_memory(device_bytes), and whose
// offloaded host tensors fit three quarters of the machine's physical memory, is returned. The
// times come from a few plans (predict_candidate_times): each layer's forward and backward time
// with nothing, keep-attention and all recomputed, summed per candidate over its layers. A setting
// with offload is the same step plus the part of its copies that cannot hide under the compute they
// run beside (a layer's copy out under the next layer's forward, its copy back under the next
// layer's backward), at the device's measured host copy rate, counted on every offloadable layer
// (the choice may offload fewer); at equal times the setting without offload comes first (it needs
// no host memory). It offloads the fewest first layers that make its device peak fit (plan_fits),
// so the fewest bytes cross the host link and host memory bounds only what it must. `offload_only`:
// the user asked for --offload activations, so only recomputing settings with offload are
// candidates. The SwiGLU MLP tiling is base.mlp_tile_tokens when given; when auto, every untiled
// candidate comes first and the same candidates with kAutoMlpTileTokens-token tiles after them
// (tiles are only needed where nothing untiled fits, and their shorter GEMMs' rate is not measured).
// Recompute all on every layer with sparse checkpoints (kAutoCheckpointStrides) comes last, after
// every setting that keeps each layer's input: it runs layers forward a third time. Throws an Error
// when nothing fits, with the smallest --sp (more processes) and the longest --seq that would.
AutoChoice choose_recompute(const PlanOptions& base, int64_t seq, int64_t device_bytes, bool offload_only = false);

// Every candidate choose_recompute ranks, with its predicted step time (without offload's copies'
// unhidden part for a setting without offload, with it for one with), in the order it tries them.
struct RankedSetting {
  RecomputeSetting setting;
  double seconds = 0;
};
std::vector<RankedSetting> rank_recompute_settings(const PlanOptions& base, int64_t seq, bool offload_only,
                                                   int* plans = nullptr);

// The longest row (a multiple of the mesh's sequence multiple, at most `limit` tokens) whose planned
// peak with `setting` fits `usable_bytes` (and whose offloaded host tensors fit three quarters of
// the machine's memory), found by doubling then bisection (the peak grows with the
// length); 0 when not even one multiple fits. `peak_bytes` receives that length's peak, `host_bytes`
// its host memory of offload and `chosen` the setting it fits with (kFewestOffloadLayers resolved).
int64_t longest_fitting_seq(const PlanOptions& base, const RecomputeSetting& setting, int64_t usable_bytes,
                            int64_t limit, int64_t* peak_bytes = nullptr, int64_t* host_bytes = nullptr,
                            RecomputeSetting* chosen = nullptr);

// The longest row the settings --recompute auto can choose reach: most_frugal_setting keeping every
// layer's input and with each of kAutoCheckpointStrides, the longest of them (at most `limit`
// tokens); `every_input_kept` receives the longest keeping every input. Other outputs as
// longest_fitting_seq's, for the setting that reaches furthest.
int64_t longest_fitting_seq_auto(const PlanOptions& base, int64_t usable_bytes, int64_t limit,
                                 int64_t* peak_bytes = nullptr, int64_t* host_bytes = nullptr,
                                 RecomputeSetting* chosen = nullptr, int64_t* every_input_kept = nullptr);

}  // namespace spindle::plan
