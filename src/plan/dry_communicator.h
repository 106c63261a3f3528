// A communicator for one simulated rank of a mesh: it knows the group it belongs to (from the
// mesh's splits, evaluated for every rank) but moves no data. With DryBackend it lets `spindle
// plan` build rank r's real groups, strategies and FSDP buffers without other processes.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "parallel/mesh.h"

namespace spindle::plan {

class DryCommunicator final : public comm::Communicator {
 public:
  // The world of `config` as seen by world rank `rank`.
  DryCommunicator(const parallel::MeshConfig& config, int rank);

  int rank() const override { return position_; }
  int size() const override { return static_cast<int>(members_.size()); }
  const std::string& name() const override { return name_; }
  void barrier() override {}
  // Groups of the mesh's splits (parallel::mesh_splits), found by their name.
  std::unique_ptr<comm::Communicator> split(int color, int key, const std::string& name) override;

 protected:
  void do_all_reduce_sum(Stream, Tensor&) override {}
  void do_all_gather(Stream, const Tensor&, Tensor&) override {}
  void do_reduce_scatter_sum(Stream, const Tensor&, Tensor&) override {}
  void do_all_to_all(Stream, const Tensor&, Tensor&) override {}
  void do_broadcast(Stream, Tensor&, int) override {}
  void do_send(Stream, const Tensor&, int) override {}
  void do_recv(Stream, Tensor&, int) override {}
  void do_send_recv(Stream, const Tensor&, int, Tensor&, int) override {}

 private:
  DryCommunicator(const parallel::MeshConfig& config, std::vector<int> members, int position, std::string name);
  parallel::MeshConfig config_;
  std::vector<int> members_;  // world ranks, in group order
  int position_;              // this rank's index in members_
  std::string name_;
};

}  // namespace spindle::plan
