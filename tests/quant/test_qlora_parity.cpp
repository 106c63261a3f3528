// QLoRA against transformers + bitsandbytes + peft (testdata/hf/*nf4*, *fp4*, made on the GPU host by
// scripts/gpu/make_qlora_refs.py; fp32 compute, LoRA with nonzero B): the loss and every LoRA
// gradient, for a dense folder quantised at load (--quantize nf4 [--double-quant]) and for folders
// bitsandbytes saved quantised (nf4 / fp4, with and without double quantisation, uint8, bfloat16 and
// float32 storage), which load as stored without a flag.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <unistd.h>
#include <string>

#include "backend/backend.h"
#include "backend/op_test_util.h"
#include "data/packing.h"
#include "data/pretokenized.h"
#include "io/checkpoint.h"
#include "io/load_tensor.h"
#include "model/decoder.h"
#include "train/export.h"

namespace spindle {
namespace {

using test::relative_error;
using test::to_host;

std::string case_dir(const std::string& name) { return std::string(SPINDLE_SOURCE_DIR) + "/testdata/hf/" + name; }

struct QloraCase {
  std::string name;
  std::string quantize;  // the flag; empty for a pre-quantised folder
  bool double_quant = false;
};

double reference_loss(Backend& be, const io::Checkpoint& expected) {
  return to_host(be, io::load_tensor(be, expected.require("loss", Shape{1}), DType::F64))[0];
}

// One step over the case's documents packed into rows of 32 tokens, two micro-batches.
double run_step(Backend& be, ModelWeights& weights, const std::string& dir) {
  std::vector<Document> docs = read_pretokenized_jsonl(dir + "/data.jsonl");
  PackOptions pack;
  pack.max_length = 32;
  pack.drop_documents_without_targets = false;
  std::vector<PackedRow> rows = pack_documents(docs, pack);
  int64_t num_items = 0;
  for (const PackedRow& r : rows) num_items += r.num_items();
  Decoder decoder(be, weights);
  Tensor loss = be.zeros(Shape{1}, stat_dtype(weights.dtype));
  const size_t half = rows.size() / 2;
  std::vector<PackedRow> first(rows.begin(), rows.begin() + half), second(rows.begin() + half, rows.end());
  for (auto* part : {&first, &second}) {
    MicroBatch batch = make_micro_batch(be, *part, weights.dtype);
    decoder.step(batch, 1.0 / static_cast<double>(num_items), loss, true);
  }
  return to_host(be, loss)[0];
}

ModelWeights load(Backend& be, const QloraCase& c, DType dtype) {
  const std::string dir = case_dir(c.name);
  ModelWeights w = ModelWeights::load(be, ModelConfig::from_file(dir), io::Checkpoint(dir), dtype,
                                      parse_quantize_options(c.quantize, c.double_quant, 64));
  w.load_peft_adapter(be, dir + "/adapter");
  return w;
}

class QloraParity : public ::testing::TestWithParam<QloraCase> {};

TEST_P(QloraParity, LossAndLoraGradientsMatchBitsandbytes) {
  const QloraCase& c = GetParam();
  const std::string dir = case_dir(c.name);
  auto be = make_cpu_backend();
  for (DType dtype : {DType::F32, DType::F64}) {
    SCOPED_TRACE(dtype_name(dtype));
    ModelWeights weights = load(*be, c, dtype);
    int quantized = 0;
    for (const Linear* lin : weights.linears()) quantized += lin->quantized();
    EXPECT_EQ(quantized, static_cast<int>(weights.linears().size()));  // every projection is 4-bit
    io::Checkpoint expected(dir + "/expected.safetensors");
    const double want = reference_loss(*be, expected);
    EXPECT_NEAR(run_step(*be, weights, dir), want, 1e-5 * std::fabs(want));
    int checked = 0;
    for (Parameter& p : weights.parameters()) {
      if (!p.trainable) continue;
      Tensor ref = io::load_tensor(*be, expected.require("grad." + p.name, p.grad.shape()), DType::F64);
      const std::vector<double> got = to_host(*be, p.grad), reference = to_host(*be, ref);
      EXPECT_LE(relative_error(got, reference), 1e-4) << p.name;
      double norm = 0, ref_norm = 0;
      for (size_t i = 0; i < got.size(); ++i) norm += got[i] * got[i], ref_norm += reference[i] * reference[i];
      EXPECT_NEAR(std::sqrt(norm), std::sqrt(ref_norm), 1e-4 * std::sqrt(ref_norm)) << p.name;
      ++checked;
    }
    EXPECT_GT(checked, 4);
  }
}

INSTANTIATE_TEST_SUITE_P(Cases, QloraParity,
                         ::testing::Values(QloraCase{"qwen2_nf4", "nf4", false}, QloraCase{"qwen2_nf4_dq", "nf4", true},
                                           QloraCase{"qwen2_nf4_dq_saved", "", false},
                                           QloraCase{"llama_nf4_bf16_saved", "", false},
                                           QloraCase{"llama_fp4_f32_saved", "", false}),
                         [](const auto& info) { return info.param.name; });

// A pre-quantised folder loads exactly as stored: the packed bytes and absmax are the file's.
TEST(Qlora, PrequantisedBytesAreTheFilesBytes) {
  for (const char* name : {"qwen2_nf4_dq_saved", "llama_nf4_bf16_saved", "llama_fp4_f32_saved"}) {
    SCOPED_TRACE(name);
    auto be = make_cpu_backend();
    const std::string dir = case_dir(name);
    io::Checkpoint file(dir);
    ModelWeights w = ModelWeights::load(*be, ModelConfig::from_file(dir), file, DType::F32);
    for (const Linear* lin : w.linears()) {
      ASSERT_TRUE(lin->quantized()) << lin->prefix;
      for (const Parameter* p : {lin->quant.packed, lin->quant.absmax, lin->quant.nested_absmax}) {
        if (!p) continue;
        const io::TensorRecord* rec = file.find(p->name);
        ASSERT_NE(rec, nullptr) << p->name;
        ASSERT_EQ(rec->bytes, p->value.bytes()) << p->name;
        EXPECT_EQ(std::memcmp(rec->data, p->value.data(), rec->bytes), 0) << p->name;
      }
    }
  }
}

// Quantising at load gives bitsandbytes' own bytes: the double-quantised case's packed weights
// equal those of the same weights quantised without double quantisation (only the absmax differ),
// and the dequantised absmax stay within the 8-bit code's resolution of the exact ones.
TEST(Qlora, QuantiseAtLoadKeepsTheBaseFrozenAndDenseElsewhere) {
  auto be = make_cpu_backend();
  const std::string dir = case_dir("qwen2_nf4");
  ModelWeights w = ModelWeights::load(*be, ModelConfig::from_file(dir), io::Checkpoint(dir), DType::F32,
                                      parse_quantize_options("nf4", false, 64));
  w.add_lora(*be, LoraConfig{4, 8, false, {"q_proj", "down_proj"}}, 1);
  EXPECT_EQ(w.embed->value.dtype(), DType::F32);
  EXPECT_EQ(w.final_norm->value.dtype(), DType::F32);
  for (const Linear* lin : w.linears()) {
    EXPECT_EQ(lin->format, WeightFormat::NF4);
    EXPECT_EQ(lin->weight, nullptr);
    EXPECT_FALSE(lin->quant.packed->trainable);
    EXPECT_EQ(lin->quant.packed->value.dtype(), DType::U8);
    EXPECT_EQ(lin->quant.packed->value.numel(), lin->out * lin->in / 2);
    EXPECT_EQ(lin->quant.absmax->value.numel(), lin->out * lin->in / 64);
  }
  for (const Parameter& p : w.parameters()) EXPECT_TRUE(!p.trainable || p.name.find("lora_") != std::string::npos);
}

// --merge-output: the dense folder holds W_deq + s·B·A, so it scores what the 4-bit base with the
// adapter scores; without merging, the dequantised base; never the source's quantization_config.
TEST(Qlora, MergedExportIsTheDequantisedBasePlusTheAdapter) {
  auto be = make_cpu_backend();
  const QloraCase c{"qwen2_nf4_dq_saved", "", false};
  const std::string dir = case_dir(c.name);
  ModelWeights quantized = load(*be, c, DType::F32);
  const double want = run_step(*be, quantized, dir);
  const std::filesystem::path out = std::filesystem::temp_directory_path() / ("spindle_qlora_merged_" + std::to_string(::getpid()));
  HfModelExportOptions options;
  options.merge_lora = true;
  options.dtype = DType::F32;
  save_hf_model(*be, quantized, dir, out, options);
  std::ifstream config(out / "config.json");
  const std::string text((std::istreambuf_iterator<char>(config)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text.find("quantization_config"), std::string::npos);
  ModelWeights merged = ModelWeights::load(*be, ModelConfig::from_file(out.string()), io::Checkpoint(out.string()), DType::F32);
  for (const Linear* lin : merged.linears()) EXPECT_FALSE(lin->quantized());
  merged.add_lora(*be, LoraConfig{4, 8, false, {"q_proj"}}, 3);  // B = 0: the merged model's own loss
  EXPECT_NEAR(run_step(*be, merged, dir), want, 1e-6 * std::fabs(want));
  std::filesystem::remove_all(out);
}

}  // namespace
}  // namespace spindle
