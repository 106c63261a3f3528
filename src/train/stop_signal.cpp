#include "train/stop_signal.h"

#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "train/progress.h"

namespace spindle {

namespace {

constexpr int kStopSignals[] = {SIGTERM, SIGINT, SIGUSR1};

volatile sig_atomic_t g_first_signal = 0;
// The launcher that started this process (SPINDLE_LAUNCHER): what it forwards only repeats a signal.
pid_t g_launcher = 0;
bool g_announce = false;   // the main rank says what happens next; the others stay quiet
bool g_terminal = false;   // stderr shows a progress bar
bool g_installed = false;  // one watcher per process
struct sigaction g_previous[3];

void write_text(const char* text) { (void)!::write(2, text, std::strlen(text)); }

const char* first_signal_text(int signal) {
  switch (signal) {
    case SIGTERM: return "spindle: SIGTERM received: finishing this step, then saving a checkpoint (send it again to stop at once)\n";
    case SIGINT: return "spindle: SIGINT received: finishing this step, then saving a checkpoint (press Ctrl-C again to stop at once)\n";
    default: return "spindle: SIGUSR1 received: finishing this step, then saving a checkpoint (send SIGTERM to stop at once)\n";
  }
}

// On a terminal a progress bar may be on the line: cleared first, so the message starts the line.
void start_line() {
  if (g_terminal) write_text("\r\x1b[K");
}

// Async-signal-safe: it sets a flag, writes with write(2), and for a second signal restores the
// default action and raises the signal again, which ends the process as that signal does.
void on_stop_signal(int signal, siginfo_t* info, void*) {
  const bool forwarded = g_launcher > 0 && info && info->si_code == SI_USER && info->si_pid == g_launcher;
  if (g_first_signal == 0) {
    g_first_signal = signal;
    if (g_announce) {
      start_line();
      write_text(first_signal_text(signal));
    }
    return;
  }
  if (forwarded) return;
  start_line();
  write_text("spindle: second stop signal: stopping at once, without a checkpoint\n");
  // SIGUSR1 asks for a checkpoint; stopping at once without one is what SIGTERM's default does.
  const int final_signal = signal == SIGUSR1 ? SIGTERM : signal;
  struct sigaction default_action {};
  default_action.sa_handler = SIG_DFL;
  ::sigemptyset(&default_action.sa_mask);
  ::sigaction(final_signal, &default_action, nullptr);
  sigset_t unblock;
  ::sigemptyset(&unblock);
  ::sigaddset(&unblock, final_signal);
  ::sigprocmask(SIG_UNBLOCK, &unblock, nullptr);
  ::raise(final_signal);
}

}  // namespace

StopSignals::StopSignals() {
  SPINDLE_CHECK(!g_installed, "only one StopSignals may watch a process at a time");
  g_installed = true;
  g_first_signal = 0;
  g_launcher = std::getenv("SPINDLE_LAUNCHER") ? ::getppid() : 0;
  const char* rank = std::getenv("RANK");
  if (!rank) rank = std::getenv("SLURM_PROCID");  // srun without a launcher: its task number is the rank
  g_announce = !rank || std::strcmp(rank, "0") == 0;
  g_terminal = train::stderr_is_terminal();
  struct sigaction action {};
  action.sa_sigaction = on_stop_signal;
  // SA_RESTART: reads, writes and socket calls the signal interrupts carry on as if it had not come.
  action.sa_flags = SA_SIGINFO | SA_RESTART;
  ::sigemptyset(&action.sa_mask);
  for (int s : kStopSignals) ::sigaddset(&action.sa_mask, s);
  for (size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], &action, &g_previous[i]);
}

StopSignals::~StopSignals() {
  for (size_t i = 0; i < std::size(kStopSignals); ++i) ::sigaction(kStopSignals[i], &g_previous[i], nullptr);
  g_installed = false;
}

int StopSignals::received() const { return g_first_signal; }

void StopSignals::request(int signal) {
  if (g_first_signal == 0) g_first_signal = signal;
}

std::string signal_name(int signal) {
  switch (signal) {
    case SIGTERM: return "SIGTERM";
    case SIGINT: return "SIGINT";
    case SIGUSR1: return "SIGUSR1";
    default: return fmt::format("signal {}", signal);
  }
}

StopDecision agree_to_stop(Backend& backend, comm::Communicator* world, int received_signal) {
  std::vector<float> signals(world ? static_cast<size_t>(world->size()) : 1, 0.0f);
  const int rank = world ? world->rank() : 0;
  if (world) {
    // One slot per rank (small integers are exact in F32, the dtype every communicator sums).
    signals[static_cast<size_t>(rank)] = static_cast<float>(received_signal);
    Tensor slots = backend.empty(Shape{static_cast<int64_t>(signals.size())}, DType::F32);
    backend.copy_from_host(backend.default_stream(), signals.data(), slots);
    world->all_reduce_sum(backend.default_stream(), slots);
    backend.copy_to_host(backend.default_stream(), slots, signals.data());
  } else {
    signals[0] = static_cast<float>(received_signal);
  }
  StopDecision decision;
  std::vector<int> ranks;
  int first = 0;
  for (size_t r = 0; r < signals.size(); ++r) {
    const int s = static_cast<int>(signals[r]);
    if (s == 0) continue;
    if (!first) first = s;
    ranks.push_back(static_cast<int>(r));
  }
  if (ranks.empty()) return decision;
  decision.stop = true;
  decision.reason = signal_name(first);
  if (world) {
    std::string list;
    for (int r : ranks) list += fmt::format("{}{}", list.empty() ? "" : ", ", r);
    decision.reason += fmt::format(" (rank{} {})", ranks.size() == 1 ? "" : "s", list);
  }
  return decision;
}

}  // namespace spindle
