// Runs a test body as N real processes (fork), each a rank of one job, as the trainer will run.
// A rank fails by throwing; its message travels back to the parent through a pipe. Each child
// has an alarm, so a hang becomes a failure (SIGALRM) instead of a stuck test.
#pragma once

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "comm/process_group.h"
#include "launch/launcher.h"

namespace spindle::testing {

struct RankOutcome {
  int status = 0;       // waitpid status
  std::string message;  // what the rank reported (its exception text)
  bool succeeded() const { return WIFEXITED(status) && WEXITSTATUS(status) == 0; }
};

// Throws with a formatted message unless cond holds (gtest assertions do not cross fork).
template <typename... Args>
void require(bool cond, fmt::format_string<Args...> format, Args&&... args) {
  if (!cond) throw std::runtime_error(fmt::format(format, std::forward<Args>(args)...));
}

inline std::vector<RankOutcome> run_ranks(int nproc, const std::function<void(const ProcessGroupInfo&)>& body,
                                          int alarm_seconds = 60) {
  const int port = pick_free_port();
  std::vector<pid_t> pids(nproc);
  std::vector<int> message_fds(nproc);
  std::fflush(stdout);
  std::fflush(stderr);
  for (int rank = 0; rank < nproc; ++rank) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe failed");
    pid_t pid = ::fork();
    if (pid == 0) {
      ::close(fds[0]);
      ::alarm(alarm_seconds);
      ProcessGroupInfo info;
      info.rank = rank;
      info.world_size = nproc;
      info.local_rank = rank;
      info.local_world_size = nproc;
      info.master_addr = "127.0.0.1";
      info.master_port = info.store_port = port;
      info.source = "test";
      int code = 0;
      std::string message;
      try {
        body(info);
      } catch (const std::exception& e) {
        message = e.what();
        code = 1;
      }
      if (!message.empty()) (void)!::write(fds[1], message.data(), message.size());
      ::close(fds[1]);
      std::fflush(stdout);
      std::fflush(stderr);
      ::_exit(code);  // skip gtest's and static destructors: the parent owns the test run
    }
    ::close(fds[1]);
    pids[rank] = pid;
    message_fds[rank] = fds[0];
  }
  std::vector<RankOutcome> outcomes(nproc);
  for (int rank = 0; rank < nproc; ++rank) {
    char buffer[4096];
    ssize_t n;
    while ((n = ::read(message_fds[rank], buffer, sizeof buffer)) > 0) outcomes[rank].message.append(buffer, n);
    ::close(message_fds[rank]);
    ::waitpid(pids[rank], &outcomes[rank].status, 0);
  }
  return outcomes;
}

inline void expect_all_succeeded(const std::vector<RankOutcome>& outcomes) {
  for (size_t rank = 0; rank < outcomes.size(); ++rank) {
    const auto& o = outcomes[rank];
    EXPECT_TRUE(o.succeeded()) << "rank " << rank << " status " << o.status
                               << (WIFSIGNALED(o.status) ? fmt::format(" (signal {})", WTERMSIG(o.status)) : "")
                               << ": " << o.message;
  }
}

}  // namespace spindle::testing
