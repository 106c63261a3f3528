// Every option of `spindle sft`, settable by flag or by a YAML file (same names, '-' or '_').
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "parallel/mesh.h"

namespace spindle {

struct TrainConfig {
  std::string model;                  // HF model folder
  std::vector<std::string> data;      // JSONL or prepared datasets, each "PATH" or "PATH:WEIGHT"
  std::string output;                 // output folder (final adapter/model, checkpoints, metrics)
  // Replace the run the output folder holds (what a run writes there) instead of refusing it.
  bool overwrite_output = false;
  std::string tokenizer;              // folder with tokenizer.json for JSONL text data; empty: --model
  bool skip_bad_samples = false;      // malformed JSONL lines are counted and reported, not an error
  std::string format = "auto";        // the JSONL sample format (data/sample_formats.h); auto: detected
  int64_t max_length = 4096;          // tokens per packed row
  bool no_packing = false;
  std::string over_length = "truncate";
  int64_t max_steps = 0;              // 0: from epochs
  double epochs = 1.0;
  double lr = 1e-4;
  std::string lr_scheduler = "linear";
  int64_t warmup_steps = 0;
  double warmup_ratio = 0.0;
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;
  double adam_beta1 = 0.9, adam_beta2 = 0.999, adam_eps = 1e-8;
  int64_t grad_accum = 1;             // micro-batches (rows) per optimizer step
  uint64_t seed = 42;
  int64_t lora_rank = 16;
  double lora_alpha = 32;
  std::vector<std::string> lora_targets = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  bool rslora = false;
  // MoE models: coefficient of the router load-balancing loss; -1: the config's (router_aux_loss_coef
  // when output_router_logits is true, else off), 0: off (model/router_aux_loss.h).
  double router_aux_loss_coef = -1;
  std::string adapter;                // start from this PEFT adapter
  bool full = false;                  // full fine-tune instead of LoRA
  // LoRA on the architecture of --model (a folder or its config.json) with random base weights, drawn as
  // spindle bench draws them: no checkpoint is read. For measuring a model whose weights are not at
  // hand (a 35B checkpoint is 70 GB) and for smoke tests; sft only.
  bool random_weights = false;
  // 4-bit base weights (docs/qlora.md): nf4 | fp4 quantises the frozen projections at load; empty: as stored.
  std::string quantize;
  bool double_quant = false;          // with quantize: the absmax in 8 bits too
  int64_t quant_block_size = 64;      // with quantize: weights per absmax
  std::string merge_output;           // LoRA: also write base + s·B·A as one dense HF model folder here
  int64_t save_steps = 0;             // 0: only at the end
  std::string eval_data;
  int64_t eval_steps = 0;
  bool resume = false;                // continue from the latest checkpoint in --output
  std::string metrics_file;           // default: OUTPUT/metrics.jsonl
  std::string tensorboard;            // folder for TensorBoard event files (main rank); empty: none
  int64_t log_every = 1;
  std::string recompute = "none";     // none | all | keep-attention | auto: activation checkpointing (RecomputeMode; auto: docs/memory.md)
  int64_t recompute_layers = -1;       // how many layers (the first ones) --recompute applies to; -1: all
  std::string offload = "none";       // none | activations: recomputed layers' kept tensors in host memory
  int64_t offload_layers = -1;        // with offload: the first N layers offload, the others stay (-1: all but the last)
  std::string mlp_tile_tokens = "auto";  // SwiGLU MLP token tiles: N, 0 (untiled) or auto (model/recompute.h)
  int64_t checkpoint_stride = 1;      // every Nth recomputed layer keeps its input (recompute all; model/decoder.h)
  std::string device_memory;          // --recompute auto: memory per device to fit (bytes or 80GiB); empty: the device's
  std::string host_memory;            // --recompute auto: the host's memory for offload (bytes or 128GiB); empty: this machine's
  std::string device = "auto";        // auto | cpu | cuda (auto: CUDA when built with it and a GPU is visible)
  std::string dtype = "auto";         // auto (cpu: f32, cuda: bf16) | f32 | f64 (cpu) | bf16 (cuda)
  std::string attention = "auto";     // auto | own | cudnn: the CUDA backend's attention (CudaAttention)
  int threads = 0;
  // Mesh (docs/parallelism.md): 0 = not given, resolved against the number of processes.
  int dp = 0, sp = 0, ulysses = 0, ring = 0;
  bool no_fsdp = false;  // replicate parameters on every rank instead of sharding them (FSDP)

  parallel::MeshFlags mesh_flags() const;

  void validate() const;                   // before any work: errors name the option to change
  nlohmann::json fingerprint() const;      // what a resumed run must share with the original
  // The options that decide what a run computes, step by step (run_folder.h compares them). The
  // run's length (--max-steps, --epochs) is not among them: --resume may lengthen or shorten a run.
  nlohmann::ordered_json trajectory_options() const;
  // The folder of tokenizer.json: --tokenizer, else --model.
  std::string tokenizer_folder() const { return tokenizer.empty() ? model : tokenizer; }
};

}  // namespace spindle
