#include "cli/commands.h"

namespace spindle::cli {

void register_all(CLI::App& app, CommandList& commands) {
  // One line per command.
}

}  // namespace spindle::cli
