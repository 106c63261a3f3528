// The counting backend of `spindle plan` holds the per-call scratch the CUDA kernels take from the
// pool, sized as the kernels size it: here the fused LoRA B backward's F32 partial sums of dB (one
// [n, r] block per strip of rows; lora_scratch.h), which the H200 measurements showed missing from
// the plan by exactly 128 · n · r · 4 bytes at 32k and 64k tokens.
#include <gtest/gtest.h>

#include "backend/cuda/lora_scratch.h"
#include "plan/dry_backend.h"

namespace spindle::plan {
namespace {

int64_t workspace_peak(DryBackend& be) {
  auto it = be.peak_by_phase().find(DryBackend::kWorkspacePhase);
  return it == be.peak_by_phase().end() ? 0 : it->second;
}

// One LoRA B backward of t rows, n out features, rank r on a modelled GPU of `sms` SMs; the
// workspace part of the peak.
int64_t lora_scratch(int64_t t, int64_t n, int64_t r, int sms, bool trainable_b, DType dtype = DType::BF16) {
  DryBackend be(Device{DeviceKind::CUDA, 0}, 512, sms);
  Tensor dy = be.empty(Shape{t, n}, dtype), b = be.empty(Shape{n, r}, dtype);
  Tensor xa = be.empty(Shape{t, r}, dtype), dxa = be.empty(Shape{t, r}, dtype), db = be.empty(Shape{n, r}, dtype);
  be.reset_peak_memory();
  be.lora_b_backward(be.default_stream(), dy, b, xa, 1.0, dxa, trainable_b ? &db : nullptr);
  return workspace_peak(be);
}

TEST(DryBackend, LoraBBackwardHoldsThePartialSumsOfItsStrips) {
  // 132 SMs (H100/H200): 32k and 64k rows both make 128 strips (2 and 4 tiles of 128 rows each).
  EXPECT_EQ(lora_scratch(32768, 8960, 16, 132, true), int64_t{128} * 8960 * 16 * 4);
  EXPECT_EQ(lora_scratch(65536, 8960, 16, 132, true), int64_t{128} * 8960 * 16 * 4);
  // 512k rows: 4 tiles per strip, 1024 strips.
  EXPECT_EQ(lora_scratch(524288, 8960, 16, 132, true), int64_t{1024} * 8960 * 16 * 4);
  // Fewer SMs, fewer strips needed: a GPU of 60 SMs at 32k takes 4 tiles a strip (64 strips ≥ 0.9 · 60).
  EXPECT_EQ(lora_scratch(32768, 8960, 16, 60, true), int64_t{64} * 8960 * 16 * 4);
  // Rank 64 strips at most 2 tiles.
  EXPECT_EQ(lora_scratch(65536, 1024, 64, 132, true), int64_t{256} * 1024 * 64 * 4);
}

TEST(DryBackend, LoraBBackwardWithoutScratchWhereTheKernelTakesNone) {
  EXPECT_EQ(lora_scratch(32768, 8960, 16, 132, false), 0);                // frozen B: no dB
  EXPECT_EQ(lora_scratch(32768, 8960 + 64, 16, 132, true), 0);            // not a multiple of 128: two GEMMs
  EXPECT_EQ(lora_scratch(32768, 8960, 8, 132, true), 0);                  // rank 8: two GEMMs
  EXPECT_EQ(lora_scratch(32768, 8960, 16, 132, true, DType::F32), 0);     // F32: two GEMMs
}

TEST(DryBackend, TheScratchIsFreedWithTheCall) {
  DryBackend be(Device{DeviceKind::CUDA, 0}, 512, 132);
  Tensor dy = be.empty(Shape{4096, 1024}, DType::BF16), b = be.empty(Shape{1024, 16}, DType::BF16);
  Tensor xa = be.empty(Shape{4096, 16}, DType::BF16), dxa = be.empty(Shape{4096, 16}, DType::BF16);
  Tensor db = be.empty(Shape{1024, 16}, DType::BF16);
  const int64_t before = be.live_bytes();
  be.lora_b_backward(be.default_stream(), dy, b, xa, 1.0, dxa, &db);
  EXPECT_EQ(be.live_bytes(), before);
  EXPECT_GT(be.peak_bytes(), before);
}

}  // namespace
}  // namespace spindle::plan
