#include "launch/launcher.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <fmt/format.h>

#include "comm/process_group.h"
#include "comm/tcp_store.h"
#include "core/error.h"
#include "launch/exit_status.h"

extern char** environ;

namespace spindle {

namespace {

using Clock = std::chrono::steady_clock;

constexpr const char* kFlagSpellings[] = {"--nproc-per-node", "--nproc_per_node"};

int parse_process_count(const std::string& flag, const std::string& text) {
  int value = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
  if (ec != std::errc{} || end != text.data() + text.size() || value < 1 || value > 4096)
    fail("{} needs a positive number of processes (e.g. {} 4, one per GPU), got '{}'", flag, flag, text);
  return value;
}

// Variables that would make a child believe it belongs to another launcher's job.
constexpr const char* kInheritedJobVariables[] = {
    "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SPINDLE_STORE_PORT",
    "SPINDLE_LAUNCHER", "SPINDLE_TERMINAL_COLUMNS", "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "ROLE_RANK"};

// The width a rank's lines have on the launcher's terminal, after the rank prefix; 0 when the
// launcher's stderr is no terminal.
int forwarded_terminal_columns(int prefix_width) {
  if (::isatty(STDERR_FILENO) != 1) return 0;
  winsize size{};
  const int columns = ::ioctl(STDERR_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0 ? size.ws_col : 100;
  return std::max(20, columns - prefix_width);
}

std::vector<std::string> child_environment(int rank, int nproc, int port) {
  std::vector<std::string> environment;
  for (char** entry = environ; *entry; ++entry) {
    std::string_view text(*entry);
    std::string_view name = text.substr(0, text.find('='));
    bool replaced = false;
    for (const char* variable : kInheritedJobVariables) replaced |= name == variable;
    if (!replaced) environment.emplace_back(text);
  }
  environment.push_back(fmt::format("RANK={}", rank));
  environment.push_back(fmt::format("WORLD_SIZE={}", nproc));
  environment.push_back(fmt::format("LOCAL_RANK={}", rank));
  environment.push_back(fmt::format("LOCAL_WORLD_SIZE={}", nproc));
  environment.push_back("MASTER_ADDR=127.0.0.1");
  environment.push_back(fmt::format("MASTER_PORT={}", port));
  environment.push_back("SPINDLE_LAUNCHER=1");
  // A progress bar draws on the launcher's terminal through the pipe (train/progress.h reads this).
  const int prefix_width = nproc > 1 ? static_cast<int>(fmt::format("[rank {}] ", rank).size()) : 0;
  if (const int columns = forwarded_terminal_columns(prefix_width))
    environment.push_back(fmt::format("SPINDLE_TERMINAL_COLUMNS={}", columns));
  return environment;
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status)) {
    int signal = WTERMSIG(status);
    const char* name = strsignal(signal);
    return fmt::format("was killed by signal {} ({}){}", signal, name ? name : "?",
                       WCOREDUMP(status) ? ", core dumped" : "");
  }
  return fmt::format("ended with wait status {}", status);
}

int exit_code_of(int status) {
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  if (WIFSIGNALED(status)) return 128 + WTERMSIG(status);
  return 1;
}

void write_all(int fd, std::string_view text) {
  while (!text.empty()) {
    ssize_t n = ::write(fd, text.data(), text.size());
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // our own stdout is gone: nothing better to do than drop output
    text.remove_prefix(static_cast<size_t>(n));
  }
}

// One output stream of one child, forwarded line by line with a rank prefix. A carriage return
// begins a redraw of the line on screen (a progress bar): it is passed on at once, with the prefix
// after the '\r', and what follows up to the next line break continues that line.
struct ForwardedStream {
  int fd = -1;         // read end of the child's pipe; -1 once closed
  int destination;     // 1 or 2
  std::string prefix;  // "[rank 3] " or empty
  std::string partial;
  bool line_open = false;  // what was written last did not end its line

  void emit(std::string_view segment) {
    if (segment.empty()) return;
    if (segment.front() == '\r') write_all(destination, "\r" + prefix + std::string(segment.substr(1)));
    else if (line_open) write_all(destination, segment);
    else write_all(destination, prefix + std::string(segment));
    line_open = segment.back() != '\n';
  }
  void forward(std::string_view data) {
    partial.append(data);
    size_t start = 0;
    while (start < partial.size()) {
      const size_t end = partial.find_first_of("\n\r", start + (partial[start] == '\r' ? 1 : 0));
      if (end == std::string::npos) break;
      const size_t next = partial[end] == '\n' ? end + 1 : end;  // a line ends after its newline, a redraw begins at '\r'
      emit(std::string_view(partial).substr(start, next - start));
      start = next;
    }
    partial.erase(0, start);
    if (!partial.empty() && partial.front() == '\r') {  // a redraw in progress is shown now, not at the next one
      emit(partial);
      partial.clear();
    }
    if (partial.size() > (64u << 10)) flush();  // a huge line without newline: don't hold it forever
  }
  void flush() {
    if (!partial.empty()) emit(partial + "\n");
    else if (line_open) emit("\n");
    partial.clear();
  }
  void read_available() {
    char buffer[65536];
    ssize_t n = ::read(fd, buffer, sizeof buffer);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) {
      flush();
      ::close(fd);
      fd = -1;
      return;
    }
    forward(std::string_view(buffer, static_cast<size_t>(n)));
  }
};

struct Child {
  int rank = 0;
  pid_t pid = -1;
  int pidfd = -1;  // readable when the child exits; -1 where the kernel lacks pidfd_open
  bool running = true;
  int status = 0;
  ForwardedStream out, err;
};

const char* stop_signal_name(int signal) {
  switch (signal) {
    case SIGINT: return "SIGINT";
    case SIGTERM: return "SIGTERM";
    case SIGUSR1: return "SIGUSR1";
    default: return strsignal(signal);
  }
}

// SIGINT, SIGTERM and SIGUSR1 to the launcher are written here so the poll loop can forward them.
int g_signal_pipe[2] = {-1, -1};
constexpr int kForwardedSignals[] = {SIGINT, SIGTERM, SIGUSR1};
void on_launcher_signal(int signal) {
  unsigned char byte = static_cast<unsigned char>(signal);
  (void)!::write(g_signal_pipe[1], &byte, 1);
}

void start_child(Child& child, const std::string& executable, const std::vector<std::string>& arguments,
                 const std::vector<std::string>& environment) {
  int out_pipe[2], err_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0 || ::pipe2(err_pipe, O_CLOEXEC) != 0)
    fail("launcher: cannot create pipes: {}", std::strerror(errno));
  // Everything the child needs is built before fork: only async-signal-safe calls after it.
  std::vector<char*> argv, envp;
  for (const auto& a : arguments) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  for (const auto& e : environment) envp.push_back(const_cast<char*>(e.c_str()));
  envp.push_back(nullptr);
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid < 0) fail("launcher: fork failed: {}", std::strerror(errno));
  if (pid == 0) {
    // If the launcher dies without cleaning up (SIGKILL), its children must not linger.
    ::prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (::getppid() != parent) ::_exit(127);
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    for (int forwarded : kForwardedSignals) ::signal(forwarded, SIG_DFL);
    ::execve(executable.c_str(), argv.data(), envp.data());
    const char message[] = "spindle launcher: exec failed\n";
    (void)!::write(2, message, sizeof message - 1);
    ::_exit(127);
  }
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  child.pid = pid;
  child.out.fd = out_pipe[0];
  child.err.fd = err_pipe[0];
  child.pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
}

}  // namespace

// The lowest port the kernel gives outgoing connections (its range is "32768 60999" by default).
int ephemeral_port_low() {
  int result = 32768;
  if (FILE* f = std::fopen("/proc/sys/net/ipv4/ip_local_port_range", "r")) {
    int low = 0, high = 0;
    if (std::fscanf(f, "%d %d", &low, &high) == 2 && low > 0 && low <= high) result = low;
    std::fclose(f);
  }
  return result;
}

namespace {

// Whether the rendezvous store could bind `port` now (port 0: the kernel picks; the port it gave
// is returned through `port`).
bool can_listen(int& port) {
  const int fd = comm::bind_any_address(port);
  if (fd < 0) return false;
  sockaddr_storage address{};
  socklen_t length = sizeof address;
  const bool ok = ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) == 0;
  if (ok)
    port = ntohs(address.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&address)->sin6_port
                                               : reinterpret_cast<sockaddr_in*>(&address)->sin_port);
  ::close(fd);
  return ok;
}

}  // namespace

int pick_free_port() {
  // A port below the ephemeral range: between this check and rank 0's store binding it, the
  // kernel hands ephemeral ports to outgoing connections (NCCL, Gloo, the ranks' own store
  // clients), and one of those once took the port picked here (port 0's answer is ephemeral).
  const int first = 20000, last = ephemeral_port_low() - 1;
  if (last - first >= 1000) {
    uint64_t state = static_cast<uint64_t>(::getpid()) * 0x9E3779B97F4A7C15ull ^
                     static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
    for (int attempt = 0; attempt < 64; ++attempt) {
      state ^= state << 13, state ^= state >> 7, state ^= state << 17;
      int port = first + static_cast<int>(state % static_cast<uint64_t>(last - first + 1));
      if (can_listen(port)) return port;
    }
  }
  int port = 0;
  if (!can_listen(port)) fail("launcher: cannot find a free port: {}", std::strerror(errno));
  return port;
}

LauncherFlag extract_launcher_flag(const std::vector<std::string>& arguments) {
  LauncherFlag result;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const std::string& argument = arguments[i];
    if (argument == "--") {  // everything after belongs to the command
      result.remaining_arguments.insert(result.remaining_arguments.end(), arguments.begin() + i, arguments.end());
      break;
    }
    bool matched = false;
    for (std::string spelling : kFlagSpellings) {
      if (argument == spelling) {
        if (i + 1 >= arguments.size()) fail("{} needs a number of processes (e.g. {} 4)", spelling, spelling);
        result.nproc_per_node = parse_process_count(spelling, arguments[++i]);
        matched = true;
      } else if (argument.starts_with(spelling + "=")) {
        result.nproc_per_node = parse_process_count(spelling, argument.substr(spelling.size() + 1));
        matched = true;
      }
      if (matched) break;
    }
    if (!matched) result.remaining_arguments.push_back(argument);
  }
  return result;
}

int launch_local(int nproc, const std::vector<std::string>& arguments, const LaunchOptions& options) {
  if (nproc < 1) fail("--nproc-per-node needs at least one process, got {}", nproc);
  if (arguments.empty()) fail("launcher: no command to run");
  if (options.check_before_start) options.check_before_start(nproc);
  const int port = pick_free_port();
  const bool prefix_output = nproc > 1;

  if (::pipe2(g_signal_pipe, O_CLOEXEC | O_NONBLOCK) != 0)
    fail("launcher: cannot create a pipe: {}", std::strerror(errno));
  struct sigaction action {}, previous[std::size(kForwardedSignals)];
  action.sa_handler = on_launcher_signal;
  ::sigemptyset(&action.sa_mask);
  for (size_t i = 0; i < std::size(kForwardedSignals); ++i) ::sigaction(kForwardedSignals[i], &action, &previous[i]);
  std::fflush(stdout);
  std::fflush(stderr);

  std::vector<Child> children(nproc);
  for (int rank = 0; rank < nproc; ++rank) {
    Child& child = children[rank];
    child.rank = rank;
    std::string prefix = prefix_output ? fmt::format("[rank {}] ", rank) : "";
    child.out = ForwardedStream{-1, 1, prefix, {}};
    child.err = ForwardedStream{-1, 2, prefix, {}};
    start_child(child, options.executable, arguments, child_environment(rank, nproc, port));
  }

  std::optional<int> first_failure;  // index into children
  std::string failure_message;
  int exit_code = 0;
  int stop_signals = 0;     // stop signals the launcher received and forwarded
  int stopped_ranks = 0;    // ranks that saved a checkpoint and exited with kExitStoppedResumable
  std::optional<Clock::time_point> kill_deadline;
  std::optional<Clock::time_point> drain_deadline;  // after the last exit: grandchildren may hold pipes

  auto stop_others = [&](int signal) {
    for (auto& c : children)
      if (c.running) ::kill(c.pid, signal);
  };
  auto reap = [&](Child& child) {
    int status = 0;
    pid_t done = ::waitpid(child.pid, &status, WNOHANG);
    if (done != child.pid) return;
    child.running = false;
    child.status = status;
    if (child.pidfd >= 0) ::close(child.pidfd), child.pidfd = -1;
    // A rank that stopped on a signal with a checkpoint: the others stop after the same step (they
    // agree on it), so it is no failure to stop them for.
    if (WIFEXITED(status) && WEXITSTATUS(status) == kExitStoppedResumable) {
      ++stopped_ranks;
      return;
    }
    bool failed = !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    if (failed && !first_failure) {
      first_failure = child.rank;
      exit_code = exit_code_of(status);
      failure_message = fmt::format("rank {} (pid {}) {}", child.rank, child.pid, describe_status(status));
      int still_running = 0;
      for (auto& c : children) still_running += c.running;
      if (still_running > 0) {
        write_all(2, fmt::format("spindle launcher: {}; stopping the other {} rank{}\n", failure_message,
                                 still_running, still_running == 1 ? "" : "s"));
        stop_others(SIGTERM);
        kill_deadline = Clock::now() + options.grace_period;
      }
    }
  };

  for (;;) {
    bool any_running = false, any_open = false, pidfds_everywhere = true;
    for (auto& c : children) {
      any_running |= c.running;
      any_open |= c.out.fd >= 0 || c.err.fd >= 0;
      pidfds_everywhere &= !c.running || c.pidfd >= 0;
    }
    if (!any_running && !drain_deadline) drain_deadline = Clock::now() + std::chrono::milliseconds(500);
    if (!any_running && (!any_open || Clock::now() >= *drain_deadline)) break;

    std::vector<pollfd> fds{{g_signal_pipe[0], POLLIN, 0}};
    std::vector<std::pair<Child*, int>> owners{{nullptr, 0}};  // 0 pidfd, 1 out, 2 err
    for (auto& c : children) {
      if (c.running && c.pidfd >= 0) fds.push_back({c.pidfd, POLLIN, 0}), owners.push_back({&c, 0});
      if (c.out.fd >= 0) fds.push_back({c.out.fd, POLLIN, 0}), owners.push_back({&c, 1});
      if (c.err.fd >= 0) fds.push_back({c.err.fd, POLLIN, 0}), owners.push_back({&c, 2});
    }
    // Sleep until something happens; the timeout only serves deadlines (and kernels without pidfd).
    int timeout_ms = -1;
    auto until = [&](Clock::time_point t) {
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - Clock::now()).count();
      int bounded = static_cast<int>(std::clamp<int64_t>(ms, 0, 1 << 30));
      timeout_ms = timeout_ms < 0 ? bounded : std::min(timeout_ms, bounded);
    };
    if (kill_deadline) until(*kill_deadline);
    if (!any_running) until(*drain_deadline);
    if (any_running && !pidfds_everywhere) until(Clock::now() + std::chrono::milliseconds(100));
    int ready = ::poll(fds.data(), fds.size(), timeout_ms);
    if (ready < 0 && errno != EINTR) fail("launcher: poll failed: {}", std::strerror(errno));

    if (ready > 0) {
      if (fds[0].revents & POLLIN) {
        unsigned char signal = 0;
        while (::read(g_signal_pipe[0], &signal, 1) == 1) {
          // The first stop signal goes on to every rank as it came: they finish their step, save a
          // checkpoint and exit (stop_signal.h). A second one stops them at once.
          if (++stop_signals == 1) {
            write_all(2, fmt::format("spindle launcher: {} received: the ranks finish their step and save a "
                                     "checkpoint (send it again to stop them at once)\n",
                                     stop_signal_name(signal)));
            stop_others(signal);
          } else if (stop_signals == 2) {
            if (!first_failure) {
              first_failure = -1;
              exit_code = 128 + signal;
              failure_message = fmt::format("the launcher received a second stop signal ({})", stop_signal_name(signal));
            }
            write_all(2, "spindle launcher: second stop signal: stopping all ranks at once\n");
            stop_others(SIGKILL);
          }
        }
      }
      for (size_t i = 1; i < fds.size(); ++i) {
        if (!fds[i].revents) continue;
        auto [child, kind] = owners[i];
        if (kind == 1) child->out.read_available();
        if (kind == 2) child->err.read_available();
      }
      // Exits after output, so a child's last lines come before the launcher's verdict.
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents && owners[i].second == 0) reap(*owners[i].first);
    }
    if (!pidfds_everywhere)
      for (auto& c : children)
        if (c.running && c.pidfd < 0) reap(c);
    if (kill_deadline && Clock::now() >= *kill_deadline) {
      stop_others(SIGKILL);
      kill_deadline.reset();
    }
  }
  for (auto& c : children) {
    if (c.out.fd >= 0) c.out.flush(), ::close(c.out.fd);
    if (c.err.fd >= 0) c.err.flush(), ::close(c.err.fd);
  }
  for (size_t i = 0; i < std::size(kForwardedSignals); ++i) ::sigaction(kForwardedSignals[i], &previous[i], nullptr);
  ::close(g_signal_pipe[0]);
  ::close(g_signal_pipe[1]);

  if (first_failure) {
    std::string others;
    for (auto& c : children)
      if (c.rank != *first_failure && !(WIFEXITED(c.status) && WEXITSTATUS(c.status) == 0))
        others += fmt::format("{}rank {} {}", others.empty() ? "" : ", ", c.rank, describe_status(c.status));
    write_all(2, fmt::format("spindle launcher: failed: {}{}{}\n", failure_message,
                             others.empty() ? "" : "; then ", others));
    return exit_code;
  }
  if (stopped_ranks > 0) {
    if (stopped_ranks < nproc)
      write_all(2, fmt::format("spindle launcher: {} of {} ranks stopped with a checkpoint, the others ended "
                               "without one\n",
                               stopped_ranks, nproc));
    return kExitStoppedResumable;
  }
  return exit_code;
}

std::optional<int> launch_if_requested(int argc, char** argv, const LaunchCheck& check) {
  std::vector<std::string> arguments(argv, argv + argc);
  LauncherFlag flag = extract_launcher_flag(arguments);
  if (!flag.nproc_per_node) {
    // A pipe makes stdout block-buffered; the launcher forwards lines as they come.
    if (std::getenv("SPINDLE_LAUNCHER")) std::setvbuf(stdout, nullptr, _IOLBF, 0);
    return std::nullopt;
  }
  ProcessGroupInfo here = process_group_from_environment();
  if (here.distributed())
    fail("--nproc-per-node starts processes on this machine, but this process is already {}; drop "
         "--nproc-per-node and let that launcher start one process per GPU",
         here.describe());
  LaunchOptions options;
  options.check_before_start = check;
  return launch_local(*flag.nproc_per_node, flag.remaining_arguments, options);
}

}  // namespace spindle
