#include "plan/dry_communicator.h"

#include <algorithm>
#include <cstring>
#include <numeric>

#include <fmt/format.h>

#include "core/error.h"
#include "plan/dry_backend.h"

namespace spindle::plan {

void Exchange::all_gather(const std::string& group, int64_t call, int position, int members, std::vector<char> bytes,
                          void* out) {
  std::unique_lock<std::mutex> lock(mutex_);
  const auto key = std::make_pair(group, call);
  Call& c = calls_[key];
  if (c.inputs.empty()) c.inputs.resize(static_cast<size_t>(members));
  const size_t n = bytes.size();
  c.inputs[static_cast<size_t>(position)] = std::move(bytes);
  ++c.arrived;
  changed_.notify_all();
  changed_.wait(lock, [&] { return aborted_ || c.arrived == members; });
  if (aborted_) fail("spindle plan: another simulated rank stopped first");
  for (int m = 0; m < members; ++m) {
    const std::vector<char>& in = c.inputs[static_cast<size_t>(m)];
    SPINDLE_CHECK(in.size() == n, "plan all-gather {} #{}: member {} gave {} bytes, member {} {}", group, call, m,
                  in.size(), position, n);
    if (n) std::memcpy(static_cast<char*>(out) + static_cast<size_t>(m) * n, in.data(), n);
  }
  if (++c.left == members) calls_.erase(key);
}

bool Exchange::simulated_together(const std::vector<int>& members) const {
  for (int m : members)
    if (std::find(ranks_.begin(), ranks_.end(), m) == ranks_.end()) return false;
  return true;
}

void Exchange::abort() {
  std::lock_guard<std::mutex> lock(mutex_);
  aborted_ = true;
  changed_.notify_all();
}

DryCommunicator::DryCommunicator(const parallel::MeshConfig& config, int rank, std::shared_ptr<Exchange> exchange)
    : config_(config),
      members_(static_cast<size_t>(config.world_size())),
      position_(rank),
      name_("world"),
      exchange_(std::move(exchange)) {
  SPINDLE_CHECK(rank >= 0 && rank < config.world_size(), "rank {} of a world of {}", rank, config.world_size());
  std::iota(members_.begin(), members_.end(), 0);
}

DryCommunicator::DryCommunicator(const parallel::MeshConfig& config, std::vector<int> members, int position,
                                 std::string name, std::shared_ptr<Exchange> exchange)
    : config_(config),
      members_(std::move(members)),
      position_(position),
      name_(std::move(name)),
      exchange_(std::move(exchange)) {}

void DryCommunicator::do_all_gather(Stream, const Tensor& in, Tensor& out) {
  if (!exchange_ || in.dtype() != DType::I32 || !exchange_->simulated_together(members_)) return;
  // The group's name differs between groups of one split ("world/sp" on every replica), so the
  // call is told apart by the group's first member too.
  const std::string group = fmt::format("{}@{}", name_, members_.front());
  std::vector<char> bytes(in.bytes());
  if (!bytes.empty() && in.storage()->data) std::memcpy(bytes.data(), in.data(), bytes.size());
  void* dst = out.bytes() ? DryBackend::host_memory(out) : nullptr;
  std::vector<char> discard;
  if (!dst && out.bytes()) {  // not a dry tensor: take part in the exchange all the same
    discard.resize(out.bytes());
    dst = discard.data();
  }
  exchange_->all_gather(group, integer_gathers_++, position_, size(), std::move(bytes), dst);
}

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
  return std::unique_ptr<comm::Communicator>(
      new DryCommunicator(config_, std::move(ranks), here, name_ + "/" + name, exchange_));
}

}  // namespace spindle::plan
