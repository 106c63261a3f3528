// The preference step on real processes (Gloo): partial per-response sums added over the sequence
// group, step totals added over the data-parallel group. Each rank compares with the one-process
// step on the whole batch, which it computes itself first (gtest does not cross fork).
//  - "SP-style": each of 2 ranks supervises every other target of every response (as a sequence
//    shard would), so every response's log-probability is split across ranks;
//  - dp × sp = 2 × 2: data-parallel ranks hold different pairs (numbered independently), each
//    split across its SP pair of ranks as above.
#include <gtest/gtest.h>

#include <cmath>

#include "comm/cpu_communicator.h"
#include "comm/multiprocess.h"
#include "dpo/dpo_test_model.h"

using namespace spindle;
using namespace spindle::dpo_test;
using spindle::testing::require;

namespace {

struct Reference {
  double loss = 0;
  std::vector<std::vector<double>> grads;
};

Reference one_process(Backend& be, Decoder& decoder, ModelWeights& w, const std::vector<Document>& docs,
                      const PreferenceLossOptions& loss) {
  const auto batches = layout(be, docs, {{0, 3, 4}, {1, 2, 5}}, true, DType::F64);
  PreferenceStepOptions options;
  options.loss = loss;
  options.num_pairs = 3;
  w.zero_grads(be);
  Reference ref;
  ref.loss = preference_step(be, decoder, w, batches, ReferenceSource::adapter_disabled(), options).metrics.loss;
  for (Parameter& p : w.parameters())
    if (p.trainable) ref.grads.push_back(test::to_host(be, p.grad));
  return ref;
}

// Sums the rank's gradients over `world` and compares them (and the loss) with the reference.
void compare(Backend& be, comm::Communicator& world, ModelWeights& w, double loss, const Reference& ref) {
  require(std::fabs(loss - ref.loss) <= 1e-13, "rank {}: loss {} vs one process {}", world.rank(), loss, ref.loss);
  size_t t = 0;
  for (Parameter& p : w.parameters()) {
    if (!p.trainable) continue;
    world.all_reduce_sum(be.default_stream(), p.grad);
    const std::vector<double> got = test::to_host(be, p.grad);
    for (size_t i = 0; i < got.size(); ++i)
      require(std::fabs(got[i] - ref.grads[t][i]) <= 1e-12 + 1e-10 * std::fabs(ref.grads[t][i]),
              "rank {}: {}[{}] = {} vs one process {}", world.rank(), p.name, i, got[i], ref.grads[t][i]);
    ++t;
  }
}

// Keeps the targets at row positions i with i % parts == part: a rank's share of every response.
std::function<void(PackedRow&)> keep_share(int part, int parts) {
  return [=](PackedRow& row) {
    for (size_t i = 0; i < row.targets.size(); ++i)
      if (static_cast<int>(i % parts) != part) {
        row.targets[i] = kIgnoreIndex;
        row.weights[i] = 0.0f;
      }
  };
}

PreferenceLossOptions rpo_options() {
  PreferenceLossOptions o;
  o.beta = 0.6;
  o.label_smoothing = 0.1;
  o.rpo_alpha = 0.5;  // the chosen-token count must be reduced too
  return o;
}

}  // namespace

TEST(PreferenceStepRanks, ResponsesSplitAcrossTheSequenceGroup) {
  auto outcomes = spindle::testing::run_ranks(2, [](const ProcessGroupInfo& info) {
    auto world = comm::connect_cpu_world(info, comm::CommOptions{std::chrono::seconds(30)});
    auto be = make_cpu_backend(1);
    ModelWeights w = base_model(*be, DType::F64);
    add_adapters(*be, w, false);
    Decoder decoder(*be, w);
    const auto docs = pair_documents();
    for (PreferenceLossType type : {PreferenceLossType::kSigmoid, PreferenceLossType::kIpo}) {
      PreferenceLossOptions loss = rpo_options();
      if (type == PreferenceLossType::kIpo) loss = {type, 0.3, 0.0, 0.0};
      const Reference ref = one_process(*be, decoder, w, docs, loss);
      // Same micro-batches on both ranks, each supervising half of every response's targets.
      const auto batches = layout(*be, docs, {{0, 3, 4}, {1, 2, 5}}, true, DType::F64, keep_share(world->rank(), 2));
      PreferenceStepOptions options;
      options.loss = loss;
      options.num_pairs = 3;
      options.sequence_group = world.get();
      w.zero_grads(*be);
      const PreferenceStepResult r =
          preference_step(*be, decoder, w, batches, ReferenceSource::adapter_disabled(), options);
      compare(*be, *world, w, r.metrics.loss, ref);
    }
  });
  spindle::testing::expect_all_succeeded(outcomes);
}

TEST(PreferenceStepRanks, DataParallelTimesSequenceParallel) {
  auto outcomes = spindle::testing::run_ranks(4, [](const ProcessGroupInfo& info) {
    auto world = comm::connect_cpu_world(info, comm::CommOptions{std::chrono::seconds(30)});
    const int dp_rank = world->rank() / 2, sp_rank = world->rank() % 2;
    auto sp = world->split(dp_rank, sp_rank, "sp");
    auto dp = world->split(sp_rank, dp_rank, "dp");
    auto be = make_cpu_backend(1);
    ModelWeights w = base_model(*be, DType::F64);
    add_adapters(*be, w, false);
    Decoder decoder(*be, w);
    const auto docs = pair_documents();
    const PreferenceLossOptions loss = rpo_options();
    const Reference ref = one_process(*be, decoder, w, docs, loss);
    // DP rank 0 holds pairs 0 and 1, DP rank 1 pair 2, each numbered from 0 in its own step.
    std::vector<Document> mine;
    if (dp_rank == 0) mine.assign(docs.begin(), docs.begin() + 4);
    else mine.assign(docs.begin() + 4, docs.end());
    const auto batches = dp_rank == 0 ? layout(*be, mine, {{0, 3}, {1, 2}}, true, DType::F64, keep_share(sp_rank, 2))
                                      : layout(*be, mine, {{1}, {0}}, true, DType::F64, keep_share(sp_rank, 2));
    PreferenceStepOptions options;
    options.loss = loss;
    options.num_pairs = dp_rank == 0 ? 2 : 1;
    options.sequence_group = sp.get();
    options.pair_group = dp.get();
    w.zero_grads(*be);
    const PreferenceStepResult r = preference_step(*be, decoder, w, batches, ReferenceSource::adapter_disabled(), options);
    require(r.metrics.pairs == 3, "rank {}: {} pairs in the step metrics, want 3", world->rank(), r.metrics.pairs);
    compare(*be, *world, w, r.metrics.loss, ref);
  });
  spindle::testing::expect_all_succeeded(outcomes);
}
