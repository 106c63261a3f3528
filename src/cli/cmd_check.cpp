// spindle check: runs the first global batch of a configured job on the requested mesh and in one
// process, and says whether they agree (exit 0) or not (exit 1). Takes the options of `spindle sft`.
#include <cstdio>

#include "backend/cuda/cuda_options.h"
#include "cli/commands.h"
#include "train/check.h"
#include "train/setup.h"

namespace spindle::cli {

void add_check_command(CLI::App& app, CommandList& commands) {
  auto config = std::make_shared<TrainConfig>();
  auto options = std::make_shared<CheckOptions>();
  auto json = std::make_shared<bool>(false);
  auto config_file = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "check", "Compare one step on the requested mesh (--sp/--ulysses/--ring/--dp) with one process");
  cmd->add_option("--config", *config_file, "YAML file with the options of `spindle sft` (flags override it)");
  add_train_options(cmd, *config);
  cmd->add_option("--loss-tolerance", options->loss_tolerance,
                  "relative loss tolerance (default: f32 on the CPU 5x the measured F32 rounding, else 1e-5; f64 "
                  "1e-10; bf16 1e-2)");
  cmd->add_option("--grad-tolerance", options->grad_tolerance,
                  "relative tolerance per gradient tensor (default: f32 on the CPU 5x each tensor's F32 rounding, "
                  "measured against the same step in F64; f32 on a GPU 1e-4; f64 1e-9; bf16 5e-2)");
  cmd->add_flag("--json", *json, "print the report as one JSON line on stdout");
  commands.push_back({cmd, [config, options, json] {
                        const std::optional<CheckReport> report = run_check(*config, *options);
                        if (!report) return 0;  // other ranks: the main rank reports
                        if (*json) std::printf("%s\n", report->to_json().dump().c_str());
                        else std::printf("%s", report->to_text().c_str());
                        return report->passed ? 0 : 1;
                      },
                      [config](int world_size) {
                        const CudaAttention attention = parse_cuda_attention(config->attention);
                        if (config->device == "cpu") check_cuda_attention_off_gpu(attention, "--device cpu");
                        check_mesh_before_launch(config->mesh_flags(), config->model, world_size);
                      }});
}

}  // namespace spindle::cli
