// spindle bench: tokens/s, MFU, peak memory and a time split of training steps on synthetic data
// (src/bench). Prints a table with the formulas it used, or JSON for scripts (--json).
#include <cstdio>
#include <functional>
#include <string>

#include "backend/cuda/cuda_options.h"
#include "bench/bench.h"
#include "cli/commands.h"
#include "comm/process_group.h"
#include "core/error.h"
#include "plan/auto_recompute.h"
#include "train/setup.h"

namespace spindle::cli {

namespace {

struct BenchArgs {
  bench::BenchOptions options;
  std::string seq = "32768";
  bool json = false;
  std::string json_file;
  std::string device_memory;
  std::string host_memory;
};

int run_bench_command(BenchArgs& args) {
  const ProcessGroupInfo group = process_group_from_environment();
  args.options.seq_lengths = parse_sequence_lengths(args.seq);
  if (args.options.device_index < 0) args.options.device_index = group.local_rank;
  // Each finished length is reported at once (stderr, and the JSON file rewritten), so a sweep
  // stopped by a time limit keeps what it measured.
  auto on_result = [&](const bench::BenchReport& partial) {
    const bench::BenchResult& r = partial.results.back();
    if (r.error.empty())
      std::fprintf(stderr, "bench: seq %lld: %.0f tokens/s, %.1f%% MFU\n", static_cast<long long>(r.seq),
                   r.tokens_per_s, 100 * r.mfu);
    else
      std::fprintf(stderr, "bench: seq %lld did not run: %s\n", static_cast<long long>(r.seq), r.error.c_str());
    if (!args.json_file.empty()) {
      std::FILE* f = std::fopen(args.json_file.c_str(), "w");
      if (!f) fail("cannot write --json-file {}", args.json_file);
      std::fprintf(f, "%s\n", bench::report_json(partial).dump(2).c_str());
      std::fclose(f);
    }
  };
  const bool main_rank = group.rank == 0;  // every rank runs the sweep; rank 0 reports
  if (main_rank)
    args.options.on_model_built = [](double seconds) { std::fprintf(stderr, "bench: model built in %.1f s\n", seconds); };
  if (!args.host_memory.empty() && args.options.recompute != "auto")
    fail("--host-memory is the host memory --recompute auto budgets offload with: give it with --recompute auto");
  if (args.options.recompute == "auto") {
    // Each length's setting from the plan of this run, before the length allocates anything.
    const int64_t device_bytes = args.device_memory.empty()
                                     ? plan::machine_device_memory(args.options.device, args.options.device_index)
                                     : plan::parse_memory_size(args.device_memory);
    const int64_t host_bytes = args.host_memory.empty() ? 0 : plan::parse_memory_size(args.host_memory, "--host-memory");
    const bench::BenchOptions& o = args.options;
    args.options.choose_recompute = [o, device_bytes, host_bytes, group, main_rank](int64_t seq,
                                                                                   bench::BenchOptions& chosen) {
      plan::PlanOptions p;
      p.host_memory_bytes = host_bytes;
      p.model = o.model;
      p.doc_length = o.doc_length;
      p.lora_rank = o.full ? 0 : o.lora_rank;
      p.lora_alpha = o.lora_alpha;
      p.lora_targets = o.lora_targets;
      p.full = o.full;
      p.quantize = o.quantize;
      p.double_quant = o.double_quant;
      p.quant_block_size = o.quant_block_size;
      p.optimizer = false;  // bench's step has no optimizer state
      p.router_aux_loss_coef = o.router_aux_loss_coef;
      p.device = o.device;
      p.mlp_tile_tokens = parse_mlp_tile_tokens(o.mlp_tile_tokens);
      p.world = group.world_size;
      p.dp = o.dp;
      p.sp = o.sp;
      p.ulysses = o.ulysses;
      p.ring = o.ring;
      const plan::AutoChoice choice = plan::choose_recompute(p, seq, device_bytes, o.offload == "activations");
      chosen.recompute = choice.setting.recompute;
      chosen.recompute_layers = choice.setting.recompute_layers;
      chosen.offload = choice.setting.offload ? "activations" : "none";
      chosen.offload_layers = choice.setting.offload_layers;
      chosen.mlp_tile_tokens = std::to_string(choice.setting.mlp_tile_tokens);
      chosen.checkpoint_stride = choice.setting.checkpoint_stride;
      if (main_rank)
        std::fprintf(stderr, "bench: seq %lld: %s\n", static_cast<long long>(seq), choice.summary(0).c_str());
    };
  }
  const bench::BenchReport report = bench::run_bench(
      args.options, main_rank ? std::function<void(const bench::BenchReport&)>(on_result) : nullptr);
  if (!main_rank) return 0;
  if (args.json)
    std::printf("%s\n", bench::report_json(report).dump(2).c_str());
  else
    std::printf("%s", bench::format_report(report).c_str());
  for (const auto& r : report.results)
    if (!r.error.empty()) return 1;
  return 0;
}

}  // namespace

std::vector<int64_t> parse_sequence_lengths(const std::string& text) {
  std::vector<int64_t> lengths;
  size_t start = 0;
  while (start <= text.size()) {
    const size_t comma = text.find(',', start);
    std::string item = text.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
    int64_t multiplier = 1;
    if (!item.empty() && (item.back() == 'k' || item.back() == 'K')) {
      multiplier = 1024;
      item.pop_back();
    } else if (!item.empty() && (item.back() == 'm' || item.back() == 'M')) {
      multiplier = 1024 * 1024;
      item.pop_back();
    }
    size_t used = 0;
    int64_t value = 0;
    try {
      value = std::stoll(item, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (item.empty() || used != item.size() || value <= 0)
      fail("--seq '{}': expected positive lengths separated by commas, e.g. 32768, 32k,64k or 1M (k = 1024 tokens, "
           "M = 1024k)",
           text);
    lengths.push_back(value * multiplier);
    if (comma == std::string::npos) break;
    start = comma + 1;
  }
  return lengths;
}

void add_bench_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<BenchArgs>();
  auto& o = args->options;
  o.device_index = -1;
  CLI::App* cmd = app.add_subcommand(
      "bench", "Training-step throughput, MFU, peak memory and time split on synthetic data (random weights)");
  cmd->add_option("--model", o.model, "model folder or its config.json (only the architecture is used)")->required();
  cmd->add_option("--seq", args->seq,
                  "sequence length(s), one causal document per step: 32768 or 32k,64k,1M (k = 1024, M = 1024k; "
                  "a sweep on the same weights; stops at the first that does not fit)")
      ->capture_default_str();
  cmd->add_option("--doc-length", o.doc_length,
                  "pack each step's row with documents of this many tokens (the last one shorter), as SFT "
                  "packing does; 0: one document per step")
      ->capture_default_str();
  add_adapter_options(cmd, {o.lora_rank, o.lora_alpha, o.lora_targets, o.full});
  add_quantize_options(cmd, o.quantize, o.double_quant, o.quant_block_size);
  add_memory_options(cmd, {o.recompute, o.recompute_layers, o.offload, o.offload_layers, o.mlp_tile_tokens,
                           o.checkpoint_stride, args->device_memory, args->host_memory});
  add_router_aux_loss_option(cmd, o.router_aux_loss_coef);
  cmd->add_option("--steps", o.steps, "timed steps per length")->capture_default_str();
  cmd->add_option("--warmup", o.warmup, "untimed steps first")->capture_default_str();
  cmd->add_option("--profile-steps", o.profile_steps,
                  "extra steps timed op by op for the time split (0: none; the timed steps never are)")
      ->capture_default_str();
  cmd->add_option("--op-table", o.op_table_rows,
                  "list the profiled step's N most costly ops (GEMMs by shape, with TFLOP/s); the JSON has all")
      ->capture_default_str();
  cmd->add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  add_attention_option(cmd, o.attention);
  cmd->add_option("--device-index", o.device_index, "CUDA device (default: LOCAL_RANK, else 0)");
  cmd->add_option("--threads", o.cpu_threads, "CPU threads with --device cpu (default: all)");
  cmd->add_option("--peak-tflops", o.peak_tflops, "MFU denominator (default: the GPU's dense BF16 peak)");
  cmd->add_option("--seed", o.seed, "seed of the random weights and tokens")->capture_default_str();
  add_mesh_options(cmd, {o.dp, o.sp, o.ulysses, o.ring});
  cmd->add_flag("--json", args->json, "print one JSON document instead of the table");
  cmd->add_option("--json-file", args->json_file, "also write the JSON document there (after every length)");
  commands.push_back({cmd, [args] { return run_bench_command(*args); },
                      [args](int world_size) {
                        const CudaAttention attention = parse_cuda_attention(args->options.attention);
                        if (args->options.device == "cpu") check_cuda_attention_off_gpu(attention, "--device cpu");
                        parallel::MeshFlags flags;  // 0: not given
                        if (args->options.dp) flags.dp = args->options.dp;
                        if (args->options.sp) flags.sp = args->options.sp;
                        if (args->options.ulysses) flags.ulysses = args->options.ulysses;
                        if (args->options.ring) flags.ring = args->options.ring;
                        check_mesh_before_launch(flags, args->options.model, world_size);
                      }});
}

}  // namespace spindle::cli
