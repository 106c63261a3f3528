// Quantising while the model is built: spindle bench's random weights (ModelWeights::random with
// --quantize) and a dense checkpoint loaded with --quantize hold one projection's dense matrix at a
// time, never the dense model, and give the bytes quantising the whole dense model afterwards gives.
// The CPU backend counts live tensor bytes, so its peak is what a GPU's would be.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <string>
#include <unistd.h>

#include "backend/backend.h"
#include "backend/cpu/quant4_ops.h"
#include "io/checkpoint.h"
#include "model/weights.h"
#include "support/tiny_model.h"

namespace spindle {
namespace {

using test::TinyModel;

// Eight qwen2 layers (q/k/v biases) whose projections dwarf the embeddings: the dense model is
// about seven times its 4-bit form.
TinyModel eight_layers() {
  TinyModel m;
  m.model_type = "qwen2";
  m.vocab_size = 32;
  m.hidden_size = 64;
  m.intermediate_size = 256;
  m.num_layers = 8;
  m.num_heads = 4;
  m.num_kv_heads = 2;
  m.head_dim = 16;
  return m;
}

int64_t dense_bytes(const ModelConfig& config, DType dtype) {
  auto be = make_cpu_backend();
  const ModelWeights w = ModelWeights::uninitialized(*be, config, dtype);
  int64_t bytes = 0;
  for (const Parameter& p : w.parameters()) bytes += static_cast<int64_t>(p.value.bytes());
  return bytes;
}

int64_t largest_dense_parameter(const ModelConfig& config, DType dtype) {
  auto be = make_cpu_backend();
  const ModelWeights w = ModelWeights::uninitialized(*be, config, dtype);
  int64_t largest = 0;
  for (const Parameter& p : w.parameters()) largest = std::max(largest, static_cast<int64_t>(p.value.bytes()));
  return largest;
}

int64_t live_bytes(const ModelWeights& w) {
  int64_t bytes = 0;
  for (const Parameter& p : w.parameters()) bytes += static_cast<int64_t>(p.value.bytes());
  return bytes;
}

void expect_same_bytes(const ModelWeights& want, const ModelWeights& got) {
  ASSERT_EQ(want.parameters().size(), got.parameters().size());
  for (const Parameter& p : want.parameters()) {
    SCOPED_TRACE(p.name);
    const Parameter* q = const_cast<ModelWeights&>(got).find(p.name);
    ASSERT_NE(q, nullptr);
    ASSERT_EQ(p.value.dtype(), q->value.dtype());
    ASSERT_EQ(p.value.bytes(), q->value.bytes());
    EXPECT_EQ(std::memcmp(p.value.data(), q->value.data(), static_cast<size_t>(p.value.bytes())), 0);
  }
  const std::vector<const Linear*> a = want.linears(), b = got.linears();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    SCOPED_TRACE(a[i]->prefix);
    EXPECT_EQ(a[i]->format, b[i]->format);
    EXPECT_EQ(b[i]->weight, nullptr);
    EXPECT_EQ(a[i]->quant.blocksize, b[i]->quant.blocksize);
    EXPECT_EQ(a[i]->quant.nested(), b[i]->quant.nested());
    EXPECT_EQ(a[i]->quant.offset, b[i]->quant.offset);  // bit for bit: the same F32 mean
  }
}

struct InitCase {
  const char* name;
  DType dtype;
  const char* quantize;
  bool double_quant;
  int64_t blocksize;
};

class QuantizedInit : public ::testing::TestWithParam<InitCase> {};

// random(..., quantize) is random() followed by quantize_projections, byte for byte, with the
// dense model never allocated: the peak stays under the final 4-bit model plus one dense matrix,
// far below the dense model.
TEST_P(QuantizedInit, RandomWeightsQuantisedAsDrawnAreTheBytesOfQuantisingAfterwards) {
  const InitCase& c = GetParam();
  const ModelConfig config = eight_layers().config();
  const QuantizeOptions options = parse_quantize_options(c.quantize, c.double_quant, c.blocksize);
  auto be = make_cpu_backend();

  be->reset_peak_memory();
  ModelWeights whole_first = ModelWeights::random(*be, config, c.dtype, 5);
  whole_first.quantize_projections(*be, options);
  const int64_t whole_first_peak = be->memory_stats().peak_allocated_bytes;

  be->reset_peak_memory();
  const int64_t before = be->memory_stats().allocated_bytes;
  ModelWeights as_drawn = ModelWeights::random(*be, config, c.dtype, 5, options);
  const int64_t peak = be->memory_stats().peak_allocated_bytes - before;

  expect_same_bytes(whole_first, as_drawn);
  // The host quantiser splits a matrix over threads by whole blocks: the bytes of one call over the
  // whole matrix (what tests/quant checks against bitsandbytes).
  const ModelWeights dense_model = ModelWeights::random(*be, config, c.dtype, 5);
  for (size_t i = 0; i < dense_model.linears().size(); ++i) {
    const Linear& d = *dense_model.linears()[i];
    const Linear& q = *as_drawn.linears()[i];
    SCOPED_TRACE(d.prefix);
    const int64_t n = d.out * d.in;
    Tensor f32 = be->empty(Shape{n}, DType::F32);
    be->copy(be->default_stream(), d.weight->value.flat(0, n), f32);
    std::vector<uint8_t> packed(static_cast<size_t>(n / 2));
    std::vector<float> absmax(static_cast<size_t>(quant4::num_blocks(n, c.blocksize)));
    quant4::quantize(f32.data_as<float>(), n, c.blocksize, *options.type, packed.data(), absmax.data());
    EXPECT_EQ(std::memcmp(packed.data(), q.quant.packed->value.data(), packed.size()), 0);
    if (!c.double_quant) {
      EXPECT_EQ(std::memcmp(absmax.data(), q.quant.absmax->value.data(), absmax.size() * sizeof(float)), 0);
    }
  }
  const int64_t dense = dense_bytes(config, c.dtype);
  EXPECT_GE(whole_first_peak, dense);  // what bench did before: the dense model, then its 4-bit copy
  EXPECT_LT(peak, dense / 3) << "dense " << dense;
  // One dense matrix at a time, drawn and quantised where it was allocated (nothing staged on the
  // host any more), with its F32 absmax while double quantisation reads them and the shared 8-bit
  // code map (F32 [256], held by the projections, not a parameter).
  const int64_t largest = largest_dense_parameter(config, c.dtype);
  const int64_t f32_absmax = c.double_quant ? largest / static_cast<int64_t>(dtype_size(c.dtype)) / c.blocksize * 4 : 0;
  EXPECT_LE(peak, live_bytes(as_drawn) + largest + f32_absmax + (c.double_quant ? 256 * 4 : 0));
}

INSTANTIATE_TEST_SUITE_P(Cases, QuantizedInit,
                         ::testing::Values(InitCase{"nf4_f32", DType::F32, "nf4", false, 64},
                                           InitCase{"nf4_double_quant_f32", DType::F32, "nf4", true, 64},
                                           InitCase{"fp4_blocksize_128_f32", DType::F32, "fp4", false, 128},
                                           InitCase{"nf4_bf16", DType::BF16, "nf4", false, 64},
                                           InitCase{"nf4_double_quant_bf16", DType::BF16, "nf4", true, 64}),
                         [](const auto& info) { return std::string(info.param.name); });

// Unquantised random weights are unchanged by the quantiser's seam: the same values as before
// for every parameter (the seeds follow the order of declaration).
TEST(QuantizedInit, DenseRandomWeightsIgnoreTheQuantiser) {
  const ModelConfig config = eight_layers().config();
  auto be = make_cpu_backend();
  const ModelWeights a = ModelWeights::random(*be, config, DType::F32, 9);
  const ModelWeights b = ModelWeights::random(*be, config, DType::F32, 9, QuantizeOptions{});
  ASSERT_EQ(a.parameters().size(), b.parameters().size());
  for (size_t i = 0; i < a.parameters().size(); ++i) {
    const Parameter& p = a.parameters()[i];
    const Parameter& q = b.parameters()[i];
    ASSERT_EQ(p.name, q.name);
    EXPECT_EQ(std::memcmp(p.value.data(), q.value.data(), static_cast<size_t>(p.value.bytes())), 0) << p.name;
  }
}

// A dense checkpoint loaded with --quantize: one projection is read, quantised and dropped before
// the next, so the peak is the 4-bit model plus one dense matrix, not the dense model.
TEST(QuantizedInit, LoadingADenseCheckpointWithQuantizeHoldsOneDenseMatrixAtATime) {
  const TinyModel model = eight_layers();
  const std::filesystem::path dir =
      std::filesystem::temp_directory_path() / ("spindle_quantized_load_" + std::to_string(::getpid()));
  test::write_model_folder(dir, model, 3);
  const ModelConfig config = ModelConfig::from_file(dir.string());
  auto be = make_cpu_backend();
  for (const bool double_quant : {false, true}) {
    SCOPED_TRACE(double_quant ? "double quantisation" : "absmax in F32");
    io::Checkpoint checkpoint(dir.string());
    be->reset_peak_memory();
    const int64_t before = be->memory_stats().allocated_bytes;
    ModelWeights w = ModelWeights::load(*be, config, checkpoint, DType::F32,
                                        parse_quantize_options("nf4", double_quant, 64));
    const int64_t peak = be->memory_stats().peak_allocated_bytes - before;
    for (const Linear* lin : w.linears()) EXPECT_TRUE(lin->quantized()) << lin->prefix;
    const int64_t dense = dense_bytes(config, DType::F32);
    EXPECT_LT(peak, dense / 3) << "dense " << dense;
    // The file's F32 values are uploaded into the matrix allocated for them, quantised there and freed.
    const int64_t largest = largest_dense_parameter(config, DType::F32);
    EXPECT_LE(peak, live_bytes(w) + largest + (double_quant ? largest / 4 / 64 * 4 + 256 * 4 : 0));
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace spindle
