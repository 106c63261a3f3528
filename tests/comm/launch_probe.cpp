// A stand-in for the spindle binary in launcher tests: main hooks the launcher exactly as
// src/cli/main.cpp does, then each child behaves as the first argument asks.
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <thread>

#include "backend/backend.h"
#include "comm/cpu_communicator.h"
#include "comm/process_group.h"
#include "core/error.h"
#include "launch/launcher.h"

namespace {

void wait_to_be_stopped() {
  for (;;) ::pause();  // sleeps until a signal ends the process
}

}  // namespace

int main(int argc, char** argv) {
  const std::string first = argc > 1 ? argv[1] : "";
  // "refuse": the job's check refuses every process count, as spindle's commands refuse a mesh the
  // count cannot hold; a child that starts anyway says so.
  const spindle::LaunchCheck check = [&](int nproc) {
    if (first == "refuse") spindle::fail("the probe refuses a job of {} processes", nproc);
  };
  try {
    if (auto code = spindle::launch_if_requested(argc, argv, check)) return *code;
  } catch (const spindle::Error& e) {
    std::fprintf(stderr, "spindle: error: %s\n", e.what());
    return 2;
  }
  const auto info = spindle::process_group_from_environment();
  const std::string mode = argc > 1 ? argv[1] : "ok";
  auto target_rank = [&] { return std::stoi(argv[2]); };  // modes that name a rank

  if (mode == "ok") {
    std::printf("rank %d of %d, local %d of %d, %s:%d\n", info.rank, info.world_size, info.local_rank,
                info.local_world_size, info.master_addr.c_str(), info.master_port);
    std::string arguments;
    for (int i = 1; i < argc; ++i) arguments += std::string(" ") + argv[i];
    std::printf("args:%s\n", arguments.c_str());
    std::fprintf(stderr, "note from %d\n", info.rank);
    return 0;
  }
  if (mode == "refuse") {
    std::printf("rank %d started\n", info.rank);
    return 0;
  }
  if (mode == "partial") {
    std::printf("no newline at the end");
    return 0;
  }
  if (mode == "fail") {  // fail <rank> <code>
    if (info.rank != target_rank()) wait_to_be_stopped();
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::fprintf(stderr, "rank %d giving up\n", info.rank);
    return std::stoi(argv[3]);
  }
  if (mode == "signal") {  // signal <rank>: that rank is killed
    if (info.rank != target_rank()) wait_to_be_stopped();
    ::kill(::getpid(), SIGKILL);
  }
  if (mode == "fail-others-ignore-term") {  // the survivors need SIGKILL
    if (info.rank != target_rank()) {
      ::signal(SIGTERM, SIG_IGN);
      wait_to_be_stopped();
    }
    return 4;
  }
  if (mode == "allreduce") {  // end to end: environment → rendezvous → collective
    auto world = spindle::comm::connect_cpu_world(info, {std::chrono::seconds(30)});
    auto backend = spindle::make_cpu_backend(1);
    double value = info.rank + 1;
    spindle::Tensor t = backend->empty(spindle::Shape{1}, spindle::DType::F64);
    backend->copy_from_host(backend->default_stream(), &value, t);
    world->all_reduce_sum(spindle::Stream{}, t);
    backend->copy_to_host(backend->default_stream(), t, &value);
    std::printf("sum %g\n", value);
    return value == world->size() * (world->size() + 1) / 2.0 ? 0 : 1;
  }
  std::fprintf(stderr, "launch_probe: unknown mode %s\n", mode.c_str());
  return 9;
}
