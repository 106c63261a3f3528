#include "train/train_config.h"

#include <filesystem>

#include "backend/cuda/cuda_options.h"
#include "core/error.h"
#include "model/quantized_weights.h"
#include "model/recompute.h"
#include "data/dataset_reader.h"
#include "data/sample_formats.h"
#include "train/data_loader.h"
#include "train/schedule.h"

namespace spindle {

void TrainConfig::validate() const {
  namespace fs = std::filesystem;
  if (model.empty()) fail("--model is required: a Hugging Face model folder");
  // With --random-weights only the architecture is read: the config.json file itself will do.
  const bool architecture_file = random_weights && fs::is_regular_file(model);
  if (!architecture_file && !fs::exists(fs::path(model) / "config.json"))
    fail("--model {}: no config.json there{}", model,
         random_weights ? " (with --random-weights, a folder with a config.json or the file itself)" : "");
  if (data.empty()) fail("--data is required: one or more JSONL or prepared datasets");
  for (const std::string& spec : data) {
    const DataSource source = parse_data_spec(spec);
    // A path, a folder's split or a hub id in the local caches (data/dataset_files.h).
    try {
      check_data_value(source.path.string(), "--data");
    } catch (const Error& e) {
      if (source.name() == spec) throw;
      fail("{} (from \"{}\": PATH:WEIGHT)", e.what(), spec);
    }
  }
  parse_sample_format(format);
  if (!tokenizer.empty() && !fs::exists(fs::path(tokenizer) / "tokenizer.json"))
    fail("--tokenizer {}: no tokenizer.json there (a Hugging Face model or tokenizer folder)", tokenizer);
  if (output.empty()) fail("--output is required: the folder for the trained adapter or model");
  if (resume && overwrite_output)
    fail("--resume continues the run in --output and --overwrite-output replaces it: give one of them");
  if (max_length <= 0) fail("--max-length must be positive, got {}", max_length);
  if (max_steps < 0) fail("--max-steps must be >= 0, got {}", max_steps);
  if (max_steps == 0 && !(epochs > 0)) fail("--epochs must be positive when --max-steps is not set, got {}", epochs);
  if (!(lr >= 0)) fail("--lr must be >= 0, got {}", lr);
  parse_lr_schedule(lr_scheduler);
  if (warmup_steps < 0) fail("--warmup-steps must be >= 0, got {}", warmup_steps);
  if (!(warmup_ratio >= 0 && warmup_ratio < 1)) fail("--warmup-ratio must be in [0, 1), got {}", warmup_ratio);
  if (!(weight_decay >= 0)) fail("--weight-decay must be >= 0, got {}", weight_decay);
  if (!(max_grad_norm >= 0)) fail("--max-grad-norm must be >= 0 (0 disables clipping), got {}", max_grad_norm);
  if (!(adam_beta1 >= 0 && adam_beta1 < 1) || !(adam_beta2 >= 0 && adam_beta2 < 1))
    fail("--adam-beta1 and --adam-beta2 must be in [0, 1)");
  if (!(adam_eps > 0)) fail("--adam-eps must be positive");
  if (grad_accum <= 0) fail("--grad-accum must be positive, got {}", grad_accum);
  if (full && !adapter.empty()) fail("--full and --adapter exclude each other: a full fine-tune trains the base weights");
  if (full && !merge_output.empty())
    fail("--merge-output folds LoRA adapters into the base; a --full run's model/ is already the whole model");
  parse_quantize_options(quantize, double_quant, quant_block_size);
  if (random_weights && (full || !adapter.empty() || !merge_output.empty()))
    fail("--random-weights trains new LoRA adapters on random base weights; it excludes --full, --adapter and "
         "--merge-output (there is no base checkpoint to save or merge into)");
  if (full && !quantize.empty())
    fail("--quantize with --full: 4-bit base weights are frozen (QLoRA trains LoRA adapters on them); drop --full or "
         "--quantize");
  if (!full && lora_rank <= 0) fail("--lora-rank must be positive (or choose --full), got {}", lora_rank);
  if (!full && !(lora_alpha > 0)) fail("--lora-alpha must be positive, got {}", lora_alpha);
  if (!full && lora_targets.empty()) fail("--lora-targets needs at least one module");
  if (!(router_aux_loss_coef >= 0 || router_aux_loss_coef == -1))
    fail("--router-aux-loss-coef must be >= 0 (0: off), got {}", router_aux_loss_coef);
  if (save_steps < 0) fail("--save-steps must be >= 0, got {}", save_steps);
  if (eval_steps < 0) fail("--eval-steps must be >= 0, got {}", eval_steps);
  if (eval_steps > 0 && eval_data.empty()) fail("--eval-steps needs --eval-data");
  if (log_every <= 0) fail("--log-every must be positive, got {}", log_every);
  if (recompute != "auto") {  // auto is resolved into a mode by the command line before training starts
    check_recompute_layers(parse_recompute_mode(recompute), recompute_layers);
    check_offload_layers(parse_offload(offload, parse_recompute_mode(recompute)), offload_layers);
    check_checkpoint_stride(parse_recompute_mode(recompute), checkpoint_stride);
  } else {
    check_left_to_auto(offload_layers, checkpoint_stride);
    if (recompute_layers != -1)
      fail("--recompute-layers is chosen by --recompute auto (sft's default); to set it, choose --recompute all or "
           "keep-attention");
  }
  parse_mlp_tile_tokens(mlp_tile_tokens);
  if (!host_memory.empty() && recompute != "auto")
    fail("--host-memory is the host memory --recompute auto budgets offload with: give it with --recompute auto "
         "(with --recompute {}, --offload-layers says how much goes to the host)",
         recompute);
  if (device != "auto" && device != "cpu" && device != "cuda")
    fail("--device must be auto, cpu or cuda, got \"{}\"", device);
  if (dtype != "auto" && dtype != "f32" && dtype != "f64" && dtype != "bf16")
    fail("--dtype must be auto, f32, f64 (CPU) or bf16 (CUDA), got \"{}\"", dtype);
  if (device == "cpu") check_cuda_attention_off_gpu(parse_cuda_attention(attention), "--device cpu");
  else parse_cuda_attention(attention);
  if (dp < 0 || sp < 0 || ulysses < 0 || ring < 0) fail("--dp, --sp, --ulysses and --ring must be positive");
  if (!adapter.empty() && !fs::exists(fs::path(adapter) / "adapter_config.json"))
    fail("--adapter {}: no adapter_config.json there", adapter);
  if (!eval_data.empty()) check_data_value(eval_data, "--eval-data");
}

nlohmann::ordered_json TrainConfig::trajectory_options() const {
  nlohmann::ordered_json j;
  j["max_length"] = max_length;
  j["no_packing"] = no_packing;
  j["over_length"] = over_length;
  j["skip_bad_samples"] = skip_bad_samples;
  j["format"] = format;
  j["lr"] = lr;
  j["lr_scheduler"] = lr_scheduler;
  j["warmup_steps"] = warmup_steps;
  j["warmup_ratio"] = warmup_steps > 0 ? 0.0 : warmup_ratio;  // not used when --warmup-steps is given
  j["weight_decay"] = weight_decay;
  j["max_grad_norm"] = max_grad_norm;
  j["adam_beta1"] = adam_beta1;
  j["adam_beta2"] = adam_beta2;
  j["adam_eps"] = adam_eps;
  j["grad_accum"] = grad_accum;
  j["seed"] = seed;
  j["full"] = full;
  j["lora_rank"] = full ? 0 : lora_rank;
  j["lora_alpha"] = full ? 0.0 : lora_alpha;
  j["lora_targets"] = full ? std::vector<std::string>{} : lora_targets;
  j["rslora"] = !full && rslora;
  j["router_aux_loss_coef"] = router_aux_loss_coef;
  j["random_weights"] = random_weights;
  j["quantize"] = quantize;
  j["double_quant"] = !quantize.empty() && double_quant;
  j["quant_block_size"] = quantize.empty() ? 0 : quant_block_size;
  return j;
}

parallel::MeshFlags TrainConfig::mesh_flags() const {
  parallel::MeshFlags flags;
  if (dp) flags.dp = dp;
  if (sp) flags.sp = sp;
  if (ulysses) flags.ulysses = ulysses;
  if (ring) flags.ring = ring;
  return flags;
}

nlohmann::json TrainConfig::fingerprint() const {
  nlohmann::json j = {{"model", model},           {"data", data},       {"max_length", max_length}, {"no_packing", no_packing},
          {"over_length", over_length}, {"grad_accum", grad_accum}, {"seed", seed},       {"full", full},
          {"lora_rank", full ? 0 : lora_rank}, {"lora_alpha", full ? 0.0 : lora_alpha},
          {"lora_targets", full ? std::vector<std::string>{} : lora_targets}, {"rslora", rslora}, {"adapter", adapter}};
  if (!quantize.empty())  // only when set: runs without it resume as before
    j["quantize"] = {{"type", quantize}, {"double_quant", double_quant}, {"block_size", quant_block_size}};
  if (router_aux_loss_coef >= 0) j["router_aux_loss_coef"] = router_aux_loss_coef;  // only when set: older runs resume
  if (random_weights) j["random_weights"] = true;
  return j;
}

}  // namespace spindle
