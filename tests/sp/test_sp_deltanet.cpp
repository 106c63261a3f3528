// A hybrid model (qwen3_5: gated DeltaNet, gated attention, gated DeltaNet) under sequence
// parallelism: each rank runs Decoder::step on its shard of a packed row with the mesh's strategies
// (Ulysses over the DeltaNet heads, the recurrent state passed from rank to rank, or both), the
// losses and gradients are summed over the sp group, and the result must equal Decoder::step on the
// whole row in one process (F64, LoRA and full training with a recomputed layer). The DeltaNet heads
// decay slowly, documents of several lengths cross rank boundaries (some shorter than the conv
// window, so a piece's halo spans several ranks), and recomputing every layer around its kept
// core gives the same bits as not recomputing. qwen3_5_moe (experts and a shared expert in every
// layer) runs the hybrid mesh of 4 ranks.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/op_test_util.h"
#include "comm/cpu_communicator.h"
#include "comm/multiprocess.h"
#include "model/decoder.h"
#include "parallel/sequence_shard.h"
#include "parallel/sp_attention.h"
#include "support/tiny_model.h"

namespace spindle::parallel {
namespace {

using spindle::test::relative_error;
using spindle::test::to_host;
using spindle::testing::expect_all_succeeded;
using spindle::testing::require;
using spindle::testing::run_ranks;

// tiny_qwen3_5 (DeltaNet 2 key heads and 4 value heads of 8, attention 4 query heads over 2 KV
// heads) with chunks of 4 tokens, so that chunks, pieces and rank boundaries all fall differently.
ModelConfig hybrid_model(bool moe = false) {
  ModelConfig c = (moe ? test::tiny_qwen3_5_moe() : test::tiny_qwen3_5()).config();
  c.linear_attention.chunk_size = 4;
  return c;
}

// exp(g) ≈ 0.9995 (A_log = −5, dt_bias = −3): a state lost or leaked at a rank boundary or a
// document start would show in every later token.
void slow_decay(Backend& be, ModelWeights& w) {
  for (Parameter& p : w.parameters()) {
    if (p.name.ends_with(".A_log")) be.fill(be.default_stream(), p.value, -5.0);
    if (p.name.ends_with(".dt_bias")) be.fill(be.default_stream(), p.value, -3.0);
  }
}

PackedRow packed_row(const std::vector<int>& lengths, int padding, uint64_t seed) {
  std::mt19937_64 rng(seed);
  PackedRow row;
  for (size_t d = 0; d < lengths.size(); ++d) {
    const size_t begin = row.input_ids.size();
    for (int i = 0; i < lengths[d]; ++i) {
      row.input_ids.push_back(static_cast<int32_t>(rng() % 64));
      row.positions.push_back(i);
      row.doc_ids.push_back(static_cast<int32_t>(d));
    }
    for (int i = 0; i < lengths[d]; ++i) {
      const bool supervised = i + 1 < lengths[d] && !(d == 0 && i < 2);  // a short prompt in document 0
      row.targets.push_back(supervised ? row.input_ids[begin + i + 1] : kIgnoreIndex);
      row.weights.push_back(supervised ? 0.5f + 0.25f * static_cast<float>(rng() % 5) : 0.0f);
    }
  }
  for (int i = 0; i < padding; ++i) {
    row.input_ids.push_back(0);
    row.positions.push_back(i);
    row.doc_ids.push_back(-1);
    row.targets.push_back(kIgnoreIndex);
    row.weights.push_back(0.0f);
  }
  return row;
}

std::vector<PackedRow> test_rows() {
  return {
      // Packed documents crossing rank boundaries under every layout, one of 5 tokens (cut into
      // pieces of one or two tokens by the zigzag of 4 ranks), a padding tail.
      packed_row({13, 5, 22, 2, 9}, 3, 17),
      // One long document: the state and the conv window travel through every rank.
      packed_row({37}, 0, 18),
  };
}

ModelWeights make_weights(Backend& be, const ModelConfig& model, bool lora) {
  ModelWeights w = test::random_weights(be, model, DType::F64, 11, 10.0);
  slow_decay(be, w);
  if (lora) test::add_lora_with_random_b(be, w, test::lora_on_every_projection(4, 8), 12, test::uniform_draw(0.2));
  else w.train_all(be);
  return w;
}

struct StepResult {
  double loss = 0;
  std::vector<std::vector<double>> grads;  // trainable parameters, in order
};

StepResult run_step(Backend& be, ModelWeights& w, Decoder& decoder, const MicroBatch& batch, double inv_n,
                    comm::Communicator* sp_group) {
  w.zero_grads(be);
  Tensor loss = be.zeros(Shape{1}, DType::F64);
  decoder.step(batch, inv_n, loss, true);
  std::vector<Parameter*> trainable;
  int64_t total = 1;
  for (Parameter& p : w.parameters())
    if (p.trainable) {
      trainable.push_back(&p);
      total += p.grad.numel();
    }
  Tensor all = be.empty(Shape{total}, DType::F64);
  Tensor loss_part = all.flat(0, 1);
  be.copy(be.default_stream(), loss, loss_part);
  int64_t offset = 1;
  for (Parameter* p : trainable) {
    Tensor part = all.flat(offset, p->grad.numel());
    be.copy(be.default_stream(), p->grad, part);
    offset += p->grad.numel();
  }
  if (sp_group) sp_group->all_reduce_sum(be.default_stream(), all);
  const std::vector<double> values = to_host(be, all);
  StepResult r;
  r.loss = values[0];
  offset = 1;
  for (Parameter* p : trainable) {
    r.grads.emplace_back(values.begin() + offset, values.begin() + offset + p->grad.numel());
    offset += p->grad.numel();
  }
  return r;
}

void expect_sharded_step_equals_whole_row(const MeshConfig& config, bool moe) {
  expect_all_succeeded(run_ranks(config.world_size(), [config, moe](const ProcessGroupInfo& info) {
    auto be = make_cpu_backend(1);
    auto world = comm::connect_cpu_world(info, comm::CommOptions{std::chrono::seconds(60)});
    Mesh mesh(config, *world);
    const ModelConfig model = hybrid_model(moe);
    auto strategy = make_sequence_parallel_attention(mesh, model);
    require(strategy->deltanet() != nullptr, "no gated DeltaNet strategy for --sp {}", config.sp);
    const std::vector<PackedRow> rows = test_rows();
    for (bool lora : {true, false}) {
      ModelWeights w = make_weights(*be, model, lora);
      DecoderOptions options;
      if (!lora) options.recompute = {true, false, false};  // layer 0 (DeltaNet) recomputed in backward
      Decoder decoder(*be, w, options);
      Decoder kept_decoder(*be, w, recompute_options(RecomputeMode::KeepAttention, w.config.num_layers));
      kept_decoder.set_attention(strategy.get());
      for (size_t which = 0; which < rows.size(); ++which) {
        const PackedRow& row = rows[which];
        const double inv_n = 1.0 / static_cast<double>(row.num_items());
        decoder.set_attention(nullptr);
        const StepResult want = run_step(*be, w, decoder, make_micro_batch(*be, {row}, DType::F64), inv_n, nullptr);

        const PackedRow shard = shard_row(row, config)[mesh.sp_rank()];
        decoder.set_attention(strategy.get());
        const StepResult got =
            run_step(*be, w, decoder, make_micro_batch(*be, {shard}, DType::F64), inv_n, &mesh.sp());

        const std::string what = fmt::format("rank {} {} row {}", info.rank, lora ? "LoRA" : "full", which);
        const double loss_error = std::fabs(got.loss - want.loss) / std::fabs(want.loss);
        require(loss_error <= 1e-12, "{}: loss {} vs {} (relative error {:.3g})", what, got.loss, want.loss,
                loss_error);
        double worst = 0;
        for (size_t i = 0; i < want.grads.size(); ++i) {
          const double error = relative_error(got.grads[i], want.grads[i]);
          worst = std::max(worst, error);
          require(error <= 1e-10, "{}: gradient {} relative error {:.3g}", what, i, error);
        }
        if (info.rank == 0) fmt::print("{}: loss error {:.2g}, worst gradient error {:.2g}\n", what, loss_error, worst);

        const StepResult kept =
            run_step(*be, w, kept_decoder, make_micro_batch(*be, {shard}, DType::F64), inv_n, &mesh.sp());
        require(kept.loss == got.loss, "{} keep-attention: loss {} vs {}", what, kept.loss, got.loss);
        for (size_t i = 0; i < got.grads.size(); ++i)
          require(kept.grads[i] == got.grads[i], "{} keep-attention: gradient {} differs (relative error {:.3g})", what,
                  i, relative_error(kept.grads[i], got.grads[i]));
      }
    }
  }));
}

class SpDeltaNet : public ::testing::TestWithParam<MeshConfig> {};

TEST_P(SpDeltaNet, ShardedStepEqualsTheWholeRowInOneProcess) {
  expect_sharded_step_equals_whole_row(GetParam(), false);
}

// qwen3_5_moe: the same layers with a mixture of experts and a shared expert in every layer (routing
// is per token, so only the DeltaNet and attention layers exchange anything).
TEST(SpDeltaNetMoe, HybridMeshOfFourRanks) { expect_sharded_step_equals_whole_row(MeshConfig{1, 4, 2, 2}, true); }

// u2: DeltaNet heads over Ulysses, the rule local. r2, r4: the state passed over the ring (zigzag
// shards: two pieces per document per rank). u2 × r2: Ulysses, then the state over the ring. u4:
// Ulysses 4 does not divide the 2 key heads, so the state passes over the whole sp group while
// attention splits its heads (KV heads replicated).
INSTANTIATE_TEST_SUITE_P(Meshes, SpDeltaNet,
                         ::testing::Values(MeshConfig{1, 2, 2, 1}, MeshConfig{1, 2, 1, 2}, MeshConfig{1, 4, 1, 4},
                                           MeshConfig{1, 4, 2, 2}, MeshConfig{1, 4, 4, 1}),
                         [](const auto& info) {
                           return fmt::format("u{}_r{}", info.param.ulysses, info.param.ring);
                         });

}  // namespace
}  // namespace spindle::parallel
