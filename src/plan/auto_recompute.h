// `--recompute auto` (sft, bench, plan): the fastest recompute / keep-attention / per-layer /
// offload setting whose planned peak fits the device, chosen before the first step from the plan
// (plan.h) of each candidate, with the margin docs/memory.md justifies; when none fits, an error
// that names the smallest sequence-parallel mesh or the longest sequence that would.
#pragma once

#include <cstdint>
#include <string>

#include "plan/plan.h"

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

struct RecomputeSetting {
  std::string recompute = "none";  // none | all | keep-attention
  int64_t recompute_layers = -1;   // first N layers (-1: all)
  bool offload = false;            // --offload activations
  int64_t mlp_tile_tokens = 0;     // --mlp-tile-tokens (0: untiled)
  std::string describe() const;    // "keep-attention on the first 12 of 28 layers, offloaded"
};

// The setting that needs least device memory: recompute all with offload, and with --mlp-tile-tokens
// auto the MLP in kAutoMlpTileTokens-token tiles (the one given otherwise).
RecomputeSetting most_frugal_setting(const PlanOptions& base);

struct AutoChoice {
  RecomputeSetting setting;
  int64_t peak_bytes = 0;           // the plan's peak per device (largest rank) with that setting
  int64_t host_bytes = 0;           // host memory of offload at its peak (per process)
  int64_t device_bytes = 0, usable_bytes = 0;
  int candidates_planned = 0;
  std::string summary(int64_t num_layers) const;  // one line for logs
};

// `base` with its recompute, recompute_layers and offload replaced by each candidate, for one length
// `seq`, fastest first (fewest executed FLOPs: the step's forward, backward and each candidate's
// recompute, bench/flops.h), every setting without offload before those with it; the first whose
// peak fits usable_memory(device_bytes), and whose offloaded host tensors fit three quarters of the
// machine's physical memory, is returned. `offload_only`: the user asked for
// --offload activations, so only recomputing settings with offload are candidates. The SwiGLU MLP
// tiling is base.mlp_tile_tokens when given; when auto, every untiled candidate comes first and the
// same candidates with kAutoMlpTileTokens-token tiles after them (tiling costs two projections more
// per token where a layer is kept, and is only needed where nothing untiled fits). Throws an Error
// when nothing fits, with the smallest --sp (more processes) and the longest --seq that would.
AutoChoice choose_recompute(const PlanOptions& base, int64_t seq, int64_t device_bytes, bool offload_only = false);

// The longest row (a multiple of the mesh's sequence multiple, at most `limit` tokens) whose planned
// peak with `setting` fits `usable_bytes` (and whose offloaded host tensors fit three quarters of
// the machine's memory), found by doubling then bisection (the peak grows with the
// length); 0 when not even one multiple fits. `peak_bytes` receives that length's peak.
int64_t longest_fitting_seq(const PlanOptions& base, const RecomputeSetting& setting, int64_t usable_bytes,
                            int64_t limit, int64_t* peak_bytes = nullptr);

}  // namespace spindle::plan
