// The backend ops that build weights on the device (random values, quantising at load) against the
// host path they replace: the CPU backend's fill_random_uniform gives the values the former host
// drawer gave (its formula restated below, independently of core/random_hash.h, and values worked
// out apart from spindle), and quantize_4bit / quantize_absmax give the host quantiser's bytes
// (quant4::quantize, which tests/quant checks against bitsandbytes) from every float dtype.
// tests/cuda/test_cuda_ops.cpp holds the CUDA backend to these same CPU results, bit for bit.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quant4_ops.h"
#include "core/error.h"

namespace spindle {
namespace {

// The former host drawer of ModelWeights::random (one value).
double former_host_value(uint64_t seed, uint64_t ordinal, uint64_t i) {
  auto mix = [](uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
  };
  const uint64_t stream = mix(seed ^ mix(ordinal));
  const double u = static_cast<double>(mix(stream + i) >> 11) * 0x1.0p-53;
  return 0.02 * std::sqrt(3.0) * (2.0 * u - 1.0);
}

const double kHalfWidth = 0.02 * std::sqrt(3.0);

// The former path stored a double into a tensor through copy(): F32 rounded, BF16/F16 through F32.
uint64_t stored_bits(double v, DType dtype) {
  switch (dtype) {
    case DType::F64: {
      uint64_t b;
      std::memcpy(&b, &v, 8);
      return b;
    }
    case DType::F32: {
      const float f = static_cast<float>(v);
      uint32_t b;
      std::memcpy(&b, &f, 4);
      return b;
    }
    case DType::BF16: return f32_to_bf16(static_cast<float>(v));
    case DType::F16: return f32_to_f16(static_cast<float>(v));
    default: return 0;
  }
}

uint64_t element_bits(const Tensor& t, int64_t i) {
  const size_t size = dtype_size(t.dtype());
  uint64_t b = 0;
  std::memcpy(&b, static_cast<const char*>(t.data()) + static_cast<size_t>(i) * size, size);
  return b;
}

TEST(BackendInitOps, RandomFillIsTheFormerHostDrawInEveryDtype) {
  auto be = make_cpu_backend();
  for (DType dtype : {DType::F32, DType::F64, DType::BF16, DType::F16})
    for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{4097}, int64_t{70001}}) {  // 70001: the threaded branch
      SCOPED_TRACE(::testing::Message() << dtype_name(dtype) << " n " << n);
      Tensor t = be->empty(Shape{n}, dtype);
      be->fill_random_uniform(be->default_stream(), t, 1234, 77, kHalfWidth);
      int64_t wrong = 0;
      for (int64_t i = 0; i < n; ++i) wrong += element_bits(t, i) != stored_bits(former_host_value(1234, 77, i), dtype);
      EXPECT_EQ(wrong, 0);
    }
}

// Values computed apart from spindle (Python's integers and doubles) for two streams: a change to
// the hash, the stream key or the arithmetic shows here even if the formula above changed with it.
TEST(BackendInitOps, RandomFillHasTheKnownValues) {
  auto be = make_cpu_backend();
  Tensor t = be->empty(Shape{1000004}, DType::F64);
  struct Known {
    uint64_t seed, sequence;
    int64_t i;
    double value;
  };
  for (const Known& k : {Known{5, 1, 0, -0x1.61bef2f807725p-6}, Known{5, 1, 1, -0x1.877cc1b4a3c08p-7},
                         Known{5, 1, 2, -0x1.10263b3098438p-5}, Known{5, 1, 1000003, 0x1.733a2b02f6887p-8},
                         Known{1234, 77, 0, -0x1.4c96c39b697ddp-7}, Known{1234, 77, 1, 0x1.1b9ffa0bb8336p-6},
                         Known{1234, 77, 2, -0x1.5d8317a51057fp-6}, Known{1234, 77, 1000003, -0x1.8ee4696d39ceap-8}}) {
    be->fill_random_uniform(be->default_stream(), t, k.seed, k.sequence, kHalfWidth);
    EXPECT_EQ(t.data_as<double>()[k.i], k.value) << "seed " << k.seed << " sequence " << k.sequence << " i " << k.i;
  }
  // With half_width 1 the op writes 2u − 1 itself (exact), which times ±0.02·√3 is the draw above.
  be->fill_random_uniform(be->default_stream(), t, 5, 1, 1.0);
  EXPECT_EQ(kHalfWidth * t.data_as<double>()[1000003], 0x1.733a2b02f6887p-8);
  for (int64_t i = 0; i < t.numel(); ++i) ASSERT_LE(std::fabs(t.data_as<double>()[i]), 1.0) << i;
}

TEST(BackendInitOps, RandomFillRefusesIntegerTensors) {
  auto be = make_cpu_backend();
  Tensor t = be->empty(Shape{4}, DType::I32);
  try {
    be->fill_random_uniform(be->default_stream(), t, 1, 1, kHalfWidth);
    FAIL() << "an I32 tensor was filled";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not a float tensor"), std::string::npos) << e.what();
  }
}

// Weights shaped like a projection's: random values of ±0.05 with whole blocks of zeros, a block
// holding one large value, and values that round differently in BF16 and F16.
std::vector<float> test_weights(int64_t n, int64_t blocksize, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 0.02f);
  std::vector<float> w(static_cast<size_t>(n));
  for (float& x : w) x = normal(rng);
  for (int64_t j = 0; j < std::min(n, blocksize); ++j) w[j] = 0.0f;                           // an all-zero block
  if (n > 3 * blocksize) w[2 * blocksize + 5] = 3.0f;                                         // one outlier
  return w;
}

std::vector<uint8_t> bytes_of(const Tensor& t) {
  std::vector<uint8_t> out(t.bytes());
  std::memcpy(out.data(), t.data(), out.size());
  return out;
}

TEST(BackendInitOps, QuantizeIsTheHostQuantiserFromEveryFloatDtype) {
  auto be = make_cpu_backend();
  std::mt19937_64 rng(11);
  for (int64_t blocksize : {64, 128, 4096})
    for (int64_t n : {int64_t{64 * 80}, int64_t{4096 * 3 + 64 * 5 + 7}})
      for (Quant4Type type : {Quant4Type::NF4, Quant4Type::FP4})
        for (DType dtype : {DType::F32, DType::BF16, DType::F16, DType::F64}) {
          SCOPED_TRACE(::testing::Message() << "blocksize " << blocksize << " n " << n << " "
                                            << quant4::type_name(type) << " " << dtype_name(dtype));
          const std::vector<float> raw = test_weights(n, blocksize, rng);
          // The values as a tensor of `dtype` holds them, and those as the quantiser reads them (F32).
          Tensor f32 = be->empty(Shape{n}, DType::F32);
          std::memcpy(f32.data(), raw.data(), raw.size() * sizeof(float));
          Tensor w = be->empty(Shape{n}, dtype);
          be->copy(be->default_stream(), f32, w);
          Tensor read = be->empty(Shape{n}, DType::F32);
          be->copy(be->default_stream(), w, read);
          const int64_t blocks = quant4::num_blocks(n, blocksize);
          std::vector<uint8_t> packed((n + 1) / 2);
          std::vector<float> absmax(blocks);
          quant4::quantize(read.data_as<float>(), n, blocksize, type, packed.data(), absmax.data());

          Tensor packed_op = be->empty(Shape{(n + 1) / 2}, DType::U8), absmax_op = be->empty(Shape{blocks}, DType::F32);
          be->quantize_4bit(be->default_stream(), w, blocksize, type, packed_op, absmax_op);
          EXPECT_EQ(bytes_of(packed_op), packed);
          EXPECT_EQ(std::memcmp(absmax_op.data(), absmax.data(), absmax.size() * sizeof(float)), 0);
          EXPECT_EQ(absmax[0], 0.0f);  // the all-zero block
        }
}

TEST(BackendInitOps, QuantizeAbsmaxIsTheHostDoubleQuantisation) {
  auto be = make_cpu_backend();
  std::mt19937_64 rng(3);
  std::uniform_real_distribution<float> uniform(0.0f, 0.08f);
  for (int64_t k : {int64_t{1}, int64_t{256}, int64_t{256 * 7 + 33}}) {
    SCOPED_TRACE(::testing::Message() << k << " absmax");
    std::vector<float> absmax(static_cast<size_t>(k));
    for (float& a : absmax) a = uniform(rng);
    const float offset = quant4::absmax_mean(absmax.data(), k);
    const int64_t blocks2 = quant4::num_blocks(k, quant4::kNestedBlocksize);
    std::vector<uint8_t> codes(static_cast<size_t>(k));
    std::vector<float> absmax2(static_cast<size_t>(blocks2));
    quant4::quantize_absmax(absmax.data(), k, offset, quant4::kNestedBlocksize, codes.data(), absmax2.data());

    Tensor a = be->empty(Shape{k}, DType::F32), map = be->empty(Shape{256}, DType::F32);
    std::memcpy(a.data(), absmax.data(), absmax.size() * sizeof(float));
    std::memcpy(map.data(), quant4::dynamic_map(), 256 * sizeof(float));
    Tensor codes_op = be->empty(Shape{k}, DType::U8), absmax2_op = be->empty(Shape{blocks2}, DType::F32);
    be->quantize_absmax(be->default_stream(), a, map, offset, quant4::kNestedBlocksize, codes_op, absmax2_op);
    EXPECT_EQ(bytes_of(codes_op), codes);
    EXPECT_EQ(std::memcmp(absmax2_op.data(), absmax2.data(), absmax2.size() * sizeof(float)), 0);
    // And back: within one code step of each absmax.
    Tensor back = be->empty(Shape{k}, DType::F32);
    be->dequantize_absmax(be->default_stream(), codes_op, map, absmax2_op, quant4::kNestedBlocksize, offset, back);
    for (int64_t i = 0; i < k; ++i) EXPECT_NEAR(back.data_as<float>()[i], absmax[i], 0.08f / 64) << i;
  }
}

TEST(BackendInitOps, QuantizeRefusesMismatchedSizes) {
  auto be = make_cpu_backend();
  Tensor w = be->zeros(Shape{128}, DType::F32);
  Tensor packed = be->empty(Shape{64}, DType::U8), absmax = be->empty(Shape{3}, DType::F32);
  try {
    be->quantize_4bit(be->default_stream(), w, 64, Quant4Type::NF4, packed, absmax);
    FAIL() << "3 absmax accepted for 2 blocks";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("need 64 packed bytes and 2 absmax"), std::string::npos) << e.what();
  }
  Tensor ints = be->empty(Shape{128}, DType::I32);
  Tensor two = be->empty(Shape{2}, DType::F32);
  EXPECT_THROW(be->quantize_4bit(be->default_stream(), ints, 64, Quant4Type::NF4, packed, two), Error);
}

}  // namespace
}  // namespace spindle
