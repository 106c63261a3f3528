// The NCCL communicator on real processes, one GPU each: every collective against a host
// computation (each rank regenerates every rank's input from its seed), the rank-order sums bit
// for bit against the CPU communicator's reduction, NCCL's own sums to rounding, split and
// new_group, and dead or stuck peers turning into errors instead of hangs. Skips below 2 GPUs.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <random>
#include <thread>

#include "backend/cuda/cuda_backend.h"
#include "comm/host_reduce.h"
#include "comm/multiprocess.h"
#include "comm/nccl_communicator.h"
#include "core/error.h"

namespace spindle::comm {
namespace {

using spindle::testing::expect_all_succeeded;
using spindle::testing::require;
using spindle::testing::run_ranks;
using Clock = std::chrono::steady_clock;

// CUDA must not start in the parent (the ranks are forked), so count the GPUs in a child.
int gpu_count() {
  static const int count = [] {
    pid_t pid = ::fork();
    if (pid == 0) ::_exit(std::min(cuda_device_count(), 100));
    int status = 0;
    ::waitpid(pid, &status, 0);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 0;
  }();
  return count;
}

#define REQUIRE_GPUS(n)                                                                        \
  if (!nccl_communicator_available()) GTEST_SKIP() << "built without NCCL";                   \
  if (gpu_count() < (n)) GTEST_SKIP() << "needs " << (n) << " GPUs, found " << gpu_count()

constexpr int kRanks = 2;

// Random host bytes for `count` elements of dtype, reproducible from seed.
std::vector<char> random_bytes(DType dtype, int64_t count, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> real(-1.0, 1.0);
  std::uniform_int_distribution<int64_t> integer(-100000, 100000);
  std::vector<char> bytes(count * dtype_size(dtype));
  for (int64_t i = 0; i < count; ++i) {
    void* p = bytes.data() + i * dtype_size(dtype);
    switch (dtype) {
      case DType::F32: { float v = static_cast<float>(real(rng)); std::memcpy(p, &v, 4); break; }
      case DType::F64: { double v = real(rng); std::memcpy(p, &v, 8); break; }
      case DType::I32: { int32_t v = static_cast<int32_t>(integer(rng)); std::memcpy(p, &v, 4); break; }
      case DType::I64: { int64_t v = integer(rng) << 20; std::memcpy(p, &v, 8); break; }
      case DType::BF16: { uint16_t v = f32_to_bf16(static_cast<float>(real(rng))); std::memcpy(p, &v, 2); break; }
      case DType::F16: { uint16_t v = f32_to_f16(static_cast<float>(real(rng))); std::memcpy(p, &v, 2); break; }
      default: throw std::runtime_error("unsupported dtype in test");
    }
  }
  return bytes;
}

double element(DType dtype, const std::vector<char>& bytes, int64_t i) {
  const char* p = bytes.data() + i * dtype_size(dtype);
  switch (dtype) {
    case DType::F32: { float v; std::memcpy(&v, p, 4); return v; }
    case DType::F64: { double v; std::memcpy(&v, p, 8); return v; }
    case DType::BF16: { uint16_t v; std::memcpy(&v, p, 2); return bf16_to_f32(v); }
    case DType::F16: { uint16_t v; std::memcpy(&v, p, 2); return f16_to_f32(v); }
    case DType::I32: { int32_t v; std::memcpy(&v, p, 4); return v; }
    case DType::I64: { int64_t v; std::memcpy(&v, p, 8); return static_cast<double>(v); }
    default: throw std::runtime_error("unsupported dtype in test");
  }
}

uint64_t seed_of(int test, int rank, DType dtype) { return 1000003ull * test + 7919ull * rank + static_cast<int>(dtype); }

struct Rank {
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Communicator> world;
  Stream stream;

  Rank(const ProcessGroupInfo& info, const NcclOptions& options)
      : backend(make_cuda_backend(info.local_rank)),
        world(connect_nccl_world(info, info.local_rank, options)),
        stream(backend->default_stream()) {}

  Tensor upload(const std::vector<char>& bytes, Shape shape, DType dtype) {
    Tensor t = backend->empty(shape, dtype);
    backend->copy_from_host(stream, bytes.data(), t);
    return t;
  }
  std::vector<char> download(const Tensor& t) {
    std::vector<char> bytes(t.bytes());
    backend->copy_to_host(stream, t, bytes.data());
    return bytes;
  }
  // Filled with a pattern the collective must overwrite entirely.
  Tensor poisoned(Shape shape, DType dtype) {
    Tensor t = backend->empty(shape, dtype);
    if (t.bytes()) cudaMemsetAsync(t.data(), 0x7f, t.bytes(), static_cast<cudaStream_t>(stream.handle));
    return t;
  }
};

const DType kSumTypes[] = {DType::F32, DType::BF16, DType::F16, DType::F64, DType::I32, DType::I64};

// All ranks' inputs of one call, and their rank-order sum as the CPU communicator computes it.
std::vector<char> host_rank_order_sum(DType dtype, const std::vector<std::vector<char>>& inputs, int64_t count) {
  std::vector<char> blocks;
  for (const auto& in : inputs) blocks.insert(blocks.end(), in.begin(), in.end());
  std::vector<char> out(count * dtype_size(dtype));
  sum_blocks_in_rank_order(dtype, blocks.data(), count * dtype_size(dtype), static_cast<int>(inputs.size()),
                           static_cast<size_t>(count), out.data());
  return out;
}

TEST(Nccl, RankOrderSumsAreBitIdenticalToTheHostReduction) {
  REQUIRE_GPUS(kRanks);
  auto outcomes = run_ranks(kRanks, [](const ProcessGroupInfo& info) {
    Rank r(info, {});
    for (DType dtype : kSumTypes) {
      // all_reduce_sum: 1001 elements (not a multiple of the rank count: the padded path), and 4096.
      for (int64_t count : {int64_t{1001}, int64_t{4096}, int64_t{1}}) {
        std::vector<std::vector<char>> inputs;
        for (int k = 0; k < kRanks; ++k) inputs.push_back(random_bytes(dtype, count, seed_of(1, k, dtype) + count));
        Tensor data = r.upload(inputs[info.rank], Shape{count}, dtype);
        r.world->all_reduce_sum(r.stream, data);
        require(r.download(data) == host_rank_order_sum(dtype, inputs, count),
                "all_reduce_sum {} x{} differs from the host rank-order sum", dtype_name(dtype), count);
      }
      // reduce_scatter_sum: in [kRanks·513, 3] -> out [513, 3] = Σ chunk `rank`.
      const int64_t rows = 513, cols = 3, chunk = rows * cols;
      std::vector<std::vector<char>> inputs, my_chunks;
      for (int k = 0; k < kRanks; ++k) {
        inputs.push_back(random_bytes(dtype, kRanks * chunk, seed_of(2, k, dtype)));
        const size_t b = chunk * dtype_size(dtype);
        my_chunks.emplace_back(inputs.back().begin() + info.rank * b, inputs.back().begin() + (info.rank + 1) * b);
      }
      Tensor in = r.upload(inputs[info.rank], Shape{kRanks * rows, cols}, dtype);
      Tensor out = r.poisoned(Shape{rows, cols}, dtype);
      r.world->reduce_scatter_sum(r.stream, in, out);
      require(r.download(out) == host_rank_order_sum(dtype, my_chunks, chunk),
              "reduce_scatter_sum {} differs from the host rank-order sum", dtype_name(dtype));
    }
  });
  expect_all_succeeded(outcomes);
}

TEST(Nccl, DataMovementMatchesTheHostLayout) {
  REQUIRE_GPUS(kRanks);
  auto outcomes = run_ranks(kRanks, [](const ProcessGroupInfo& info) {
    Rank r(info, {});
    const int me = info.rank, peer = 1 - info.rank;
    for (DType dtype : {DType::BF16, DType::F32, DType::I64}) {
      const size_t es = dtype_size(dtype);
      auto input = [&](int test, int rank, int64_t count) { return random_bytes(dtype, count, seed_of(test, rank, dtype)); };

      // all_gather: in [7, 5] -> out [14, 5], rank order; and the in-place form.
      {
        const int64_t n = 7 * 5;
        Tensor in = r.upload(input(3, me, n), Shape{7, 5}, dtype);
        Tensor out = r.poisoned(Shape{kRanks * 7, 5}, dtype);
        r.world->all_gather(r.stream, in, out);
        std::vector<char> expected;
        for (int k = 0; k < kRanks; ++k) {
          auto b = input(3, k, n);
          expected.insert(expected.end(), b.begin(), b.end());
        }
        require(r.download(out) == expected, "all_gather {}", dtype_name(dtype));
        Tensor whole = r.poisoned(Shape{kRanks * 7, 5}, dtype);
        Tensor mine = whole.rows(me * 7, me * 7 + 7);
        r.backend->copy(r.stream, in, mine);
        r.world->all_gather(r.stream, mine, whole);
        require(r.download(whole) == expected, "in-place all_gather {}", dtype_name(dtype));
      }
      // all_to_all: chunk j of rank k's input lands as chunk k of rank j's output; in place too.
      {
        const int64_t rows = 2 * 9, n = rows * 4, chunk_bytes = n / kRanks * es;
        Tensor in = r.upload(input(4, me, n), Shape{rows, 4}, dtype);
        Tensor out = r.poisoned(Shape{rows, 4}, dtype);
        r.world->all_to_all(r.stream, in, out);
        std::vector<char> expected;
        for (int k = 0; k < kRanks; ++k) {
          auto b = input(4, k, n);
          expected.insert(expected.end(), b.begin() + me * chunk_bytes, b.begin() + (me + 1) * chunk_bytes);
        }
        require(r.download(out) == expected, "all_to_all {}", dtype_name(dtype));
        r.world->all_to_all(r.stream, in, in);
        require(r.download(in) == expected, "in-place all_to_all {}", dtype_name(dtype));
      }
      // broadcast from rank 1.
      {
        Tensor data = r.upload(input(5, me, 333), Shape{333}, dtype);
        r.world->broadcast(r.stream, data, 1);
        require(r.download(data) == input(5, 1, 333), "broadcast {}", dtype_name(dtype));
      }
      // send_recv around the ring, and with itself (a ring of one), and send/recv in turn.
      {
        Tensor out = r.upload(input(6, me, 100), Shape{100}, dtype);
        Tensor in = r.poisoned(Shape{100}, dtype);
        r.world->send_recv(r.stream, out, (me + 1) % kRanks, in, (me + kRanks - 1) % kRanks);
        require(r.download(in) == input(6, (me + kRanks - 1) % kRanks, 100), "send_recv {}", dtype_name(dtype));
        Tensor self = r.poisoned(Shape{100}, dtype);
        r.world->send_recv(r.stream, out, me, self, me);
        require(r.download(self) == input(6, me, 100), "send_recv to itself {}", dtype_name(dtype));
        Tensor got = r.poisoned(Shape{64}, dtype);
        Tensor mine = r.upload(input(7, me, 64), Shape{64}, dtype);
        if (me == 0) {
          r.world->send(r.stream, mine, peer);
          r.world->recv(r.stream, got, peer);
        } else {
          r.world->recv(r.stream, got, peer);
          r.world->send(r.stream, mine, peer);
        }
        require(r.download(got) == input(7, peer, 64), "send/recv {}", dtype_name(dtype));
      }
    }
    r.world->barrier();

    // Host tensors and tensors of another device are refused with a message.
    auto host = make_cpu_backend(1);
    Tensor host_tensor = host->zeros(Shape{4}, DType::F32);
    try {
      r.world->all_reduce_sum(r.stream, host_tensor);
      throw std::runtime_error("a host tensor was accepted");
    } catch (const Error& e) {
      require(std::string(e.what()).find("moves tensors on cuda:" + std::to_string(info.local_rank)) !=
                  std::string::npos,
              "unexpected message: {}", e.what());
    }
  });
  expect_all_succeeded(outcomes);
}

// Ring attention's overlap (sp_attention.cpp): send_recv on the backend's comm stream while the
// compute stream works on the block it holds, double-buffered, ordered only by stream_wait. Each
// rank's block holds rank + 1; over `steps` ring steps the compute stream adds every block it
// holds into `sum` after long busy work reading it. A missing or misplaced wait lets a receive
// overwrite a block that is still being read, or a block be read before it has arrived.
TEST(Nccl, RingSendRecvOnTheCommStreamOverlapsCompute) {
  REQUIRE_GPUS(kRanks);
  auto outcomes = run_ranks(kRanks, [](const ProcessGroupInfo& info) {
    Rank r(info, {});
    Backend& be = *r.backend;
    const Stream compute = r.stream, comm = be.comm_stream();
    const int me = info.rank, next = (me + 1) % kRanks, previous = (me + kRanks - 1) % kRanks;
    const int64_t n = int64_t{8} << 20;  // 32 MiB of F32 per block
    const int steps = 6, work = 30;
    Tensor block[2] = {be.empty(Shape{n}, DType::F32), be.empty(Shape{n}, DType::F32)};
    Tensor sum = be.empty(Shape{n}, DType::F32), busy = be.empty(Shape{n}, DType::F32);
    be.fill(compute, block[0], me + 1.0);
    be.fill(compute, block[1], -1.0);
    be.fill(compute, sum, 0.0);
    be.fill(compute, busy, 0.0);
    be.stream_wait(comm, compute);
    for (int step = 0; step < steps; ++step) {
      Tensor& held = block[step % 2];
      Tensor& incoming = block[(step + 1) % 2];
      if (step + 1 < steps) r.world->send_recv(comm, held, next, incoming, previous);
      for (int w = 0; w < work; ++w) be.axpy(compute, 0.0, held, busy);
      be.axpy(compute, 1.0, held, sum);
      if (step + 2 < steps) be.stream_wait(comm, compute);
      if (step + 1 < steps) be.stream_wait(compute, comm);
    }
    be.stream_wait(compute, comm);
    double want = 0;
    for (int step = 0; step < steps; ++step) want += ((me - step) % kRanks + kRanks) % kRanks + 1.0;
    std::vector<float> got(static_cast<size_t>(n));
    be.copy_to_host(compute, sum, got.data());
    int64_t bad = 0;
    for (float v : got) bad += v != static_cast<float>(want);
    require(bad == 0, "rank {}: {} of {} sums differ from {} (first {})", me, bad, n, want, got[0]);
  });
  expect_all_succeeded(outcomes);
}

TEST(Nccl, NcclSumOrderAgreesToRoundingAndAcrossRanks) {
  REQUIRE_GPUS(kRanks);
  auto outcomes = run_ranks(kRanks, [](const ProcessGroupInfo& info) {
    NcclOptions options;
    options.sum_order = SumOrder::Nccl;
    Rank r(info, options);
    for (DType dtype : {DType::F32, DType::BF16}) {
      const int64_t count = 1 << 20;
      std::vector<std::vector<char>> inputs;
      for (int k = 0; k < kRanks; ++k) inputs.push_back(random_bytes(dtype, count, seed_of(8, k, dtype)));
      Tensor data = r.upload(inputs[info.rank], Shape{count}, dtype);
      r.world->all_reduce_sum(r.stream, data);
      const std::vector<char> result = r.download(data);
      // Close to the exact sum: one rounding for F32 (2 ranks: one addition), BF16 rounds once too.
      const double tolerance = dtype == DType::F32 ? 1.2e-7 : 8e-3;
      for (int64_t i = 0; i < count; ++i) {
        double exact = 0;
        for (int k = 0; k < kRanks; ++k) exact += element(dtype, inputs[k], i);
        const double got = element(dtype, result, i);
        require(std::abs(got - exact) <= tolerance * std::max(1.0, std::abs(exact)),
                "{} element {}: {} vs exact {}", dtype_name(dtype), i, got, exact);
      }
      // Every rank holds the same bits.
      Tensor gathered = r.poisoned(Shape{kRanks * count}, dtype);
      r.world->all_gather(r.stream, data, gathered);
      const std::vector<char> all = r.download(gathered);
      for (int k = 1; k < kRanks; ++k)
        require(std::memcmp(all.data(), all.data() + k * result.size(), result.size()) == 0,
                "rank {} holds different {} sums than rank 0", k, dtype_name(dtype));
      // reduce_scatter_sum with NCCL's order.
      Tensor in = r.upload(inputs[info.rank], Shape{count}, dtype);
      Tensor out = r.poisoned(Shape{count / kRanks}, dtype);
      r.world->reduce_scatter_sum(r.stream, in, out);
      const std::vector<char> part = r.download(out);
      for (int64_t i = 0; i < count / kRanks; ++i) {
        const int64_t src = info.rank * (count / kRanks) + i;
        require(element(dtype, part, i) == element(dtype, result, src), "reduce_scatter {} element {}",
                dtype_name(dtype), i);
      }
    }
  });
  expect_all_succeeded(outcomes);
}

TEST(Nccl, SplitAndNewGroupFollowKeysAndColors) {
  REQUIRE_GPUS(kRanks);
  auto outcomes = run_ranks(kRanks, [](const ProcessGroupInfo& info) {
    Rank r(info, {});
    // Same color, keys reversing the order: the child's rank 0 is the world's last rank.
    auto reversed = r.world->split(0, -info.rank, "reversed");
    require(reversed && reversed->size() == kRanks && reversed->rank() == kRanks - 1 - info.rank,
            "reversed split: size {} rank {}", reversed ? reversed->size() : -1, reversed ? reversed->rank() : -1);
    require(reversed->name() == "world/reversed", "name {}", reversed->name());
    std::vector<char> id_bytes(4);
    const int32_t me = info.rank;
    std::memcpy(id_bytes.data(), &me, 4);
    Tensor id = r.upload(id_bytes, Shape{1}, DType::I32);
    Tensor ids = r.poisoned(Shape{kRanks}, DType::I32);
    reversed->all_gather(r.stream, id, ids);
    std::vector<char> got = r.download(ids);
    for (int k = 0; k < kRanks; ++k) {
      int32_t v;
      std::memcpy(&v, got.data() + 4 * k, 4);
      require(v == kRanks - 1 - k, "reversed group slot {} holds world rank {}", k, v);
    }
    // One group per rank: a sum over a group of one is the input.
    auto alone = r.world->split(info.rank, 0, "alone");
    require(alone && alone->size() == 1 && alone->rank() == 0, "split by rank");
    std::vector<char> bytes = random_bytes(DType::F32, 50, seed_of(9, info.rank, DType::F32));
    Tensor x = r.upload(bytes, Shape{50}, DType::F32);
    alone->all_reduce_sum(r.stream, x);
    require(r.download(x) == bytes, "all_reduce over a group of one changed the data");
    // A negative color joins nothing.
    auto some = r.world->split(info.rank == 0 ? 0 : -1, 0, "some");
    require((info.rank == 0) == (some != nullptr), "negative color");
    auto listed = r.world->new_group({1, 0}, "listed");
    require(listed && listed->rank() == (info.rank == 1 ? 0 : 1), "new_group order");
    listed->barrier();
  });
  expect_all_succeeded(outcomes);
}

TEST(Nccl, PeerThatExitsIsAnErrorWithinTheTimeout) {
  REQUIRE_GPUS(kRanks);
  auto outcomes = run_ranks(kRanks, [](const ProcessGroupInfo& info) {
    NcclOptions options;
    options.comm.timeout = std::chrono::seconds(3);
    Rank r(info, options);
    Tensor data = r.backend->zeros(Shape{1 << 16}, DType::F32);
    r.world->all_reduce_sum(r.stream, data);  // connections are up
    r.backend->synchronize(r.stream);
    r.world->barrier();
    if (info.rank == 1) ::_exit(7);
    const auto start = Clock::now();
    std::string message;
    try {
      for (int i = 0; i < 1000; ++i) {
        r.world->all_reduce_sum(r.stream, data);
        r.backend->synchronize(r.stream);
      }
    } catch (const Error& e) {
      message = e.what();
    }
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    require(!message.empty(), "no error although rank 1 exited");
    require(seconds < 20, "took {} s to notice", seconds);
    // The error that surfaced may be CUDA's view of the aborted kernel; the group then reports why.
    if (message.find("probably exited") == std::string::npos) {
      try {
        r.world->barrier();
      } catch (const Error& e) {
        message = e.what();
      }
    }
    require(message.find("all_reduce_sum on group 'world'") != std::string::npos &&
                message.find("probably exited or stopped responding") != std::string::npos,
            "unexpected message: {}", message);
  }, 90);
  expect_all_succeeded({outcomes[0]});
  EXPECT_TRUE(WIFEXITED(outcomes[1].status) && WEXITSTATUS(outcomes[1].status) == 7);
}

TEST(Nccl, StuckPeerTimesOutInBarrier) {
  REQUIRE_GPUS(kRanks);
  auto outcomes = run_ranks(kRanks, [](const ProcessGroupInfo& info) {
    NcclOptions options;
    options.comm.timeout = std::chrono::seconds(2);
    Rank r(info, options);
    r.world->barrier();
    if (info.rank == 1) {  // alive, never joins the second barrier
      std::this_thread::sleep_for(std::chrono::seconds(6));
      return;
    }
    const auto start = Clock::now();
    try {
      r.world->barrier();
    } catch (const Error& e) {
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      const std::string message = e.what();
      require(message.find("barrier on group 'world'") != std::string::npos &&
                  message.find("did not finish within 2 s") != std::string::npos,
              "unexpected message: {}", message);
      require(seconds >= 1.9 && seconds < 6, "timed out after {} s", seconds);
      return;
    }
    throw std::runtime_error("the barrier returned although rank 1 never joined");
  }, 60);
  expect_all_succeeded(outcomes);
}

}  // namespace
}  // namespace spindle::comm
