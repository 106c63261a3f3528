// A dead or stuck peer must turn into an error on the other ranks, quickly, never a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <thread>

#include "backend/backend.h"
#include "comm/cpu_communicator.h"
#include "comm/multiprocess.h"
#include "core/error.h"

namespace spindle::comm {
namespace {

using spindle::testing::expect_all_succeeded;
using spindle::testing::require;
using spindle::testing::run_ranks;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

TEST(Failures, PeerThatExitsMakesTheOthersFailWithAMessage) {
  // Rank 2 dies right after connecting; the others are mid-all-reduce. The timeout is long, so
  // passing quickly proves the closed connection is detected rather than waited out.
  auto outcomes = run_ranks(3, [](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, CommOptions{std::chrono::seconds(60)});
    if (info.rank == 2) ::_exit(7);
    auto backend = make_cpu_backend(1);
    Tensor data = backend->zeros(Shape{1000}, DType::F32);
    auto start = Clock::now();
    try {
      for (int i = 0; i < 100; ++i) world->all_reduce_sum(Stream{}, data);
    } catch (const Error& e) {
      std::string message = e.what();
      require(message.find("all_reduce_sum on group 'world' (3 ranks; this is rank") != std::string::npos &&
                  message.find("probably exited or stopped responding") != std::string::npos,
              "unexpected message: {}", message);
      require(seconds_since(start) < 20, "took {} s to notice", seconds_since(start));
      return;
    }
    throw std::runtime_error("no error although rank 2 exited");
  });
  expect_all_succeeded({outcomes[0], outcomes[1]});
  EXPECT_TRUE(WIFEXITED(outcomes[2].status) && WEXITSTATUS(outcomes[2].status) == 7);
}

TEST(Failures, PeerThatDiesBeforeAnSendRecvIsNamed) {
  auto outcomes = run_ranks(2, [](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, CommOptions{std::chrono::seconds(60)});
    if (info.rank == 1) ::_exit(3);
    auto backend = make_cpu_backend(1);
    Tensor out = backend->zeros(Shape{16}, DType::F32), in = backend->zeros(Shape{16}, DType::F32);
    try {
      world->send_recv(Stream{}, out, 1, in, 1);
    } catch (const Error& e) {
      std::string message = e.what();
      require(message.find("send_recv on group 'world' (2 ranks; this is rank 0) failed") != std::string::npos &&
                  message.find("Rank 1 of this group probably exited") != std::string::npos,
              "unexpected message: {}", message);
      return;
    }
    throw std::runtime_error("no error although rank 1 exited");
  });
  expect_all_succeeded({outcomes[0]});
}

TEST(Failures, StuckPeerTimesOut) {
  auto outcomes = run_ranks(2, [](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, CommOptions{std::chrono::milliseconds(800)});
    if (info.rank == 1) {  // alive but never joins the barrier
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      return;
    }
    auto start = Clock::now();
    try {
      world->barrier();
    } catch (const Error& e) {
      std::string message = e.what();
      require(message.find("barrier on group 'world'") != std::string::npos &&
                  message.find("timeout 0.8 s") != std::string::npos,
              "unexpected message: {}", message);
      require(seconds_since(start) < 2.5, "timed out after {} s", seconds_since(start));
      return;
    }
    throw std::runtime_error("barrier passed without rank 1");
  });
  expect_all_succeeded({outcomes[0]});
}

TEST(Failures, MissingRankAtRendezvousTimesOut) {
  // World of 2, but only rank 0 ever starts.
  auto outcomes = run_ranks(1, [](const ProcessGroupInfo& single) {
    ProcessGroupInfo info = single;
    info.world_size = 2;
    info.local_world_size = 2;
    try {
      connect_cpu_world(info, CommOptions{std::chrono::milliseconds(500)});
    } catch (const Error& e) {
      std::string message = e.what();
      require(message.find("connecting group 'world' (2 ranks) failed at rank 0") != std::string::npos &&
                  message.find("another rank did not arrive") != std::string::npos,
              "unexpected message: {}", message);
      return;
    }
    throw std::runtime_error("connected without rank 1");
  });
  expect_all_succeeded({outcomes[0]});
}

}  // namespace
}  // namespace spindle::comm
