// Token tiling of the SwiGLU MLP (DecoderOptions::mlp_tile_tokens, --mlp-tile-tokens): forward and
// backward walk each MLP's tokens in tiles and keep only the MLP's input, the backward recomputing
// gate and up per tile. In F64 the loss and every gradient equal the untiled step's within 1e-12
// relative (only the order in which weight gradients sum over the tiles differs): LoRA and full
// fine-tuning, tiles that divide the tokens, that do not, of one row and larger than the row, packed
// documents with padding, recompute all, keep-attention and none; MoE layers (which are not tiled)
// beside a dense one; phi3's fused gate_up_proj, split per tile. The device's peak drops once the
// MLP is wide, and the option's values parse.
#include <gtest/gtest.h>


#include "backend/op_test_util.h"
#include "core/error.h"
#include "model/decoder.h"
#include "support/decoder_steps.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;

namespace {

struct Result : StepOutcome {
  int64_t device_peak = 0;
};

constexpr int64_t kLengths[] = {40, 27};  // two micro-batches accumulated into the same gradients

Result run(Backend& be, ModelWeights& w, const DecoderOptions& options) {
  Decoder decoder(be, w, options);
  w.zero_grads(be);
  Result r;
  Tensor loss = be.zeros(Shape{1}, stat_dtype(w.dtype));
  be.reset_peak_memory();
  for (int64_t length : kLengths) {
    decoder.step(make_micro_batch(be, {two_document_row(length, w.config.vocab_size, 50 + length)}, w.dtype), 0.05, loss, true);
    r.loss.push_back(to_host(be, loss)[0]);
  }
  r.device_peak = be.memory_stats().peak_allocated_bytes;
  for (Parameter& p : w.parameters())
    if (p.trainable) r.grads.push_back(to_host(be, p.grad));
  return r;
}

void expect_close(const Result& got, const Result& want, double tolerance, const std::string& what) {
  ASSERT_EQ(got.loss.size(), want.loss.size());
  for (size_t i = 0; i < want.loss.size(); ++i)
    EXPECT_LE(std::fabs(got.loss[i] - want.loss[i]), tolerance * std::fabs(want.loss[i]))
        << what << ", micro-batch " << i << ": loss " << got.loss[i] << " vs " << want.loss[i];
  ASSERT_EQ(got.grads.size(), want.grads.size());
  for (size_t i = 0; i < want.grads.size(); ++i)
    EXPECT_LE(relative_error(got.grads[i], want.grads[i]), tolerance) << what << ": gradient " << i;
}

DecoderOptions tiled(DecoderOptions o, int64_t tile) {
  o.mlp_tile_tokens = tile;
  return o;
}

ModelConfig dense(const std::string& type) {
  TinyModel m{.model_type = type, .vocab_size = 19, .hidden_size = 16, .intermediate_size = 24, .num_layers = 2,
              .num_heads = 4, .num_kv_heads = 2, .head_dim = 4, .rope_theta = 100.0};
  return m.config();
}

// Made in the test, not when the cases are listed: the family table is itself a static object.
ModelConfig config_of(const std::string& type) {
  if (type == "qwen3_5_text") return tiny_qwen3_5().config();  // gated DeltaNet and gated attention, SwiGLU MLPs
  if (type == "qwen3_moe") return tiny_qwen3_moe().config();    // MoE layers around a dense one: only it tiles
  if (type == "phi3") return tiny_phi3().config();  // gate and up one projection (gate_up_proj), split per tile
  return dense(type);
}

struct Case {
  std::string name;
  std::string type;
  bool lora;
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class MlpTiling : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(MlpTiling, EqualsTheUntiledStepInF64) {
  const Case c = GetParam();
  auto be = make_cpu_backend(1);
  ModelWeights w = random_weights(*be, config_of(c.type), DType::F64, 11, 10.0);
  if (c.lora) {
    LoraConfig lora = lora_on_every_projection(2, 4);
    lora.targets = w.present_lora_targets(lora.targets);  // phi3: its fused projections
    add_lora_with_random_b(*be, w, lora, 12, uniform_draw(0.3));
  } else {
    w.train_all(*be);
  }
  const int64_t layers = w.config.num_layers;
  for (RecomputeMode mode : {RecomputeMode::None, RecomputeMode::All, RecomputeMode::KeepAttention}) {
    const DecoderOptions plain = recompute_options(mode, layers);
    const Result want = run(*be, w, plain);
    ASSERT_GT(gradient_mass(want), 0.0) << "no gradient: the comparison would prove nothing";
    // 8 and 9 divide neither micro-batch evenly but 8 divides 40; 1: one row per tile; 64: one
    // tile holds every token.
    for (int64_t tile : {8, 9, 1, 64}) {
      const std::string what = fmt::format("{} {}, {}-token tiles", c.name, recompute_mode_name(mode), tile);
      expect_close(run(*be, w, tiled(plain, tile)), want, 1e-12, what);
    }
  }
  // Some layers recomputed, the others kept: both kinds of layer tile.
  if (layers >= 2) {
    const DecoderOptions mixed = recompute_options(RecomputeMode::All, layers, 1);
    expect_close(run(*be, w, tiled(mixed, 7)), run(*be, w, mixed), 1e-12, c.name + " all on the first layer");
  }
}

INSTANTIATE_TEST_SUITE_P(Models, MlpTiling,
                         ::testing::Values(Case{"qwen2_lora", "qwen2", true}, Case{"llama_full", "llama", false},
                                           Case{"qwen3_lora", "qwen3", true},
                                           Case{"qwen3_5_full", "qwen3_5_text", false},
                                           Case{"qwen3_moe_full", "qwen3_moe", false},
                                           Case{"phi3_lora", "phi3", true}, Case{"phi3_full", "phi3", false}),
                         [](const auto& info) { return info.param.name; });

// With an MLP much wider than the hidden size the untiled step's peak holds [T, F] tensors that the
// tiled one holds for one tile only.
TEST(MlpTilingMemory, LowersThePeakOfAWideMlp) {
  auto be = make_cpu_backend(1);
  TinyModel m{.model_type = "qwen2", .vocab_size = 19, .hidden_size = 16, .intermediate_size = 256, .num_layers = 2,
              .num_heads = 4, .num_kv_heads = 2, .head_dim = 4, .rope_theta = 100.0};
  ModelWeights w = random_weights(*be, m.config(), DType::F64, 11, 10.0);
  add_lora_with_random_b(*be, w, lora_on_every_projection(2, 4), 12, uniform_draw(0.3));
  for (RecomputeMode mode : {RecomputeMode::None, RecomputeMode::All}) {
    const DecoderOptions plain = recompute_options(mode, w.config.num_layers);
    const Result untiled = run(*be, w, plain), tiles = run(*be, w, tiled(plain, 8));
    // Untiled, the backward of the 40-token micro-batch holds at least gate, up, their product and
    // its gradient [40, 256]; tiled, five [8, 256] buffers.
    const int64_t row_bytes = 256 * static_cast<int64_t>(dtype_size(DType::F64));
    EXPECT_LE(tiles.device_peak + (4 * 40 - 5 * 8) * row_bytes, untiled.device_peak) << recompute_mode_name(mode);
  }
}

TEST(MlpTilingOption, ParsesTokensAndAuto) {
  EXPECT_EQ(parse_mlp_tile_tokens("auto"), kMlpTileAuto);
  EXPECT_EQ(parse_mlp_tile_tokens("0"), 0);
  EXPECT_EQ(parse_mlp_tile_tokens("4096"), 4096);
  EXPECT_EQ(parse_mlp_tile_tokens("16k"), 16384);
  EXPECT_EQ(mlp_tile_tokens_to_run(kMlpTileAuto), 0);
  EXPECT_EQ(mlp_tile_tokens_to_run(512), 512);
  for (const char* bad : {"", "-1", "k", "1.5k", "lots", "16kk"}) {
    try {
      parse_mlp_tile_tokens(bad);
      ADD_FAILURE() << "accepted \"" << bad << "\"";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("--mlp-tile-tokens"), std::string::npos) << e.what();
    }
  }
  auto be = make_cpu_backend(1);
  ModelWeights w = random_weights(*be, dense("llama"), DType::F64, 11, 10.0);
  DecoderOptions negative;
  negative.mlp_tile_tokens = -3;
  EXPECT_THROW(Decoder(*be, w, negative), Error);
}
