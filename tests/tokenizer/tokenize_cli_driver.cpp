// The `tokenize` subcommand alone, run the way src/cli/main.cpp runs commands, so that its tests do
// not depend on every other command linking.
#include <CLI/CLI.hpp>

#include <cstdio>

#include "cli/commands.h"
#include "core/error.h"

int main(int argc, char** argv) {
  CLI::App app{"spindle tokenize (test driver)"};
  app.require_subcommand(1);
  spindle::cli::CommandList commands;
  spindle::cli::add_tokenize_command(app, commands);
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
  }
  return 0;
}
