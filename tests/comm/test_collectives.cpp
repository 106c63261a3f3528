// Every collective on 2, 3 and 4 real processes, every dtype, random data, checked bit for bit
// against a direct rank-order computation that each rank can do since it can regenerate every
// rank's input from its seed.
#include <gtest/gtest.h>

#include <cstring>
#include <random>

#include "backend/backend.h"
#include "comm/cpu_communicator.h"
#include "comm/multiprocess.h"
#include "core/error.h"

namespace spindle::comm {
namespace {

using spindle::testing::expect_all_succeeded;
using spindle::testing::require;
using spindle::testing::run_ranks;

CommOptions test_options() { return CommOptions{std::chrono::seconds(30)}; }

// Random host bytes for `count` elements of dtype, reproducible from (seed, rank).
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

template <typename T>
T load(const std::vector<char>& bytes, int64_t i) {
  T v;
  std::memcpy(&v, bytes.data() + i * sizeof(T), sizeof(T));
  return v;
}

// Element i of Σ_ranks inputs[rank], in rank order, written as bytes of dtype.
void expected_sum_element(DType dtype, const std::vector<std::vector<char>>& inputs, int64_t i, void* out) {
  auto fold = [&]<typename T, typename Acc>(T*, Acc* ) {
    Acc acc = static_cast<Acc>(load<T>(inputs[0], i));
    for (size_t r = 1; r < inputs.size(); ++r) acc += static_cast<Acc>(load<T>(inputs[r], i));
    return acc;
  };
  switch (dtype) {
    case DType::F32: { float v = fold((float*)nullptr, (float*)nullptr); std::memcpy(out, &v, 4); break; }
    case DType::F64: { double v = fold((double*)nullptr, (double*)nullptr); std::memcpy(out, &v, 8); break; }
    case DType::I32: { int32_t v = fold((int32_t*)nullptr, (int32_t*)nullptr); std::memcpy(out, &v, 4); break; }
    case DType::I64: { int64_t v = fold((int64_t*)nullptr, (int64_t*)nullptr); std::memcpy(out, &v, 8); break; }
    case DType::BF16:
    case DType::F16: {
      float acc = 0;
      for (size_t r = 0; r < inputs.size(); ++r) {
        uint16_t bits = load<uint16_t>(inputs[r], i);
        float x = dtype == DType::BF16 ? bf16_to_f32(bits) : f16_to_f32(bits);
        acc = r == 0 ? x : acc + x;
      }
      uint16_t v = dtype == DType::BF16 ? f32_to_bf16(acc) : f32_to_f16(acc);
      std::memcpy(out, &v, 2);
      break;
    }
    default: throw std::runtime_error("unsupported dtype in test");
  }
}

struct Host {
  std::unique_ptr<Backend> backend = make_cpu_backend(1);
  Tensor tensor(Shape shape, DType dtype, const std::vector<char>& bytes) {
    Tensor t = backend->empty(shape, dtype);
    require(bytes.size() == t.bytes(), "test bug: {} bytes for {}", bytes.size(), t.describe());
    backend->copy_from_host(backend->default_stream(), bytes.data(), t);
    return t;
  }
  std::vector<char> bytes(const Tensor& t) {
    std::vector<char> out(t.bytes());
    backend->copy_to_host(backend->default_stream(), t, out.data());
    return out;
  }
};

void require_equal_bytes(const std::vector<char>& got, const std::vector<char>& want, const std::string& what) {
  require(got.size() == want.size(), "{}: {} bytes, expected {}", what, got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i)
    require(got[i] == want[i], "{}: byte {} differs ({} vs {})", what, i, int(got[i]), int(want[i]));
}

const DType kDtypes[] = {DType::F32, DType::F64, DType::I32, DType::I64, DType::BF16, DType::F16};

uint64_t seed_for(int call, DType dtype, int rank) {
  return 1000003ull * call + 7919ull * static_cast<uint64_t>(dtype) + static_cast<uint64_t>(rank) + 1;
}

class Collectives : public ::testing::TestWithParam<int> {};

TEST_P(Collectives, AllReduceSum) {
  const int n = GetParam();
  expect_all_succeeded(run_ranks(n, [n](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, test_options());
    require(world->rank() == info.rank && world->size() == n, "rank {} size {}", world->rank(), world->size());
    Host host;
    // 35 elements: not a multiple of 2 or 4, so the padded path runs; 100000: a larger message.
    for (int64_t rows : {int64_t{7}, int64_t{20000}}) {
      for (DType dtype : kDtypes) {
        Shape shape{rows, 5};
        std::vector<std::vector<char>> inputs;
        for (int r = 0; r < n; ++r) inputs.push_back(random_bytes(dtype, shape.numel(), seed_for(1, dtype, r) + rows));
        Tensor data = host.tensor(shape, dtype, inputs[info.rank]);
        world->all_reduce_sum(Stream{}, data);
        std::vector<char> want(data.bytes());
        for (int64_t i = 0; i < shape.numel(); ++i)
          expected_sum_element(dtype, inputs, i, want.data() + i * dtype_size(dtype));
        require_equal_bytes(host.bytes(data), want, fmt::format("all_reduce_sum {} {}", dtype_name(dtype), shape.str()));
      }
    }
  }));
}

TEST_P(Collectives, AllGather) {
  const int n = GetParam();
  expect_all_succeeded(run_ranks(n, [n](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, test_options());
    Host host;
    for (DType dtype : kDtypes) {
      Shape in_shape{3, 4};
      std::vector<char> want;
      for (int r = 0; r < n; ++r) {
        auto bytes = random_bytes(dtype, in_shape.numel(), seed_for(2, dtype, r));
        want.insert(want.end(), bytes.begin(), bytes.end());
      }
      Tensor in = host.tensor(in_shape, dtype, random_bytes(dtype, in_shape.numel(), seed_for(2, dtype, info.rank)));
      Tensor out = host.backend->empty(Shape{3 * n, 4}, dtype);
      world->all_gather(Stream{}, in, out);
      require_equal_bytes(host.bytes(out), want, fmt::format("all_gather {}", dtype_name(dtype)));
    }
  }));
}

TEST_P(Collectives, ReduceScatterSum) {
  const int n = GetParam();
  expect_all_succeeded(run_ranks(n, [n](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, test_options());
    Host host;
    for (DType dtype : kDtypes) {
      Shape in_shape{2 * n, 5}, out_shape{2, 5};
      std::vector<std::vector<char>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(random_bytes(dtype, in_shape.numel(), seed_for(3, dtype, r)));
      Tensor in = host.tensor(in_shape, dtype, inputs[info.rank]);
      Tensor out = host.backend->empty(out_shape, dtype);
      world->reduce_scatter_sum(Stream{}, in, out);
      std::vector<char> want(out.bytes());
      const int64_t chunk = out_shape.numel();
      for (int64_t i = 0; i < chunk; ++i)
        expected_sum_element(dtype, inputs, info.rank * chunk + i, want.data() + i * dtype_size(dtype));
      require_equal_bytes(host.bytes(out), want, fmt::format("reduce_scatter_sum {}", dtype_name(dtype)));
    }
  }));
}

TEST_P(Collectives, AllToAll) {
  const int n = GetParam();
  expect_all_succeeded(run_ranks(n, [n](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, test_options());
    Host host;
    for (DType dtype : kDtypes) {
      Shape shape{2 * n, 3};
      const size_t chunk_bytes = 2 * 3 * dtype_size(dtype);
      std::vector<std::vector<char>> inputs;
      for (int r = 0; r < n; ++r) inputs.push_back(random_bytes(dtype, shape.numel(), seed_for(4, dtype, r)));
      Tensor in = host.tensor(shape, dtype, inputs[info.rank]);
      Tensor out = host.backend->empty(shape, dtype);
      world->all_to_all(Stream{}, in, out);
      std::vector<char> want;  // chunk i of out = chunk <my rank> of rank i's input
      for (int r = 0; r < n; ++r)
        want.insert(want.end(), inputs[r].begin() + info.rank * chunk_bytes,
                    inputs[r].begin() + (info.rank + 1) * chunk_bytes);
      require_equal_bytes(host.bytes(out), want, fmt::format("all_to_all {}", dtype_name(dtype)));
      // In place (the same tensor as input and output) gives the same result.
      world->all_to_all(Stream{}, in, in);
      require_equal_bytes(host.bytes(in), want, fmt::format("all_to_all in place {}", dtype_name(dtype)));
    }
  }));
}

TEST_P(Collectives, BroadcastFromEveryRoot) {
  const int n = GetParam();
  expect_all_succeeded(run_ranks(n, [n](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, test_options());
    Host host;
    for (DType dtype : kDtypes) {
      for (int root = 0; root < n; ++root) {
        Shape shape{9, 7};
        Tensor data = host.tensor(shape, dtype, random_bytes(dtype, shape.numel(), seed_for(7, dtype, info.rank)));
        world->broadcast(Stream{}, data, root);
        require_equal_bytes(host.bytes(data), random_bytes(dtype, shape.numel(), seed_for(7, dtype, root)),
                            fmt::format("broadcast {} from {}", dtype_name(dtype), root));
      }
    }
  }));
}

TEST_P(Collectives, SendRecvRingPassesEveryBlockAround) {
  const int n = GetParam();
  expect_all_succeeded(run_ranks(n, [n](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, test_options());
    Host host;
    const int r = info.rank, next = (r + 1) % n, previous = (r + n - 1) % n;
    Shape shape{64, 8};
    auto block_of = [&](int owner) { return random_bytes(DType::F32, shape.numel(), seed_for(5, DType::F32, owner)); };
    Tensor current = host.tensor(shape, DType::F32, block_of(r));
    Tensor incoming = host.backend->empty(shape, DType::F32);
    // After step k a rank holds the block of rank r−k, as ring attention's K/V rotation needs.
    for (int step = 1; step < n; ++step) {
      world->send_recv(Stream{}, current, next, incoming, previous);
      std::swap(current, incoming);
      require_equal_bytes(host.bytes(current), block_of((r - step + n) % n), fmt::format("ring step {}", step));
    }
  }));
}

TEST_P(Collectives, SendAndRecvBetweenPairs) {
  const int n = GetParam();
  expect_all_succeeded(run_ranks(n, [n](const ProcessGroupInfo& info) {
    auto world = connect_cpu_world(info, test_options());
    Host host;
    Shape shape{5, 3};
    auto message = [&](int from, int to) {
      return random_bytes(DType::I64, shape.numel(), seed_for(6, DType::I64, from * 100 + to));
    };
    // Rank 0 sends a distinct message to each rank, which answers with its own.
    if (info.rank == 0) {
      for (int peer = 1; peer < n; ++peer) {
        world->send(Stream{}, host.tensor(shape, DType::I64, message(0, peer)), peer);
        Tensor reply = host.backend->empty(shape, DType::I64);
        world->recv(Stream{}, reply, peer);
        require_equal_bytes(host.bytes(reply), message(peer, 0), fmt::format("reply from {}", peer));
      }
    } else {
      Tensor got = host.backend->empty(shape, DType::I64);
      world->recv(Stream{}, got, 0);
      require_equal_bytes(host.bytes(got), message(0, info.rank), "message from 0");
      world->send(Stream{}, host.tensor(shape, DType::I64, message(info.rank, 0)), 0);
    }
    world->barrier();
  }));
}

INSTANTIATE_TEST_SUITE_P(Processes, Collectives, ::testing::Values(2, 3, 4),
                         [](const auto& info) { return std::to_string(info.param) + "ranks"; });

TEST(SingleProcess, CollectivesAreCopiesAndShapeErrorsNameTheCall) {
  auto world = connect_cpu_world(ProcessGroupInfo{}, test_options());
  Host host;
  EXPECT_EQ(world->size(), 1);
  EXPECT_EQ(world->name(), "world");
  auto bytes = random_bytes(DType::F32, 6, 42);
  Tensor a = host.tensor(Shape{2, 3}, DType::F32, bytes);
  world->all_reduce_sum(Stream{}, a);
  EXPECT_EQ(host.bytes(a), bytes);
  Tensor out = host.backend->empty(Shape{2, 3}, DType::F32);
  world->all_gather(Stream{}, a, out);
  EXPECT_EQ(host.bytes(out), bytes);
  world->send_recv(Stream{}, a, 0, out, 0);
  EXPECT_EQ(host.bytes(out), bytes);

  auto message_of = [](auto&& call) -> std::string {
    try {
      call();
    } catch (const Error& e) {
      return e.what();
    }
    return "no error";
  };
  Tensor wrong_rows = host.backend->empty(Shape{3, 3}, DType::F32);
  EXPECT_EQ(message_of([&] { world->all_gather(Stream{}, a, wrong_rows); }),
            "all_gather on group 'world' of 1 ranks: out must be [size·n, ...] for in [n, ...]; got F32[2, 3] on cpu "
            "and F32[3, 3] on cpu");
  Tensor wrong_type = host.backend->empty(Shape{2, 3}, DType::F64);
  EXPECT_EQ(message_of([&] { world->reduce_scatter_sum(Stream{}, a, wrong_type); }),
            "reduce_scatter_sum on group 'world': input F32[2, 3] on cpu and output F64[2, 3] on cpu must have the "
            "same dtype");
  EXPECT_EQ(message_of([&] { world->all_to_all(Stream{}, a, wrong_rows); }),
            "all_to_all on group 'world' of 1 ranks: in and out must have one shape whose first dimension is a multiple "
            "of 1; got F32[2, 3] on cpu and F32[3, 3] on cpu");
  EXPECT_EQ(message_of([&] { world->send(Stream{}, a, 1); }),
            "send on group 'world': peer 1 is not a rank of this group (0..0)");
  auto world2 = world->split(0, 0, "solo");
  EXPECT_EQ(world2->name(), "world/solo");
  EXPECT_EQ(world->split(-1, 0, "none"), nullptr);
}

}  // namespace
}  // namespace spindle::comm
