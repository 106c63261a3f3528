// spindle prepare: tokenize a dataset (JSONL, Parquet, Arrow, a hub dataset) once into the memory-mapped form training reads.
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "cli/commands.h"
#include "data/prepared_dataset.h"

namespace spindle::cli {

namespace {

struct PrepareFlags {
  std::string data;
  std::string tokenizer;
  std::string output;
  int64_t max_length = 0;
  std::string format = "auto";
  std::string truncation = "truncate";
  bool skip_bad_samples = false;
  bool keep_without_targets = false;
  bool no_eos = false;
  bool labels_may_differ = false;
};

int run_prepare(const PrepareFlags& flags) {
  PrepareOptions options;
  options.data = flags.data;
  options.output_dir = flags.output;
  options.encode.format = parse_sample_format(flags.format);
  options.encode.append_eos = !flags.no_eos;
  options.encode.read.on_bad_sample =
      flags.skip_bad_samples ? BadSamplePolicy::kSkip : BadSamplePolicy::kFail;
  options.encode.read.require_labels_match_input_ids = !flags.labels_may_differ;
  options.fit.max_length = flags.max_length;
  options.fit.over_length = parse_over_length(flags.truncation);
  options.fit.drop_documents_without_targets = !flags.keep_without_targets;

  std::unique_ptr<TextEncoder> text_encoder;
  if (!flags.tokenizer.empty()) {
    text_encoder = load_text_encoder(flags.tokenizer);
    options.tokenizer_description = flags.tokenizer;
  }
  const PrepareReport report = prepare_dataset(options, text_encoder.get());
  std::printf("%s\n", report.summary().c_str());
  return 0;
}

}  // namespace

void add_prepare_command(CLI::App& app, CommandList& commands) {
  auto flags = std::make_shared<PrepareFlags>();
  CLI::App* sub = app.add_subcommand(
      "prepare", "Tokenize a dataset (JSONL, Parquet, Arrow, a hub dataset) once into a memory-mapped file that training reads");
  sub->add_option("--data", flags->data, "the dataset: a JSONL, Parquet or Arrow file, a folder of shards, or a hub id "
                                        "ORG/NAME in the local Hugging Face caches; a folder or hub id may end in "
                                        "[:CONFIG]:SPLIT (default train) (docs/usage.md)")->required();
  sub->add_option("--tokenizer", flags->tokenizer,
                  "model folder with tokenizer.json (not needed for pre-tokenized data)");
  sub->add_option("--output", flags->output, "directory that receives dataset.bin and dataset.json")
      ->required();
  sub->add_option("--max-length", flags->max_length, "longest document kept, in tokens")->required();
  sub->add_option("--format", flags->format,
                  "auto, pretokenized, text, prompt-completion, alpaca, messages or preference")
      ->capture_default_str();
  // --over-length as sft, dpo and eval name it; --truncation is its older name.
  sub->add_option("--over-length,--truncation", flags->truncation,
                  "over-long documents: truncate (keep the start), truncate-left (keep the end), "
                  "drop, or error")
      ->capture_default_str();
  sub->add_flag("--skip-bad-samples", flags->skip_bad_samples,
                "skip malformed samples (counted and reported) instead of stopping at the first");
  sub->add_flag("--keep-samples-without-targets", flags->keep_without_targets,
                "keep documents with no supervised token (they add nothing to the loss)");
  sub->add_flag("--no-eos", flags->no_eos, "do not append the EOS token to text samples");
  sub->add_flag("--labels-may-differ", flags->labels_may_differ,
                "accept pre-tokenized labels that differ from input_ids where supervised");
  commands.push_back({sub, [flags] { return run_prepare(*flags); }});
}

}  // namespace spindle::cli
