// spindle: one binary, one subcommand per user task. Each command lives in its own cmd_*.cpp and
// registers itself here; errors reach the user as one line saying what to change.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>
#include <exception>
#include <regex>

#include "cli/commands.h"
#include "core/error.h"
#include "launch/launcher.h"

int main(int argc, char** argv) {
  // `--nproc-per-node N` on any command re-runs it as N local processes (src/launch/launcher.h). The
  // flag is the launcher's: the command line is parsed without it, once, before any process starts.
  spindle::LauncherFlag launcher_flag;
  try {
    launcher_flag = spindle::extract_launcher_flag(std::vector<std::string>(argv, argv + argc));
  } catch (const spindle::Error& e) {
    std::fprintf(stderr, "spindle: error: %s\n", e.what());
    return 2;
  }
  CLI::App app{"spindle: long-context fine-tuning of Hugging Face decoder LLMs"};
  app.footer("Any command: --nproc-per-node N runs it as N processes on this machine (docs/parallelism.md).");
  app.set_version_flag("--version", std::string("spindle ") + SPINDLE_VERSION + " (" + SPINDLE_BUILD_FEATURES + ")");
  app.require_subcommand(1);
  spindle::cli::CommandList commands;
  spindle::cli::register_all(app, commands);
  try {
    const std::vector<std::string>& command_line = launcher_flag.remaining_arguments;  // [0]: the program
    std::vector<std::string> args(command_line.begin() + (command_line.empty() ? 0 : 1), command_line.end());
    args = spindle::cli::expand_config_file(app, args);  // `--config FILE.yaml` becomes flags
    std::reverse(args.begin(), args.end());              // CLI11 consumes a vector from the back
    app.parse(args);
  } catch (const CLI::ArgumentMismatch& e) {
    // CLI11 says "--lr: At Most 1 required but received 2" for an option given twice.
    static const std::regex repeated("(--[A-Za-z0-9_-]+): At Most 1 required but received ([0-9]+)");
    std::smatch m;
    const std::string what = e.what();
    if (!std::regex_search(what, m, repeated)) return app.exit(e) == 0 ? 0 : 2;
    std::fprintf(stderr, "spindle: error: %s is given %s times; give it once (on the command line it also replaces "
                 "the same key of a --config file)\n", m[1].str().c_str(), m[2].str().c_str());
    return 2;
  } catch (const CLI::ParseError& e) {
    // --help and --version end here with 0; every usage error exits 2, as spindle's own errors do.
    return app.exit(e) == 0 ? 0 : 2;
  } catch (const spindle::Error& e) {
    std::fprintf(stderr, "spindle: error: %s\n", e.what());
    return 2;
  }
  try {
    for (auto& command : commands) {
      if (!command.app->parsed()) continue;
      // With --nproc-per-node: the command's check of the job (its mesh), then the processes.
      if (auto exit_code = spindle::launch_if_requested(argc, argv, command.check_launch)) return *exit_code;
      return command.run();
    }
  } catch (const spindle::Error& e) {
    std::fprintf(stderr, "spindle: error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "spindle: unexpected error: %s\n", e.what());
    return 3;
  }
  return 0;
}
