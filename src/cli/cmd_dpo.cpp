// spindle dpo: preference training (DPO, IPO, RPO; CPO, SimPO and ORPO without a reference) with
// every option of `spindle sft` (data, parallelism, LoRA/full, checkpoints, metrics; YAML --config
// too) plus the loss and the reference.
#include <memory>

#include "cli/commands.h"
#include "plan/plan.h"
#include "train/dpo_trainer.h"
#include "train/setup.h"

namespace spindle::cli {

void add_preference_options(CLI::App* cmd, DpoConfig& config) {
  cmd->add_option("--loss-type", config.loss_type,
                  "sigmoid (DPO) or ipo against a reference model; cpo, simpo or orpo without one (TRL's "
                  "CPOTrainer and ORPOTrainer; docs/dpo.md)")
      ->capture_default_str();
  cmd->add_option("--beta", config.beta,
                  "strength of the preference term: DPO's pull towards the reference (IPO: tau; ORPO: lambda, the "
                  "weight of the odds-ratio term)")
      ->capture_default_str();
  cmd->add_option("--label-smoothing", config.label_smoothing,
                  "sigmoid, cpo and simpo: probability that a preference label is flipped (conservative DPO), in "
                  "[0, 0.5)")
      ->capture_default_str();
  cmd->add_option("--rpo-alpha", config.rpo_alpha,
                  "sigmoid and ipo: weight of the chosen responses' NLL (RPO; 0: off)")
      ->capture_default_str();
  cmd->add_option("--cpo-alpha", config.cpo_alpha,
                  "cpo and simpo: weight of the chosen responses' NLL (default: 1 for cpo, 0 for simpo; simpo with "
                  "a weight is CPO-SimPO)");
  cmd->add_option("--simpo-gamma", config.simpo_gamma, "simpo: the target reward margin gamma")->capture_default_str();
  cmd->add_option("--ref-model", config.ref_model,
                  "sigmoid and ipo: reference model folder (default: the policy with its LoRA adapters disabled; "
                  "with --full, the initial model)");
  cmd->add_flag("--precompute-ref", config.precompute_ref,
                "sigmoid and ipo: compute the reference log-probabilities of every pair once before training and "
                "cache them");
}

void add_dpo_command(CLI::App& app, CommandList& commands) {
  auto config = std::make_shared<DpoConfig>();
  auto config_file = std::make_shared<std::string>();
  CLI::App* cmd = app.add_subcommand("dpo", "Preference training (DPO, IPO, RPO, CPO, SimPO, ORPO) on chosen/rejected "
                                            "pairs");
  cmd->add_option("--config", *config_file, "YAML file with the same options (flags override it)");
  add_train_options(cmd, config->train);
  add_preference_options(cmd, *config);
  const CLI::Option* recompute_option = cmd->get_option("--recompute");
  commands.push_back({cmd,
                      [config, recompute_option] {
                        DpoConfig resolved = *config;
                        resolved.validate();
                        const ProcessGroupInfo process = process_group_from_environment();
                        if (process.rank == 0)  // before the memory plan: a refused folder is the one message
                          check_run_output_before_work(resolved.train, "dpo", resolved.identity_options(),
                                                       process.world_size);
                        if (resolved.train.recompute == "auto") {
                          // dpo's step beyond sft's: every micro-batch of the optimizer step laid out
                          // at once, the backward's own per-token weights, and a reference model
                          // whenever one is loaded (dpo_trainer.cpp: --ref-model, or a full fine-tune
                          // that resumes; counted for the whole run, which also covers
                          // --precompute-ref's pass before training).
                          std::string reference = resolved.ref_model;
                          if (reference.empty() && resolved.train.full && resolved.train.resume &&
                              uses_reference(resolved.loss_options().type))
                            reference = resolved.train.model;
                          const int64_t rows = resolved.train.grad_accum;
                          resolve_auto_recompute(resolved.train, recompute_option->count() > 0,
                                                 [&](plan::PlanOptions& p) {
                                                   p.preference = true;
                                                   p.rows_held = rows;
                                                   p.reference_model = reference;
                                                 });
                        }
                        return exit_status(run_dpo(resolved));
                      },
                      [config](int world_size) {
                        // The job's shape first (the mesh against the models' heads), then inputs and output.
                        const parallel::MeshFlags flags = config->train.mesh_flags();
                        check_mesh_before_launch(flags, config->train.model, world_size);
                        // The reference runs on the same mesh: its heads must suit it too.
                        if (!config->ref_model.empty())
                          check_mesh_before_launch(flags, config->ref_model, world_size, "--ref-model");
                        config->validate();
                        check_run_output_before_work(config->train, "dpo", config->identity_options(), world_size);
                      }});
}

}  // namespace spindle::cli
