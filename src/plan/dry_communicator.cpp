#include "plan/dry_communicator.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include "core/error.h"

namespace spindle::plan {

DryCommunicator::DryCommunicator(const parallel::MeshConfig& config, int rank)
    : config_(config), members_(static_cast<size_t>(config.world_size())), position_(rank), name_("world") {
  SPINDLE_CHECK(rank >= 0 && rank < config.world_size(), "rank {} of a world of {}", rank, config.world_size());
  std::iota(members_.begin(), members_.end(), 0);
}

DryCommunicator::DryCommunicator(const parallel::MeshConfig& config, std::vector<int> members, int position,
                                 std::string name)
    : config_(config), members_(std::move(members)), position_(position), name_(std::move(name)) {}

std::unique_ptr<comm::Communicator> DryCommunicator::split(int color, int key, const std::string& name) {
  if (color < 0) return nullptr;
  // Every member's (color, key) for the split of this name, as Mesh computes it on that rank.
  struct Member {
    int key, position, world_rank;
  };
  std::vector<Member> group;
  for (size_t p = 0; p < members_.size(); ++p) {
    bool found = false;
    for (const parallel::GroupSplit& s : parallel::mesh_splits(config_, members_[p])) {
      if (name != s.name) continue;
      found = true;
      if (s.color == color) group.push_back({s.key, static_cast<int>(p), members_[p]});
    }
    SPINDLE_CHECK(found, "the plan's communicator knows the mesh's splits only, not \"{}\"", name);
  }
  std::sort(group.begin(), group.end(),
            [](const Member& a, const Member& b) { return a.key != b.key ? a.key < b.key : a.position < b.position; });
  std::vector<int> ranks;
  int here = -1;
  for (const Member& m : group) {
    if (m.position == position_) here = static_cast<int>(ranks.size());
    ranks.push_back(m.world_rank);
  }
  SPINDLE_CHECK(here >= 0 && key == group[static_cast<size_t>(here)].key, "split \"{}\": this rank's color {} / key {} "
                "differ from the mesh's", name, color, key);
  return std::unique_ptr<comm::Communicator>(new DryCommunicator(config_, std::move(ranks), here, name_ + "/" + name));
}

}  // namespace spindle::plan
