// spindle eval: the loss of a model (and adapter) on pre-tokenized data, normalised exactly as
// training normalises it (docs/design.md §2.2): Σ loss_scale·CE over supervised targets / their number.
#include <chrono>
#include <cstdio>
#include <nlohmann/json.hpp>
#include <string>

#include "backend/backend.h"
#include "cli/commands.h"
#include "data/packing.h"
#include "data/pretokenized.h"
#include "io/checkpoint.h"
#include "model/decoder.h"
#include "train/setup.h"
#include "train/trainer.h"

namespace spindle::cli {

namespace {

struct EvalArgs {
  std::string model, adapter, data, device = "auto", dtype = "auto", over_length = "truncate";
  int64_t max_length = 4096;
  int64_t batch_tokens = 0;
  int threads = 0;
  std::string quantize;
  bool double_quant = false;
  int64_t quant_block_size = 64;
  bool no_packing = false, skip_bad = false;
};

int run_eval(const EvalArgs& args) {
  const auto start = std::chrono::steady_clock::now();
  if (args.max_length <= 0) fail("--max-length must be positive, got {}", args.max_length);
  const QuantizeOptions quantize = parse_quantize_options(args.quantize, args.double_quant, args.quant_block_size);
  const ComputeDevice device = choose_device(args.device, args.dtype, ProcessGroupInfo{});
  const DType dtype = device.dtype;
  auto backend = make_backend(device, args.threads);
  const ModelConfig config = ModelConfig::from_file(args.model);
  ModelWeights weights = ModelWeights::load(*backend, config, io::Checkpoint(args.model), dtype, quantize);
  if (!args.adapter.empty()) weights.load_peft_adapter(*backend, args.adapter);

  ReadOptions read;
  read.vocab_size = config.vocab_size;
  read.on_bad_sample = args.skip_bad ? BadSamplePolicy::kSkip : BadSamplePolicy::kFail;
  ReadStats read_stats;
  std::vector<Document> documents = read_pretokenized_jsonl(args.data, read, &read_stats);
  PackOptions pack;
  pack.max_length = args.max_length;
  pack.packing = !args.no_packing;
  pack.over_length = parse_over_length(args.over_length);
  pack.drop_documents_without_targets = true;
  PackStats pack_stats;
  std::vector<PackedRow> rows = pack_documents(documents, pack, &pack_stats);
  std::fprintf(stderr, "%s\n%s\n", read_stats.summary().c_str(), pack_stats.summary().c_str());

  const int64_t row_count = static_cast<int64_t>(rows.size());
  Decoder decoder(*backend, weights);
  const EvalResult result =
      evaluate(*backend, decoder, dtype, std::move(rows), args.batch_tokens > 0 ? args.batch_tokens : args.max_length);
  if (result.num_items == 0) fail("{} has no supervised target: nothing to evaluate (check labels / loss_mask)", args.data);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  nlohmann::ordered_json out;
  out["loss"] = result.loss;
  out["num_items"] = result.num_items;
  out["documents"] = pack_stats.documents_packed;
  out["rows"] = row_count;
  out["tokens"] = result.tokens;
  out["seconds"] = seconds;
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace

void add_eval_command(CLI::App& app, CommandList& commands) {
  auto args = std::make_shared<EvalArgs>();
  CLI::App* cmd = app.add_subcommand("eval", "Loss of a model (and adapter) on pre-tokenized JSONL data");
  cmd->add_option("--model", args->model, "Hugging Face model folder (config.json, *.safetensors)")->required();
  cmd->add_option("--adapter", args->adapter, "PEFT LoRA adapter folder to apply");
  add_quantize_options(cmd, args->quantize, args->double_quant, args->quant_block_size);
  cmd->add_option("--data", args->data, "JSONL with input_ids and labels (-100 = unsupervised) or loss_mask, "
                                        "optional loss_scale")->required();
  cmd->add_option("--max-length", args->max_length, "tokens per packed row")->capture_default_str();
  cmd->add_option("--over-length", args->over_length, "documents longer than --max-length: truncate, "
                                                      "truncate-left, drop or error")->capture_default_str();
  cmd->add_flag("--no-packing", args->no_packing, "one document per row");
  cmd->add_option("--batch-tokens", args->batch_tokens, "tokens per forward pass (default: --max-length)");
  cmd->add_option("--device", args->device, "cpu, cuda (GPU 0) or auto (CUDA when built with it and a GPU is visible)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))->capture_default_str();
  cmd->add_option("--dtype", args->dtype, "auto (cpu: f32, cuda: bf16), f32, f64 (cpu) or bf16 (cuda)")
      ->check(CLI::IsMember({"auto", "f32", "f64", "bf16"}))->capture_default_str();
  cmd->add_option("--threads", args->threads, "CPU threads (default: all)");
  cmd->add_flag("--skip-bad-samples", args->skip_bad, "skip malformed lines (counted and reported) instead of failing");
  commands.push_back({cmd, [args] { return run_eval(*args); }});
}

}  // namespace spindle::cli
