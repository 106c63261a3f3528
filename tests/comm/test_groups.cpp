// Sub-groups: split and new_group on real processes; membership and order are checked by an
// all_gather of world ranks inside each group.
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "comm/cpu_communicator.h"
#include "comm/multiprocess.h"
#include "core/error.h"

namespace spindle::comm {
namespace {

using spindle::testing::expect_all_succeeded;
using spindle::testing::require;
using spindle::testing::run_ranks;

// The world ranks of a group's members, in group-rank order.
std::vector<int32_t> members(Communicator& group, int world_rank) {
  auto backend = make_cpu_backend(1);
  Tensor mine = backend->empty(Shape{1}, DType::I32);
  int32_t value = world_rank;
  backend->copy_from_host(backend->default_stream(), &value, mine);
  Tensor all = backend->empty(Shape{group.size()}, DType::I32);
  group.all_gather(Stream{}, mine, all);
  std::vector<int32_t> result(group.size());
  backend->copy_to_host(backend->default_stream(), all, result.data());
  return result;
}

TEST(Groups, SplitOrdersByKeyAndNestedSplitsWork) {
  expect_all_succeeded(run_ranks(4, [](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, CommOptions{std::chrono::seconds(30)});
    const int r = info.rank;
    // Even and odd ranks, each group in descending world-rank order (key = −rank).
    auto parity = world->split(r % 2, -r, "parity");
    require(parity->size() == 2, "parity size {}", parity->size());
    std::vector<int32_t> want = r % 2 == 0 ? std::vector<int32_t>{2, 0} : std::vector<int32_t>{3, 1};
    require(members(*parity, r) == want, "parity members of rank {}", r);
    require(parity->rank() == (r >= 2 ? 0 : 1), "parity rank of {} is {}", r, parity->rank());
    require(parity->name() == "world/parity", "name {}", parity->name());

    // A split of a split: every member alone.
    auto single = parity->split(parity->rank(), 0, "single");
    require(single->size() == 1 && single->rank() == 0, "single group");
    require(single->name() == "world/parity/single", "name {}", single->name());

    // Ranks that opt out get no group but still take part in the call.
    auto low = world->split(r < 3 ? 7 : -1, r, "low");
    if (r < 3) {
      require(low && low->size() == 3 && members(*low, r) == std::vector<int32_t>{0, 1, 2}, "low group");
    } else {
      require(low == nullptr, "rank 3 opted out but got a group");
    }

    // new_group keeps the order of the list; world still works afterwards.
    auto picked = world->new_group({3, 1}, "picked");
    if (r == 3 || r == 1) {
      require(picked && members(*picked, r) == std::vector<int32_t>{3, 1}, "picked members");
      require(picked->rank() == (r == 3 ? 0 : 1), "picked rank");
    } else {
      require(picked == nullptr, "rank {} is not in the list", r);
    }
    require(members(*world, r) == std::vector<int32_t>{0, 1, 2, 3}, "world after splits");
  }));
}

TEST(Groups, NewGroupRejectsBadLists) {
  auto world = connect_cpu_world(ProcessGroupInfo{}, CommOptions{std::chrono::seconds(5)});
  try {
    world->new_group({0, 0}, "twice");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "new_group('twice') on group 'world' of 1 ranks: the rank list must be non-empty, distinct and "
                 "within 0..0");
  }
}

}  // namespace
}  // namespace spindle::comm
