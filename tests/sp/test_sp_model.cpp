// The whole decoder under sequence parallelism (docs/design.md §2.1, §2.2, §2.5): each rank runs
// Decoder::step on its shard of a packed row with the mesh's attention strategy and the global
// denominator, the losses and gradients are summed over the sp group, and the result must equal
// Decoder::step on the whole row in one process (F32, LoRA and full training with a recomputed layer);
// recomputing every layer around its kept attention output gives the same bits as not recomputing.
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

using spindle::test::from_host;
using spindle::test::relative_error;
using spindle::test::to_host;
using spindle::testing::expect_all_succeeded;
using spindle::testing::require;
using spindle::testing::run_ranks;

ModelConfig tiny_gqa() { return test::TinyModel{.rope_theta = 1000.0}.config(); }

// Documents of the given lengths, targets the next token of the same document with varied loss
// weights; `supervised(doc, i)` says which targets count.
template <typename Supervised>
PackedRow packed_row(const std::vector<int>& lengths, int padding, Supervised supervised) {
  std::mt19937_64 rng(17);
  PackedRow row;
  for (size_t d = 0; d < lengths.size(); ++d) {
    const size_t begin = row.input_ids.size();
    for (int i = 0; i < lengths[d]; ++i) {
      row.input_ids.push_back(static_cast<int32_t>(rng() % 64));
      row.positions.push_back(i);
      row.doc_ids.push_back(static_cast<int32_t>(d));
    }
    for (int i = 0; i < lengths[d]; ++i) {
      const bool s = i + 1 < lengths[d] && supervised(static_cast<int>(d), i);
      row.targets.push_back(s ? row.input_ids[begin + i + 1] : kIgnoreIndex);
      row.weights.push_back(s ? 0.5f + 0.25f * static_cast<float>(rng() % 5) : 0.0f);
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
      // Packed documents (one of a single token), a few prompt tokens unsupervised, padding tail.
      packed_row({9, 1, 14, 6}, 2, [](int doc, int i) { return !(doc == 2 && i < 3); }),
      // Only the first two tokens of the first document are supervised: under every layout of
      // these tests they land on sp rank 0, the other ranks have nothing to score.
      packed_row({16, 8}, 0, [](int doc, int i) { return doc == 0 && i < 2; }),
  };
}

// Weights of one training mode, identical on every rank (fixed seeds).
ModelWeights make_weights(Backend& be, bool lora) {
  ModelWeights w = test::random_weights(be, tiny_gqa(), DType::F32, 11, 10.0);
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
  Tensor loss = be.zeros(Shape{1}, DType::F32);
  decoder.step(batch, inv_n, loss, true);
  // The loss and every gradient in one buffer, summed over the group in one call (fewer
  // round trips keep the test fast on a loaded machine).
  std::vector<Parameter*> trainable;
  int64_t total = 1;
  for (Parameter& p : w.parameters())
    if (p.trainable) {
      trainable.push_back(&p);
      total += p.grad.numel();
    }
  Tensor all = be.empty(Shape{total}, DType::F32);
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

class SpModel : public ::testing::TestWithParam<MeshConfig> {};

TEST_P(SpModel, ShardedStepEqualsTheWholeRowInOneProcess) {
  const MeshConfig config = GetParam();
  expect_all_succeeded(run_ranks(config.world_size(), [config](const ProcessGroupInfo& info) {
    auto be = make_cpu_backend(1);
    auto world = comm::connect_cpu_world(info, comm::CommOptions{std::chrono::seconds(30)});
    Mesh mesh(config, *world);
    auto strategy = make_sequence_parallel_attention(mesh, tiny_gqa());
    const std::vector<PackedRow> rows = test_rows();
    for (bool lora : {true, false}) {
      ModelWeights w = make_weights(*be, lora);
      // Full training also recomputes layer 0 in backward: the strategies keep no state between calls.
      DecoderOptions options;
      if (!lora) options.recompute = {true, false};
      Decoder decoder(*be, w, options);
      // Every layer recomputed around its kept attention output: the strategy's forward runs once
      // per layer, its backward reads the kept out/lse; bit-identical to the decoder above.
      Decoder kept_decoder(*be, w, recompute_options(RecomputeMode::KeepAttention, w.config.num_layers));
      kept_decoder.set_attention(strategy.get());
      for (size_t which = 0; which < rows.size(); ++which) {
        const PackedRow& row = rows[which];
        const double inv_n = 1.0 / static_cast<double>(row.num_items());
        decoder.set_attention(nullptr);
        const StepResult want = run_step(*be, w, decoder, make_micro_batch(*be, {row}, DType::F32), inv_n, nullptr);

        const PackedRow shard = shard_row(row, config)[mesh.sp_rank()];
        if (which == 1) require((shard.num_items() > 0) == (mesh.sp_rank() == 0), "row 1 is meant to be supervised on sp rank 0 only");
        decoder.set_attention(strategy.get());
        const StepResult got =
            run_step(*be, w, decoder, make_micro_batch(*be, {shard}, DType::F32), inv_n, &mesh.sp());

        const std::string what = fmt::format("rank {} {} row {}", info.rank, lora ? "LoRA" : "full", which);
        const double loss_error = std::fabs(got.loss - want.loss) / std::fabs(want.loss);
        require(loss_error <= 1e-6, "{}: loss {} vs {} (relative error {:.3g})", what, got.loss, want.loss, loss_error);
        double worst = 0;
        for (size_t i = 0; i < want.grads.size(); ++i) {
          const double error = relative_error(got.grads[i], want.grads[i]);
          worst = std::max(worst, error);
          require(error <= 1e-5, "{}: gradient {} relative error {:.3g}", what, i, error);
        }
        if (info.rank == 0) fmt::print("{}: loss error {:.2g}, worst gradient error {:.2g}\n", what, loss_error, worst);

        const StepResult kept =
            run_step(*be, w, kept_decoder, make_micro_batch(*be, {shard}, DType::F32), inv_n, &mesh.sp());
        require(kept.loss == got.loss, "{} keep-attention: loss {} vs {}", what, kept.loss, got.loss);
        for (size_t i = 0; i < got.grads.size(); ++i)
          require(kept.grads[i] == got.grads[i], "{} keep-attention: gradient {} differs (relative error {:.3g})", what,
                  i, relative_error(kept.grads[i], got.grads[i]));
      }
    }
  }));
}

INSTANTIATE_TEST_SUITE_P(Meshes, SpModel,
                         ::testing::Values(MeshConfig{1, 2, 2, 1}, MeshConfig{1, 4, 4, 1}, MeshConfig{1, 2, 1, 2},
                                           MeshConfig{1, 4, 1, 4}, MeshConfig{1, 4, 2, 2}),
                         [](const auto& info) {
                           return fmt::format("u{}_r{}", info.param.ulysses, info.param.ring);
                         });

}  // namespace
}  // namespace spindle::parallel
