#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "core/dtype.h"

using namespace spindle;

TEST(DType, NamesRoundTrip) {
  for (DType t : {DType::F32, DType::F64, DType::BF16, DType::F16, DType::I32, DType::I64, DType::U8}) {
    DType back;
    ASSERT_TRUE(dtype_from_name(dtype_name(t), &back));
    EXPECT_EQ(back, t);
  }
  DType unused;
  EXPECT_FALSE(dtype_from_name("F8_E4M3", &unused));
}

TEST(DType, Bf16RoundsToNearestEven) {
  EXPECT_EQ(f32_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  // 1 + 2^-8 is exactly half-way between two bf16 values: ties go to the even mantissa (1.0).
  EXPECT_EQ(f32_to_bf16(1.0f + 1.0f / 256), 0x3f80);
  EXPECT_EQ(f32_to_bf16(1.0f + 3.0f / 256), 0x3f82);
  EXPECT_TRUE(std::isnan(bf16_to_f32(f32_to_bf16(NAN))));
}

TEST(DType, F16RoundTripIsExactOnRepresentableValues) {
  std::mt19937 rng(1);
  for (int i = 0; i < 20000; ++i) {
    uint16_t h = static_cast<uint16_t>(rng());
    if (((h >> 10) & 0x1f) == 0x1f) continue;  // inf / nan
    EXPECT_EQ(f32_to_f16(f16_to_f32(h)), h) << std::hex << h;
  }
  EXPECT_EQ(f32_to_f16(65536.0f), 0x7c00);
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
}
