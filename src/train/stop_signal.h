// Stopping a training run on request, as a cluster asks for it: SLURM sends SIGTERM at preemption and
// at the time limit (SIGKILL follows after its grace period), and can send SIGUSR1 ahead of the limit
// (`sbatch --signal=USR1@600`); a user presses Ctrl-C (SIGINT). The first such signal lets every rank
// finish the step it is in; the ranks agree after each step, so all of them stop after the same one,
// save a checkpoint there and exit with kExitStoppedResumable. A second signal ends the process at
// once, as the signal's default action would.
//
// Under spindle's launcher (--nproc-per-node) a signal reaches a rank twice when it is sent to the
// whole process group (Ctrl-C, SLURM): from the kernel, and forwarded by the launcher. What the
// launcher forwards therefore never counts as the second signal.
#pragma once

#include <string>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "launch/exit_status.h"  // kExitStoppedResumable

namespace spindle {

// Watches SIGTERM, SIGINT and SIGUSR1 while it lives (one at a time per process): the previous
// handlers come back when it is destroyed.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

  // The first stop signal this process received since construction (0: none).
  int received() const;
  // Tests: as if `signal` had arrived.
  void request(int signal);
};

// What the ranks agreed on after a step: whether to stop, and which signal each rank saw.
struct StopDecision {
  bool stop = false;
  std::string reason;  // "SIGTERM (rank 0)", "SIGUSR1 (ranks 0, 1)"
};

// Collective over `world` (null: one process): every rank calls it after the same step with the
// signal it received (0: none), and every rank gets the same decision.
StopDecision agree_to_stop(Backend& backend, comm::Communicator* world, int received_signal);

// "SIGTERM", "SIGINT", "SIGUSR1", or "signal N".
std::string signal_name(int signal);

}  // namespace spindle
