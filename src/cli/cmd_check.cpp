// spindle check: runs the first global batch of a configured job on the requested mesh and in one
// process, and says whether they agree (exit 0) or not (exit 1). Takes the options of `spindle sft`,
// and with --objective dpo those of `spindle dpo`: the step checked is then dpo's.
#include <cstdio>

#include "backend/cuda/cuda_options.h"
#include "core/error.h"
#include "cli/commands.h"
#include "train/check.h"
#include "train/dpo_trainer.h"
#include "train/objective.h"
#include "train/setup.h"

namespace spindle::cli {

void add_check_command(CLI::App& app, CommandList& commands) {
  auto preference = std::make_shared<DpoConfig>();  // its `train`: the options of sft
  TrainConfig* config = &preference->train;
  auto objective = std::make_shared<std::string>("sft");
  auto options = std::make_shared<CheckOptions>();
  auto json = std::make_shared<bool>(false);
  auto config_file = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand(
      "check", "Compare one step on the requested mesh (--sp/--ulysses/--ring/--dp) with one process");
  cmd->add_option("--config", *config_file, "YAML file with the options of `spindle sft` (flags override it)");
  add_train_options(cmd, *config);
  cmd->add_option("--objective", *objective,
                  "the step checked: sft (cross-entropy) or dpo (spindle dpo's, with --loss-type and its options on "
                  "preference data)")
      ->check(CLI::IsMember({"sft", "dpo"}))
      ->capture_default_str();
  add_preference_options(cmd, *preference);
  cmd->add_option("--loss-tolerance", options->loss_tolerance,
                  "relative loss tolerance (default: f32 on the CPU 5x the measured F32 rounding, else 1e-5; f64 "
                  "1e-10; bf16 1e-2)");
  cmd->add_option("--grad-tolerance", options->grad_tolerance,
                  "relative tolerance per gradient tensor (default: f32 on the CPU 5x each tensor's F32 rounding, "
                  "measured against the same step in F64; f32 on a GPU 1e-4; f64 1e-9; bf16 5e-2)");
  cmd->add_flag("--json", *json, "print the report as one JSON line on stdout");
  commands.push_back({cmd, [preference, objective, options, json] {
                        std::optional<CheckReport> report;
                        if (*objective == "dpo") {
                          preference->validate_preference();
                          report = run_check(preference->train, *options, DpoObjective(*preference));
                        } else {
                          const DpoConfig d;
                          const DpoConfig& p = *preference;
                          if (p.loss_type != d.loss_type || p.beta != d.beta || p.label_smoothing != d.label_smoothing ||
                              p.rpo_alpha != d.rpo_alpha || p.cpo_alpha != d.cpo_alpha ||
                              p.simpo_gamma != d.simpo_gamma || p.ref_model != d.ref_model ||
                              p.precompute_ref != d.precompute_ref)
                            fail("--loss-type, --beta and the other options of dpo's loss check dpo's step: give "
                                 "them with --objective dpo");
                          report = run_check(preference->train, *options);
                        }
                        if (!report) return 0;  // other ranks: the main rank reports
                        if (*json) std::printf("%s\n", report->to_json().dump().c_str());
                        else std::printf("%s", report->to_text().c_str());
                        return report->passed ? 0 : 1;
                      },
                      [config, preference](int world_size) {
                        const CudaAttention attention = parse_cuda_attention(config->attention);
                        if (config->device == "cpu") check_cuda_attention_off_gpu(attention, "--device cpu");
                        check_mesh_before_launch(config->mesh_flags(), config->model, world_size);
                        // The reference runs on the same mesh: its heads must suit it too.
                        if (!preference->ref_model.empty())
                          check_mesh_before_launch(config->mesh_flags(), preference->ref_model, world_size,
                                                   "--ref-model");
                      }});
}

}  // namespace spindle::cli
