// spindle plan: the predicted peak memory of a training step per rank, before anything is
// allocated (src/plan). Prints a table of what the peak consists of, or JSON (--json) whose
// peak_allocated_bytes is comparable to `spindle bench --json`'s field of that name.
#include <cstdio>
#include <memory>
#include <string>

#include "cli/commands.h"
#include "model/recompute.h"
#include "core/error.h"
#include "plan/auto_recompute.h"
#include "plan/plan.h"

namespace spindle::cli {

namespace {

struct PlanArgs {
  plan::PlanOptions options;
  std::string seq = "32768";
  bool json = false;
  bool bench_step = false;
  bool max_seq = false;
  std::string offload = "none";
  std::string mlp_tile_tokens = "auto";
  std::string device_memory;
  std::string host_memory;
};

int run_plan_command(PlanArgs& args) {
  args.options.seq_lengths = parse_sequence_lengths(args.seq);
  if (args.bench_step) args.options.optimizer = false;
  args.options.offload = args.offload == "activations";
  if (args.offload != "none" && args.offload != "activations") parse_offload(args.offload, RecomputeMode::All);
  args.options.mlp_tile_tokens = parse_mlp_tile_tokens(args.mlp_tile_tokens);
  if (args.options.recompute == "auto") check_left_to_auto(args.options.offload_layers, args.options.checkpoint_stride);
  if (!args.options.preference && (args.options.rows_held != 1 || !args.options.reference_model.empty()))
    fail("--grad-accum and --ref-model describe dpo's step: give them with --dpo (sft's step holds one row at a time)");
  if (args.options.rows_held < 1) fail("--grad-accum must be at least 1, got {}", args.options.rows_held);
  int64_t device_bytes = 0;
  if (!args.device_memory.empty()) {
    device_bytes = plan::parse_memory_size(args.device_memory);
    args.options.device_memory_gib = static_cast<double>(device_bytes) / (int64_t{1} << 30);
  }
  if (!args.host_memory.empty()) args.options.host_memory_bytes = plan::parse_memory_size(args.host_memory, "--host-memory");
  if (args.max_seq) {
    // The longest row that fits, with the setting given, or with auto the one that needs least.
    if (device_bytes == 0) device_bytes = plan::machine_device_memory(args.options.device, 0);
    if (device_bytes <= 0) fail("--max-seq needs the device's memory: give --device-memory (bytes or e.g. 80GiB)");
    // With auto the settings that need least, keeping every layer's input and with sparse checkpoints
    // (what --recompute auto tries last): the longest of them.
    const bool automatic = args.options.recompute == "auto";
    const int64_t usable = plan::usable_memory(device_bytes, args.options.device);
    constexpr int64_t kLimit = int64_t{1} << 26;
    int64_t peak = 0, host = 0, every_input = 0, longest = 0;
    plan::RecomputeSetting chosen;
    if (automatic) {
      longest = plan::longest_fitting_seq_auto(args.options, usable, kLimit, &peak, &host, &chosen, &every_input);
    } else {
      const plan::RecomputeSetting setting{args.options.recompute, args.options.recompute_layers, args.options.offload,
                                           args.options.offload_layers,
                                           mlp_tile_tokens_to_run(args.options.mlp_tile_tokens),
                                           args.options.checkpoint_stride};
      chosen = setting;
      longest = plan::longest_fitting_seq(args.options, setting, usable, kLimit, &peak, &host, &chosen);
    }
    if (args.json) {
      nlohmann::ordered_json j;
      j["model"] = args.options.model;
      j["device_memory_bytes"] = device_bytes;
      j["usable_memory_bytes"] = usable;
      j["recompute"] = chosen.recompute;
      j["recompute_layers"] = chosen.recompute_layers;
      j["offload"] = chosen.offload ? "activations" : "none";
      j["offload_layers"] = chosen.offload_layers;
      j["mlp_tile_tokens"] = chosen.mlp_tile_tokens;
      j["checkpoint_stride"] = chosen.checkpoint_stride;
      j["max_seq"] = longest;
      if (automatic) j["max_seq_every_input_kept"] = every_input;
      j["peak_allocated_bytes"] = peak;
      j["offload_host_bytes"] = host;
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      std::printf("longest row that fits %s per device (%s usable) with %s: %lld tokens (peak %s%s)\n",
                  plan::format_bytes(device_bytes).c_str(), plan::format_bytes(usable).c_str(),
                  chosen.describe().c_str(), static_cast<long long>(longest), plan::format_bytes(peak).c_str(),
                  chosen.offload ? (", " + plan::format_bytes(host) + " of host memory").c_str() : "");
      if (automatic && chosen.checkpoint_stride > 1)
        std::printf("keeping every layer's input (--checkpoint-stride 1): %lld tokens\n",
                    static_cast<long long>(every_input));
    }
    return 0;
  }
  if (args.options.recompute != "auto") {
    const plan::PlanReport report = plan::run_plan(args.options);
    if (args.json) std::printf("%s\n", plan::plan_json(report).dump(2).c_str());
    else std::printf("%s", plan::format_plan(report).c_str());
    return 0;
  }
  // What sft and bench would choose for each length, then that length's plan.
  if (device_bytes == 0) device_bytes = plan::machine_device_memory(args.options.device, 0);
  nlohmann::ordered_json doc;
  for (int64_t seq : args.options.seq_lengths) {
    const plan::AutoChoice choice = plan::choose_recompute(args.options, seq, device_bytes, args.options.offload);
    plan::PlanOptions chosen = args.options;
    chosen.seq_lengths = {seq};
    chosen.recompute = choice.setting.recompute;
    chosen.recompute_layers = choice.setting.recompute_layers;
    chosen.offload = choice.setting.offload;
    chosen.offload_layers = choice.setting.offload_layers;
    chosen.mlp_tile_tokens = choice.setting.mlp_tile_tokens;
    chosen.checkpoint_stride = choice.setting.checkpoint_stride;
    const plan::PlanReport report = plan::run_plan(chosen);
    if (args.json) {
      nlohmann::ordered_json j = plan::plan_json(report);
      if (doc.is_null()) {
        doc = j;
        doc["recompute"] = "auto";
        doc["device_memory_bytes"] = device_bytes;
        doc["usable_memory_bytes"] = choice.usable_bytes;
        doc["results"] = nlohmann::ordered_json::array();
      }
      nlohmann::ordered_json r = j["results"][0];
      r["recompute_chosen"] = choice.setting.recompute;
      r["recompute_layers_chosen"] = choice.setting.recompute_layers;
      r["offload_chosen"] = choice.setting.offload ? "activations" : "none";
      r["offload_layers_chosen"] = choice.setting.offload_layers;
      r["mlp_tile_tokens_chosen"] = choice.setting.mlp_tile_tokens;
      r["checkpoint_stride_chosen"] = choice.setting.checkpoint_stride;
      doc["results"].push_back(r);
    } else {
      std::printf("seq %lld: %s\n", static_cast<long long>(seq), choice.summary(report.config.num_layers).c_str());
      std::printf("%s\n", plan::format_plan(report).c_str());
    }
  }
  if (args.json) std::printf("%s\n", doc.dump(2).c_str());
  return 0;
}

}  // namespace

void add_plan_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<PlanArgs>();
  auto& o = args->options;
  CLI::App* cmd = app.add_subcommand(
      "plan", "Predicted peak memory of a training step per rank, before anything is allocated (no GPU needed)");
  cmd->add_option("--model", o.model, "model folder or its config.json (only the architecture is used)")->required();
  cmd->add_option("--seq", args->seq, "tokens per row: 32768 or 32k,64k,1M (k = 1024, M = 1024k)")->capture_default_str();
  cmd->add_option("--doc-length", o.doc_length, "rows packed with documents of this many tokens (0: one document)");
  add_adapter_options(cmd, {o.lora_rank, o.lora_alpha, o.lora_targets, o.full});
  add_quantize_options(cmd, o.quantize, o.double_quant, o.quant_block_size);
  add_memory_options(cmd, {o.recompute, o.recompute_layers, args->offload, o.offload_layers, args->mlp_tile_tokens,
                           o.checkpoint_stride, args->device_memory, args->host_memory});
  cmd->add_flag("--dpo", o.preference,
                "plan dpo's step instead of sft's: every micro-batch of the optimizer step laid out at once "
                "(--grad-accum) and the backward's own per-token weights");
  cmd->add_option("--grad-accum", o.rows_held, "with --dpo: micro-batches per optimizer step (dpo's --grad-accum)")
      ->capture_default_str();
  cmd->add_option("--ref-model", o.reference_model,
                  "with --dpo: a reference model folder held beside the policy (dpo's --ref-model; default: the "
                  "policy with its adapters disabled, or cached log-probabilities, which hold nothing more)");
  add_router_aux_loss_option(cmd, o.router_aux_loss_coef);
  cmd->add_flag("--bench-step", args->bench_step,
                "leave out the optimizer state, as `spindle bench`'s step does (to compare with its peak)");
  cmd->add_option("--device", o.device, "the device planned for: cuda (bf16) or cpu (f32)")->capture_default_str();
  cmd->add_option("--gpu", o.gpu,
                  "the kind of device whose measured rates predict the step time and rank --recompute auto's "
                  "settings: h100, h200 or cpu (default: this machine's GPU, estimated from its properties when it "
                  "has no measured rates; h100 when no GPU is visible; docs/perf.md, step-time model)");
  add_dtype_option(cmd, o.dtype);
  cmd->add_option("--world", o.world, "processes (GPUs) of the job, as --nproc-per-node × nodes would start")
      ->capture_default_str();
  add_mesh_options(cmd, {o.dp, o.sp, o.ulysses, o.ring});
  cmd->add_flag("--max-seq", args->max_seq,
                "print the longest row that fits --device-memory (up to 64M tokens) with the --recompute / --offload "
                "/ --mlp-tile-tokens / --checkpoint-stride given; with auto, recompute all with offload and "
                "(--mlp-tile-tokens auto) the MLP in 16k-token tiles, keeping every layer's input or every 2nd to 4th "
                "(--checkpoint-stride): the longest of these");
  cmd->add_flag("--json", args->json, "print one JSON document instead of the table");
  commands.push_back({cmd, [args] { return run_plan_command(*args); }});
}

}  // namespace spindle::cli
