#include <gtest/gtest.h>

#include <map>

#include "comm/process_group.h"
#include "core/error.h"

namespace spindle {
namespace {

using Environment = std::map<std::string, std::string>;

ProcessGroupInfo parse(const Environment& env) {
  return process_group_from_environment([&](std::string_view name) -> std::optional<std::string> {
    auto it = env.find(std::string(name));
    if (it == env.end()) return std::nullopt;
    return it->second;
  });
}

std::string error_of(const Environment& env) {
  try {
    parse(env);
  } catch (const Error& e) {
    return e.what();
  }
  return "no error";
}

TEST(ProcessGroupInfo, NoVariablesMeansOneProcess) {
  auto info = parse({});
  EXPECT_EQ(info.rank, 0);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_FALSE(info.distributed());
  EXPECT_EQ(info.source, "single process");
}

TEST(ProcessGroupInfo, Torchrun) {
  auto info = parse({{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"},
                     {"MASTER_ADDR", "node7"}, {"MASTER_PORT", "29500"}, {"TORCHELASTIC_RUN_ID", "abc"},
                     {"TORCHELASTIC_USE_AGENT_STORE", "True"}});
  EXPECT_EQ(info.rank, 5);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 1);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "node7");
  EXPECT_EQ(info.master_port, 29500);
  EXPECT_EQ(info.store_port, 29501);  // torchrun's agent store holds 29500
  EXPECT_EQ(info.describe(), "rank 5 of 8 (local 1 of 4), rendezvous node7:29501, from torchrun-style environment");
}

TEST(ProcessGroupInfo, SpindleLauncherAndStorePortOverride) {
  auto info = parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "4000"}, {"SPINDLE_LAUNCHER", "1"}});
  EXPECT_EQ(info.source, "spindle launcher");
  EXPECT_EQ(info.store_port, 4000);
  info = parse({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "4000"},
                {"SPINDLE_STORE_PORT", "4100"}});
  EXPECT_EQ(info.store_port, 4100);
  EXPECT_EQ(info.local_rank, 0);        // LOCAL_* default to the global values
  EXPECT_EQ(info.local_world_size, 2);
}

TEST(ProcessGroupInfo, TorchrunErrors) {
  EXPECT_EQ(error_of({{"RANK", "0"}}), "RANK is set but WORLD_SIZE is not; set both (torchrun-style) or neither");
  EXPECT_EQ(error_of({{"WORLD_SIZE", "2"}}), "WORLD_SIZE is set but RANK is not; set both (torchrun-style) or neither");
  EXPECT_EQ(error_of({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
            "RANK=2 is not below WORLD_SIZE=2; ranks run from 0 to world size - 1");
  EXPECT_EQ(error_of({{"RANK", "x"}, {"WORLD_SIZE", "2"}}),
            "environment variable RANK='x' is not an integer in [0, 1048576]; fix or unset it");
  EXPECT_EQ(error_of({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "29500"}}),
            "RANK and WORLD_SIZE=2 are set but MASTER_ADDR is not; a multi-process job needs MASTER_ADDR (the host "
            "of rank 0) and MASTER_PORT (a free TCP port there), as torchrun sets them");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "70000"}}),
            "environment variable MASTER_PORT='70000' is not an integer in [1, 65535]; fix or unset it");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "4"}, {"LOCAL_RANK", "2"}, {"LOCAL_WORLD_SIZE", "2"},
                      {"MASTER_ADDR", "h"}, {"MASTER_PORT", "1"}}),
            "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE=2");
  EXPECT_EQ(error_of({{"RANK", "0"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "h"}, {"MASTER_PORT", "65535"},
                      {"TORCHELASTIC_RUN_ID", "x"}}),
            "MASTER_PORT=65535 leaves no port above it for spindle's rendezvous store under torchrun; set "
            "SPINDLE_STORE_PORT to a free port");
}

TEST(ProcessGroupInfo, SlurmDerivesAddressPortAndLocalSize) {
  auto info = parse({{"SLURM_PROCID", "6"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "2"}, {"SLURM_NODEID", "1"},
                     {"SLURM_TASKS_PER_NODE", "4(x2)"}, {"SLURM_JOB_NODELIST", "gpu[07-08]"}, {"SLURM_JOB_ID", "123456"}});
  EXPECT_EQ(info.source, "SLURM");
  EXPECT_EQ(info.rank, 6);
  EXPECT_EQ(info.world_size, 8);
  EXPECT_EQ(info.local_rank, 2);
  EXPECT_EQ(info.local_world_size, 4);
  EXPECT_EQ(info.master_addr, "gpu07");
  EXPECT_EQ(info.master_port, 20000 + 123456 % 20000);
  EXPECT_EQ(info.store_port, info.master_port);

  // Uneven nodes; explicit MASTER_ADDR/MASTER_PORT win over derivation.
  info = parse({{"SLURM_PROCID", "8"}, {"SLURM_NTASKS", "9"}, {"SLURM_LOCALID", "0"}, {"SLURM_NODEID", "2"},
                {"SLURM_TASKS_PER_NODE", "4(x2),1"}, {"SLURM_JOB_NODELIST", "a,b,c"}, {"MASTER_ADDR", "head"},
                {"MASTER_PORT", "1234"}});
  EXPECT_EQ(info.local_world_size, 1);
  EXPECT_EQ(info.master_addr, "head");
  EXPECT_EQ(info.master_port, 1234);

  // torchrun variables win inside a SLURM allocation.
  info = parse({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "1"}, {"RANK", "3"}, {"WORLD_SIZE", "4"},
                {"MASTER_ADDR", "h"}, {"MASTER_PORT", "5"}});
  EXPECT_EQ(info.rank, 3);
  EXPECT_EQ(info.source, "torchrun-style environment");
}

TEST(ProcessGroupInfo, SlurmErrors) {
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "1"}}),
            "SLURM job with SLURM_NTASKS=2 but neither MASTER_ADDR nor SLURM_JOB_NODELIST is set; export "
            "MASTER_ADDR=<host of task 0>");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n1"}}),
            "SLURM job with SLURM_NTASKS=2 but neither MASTER_PORT nor SLURM_JOB_ID is set; export "
            "MASTER_PORT=<free port>");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_NODEID", "3"},
                      {"SLURM_TASKS_PER_NODE", "1(x2)"}}),
            "SLURM_TASKS_PER_NODE='1(x2)' has no entry for SLURM_NODEID=3");
  EXPECT_EQ(error_of({{"SLURM_PROCID", "4"}, {"SLURM_NTASKS", "4"}}),
            "SLURM_PROCID=4 is not below SLURM_NTASKS=4; ranks run from 0 to world size - 1");
}

TEST(ProcessGroupInfo, FirstSlurmHost) {
  EXPECT_EQ(first_slurm_host("node1"), "node1");
  EXPECT_EQ(first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(first_slurm_host("gpu[07-09,12],cpu1"), "gpu07");
  EXPECT_EQ(first_slurm_host("gpu[3,5]"), "gpu3");
  EXPECT_EQ(first_slurm_host("cpu1,gpu[1-2]"), "cpu1");
  EXPECT_EQ(first_slurm_host("n[01-02]-ib"), "n01-ib");
  try {
    first_slurm_host("gpu[1-2");
    FAIL();
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(), "SLURM node list 'gpu[1-2' has an unclosed '['");
  }
}

}  // namespace
}  // namespace spindle
