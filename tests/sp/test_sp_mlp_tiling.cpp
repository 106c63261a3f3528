// Token-tiled SwiGLU MLPs (DecoderOptions::mlp_tile_tokens) under sequence parallelism: each rank
// tiles the MLP over its own shard, so a sharded step with tiles, its losses and gradients summed
// over the sp group, must equal the untiled step on the whole row in one process (F64, within
// 1e-12 relative; LoRA and full, recompute all, on 2-rank Ulysses and ring meshes).
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

ModelConfig tiny_gqa() { return test::TinyModel{.intermediate_size = 80, .rope_theta = 1000.0}.config(); }

// Packed documents of 13, 1, 20 and 9 tokens and a padding tail of 5: 48 tokens, 24 per rank, so
// the last 5-token tile of every rank is short.
PackedRow packed_row() {
  std::mt19937_64 rng(17);
  PackedRow row;
  for (int n : {13, 1, 20, 9}) {
    const size_t begin = row.input_ids.size();
    for (int i = 0; i < n; ++i) {
      row.input_ids.push_back(static_cast<int32_t>(rng() % 64));
      row.positions.push_back(i);
      row.doc_ids.push_back(static_cast<int32_t>(row.doc_ids.empty() ? 0 : row.doc_ids.back() + (i == 0)));
    }
    for (int i = 0; i < n; ++i) {
      const bool supervised = i + 1 < n && i >= 1;
      row.targets.push_back(supervised ? row.input_ids[begin + i + 1] : kIgnoreIndex);
      row.weights.push_back(supervised ? 0.5f + 0.25f * static_cast<float>(rng() % 5) : 0.0f);
    }
  }
  for (int i = 0; i < 5; ++i) {
    row.input_ids.push_back(0);
    row.positions.push_back(i);
    row.doc_ids.push_back(-1);
    row.targets.push_back(kIgnoreIndex);
    row.weights.push_back(0.0f);
  }
  return row;
}

struct StepResult {
  double loss = 0;
  std::vector<std::vector<double>> grads;  // trainable parameters, in order
};

// One step; with a group, the loss and every gradient summed over it.
StepResult run_step(Backend& be, ModelWeights& w, Decoder& decoder, const MicroBatch& batch, double inv_n,
                    comm::Communicator* group) {
  w.zero_grads(be);
  Tensor loss = be.zeros(Shape{1}, DType::F64);
  decoder.step(batch, inv_n, loss, true);
  if (group) group->all_reduce_sum(be.default_stream(), loss);
  StepResult r;
  r.loss = to_host(be, loss)[0];
  for (Parameter& p : w.parameters())
    if (p.trainable) {
      if (group) group->all_reduce_sum(be.default_stream(), p.grad);
      r.grads.push_back(to_host(be, p.grad));
    }
  return r;
}

class SpMlpTiling : public ::testing::TestWithParam<MeshConfig> {};

TEST_P(SpMlpTiling, TiledShardsEqualTheUntiledWholeRow) {
  const MeshConfig config = GetParam();
  expect_all_succeeded(run_ranks(config.world_size(), [config](const ProcessGroupInfo& info) {
    auto be = make_cpu_backend(1);
    auto world = comm::connect_cpu_world(info, comm::CommOptions{std::chrono::seconds(30)});
    Mesh mesh(config, *world);
    auto strategy = make_sequence_parallel_attention(mesh, tiny_gqa());
    const PackedRow row = packed_row();
    const double inv_n = 1.0 / static_cast<double>(row.num_items());
    for (bool lora : {true, false}) {
      ModelWeights w = test::random_weights(*be, tiny_gqa(), DType::F64, 11, 10.0);
      if (lora) test::add_lora_with_random_b(*be, w, test::lora_on_every_projection(4, 8), 12, test::uniform_draw(0.2));
      else w.train_all(*be);
      const DecoderOptions plain = recompute_options(RecomputeMode::All, w.config.num_layers);
      Decoder whole(*be, w, plain);
      const StepResult want = run_step(*be, w, whole, make_micro_batch(*be, {row}, DType::F64), inv_n, nullptr);

      DecoderOptions tiles = plain;
      tiles.mlp_tile_tokens = 5;
      Decoder sharded(*be, w, tiles);
      sharded.set_attention(strategy.get());
      const PackedRow shard = shard_row(row, config)[mesh.sp_rank()];
      const StepResult got =
          run_step(*be, w, sharded, make_micro_batch(*be, {shard}, DType::F64), inv_n, &mesh.sp());

      const std::string what = fmt::format("rank {} {}", info.rank, lora ? "LoRA" : "full");
      const double loss_error = std::fabs(got.loss - want.loss) / std::fabs(want.loss);
      require(loss_error <= 1e-12, "{}: loss {} vs {} (relative error {:.3g})", what, got.loss, want.loss, loss_error);
      double mass = 0;
      for (size_t i = 0; i < want.grads.size(); ++i) {
        for (double x : want.grads[i]) mass += std::fabs(x);
        const double error = relative_error(got.grads[i], want.grads[i]);
        require(error <= 1e-12, "{}: gradient {} relative error {:.3g}", what, i, error);
      }
      require(mass > 0, "{}: no gradient, the comparison would prove nothing", what);
    }
  }));
}

INSTANTIATE_TEST_SUITE_P(Meshes, SpMlpTiling, ::testing::Values(MeshConfig{1, 2, 2, 1}, MeshConfig{1, 2, 1, 2}),
                         [](const auto& info) { return fmt::format("u{}_r{}", info.param.ulysses, info.param.ring); });

}  // namespace
}  // namespace spindle::parallel
