#include "comm/cpu_communicator.h"

#include <signal.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <tuple>
#include <vector>

#include "core/error.h"

#if SPINDLE_HAVE_GLOO
#include <gloo/allgather.h>
#include <gloo/alltoall.h>
#include <gloo/barrier.h>
#include <gloo/broadcast.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include "comm/host_reduce.h"
#include "comm/tcp_store.h"
#endif

namespace spindle::comm {

#if !SPINDLE_HAVE_GLOO

bool cpu_communicator_available() { return false; }

std::unique_ptr<Communicator> connect_cpu_world(const ProcessGroupInfo&, const CommOptions&) {
  fail("this spindle was built without Gloo, so it cannot run several CPU processes; install libgloo-dev "
       "(Debian) and rebuild");
}

#else

bool cpu_communicator_available() { return true; }

namespace {

// Point-to-point messages use their own slot range so they never match a collective's.
constexpr uint8_t kPointToPointSlotPrefix = 0x5a;

// Gloo's rendezvous goes through our TCP store, under a per-group key prefix.
class StoreAdapter : public gloo::rendezvous::Store {
 public:
  StoreAdapter(TcpStore& store, std::string prefix) : store_(store), prefix_(std::move(prefix)) {}
  void set(const std::string& key, const std::vector<char>& data) override { store_.set(prefix_ + key, data); }
  std::vector<char> get(const std::string& key) override { return store_.get(prefix_ + key); }
  void wait(const std::vector<std::string>& keys) override { wait(keys, store_.timeout()); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    for (const auto& key : keys) store_.get(prefix_ + key, timeout);
  }

 private:
  TcpStore& store_;
  std::string prefix_;
};

// What every group of one job shares: the store, the TCP device (one listening socket and event
// loop per process) and the options.
struct Job {
  std::shared_ptr<TcpStore> store;
  std::shared_ptr<gloo::transport::Device> device;
  CommOptions options;
};

class GlooCommunicator final : public Communicator {
 public:
  GlooCommunicator(std::shared_ptr<Job> job, std::shared_ptr<gloo::Context> context, int rank, int size,
                   std::string name, std::string store_prefix)
      : job_(std::move(job)),
        context_(std::move(context)),
        rank_(rank),
        size_(size),
        name_(std::move(name)),
        store_prefix_(std::move(store_prefix)) {}

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::string& name() const override { return name_; }

  void do_all_reduce_sum(Stream, Tensor& data) override {
    check_host(data, "all_reduce_sum");
    if (size_ == 1 || data.numel() == 0) return;
    // Reduce-scatter (all-to-all, then a rank-order sum of my chunk) and all-gather: the same bytes
    // as a ring all-reduce, with every element summed in rank order on one rank.
    const size_t element = dtype_size(data.dtype());
    const size_t count = static_cast<size_t>(data.numel());
    const size_t chunk = (count + size_ - 1) / size_;
    const size_t padded_bytes = chunk * size_ * element;
    std::vector<char> padded;
    const char* send = static_cast<const char*>(data.data());
    if (chunk * size_ != count) {
      padded.assign(padded_bytes, 0);
      std::memcpy(padded.data(), data.data(), count * element);
      send = padded.data();
    }
    std::vector<char> received(padded_bytes), mine(chunk * element), gathered(padded_bytes);
    guarded("all_reduce_sum", [&] {
      alltoall_bytes(send, received.data(), padded_bytes);
      sum_blocks_in_rank_order(data.dtype(), received.data(), chunk * element, size_, chunk, mine.data());
      allgather_bytes(mine.data(), gathered.data(), mine.size());
    });
    std::memcpy(data.data(), gathered.data(), count * element);
  }

  void do_all_gather(Stream, const Tensor& in, Tensor& out) override {
    check_all_gather_shapes(*this, in, out);
    check_host(in, "all_gather");
    check_host(out, "all_gather");
    if (in.bytes() == 0) return;
    if (size_ == 1) return copy_bytes(in, out);
    guarded("all_gather", [&] { allgather_bytes(in.data(), out.data(), in.bytes()); });
  }

  void do_reduce_scatter_sum(Stream, const Tensor& in, Tensor& out) override {
    check_reduce_scatter_shapes(*this, in, out);
    check_host(in, "reduce_scatter_sum");
    check_host(out, "reduce_scatter_sum");
    if (in.bytes() == 0) return;
    if (size_ == 1) return copy_bytes(in, out);
    std::vector<char> received(in.bytes());
    guarded("reduce_scatter_sum", [&] {
      alltoall_bytes(in.data(), received.data(), in.bytes());
      sum_blocks_in_rank_order(in.dtype(), received.data(), out.bytes(), size_, static_cast<size_t>(out.numel()),
                               out.data());
    });
  }

  void do_all_to_all(Stream, const Tensor& in, Tensor& out) override {
    check_all_to_all_shapes(*this, in, out);
    check_host(in, "all_to_all");
    check_host(out, "all_to_all");
    if (in.bytes() == 0) return;
    if (size_ == 1) return copy_bytes(in, out);
    std::vector<char> staging;
    const void* source = in.data();
    if (overlaps(in, out)) {  // Gloo reads in while writing out
      staging.assign(static_cast<const char*>(in.data()), static_cast<const char*>(in.data()) + in.bytes());
      source = staging.data();
    }
    guarded("all_to_all", [&] { alltoall_bytes(source, out.data(), in.bytes()); });
  }

  void do_broadcast(Stream, Tensor& data, int root) override {
    check_peer(*this, root, "broadcast");
    check_host(data, "broadcast");
    if (size_ == 1 || data.bytes() == 0) return;
    guarded("broadcast", [&] {
      gloo::BroadcastOptions options(context_);
      options.setOutput(static_cast<char*>(data.data()), data.bytes());
      options.setRoot(root);
      options.setTag(next_tag());
      options.setTimeout(job_->options.timeout);
      gloo::broadcast(options);
    });
  }

  void do_send(Stream, const Tensor& data, int peer) override {
    check_peer(*this, peer, "send");
    check_host(data, "send");
    if (peer == rank_) fail("send on group '{}': rank {} cannot send to itself; use send_recv", name_, rank_);
    guarded("send", peer, [&] {
      auto buffer = context_->createUnboundBuffer(data.data(), data.bytes());
      buffer->send(peer, p2p_slot());
      buffer->waitSend(job_->options.timeout);
    });
  }

  void do_recv(Stream, Tensor& data, int peer) override {
    check_peer(*this, peer, "recv");
    check_host(data, "recv");
    if (peer == rank_) fail("recv on group '{}': rank {} cannot receive from itself; use send_recv", name_, rank_);
    guarded("recv", peer, [&] {
      auto buffer = context_->createUnboundBuffer(data.data(), data.bytes());
      buffer->recv(peer, p2p_slot());
      buffer->waitRecv(job_->options.timeout);
    });
  }

  void do_send_recv(Stream, const Tensor& send_data, int send_to, Tensor& recv_data, int recv_from) override {
    check_peer(*this, send_to, "send_recv");
    check_peer(*this, recv_from, "send_recv");
    check_host(send_data, "send_recv");
    check_host(recv_data, "send_recv");
    if ((send_to == rank_) != (recv_from == rank_))
      fail("send_recv on group '{}': rank {} sends to {} but receives from {}; a rank talks to itself only in "
           "both directions (a ring of one)",
           name_, rank_, send_to, recv_from);
    if (send_to == rank_) {
      if (send_data.bytes() != recv_data.bytes())
        fail("send_recv on group '{}': {} and {} differ in size", name_, send_data.describe(), recv_data.describe());
      return copy_bytes(send_data, recv_data);
    }
    std::vector<char> staging;
    void* source = send_data.data();
    if (overlaps(send_data, recv_data)) {  // the receive may land before the send has left
      staging.assign(static_cast<const char*>(send_data.data()),
                     static_cast<const char*>(send_data.data()) + send_data.bytes());
      source = staging.data();
    }
    guarded("send_recv", recv_from, [&] {
      auto incoming = context_->createUnboundBuffer(recv_data.data(), recv_data.bytes());
      auto outgoing = context_->createUnboundBuffer(source, send_data.bytes());
      incoming->recv(recv_from, p2p_slot());
      outgoing->send(send_to, p2p_slot());
      incoming->waitRecv(job_->options.timeout);
      outgoing->waitSend(job_->options.timeout);
    });
  }

  void barrier() override {
    if (size_ == 1) return;
    guarded("barrier", [&] { barrier_now(); });
  }

  std::unique_ptr<Communicator> split(int color, int key, const std::string& name) override {
    std::vector<int64_t> mine{color, key}, everyone(2 * size_);
    if (size_ == 1)
      everyone = mine;
    else
      guarded("split", [&] { allgather_bytes(mine.data(), everyone.data(), sizeof(int64_t) * 2); });
    const int split_index = split_count_++;
    if (color < 0) return nullptr;

    std::vector<std::tuple<int64_t, int>> members;  // (key, rank here)
    for (int r = 0; r < size_; ++r)
      if (everyone[2 * r] == color) members.emplace_back(everyone[2 * r + 1], r);
    std::sort(members.begin(), members.end());
    const int new_size = static_cast<int>(members.size());
    const int new_rank = static_cast<int>(
        std::find(members.begin(), members.end(), std::tuple<int64_t, int>{key, rank_}) - members.begin());
    std::string child_name = name_ + "/" + name;
    std::string prefix = store_prefix_ + "/" + std::to_string(split_index) + ":" + std::to_string(color);
    if (new_size == 1) return std::make_unique<GlooCommunicator>(job_, nullptr, 0, 1, child_name, prefix);
    auto context = connect_mesh(*job_, prefix, new_rank, new_size, child_name);
    return std::make_unique<GlooCommunicator>(job_, std::move(context), new_rank, new_size, child_name, prefix);
  }

  static std::shared_ptr<gloo::Context> connect_mesh(Job& job, const std::string& prefix, int rank, int size,
                                                     const std::string& name) {
    try {
      auto context = std::make_shared<gloo::rendezvous::Context>(rank, size);
      context->setTimeout(job.options.timeout);
      StoreAdapter store(*job.store, prefix + "/");
      context->connectFullMesh(store, job.device);
      // Every member has read its peers' addresses once all pass this, so the store (in rank 0's
      // process) may go away afterwards.
      gloo::BarrierOptions options(context);
      options.setTimeout(job.options.timeout);
      gloo::barrier(options);
      return context;
    } catch (const Error& e) {
      fail("connecting group '{}' ({} ranks) failed at rank {}: {}", name, size, rank, e.what());
    } catch (const std::exception& e) {
      fail("connecting group '{}' ({} ranks) failed at rank {}: {}. Another rank probably exited; its own output "
           "says why",
           name, size, rank, e.what());
    }
  }

 private:
  void check_host(const Tensor& t, const char* call) const {
    if (!t.defined()) fail("{} on group '{}': the tensor is not allocated", call, name_);
    if (t.device().kind != DeviceKind::CPU)
      fail("{} on group '{}': the CPU communicator moves host tensors, got {}; use the NCCL communicator for "
           "device tensors",
           call, name_, t.describe());
  }

  static bool overlaps(const Tensor& a, const Tensor& b) {
    auto* a0 = static_cast<const char*>(a.data());
    auto* b0 = static_cast<const char*>(b.data());
    return a0 < b0 + b.bytes() && b0 < a0 + a.bytes();
  }

  static void copy_bytes(const Tensor& in, Tensor& out) {
    if (in.data() != out.data()) std::memmove(out.data(), in.data(), in.bytes());
  }

  uint64_t p2p_slot() const { return gloo::Slot::build(kPointToPointSlotPrefix, 0); }

  void alltoall_bytes(const void* in, void* out, size_t bytes) {
    gloo::AlltoallOptions options(context_);
    options.setInput(static_cast<char*>(const_cast<void*>(in)), bytes);
    options.setOutput(static_cast<char*>(out), bytes);
    options.setTag(next_tag());
    options.setTimeout(job_->options.timeout);
    gloo::alltoall(options);
  }

  void allgather_bytes(const void* in, void* out, size_t bytes_per_rank) {
    gloo::AllgatherOptions options(context_);
    options.setInput(static_cast<char*>(const_cast<void*>(in)), bytes_per_rank);
    options.setOutput(static_cast<char*>(out), bytes_per_rank * size_);
    options.setTag(next_tag());
    options.setTimeout(job_->options.timeout);
    gloo::allgather(options);
  }

  void barrier_now() {
    gloo::BarrierOptions options(context_);
    options.setTag(next_tag());
    options.setTimeout(job_->options.timeout);
    gloo::barrier(options);
  }

  // Every rank issues collectives in the same order, so a counter gives matching tags.
  uint32_t next_tag() { return tag_++ & 0xffffff; }

  template <typename Body>
  void guarded(const char* call, Body&& body) {
    guarded(call, -1, std::forward<Body>(body));
  }
  template <typename Body>
  void guarded(const char* call, int peer, Body&& body) {
    try {
      body();
    } catch (const Error&) {
      throw;
    } catch (const std::exception& e) {
      std::string who = peer >= 0 ? fmt::format("Rank {} of this group", peer) : std::string("Another rank");
      fail("{} on group '{}' ({} ranks; this is rank {}) failed: {}. {} probably exited or stopped responding "
           "(timeout {} s); its own output says why",
           call, name_, size_, rank_, e.what(), who, job_->options.timeout.count() / 1000.0);
    }
  }

  std::shared_ptr<Job> job_;
  std::shared_ptr<gloo::Context> context_;  // null for a group of one
  int rank_, size_;
  std::string name_;
  std::string store_prefix_;
  int split_count_ = 0;
  uint32_t tag_ = 0;
};

// Gloo writes to its sockets without MSG_NOSIGNAL, so a write to a peer that just died raises
// SIGPIPE, which kills this process without a word (Python, Gloo's usual host, ignores SIGPIPE).
// Ignored, the write fails with EPIPE and surfaces as an error naming the call. A handler the
// program installed itself is left alone.
void ignore_sigpipe() {
  struct sigaction current {};
  if (::sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) ::signal(SIGPIPE, SIG_IGN);
}

bool is_loopback(const std::string& host) {
  return host == "localhost" || host.starts_with("127.") || host == "::1";
}

}  // namespace

std::unique_ptr<Communicator> connect_cpu_world(const ProcessGroupInfo& info, const CommOptions& options) {
  auto job = std::make_shared<Job>();
  job->options = options;
  if (!info.distributed()) return std::make_unique<GlooCommunicator>(job, nullptr, 0, 1, "world", "world");
  ignore_sigpipe();
  job->store = std::make_shared<TcpStore>(info.master_addr, info.store_port, info.rank == 0, options.timeout);
  gloo::transport::tcp::attr attr;
  if (const char* iface = std::getenv("GLOO_SOCKET_IFNAME"); iface && *iface)
    attr.iface = iface;
  else if (is_loopback(info.master_addr))
    attr.hostname = "127.0.0.1";  // all ranks on this machine: stay off the network
  try {
    job->device = gloo::transport::tcp::CreateDevice(attr);
  } catch (const std::exception& e) {
    fail("cannot open a TCP endpoint for Gloo ({}); set GLOO_SOCKET_IFNAME to the network interface ranks reach "
         "each other on",
         e.what());
  }
  auto context = GlooCommunicator::connect_mesh(*job, "world", info.rank, info.world_size, "world");
  return std::make_unique<GlooCommunicator>(job, std::move(context), info.rank, info.world_size, "world", "world");
}

#endif

}  // namespace spindle::comm
