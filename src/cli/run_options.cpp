// The options that say what a run builds (train/run_assembly.h), declared once: sft, dpo, check,
// bench and plan register them here, so each has one name, one help text and one check in every
// command that takes it. A command's own default shows in its --help.
#include <string>

#include "backend/cuda/cuda_options.h"
#include "cli/commands.h"
#include "core/error.h"
#include "model/recompute.h"

namespace spindle::cli {

namespace {

// A CLI11 check from one of spindle's parsers: its message, without the option's name in front
// (CLI11 puts "--option: " there).
CLI::Validator parsed_by(const std::string& option, std::function<void(const std::string&)> parse) {
  return CLI::Validator(
      [option, parse](std::string& value) {
        try {
          parse(value);
        } catch (const Error& e) {
          std::string message = e.what();
          if (message.rfind(option + " ", 0) == 0) message.erase(0, option.size() + 1);
          return message;
        }
        return std::string();
      },
      "", option);
}

}  // namespace

void add_adapter_options(CLI::App* cmd, const AdapterFlags& f) {
  cmd->add_option("--lora-rank", f.lora_rank, "LoRA rank of the adapters (unused with --full)")->capture_default_str();
  cmd->add_option("--lora-alpha", f.lora_alpha, "LoRA alpha: the adapters are scaled by alpha / rank")
      ->capture_default_str();
  cmd->add_option("--lora-targets", f.lora_targets,
                  "projections to adapt, by PEFT module name (experts: the routed experts' fused tensors); "
                  "default: sft, dpo and check the projections of the list shown that the model has, bench and plan "
                  "every projection the model has, the routed experts left out")
      ->capture_default_str();
  cmd->add_flag("--full", f.full, "full fine-tuning (every weight) instead of LoRA");
}

void add_quantize_options(CLI::App* cmd, std::string& quantize, bool& double_quant, int64_t& block_size) {
  cmd->add_option("--quantize", quantize,
                  "nf4 (or fp4): hold the frozen base projections in bitsandbytes' 4-bit format, quantised as they "
                  "load (QLoRA; docs/qlora.md). A folder bitsandbytes already quantised loads as stored without it");
  cmd->add_flag("--double-quant", double_quant, "with --quantize: store the absmax in 8 bits too (bitsandbytes' "
                                                "double quantisation)");
  cmd->add_option("--quant-block-size", block_size, "with --quantize: weights per absmax, 32 ... 4096")
      ->capture_default_str();
}

void add_memory_options(CLI::App* cmd, const MemoryFlags& f) {
  cmd->add_option("--recompute", f.recompute,
                  "activation checkpointing: none (keep every activation), all (keep layer inputs, recompute "
                  "layers in backward) or keep-attention (as all, but keep each layer's attention output: no "
                  "second attention forward), or auto (the fastest setting whose planned peak fits the device, "
                  "from spindle plan; docs/memory.md)")
      ->check(parsed_by("--recompute",
                        [](const std::string& value) {
                          if (value == "auto") return;
                          if (value != "none" && value != "all" && value != "keep-attention")
                            fail("--recompute must be none, all, keep-attention or auto, got \"{}\" (none: fastest, "
                                 "most memory; all: least memory; keep-attention: in between; auto: the fastest "
                                 "that fits the device; docs/memory.md)",
                                 value);
                        }))
      ->capture_default_str();
  cmd->add_option("--recompute-layers", f.recompute_layers,
                  "apply --recompute to the first N layers only; the others keep every activation (faster, more "
                  "memory; -1: all layers)")
      ->capture_default_str();
  cmd->add_option("--offload", f.offload,
                  "none, or activations: recomputed layers' inputs (and kept attention outputs) go to host memory "
                  "during forward and come back ahead of backward (docs/memory.md)")
      ->check(parsed_by("--offload", [](const std::string& value) { parse_offload(value, RecomputeMode::All); }))
      ->capture_default_str();
  cmd->add_option("--offload-layers", f.offload_layers, kOffloadLayersHelp)->capture_default_str();
  cmd->add_option("--mlp-tile-tokens", f.mlp_tile_tokens, kMlpTileTokensHelp)
      ->check(parsed_by("--mlp-tile-tokens", [](const std::string& value) { parse_mlp_tile_tokens(value); }))
      ->capture_default_str();
  cmd->add_option("--checkpoint-stride", f.checkpoint_stride, kCheckpointStrideHelp)->capture_default_str();
  cmd->add_option("--device-memory", f.device_memory,
                  "the memory per device (bytes, or 80GiB): what --recompute auto fits, and what plan says whether "
                  "the peak fits (default: the GPU's, or the machine's RAM on the CPU)");
  cmd->add_option("--host-memory", f.host_memory,
                  "the host memory offloaded activations may take three quarters of, for --recompute auto (bytes, "
                  "or 128GiB; default: this machine's RAM, or less where the process's control group caps it)");
}

void add_router_aux_loss_option(CLI::App* cmd, double& coefficient) {
  cmd->add_option("--router-aux-loss-coef", coefficient,
                  "MoE models: add C x the router load-balancing loss to the step (0: off; default: the config's "
                  "router_aux_loss_coef when its output_router_logits is true, else off)")
      ->check(parsed_by("--router-aux-loss-coef", [](const std::string& value) {
        double c = 0;
        try {
          c = std::stod(value);
        } catch (const std::exception&) {
          return;  // not a number: CLI11's own conversion says so
        }
        if (!(c >= 0 || c == -1)) fail("--router-aux-loss-coef must be >= 0 (0: off), got {}", value);
      }));
}

void add_mesh_options(CLI::App* cmd, const MeshOptionFlags& f) {
  cmd->add_option("--dp", f.dp, "data-parallel replicas (default: processes / sp)");
  cmd->add_option("--sp", f.sp, "sequence-parallel degree: each row is split over this many processes (default 1)");
  cmd->add_option("--ulysses", f.ulysses, "Ulysses (all-to-all over heads) part of --sp (default: the largest the "
                                          "head counts allow)");
  cmd->add_option("--ring", f.ring, "ring-attention part of --sp (default: sp / ulysses)");
}

void add_attention_option(CLI::App* cmd, std::string& attention) {
  cmd->add_option("--attention", attention,
                  "CUDA attention: auto (cuDNN for long one-document rows, the engine's own kernels elsewhere), "
                  "own (never cuDNN) or cudnn (cuDNN for every call; fails on calls it cannot take)")
      ->check(parsed_by("--attention", [](const std::string& value) { parse_cuda_attention(value); }))
      ->capture_default_str();
}

void add_dtype_option(CLI::App* cmd, std::string& dtype) {
  cmd->add_option("--dtype", dtype, "compute precision: auto (CPU f32, CUDA bf16), f32, f64 (CPU) or bf16 (CUDA)")
      ->check(parsed_by("--dtype",
                        [](const std::string& value) {
                          if (value != "auto" && value != "f32" && value != "f64" && value != "bf16")
                            fail("--dtype must be auto, f32, f64 (CPU) or bf16 (CUDA), got \"{}\"", value);
                        }))
      ->capture_default_str();
}

}  // namespace spindle::cli
