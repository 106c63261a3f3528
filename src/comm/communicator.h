// A process group: the one interface model, parallel and loss code use to move tensors between
// ranks. The CPU implementation (Gloo over TCP) works on host tensors and ignores the stream; the
// NCCL implementation takes device tensors and enqueues on the stream.
//
// Rules for every call:
//  - Collective: every rank of the group calls it, in the same order, with tensors of the same
//    shape and dtype (p2p calls: the two peers match).
//  - Tensors are contiguous; "chunks" are equal slices along dimension 0.
//  - Sums are taken in rank order (x₀ + x₁ + …), identical on every rank, so a result does not
//    depend on the group's topology; BF16/F16 sum in F32 and round once.
//  - A peer that died or stopped answering makes the call throw spindle::Error within the timeout.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "core/tensor.h"

namespace spindle::comm {

struct CommOptions {
  // Longest wait for any one call (and for rendezvous). A hung peer turns into an error after this.
  std::chrono::milliseconds timeout = std::chrono::minutes(10);
};

class Communicator;

// Sees each data-moving call of a group around its enqueue on `stream` (`spindle bench` times
// them with device events for its time split). `data` is the call's larger tensor.
class CommObserver {
 public:
  virtual ~CommObserver() = default;
  virtual int begin(Stream stream, const Communicator& group, const char* call, const Tensor& data) = 0;
  virtual void end(Stream stream, int token) = 0;
};

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // "world", "world/sp", ...: which group an error message is about.
  virtual const std::string& name() const = 0;

  // data ← Σ_ranks data, in place.
  void all_reduce_sum(Stream stream, Tensor& data) {
    observed(stream, "all_reduce_sum", data, [&] { do_all_reduce_sum(stream, data); });
  }
  // out [size·n, ...] ← ranks' in [n, ...] concatenated in rank order.
  void all_gather(Stream stream, const Tensor& in, Tensor& out) {
    observed(stream, "all_gather", out, [&] { do_all_gather(stream, in, out); });
  }
  // in [size·n, ...] = size chunks; rank r's out [n, ...] ← Σ_ranks chunk r.
  void reduce_scatter_sum(Stream stream, const Tensor& in, Tensor& out) {
    observed(stream, "reduce_scatter_sum", in, [&] { do_reduce_scatter_sum(stream, in, out); });
  }
  // in [size·n, ...]: chunk j goes to rank j; out [size·n, ...]: chunk i is what rank i sent here.
  void all_to_all(Stream stream, const Tensor& in, Tensor& out) {
    observed(stream, "all_to_all", in, [&] { do_all_to_all(stream, in, out); });
  }

  // data ← root's data on every rank (same initial weights, a shared random seed, ...).
  void broadcast(Stream stream, Tensor& data, int root) {
    observed(stream, "broadcast", data, [&] { do_broadcast(stream, data, root); });
  }

  // Point to point; peer is a rank of this group.
  void send(Stream stream, const Tensor& data, int peer) {
    observed(stream, "send", data, [&] { do_send(stream, data, peer); });
  }
  void recv(Stream stream, Tensor& data, int peer) {
    observed(stream, "recv", data, [&] { do_recv(stream, data, peer); });
  }
  // Sends to one rank while receiving from another (a ring step: to = r+1, from = r-1), without
  // the deadlock two blocking calls in sequence would risk. to == from == rank() copies locally.
  void send_recv(Stream stream, const Tensor& send_data, int send_to, Tensor& recv_data, int recv_from) {
    observed(stream, "send_recv", send_data, [&] { do_send_recv(stream, send_data, send_to, recv_data, recv_from); });
  }

  // nullptr: none (the default). The observer must outlive its use; groups split from this one do
  // not inherit it.
  void set_observer(CommObserver* observer) { observer_ = observer; }

  virtual void barrier() = 0;

  // Collective over this group: ranks passing the same color form a new group, ordered by
  // (key, rank here). A negative color joins no group and gets nullptr. `name` is appended to this
  // group's name for messages ("world" + "sp" -> "world/sp").
  virtual std::unique_ptr<Communicator> split(int color, int key, const std::string& name) = 0;

  // Collective over this group: ranks listed (in that order) form a new group; others get nullptr.
  std::unique_ptr<Communicator> new_group(const std::vector<int>& ranks, const std::string& name);

 protected:
  // The implementations' side of the calls above (same contracts).
  virtual void do_all_reduce_sum(Stream stream, Tensor& data) = 0;
  virtual void do_all_gather(Stream stream, const Tensor& in, Tensor& out) = 0;
  virtual void do_reduce_scatter_sum(Stream stream, const Tensor& in, Tensor& out) = 0;
  virtual void do_all_to_all(Stream stream, const Tensor& in, Tensor& out) = 0;
  virtual void do_broadcast(Stream stream, Tensor& data, int root) = 0;
  virtual void do_send(Stream stream, const Tensor& data, int peer) = 0;
  virtual void do_recv(Stream stream, Tensor& data, int peer) = 0;
  virtual void do_send_recv(Stream stream, const Tensor& send_data, int send_to, Tensor& recv_data,
                            int recv_from) = 0;

 private:
  template <typename Call>
  void observed(Stream stream, const char* call, const Tensor& data, Call&& run) {
    if (!observer_) return run();
    const int token = observer_->begin(stream, *this, call, data);
    run();
    observer_->end(stream, token);
  }
  CommObserver* observer_ = nullptr;
};

// Shape checks shared by the implementations; throw spindle::Error naming the call and the group.
void check_all_gather_shapes(const Communicator& group, const Tensor& in, const Tensor& out);
void check_reduce_scatter_shapes(const Communicator& group, const Tensor& in, const Tensor& out);
void check_all_to_all_shapes(const Communicator& group, const Tensor& in, const Tensor& out);
void check_peer(const Communicator& group, int peer, const char* call);

}  // namespace spindle::comm
