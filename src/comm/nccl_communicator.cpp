#include "comm/nccl_communicator.h"

#include "core/error.h"

#if SPINDLE_HAVE_NCCL
#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <condition_variable>
#include <cstdio>
#include <deque>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "comm/nccl_reduce.h"
#include "comm/tcp_store.h"
#endif

namespace spindle::comm {

#if !SPINDLE_HAVE_NCCL

bool nccl_communicator_available() { return false; }

std::unique_ptr<Communicator> connect_nccl_world(const ProcessGroupInfo&, int, const NcclOptions&) {
  fail("this spindle was built without NCCL, so it cannot run several GPU processes; build with CUDA "
       "(-DSPINDLE_CUDA=ON) on a machine whose CUDA toolkit has nccl.h (libnccl-dev)");
}

#else

bool nccl_communicator_available() { return true; }

namespace {

using Clock = std::chrono::steady_clock;

// A failed NCCL call becomes an Error naming the call, the place and the group; NCCL's own last
// message says more (which peer, which transport).
[[noreturn]] void throw_nccl(ncclResult_t result, ncclComm_t comm, const char* call, const char* file, int line,
                             const std::string& group) {
  const char* detail = ncclGetLastError(comm);
  fail("NCCL error {} ({}) in {} at {}:{} on group '{}'{}{}", static_cast<int>(result), ncclGetErrorString(result),
       call, file, line, group, detail && *detail ? ": " : "", detail ? detail : "");
}

[[noreturn]] void throw_cuda_call(cudaError_t e, const char* call, const char* file, int line) {
  fail("CUDA error {} ({}) in {} at {}:{}", cudaGetErrorName(e), cudaGetErrorString(e), call, file, line);
}

#define NCCL_COMM_CUDA_CHECK(call)                                                            \
  do {                                                                                        \
    cudaError_t spindle_e_ = (call);                                                          \
    if (spindle_e_ != cudaSuccess) throw_cuda_call(spindle_e_, #call, __FILE__, __LINE__);    \
  } while (0)

ncclDataType_t nccl_sum_type(DType t, const char* call, const std::string& group) {
  switch (t) {
    case DType::F32: return ncclFloat32;
    case DType::F64: return ncclFloat64;
    case DType::BF16: return ncclBfloat16;
    case DType::F16: return ncclFloat16;
    case DType::I32: return ncclInt32;
    case DType::I64: return ncclInt64;
    default:
      fail("{} on group '{}': sums support F32, F64, BF16, F16, I32 and I64, not {}", call, group, dtype_name(t));
  }
}

bool overlaps(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  auto* a0 = static_cast<const char*>(a);
  auto* b0 = static_cast<const char*>(b);
  return a_bytes && b_bytes && a0 < b0 + b_bytes && b0 < a0 + a_bytes;
}

// Stream-ordered scratch from the device's default pool (the one the CUDA backend allocates
// from, so memory statistics see it); freed on the same stream after the work that uses it.
class Scratch {
 public:
  Scratch(cudaStream_t stream, size_t bytes) : stream_(stream) {
    if (bytes) NCCL_COMM_CUDA_CHECK(cudaMallocAsync(&data_, bytes, stream));
  }
  ~Scratch() {
    if (data_) cudaFreeAsync(data_, stream_);
  }
  Scratch(const Scratch&) = delete;
  Scratch& operator=(const Scratch&) = delete;
  char* data() const { return static_cast<char*>(data_); }

 private:
  cudaStream_t stream_;
  void* data_ = nullptr;
};

// The communicator of one group: the NCCL handle, its failure state and the watchdog that turns
// a call stuck on the GPU into an abort plus an error message.
class NcclGroupState {
 public:
  NcclGroupState(ncclComm_t comm, int device, int rank, int size, std::string name,
                 std::chrono::milliseconds timeout)
      : comm_(comm), device_(device), rank_(rank), size_(size), name_(std::move(name)), timeout_(timeout) {
    watchdog_ = std::thread([this] { watch(); });
  }

  ~NcclGroupState() {
    {
      std::lock_guard lock(mutex_);
      stopping_ = true;
    }
    wake_.notify_all();
    watchdog_.join();
    cudaSetDevice(device_);
    for (auto& p : pending_) {
      cudaEventDestroy(p.start);
      cudaEventDestroy(p.finish);
    }
    for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    std::lock_guard api(api_mutex_);
    if (!aborted_) {
      // Flush what is queued, then free; a peer that is gone makes the flush wait: give up
      // after the timeout and abort instead (destructors cannot throw).
      ncclResult_t r = ncclCommFinalize(comm_);
      const auto deadline = Clock::now() + timeout_;
      ncclResult_t state = r;
      while (r == ncclSuccess || r == ncclInProgress) {
        if (ncclCommGetAsyncError(comm_, &state) != ncclSuccess || state != ncclInProgress) break;
        if (Clock::now() > deadline) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
      }
      if (state == ncclSuccess)
        ncclCommDestroy(comm_);
      else
        ncclCommAbort(comm_);
    }
  }

  ncclComm_t comm() const { return comm_; }
  std::recursive_mutex& api_mutex() { return api_mutex_; }
  int device() const { return device_; }
  int rank() const { return rank_; }
  int size() const { return size_; }
  const std::string& name() const { return name_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // Throws the recorded failure, if any: every call on a failed group reports why it failed.
  void throw_if_failed(const char* call) {
    std::lock_guard lock(mutex_);
    if (failure_) fail("{} on group '{}' cannot run: this group failed earlier. {}", call, name_, *failure_);
  }

  // Around every call that enqueues GPU work: events before and after it on `stream`.
  uint64_t begin(cudaStream_t stream, const char* call, int peer) {
    Pending p;
    p.start = take_event();
    p.finish = take_event();
    p.call = call;
    p.peer = peer;
    NCCL_COMM_CUDA_CHECK(cudaEventRecord(p.start, stream));
    std::lock_guard lock(mutex_);
    p.id = next_id_++;
    pending_.push_back(p);
    return p.id;
  }
  void end(uint64_t id, cudaStream_t stream) {
    std::lock_guard lock(mutex_);
    for (auto& p : pending_)
      if (p.id == id) {
        NCCL_COMM_CUDA_CHECK(cudaEventRecord(p.finish, stream));
        p.recorded = true;
      }
  }

  // A nonblocking NCCL call returned: wait until NCCL has enqueued it (ncclInProgress → success),
  // within the timeout; on error or timeout abort and throw.
  void complete(ncclResult_t result, const char* what, const char* call, const char* file, int line) {
    if (result == ncclSuccess) return;
    if (result != ncclInProgress) throw_nccl(result, comm_, what, file, line, name_);
    wait_until_ready(call);
  }

  // Polls this group's communicator until NCCL is done with the last call (ncclInProgress →
  // success), within the timeout; on error or timeout aborts it and throws.
  void wait_until_ready(const char* call) {
    std::lock_guard api(api_mutex_);
    const auto start = Clock::now();
    for (;;) {
      {
        std::lock_guard lock(mutex_);
        if (failure_) fail("{} on group '{}' failed: {}", call, name_, *failure_);
      }
      ncclResult_t state = ncclSuccess;
      const ncclResult_t r = ncclCommGetAsyncError(comm_, &state);
      if (r != ncclSuccess) state = r;
      if (state == ncclSuccess) return;
      if (state != ncclInProgress) {
        const std::string message = fmt::format(
            "{} on group '{}' ({} ranks; this is rank {}) failed: NCCL reported {} ({}). Another rank probably "
            "exited or stopped responding; its own output says why",
            call, name_, size_, rank_, static_cast<int>(state), ncclGetErrorString(state));
        abort_with(message);
        fail("{}", message);
      }
      if (Clock::now() - start > timeout_) {
        const std::string message = fmt::format(
            "{} on group '{}' ({} ranks; this is rank {}) did not get past NCCL's setup within {} s. Another "
            "rank probably exited or stopped responding; its own output says why",
            call, name_, size_, rank_, timeout_.count() / 1000.0);
        abort_with(message);
        fail("{}", message);
      }
      std::this_thread::yield();
    }
  }

  // Aborts the NCCL communicator once (kernels waiting on a dead peer exit) and remembers why.
  void abort_with(const std::string& message) {
    std::lock_guard api(api_mutex_);
    std::lock_guard lock(mutex_);
    if (!failure_) failure_ = message;
    if (!aborted_) {
      aborted_ = true;
      ncclCommAbort(comm_);
    }
  }

  std::optional<std::string> failure() {
    std::lock_guard lock(mutex_);
    return failure_;
  }

 private:
  struct Pending {
    uint64_t id = 0;
    cudaEvent_t start = nullptr, finish = nullptr;
    const char* call = "";
    int peer = -1;
    bool recorded = false;                 // the finish event is in the stream
    std::optional<Clock::time_point> started;  // when the watchdog first saw `start` complete
  };

  cudaEvent_t take_event() {
    {
      std::lock_guard lock(mutex_);
      if (!free_events_.empty()) {
        cudaEvent_t e = free_events_.back();
        free_events_.pop_back();
        return e;
      }
    }
    cudaEvent_t e;
    NCCL_COMM_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming));
    return e;
  }

  // Polls the oldest unfinished call: its clock starts when its start event has completed (the
  // GPU reached it), so a collective queued behind a long computation is not timed out early.
  void watch() {
    cudaSetDevice(device_);
    std::unique_lock lock(mutex_);
    while (!stopping_) {
      wake_.wait_for(lock, std::chrono::milliseconds(10));
      if (stopping_ || aborted_) continue;
      lock.unlock();
      ncclResult_t state = ncclSuccess;
      bool async_error = false;
      {
        std::lock_guard api(api_mutex_);
        if (!aborted_)
          async_error = ncclCommGetAsyncError(comm_, &state) == ncclSuccess && state != ncclSuccess &&
                        state != ncclInProgress;
      }
      lock.lock();
      if (aborted_) continue;
      std::optional<std::string> message;
      if (async_error) {
        const char* call = pending_.empty() ? "a call" : pending_.front().call;
        message = fmt::format(
            "{} on group '{}' ({} ranks; this is rank {}) failed: NCCL reported {} ({}). Another rank probably "
            "exited or stopped responding; its own output says why",
            call, name_, size_, rank_, static_cast<int>(state), ncclGetErrorString(state));
      }
      while (!message && !pending_.empty()) {
        Pending& p = pending_.front();
        if (!p.recorded) break;
        if (!p.started) {
          const cudaError_t q = cudaEventQuery(p.start);
          if (q == cudaErrorNotReady) break;
          p.started = Clock::now();
        }
        const cudaError_t q = cudaEventQuery(p.finish);
        if (q == cudaSuccess) {
          free_events_.push_back(p.start);
          free_events_.push_back(p.finish);
          pending_.pop_front();
          continue;
        }
        if (q != cudaErrorNotReady) {
          message = fmt::format("{} on group '{}' failed on the GPU: {}", p.call, name_, cudaGetErrorString(q));
        } else if (Clock::now() - *p.started > timeout_) {
          std::string who =
              p.peer >= 0 ? fmt::format("Rank {} of this group", p.peer) : std::string("Another rank");
          message = fmt::format(
              "{} on group '{}' ({} ranks; this is rank {}) did not finish within {} s of starting on the GPU. "
              "{} probably exited or stopped responding; its own output says why. The NCCL communicator was "
              "aborted",
              p.call, name_, size_, rank_, timeout_.count() / 1000.0, who);
        }
        break;
      }
      if (message) {
        lock.unlock();
        abort_with(*message);
        std::fprintf(stderr, "spindle: %s\n", message->c_str());
        lock.lock();
      }
    }
  }

  ncclComm_t comm_;
  // Held around every use of comm_ (the watchdog's polls and abort too): an aborted communicator is
  // freed, so no call may be inside NCCL, or between a group's start and end, when it is aborted.
  std::recursive_mutex api_mutex_;
  int device_, rank_, size_;
  std::string name_;
  std::chrono::milliseconds timeout_;
  std::mutex mutex_;
  std::condition_variable wake_;
  std::deque<Pending> pending_;
  std::vector<cudaEvent_t> free_events_;
  std::optional<std::string> failure_;
  bool aborted_ = false;
  bool stopping_ = false;
  uint64_t next_id_ = 0;
  std::thread watchdog_;
};

// Keeps rank 0's rendezvous store alive as long as any group of the job exists.
struct Job {
  std::shared_ptr<TcpStore> store;
  NcclOptions options;
};

#define NCCL_CALL(state, call_name, expr) (state).complete((expr), #expr, call_name, __FILE__, __LINE__)

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(std::shared_ptr<Job> job, std::unique_ptr<NcclGroupState> state, std::string store_prefix)
      : job_(std::move(job)), state_(std::move(state)), store_prefix_(std::move(store_prefix)) {}

  int rank() const override { return state_->rank(); }
  int size() const override { return state_->size(); }
  const std::string& name() const override { return state_->name(); }

  void do_all_reduce_sum(Stream stream, Tensor& data) override {
    const char* call = "all_reduce_sum";
    check_device(data, call);
    const ncclDataType_t type = nccl_sum_type(data.dtype(), call, name());
    if (data.numel() == 0) return;
    cudaStream_t s = cuda_stream(stream);
    if (job_->options.sum_order == SumOrder::Nccl) {
      return enqueue(call, -1, s, [&] {
        NCCL_CALL(*state_, call,
                  ncclAllReduce(data.data(), data.data(), static_cast<size_t>(data.numel()), type, ncclSum,
                                state_->comm(), s));
      });
    }
    // Rank order: all-to-all of chunks, my chunk summed locally in rank order, all-gather.
    const int n = size();
    const size_t element = dtype_size(data.dtype());
    const size_t count = static_cast<size_t>(data.numel());
    const size_t chunk = (count + n - 1) / n;
    const size_t chunk_bytes = chunk * element;
    const bool padded = chunk * n != count;
    Scratch padding(s, padded ? chunk_bytes * n : 0);
    char* buffer = padded ? padding.data() : static_cast<char*>(data.data());  // [n, chunk]
    if (padded) {
      NCCL_COMM_CUDA_CHECK(cudaMemcpyAsync(buffer, data.data(), count * element, cudaMemcpyDeviceToDevice, s));
      NCCL_COMM_CUDA_CHECK(cudaMemsetAsync(buffer + count * element, 0, chunk_bytes * n - count * element, s));
    }
    Scratch received(s, chunk_bytes * n);  // [n, chunk]: my chunk from every rank
    enqueue(call, -1, s, [&] { all_to_all_bytes(buffer, received.data(), chunk_bytes, s, call); });
    char* mine = buffer + static_cast<size_t>(rank()) * chunk_bytes;
    sum_blocks_in_rank_order_on_device(s, data.dtype(), received.data(), n, static_cast<int64_t>(chunk), mine);
    enqueue(call, -1, s, [&] {
      NCCL_CALL(*state_, call, ncclAllGather(mine, buffer, chunk_bytes, ncclUint8, state_->comm(), s));
    });
    if (padded)
      NCCL_COMM_CUDA_CHECK(cudaMemcpyAsync(data.data(), buffer, count * element, cudaMemcpyDeviceToDevice, s));
  }

  void do_all_gather(Stream stream, const Tensor& in, Tensor& out) override {
    const char* call = "all_gather";
    check_all_gather_shapes(*this, in, out);
    check_device(in, call);
    check_device(out, call);
    if (in.bytes() == 0) return;
    cudaStream_t s = cuda_stream(stream);
    const size_t bytes = in.bytes();
    char* my_slot = static_cast<char*>(out.data()) + static_cast<size_t>(rank()) * bytes;
    // NCCL allows the in-place form (in is my slot of out), not any other overlap.
    const bool in_place = in.data() == my_slot;
    std::optional<Scratch> staging;
    const void* source = in.data();
    if (!in_place && overlaps(in.data(), bytes, out.data(), out.bytes())) {
      staging.emplace(s, bytes);
      NCCL_COMM_CUDA_CHECK(cudaMemcpyAsync(staging->data(), in.data(), bytes, cudaMemcpyDeviceToDevice, s));
      source = staging->data();
    }
    enqueue(call, -1, s, [&] {
      NCCL_CALL(*state_, call, ncclAllGather(source, out.data(), bytes, ncclUint8, state_->comm(), s));
    });
  }

  void do_reduce_scatter_sum(Stream stream, const Tensor& in, Tensor& out) override {
    const char* call = "reduce_scatter_sum";
    check_reduce_scatter_shapes(*this, in, out);
    check_device(in, call);
    check_device(out, call);
    const ncclDataType_t type = nccl_sum_type(in.dtype(), call, name());
    if (in.bytes() == 0) return;
    cudaStream_t s = cuda_stream(stream);
    if (job_->options.sum_order == SumOrder::Nccl) {
      return enqueue(call, -1, s, [&] {
        NCCL_CALL(*state_, call,
                  ncclReduceScatter(in.data(), out.data(), static_cast<size_t>(out.numel()), type, ncclSum,
                                    state_->comm(), s));
      });
    }
    Scratch received(s, in.bytes());  // [size, n]: chunk `rank` of every rank
    enqueue(call, -1, s, [&] { all_to_all_bytes(in.data(), received.data(), out.bytes(), s, call); });
    sum_blocks_in_rank_order_on_device(s, in.dtype(), received.data(), size(), out.numel(), out.data());
  }

  void do_all_to_all(Stream stream, const Tensor& in, Tensor& out) override {
    const char* call = "all_to_all";
    check_all_to_all_shapes(*this, in, out);
    check_device(in, call);
    check_device(out, call);
    if (in.bytes() == 0) return;
    cudaStream_t s = cuda_stream(stream);
    std::optional<Scratch> staging;
    const void* source = in.data();
    if (overlaps(in.data(), in.bytes(), out.data(), out.bytes())) {  // receives may land before sends leave
      staging.emplace(s, in.bytes());
      NCCL_COMM_CUDA_CHECK(cudaMemcpyAsync(staging->data(), in.data(), in.bytes(), cudaMemcpyDeviceToDevice, s));
      source = staging->data();
    }
    enqueue(call, -1, s, [&] { all_to_all_bytes(source, out.data(), in.bytes() / size(), s, call); });
  }

  void do_broadcast(Stream stream, Tensor& data, int root) override {
    const char* call = "broadcast";
    check_peer(*this, root, call);
    check_device(data, call);
    if (data.bytes() == 0) return;
    cudaStream_t s = cuda_stream(stream);
    enqueue(call, root, s, [&] {
      NCCL_CALL(*state_, call,
                ncclBroadcast(data.data(), data.data(), data.bytes(), ncclUint8, root, state_->comm(), s));
    });
  }

  void do_send(Stream stream, const Tensor& data, int peer) override {
    const char* call = "send";
    check_peer(*this, peer, call);
    check_device(data, call);
    if (peer == rank()) fail("send on group '{}': rank {} cannot send to itself; use send_recv", name(), rank());
    if (data.bytes() == 0) return;
    cudaStream_t s = cuda_stream(stream);
    enqueue(call, peer, s, [&] {
      NCCL_CALL(*state_, call, ncclSend(data.data(), data.bytes(), ncclUint8, peer, state_->comm(), s));
    });
  }

  void do_recv(Stream stream, Tensor& data, int peer) override {
    const char* call = "recv";
    check_peer(*this, peer, call);
    check_device(data, call);
    if (peer == rank())
      fail("recv on group '{}': rank {} cannot receive from itself; use send_recv", name(), rank());
    if (data.bytes() == 0) return;
    cudaStream_t s = cuda_stream(stream);
    enqueue(call, peer, s, [&] {
      NCCL_CALL(*state_, call, ncclRecv(data.data(), data.bytes(), ncclUint8, peer, state_->comm(), s));
    });
  }

  void do_send_recv(Stream stream, const Tensor& send_data, int send_to, Tensor& recv_data, int recv_from) override {
    const char* call = "send_recv";
    check_peer(*this, send_to, call);
    check_peer(*this, recv_from, call);
    check_device(send_data, call);
    check_device(recv_data, call);
    if ((send_to == rank()) != (recv_from == rank()))
      fail("send_recv on group '{}': rank {} sends to {} but receives from {}; a rank talks to itself only in "
           "both directions (a ring of one)",
           name(), rank(), send_to, recv_from);
    cudaStream_t s = cuda_stream(stream);
    if (send_to == rank()) {
      if (send_data.bytes() != recv_data.bytes())
        fail("send_recv on group '{}': {} and {} differ in size", name(), send_data.describe(),
             recv_data.describe());
      state_->throw_if_failed(call);
      if (send_data.data() != recv_data.data() && send_data.bytes())
        NCCL_COMM_CUDA_CHECK(cudaMemcpyAsync(recv_data.data(), send_data.data(), send_data.bytes(),
                                             cudaMemcpyDeviceToDevice, s));
      return;
    }
    std::optional<Scratch> staging;
    const void* source = send_data.data();
    if (overlaps(send_data.data(), send_data.bytes(), recv_data.data(), recv_data.bytes())) {
      staging.emplace(s, send_data.bytes());
      NCCL_COMM_CUDA_CHECK(
          cudaMemcpyAsync(staging->data(), source, send_data.bytes(), cudaMemcpyDeviceToDevice, s));
      source = staging->data();
    }
    enqueue(call, recv_from, s, [&] {
      NCCL_CALL(*state_, call, ncclGroupStart());
      if (send_data.bytes())
        NCCL_CALL(*state_, call, ncclSend(source, send_data.bytes(), ncclUint8, send_to, state_->comm(), s));
      if (recv_data.bytes())
        NCCL_CALL(*state_, call,
                  ncclRecv(recv_data.data(), recv_data.bytes(), ncclUint8, recv_from, state_->comm(), s));
      NCCL_CALL(*state_, call, ncclGroupEnd());
    });
  }

  // Host-side: returns once every rank has called it (not once their queued GPU work is done).
  void barrier() override {
    const char* call = "barrier";
    state_->throw_if_failed(call);
    if (size() == 1) return;
    activate();
    if (!barrier_stream_) {
      NCCL_COMM_CUDA_CHECK(cudaStreamCreateWithFlags(&barrier_stream_, cudaStreamNonBlocking));
      NCCL_COMM_CUDA_CHECK(cudaMalloc(&barrier_word_, sizeof(int32_t)));
    }
    enqueue(call, -1, barrier_stream_, [&] {
      NCCL_CALL(*state_, call,
                ncclAllReduce(barrier_word_, barrier_word_, 1, ncclInt32, ncclSum, state_->comm(), barrier_stream_));
    });
    for (;;) {
      const cudaError_t q = cudaStreamQuery(barrier_stream_);
      if (auto failure = state_->failure()) fail("{}", *failure);  // the watchdog aborted it
      if (q == cudaSuccess) return;
      if (q != cudaErrorNotReady) NCCL_COMM_CUDA_CHECK(q);
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }

  // Members exchange (color, key) through the job's TCP store, the first member of each new group
  // publishes a fresh NCCL unique id there, and the group connects like the world does. (Not
  // ncclCommSplit: in nonblocking mode NCCL 2.28 publishes the child's handle only when the split
  // completes, and our 2-GPU test of it hung; this path is the tested one of connect_nccl_world.)
  std::unique_ptr<Communicator> split(int color, int key, const std::string& child_name) override {
    const char* call = "split";
    state_->throw_if_failed(call);
    const std::string prefix = store_prefix_ + "/" + std::to_string(split_count_++);
    std::vector<std::pair<int64_t, int64_t>> everyone(size());  // (color, key) per rank here
    everyone[rank()] = {color, key};
    if (size() > 1) {
      TcpStore& store = *job_->store;
      std::vector<char> mine(2 * sizeof(int64_t));
      const int64_t pair[2] = {color, key};
      std::memcpy(mine.data(), pair, sizeof pair);
      store.set(fmt::format("nccl/{}/ck/{}", prefix, rank()), mine);
      for (int r = 0; r < size(); ++r) {
        if (r == rank()) continue;
        std::vector<char> bytes;
        try {
          bytes = store.get(fmt::format("nccl/{}/ck/{}", prefix, r), state_->timeout());
        } catch (const Error& e) {
          fail("split on group '{}' ({} ranks; this is rank {}): rank {} did not call split within {} s ({}); it "
               "probably exited or stopped responding",
               name(), size(), rank(), r, state_->timeout().count() / 1000.0, e.what());
        }
        SPINDLE_CHECK(bytes.size() == sizeof pair, "split record of {} bytes", bytes.size());
        int64_t theirs[2];
        std::memcpy(theirs, bytes.data(), sizeof theirs);
        everyone[r] = {theirs[0], theirs[1]};
      }
    }
    if (color < 0) return nullptr;
    std::vector<std::pair<int64_t, int>> members;  // (key, rank here), ordered
    for (int r = 0; r < size(); ++r)
      if (everyone[r].first == color) members.emplace_back(everyone[r].second, r);
    std::sort(members.begin(), members.end());
    const int new_size = static_cast<int>(members.size());
    const int new_rank = static_cast<int>(
        std::find(members.begin(), members.end(), std::pair<int64_t, int>{key, rank()}) - members.begin());
    const std::string child_prefix = prefix + ":" + std::to_string(color);

    ncclUniqueId id{};
    if (new_rank == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) throw_nccl(r, nullptr, "ncclGetUniqueId", __FILE__, __LINE__, name());
      if (new_size > 1)
        job_->store->set("nccl/" + child_prefix + "/id", std::vector<char>(id.internal, id.internal + sizeof id.internal));
    } else {
      std::vector<char> bytes;
      try {
        bytes = job_->store->get("nccl/" + child_prefix + "/id", state_->timeout());
      } catch (const Error& e) {
        fail("split on group '{}': the first member of the new group '{}' did not publish its id within {} s ({})",
             name(), child_name, state_->timeout().count() / 1000.0, e.what());
      }
      SPINDLE_CHECK(bytes.size() == sizeof id.internal, "NCCL unique id of {} bytes", bytes.size());
      std::copy(bytes.begin(), bytes.end(), id.internal);
    }
    activate();
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t child = nullptr;
    const ncclResult_t r = ncclCommInitRankConfig(&child, new_size, id, new_rank, &config);
    if (r != ncclSuccess && r != ncclInProgress)
      throw_nccl(r, child, "ncclCommInitRankConfig", __FILE__, __LINE__, name() + "/" + child_name);
    auto child_state = std::make_unique<NcclGroupState>(child, state_->device(), new_rank, new_size,
                                                        name() + "/" + child_name, state_->timeout());
    child_state->wait_until_ready(call);
    return std::make_unique<NcclCommunicator>(job_, std::move(child_state), child_prefix);
  }

  ~NcclCommunicator() override {
    if (barrier_stream_) {
      cudaSetDevice(state_->device());
      cudaStreamSynchronize(barrier_stream_);
      cudaFree(barrier_word_);
      cudaStreamDestroy(barrier_stream_);
    }
  }

 private:
  void activate() const {
    int current = -1;
    NCCL_COMM_CUDA_CHECK(cudaGetDevice(&current));
    if (current != state_->device()) NCCL_COMM_CUDA_CHECK(cudaSetDevice(state_->device()));
  }

  static cudaStream_t cuda_stream(Stream stream) { return static_cast<cudaStream_t>(stream.handle); }

  void check_device(const Tensor& t, const char* call) const {
    if (!t.defined()) fail("{} on group '{}': the tensor is not allocated", call, name());
    if (t.device().kind != DeviceKind::CUDA || t.device().index != state_->device())
      fail("{} on group '{}': the NCCL communicator of this process moves tensors on cuda:{}, got {}; allocate "
           "them with this rank's CUDA backend (or use the CPU communicator for host tensors)",
           call, name(), state_->device(), t.describe());
  }

  // Runs `body` (which issues NCCL calls on `s`) between the watchdog's events.
  template <typename Body>
  void enqueue(const char* call, int peer, cudaStream_t s, Body&& body) {
    std::lock_guard api(state_->api_mutex());
    state_->throw_if_failed(call);
    activate();
    const uint64_t id = state_->begin(s, call, peer);
    body();
    state_->end(id, s);
  }

  // Chunk j of `in` goes to rank j; chunk i of `out` comes from rank i (grouped send/recv).
  void all_to_all_bytes(const void* in, void* out, size_t chunk_bytes, cudaStream_t s, const char* call) {
    const auto* src = static_cast<const char*>(in);
    auto* dst = static_cast<char*>(out);
    const size_t me = static_cast<size_t>(rank());
    NCCL_COMM_CUDA_CHECK(cudaMemcpyAsync(dst + me * chunk_bytes, src + me * chunk_bytes, chunk_bytes,
                                         cudaMemcpyDeviceToDevice, s));
    if (size() == 1) return;
    NCCL_CALL(*state_, call, ncclGroupStart());
    for (int peer = 0; peer < size(); ++peer) {
      if (peer == rank()) continue;
      const size_t offset = static_cast<size_t>(peer) * chunk_bytes;
      NCCL_CALL(*state_, call, ncclSend(src + offset, chunk_bytes, ncclUint8, peer, state_->comm(), s));
      NCCL_CALL(*state_, call, ncclRecv(dst + offset, chunk_bytes, ncclUint8, peer, state_->comm(), s));
    }
    NCCL_CALL(*state_, call, ncclGroupEnd());
  }

  std::shared_ptr<Job> job_;
  std::unique_ptr<NcclGroupState> state_;
  std::string store_prefix_;  // this group's keys in the job's store ("world", "world/0:1", ...)
  int split_count_ = 0;       // every member splits in the same order, so this names each split
  cudaStream_t barrier_stream_ = nullptr;
  void* barrier_word_ = nullptr;
};

// Every rank announces itself in the store and waits for all others, so a rank that never
// started (or died before this point) is reported by number instead of NCCL's init hanging.
void wait_for_all_ranks(TcpStore& store, const ProcessGroupInfo& info, std::chrono::milliseconds timeout) {
  store.set(fmt::format("nccl/world/arrived/{}", info.rank), {'1'});
  for (int r = 0; r < info.world_size; ++r) {
    try {
      store.get(fmt::format("nccl/world/arrived/{}", r), timeout);
    } catch (const Error& e) {
      fail("connecting NCCL group 'world' ({} ranks) at rank {}: rank {} did not arrive within {} s ({}); its "
           "own output says why",
           info.world_size, info.rank, r, timeout.count() / 1000.0, e.what());
    }
  }
}

}  // namespace

std::unique_ptr<Communicator> connect_nccl_world(const ProcessGroupInfo& info, int device, const NcclOptions& options) {
  int count = 0;
  const cudaError_t e = cudaGetDeviceCount(&count);
  if (e != cudaSuccess || count == 0)
    fail("the NCCL communicator needs a CUDA device, and none is available ({})",
         e == cudaSuccess ? "0 devices" : cudaGetErrorString(e));
  if (device < 0 || device >= count)
    fail("rank {} asked for CUDA device {}, but this machine has {} (devices 0..{}); run at most {} processes per "
         "machine",
         info.rank, device, count, count - 1, count);
  NCCL_COMM_CUDA_CHECK(cudaSetDevice(device));

  auto job = std::make_shared<Job>();
  job->options = options;
  const auto timeout = options.comm.timeout;
  ncclUniqueId id{};
  if (info.distributed()) {
    job->store = std::make_shared<TcpStore>(info.master_addr, info.store_port, info.rank == 0, timeout);
    wait_for_all_ranks(*job->store, info, timeout);
    if (info.rank == 0) {
      const ncclResult_t r = ncclGetUniqueId(&id);
      if (r != ncclSuccess) throw_nccl(r, nullptr, "ncclGetUniqueId", __FILE__, __LINE__, "world");
      job->store->set("nccl/world/id", std::vector<char>(id.internal, id.internal + sizeof(id.internal)));
    } else {
      const std::vector<char> bytes = job->store->get("nccl/world/id", timeout);
      SPINDLE_CHECK(bytes.size() == sizeof(id.internal), "NCCL unique id of {} bytes", bytes.size());
      std::copy(bytes.begin(), bytes.end(), id.internal);
    }
  } else {
    const ncclResult_t r = ncclGetUniqueId(&id);
    if (r != ncclSuccess) throw_nccl(r, nullptr, "ncclGetUniqueId", __FILE__, __LINE__, "world");
  }

  // Nonblocking: no NCCL call can hang the host; complete()/wait_until_ready() poll with the timeout.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t r = ncclCommInitRankConfig(&comm, info.world_size, id, info.rank, &config);
  if (r != ncclSuccess && r != ncclInProgress)
    throw_nccl(r, comm, "ncclCommInitRankConfig", __FILE__, __LINE__, "world");
  auto state = std::make_unique<NcclGroupState>(comm, device, info.rank, info.world_size, "world", timeout);
  state->wait_until_ready("connecting");
  return std::make_unique<NcclCommunicator>(job, std::move(state), "world");
}

#endif

}  // namespace spindle::comm
