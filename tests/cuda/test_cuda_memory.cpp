// Memory statistics of the CUDA backend follow its pool: allocations raise the current and peak
// figures by at least their size, releases lower the current one, reset_peak_memory restarts the
// peak, and the device-wide figure covers the pool.
#include <gtest/gtest.h>

#include "backend/cuda/cuda_backend.h"

namespace spindle {
namespace {

TEST(CudaMemory, StatsFollowAllocationsAndReleases) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto backend = make_cuda_backend(0);
  const int64_t size = int64_t{256} << 20;
  backend->synchronize(backend->default_stream());
  backend->reset_peak_memory();
  const MemoryStats before = backend->memory_stats();
  EXPECT_EQ(before.peak_allocated_bytes, before.allocated_bytes);
  {
    Tensor t = backend->empty(Shape{size / 2}, DType::BF16);
    backend->fill(backend->default_stream(), t, 1.0);
    backend->synchronize(backend->default_stream());
    const MemoryStats during = backend->memory_stats();
    EXPECT_GE(during.allocated_bytes - before.allocated_bytes, size);
    EXPECT_GE(during.peak_allocated_bytes, during.allocated_bytes);
    EXPECT_GE(during.reserved_bytes, during.allocated_bytes);
    EXPECT_GE(during.device_used_bytes, during.reserved_bytes);
    EXPECT_GT(during.device_total_bytes, during.device_used_bytes);
  }
  backend->synchronize(backend->default_stream());  // the release is stream-ordered
  const MemoryStats after = backend->memory_stats();
  EXPECT_LE(after.allocated_bytes, before.allocated_bytes);
  EXPECT_GE(after.peak_allocated_bytes - before.allocated_bytes, size);
  backend->reset_peak_memory();
  EXPECT_EQ(backend->memory_stats().peak_allocated_bytes, after.allocated_bytes);
}

}  // namespace
}  // namespace spindle
