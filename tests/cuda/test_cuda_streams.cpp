// Cross-stream ordering on the GPU (backend.h: comm_stream, stream_wait), which ring attention and
// FSDP rely on to overlap communication with compute. Each check runs long work on one stream
// (hundreds of kernels over 64 MiB, milliseconds) and then work on the other stream that depends
// on it: without the wait, or with the wait on the wrong side, the second stream reads a value
// midway and the result is wrong. Skips without a CUDA device.
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.h"
#include "backend/stream_test_util.h"

namespace spindle::test {
namespace {

class CudaStreams : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA stream tests need a GPU";
    gpu = make_cuda_backend(0);
  }
  std::unique_ptr<Backend> gpu;
};

TEST_F(CudaStreams, CommStreamIsASecondQueue) {
  const Stream comm = gpu->comm_stream();
  EXPECT_NE(comm.handle, nullptr);
  EXPECT_NE(comm.handle, gpu->default_stream().handle);
  EXPECT_EQ(gpu->comm_stream().handle, comm.handle);
}

TEST_F(CudaStreams, LongWorkThenWaitThenCopyOnTheOtherStream) {
  // 16M F32 (64 MiB); 300 axpy passes per stream ≈ 15 ms on an H200, far longer than the host
  // takes to enqueue the dependent work.
  check_cross_stream_handoff(*gpu, int64_t{16} << 20, 300);
}

TEST_F(CudaStreams, DoubleBufferPingPongAsRingAttentionUsesIt) {
  check_double_buffer_ping_pong(*gpu, int64_t{8} << 20, 8, 40);
}

TEST_F(CudaStreams, RepeatedWaitsReuseOneEventSafely) {
  // The backend records one event for every stream_wait: a later record must not change what an
  // earlier wait waits for. Long work on compute, wait(comm <- compute), then immediately
  // wait(compute <- comm) (re-records the event on comm), then the dependent copy on comm.
  const Stream compute = gpu->default_stream(), comm = gpu->comm_stream();
  const int64_t n = int64_t{16} << 20;
  Tensor ones = gpu->empty(Shape{n}, DType::F32), x = gpu->empty(Shape{n}, DType::F32);
  Tensor y = gpu->empty(Shape{n}, DType::F32);
  gpu->fill(compute, ones, 1.0);
  gpu->fill(compute, x, 0.0);
  for (int r = 0; r < 300; ++r) gpu->axpy(compute, 1.0, ones, x);
  gpu->stream_wait(comm, compute);
  gpu->stream_wait(compute, comm);
  gpu->copy(comm, x, y);
  gpu->stream_wait(compute, comm);
  EXPECT_EQ(count_mismatches(to_host(*gpu, y), 300.0, "y"), 0);
}

TEST_F(CudaStreams, OffloadCopiesAreExactTimedAndTheirWaitsMeasured) {
  // Activation offload's path (model/decoder.h): a device tensor to pinned host memory on the copy
  // stream and back. Backend::offload_stats counts each copy with its duration and each
  // wait_for_copies with how long the waiting stream stalled.
  const Stream compute = gpu->default_stream(), copy = gpu->copy_stream();
  const int64_t n = int64_t{64} << 20;  // 64M F32: 256 MiB, milliseconds over the host link
  Tensor ones = gpu->empty(Shape{n}, DType::F32), x = gpu->empty(Shape{n}, DType::F32);
  gpu->fill(compute, ones, 1.0);
  gpu->fill(compute, x, 0.0);
  for (int r = 0; r < 7; ++r) gpu->axpy(compute, 1.0, ones, x);  // x = 7
  Tensor host = gpu->empty_host(Shape{n}, DType::F32);
  gpu->synchronize(compute);
  gpu->reset_offload_stats();

  // Out, with compute waiting at once: it stalls for about the whole copy.
  gpu->stream_wait(copy, compute);
  gpu->copy_host_device(copy, x, host);
  gpu->wait_for_copies(compute);
  gpu->synchronize(compute);
  const OffloadStats out = gpu->offload_stats();
  EXPECT_EQ(out.copies, 1);
  EXPECT_EQ(out.bytes, n * 4);
  const double gb_per_s = static_cast<double>(out.bytes) / out.copy_seconds / 1e9;
  EXPECT_GT(gb_per_s, 1.0) << out.copy_seconds << " s for 256 MiB";
  EXPECT_LT(gb_per_s, 1000.0) << out.copy_seconds << " s for 256 MiB: faster than any host link";
  EXPECT_GT(out.wait_seconds, 0.5 * out.copy_seconds) << "compute waited " << out.wait_seconds << " s for a copy of "
                                                      << out.copy_seconds << " s enqueued just before";
  EXPECT_LE(out.wait_seconds, out.copy_seconds * 1.5 + 1e-3);

  // Back, under long compute that does not need it: the wait after that compute costs nothing.
  Tensor back = gpu->empty(Shape{n}, DType::F32);
  gpu->stream_wait(copy, compute);  // `back` was allocated in the compute stream's order
  gpu->copy_host_device(copy, host, back);
  for (int r = 0; r < 600; ++r) gpu->axpy(compute, 1.0, ones, x);  // tens of milliseconds
  gpu->wait_for_copies(compute);
  gpu->synchronize(compute);
  const OffloadStats both = gpu->offload_stats();
  EXPECT_EQ(both.copies, 2);
  EXPECT_EQ(both.bytes, 2 * n * 4);
  EXPECT_LT(both.wait_seconds - out.wait_seconds, 0.2 * (both.copy_seconds - out.copy_seconds))
      << "compute waited for a copy that finished under its own work";
  EXPECT_EQ(count_mismatches(to_host(*gpu, back), 7.0, "back"), 0) << "offload's copies must be exact";

  gpu->reset_offload_stats();
  const OffloadStats reset = gpu->offload_stats();
  EXPECT_EQ(reset.copies, 0);
  EXPECT_EQ(reset.wait_seconds, 0.0);
}

}  // namespace
}  // namespace spindle::test
