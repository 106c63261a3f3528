// Where this process sits in its job, read from the environment the launcher left behind:
// spindle's own --nproc-per-node launcher and torchrun set RANK/WORLD_SIZE/LOCAL_RANK/
// LOCAL_WORLD_SIZE/MASTER_ADDR/MASTER_PORT; srun sets SLURM_*; with neither, one process.
// docs/parallelism.md lists every variable and how missing ones are derived.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <string_view>

namespace spindle {

struct ProcessGroupInfo {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;        // index among the processes of this machine: picks the GPU
  int local_world_size = 1;  // processes on this machine
  std::string master_addr = "127.0.0.1";
  int master_port = 0;
  // Where rank 0 hosts spindle's rendezvous store. Equal to master_port, except under torchrun,
  // whose own agent store already holds MASTER_PORT (then master_port + 1), or SPINDLE_STORE_PORT.
  int store_port = 0;
  std::string source = "single process";  // "torchrun", "spindle launcher", "SLURM", ...

  bool distributed() const { return world_size > 1; }
  std::string describe() const;  // "rank 2 of 4 (local 2 of 4), rendezvous 127.0.0.1:29500, from torchrun"
};

// Returns the value of an environment variable, or nullopt when unset.
using EnvironmentLookup = std::function<std::optional<std::string>(std::string_view name)>;

// Throws spindle::Error naming the variable when one is present but malformed or inconsistent.
ProcessGroupInfo process_group_from_environment(const EnvironmentLookup& lookup);
ProcessGroupInfo process_group_from_environment();  // the real environment

// The first host of a SLURM node list ("gpu[07-09,12],cpu1" -> "gpu07"). Throws on bad syntax.
std::string first_slurm_host(std::string_view node_list);

}  // namespace spindle
