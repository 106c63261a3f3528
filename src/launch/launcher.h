// spindle's own launcher: `spindle <command> ... --nproc-per-node N` runs N processes of the same
// command on this machine, torchrun-style. Each child gets RANK, WORLD_SIZE, LOCAL_RANK,
// LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1, MASTER_PORT (a free port) and SPINDLE_LAUNCHER=1.
// Every output line of every child is forwarded with a "[rank N] " prefix (none when N = 1); a
// carriage return passes on at once, so a rank's progress bar redraws on the launcher's terminal
// (whose width the children get as SPINDLE_TERMINAL_COLUMNS). When a child fails (non-zero exit or
// a signal) the others get SIGTERM, then SIGKILL after a grace period, and the launcher returns the
// failing child's status. SIGTERM, SIGINT or SIGUSR1 sent to the launcher goes on to every child as
// it came (a training run then stops after its step with a checkpoint, train/stop_signal.h); a
// second one kills the children at once. When every child exits with kExitStoppedResumable
// (launch/exit_status.h) the launcher returns it too. Before it starts any child it runs
// the command's own check of the job (the mesh against the process count and the model's heads),
// so a job that cannot run fails once, with one message, instead of once per rank.
// docs/parallelism.md has the rules.
#pragma once

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace spindle {

// Checks a job of `nproc` processes before the launcher starts them; throws spindle::Error (the one
// message the user sees) when they could not run.
using LaunchCheck = std::function<void(int nproc)>;

struct LaunchOptions {
  std::string executable = "/proc/self/exe";  // the program each child runs
  std::chrono::milliseconds grace_period = std::chrono::seconds(10);  // SIGTERM → SIGKILL
  LaunchCheck check_before_start;             // none: nothing to check
};

// Runs `nproc` processes of `arguments` (arguments[0] becomes each child's argv[0]) and waits for
// all of them. Returns 0 when all succeed; otherwise the first failure's exit code (128 + signal
// for a signal) after a message on stderr naming the rank and how it died. Throws what
// options.check_before_start throws, with no process started.
int launch_local(int nproc, const std::vector<std::string>& arguments, const LaunchOptions& options = {});

// Called in main before the command runs. With `--nproc-per-node N` (or `=N`, or torchrun's
// `--nproc_per_node`) in argv: runs `check` (the parsed command's check of an N-process job), then
// launches the command without the flag and returns the exit code. Without it: returns nullopt (in
// a child of the launcher it also line-buffers stdout, so output arrives as it is printed). Throws
// spindle::Error for a malformed flag, a job the check refuses, or when this process is already one
// rank of a larger job.
std::optional<int> launch_if_requested(int argc, char** argv, const LaunchCheck& check = {});

// The argv without the launcher flag, and the process count it gave (nullopt when absent).
struct LauncherFlag {
  std::optional<int> nproc_per_node;
  std::vector<std::string> remaining_arguments;
};
LauncherFlag extract_launcher_flag(const std::vector<std::string>& arguments);

// A TCP port nobody listens on right now, below the kernel's ephemeral range when there is room
// (so no outgoing connection takes it before rank 0 listens), for MASTER_PORT.
int pick_free_port();
int ephemeral_port_low();  // from /proc/sys/net/ipv4/ip_local_port_range

}  // namespace spindle
