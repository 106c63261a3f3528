#pragma once

#include <CLI/CLI.hpp>

#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/train_config.h"

namespace spindle {
struct TrainSummary;
struct DpoConfig;
}
namespace spindle::plan {
struct PlanOptions;
}

namespace spindle::cli {

struct Command {
  CLI::App* app;               // the parsed subcommand
  std::function<int()> run;    // returns the process exit code
  // With --nproc-per-node N, called with N before the launcher starts any process: throws
  // spindle::Error when N processes cannot run the command (its mesh against the model's heads).
  std::function<void(int world_size)> check_launch = {};
};
using CommandList = std::vector<Command>;

// --recompute auto for sft and dpo (defined in cmd_sft.cpp): plans the job's rows (--max-length) on
// its mesh with the AdamW state and writes the fastest setting that fits the device into `config`
// before anything is allocated. `asked`: auto was given, not taken as sft's default. `adjust` adds to
// the plan what the command's step holds beyond sft's (dpo: plan::PlanOptions::preference).
void resolve_auto_recompute(TrainConfig& config, bool asked,
                            const std::function<void(plan::PlanOptions&)>& adjust = {});

// sft and dpo (defined in cmd_sft.cpp): the output folder, --merge-output and an outside
// --metrics-file checked against the run before its memory plan or its processes start, so a
// refusal comes first and alone (run_folder.h). `world_size`: the job's processes.
void check_run_output_before_work(const TrainConfig& config, const std::string& command,
                                  const nlohmann::json& command_options, int world_size);
// What sft and dpo exit with: 0, kExitStoppedResumable after a stop signal, 1 when no step ran.
int exit_status(const TrainSummary& summary);

// Each cmd_*.cpp defines one add_*_command; register_all (commands.cpp) calls them all.
void add_eval_command(CLI::App& app, CommandList& commands);
void add_generate_command(CLI::App&, CommandList&);
void add_prepare_command(CLI::App&, CommandList&);
void add_tokenize_command(CLI::App&, CommandList&);

void add_sft_command(CLI::App& app, CommandList& commands);
void add_dpo_command(CLI::App& app, CommandList& commands);
void add_check_command(CLI::App& app, CommandList& commands);
void add_bench_command(CLI::App& app, CommandList& commands);
void add_plan_command(CLI::App& app, CommandList& commands);
void add_doctor_command(CLI::App& app, CommandList& commands);

// --mlp-tile-tokens's help (sft, dpo, check, bench, plan; parsed by parse_mlp_tile_tokens).
inline constexpr const char* kMlpTileTokensHelp =
    "run the SwiGLU MLPs over the tokens in tiles of N (16k = 16384): only one tile's [N, intermediate] tensors are "
    "live, for recomputing gate and up in backward; 0: untiled; auto: untiled unless --recompute auto finds that "
    "only tiled settings fit (docs/memory.md)";

// --checkpoint-stride's help (sft, dpo, check, bench, plan; DecoderOptions::checkpoint_stride).
inline constexpr const char* kCheckpointStrideHelp =
    "with --recompute all: keep only every Nth layer's input (layers 0, N, 2N, ...); backward regenerates the "
    "others by running the layers between forward again (one more layer forward each), for the longest rows; "
    "1: every layer's; --recompute auto tries 2 to 4 when nothing else fits (docs/memory.md)";

// --offload-layers's help (sft, dpo, check, bench, plan; DecoderOptions::offload_layers).
inline constexpr const char* kOffloadLayersHelp =
    "with --offload activations: offload only the first N layers' kept tensors and keep the later layers' on the GPU, "
    "for when host memory cannot hold every layer (-1: every recomputed layer but the last; --recompute auto "
    "chooses the fewest that fit; docs/memory.md)";

// --seq of bench and plan: "32768", "32k", "32k,64k,128k" (k = 1024).
std::vector<int64_t> parse_sequence_lengths(const std::string& text);

// The options that say what a run builds (train/run_assembly.h), declared once for every command
// that takes them (run_options.cpp): the same name, help and check in sft, dpo, check, bench and plan.
// Each binds to the command's own fields.
struct AdapterFlags {  // --lora-rank, --lora-alpha, --lora-targets, --full
  int64_t& lora_rank;
  double& lora_alpha;
  std::vector<std::string>& lora_targets;
  bool& full;
};
void add_adapter_options(CLI::App* cmd, const AdapterFlags& flags);
// --quantize, --double-quant, --quant-block-size (every command that loads or builds a model).
void add_quantize_options(CLI::App* cmd, std::string& quantize, bool& double_quant, int64_t& block_size);
struct MemoryFlags {  // --recompute, --recompute-layers, --offload, --offload-layers, --mlp-tile-tokens,
                      // --checkpoint-stride, --device-memory, --host-memory
  std::string& recompute;
  int64_t& recompute_layers;
  std::string& offload;
  int64_t& offload_layers;
  std::string& mlp_tile_tokens;
  int64_t& checkpoint_stride;
  std::string& device_memory;
  std::string& host_memory;
};
void add_memory_options(CLI::App* cmd, const MemoryFlags& flags);
void add_router_aux_loss_option(CLI::App* cmd, double& coefficient);  // --router-aux-loss-coef
struct MeshOptionFlags {  // --dp, --sp, --ulysses, --ring (0: not given)
  int& dp;
  int& sp;
  int& ulysses;
  int& ring;
};
void add_mesh_options(CLI::App* cmd, const MeshOptionFlags& flags);
void add_attention_option(CLI::App* cmd, std::string& attention);  // --attention (the CUDA backend's)
void add_dtype_option(CLI::App* cmd, std::string& dtype);          // --dtype

// The options of `spindle sft` (also taken by dpo and check), bound to a TrainConfig.
void add_train_options(CLI::App* cmd, TrainConfig& config);
// The loss and reference options of `spindle dpo` (also taken by check), defined in cmd_dpo.cpp.
void add_preference_options(CLI::App* cmd, DpoConfig& config);

void register_all(CLI::App& app, CommandList& commands);

// `sft --config FILE.yaml ...` → the file's options as flags (command-line flags win).
std::vector<std::string> expand_config_file(CLI::App& app, const std::vector<std::string>& args);

}  // namespace spindle::cli
