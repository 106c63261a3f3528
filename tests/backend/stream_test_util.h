// The cross-stream contract of backend.h (comm_stream, stream_wait), checked the same way on every
// backend: long work on one stream, a wait, work on the other stream that reads what the first one
// wrote, and a tensor released only after the waits (so the stream-ordered allocator must not hand
// its memory to the next allocation while the other stream still reads it). On the CPU every op
// runs inside its call, so this checks the calls exist and keep program order; on a GPU a missing
// or misplaced wait makes a stream read a value midway through the other's work.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "backend/backend.h"
#include "backend/op_test_util.h"

namespace spindle::test {

// Counts the elements of `got` that differ from `want` (reporting the first few).
inline int64_t count_mismatches(const std::vector<double>& got, double want, const char* what) {
  int64_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want && bad++ < 3) ADD_FAILURE() << what << "[" << i << "] = " << got[i] << ", want " << want;
  return bad;
}

// n F32 elements, `repeats` axpy passes on each stream (long enough on a GPU that the other stream
// would overtake it without the waits).
inline void check_cross_stream_handoff(Backend& be, int64_t n, int repeats) {
  const Stream compute = be.default_stream(), comm = be.comm_stream();
  EXPECT_EQ(be.comm_stream().handle, comm.handle) << "comm_stream() must always return the same queue";
  be.stream_wait(compute, compute);  // a stream waiting for itself: allowed, nothing to do

  // Everything the comm stream touches is allocated (and written) on the compute stream first.
  Tensor ones = be.empty(Shape{n}, DType::F32), x = be.empty(Shape{n}, DType::F32);
  Tensor y = be.empty(Shape{n}, DType::F32);
  be.fill(compute, ones, 1.0);
  be.fill(compute, x, 0.0);
  for (int r = 0; r < repeats; ++r) be.axpy(compute, 1.0, ones, x);  // x = repeats, slowly
  be.stream_wait(comm, compute);
  be.copy(comm, x, y);  // must see the finished x
  for (int r = 0; r < repeats; ++r) be.axpy(comm, 1.0, ones, y);  // y = 2·repeats, slowly, reading `ones`
  be.stream_wait(compute, comm);
  // `ones` goes back to the allocator now, ordered after the comm stream's reads of it by the wait
  // above; a new tensor of the same size (likely the same memory) is overwritten at once.
  ones = Tensor();
  Tensor reuse = be.empty(Shape{n}, DType::F32);
  be.fill(compute, reuse, -1.0e6);
  EXPECT_EQ(count_mismatches(to_host(be, y), 2.0 * repeats, "y (written on the comm stream)"), 0);
  EXPECT_EQ(count_mismatches(to_host(be, x), 1.0 * repeats, "x"), 0);
  be.synchronize(comm);
  be.synchronize(compute);
}

// The ring's pattern: two buffers take turns, the comm stream refilling one while the compute
// stream reads the other. Each round the comm stream writes value `round` into the buffer the
// compute stream read in the previous round; the compute stream adds the buffer it holds into
// `sum`. With correct waits sum = Σ rounds exactly.
inline void check_double_buffer_ping_pong(Backend& be, int64_t n, int rounds, int work) {
  const Stream compute = be.default_stream(), comm = be.comm_stream();
  Tensor buffer[2] = {be.empty(Shape{n}, DType::F32), be.empty(Shape{n}, DType::F32)};
  Tensor sum = be.empty(Shape{n}, DType::F32), busy = be.empty(Shape{n}, DType::F32);
  be.fill(compute, buffer[0], 0.0);
  be.fill(compute, sum, 0.0);
  be.fill(compute, busy, 0.0);
  be.stream_wait(comm, compute);
  for (int round = 0; round < rounds; ++round) {
    Tensor& held = buffer[round % 2];
    Tensor& next = buffer[(round + 1) % 2];
    if (round + 1 < rounds) {
      // comm: slow writes into `next` (the last is the value), overlapping the compute below.
      for (int w = 0; w < work; ++w) be.fill(comm, next, -1.0);
      be.fill(comm, next, round + 1.0);
    }
    for (int w = 0; w < work; ++w) be.axpy(compute, 0.0, held, busy);  // slow reads of `held`
    be.axpy(compute, 1.0, held, sum);
    if (round + 2 < rounds) be.stream_wait(comm, compute);  // `held` is refilled next round
    if (round + 1 < rounds) be.stream_wait(compute, comm);  // `next` is read next round
  }
  be.stream_wait(compute, comm);
  double want = 0;
  for (int round = 0; round < rounds; ++round) want += round;
  EXPECT_EQ(count_mismatches(to_host(be, sum), want, "sum"), 0);
}

}  // namespace spindle::test
