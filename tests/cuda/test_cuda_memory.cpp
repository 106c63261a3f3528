// Memory statistics of the CUDA backend follow its pool: allocations raise the current and peak
// figures by at least their size, releases lower the current one, reset_peak_memory restarts the
// peak, and the device-wide figure covers the pool. A request that only fits once the pool gives its
// freed blocks back to the driver succeeds.
#include <gtest/gtest.h>

#include <vector>

#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

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

// Fill the device with 1 GiB blocks, free every other one (the pool keeps them mapped), then ask for
// 2 GiB: no free block is that large and the device has nothing left to map, so it fits only when the
// pool hands its free blocks back to the driver first.
TEST(CudaMemory, LargeRequestFitsIntoFreedPiecesOfAFullDevice) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device";
  auto backend = make_cuda_backend(0);
  const int64_t block = int64_t{1} << 30;
  std::vector<Tensor> blocks;
  try {
    for (;;) blocks.push_back(backend->empty(Shape{block}, DType::U8));
  } catch (const Error&) {
  }
  ASSERT_GE(blocks.size(), 4u) << "a device with less than 4 GiB";
  for (size_t i = 0; i < blocks.size(); i += 2) blocks[i] = Tensor();
  backend->synchronize(backend->default_stream());
  Tensor large;
  EXPECT_NO_THROW(large = backend->empty(Shape{2 * block}, DType::U8));
  EXPECT_TRUE(large.defined());
}

}  // namespace
}  // namespace spindle
