#include "cli/commands.h"

namespace spindle::cli {

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
}

}  // namespace spindle::cli
