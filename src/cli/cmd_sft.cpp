// spindle sft: supervised fine-tuning, configured by flags and/or a YAML file (--config). A YAML
// key is a flag's name without the dashes ('-' or '_' both work); flags given on the command line
// override the file. Unknown keys and wrong types are errors before any work starts.
#include <yaml-cpp/yaml.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "cli/commands.h"
#include "core/error.h"
#include "model/config.h"
#include "parallel/mesh.h"
#include "plan/auto_recompute.h"
#include "train/run_folder.h"
#include "train/setup.h"
#include "train/stop_signal.h"
#include "train/trainer.h"

namespace spindle::cli {

namespace {

std::string option_name(std::string key) {
  for (char& c : key)
    if (c == '_') c = '-';
  return key;
}

// The YAML file as command-line arguments; keys whose flag is also on the command line are left
// out, so the command line wins (whole lists included).
std::vector<std::string> yaml_to_args(const std::string& path, CLI::App& cmd, const std::vector<std::string>& given) {
  YAML::Node root;
  std::error_code error;
  if (!std::filesystem::is_regular_file(path, error))
    fail("--config {}: {}", path,
         std::filesystem::exists(path, error) ? "not a file" : "no such file (a YAML file of sft's options)");
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    fail("--config {}: not valid YAML ({})", path, e.what());
  }
  if (!root.IsMap()) fail("--config {}: expected a mapping of option names to values", path);
  std::vector<std::string> args;
  for (const auto& entry : root) {
    const std::string key = entry.first.as<std::string>();
    const std::string flag = "--" + option_name(key);
    if (flag == "--config") fail("--config {}: a config file cannot name another config file", path);
    CLI::Option* opt = nullptr;
    try {
      opt = cmd.get_option(flag);
    } catch (const CLI::OptionNotFound&) {
      std::string known;
      for (const CLI::Option* o : cmd.get_options())
        if (!o->get_lnames().empty() && o->get_lnames()[0] != "help" && o->get_lnames()[0] != "config")
          known += " " + o->get_lnames()[0];
      fail("--config {}: unknown key \"{}\"; known keys:{}", path, key, known);
    }
    const YAML::Node& value = entry.second;
    bool on_command_line = false;
    for (const std::string& a : given) on_command_line |= a == flag || a.rfind(flag + "=", 0) == 0;
    if (on_command_line) continue;
    if (opt->get_expected_min() == 0) {  // a flag
      bool on = false;
      try {
        on = value.as<bool>();
      } catch (const YAML::Exception&) {
        fail("--config {}: \"{}\" must be true or false", path, key);
      }
      if (on) args.push_back(flag);
      continue;
    }
    auto scalar = [&](const YAML::Node& n) {
      if (!n.IsScalar()) fail("--config {}: \"{}\" must be a value or a list of values", path, key);
      return n.as<std::string>();
    };
    if (value.IsSequence()) {
      if (value.size() == 0) fail("--config {}: \"{}\" is an empty list", path, key);
      args.push_back(flag);
      for (const auto& item : value) {
        if (item.IsMap()) {  // data: [{path: a.jsonl, weight: 0.3}]
          if (!item["path"]) fail("--config {}: entries of \"{}\" need a path", path, key);
          std::string s = item["path"].as<std::string>();
          if (item["weight"]) s += ":" + item["weight"].as<std::string>();
          args.push_back(s);
        } else {
          args.push_back(scalar(item));
        }
      }
    } else {
      args.push_back(flag);
      args.push_back(scalar(value));
    }
  }
  return args;
}

}  // namespace

void add_train_options(CLI::App* cmd, TrainConfig& c) {
  cmd->add_option("--model", c.model, "Hugging Face model folder");
  cmd->add_option("--data", c.data, "training data: a JSONL, Parquet or Arrow file (any supported format), a folder of "
                                    "shards, a hub id ORG/NAME in the local Hugging Face caches (a folder or hub id may "
                                    "end in [:CONFIG]:SPLIT, default train), or a prepared dataset; add :WEIGHT to mix "
                                    "several")->expected(1, 1 << 20);
  cmd->add_option("--output", c.output, "output folder: adapter/ or model/, checkpoint-N/, metrics.jsonl, metrics.svg "
                                        "(new or empty, or holding this run with --resume)");
  cmd->add_flag("--overwrite-output", c.overwrite_output,
                "replace the run --output holds (what a run writes there; other files stay), and a model in "
                "--merge-output");
  cmd->add_option("--tokenizer", c.tokenizer, "folder with tokenizer.json for JSONL text data (default: --model)");
  cmd->add_flag("--skip-bad-samples", c.skip_bad_samples,
                "skip malformed JSONL lines (counted and reported) instead of stopping at the first");
  cmd->add_option("--format", c.format,
                  "JSONL sample format: auto (detected from the fields), pretokenized, text, prompt-completion, "
                  "alpaca, messages or preference (docs/formats.md)")
      ->capture_default_str();
  cmd->add_option("--max-length", c.max_length, "tokens per packed row")->capture_default_str();
  cmd->add_flag("--no-packing", c.no_packing, "one document per row");
  cmd->add_option("--over-length", c.over_length, "documents longer than --max-length: truncate, truncate-left, "
                                                  "drop or error")->capture_default_str();
  cmd->add_option("--max-steps", c.max_steps, "optimizer steps (0: from --epochs)")->capture_default_str();
  cmd->add_option("--epochs", c.epochs, "passes over the data when --max-steps is 0")->capture_default_str();
  cmd->add_option("--lr", c.lr, "peak learning rate")->capture_default_str();
  cmd->add_option("--lr-scheduler", c.lr_scheduler, "constant, linear or cosine")->capture_default_str();
  cmd->add_option("--warmup-steps", c.warmup_steps, "linear warm-up steps")->capture_default_str();
  cmd->add_option("--warmup-ratio", c.warmup_ratio, "warm-up as a fraction of all steps")->capture_default_str();
  cmd->add_option("--weight-decay", c.weight_decay, "AdamW decoupled weight decay")->capture_default_str();
  cmd->add_option("--max-grad-norm", c.max_grad_norm, "clip the global gradient norm (0: off)")->capture_default_str();
  cmd->add_option("--adam-beta1", c.adam_beta1)->capture_default_str();
  cmd->add_option("--adam-beta2", c.adam_beta2)->capture_default_str();
  cmd->add_option("--adam-eps", c.adam_eps)->capture_default_str();
  cmd->add_option("--grad-accum", c.grad_accum, "rows (micro-batches) per optimizer step")->capture_default_str();
  cmd->add_option("--seed", c.seed, "data order and LoRA initialisation")
      ->check(CLI::Validator(
          [](std::string& value) {
            // CLI11 reads "-1" into the unsigned seed as 2^64 - 1; a seed is never negative.
            if (!value.empty() && value.front() == '-')
              return "must be a whole number from 0 to 18446744073709551615, got " + value;
            return std::string();
          },
          "", "non-negative"))
      ->capture_default_str();
  add_adapter_options(cmd, {c.lora_rank, c.lora_alpha, c.lora_targets, c.full});
  cmd->add_flag("--rslora", c.rslora, "scale LoRA by alpha/sqrt(rank) (rsLoRA)");
  add_router_aux_loss_option(cmd, c.router_aux_loss_coef);
  cmd->add_option("--adapter", c.adapter, "start from this PEFT adapter folder");
  cmd->add_option("--save-steps", c.save_steps, "checkpoint every N steps (0: only at the end)")->capture_default_str();
  cmd->add_option("--eval-data", c.eval_data, "held-out data scored during training");
  cmd->add_option("--eval-steps", c.eval_steps, "score --eval-data every N steps")->capture_default_str();
  add_quantize_options(cmd, c.quantize, c.double_quant, c.quant_block_size);
  cmd->add_option("--merge-output", c.merge_output,
                  "LoRA: also write the base with the trained adapters folded in (W + s*B*A; a 4-bit base "
                  "dequantised first) as a dense Hugging Face model folder here (BF16 from GPUs, F32 from the CPU)");
  cmd->add_flag("--resume", c.resume, "continue from the latest checkpoint in --output");
  cmd->add_option("--metrics-file", c.metrics_file, "JSONL metrics (default OUTPUT/metrics.jsonl)");
  cmd->add_option("--tensorboard", c.tensorboard, "also write every step's metrics as TensorBoard event files "
                                                  "into this folder (tensorboard --logdir)");
  cmd->add_option("--log-every", c.log_every, "plain progress lines every N steps")->capture_default_str();
  add_memory_options(cmd, {c.recompute, c.recompute_layers, c.offload, c.offload_layers, c.mlp_tile_tokens,
                           c.checkpoint_stride, c.device_memory, c.host_memory});
  cmd->add_option("--device", c.device, "auto, cpu or cuda (auto: CUDA when a GPU is visible; each process uses "
                                        "the GPU of its local rank)")->capture_default_str();
  add_dtype_option(cmd, c.dtype);
  add_attention_option(cmd, c.attention);
  cmd->add_option("--threads", c.threads, "CPU threads per process (default: the machine's cores / processes)");
  add_mesh_options(cmd, {c.dp, c.sp, c.ulysses, c.ring});
  cmd->add_flag("--no-fsdp", c.no_fsdp, "with several processes, keep a full copy of the weights on each "
                                        "(default: FSDP shards weights, gradients and optimizer state)");
}


// commands.h: the plan of rows of --max-length tokens on this job's mesh with the AdamW state.
void resolve_auto_recompute(TrainConfig& config, bool asked, const std::function<void(plan::PlanOptions&)>& adjust) {
  config.validate();
  if (config.no_fsdp && process_group_from_environment().world_size > 1) {
    if (asked)
      fail("--recompute auto plans sharded (FSDP) runs; with --no-fsdp choose --recompute none, all or keep-attention");
    config.recompute = "none";  // the default cannot plan this job: keep every activation, as before auto existed
    return;
  }
  const ProcessGroupInfo process = process_group_from_environment();
  const ComputeDevice device = choose_device(config, process);
  plan::PlanOptions p;
  p.model = config.model;
  p.seq_lengths = {config.max_length};
  p.lora_rank = config.full ? 0 : config.lora_rank;
  p.lora_alpha = config.lora_alpha;
  // The adapters sft will attach (train/setup.cpp): the targets given, or of its default list those
  // the model has.
  p.lora_targets = config.lora_targets;
  p.lora_targets_if_present = config.lora_targets == TrainConfig{}.lora_targets;
  p.full = config.full;
  p.quantize = config.quantize;
  p.double_quant = config.double_quant;
  p.quant_block_size = config.quant_block_size;
  p.router_aux_loss_coef = config.router_aux_loss_coef;
  p.device = device.cuda ? "cuda" : "cpu";
  p.mlp_tile_tokens = parse_mlp_tile_tokens(config.mlp_tile_tokens);
  p.dtype = config.dtype;
  p.world = process.world_size;
  p.dp = config.dp;
  p.sp = config.sp;
  p.ulysses = config.ulysses;
  p.ring = config.ring;
  if (!config.host_memory.empty()) p.host_memory_bytes = plan::parse_memory_size(config.host_memory, "--host-memory");
  if (adjust) adjust(p);
  const int64_t device_bytes = config.device_memory.empty() ? plan::machine_device_memory(p.device, device.index)
                                                            : plan::parse_memory_size(config.device_memory);
  const ModelConfig model = ModelConfig::from_file(config.model);
  const parallel::MeshConfig mesh = parallel::resolve_mesh(config.mesh_flags(), process.world_size,
                                                           static_cast<int>(model.num_heads),
                                                           static_cast<int>(model.num_kv_heads));
  const int64_t seq = parallel::padded_length(config.max_length, mesh);  // the longest row, as the loader pads it
  const plan::AutoChoice choice = plan::choose_recompute(p, seq, device_bytes, config.offload == "activations");
  config.recompute = choice.setting.recompute;
  config.recompute_layers = choice.setting.recompute_layers;
  config.offload = choice.setting.offload ? "activations" : "none";
  config.offload_layers = choice.setting.offload_layers;
  config.mlp_tile_tokens = std::to_string(choice.setting.mlp_tile_tokens);
  config.checkpoint_stride = choice.setting.checkpoint_stride;
  if (process.rank == 0) std::fprintf(stderr, "%s\n", choice.summary(0).c_str());
}

void check_run_output_before_work(const TrainConfig& config, const std::string& command,
                                  const nlohmann::json& command_options, int world_size) {
  // Under spindle's launcher the parent checked before starting the ranks; the ranks check again in the run.
  if (std::getenv("SPINDLE_LAUNCHER")) return;
  const ModelConfig model = ModelConfig::from_file(config.model);
  const parallel::MeshConfig mesh = parallel::resolve_mesh(config.mesh_flags(), world_size,
                                                           static_cast<int>(model.num_heads),
                                                           static_cast<int>(model.num_kv_heads));
  check_run_output(config, run_identity(config, command, command_options, mesh.dp));
}

int exit_status(const TrainSummary& summary) {
  if (summary.stopped()) return kExitStoppedResumable;
  return summary.steps > 0 ? 0 : 1;
}

void add_sft_command(CLI::App& app, CommandList& commands) {
  auto config = std::make_shared<TrainConfig>();
  // sft plans its memory by default: the fastest recompute/offload setting that fits (measured within
  // 0.4 % of the fastest hand-chosen one on the H200, docs/perf.md); dpo and check keep `none`.
  config->recompute = "auto";
  auto config_file = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("sft", "Supervised fine-tuning (LoRA or full) of a Hugging Face model");
  cmd->add_option("--config", *config_file, "YAML file with the same options (flags override it)");
  add_train_options(cmd, *config);
  const CLI::Option* recompute_option = cmd->get_option("--recompute");
  cmd->add_flag("--random-weights", config->random_weights,
                "train LoRA on the architecture of --model (a folder or a config.json) with random base weights "
                "instead of reading its checkpoint (for measuring and smoke tests; data must be pre-tokenized "
                "JSONL or a prepared dataset unless the folder has a tokenizer)");
  commands.push_back({cmd,
                      [config, recompute_option] {
                        TrainConfig resolved = *config;
                        resolved.validate();
                        const ProcessGroupInfo process = process_group_from_environment();
                        if (process.rank == 0)  // before the memory plan: a refused folder is the one message
                          check_run_output_before_work(resolved, "sft", nlohmann::json(), process.world_size);
                        if (resolved.recompute == "auto") resolve_auto_recompute(resolved, recompute_option->count() > 0);
                        return exit_status(run_sft(resolved));
                      },
                      [config](int world_size) {
                        // The job's shape first (the mesh against the model's heads), then its inputs and output.
                        check_mesh_before_launch(config->mesh_flags(), config->model, world_size);
                        config->validate();
                        check_run_output_before_work(*config, "sft", nlohmann::json(), world_size);
                      }});
}

// Called by main before parsing: expands `sft --config FILE` into the file's arguments.
std::vector<std::string> expand_config_file(CLI::App& app, const std::vector<std::string>& args) {
  if (args.empty()) return args;
  CLI::App* cmd = nullptr;
  try {
    cmd = app.get_subcommand(args[0]);
  } catch (const CLI::OptionNotFound&) {
    return args;
  }
  for (size_t i = 1; i < args.size(); ++i) {
    std::string path;
    if (args[i] == "--config" && i + 1 < args.size()) path = args[i + 1];
    else if (args[i].rfind("--config=", 0) == 0) path = args[i].substr(9);
    else continue;
    std::vector<std::string> out{args[0]};
    std::vector<std::string> from_file = yaml_to_args(path, *cmd, args);
    out.insert(out.end(), from_file.begin(), from_file.end());
    out.insert(out.end(), args.begin() + 1, args.end());
    return out;
  }
  return args;
}

}  // namespace spindle::cli
