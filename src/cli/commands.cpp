#include "cli/commands.h"

#include <string>

#include "io/hub_cache.h"

namespace spindle::cli {

namespace {

// The options that name a Hugging Face model (or adapter, or tokenizer) folder, in any command.
constexpr const char* kModelFolderOptions[] = {"--model", "--ref-model", "--tokenizer", "--adapter"};

// Every option naming a model folder also takes a hub id, ORG/NAME[@REVISION], found in the local
// Hugging Face cache (io/hub_cache.h); attached here once so that no command can miss it.
void accept_hub_ids(CLI::App& app) {
  for (CLI::App* command : app.get_subcommands({}))
    for (const char* name : kModelFolderOptions) {
      CLI::Option* option = command->get_option_no_throw(name);
      if (!option) continue;
      const std::string flag = name;
      option->transform(CLI::Validator(
          [flag](std::string& value) {
            value = io::resolve_model_reference(value, flag);
            return std::string();
          },
          "", "hub id"));
      option->description(option->get_description() + "; or a hub id ORG/NAME[@REVISION] in the local Hugging Face "
                                                       "cache (docs/usage.md)");
    }
}

}  // namespace

void register_all(CLI::App& app, CommandList& commands) {
  // One line per command.
  add_eval_command(app, commands);
  add_generate_command(app, commands);
  add_sft_command(app, commands);
  add_dpo_command(app, commands);
  add_check_command(app, commands);
  add_prepare_command(app, commands);
  add_tokenize_command(app, commands);
  add_bench_command(app, commands);
  add_plan_command(app, commands);
  add_doctor_command(app, commands);
  accept_hub_ids(app);
}

}  // namespace spindle::cli
