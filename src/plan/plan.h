// `spindle plan`: what a training step will hold in memory, per rank, before anything is allocated.
// The engine's own setup and step run on a DryBackend (plan/dry_backend.h) for each rank of the
// mesh, over DryCommunicator groups, so the prediction follows every model family, mesh, recompute
// mode and buffer the engine has, with no second description of them to fall out of step.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "model/config.h"
#include "model/recompute.h"
#include "plan/step_cost.h"
#include "train/run_assembly.h"

namespace spindle::plan {

struct PlanOptions {
  std::string model;                 // config.json or a model folder (only the architecture is read)
  std::vector<int64_t> seq_lengths;  // tokens per row (one row per data-parallel replica and step)
  int64_t doc_length = 0;            // packed documents of this length; 0: one document per row
  int64_t lora_rank = 16;            // 0 with full
  double lora_alpha = 32;
  std::vector<std::string> lora_targets;  // as bench's --lora-targets; empty: every projection the family has
  bool lora_targets_if_present = false;   // only those of lora_targets the model has (sft's default list)
  bool full = false;
  std::string quantize;              // nf4 | fp4: 4-bit base projections, as sft/bench --quantize; empty: dense
  bool double_quant = false;
  int64_t quant_block_size = 64;
  std::string recompute = "all";     // none | all | keep-attention
  int64_t recompute_layers = -1;
  bool offload = false;              // --offload activations: recomputed layers' kept tensors in host memory
  int64_t offload_layers = -1;       // --offload-layers: the first N layers offload (-1: every recomputed one but the last)
  int64_t mlp_tile_tokens = kMlpTileAuto;  // --mlp-tile-tokens: rows per SwiGLU MLP tile, 0 untiled (auto: untiled
                                           // here; choose_recompute tries tiles when nothing untiled fits)
  int64_t checkpoint_stride = 1;     // --checkpoint-stride: every Nth recomputed layer keeps its input (recompute all)
  bool optimizer = true;             // AdamW state (sft holds it; `spindle bench`'s step does not)
  // dpo's step (train/preference_step.h): every micro-batch of an optimizer step is laid out before
  // the first forward (`rows_held` of them, its --grad-accum), and the backward runs on a copy of
  // each with per-token weights of its own; `reference_model` (a folder or config.json; empty: none)
  // is a frozen reference held beside the policy, FSDP-sharded like it (--ref-model).
  bool preference = false;
  int64_t rows_held = 1;
  std::string reference_model;
  // MoE models: the router load-balancing loss, as sft's --router-aux-loss-coef (-1: the config's rule;
  // model/router_aux_loss.h): its statistics and gradient vector are planned when it is on.
  double router_aux_loss_coef = -1;
  std::string device = "cuda";       // the device planned for: cuda (BF16) or cpu (F32)
  std::string dtype = "auto";        // auto | f32 | f64 | bf16
  int world = 1;                     // processes (GPUs) of the job
  int sp = 0, ulysses = 0, ring = 0, dp = 0;  // 0: as resolve_mesh chooses
  double device_memory_gib = 0;      // > 0: say whether the peak fits this much per device
  int64_t host_memory_bytes = 0;     // the host's memory for offload's limit (auto_recompute.h); 0: this machine's
  // The kind of device whose rates predict the step's time (step_cost.h: h100, h200, cpu); empty:
  // this machine's GPU (cuda) or CPU (cpu).
  std::string gpu;
  std::optional<DeviceRates> rates;  // rates given directly (tests, rates measured elsewhere): override `gpu`
};

// One part of a rank's peak: the bytes, allocated in one phase, still live at the peak.
struct PlanPart {
  std::string name;
  int64_t bytes = 0;
};

struct RankPlan {
  int rank = 0;
  int64_t tokens = 0;                  // tokens this rank computes per step (its shard of the row)
  int64_t peak_allocated_bytes = 0;    // comparable to `spindle bench --json`'s field of that name
  std::string peak_phase;              // the phase in which the peak is reached
  std::vector<PlanPart> parts;         // what is live at the peak, by the phase that allocated it
  int64_t steady_bytes = 0;            // live between steps (weights, shards, gradients, optimizer)
  int64_t host_peak_bytes = 0;         // host memory of activation offload at its peak (0 without)
  StepTime time;                       // the step's predicted time on PlanReport::rates' device
};

struct LengthPlan {
  int64_t seq = 0;
  std::vector<RankPlan> ranks;         // every rank of the mesh
  const RankPlan& largest() const;     // the rank with the highest peak
  const RankPlan& slowest() const;     // the rank with the longest predicted step (the step waits for it)
};

struct PlanReport {
  PlanOptions options;
  ModelConfig config;
  int world = 1, dp = 1, sp = 1, ulysses = 1, ring = 1;
  std::string dtype;
  double router_aux_loss_coef = 0;   // the coefficient the step runs with (0: off)
  DeviceRates rates;                 // what the predicted step times were computed with
  std::vector<LengthPlan> lengths;
};

PlanReport run_plan(const PlanOptions& options);
// What a plan of `options` builds on the dry backend (train/run_assembly.h): shapes only, the
// adapters and 4-bit projections as given, FSDP over the world, AdamW state with `optimizer`, the
// router loss with coefficient `router_aux_loss` (0: off).
RunDescription describe_planned_run(const PlanOptions& options, const ModelConfig& config, DType dtype,
                                    double router_aux_loss);
// The rates a plan of `options` predicts step times with: options.rates, else planning_rates for
// options.device and options.gpu (asked of the GPU once per process).
DeviceRates plan_rates(const PlanOptions& options);
std::string format_plan(const PlanReport& report);
nlohmann::ordered_json plan_json(const PlanReport& report);

}  // namespace spindle::plan
