// spindle bench's parts on the CPU: the timing decorator forwards every op unchanged (bit-identical
// loss and gradients) and sees the op categories; the FLOP formulas count the parameters the
// model really allocates; memory statistics move with allocations; a whole tiny sweep runs.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <numeric>
#include <set>

#include "bench/bench.h"
#include "bench/flops.h"
#include "bench/timed_backend.h"
#include "core/error.h"
#include "model/batch.h"
#include "model/decoder.h"
#include "model/weights.h"
#include "support/tiny_model.h"

namespace spindle::bench {
namespace {

const std::string kQwen2 = std::string(SPINDLE_SOURCE_DIR) + "/testdata/hf/qwen2";
const std::string kLlama = std::string(SPINDLE_SOURCE_DIR) + "/testdata/hf/llama";

PackedRow row_of(int64_t length, int64_t vocab) {
  PackedRow row;
  for (int64_t i = 0; i < length; ++i) {
    row.input_ids.push_back(static_cast<int32_t>((i * 7919 + 13) % vocab));
    row.positions.push_back(static_cast<int32_t>(i));
    row.doc_ids.push_back(0);
  }
  for (int64_t i = 0; i < length; ++i) {
    row.targets.push_back(i + 1 < length ? row.input_ids[i + 1] : kIgnoreIndex);
    row.weights.push_back(i + 1 < length ? 1.0f : 0.0f);
  }
  return row;
}

std::vector<float> values(Backend& backend, const Tensor& t) {
  std::vector<float> v(t.numel());
  backend.copy_to_host(backend.default_stream(), t, v.data());
  return v;
}

TEST(Bench, TimedBackendForwardsEveryOpUnchanged) {
  auto backend = make_cpu_backend(1);
  const ModelConfig config = ModelConfig::from_file(kQwen2);
  const MicroBatch batch = make_micro_batch(*backend, {row_of(40, config.vocab_size)}, DType::F32);

  auto run = [&](Backend& be, ModelWeights& weights) {
    DecoderOptions options;
    options.recompute.assign(config.num_layers, true);
    Decoder decoder(be, weights, options);
    Tensor loss = be.zeros(Shape{1}, DType::F32);
    weights.zero_grads(be);
    decoder.step(batch, 1.0 / batch.num_items, loss, true);
    return values(*backend, loss)[0];
  };
  ModelWeights plain = ModelWeights::random(*backend, config, DType::F32, 7);
  plain.train_all(*backend);
  ModelWeights decorated = ModelWeights::random(*backend, config, DType::F32, 7);
  decorated.train_all(*backend);

  OpRecorder recorder(*backend);
  TimedBackend timed(*backend, recorder);
  const float plain_loss = run(*backend, plain);
  const float timed_loss = run(timed, decorated);
  EXPECT_EQ(plain_loss, timed_loss);
  EXPECT_GT(plain_loss, 0.0f);
  for (size_t i = 0; i < plain.parameters().size(); ++i) {
    const auto& a = plain.parameters()[i];
    const auto& b = decorated.parameters()[i];
    EXPECT_EQ(values(*backend, a.grad), values(*backend, b.grad)) << a.name;
  }
  const auto totals = recorder.totals_ms();
  EXPECT_GT(recorder.op_count(), 50);
  EXPECT_GT(totals[static_cast<size_t>(OpCategory::Attention)], 0.0);
  EXPECT_GT(totals[static_cast<size_t>(OpCategory::Gemm)], 0.0);
  EXPECT_GT(totals[static_cast<size_t>(OpCategory::OtherOps)], 0.0);
  EXPECT_EQ(totals[static_cast<size_t>(OpCategory::Communication)], 0.0);
}

// The same for the hybrid MoE family, whose layers use every op the dense model does not: gated
// attention (partial RoPE, output gate), gated DeltaNet (conv, L2 norm, gates, the delta rule, gated
// norm), routed experts (router, permutation, grouped GEMMs, combine) and the shared expert's gate.
// An op the decorator does not forward would throw here (the Backend default) or change a result.
TEST(Bench, TimedBackendForwardsTheHybridMoeOps) {
  auto backend = make_cpu_backend(1);
  const ModelConfig config = test::tiny_qwen3_5_moe().config();
  const MicroBatch batch = make_micro_batch(*backend, {row_of(24, config.vocab_size)}, DType::F32);
  auto run = [&](Backend& be, ModelWeights& weights) {
    Decoder decoder(be, weights);
    Tensor loss = be.zeros(Shape{1}, DType::F32);
    weights.zero_grads(be);
    decoder.step(batch, 1.0 / batch.num_items, loss, true);
    return values(*backend, loss)[0];
  };
  ModelWeights plain = test::random_weights(*backend, config, DType::F32, 11, 10.0);
  plain.train_all(*backend);
  ModelWeights decorated = test::random_weights(*backend, config, DType::F32, 11, 10.0);
  decorated.train_all(*backend);

  OpRecorder recorder(*backend);
  TimedBackend timed(*backend, recorder);
  const float plain_loss = run(*backend, plain);
  EXPECT_EQ(plain_loss, run(timed, decorated));
  for (size_t i = 0; i < plain.parameters().size(); ++i)
    EXPECT_EQ(values(*backend, plain.parameters()[i].grad), values(*backend, decorated.parameters()[i].grad))
        << plain.parameters()[i].name;
  std::set<std::string> labels;
  for (const OpTime& t : recorder.op_table()) labels.insert(t.label);
  for (const char* op : {"gated_delta_rule_forward", "gated_delta_rule_backward", "deltanet_conv_split_forward",
                         "deltanet_conv_split_backward", "gated_rmsnorm_backward", "rope_partial", "sigmoid_gate_backward", "moe_router_forward",
                         "shared_expert_gate_forward", "shared_expert_gate_backward"})
    EXPECT_TRUE(labels.count(op)) << op << " was not recorded";
}

// N_matmul and the LoRA count must be what ModelWeights allocates (tied and untied heads).
TEST(Bench, FlopFormulasCountTheAllocatedParameters) {
  auto backend = make_cpu_backend(1);
  for (const std::string& path : {kQwen2, kLlama}) {
    const ModelConfig config = ModelConfig::from_file(path);
    ModelWeights weights = ModelWeights::random(*backend, config, DType::F32, 1);
    weights.add_lora(*backend, test::lora_on_every_projection(4, 8), 2);
    int64_t projections = 0, adapters = 0;
    for (const Parameter& p : weights.parameters()) {
      if (p.name.find("lora_") != std::string::npos) adapters += p.value.numel();
      else if (p.name.ends_with("proj.weight")) projections += p.value.numel();
    }
    const int64_t head = config.vocab_size * config.hidden_size;
    EXPECT_EQ(matmul_parameters(config), projections + head) << path;
    EXPECT_EQ(lora_parameters(config, 4), adapters) << path;

    FlopSetup setup;
    setup.tokens = 100;
    setup.lora_rank = 4;
    setup.recompute = RecomputeMode::All;
    const StepFlops f = step_flops(config, setup);
    EXPECT_DOUBLE_EQ(f.dense_model, 6.0 * (projections + head + adapters) * 100);
    const double attention_forward = config.num_layers * 4.0 * config.num_heads * config.head_dim * 100 * 101 / 2;
    EXPECT_DOUBLE_EQ(f.attention_model, 3.5 * attention_forward);
    EXPECT_DOUBLE_EQ(f.attention_executed, 4.5 * attention_forward);
    const double dense_recomputed = (4.0 * (projections + head) + 6.0 * adapters) * 100 +
                                    2.0 * (projections + adapters) * 100;
    EXPECT_DOUBLE_EQ(f.dense_executed, dense_recomputed);

    // keep-attention: the layers' dense forward runs again, the attention forward does not.
    setup.recompute = RecomputeMode::KeepAttention;
    const StepFlops kept = step_flops(config, setup);
    EXPECT_DOUBLE_EQ(kept.model(), f.model());
    EXPECT_DOUBLE_EQ(kept.attention_executed, 3.5 * attention_forward);
    EXPECT_DOUBLE_EQ(kept.dense_executed, dense_recomputed);
    // --recompute-layers: the recompute's FLOPs in proportion to the layers that recompute.
    setup.recompute = RecomputeMode::All;
    setup.recomputed_layers = 1;
    const StepFlops one = step_flops(config, setup);
    const double share = 1.0 / static_cast<double>(config.num_layers);
    EXPECT_DOUBLE_EQ(one.attention_executed, (3.5 + share) * attention_forward);
    EXPECT_DOUBLE_EQ(one.dense_executed, (4.0 * (projections + head) + 6.0 * adapters) * 100 +
                                             share * 2.0 * (projections + adapters) * 100);
    setup.recomputed_layers = -1;
    setup.recompute = RecomputeMode::None;
    const StepFlops plain = step_flops(config, setup);
    EXPECT_DOUBLE_EQ(plain.attention_executed, 3.5 * attention_forward);
    EXPECT_DOUBLE_EQ(plain.dense_executed, (4.0 * (projections + head) + 6.0 * adapters) * 100);
    // A packed row of documents of 30 tokens: 30 + 30 + 30 + 10; attention counts their pairs only.
    setup.doc_length = 30;
    const StepFlops packed = step_flops(config, setup);
    const double per_pair = config.num_layers * 4.0 * config.num_heads * config.head_dim;
    EXPECT_DOUBLE_EQ(packed.attention_model, 3.5 * per_pair * (3 * 30 * 31 / 2 + 10 * 11 / 2));
    EXPECT_DOUBLE_EQ(packed.dense_model, plain.dense_model);
  }
}

// --mlp-tile-tokens: the MLP backward runs gate and up again; a recomputed layer's recompute stops at
// the MLP's input, so there only the down projection's second forward goes.
TEST(Bench, TiledMlpFlopsCountTheProjectionsRunAgain) {
  auto backend = make_cpu_backend(1);
  const ModelConfig config = ModelConfig::from_file(kQwen2);
  ModelWeights weights = ModelWeights::random(*backend, config, DType::F32, 1);
  weights.add_lora(*backend, test::lora_on_every_projection(4, 8), 2);
  double gate_up = 0, down = 0;  // weights with their LoRA pairs
  for (const Parameter& p : weights.parameters()) {
    if (p.name.find(".mlp.gate_proj.") != std::string::npos || p.name.find(".mlp.up_proj.") != std::string::npos)
      gate_up += static_cast<double>(p.value.numel());
    else if (p.name.find(".mlp.down_proj.") != std::string::npos)
      down += static_cast<double>(p.value.numel());
  }
  ASSERT_GT(gate_up, 0.0);
  ASSERT_GT(down, 0.0);
  FlopSetup setup;
  setup.tokens = 100;
  setup.lora_rank = 4;
  for (RecomputeMode mode : {RecomputeMode::None, RecomputeMode::All}) {
    setup.recompute = mode;
    setup.mlp_tiled = false;
    const StepFlops untiled = step_flops(config, setup);
    setup.mlp_tiled = true;
    const StepFlops tiled = step_flops(config, setup);
    EXPECT_DOUBLE_EQ(tiled.model(), untiled.model());
    EXPECT_DOUBLE_EQ(tiled.attention_executed, untiled.attention_executed);
    const double change = mode == RecomputeMode::None ? 2.0 * gate_up * 100 : -2.0 * down * 100;
    EXPECT_DOUBLE_EQ(tiled.dense_executed, untiled.dense_executed + change) << recompute_mode_name(mode);
  }
}

TEST(Bench, MixtureOfExpertsFlopsCountTheActiveExperts) {
  // A token multiplies the router and k of the E experts: routed experts count k/E of their weights.
  const ModelConfig config = test::tiny_qwen3_moe().config();
  auto backend = make_cpu_backend(1);
  ModelWeights weights = ModelWeights::random(*backend, config, DType::F32, 1);
  int64_t dense = 0, experts = 0;
  for (const Parameter& p : weights.parameters()) {
    if (p.name.find(".mlp.experts.") != std::string::npos) experts += p.value.numel();
    else if (p.name.ends_with("proj.weight") || p.name.ends_with("mlp.gate.weight")) dense += p.value.numel();
  }
  const int64_t head = config.vocab_size * config.hidden_size, moe_layers = 2;
  const MoeConfig& moe = config.moe;
  EXPECT_EQ(experts, moe_layers * moe.num_experts * 3 * config.hidden_size * moe.expert_intermediate_size);
  const int64_t active = moe_layers * moe.experts_per_token * 3 * config.hidden_size * moe.expert_intermediate_size;
  EXPECT_EQ(matmul_parameters(config), dense + head + active);
  EXPECT_LT(matmul_parameters(config), dense + head + experts);
  // LoRA reaches the attention and the dense layer's MLP only.
  weights.add_lora(*backend, test::lora_on_every_projection(4, 8), 2);
  int64_t adapters = 0;
  for (const Parameter& p : weights.parameters())
    if (p.name.find("lora_") != std::string::npos) adapters += p.value.numel();
  EXPECT_EQ(lora_parameters(config, 4), adapters);
  FlopSetup setup;
  setup.tokens = 50;
  EXPECT_DOUBLE_EQ(step_flops(config, setup).dense_model, 6.0 * (dense + head + active) * 50);
}

TEST(Bench, CpuMemoryStatsCountTensorsAndTheResidentSet) {
  auto backend = make_cpu_backend(1);
  backend->reset_peak_memory();
  const MemoryStats before = backend->memory_stats();
  EXPECT_GE(before.allocated_bytes, 0);
  EXPECT_GT(before.reserved_bytes, 0);  // the resident set: the program itself
  EXPECT_GE(before.peak_allocated_bytes, before.allocated_bytes);
  const int64_t bytes = int64_t{48} << 22;  // 192 MiB of F32
  {
    Tensor big = backend->empty(Shape{int64_t{48} << 20}, DType::F32);
    backend->fill(backend->default_stream(), big, 1.0);  // touched: resident
    const MemoryStats during = backend->memory_stats();
    EXPECT_EQ(during.allocated_bytes - before.allocated_bytes, bytes);  // exactly the tensor (64-byte padded)
    EXPECT_GE(during.reserved_bytes - before.reserved_bytes, int64_t{180} << 20);
  }
  const MemoryStats after = backend->memory_stats();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.peak_allocated_bytes - before.allocated_bytes, bytes);
  EXPECT_EQ(after.device_total_bytes, 0);
}

TEST(Bench, TinySweepOnTheCpu) {
  BenchOptions o;
  o.model = kQwen2;
  o.device = "cpu";
  o.cpu_threads = 1;
  o.seq_lengths = {32, 64};
  o.lora_rank = 4;
  o.steps = 2;
  o.warmup = 1;
  BenchReport report = run_bench(o);
  ASSERT_EQ(report.results.size(), 2u);
  const double ln_vocab = std::log(static_cast<double>(report.config.vocab_size));
  for (const BenchResult& r : report.results) {
    EXPECT_TRUE(r.error.empty()) << r.error;
    ASSERT_EQ(r.step_ms.size(), 2u);
    EXPECT_GT(r.tokens_per_s, 0);
    // Random weights (std 0.02) give nearly uniform predictions.
    EXPECT_NEAR(r.loss, ln_vocab, 0.1);
    EXPECT_TRUE(r.split_measured);
    EXPECT_GT(r.split_ms[0], 0);
    EXPECT_GT(r.model_flops, 0);
    // The op table splits the same records by op: its times add up to the category totals, and
    // every GEMM (and the LoRA B backward, two GEMM-shaped products) carries its FLOPs.
    double table_ms = 0, gemm_ms = 0;
    bool saw_attention_backward = false;
    int64_t calls = 0;
    for (const OpTime& t : r.op_table) {
      table_ms += t.ms;
      calls += t.calls;
      saw_attention_backward |= t.label == "attention_backward";
      if (t.category == OpCategory::Gemm) {
        gemm_ms += t.ms;
        EXPECT_TRUE(t.label.rfind("gemm ", 0) == 0 || t.label.rfind("lora_b_backward ", 0) == 0) << t.label;
        EXPECT_GT(t.flops, 0) << t.label;
      }
    }
    EXPECT_TRUE(saw_attention_backward);
    EXPECT_EQ(calls, r.ops_per_step);
    EXPECT_NEAR(table_ms, r.split_ms[0] + r.split_ms[1] + r.split_ms[2] + r.split_ms[3] + r.split_ms[4],
                1e-6 * (1 + table_ms));
    EXPECT_EQ(r.split_ms[2] + r.split_ms[4], 0) << "one process has no collectives";
    EXPECT_NEAR(gemm_ms, r.split_ms[1], 1e-6 * (1 + gemm_ms));
    for (size_t i = 1; i < r.op_table.size(); ++i) EXPECT_GE(r.op_table[i - 1].ms, r.op_table[i].ms);
  }
  const auto j = report_json(report);
  EXPECT_EQ(j["results"].size(), 2u);

  // Packed rows: documents of 20 tokens (32 = 20 + 12, 64 = 3 × 20 + 4); fewer attention FLOPs
  // than one document of the same length, the same loss level.
  o.doc_length = 20;
  BenchReport packed = run_bench(o);
  ASSERT_EQ(packed.results.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    const BenchResult& r = packed.results[i];
    EXPECT_TRUE(r.error.empty()) << r.error;
    EXPECT_NEAR(r.loss, ln_vocab, 0.1);
    EXPECT_LT(r.model_flops, report.results[i].model_flops);
  }
  EXPECT_NE(format_report(packed).find("packed with documents of 20 tokens"), std::string::npos);
  o.doc_length = 1;
  EXPECT_THROW(run_bench(o), Error);
  o.doc_length = 0;
  EXPECT_FALSE(j["optimizer_step_included"].get<bool>());
  EXPECT_NE(format_report(report).find("optimizer step is not included"), std::string::npos);
  EXPECT_EQ(format_report(report).find("most costly ops"), std::string::npos);
  report.options.op_table_rows = 3;
  EXPECT_NE(format_report(report).find("the 3 most costly ops"), std::string::npos);
  EXPECT_FALSE(j["results"][0]["ops"].empty());

  // keep-attention runs, and its executed FLOPs are one attention forward below recompute all.
  o.seq_lengths = {32};
  o.steps = 1;
  o.warmup = 0;
  o.profile_steps = 0;
  o.recompute = "keep-attention";
  const BenchReport kept = run_bench(o);
  ASSERT_EQ(kept.results.size(), 1u);
  EXPECT_TRUE(kept.results[0].error.empty()) << kept.results[0].error;
  EXPECT_NEAR(kept.results[0].loss, ln_vocab, 0.1);
  FlopSetup all;
  all.tokens = 32;
  all.lora_rank = 4;
  all.recompute = RecomputeMode::All;
  const ModelConfig& c = kept.config;
  const double attention_forward = c.num_layers * 4.0 * c.num_heads * c.head_dim * 32 * 33 / 2;
  EXPECT_DOUBLE_EQ(kept.results[0].executed_flops, step_flops(c, all).executed() - attention_forward);
  EXPECT_EQ(report_json(kept)["recompute"], "keep-attention");
  o.recompute = "attention";
  EXPECT_THROW(run_bench(o), Error);
  o.recompute = "all";

  o.sp = 2;
  EXPECT_THROW(run_bench(o), Error);
  o.sp = 1;
  o.seq_lengths = {1};
  EXPECT_THROW(run_bench(o), Error);
}

}  // namespace
}  // namespace spindle::bench
