// Activation offload (DecoderOptions::offload, --offload activations): what recomputed layers keep
// goes to host memory after their forward and comes back ahead of their backward. On the CPU
// backend the host copy is a separate allocation (Backend::empty_host), so these tests see both
// properties that matter: losses and every gradient are bit-identical with and without offload
// (recompute all, keep-attention, per-layer mixes, offload on the first layers only; dense attention
// and gated DeltaNet layers; F32 and F64; LoRA and full), and the device's peak drops by the
// offloaded bytes, which the host holds. The backend's offload counters see every copy.
#include <gtest/gtest.h>

#include "backend/op_test_util.h"
#include "model/decoder.h"
#include "support/decoder_steps.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;

namespace {

ModelConfig config_of(const std::string& type, int64_t layers) {
  if (type == "qwen3_5_text") return tiny_qwen3_5().config();  // DeltaNet, gated attention, DeltaNet
  TinyModel m{.model_type = type, .vocab_size = 19, .hidden_size = 16, .intermediate_size = 24,
              .num_layers = layers, .num_heads = 4, .num_kv_heads = 2, .head_dim = 4, .rope_theta = 100.0};
  return m.config();
}

struct Result : StepOutcome {
  int64_t device_peak = 0, host_peak = 0, host_after = 0;
  OffloadStats copies;
};

// Two micro-batches of different lengths accumulated into the same gradients.
Result run(Backend& be, ModelWeights& w, const DecoderOptions& options) {
  Decoder decoder(be, w, options);
  w.zero_grads(be);
  Result r;
  Tensor loss = be.zeros(Shape{1}, stat_dtype(w.dtype));
  be.reset_peak_memory();
  be.reset_offload_stats();
  for (int64_t length : {40, 27}) {
    decoder.step(make_micro_batch(be, {two_document_row(length, w.config.vocab_size, 50 + length)}, w.dtype), 0.05,
                 loss, true);
    r.loss.push_back(to_host(be, loss)[0]);
  }
  const MemoryStats m = be.memory_stats();
  r.device_peak = m.peak_allocated_bytes;
  r.host_peak = m.peak_host_allocated_bytes;
  r.host_after = m.host_allocated_bytes;
  r.copies = be.offload_stats();
  for (Parameter& p : w.parameters())
    if (p.trainable) r.grads.push_back(to_host(be, p.grad));
  return r;
}

struct Case {
  std::string type;
  DType dtype;
  bool lora;
};

class Offload : public ::testing::TestWithParam<Case> {};

}  // namespace

TEST_P(Offload, IsBitIdenticalAndMovesKeptTensorsOffTheDevice) {
  const Case c = GetParam();
  auto be = make_cpu_backend(1);
  ModelWeights w = random_weights(*be, config_of(c.type, 6), c.dtype, 11, 10.0);
  if (c.lora) add_lora_with_random_b(*be, w, lora_on_every_projection(2, 4), 12, uniform_draw(0.3));
  else w.train_all(*be);
  const int64_t layers = w.config.num_layers;
  auto with_offload = [](DecoderOptions o) {
    o.offload = true;
    return o;
  };

  for (RecomputeMode mode : {RecomputeMode::All, RecomputeMode::KeepAttention}) {
    const std::string name = recompute_mode_name(mode);
    const DecoderOptions plain = recompute_options(mode, layers);
    const Result kept = run(*be, w, plain);
    EXPECT_EQ(kept.copies.copies, 0) << name << " without offload copied";
    ASSERT_GT(gradient_mass(kept), 0.0) << "no gradient: the comparison would prove nothing";
    EXPECT_EQ(kept.host_peak, 0) << name << " without offload used host tensors";

    const Result moved = run(*be, w, with_offload(plain));
    expect_bit_identical(moved, kept, name + " with offload");
    // Every layer but the last offloads its input ([T, H]) at least; the first micro-batch (40
    // tokens) is the larger, so the host peak is at least (L - 1) of its inputs and all of them
    // are back on the device (freed from the host) after the step.
    const int64_t x_in = 40 * w.config.hidden_size * static_cast<int64_t>(dtype_size(c.dtype));
    EXPECT_GE(moved.host_peak, (layers - 1) * x_in) << name;
    EXPECT_EQ(moved.host_after, 0) << name << ": host tensors outlived the step";
    // The device still holds the layer in backward and the one being fetched: the three-layer
    // qwen3_5 model's peak (in its last layer's backward) holds what it held without offload.
    if (layers >= 5)
      EXPECT_LT(moved.device_peak, kept.device_peak) << name << ": offload did not lower the device's peak";
    else
      EXPECT_LE(moved.device_peak, kept.device_peak) << name;

    // Each offloaded tensor goes out and comes back once per micro-batch, timed (the CPU's copies
    // run inside the step: their time is the time they add).
    EXPECT_GT(moved.copies.copies, 0) << name;
    EXPECT_EQ(moved.copies.copies % 2, 0) << name << ": every copy out has one back";
    EXPECT_GE(moved.copies.bytes, 2 * (layers - 1) * (40 + 27) * w.config.hidden_size *
                                      static_cast<int64_t>(dtype_size(c.dtype)))
        << name;
    EXPECT_GT(moved.copies.copy_seconds, 0.0) << name;
    EXPECT_EQ(moved.copies.wait_seconds, moved.copies.copy_seconds) << name;

    // Per-layer: the first two layers recomputed (and offloaded), the rest kept whole.
    const Result first_two = run(*be, w, with_offload(recompute_options(mode, layers, 2)));
    expect_bit_identical(first_two, kept, name + " on the first 2 layers with offload");
    EXPECT_GE(first_two.host_peak, 2 * x_in);

    // Partial offload (--offload-layers): every layer recomputed, only the first ones offloaded, the
    // later ones keeping theirs on the device. The host holds those layers' tensors and no more: a
    // layer offloads what a full offload moves for it, so where every layer keeps the same tensors
    // (not keep-attention on the hybrid model) the copies are the full offload's times M / (L − 1).
    const bool uniform_layers = c.type != "qwen3_5_text" || mode == RecomputeMode::All;
    for (int64_t offloaded : {int64_t{0}, int64_t{1}, layers / 2, layers - 1, layers}) {
      DecoderOptions partial = with_offload(plain);
      partial.offload_layers = offloaded;
      const Result some = run(*be, w, partial);
      const std::string what = name + " with the first " + std::to_string(offloaded) + " layers offloaded";
      expect_bit_identical(some, kept, what);
      const int64_t moving = std::min(offloaded, layers - 1);  // the last layer never offloads
      if (uniform_layers) {
        EXPECT_EQ(some.copies.bytes * (layers - 1), moved.copies.bytes * moving) << what;
        EXPECT_EQ(some.copies.copies * (layers - 1), moved.copies.copies * moving) << what;
      }
      EXPECT_EQ(some.copies.copies == 0, moving == 0) << what;
      EXPECT_EQ(some.host_after, 0) << what;
      if (moving == 0) {
        EXPECT_EQ(some.host_peak, 0) << what;
        EXPECT_EQ(some.device_peak, kept.device_peak) << what;
      } else {
        EXPECT_GE(some.host_peak, moving * x_in) << what;
        EXPECT_LE(some.host_peak, moved.host_peak) << what;
        EXPECT_LE(some.device_peak, kept.device_peak) << what;
        EXPECT_GE(some.device_peak, moved.device_peak) << what;
      }
      if (moving == layers - 1) {
        EXPECT_EQ(some.host_peak, moved.host_peak) << what;
        EXPECT_EQ(some.device_peak, moved.device_peak) << what;
      }
    }
  }
}

TEST(OffloadLayers, AreCheckedAgainstTheOffloadOption) {
  EXPECT_NO_THROW(check_offload_layers(true, -1));
  EXPECT_NO_THROW(check_offload_layers(true, 3));
  EXPECT_NO_THROW(check_offload_layers(false, -1));
  try {
    check_offload_layers(false, 2);
    ADD_FAILURE() << "--offload-layers without --offload activations was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--offload activations"), std::string::npos) << e.what();
  }
  try {
    check_offload_layers(true, -3);
    ADD_FAILURE() << "--offload-layers -3 was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--offload-layers"), std::string::npos) << e.what();
  }
}

INSTANTIATE_TEST_SUITE_P(Models, Offload,
                         ::testing::Values(Case{"qwen3", DType::F32, true}, Case{"qwen3", DType::F64, false},
                                           Case{"qwen2", DType::F32, false}, Case{"llama", DType::F64, true},
                                           Case{"qwen3_5_text", DType::F32, true},
                                           Case{"qwen3_5_text", DType::F64, false}),
                         [](const auto& info) {
                           return info.param.type + (info.param.dtype == DType::F64 ? "_f64" : "_f32") +
                                  (info.param.lora ? "_lora" : "_full");
                         });
