// The host memory --recompute auto budgets offload with: a container's or a job's control group may
// cap it below the machine's physical memory (plan/auto_recompute.h: cgroup_memory_limit). The
// cgroup file systems are built in a temporary folder: v2 (memory.max), v1 (memory/
// memory.limit_in_bytes), a process in a nested group under capped ancestors, "max" and v1's
// "no limit" values, missing files.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "plan/auto_recompute.h"

namespace fs = std::filesystem;
using spindle::plan::cgroup_memory_limit;

namespace {

class CgroupTree : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() / ("spindle-cgroup-" + std::to_string(::getpid()) + "-" +
                                         ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  void write(const fs::path& relative, const std::string& text) {
    fs::create_directories((root_ / relative).parent_path());
    std::ofstream(root_ / relative) << text << "\n";
  }
  int64_t limit(const std::string& cgroup_of_process) { return cgroup_memory_limit(root_.string(), cgroup_of_process); }
  fs::path root_;
};

}  // namespace

TEST_F(CgroupTree, V2TakesTheTightestOfTheGroupAndItsAncestors) {
  write("memory.max", "max");
  write("job/memory.max", "8589934592");        // 8 GiB on the job
  write("job/step/memory.max", "17179869184");  // 16 GiB on the step below it: the job's binds
  EXPECT_EQ(limit("0::/job/step\n"), int64_t{8} << 30);
  write("job/step/memory.max", "4294967296");
  EXPECT_EQ(limit("0::/job/step\n"), int64_t{4} << 30);
  EXPECT_EQ(limit("0::/\n"), 0) << "\"max\" at the root is no limit";
}

TEST_F(CgroupTree, V1ReadsTheMemoryControllersGroup) {
  write("memory/memory.limit_in_bytes", "9223372036854771712");  // v1's "unlimited"
  write("memory/process_api/abc/memory.limit_in_bytes", "25769803776");
  const std::string groups = "9:name=systemd:/\n5:devices:/\n4:memory:/process_api/abc\n3:cpu,cpuacct:/\n0::/\n";
  EXPECT_EQ(limit(groups), int64_t{24} << 30);
  // Controllers listed together ("cpu,memory") are the memory controller's group too.
  EXPECT_EQ(limit("4:cpu,memory:/process_api/abc\n"), int64_t{24} << 30);
}

TEST_F(CgroupTree, NoFilesOrNoLimitsMeanNone) {
  EXPECT_EQ(limit("0::/anything\n"), 0);
  EXPECT_EQ(limit(""), 0);
  write("memory.max", "max");
  write("memory/memory.limit_in_bytes", "9223372036854771712");
  EXPECT_EQ(limit("4:memory:/\n0::/\n"), 0);
  write("garbage/memory.max", "lots");
  EXPECT_EQ(limit("0::/garbage\n"), 0) << "an unreadable value is no limit, not an error";
}

TEST(MachineHostMemory, IsPositiveAndAtMostPhysicalMemory) {
  const int64_t host = spindle::plan::machine_host_memory();
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  EXPECT_GT(host, 0);
  EXPECT_LE(host, static_cast<int64_t>(pages) * page);
}
