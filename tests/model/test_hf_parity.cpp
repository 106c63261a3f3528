// The CPU engine against Hugging Face transformers (and PEFT) on tiny random models saved by
// scripts/gpu/make_hf_refs.py: loss, per-token cross-entropy and every trainable gradient for
// packed multi-document rows with prompt masking and loss_scale.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <optional>
#include <string>

#include "backend/backend.h"
#include "backend/op_test_util.h"
#include "data/packing.h"
#include "data/pretokenized.h"
#include "io/checkpoint.h"
#include "io/load_tensor.h"
#include "model/decoder.h"
#include "model/router_aux_loss.h"

using namespace spindle;
using namespace spindle::test;

namespace {

std::string case_dir(const std::string& name) { return std::string(SPINDLE_SOURCE_DIR) + "/testdata/hf/" + name; }

struct Reference {
  io::Checkpoint expected;
  double loss;
  std::optional<double> aux_loss;  // MoE cases: the router load-balancing loss
  int64_t num_items;
  explicit Reference(const std::string& dir) : expected(dir + "/expected.safetensors") {
    auto cpu = make_cpu_backend();
    loss = to_host(*cpu, io::load_tensor(*cpu, expected.require("loss", Shape{1}), DType::F64))[0];
    if (expected.find("aux_loss"))
      aux_loss = to_host(*cpu, io::load_tensor(*cpu, expected.require("aux_loss", Shape{1}), DType::F64))[0];
    std::vector<int64_t> n(1);
    const io::TensorRecord& rec = expected.require("num_items", Shape{1});
    std::memcpy(n.data(), rec.data, 8);
    num_items = n[0];
  }
};

struct StepResult {
  double loss = 0;
  int64_t num_items = 0;
  std::optional<double> aux_loss;
};

// Loads the case's model (and adapter), packs its documents into rows of `max_length`, and runs one
// forward/backward step with the loss normalised by the global supervised-token count.
StepResult run_case(Backend& be, ModelWeights& weights, const std::string& dir, int64_t max_length, DecoderOptions options) {
  std::vector<Document> docs = read_pretokenized_jsonl(dir + "/data.jsonl");
  PackOptions pack;
  pack.max_length = max_length;
  pack.drop_documents_without_targets = false;
  std::vector<PackedRow> rows = pack_documents(docs, pack);
  int64_t num_items = 0;
  for (const PackedRow& r : rows) num_items += r.num_items();
  Decoder decoder(be, weights, options);
  Tensor loss = be.zeros(Shape{1}, stat_dtype(weights.dtype));
  // Two micro-batches (the rows split in halves) whose gradients add up: accumulation is exact.
  const size_t half = rows.size() / 2;
  std::vector<PackedRow> first(rows.begin(), rows.begin() + half), second(rows.begin() + half, rows.end());
  const double scale = 1.0 / static_cast<double>(num_items);
  // MoE models train with the router load-balancing loss their config asks for, its statistics over
  // both micro-batches: a forward-only pass first, as StepRunner does for several micro-batches.
  std::unique_ptr<RouterAuxLoss> aux;
  if (const double coefficient = router_aux_loss_coefficient(weights.config, -1); coefficient > 0) {
    aux = std::make_unique<RouterAuxLoss>(be, weights.config, weights.dtype, coefficient);
    int64_t tokens = 0;
    for (const PackedRow& r : rows)
      for (int32_t doc : r.doc_ids) tokens += doc >= 0;
    aux->begin_step(tokens, nullptr);
    decoder.set_router_aux_loss(aux.get());
    Tensor discard = be.zeros(Shape{1}, stat_dtype(weights.dtype));
    for (auto* part : {&first, &second})
      if (!part->empty()) decoder.step(make_micro_batch(be, *part, weights.dtype), scale, discard, false);
    aux->finish_statistics();
  }
  for (auto* part : {&first, &second}) {
    if (part->empty()) continue;
    MicroBatch batch = make_micro_batch(be, *part, weights.dtype);
    decoder.step(batch, scale, loss, true);
  }
  StepResult result{to_host(be, loss)[0], num_items, std::nullopt};
  if (aux) result.aux_loss = aux->value();
  return result;
}

// The reference gradient of `p`: under its own name, or its slice of a packed tensor (transformers
// 5 keeps routed experts fused: gate_up_proj [E, 2I, H], down_proj [E, H, I]; gpt_oss's transposed,
// [E, H, 2I] and [E, I, H], with their biases [E, 2I] and [E, H]). An expert LoRA's B
// is PEFT's [out, r·E] there and [E, out, r] in spindle (model/expert_lora.h).
std::vector<double> reference_gradient(Backend& be, const ModelWeights& weights, const Reference& ref,
                                       const Parameter& p) {
  if (const io::TensorRecord* rec = ref.expected.find("grad." + p.name)) {
    const Tensor stored = io::load_tensor(be, *rec, DType::F64);
    if (!weights.expert_lora_of_b(p)) return to_host(be, stored);
    Tensor per_expert = be.empty(p.value.shape(), DType::F64);
    expert_lora_b_from_peft(stored, per_expert);
    return to_host(be, per_expert);
  }
  for (const PackedTensor& packed : weights.packed_tensors()) {
    int64_t offset = 0;
    for (const Parameter* part : packed.parts) {
      if (part == &p) {
        const io::TensorRecord* rec = ref.expected.find("grad." + packed.name);
        if (!rec) return {};
        const std::vector<double> whole = to_host(be, io::load_tensor(be, *rec, DType::F64));
        std::vector<double> slice(whole.begin() + offset, whole.begin() + offset + p.value.numel());
        if (!packed.transposed_parts) return slice;
        // gpt_oss: the part [out, in] is stored [in, out].
        const int64_t out = p.value.dim(0), in = p.value.dim(1);
        std::vector<double> matrix(slice.size());
        for (int64_t r = 0; r < out; ++r)
          for (int64_t c = 0; c < in; ++c) matrix[static_cast<size_t>(r * in + c)] = slice[static_cast<size_t>(c * out + r)];
        return matrix;
      }
      offset += part->value.numel();
    }
  }
  return {};
}

void expect_gradients_match(Backend& be, ModelWeights& weights, const Reference& ref, double tol) {
  int checked = 0;
  for (Parameter& p : weights.parameters()) {
    if (!p.trainable) continue;
    const std::vector<double> want = reference_gradient(be, weights, ref, p);
    ASSERT_EQ(static_cast<int64_t>(want.size()), p.grad.numel()) << "no reference gradient of its size for " << p.name;
    const double err = relative_error(to_host(be, p.grad), want);
    EXPECT_LE(err, tol) << p.name;
    ++checked;
  }
  EXPECT_GT(checked, 0);
}

// The case's model, with its PEFT adapter when it has one (then only the adapter trains).
ModelWeights load_case(Backend& be, const std::string& dir, bool train) {
  ModelWeights weights = ModelWeights::load(be, ModelConfig::from_file(dir), io::Checkpoint(dir), DType::F32);
  if (std::filesystem::exists(dir + "/adapter")) weights.load_peft_adapter(be, dir + "/adapter");
  else if (train) weights.train_all(be);
  return weights;
}

class HfParity : public ::testing::TestWithParam<std::string> {};

}  // namespace

TEST_P(HfParity, LossAndEveryGradientMatchTransformers) {
  const std::string dir = case_dir(GetParam());
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "missing " << dir << " (regenerate: scripts/gpu/make_hf_refs.sh)";
  auto be = make_cpu_backend();
  Reference ref(dir);
  ModelWeights weights = load_case(*be, dir, true);
  StepResult run = run_case(*be, weights, dir, 32, {});
  EXPECT_EQ(run.num_items, ref.num_items);
  EXPECT_NEAR(run.loss, ref.loss, 1e-5 * std::fabs(ref.loss));
  ASSERT_EQ(run.aux_loss.has_value(), ref.aux_loss.has_value());
  if (ref.aux_loss) EXPECT_NEAR(*run.aux_loss, *ref.aux_loss, 1e-5 * std::fabs(*ref.aux_loss));
  expect_gradients_match(*be, weights, ref, 1e-4);
}

TEST_P(HfParity, RecomputedLayersAndOtherPackingsGiveTheSameResult) {
  const std::string dir = case_dir(GetParam());
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "missing " << dir;
  auto be = make_cpu_backend();
  Reference ref(dir);
  ModelWeights weights = load_case(*be, dir, true);
  DecoderOptions options;
  options.recompute.assign(weights.config.num_layers, false);
  options.recompute[0] = true;        // checkpoint the first layer only
  options.logits_budget_bytes = 512;  // a few rows per logits chunk
  StepResult run = run_case(*be, weights, dir, 64, options);
  EXPECT_NEAR(run.loss, ref.loss, 1e-5 * std::fabs(ref.loss));
  if (ref.aux_loss) EXPECT_NEAR(*run.aux_loss, *ref.aux_loss, 1e-5 * std::fabs(*ref.aux_loss));
  expect_gradients_match(*be, weights, ref, 1e-4);
}

TEST_P(HfParity, PerTokenCrossEntropyMatchesTransformersLogits) {
  // Every position supervised: the CE of each target must equal the CE from HF's logits.
  const std::string dir = case_dir(GetParam());
  if (!std::filesystem::exists(dir)) GTEST_SKIP() << "missing " << dir;
  auto be = make_cpu_backend();
  Reference ref(dir);
  ModelWeights weights = load_case(*be, dir, false);
  std::vector<Document> docs = read_pretokenized_jsonl(dir + "/data.jsonl");
  int64_t total = 0;
  for (Document& d : docs) {
    d.labels = d.input_ids;
    d.loss_scale.clear();
    total += static_cast<int64_t>(d.input_ids.size());
  }
  PackOptions pack;
  pack.max_length = total;
  pack.packing = false;  // one document per row, rows in dataset order: selected order = document order
  pack.drop_documents_without_targets = false;
  std::vector<PackedRow> rows = pack_documents(docs, pack);
  MicroBatch batch = make_micro_batch(*be, rows, weights.dtype);
  Decoder decoder(*be, weights);
  Tensor loss = be->zeros(Shape{1}, DType::F32), ce = be->empty(Shape{batch.num_selected}, DType::F32);
  decoder.step(batch, 1.0, loss, false, &ce);
  std::vector<double> got = to_host(*be, ce);

  const int64_t vocab = weights.config.vocab_size;
  std::vector<double> logits = to_host(*be, io::load_tensor(*be, ref.expected.require("logits", Shape{total, vocab}), DType::F64));
  std::vector<double> want;
  int64_t offset = 0;
  for (const Document& d : docs) {
    for (size_t i = 0; i + 1 < d.input_ids.size(); ++i) {
      const double* row = &logits[(offset + i) * vocab];
      double mx = row[0], z = 0;
      for (int64_t j = 0; j < vocab; ++j) mx = std::max(mx, row[j]);
      for (int64_t j = 0; j < vocab; ++j) z += std::exp(row[j] - mx);
      want.push_back(mx + std::log(z) - row[d.input_ids[i + 1]]);
    }
    offset += static_cast<int64_t>(d.input_ids.size());
  }
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 2e-5 * std::max(1.0, std::fabs(want[i]))) << i;
}

INSTANTIATE_TEST_SUITE_P(Models, HfParity, ::testing::Values("llama", "qwen2", "qwen3", "qwen2_lora", "llama_rslora",
                                                                "qwen3_moe", "qwen3_moe_lora"));
// mistral: a sliding window of 5 keys on every layer, shorter than the packed documents; YaRN RoPE
// (qwen3: untruncated bounds, mscale ratio, v4 spelling; llama: the defaults, v5 spelling) on
// documents longer than the original window.
INSTANTIATE_TEST_SUITE_P(Wave2, HfParity, ::testing::Values("mistral", "mistral_lora", "qwen3_yarn", "llama_yarn"));
// gemma2: sliding/full layers, soft-capped attention and final logits, sandwich (1 + w) norms, GeGLU,
// √hidden embeddings, tied head (and LoRA on it); gemma3_text: q/k norms and the sliding layers' own
// RoPE against the full layers' scaled one.
// gemma3: the multimodal checkpoint (text model under language_model.model., a SigLIP tower carried).
INSTANTIATE_TEST_SUITE_P(Gemma, HfParity, ::testing::Values("gemma2", "gemma2_lora", "gemma3_text", "gemma3"));
// Gated DeltaNet and gated attention layers (qwen3_5, text-only; slow-decay DeltaNet heads).
INSTANTIATE_TEST_SUITE_P(Qwen35, HfParity, ::testing::Values("qwen3_5", "qwen3_5_lora"));
// Qwen3.5-MoE / Qwen3.6: the multimodal checkpoint (tiny vision tower, experts fused as released, mtp.*
// tensors; the load-balancing loss on), LoRA on it with nonzero B (shared expert, its gate, DeltaNet,
// attention), and the text-only Qwen3_5MoeForCausalLM (per-expert tensors, as transformers 5 saves them).
INSTANTIATE_TEST_SUITE_P(Qwen35Moe, HfParity, ::testing::Values("qwen3_5_moe", "qwen3_5_moe_lora", "qwen3_5_moe_text"));
// Qwen3-Next: the DeltaNet projections fused per key head (in_proj_qkvz, in_proj_ba, two value heads per
// key head), a dense middle layer (mlp_only_layers), experts saved per expert; the full case with no
// top-k renormalisation and the load-balancing loss, the LoRA case on the fused projections.
INSTANTIATE_TEST_SUITE_P(Qwen3Next, HfParity, ::testing::Values("qwen3_next", "qwen3_next_lora"));
// PEFT's LoRA on the routed experts' fused tensors (target_parameters, peft 0.21), with LoRA on attention:
// qwen3_moe over a per-expert checkpoint, the multimodal qwen3_5_moe over a fused one (aux loss on in both).
INSTANTIATE_TEST_SUITE_P(ExpertLora, HfParity, ::testing::Values("qwen3_moe_expert_lora", "qwen3_5_moe_expert_lora"));
// gpt_oss: sliding (window 8, shorter than the documents) and full layers, sinks drawn away from zero
// on both, biased q/k/v/o, YaRN on documents past its original window, the biased router and the
// clamped-SwiGLU experts (some gate/up values past the limit) in transformers' [E, in, out] layout,
// the load-balancing loss on; its LoRA case adapts q/k/v/o with nonzero B. Every gate/up value is
// at least 1e-4 from a clamp bound, where the clamp's derivative jumps (make_hf_refs.py, CLAMP_MARGIN).
INSTANTIATE_TEST_SUITE_P(GptOss, HfParity, ::testing::Values("gpt_oss", "gpt_oss_lora"));
// glm4_moe: a dense first layer, then the sigmoid router with correction biases that change most
// choices (4 groups of 2 experts, 3 experts per token from the best 2 groups, renormalised, scaled by
// 2.5) and 2 ungated shared experts; q/k/v biases, q/k norms, RoPE on half of each head (v5
// spelling). LoRA with nonzero B on every projection (attention, the dense MLP, the shared experts;
// made with peft's transformers-5 MoE target rewrite turned off: make_hf_refs.py,
// PeftModuleTargetsAsWritten), and on q_proj with the routed experts' fused tensors (target_parameters).
// glm4_moe_v4: one group, raw scores, no q/k norm or bias, the transformers-4 RoPE spelling, and an
// MTP layer in the checkpoint that is not loaded.
INSTANTIATE_TEST_SUITE_P(Glm4Moe, HfParity,
                         ::testing::Values("glm4_moe", "glm4_moe_lora", "glm4_moe_expert_lora", "glm4_moe_v4"));
// phi3: q/k/v and gate/up each one projection (qkv_proj, gate_up_proj), LongRoPE with documents on both
// sides of the original window (each rotated with its own length's factors, as transformers rotates one
// document run alone) and the attention factor; a sliding window (phi3); partial rotary, a tied head,
// explicit factors and LoRA with nonzero B on the fused projections (phi3_lora); only the short factors
// (phi3_short). llama_dynamic: dynamic NTK, each document's base grown to its own length.
INSTANTIATE_TEST_SUITE_P(Phi3, HfParity, ::testing::Values("phi3", "phi3_lora", "phi3_short", "llama_dynamic"));
