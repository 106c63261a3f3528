// bitsandbytes' 4-bit format, against bytes bitsandbytes itself wrote on the GPU host
// (testdata/nf4/quant.safetensors, scripts/gpu/make_nf4_refs.py): quantisation byte for byte,
// dequantisation bit for bit, with and without double quantisation, NF4 and FP4, blocksizes 32 … 4096.
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quant4_ops.h"
#include "io/safetensors_file.h"

namespace spindle {
namespace {

const std::string kRefs = std::string(SPINDLE_SOURCE_DIR) + "/testdata/nf4/quant.safetensors";

template <typename T>
std::vector<T> raw(const io::TensorRecord& rec) {
  std::vector<T> out(rec.bytes / sizeof(T));
  std::memcpy(out.data(), rec.data, rec.bytes);
  return out;
}

std::vector<float> as_f32(const io::TensorRecord& rec) {
  std::vector<float> out(static_cast<size_t>(rec.shape.numel()));
  for (size_t i = 0; i < out.size(); ++i) {
    uint16_t h;
    switch (rec.dtype) {
      case DType::F32: std::memcpy(&out[i], static_cast<const char*>(rec.data) + 4 * i, 4); break;
      case DType::BF16:
        std::memcpy(&h, static_cast<const char*>(rec.data) + 2 * i, 2);
        out[i] = bf16_to_f32(h);
        break;
      case DType::F16:
        std::memcpy(&h, static_cast<const char*>(rec.data) + 2 * i, 2);
        out[i] = f16_to_f32(h);
        break;
      default: ADD_FAILURE() << rec.name << ": not a float tensor"; return out;
    }
  }
  return out;
}

// Indices where two float arrays differ in their bits (±0 and NaN payloads included).
std::vector<size_t> bit_differences(const std::vector<float>& a, const std::vector<float>& b) {
  std::vector<size_t> out;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    if (std::bit_cast<uint32_t>(a[i]) != std::bit_cast<uint32_t>(b[i])) out.push_back(i);
  return out;
}

struct Case {
  std::string name, input, quant_type;
  int64_t blocksize = 0;
  bool double_quant = false;
};

class Quant4Refs : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { file_ = new io::SafetensorsFile(kRefs); }
  static void TearDownTestSuite() { delete file_; }
  static const io::TensorRecord& rec(const std::string& name) {
    const io::TensorRecord* r = file_->find(name);
    if (!r) throw std::runtime_error(kRefs + " has no tensor " + name);
    return *r;
  }
  static std::vector<Case> cases() {
    std::vector<Case> out;
    for (const auto& j : nlohmann::json::parse(file_->metadata().at("cases")))
      out.push_back({j["case"], j["input"], j["quant_type"], j["blocksize"], j["double_quant"]});
    return out;
  }
  static quant4::Type type_of(const Case& c) { return c.quant_type == "nf4" ? quant4::Type::NF4 : quant4::Type::FP4; }
  static io::SafetensorsFile* file_;
};
io::SafetensorsFile* Quant4Refs::file_ = nullptr;

TEST_F(Quant4Refs, CoverTheEdgeCases) {
  const std::vector<Case> all = cases();
  ASSERT_GE(all.size(), 20u);
  int dq = 0, fp4 = 0;
  std::set<int64_t> blocksizes;
  for (const Case& c : all) {
    dq += c.double_quant;
    fp4 += c.quant_type == "fp4";
    blocksizes.insert(c.blocksize);
  }
  EXPECT_GE(dq, 5);
  EXPECT_GE(fp4, 3);
  EXPECT_EQ(blocksizes, (std::set<int64_t>{32, 64, 128, 256, 512, 1024, 2048, 4096}));
}

TEST_F(Quant4Refs, TablesAreBitsandbytes) {
  const std::vector<float> nf4 = as_f32(rec("quant_map.nf4")), fp4 = as_f32(rec("quant_map.fp4"));
  const std::vector<float> dynamic = as_f32(rec("dynamic_map"));
  EXPECT_TRUE(bit_differences(nf4, std::vector<float>(quant4::table(quant4::Type::NF4),
                                                      quant4::table(quant4::Type::NF4) + 16)).empty());
  EXPECT_TRUE(bit_differences(fp4, std::vector<float>(quant4::table(quant4::Type::FP4),
                                                      quant4::table(quant4::Type::FP4) + 16)).empty());
  EXPECT_TRUE(bit_differences(dynamic, std::vector<float>(quant4::dynamic_map(), quant4::dynamic_map() + 256)).empty());
}

// Quantisation without double quantisation: bitsandbytes' packed bytes and absmax, exactly.
TEST_F(Quant4Refs, QuantiseIsByteIdentical) {
  int checked = 0;
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::vector<float> x = as_f32(rec("in." + c.input));
    const int64_t n = static_cast<int64_t>(x.size());
    std::vector<uint8_t> packed((n + 1) / 2);
    std::vector<float> absmax(quant4::num_blocks(n, c.blocksize));
    quant4::quantize(x.data(), n, c.blocksize, type_of(c), packed.data(), absmax.data());
    const std::vector<uint8_t> want = raw<uint8_t>(rec(c.name + ".packed"));
    ASSERT_EQ(packed.size(), want.size());
    size_t wrong = 0;
    for (size_t i = 0; i < want.size(); ++i) {
      if (packed[i] == want[i]) continue;
      if (++wrong <= 5)
        ADD_FAILURE() << "byte " << i << " (elements " << 2 * i << ", " << 2 * i + 1 << ": " << x[2 * i] << ", "
                      << (2 * i + 1 < x.size() ? x[2 * i + 1] : 0.0f) << ") is " << int(packed[i]) << ", bitsandbytes "
                      << int(want[i]);
    }
    EXPECT_EQ(wrong, 0u);
    if (!c.double_quant) {
      EXPECT_TRUE(bit_differences(absmax, raw<float>(rec(c.name + ".absmax"))).empty());
      ++checked;
    }
  }
  EXPECT_GE(checked, 15);
}

// Double quantisation: given bitsandbytes' offset (torch's float mean), the codes and nested absmax
// are byte-identical; with spindle's own mean (the exactly rounded one) the offset may differ in its
// last bits, and so, rarely, may a code.
TEST_F(Quant4Refs, DoubleQuantisationGivenTheOffsetIsByteIdentical) {
  for (const Case& c : cases()) {
    if (!c.double_quant) continue;
    SCOPED_TRACE(c.name);
    const std::vector<float> x = as_f32(rec("in." + c.input));
    const int64_t n = static_cast<int64_t>(x.size()), k = quant4::num_blocks(n, c.blocksize);
    std::vector<uint8_t> packed((n + 1) / 2);
    std::vector<float> absmax(k);
    quant4::quantize(x.data(), n, c.blocksize, type_of(c), packed.data(), absmax.data());
    const float offset = raw<float>(rec(c.name + ".offset"))[0];
    const int64_t k2 = quant4::num_blocks(k, quant4::kNestedBlocksize);
    std::vector<uint8_t> codes(k);
    std::vector<float> absmax2(k2);
    quant4::quantize_absmax(absmax.data(), k, offset, quant4::kNestedBlocksize, codes.data(), absmax2.data());
    EXPECT_EQ(codes, raw<uint8_t>(rec(c.name + ".absmax")));
    EXPECT_TRUE(bit_differences(absmax2, raw<float>(rec(c.name + ".nested_absmax"))).empty());

    const float own = quant4::absmax_mean(absmax.data(), k);
    EXPECT_NEAR(own, offset, std::fabs(offset) * 1e-6);
    std::vector<uint8_t> own_codes(k);
    std::vector<float> own_absmax2(k2);
    quant4::quantize_absmax(absmax.data(), k, own, quant4::kNestedBlocksize, own_codes.data(), own_absmax2.data());
    size_t differ = 0;
    for (int64_t i = 0; i < k; ++i) differ += own_codes[i] != codes[i];
    EXPECT_LE(differ, static_cast<size_t>(k / 100 + 1)) << "own offset " << own << " vs " << offset;
  }
}

// Dequantisation: bitsandbytes' float32 output bit for bit (the nested absmax too); its bfloat16
// output is that product rounded to nearest even.
TEST_F(Quant4Refs, DequantiseIsBitIdentical) {
  for (const Case& c : cases()) {
    SCOPED_TRACE(c.name);
    const std::vector<uint8_t> packed = raw<uint8_t>(rec(c.name + ".packed"));
    const std::vector<float> want = raw<float>(rec(c.name + ".dequant_f32"));
    const int64_t n = static_cast<int64_t>(want.size()), k = quant4::num_blocks(n, c.blocksize);
    std::vector<float> absmax;
    if (c.double_quant) {
      const std::vector<uint8_t> codes = raw<uint8_t>(rec(c.name + ".absmax"));
      const std::vector<float> absmax2 = raw<float>(rec(c.name + ".nested_absmax"));
      absmax.resize(k);
      quant4::dequantize_absmax(codes.data(), k, quant4::dynamic_map(), absmax2.data(), quant4::kNestedBlocksize,
                                raw<float>(rec(c.name + ".offset"))[0], absmax.data());
      EXPECT_TRUE(bit_differences(absmax, raw<float>(rec(c.name + ".absmax_deq"))).empty());
    } else {
      absmax = raw<float>(rec(c.name + ".absmax"));
    }
    std::vector<float> got(n);
    quant4::dequantize(packed.data(), absmax.data(), n, c.blocksize, type_of(c), got.data());
    const std::vector<size_t> differ = bit_differences(got, want);
    EXPECT_TRUE(differ.empty()) << differ.size() << " differ, first at " << differ[0] << ": " << got[differ[0]]
                                << " vs " << want[differ[0]];
    if (const io::TensorRecord* bf16 = file_->find(c.name + ".dequant_bf16")) {
      const std::vector<uint16_t> want16 = raw<uint16_t>(*bf16);
      size_t wrong = 0;
      for (int64_t j = 0; j < n; ++j) wrong += f32_to_bf16(got[j]) != want16[j];
      EXPECT_EQ(wrong, 0u);
    }
  }
}

// The backend op gives the same values in F32 and (widened) in F64.
TEST_F(Quant4Refs, CpuBackendOpMatches) {
  auto be = make_cpu_backend(1);
  for (const Case& c : cases()) {
    if (c.double_quant) continue;
    SCOPED_TRACE(c.name);
    const std::vector<uint8_t> packed = raw<uint8_t>(rec(c.name + ".packed"));
    const std::vector<float> absmax = raw<float>(rec(c.name + ".absmax"));
    const std::vector<float> want = raw<float>(rec(c.name + ".dequant_f32"));
    const int64_t n = static_cast<int64_t>(want.size());
    Tensor p = be->empty(Shape{static_cast<int64_t>(packed.size())}, DType::U8);
    Tensor a = be->empty(Shape{static_cast<int64_t>(absmax.size())}, DType::F32);
    be->copy_from_host(be->default_stream(), packed.data(), p);
    be->copy_from_host(be->default_stream(), absmax.data(), a);
    for (DType dt : {DType::F32, DType::F64}) {
      Tensor w = be->empty(Shape{n}, dt);
      be->dequantize_4bit(be->default_stream(), p, a, c.blocksize, type_of(c), w);
      for (int64_t j = 0; j < n; ++j) {
        const double got = dt == DType::F32 ? w.data_as<float>()[j] : w.data_as<double>()[j];
        ASSERT_EQ(std::signbit(got), std::signbit(want[j])) << j;
        ASSERT_EQ(got, static_cast<double>(want[j])) << j;
      }
    }
  }
}

TEST(Quant4, ReciprocalMatchesTheGpu) {
  // Read on an H200 (scripts/gpu/make_nf4_refs.py prints them with the table).
  const std::vector<std::pair<uint32_t, uint32_t>> measured = {
      {0x00000000, 0x7f800000}, {0x80000000, 0xff800000}, {0x00000001, 0x7f800000}, {0x007fffff, 0x7f800000},
      {0x80400000, 0xff800000}, {0x00800000, 0x7e800000}, {0x7f7fffff, 0x00000000}, {0x7f000000, 0x00000000},
      {0x7e800000, 0x00800000}, {0x7e800001, 0x00000000}, {0x7f800000, 0x00000000}, {0xff800000, 0x80000000},
      {0x3f800000, 0x3f800000}, {0xbf800000, 0xbf800000}, {0x3fffffff, 0x3f000001}};
  for (auto [in, out] : measured)
    EXPECT_EQ(std::bit_cast<uint32_t>(quant4::rcp_approx_ftz(std::bit_cast<float>(in))), out) << std::hex << in;
  EXPECT_TRUE(std::isnan(quant4::rcp_approx_ftz(std::nanf(""))));
  // Faithful everywhere: one of the two floats around the exact reciprocal.
  for (uint32_t m = 1; m < (1u << 23); m += 977) {
    const float x = std::bit_cast<float>(0x3F800000u | m), r = quant4::rcp_approx_ftz(x);
    const double exact = 1.0 / static_cast<double>(x);
    EXPECT_LE(static_cast<double>(std::nextafter(r, 0.0f)), exact);
    EXPECT_GE(static_cast<double>(std::nextafter(r, 2.0f)), exact);
  }
}

}  // namespace
}  // namespace spindle
