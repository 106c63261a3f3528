// The CPU backend's side of the cross-stream API (backend.h): it has one queue in all but name, so
// comm_stream() and stream_wait() must cost nothing and keep program order.
#include <gtest/gtest.h>

#include "backend/stream_test_util.h"

namespace spindle::test {
namespace {

TEST(CpuStreams, CrossStreamHandoffKeepsProgramOrder) {
  auto be = make_cpu_backend(1);
  check_cross_stream_handoff(*be, 1000, 5);
}

TEST(CpuStreams, DoubleBufferPingPongSumsEveryRound) {
  auto be = make_cpu_backend(1);
  check_double_buffer_ping_pong(*be, 257, 6, 2);
}

}  // namespace
}  // namespace spindle::test
