// `spindle bench`: training-step throughput, MFU, peak memory and a time split on synthetic data
// (random weights, random tokens, one causal document per step or a row packed with documents of
// --doc-length tokens, every token supervised but each document's last).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "backend/backend.h"
#include "bench/timed_backend.h"
#include "data/packing.h"
#include "model/config.h"
#include "train/run_assembly.h"

namespace spindle::bench {

struct BenchOptions {
  std::string model;                   // config.json or a model folder (only the architecture is read)
  std::vector<int64_t> seq_lengths;    // one result per length, in order, on the same weights
  int64_t doc_length = 0;              // packed rows of documents this long (the last one shorter); 0: one
  int64_t lora_rank = 16;              // 0 with full = true
  double lora_alpha = 32;
  std::vector<std::string> lora_targets;  // PEFT module names (sft's --lora-targets); empty: every projection
  bool full = false;                   // full fine-tuning instead of LoRA
  std::string quantize;                // nf4 | fp4: 4-bit base projections (docs/qlora.md); empty: dense
  bool double_quant = false;
  int64_t quant_block_size = 64;
  std::string recompute = "all";       // none | all | keep-attention (RecomputeMode)
  int64_t recompute_layers = -1;       // the first N layers recompute; the others keep all (-1: every layer)
  std::string offload = "none";        // none | activations: recomputed layers' kept tensors in host memory
  int64_t offload_layers = -1;         // with offload: the first N layers offload (-1: every recomputed one but the last)
  double router_aux_loss_coef = -1;    // MoE: the router load-balancing loss, as sft's flag (-1: the config's rule)
  std::string mlp_tile_tokens = "auto";  // SwiGLU MLP tiles: N tokens, 0 untiled, auto (model/recompute.h)
  int64_t checkpoint_stride = 1;       // every Nth recomputed layer keeps its input (recompute all; decoder.h)
  // --recompute auto: called before each length runs with the options to fill in (recompute,
  // recompute_layers, offload, mlp_tile_tokens, checkpoint_stride), from `spindle plan`'s choice (plan/auto_recompute.h).
  std::function<void(int64_t seq, BenchOptions& chosen)> choose_recompute;
  // Called once the model is on the device (BenchReport::model_build_s set), before any length runs.
  std::function<void(double model_build_s)> on_model_built;
  int warmup = 2, steps = 3;
  int profile_steps = 1;               // extra steps through the timing decorator (0: no split)
  int op_table_rows = 0;               // the text report lists the profiled step's N most costly ops
  std::string device = "cuda";         // cuda | cpu
  std::string attention = "auto";      // auto | own | cudnn: the CUDA backend's attention (CudaAttention)
  int device_index = 0;
  int cpu_threads = 0;
  double peak_tflops = 0;              // MFU denominator; 0: the device's BF16 dense peak if known
  uint64_t seed = 1234;
  // Mesh when run as several processes (--nproc-per-node / torchrun): each step is one sequence of
  // `seq` tokens per data-parallel replica (dp of them), split over sp ranks (0 = default, see resolve_mesh);
  // parameters sharded over all ranks (FSDP), as `spindle sft` runs.
  int dp = 0, sp = 0, ulysses = 0, ring = 0;
};

struct BenchResult {
  int64_t seq = 0;
  std::string error;                   // set when this length did not run (e.g. out of memory)
  double loss = 0;                     // first step's loss (≈ ln V for random weights)
  std::vector<double> step_ms;         // each timed step
  double tokens_per_s = 0;
  double model_tflops = 0, executed_tflops = 0, mfu = 0;
  double model_flops = 0, executed_flops = 0;
  MemoryStats memory;                  // after the timed steps; peaks since the first timed step
  std::string recompute;               // the setting this length ran with (auto: the one chosen)
  int64_t recompute_layers = -1;
  bool offload = false;
  int64_t offload_layers = -1;         // as run (DecoderOptions::offload_layers)
  int64_t mlp_tile_tokens = 0;         // as run: rows per SwiGLU MLP tile (0: untiled)
  int64_t checkpoint_stride = 1;       // as run (DecoderOptions::checkpoint_stride)
  OffloadStats offload_copies;         // activation offload's copies over the timed steps (all of them)
  bool split_measured = false;
  // Per step, by OpCategory: attention, gemm, communication (on the compute stream), other ops,
  // overlapped communication (on another stream; not part of idle = step − the first four).
  double split_ms[5] = {};
  double profiled_step_ms = 0;         // wall time of the profiled step(s), per step (rank 0)
  int64_t ops_per_step = 0;
  std::vector<OpTime> op_table;        // per profiled step, the most time first
};

struct BenchReport {
  BenchOptions options;
  int world = 1, dp = 1, sp = 1, ulysses = 1, ring = 1;  // the mesh the sweep ran on
  ModelConfig config;
  std::string device_name;
  double peak_tflops = 0;
  int64_t parameters = 0, trainable_parameters = 0;
  // Wall seconds from the first weight to the model ready on the device: random weights drawn (and
  // quantised, with --quantize) by the backend, LoRA adapters, FSDP shards.
  double model_build_s = 0;
  std::vector<BenchResult> results;
};

// A row of random tokens: one causal document, or documents of doc_length tokens (the last one
// shorter) as packing lays them out, positions restarting at each. Every position but a
// document's last predicts the next token. `spindle plan` plans the same rows.
PackedRow synthetic_row(int64_t length, int64_t doc_length, int64_t vocab, uint64_t seed);

// What bench builds (train/run_assembly.h): random weights from --seed, LoRA from --seed + 1 on
// --lora-targets (none: every projection the model has), FSDP over the processes, the router loss;
// no optimizer state.
RunDescription describe_bench_run(const BenchOptions& options, const ModelConfig& config, DType dtype);

// Runs the whole sweep. Errors in the setup throw; a length that runs out of memory is recorded
// in its result and ends the sweep (longer ones would not fit either).
// on_result (optional) sees the report after each length, for output that survives a later crash.
BenchReport run_bench(const BenchOptions& options,
                      const std::function<void(const BenchReport&)>& on_result = nullptr);

std::string format_report(const BenchReport& report);  // human-readable, with the formulas
nlohmann::ordered_json report_json(const BenchReport& report);

}  // namespace spindle::bench
