// A communicator for one simulated rank of a mesh: it knows the group it belongs to (from the
// mesh's splits, evaluated for every rank) but moves no data. With DryBackend it lets `spindle
// plan` build rank r's real groups, strategies and FSDP buffers without other processes.
//
// One exception: integer all-gathers (I32: document ids, positions, the tables sequence-parallel
// code plans its pieces from on the host) move their values when the ranks are simulated side by
// side in threads sharing an Exchange: each member leaves its input there and copies the others'.
// So a step that reads such values back finds the real ones (DryBackend keeps written values).
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"
#include "parallel/mesh.h"

namespace spindle::plan {

// Where the simulated ranks of one mesh meet for integer all-gathers: each call of a group is
// identified by the group's name and its count of such calls, which every member makes in the same
// order. abort() wakes every waiting rank with an error (another rank failed first).
class Exchange {
 public:
  // `ranks`: the world ranks simulated side by side; groups with members outside them move no values
  // (the others are simulated at another time, and waiting for them would never end).
  explicit Exchange(std::vector<int> ranks) : ranks_(std::move(ranks)) {}
  bool simulated_together(const std::vector<int>& members) const;
  // Leaves `bytes` as member `position`'s input of call `call` of a group of `members`, waits for
  // every member's, and copies them in member order into `out` (members × bytes.size()).
  void all_gather(const std::string& group, int64_t call, int position, int members, std::vector<char> bytes,
                  void* out);
  void abort();

 private:
  struct Call {
    std::vector<std::vector<char>> inputs;
    int arrived = 0, left = 0;
  };
  std::vector<int> ranks_;
  std::mutex mutex_;
  std::condition_variable changed_;
  std::map<std::pair<std::string, int64_t>, Call> calls_;
  bool aborted_ = false;
};

class DryCommunicator final : public comm::Communicator {
 public:
  // The world of `config` as seen by world rank `rank`; `exchange` (may be null: no values move)
  // connects it to the other ranks simulated at the same time.
  DryCommunicator(const parallel::MeshConfig& config, int rank, std::shared_ptr<Exchange> exchange = nullptr);

  int rank() const override { return position_; }
  int size() const override { return static_cast<int>(members_.size()); }
  const std::string& name() const override { return name_; }
  void barrier() override {}
  // Groups of the mesh's splits (parallel::mesh_splits), found by their name.
  std::unique_ptr<comm::Communicator> split(int color, int key, const std::string& name) override;

 protected:
  void do_all_reduce_sum(Stream, Tensor&) override {}
  void do_all_gather(Stream, const Tensor& in, Tensor& out) override;
  void do_reduce_scatter_sum(Stream, const Tensor&, Tensor&) override {}
  void do_all_to_all(Stream, const Tensor&, Tensor&) override {}
  void do_broadcast(Stream, Tensor&, int) override {}
  void do_send(Stream, const Tensor&, int) override {}
  void do_recv(Stream, Tensor&, int) override {}
  void do_send_recv(Stream, const Tensor&, int, Tensor&, int) override {}

 private:
  DryCommunicator(const parallel::MeshConfig& config, std::vector<int> members, int position, std::string name,
                  std::shared_ptr<Exchange> exchange);
  parallel::MeshConfig config_;
  std::vector<int> members_;  // world ranks, in group order
  int position_;              // this rank's index in members_
  std::string name_;
  std::shared_ptr<Exchange> exchange_;
  int64_t integer_gathers_ = 0;  // this group's I32 all-gathers so far (the Exchange's call number)
};

}  // namespace spindle::plan
