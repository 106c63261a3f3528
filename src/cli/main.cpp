// spindle: one binary, one subcommand per user task. Each command lives in its own cmd_*.cpp and
// registers itself here; errors reach the user as one line saying what to change.
#include <CLI/CLI.hpp>

#include <cstdio>
#include <exception>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"spindle: long-context fine-tuning of Hugging Face decoder LLMs"};
  app.require_subcommand(1);
  spindle::cli::CommandList commands;
  spindle::cli::register_all(app, commands);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    for (auto& command : commands)
      if (command.app->parsed()) return command.run();
  } catch (const spindle::Error& e) {
    std::fprintf(stderr, "spindle: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spindle: unexpected error: %s\n", e.what());
    return 3;
  }
  return 0;
}
