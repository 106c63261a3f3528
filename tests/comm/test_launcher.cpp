// The launcher end to end: launch_probe is built with the same main hook as spindle, run with
// --nproc-per-node, and its output and exit status are checked; spindle itself for the check of the
// mesh before any rank starts.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/error.h"
#include "launch/launcher.h"
#include "support/tiny_model.h"

namespace spindle {
namespace {

using Clock = std::chrono::steady_clock;

struct ProbeRun {
  int status = 0;
  std::string out, err;
  double seconds = 0;
  int exit_code() const { return WIFEXITED(status) ? WEXITSTATUS(status) : -1; }
};

std::string slurp(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs `program` with `arguments`, outside any launcher's job.
ProbeRun run_program(const std::string& program, std::vector<std::string> arguments) {
  arguments.insert(arguments.begin(), program);
  std::string dir = ::testing::TempDir();
  std::string out_path = dir + "/probe_out_" + std::to_string(::getpid());
  std::string err_path = dir + "/probe_err_" + std::to_string(::getpid());
  auto start = Clock::now();
  pid_t pid = ::fork();
  if (pid == 0) {
    int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::alarm(60);
    std::vector<char*> argv;
    for (auto& a : arguments) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::unsetenv("RANK");
    ::unsetenv("WORLD_SIZE");
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  ProbeRun run;
  ::waitpid(pid, &run.status, 0);
  run.seconds = std::chrono::duration<double>(Clock::now() - start).count();
  run.out = slurp(out_path);
  run.err = slurp(err_path);
  return run;
}

ProbeRun run_probe(std::vector<std::string> arguments) { return run_program(LAUNCH_PROBE, std::move(arguments)); }

size_t count(const std::string& text, const std::string& part) {
  size_t n = 0;
  for (size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + part.size())) ++n;
  return n;
}

std::vector<std::string> sorted_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream s(text);
  for (std::string line; std::getline(s, line);) lines.push_back(line);
  std::sort(lines.begin(), lines.end());
  return lines;
}

TEST(Launcher, StartsRanksWithTheirEnvironmentAndPrefixesOutput) {
  ProbeRun run = run_probe({"ok", "--nproc-per-node", "3", "--extra=1"});
  ASSERT_EQ(run.exit_code(), 0) << run.err;
  auto lines = sorted_lines(run.out);
  ASSERT_EQ(lines.size(), 6u) << run.out;
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(lines[2 * rank], fmt::format("[rank {}] args: ok --extra=1", rank));
    EXPECT_TRUE(lines[2 * rank + 1].starts_with(fmt::format("[rank {}] rank {} of 3, local {} of 3, 127.0.0.1:", rank,
                                                            rank, rank)))
        << lines[2 * rank + 1];
  }
  EXPECT_EQ(sorted_lines(run.err), (std::vector<std::string>{"[rank 0] note from 0", "[rank 1] note from 1",
                                                             "[rank 2] note from 2"}));
}

TEST(Launcher, OneProcessIsNotPrefixedAndPartialLinesAreKept) {
  ProbeRun run = run_probe({"--nproc-per-node=1", "partial"});
  EXPECT_EQ(run.exit_code(), 0);
  EXPECT_EQ(run.out, "no newline at the end\n");
  run = run_probe({"--nproc_per_node", "2", "partial"});
  EXPECT_EQ(sorted_lines(run.out),
            (std::vector<std::string>{"[rank 0] no newline at the end", "[rank 1] no newline at the end"}));
}

TEST(Launcher, FailingRankStopsTheOthersAndIsNamed) {
  ProbeRun run = run_probe({"--nproc-per-node", "4", "fail", "2", "5"});
  EXPECT_EQ(run.exit_code(), 5) << run.err;
  EXPECT_LT(run.seconds, 8.0);
  EXPECT_NE(run.err.find("[rank 2] rank 2 giving up\n"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("spindle launcher: rank 2 (pid "), std::string::npos) << run.err;
  EXPECT_NE(run.err.find(") exited with code 5; stopping the other 3 ranks\n"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("spindle launcher: failed: rank 2 (pid"), std::string::npos) << run.err;
  EXPECT_NE(run.err.find("rank 0 was killed by signal 15 (Terminated)"), std::string::npos) << run.err;
}

TEST(Launcher, RankKilledBySignalIsReported) {
  ProbeRun run = run_probe({"--nproc-per-node", "2", "signal", "1"});
  EXPECT_EQ(run.exit_code(), 128 + 9) << run.err;
  EXPECT_NE(run.err.find(") was killed by signal 9 (Killed); stopping the other 1 rank\n"), std::string::npos)
      << run.err;
}

TEST(Launcher, RanksIgnoringSigtermAreKilledAfterTheGracePeriod) {
  LaunchOptions options;
  options.executable = LAUNCH_PROBE;
  options.grace_period = std::chrono::milliseconds(300);
  auto start = Clock::now();
  int code = launch_local(3, {LAUNCH_PROBE, "fail-others-ignore-term", "0"}, options);
  EXPECT_EQ(code, 4);
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 5.0);
}

TEST(Launcher, ChildrenRendezvousAndReduce) {
  if (!SPINDLE_HAVE_GLOO) GTEST_SKIP() << "built without Gloo";
  ProbeRun run = run_probe({"allreduce", "--nproc-per-node", "4"});
  EXPECT_EQ(run.exit_code(), 0) << run.err;
  EXPECT_EQ(sorted_lines(run.out),
            (std::vector<std::string>{"[rank 0] sum 10", "[rank 1] sum 10", "[rank 2] sum 10", "[rank 3] sum 10"}));
}

TEST(Launcher, PicksListenablePortsBelowTheEphemeralRange) {
  // Outgoing connections take ephemeral ports; a store port from that range can be taken between
  // the pick and rank 0's listen (seen once on the GPU host).
  const int low = ephemeral_port_low();
  for (int i = 0; i < 20; ++i) {
    const int port = pick_free_port();
    if (low > 21000) {
      EXPECT_LT(port, low);
    }
    EXPECT_GT(port, 0);
    EXPECT_LT(port, 65536);
  }
}

TEST(Launcher, FlagErrors) {
  ProbeRun run = run_probe({"ok", "--nproc-per-node", "zero"});
  EXPECT_EQ(run.exit_code(), 2);
  EXPECT_EQ(run.err,
            "spindle: error: --nproc-per-node needs a positive number of processes (e.g. --nproc-per-node 4, one per "
            "GPU), got 'zero'\n");
  run = run_probe({"ok", "--nproc-per-node"});
  EXPECT_EQ(run.err, "spindle: error: --nproc-per-node needs a number of processes (e.g. --nproc-per-node 4)\n");

  auto flag = extract_launcher_flag({"spindle", "sft", "--nproc-per-node=8", "--sp", "4", "--", "--nproc-per-node"});
  EXPECT_EQ(flag.nproc_per_node, 8);
  EXPECT_EQ(flag.remaining_arguments,
            (std::vector<std::string>{"spindle", "sft", "--sp", "4", "--", "--nproc-per-node"}));
  EXPECT_FALSE(extract_launcher_flag({"spindle", "sft"}).nproc_per_node.has_value());
}

TEST(Launcher, AJobItsCheckRefusesStartsNoProcess) {
  ProbeRun run = run_probe({"refuse", "--nproc-per-node", "3"});
  EXPECT_EQ(run.exit_code(), 2);
  EXPECT_EQ(run.err, "spindle: error: the probe refuses a job of 3 processes\n");
  EXPECT_EQ(run.out, "") << "a rank started";
  run = run_probe({"refuse"});  // no launcher: no check, the process runs
  EXPECT_EQ(run.exit_code(), 0);
  EXPECT_EQ(run.out, "rank 0 started\n");
}

// A model folder holding only config.json: the launcher reads the heads from it.
std::filesystem::path model_with_heads(const std::string& name, int q_heads, int kv_heads) {
  const auto dir = std::filesystem::path(::testing::TempDir()) / ("launcher_model_" + std::to_string(::getpid()) + name);
  spindle::test::write_config(dir, {.model_type = "qwen2",
                                   .hidden_size = 8 * q_heads,
                                   .intermediate_size = 32,
                                   .num_layers = 1,
                                   .num_heads = q_heads,
                                   .num_kv_heads = kv_heads,
                                   .rms_norm_eps = 1e-6});
  return dir;
}

// spindle's mesh errors come from the launcher, once, before any rank starts: no "[rank N]"
// line, no launcher report of a dead rank, no output folder.
void expect_one_error_and_no_rank(const ProbeRun& run, const std::string& error, const std::filesystem::path& output) {
  EXPECT_EQ(run.exit_code(), 2) << run.err;
  EXPECT_EQ(count(run.err, "error:"), 1u) << run.err;
  EXPECT_NE(run.err.find("spindle: error: " + error), std::string::npos) << run.err;
  EXPECT_EQ(run.err.find("[rank"), std::string::npos) << run.err;
  EXPECT_EQ(run.out.find("[rank"), std::string::npos) << run.out;
  EXPECT_EQ(run.err.find("spindle launcher:"), std::string::npos) << run.err;
  EXPECT_FALSE(std::filesystem::exists(output)) << "a rank started and made " << output;
}

TEST(Launcher, SpindleChecksTheMeshBeforeStartingRanks) {
  const auto model = model_with_heads("q4kv2", 4, 2);
  const auto output = model / "out";
  const std::vector<std::string> job = {"--model", model.string(), "--data", (model / "train.jsonl").string(),
                                        "--output", output.string(), "--device", "cpu"};
  auto with = [&](std::string command, std::vector<std::string> extra) {
    std::vector<std::string> arguments = {std::move(command)};
    arguments.insert(arguments.end(), job.begin(), job.end());
    arguments.insert(arguments.end(), extra.begin(), extra.end());
    return arguments;
  };
  // sp does not divide the processes.
  expect_one_error_and_no_rank(run_program(SPINDLE_CLI, with("sft", {"--nproc-per-node", "3", "--sp", "2"})),
                               "--sp 2 does not divide the 3 processes of this job", output);
  // dp · sp is not the process count.
  expect_one_error_and_no_rank(
      run_program(SPINDLE_CLI, with("sft", {"--nproc-per-node", "4", "--sp", "2", "--dp", "1"})),
      "--dp 1 × --sp 2 = 2, but this job has 4 processes", output);
  // ulysses · ring is not sp.
  expect_one_error_and_no_rank(
      run_program(SPINDLE_CLI, with("check", {"--nproc-per-node", "4", "--sp", "4", "--ulysses", "2", "--ring", "1"})),
      "--ulysses 2 × --ring 1 = 2, but --sp is 4", output);
  // Ulysses needs a degree that divides the heads: 4 query heads cannot split 8 ways.
  expect_one_error_and_no_rank(run_program(SPINDLE_CLI, with("sft", {"--nproc-per-node", "8", "--ulysses", "8"})),
                               "--ulysses 8 does not divide the 4 query heads of this model", output);
  // DPO's reference model shares the mesh: its heads are checked too.
  const auto reference = model_with_heads("q3kv3", 3, 3);
  expect_one_error_and_no_rank(
      run_program(SPINDLE_CLI, with("dpo", {"--nproc-per-node", "2", "--ulysses", "2", "--ref-model", reference.string()})),
      "--ulysses 2 does not divide the 3 query heads", output);
  std::filesystem::remove_all(model);
  std::filesystem::remove_all(reference);
}

TEST(Launcher, RefusesInsideAnotherLaunchersJob) {
  ::setenv("RANK", "0", 1);
  ::setenv("WORLD_SIZE", "2", 1);
  ::setenv("MASTER_ADDR", "127.0.0.1", 1);
  ::setenv("MASTER_PORT", "29999", 1);
  std::vector<std::string> arguments{"probe", "--nproc-per-node", "2", "ok"};
  std::vector<char*> argv;
  for (auto& a : arguments) argv.push_back(a.data());
  try {
    launch_if_requested(static_cast<int>(argv.size()), argv.data());
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "--nproc-per-node starts processes on this machine, but this process is already rank 0 of 2 (local "
                 "0 of 2), rendezvous 127.0.0.1:29999, from torchrun-style environment; drop --nproc-per-node and let "
                 "that launcher start one process per GPU");
  }
  for (const char* name : {"RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
}

}  // namespace
}  // namespace spindle
