// The step-time model (plan/step_cost.h) and `--recompute auto`'s ranking by it
// (plan/auto_recompute.h): each op at the rate of its kind, attention over the pairs its mask shows,
// a candidate's time assembled from per-layer times equal to the plan of that candidate as a whole,
// and the choice following the device's rates rather than the amount recomputed.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

#include "plan/auto_recompute.h"
#include "plan/dry_backend.h"
#include "plan/plan.h"
#include "plan/step_cost.h"
#include "support/tiny_model.h"

namespace spindle::plan {
namespace {

namespace fs = std::filesystem;
using bench::OpCategory;

DeviceRates round_rates() {
  DeviceRates r;
  r.kind = "test";
  r.gemm_flops = 1e12;
  r.attention_forward_flops = 0.5e12;
  r.attention_backward_flops = 0.25e12;
  r.grouped_gemm_flops = 0.8e12;
  r.delta_rule_flops = 0.1e12;
  r.memory_bytes_per_s = 1e9;
  r.op_seconds = 1e-6;
  r.host_copy_bytes_per_s = 1e8;
  return r;
}

TEST(StepCostModel, EachOpCostsItsRooflineAtTheRateOfItsKind) {
  const StepCostModel m(round_rates(), 1);
  // A GEMM with few bytes per FLOP is bound by the matrix rate, one with many (LoRA's thin
  // products) by the bandwidth.
  EXPECT_DOUBLE_EQ(m.op_seconds(OpCategory::Gemm, "gemm 4096x4096x4096 NT", 2e12, 1e8), 2.0);
  EXPECT_DOUBLE_EQ(m.op_seconds(OpCategory::Gemm, "gemm 32768x16x1536 NT", 1e9, 1e9), 1.0);
  EXPECT_DOUBLE_EQ(m.op_seconds(OpCategory::Gemm, "moe_grouped_gemm 131072x512x2048", 1.6e12, 1e6), 2.0);
  EXPECT_DOUBLE_EQ(m.op_seconds(OpCategory::Attention, "attention_forward", 1e12, 1e6), 2.0);
  EXPECT_DOUBLE_EQ(m.op_seconds(OpCategory::Attention, "attention_backward", 1e12, 1e6), 4.0);
  EXPECT_DOUBLE_EQ(m.op_seconds(OpCategory::Attention, "gated_delta_rule_backward_states", 1e11, 1e6), 1.0);
  // Everything else moves bytes.
  EXPECT_DOUBLE_EQ(m.op_seconds(OpCategory::OtherOps, "rmsnorm_forward", 0, 3e9), 3.0);
}

TEST(StepCostModel, ChargesEachOpToTheWindowItRunsIn) {
  StepCostModel m(round_rates(), 2);
  const Stream s{};
  m.begin(s, OpCategory::OtherOps, "embedding_forward", 0, 1e9);  // outside: 1 s + 1 us
  m.set_unit(1, false);
  m.begin(s, OpCategory::Gemm, "gemm", 3e12, 0);
  m.set_unit(1, true);
  m.begin(s, OpCategory::Attention, "attention_backward", 0.5e12, 0);
  m.set_unit(7, true);  // not a layer of this model: outside
  m.begin(s, OpCategory::OtherOps, "cross_entropy", 0, 2e9);
  m.begin(s, OpCategory::Communication, "sp all_to_all", 0, 1e12);  // not modelled
  const StepTime& t = m.time();
  EXPECT_EQ(t.ops, 4);
  EXPECT_DOUBLE_EQ(t.outside_layers_s, 3.0 + 2e-6);
  EXPECT_DOUBLE_EQ(t.layer_forward_s[0], 0.0);
  EXPECT_DOUBLE_EQ(t.layer_forward_s[1], 3.0 + 1e-6);
  EXPECT_DOUBLE_EQ(t.layer_backward_s[1], 2.0 + 1e-6);
  EXPECT_DOUBLE_EQ(t.gemm_s, 3.0);
  EXPECT_DOUBLE_EQ(t.attention_s, 2.0);
  EXPECT_DOUBLE_EQ(t.memory_s, 3.0);
  EXPECT_DOUBLE_EQ(t.total_s(), 8.0 + 4e-6);
}

TEST(StepCostModel, CountsTheAttentionPairsOfPackedDocuments) {
  DryBackend dry(Device{DeviceKind::CUDA, 0}, 512);
  StepCostModel m(round_rates(), 1);
  auto ids = [&](const std::vector<int32_t>& values) {
    Tensor t = dry.empty(Shape{static_cast<int64_t>(values.size())}, DType::I32);
    dry.copy_from_host(dry.default_stream(), values.data(), t);
    return t;
  };
  // Documents of 3 and 2 tokens and a padding token (its own document): 6 + 3 + 1 visible pairs;
  // with a window of 2 keys, 5 + 3 + 1.
  AttentionMask packed;
  packed.q_doc = packed.k_doc = ids({0, 0, 0, 1, 1, -1});
  packed.q_pos = packed.k_pos = ids({0, 1, 2, 0, 1, 0});
  EXPECT_DOUBLE_EQ(m.attention_pairs(packed, 0, 6, 6), 10.0);
  EXPECT_DOUBLE_EQ(m.attention_pairs(packed, 2, 6, 6), 9.0);
  // A ring block: the queries of the second half against the keys of the first, one document.
  AttentionMask block;
  block.q_doc = ids({0, 0});
  block.q_pos = ids({2, 3});
  block.k_doc = ids({0, 0});
  block.k_pos = ids({0, 1});
  EXPECT_DOUBLE_EQ(m.attention_pairs(block, 0, 2, 2), 4.0);
  EXPECT_DOUBLE_EQ(m.attention_pairs(block, 3, 2, 2), 3.0);  // query 2 sees keys 0 and 1, query 3 key 1
  AttentionMask causal;
  causal.plain_causal = true;
  EXPECT_DOUBLE_EQ(m.attention_pairs(causal, 0, 1000, 1000), 1000.0 * 1001 / 2);
  EXPECT_DOUBLE_EQ(m.attention_pairs(causal, 100, 1000, 1000), 100.0 * 101 / 2 + 900.0 * 100);
  // Ids the plan never wrote (not read back): half of all pairs.
  AttentionMask unread;
  unread.q_doc = unread.k_doc = dry.empty(Shape{10}, DType::I32);
  unread.q_pos = unread.k_pos = dry.empty(Shape{10}, DType::I32);
  EXPECT_DOUBLE_EQ(m.attention_pairs(unread, 0, 10, 10), 50.0);
}

TEST(DeviceRates, KnownKindsByDeviceName) {
  EXPECT_EQ(device_kind_of("NVIDIA H100 80GB HBM3"), "h100");
  EXPECT_EQ(device_kind_of("NVIDIA H200"), "h200");
  EXPECT_EQ(device_kind_of("NVIDIA H100 PCIe"), "");
  EXPECT_EQ(device_kind_of("NVIDIA H100 NVL"), "");
  EXPECT_EQ(device_kind_of("NVIDIA A100-SXM4-80GB"), "");
  EXPECT_EQ(device_rates("h100").kind, "h100");
  EXPECT_THROW(device_rates("a100"), Error);
}

TEST(DeviceRates, AnUnknownGpuIsScaledFromTheH100ByItsPeaks) {
  // An A100 SXM: 108 SMs at 1.41 GHz, 2048 BF16 FLOPs per clock and SM; 2.04 TB/s.
  GpuProperties a100{"NVIDIA A100-SXM4-80GB", 80, 108, 1.41e9, 2.039e12};
  const DeviceRates h100 = device_rates("h100"), r = estimated_rates(a100);
  const double compute = 108 * 1.41e9 * 2048 / (132 * 1.98e9 * 4096);
  EXPECT_NEAR(r.gemm_flops / h100.gemm_flops, compute, 1e-12);
  EXPECT_NEAR(r.attention_backward_flops / h100.attention_backward_flops, compute, 1e-12);
  EXPECT_NEAR(r.memory_bytes_per_s / h100.memory_bytes_per_s, 2.039e12 / 3.35e12, 1e-12);
  EXPECT_EQ(r.kind, "estimated: NVIDIA A100-SXM4-80GB");
}

// A plan's options for a tiny model folder written to a temporary directory.
class RankTest : public ::testing::Test {
 protected:
  void write(const test::TinyModel& model) {
    dir_ = fs::temp_directory_path() / fs::path("spindle_step_cost_" + std::to_string(::getpid()) + "_" +
                                                ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
    std::ofstream(dir_ / "config.json") << model.config_json().dump();
    base_.model = (dir_ / "config.json").string();
    base_.device = "cuda";
    base_.optimizer = false;
    base_.rates = round_rates();
  }
  void TearDown() override {
    std::error_code ec;
    if (!dir_.empty()) fs::remove_all(dir_, ec);
  }
  double planned_seconds(const RecomputeSetting& s, int64_t seq) const {
    PlanOptions o = base_;
    o.recompute = s.recompute;
    o.recompute_layers = s.recompute_layers;
    o.mlp_tile_tokens = s.mlp_tile_tokens;
    o.checkpoint_stride = s.checkpoint_stride;
    o.seq_lengths = {seq};
    return run_plan(o).lengths.at(0).slowest().time.total_s();
  }
  fs::path dir_;
  PlanOptions base_;
};

// Every candidate without offload is ranked at the time the plan of that very setting predicts,
// though the ranking plans only each mode on every layer: per-layer times add up exactly, on a
// dense model and on a hybrid one whose layers differ (gated DeltaNet and attention).
TEST_F(RankTest, CandidateTimesEqualThePlansOfTheWholeSetting) {
  for (const test::TinyModel& model : {test::TinyModel{}, test::tiny_qwen3_5()}) {
    test::TinyModel m = model;
    m.num_layers = std::max<int64_t>(m.num_layers, 3);
    write(m);
    const int64_t seq = 256;
    int checked = 0;
    for (const RankedSetting& c : rank_recompute_settings(base_, seq, false)) {
      if (c.setting.offload) continue;
      const double planned = planned_seconds(c.setting, seq);
      EXPECT_NEAR(c.seconds, planned, 1e-12 * planned) << m.model_type << ": " << c.setting.describe();
      ++checked;
    }
    EXPECT_GT(checked, 2 * m.num_layers);
  }
}

TEST_F(RankTest, FastestPredictedFirstWithinEachGroup) {
  test::TinyModel m;
  m.num_layers = 4;
  write(m);
  base_.rates->host_copy_bytes_per_s = 1e3;  // slower than any layer's compute
  const std::vector<RankedSetting> ranked = rank_recompute_settings(base_, 512, false);
  ASSERT_FALSE(ranked.empty());
  EXPECT_EQ(ranked.front().setting.recompute, "none");
  for (size_t i = 1; i < ranked.size(); ++i) {
    const RecomputeSetting &a = ranked[i - 1].setting, &b = ranked[i].setting;
    if (a.checkpoint_stride != b.checkpoint_stride || a.mlp_tile_tokens != b.mlp_tile_tokens) continue;
    EXPECT_LE(ranked[i - 1].seconds, ranked[i].seconds) << a.describe() << " before " << b.describe();
  }
  // Offload's copies that cannot hide cost time: at this copy rate (100 MB/s) more than nothing.
  for (const RankedSetting& c : ranked)
    if (c.setting.offload && c.setting.checkpoint_stride == 1) {
      RecomputeSetting kept = c.setting;
      kept.offload = false;
      kept.offload_layers = -1;
      EXPECT_GT(c.seconds, planned_seconds(kept, 512)) << c.setting.describe();
    }
}

// The same memory, two devices: where attention is slow, recomputing it (all) costs more than
// recomputing the projections of a few more layers (keep-attention); where projections are slow,
// all on fewer layers wins. Ranking by the amount recomputed could not tell the two apart.
TEST_F(RankTest, TheChoiceFollowsTheDevicesRates) {
  test::TinyModel m;
  m.num_layers = 6;
  m.hidden_size = 32;
  m.intermediate_size = 48;
  m.num_heads = 8;
  m.num_kv_heads = 8;
  m.head_dim = 16;
  write(m);
  base_.device = "cpu";        // no CUDA margin: the budget is what the plan counts
  base_.host_memory_bytes = 4;  // no room for offload
  const int64_t seq = 512;
  auto peak = [&](const std::string& mode, int64_t n) {
    PlanOptions o = base_;
    o.seq_lengths = {seq};
    o.recompute = mode;
    o.recompute_layers = n;
    return run_plan(o).lengths[0].largest().peak_allocated_bytes;
  };
  // A budget that all on n layers fits and keep-attention needs more layers for.
  int64_t n = 1, budget = 0;
  for (; n < m.num_layers && budget == 0; ++n)
    if (peak("keep-attention", n) > peak("all", n)) budget = peak("all", n);
  ASSERT_GT(budget, 0);
  ASSERT_GT(peak("none", -1), budget);

  DeviceRates slow_attention = round_rates(), slow_projections = round_rates();
  slow_attention.attention_forward_flops = slow_attention.attention_backward_flops = 1e6;
  slow_projections.gemm_flops = 1e6;
  base_.rates = slow_attention;
  const AutoChoice a = choose_recompute(base_, seq, budget);
  base_.rates = slow_projections;
  const AutoChoice b = choose_recompute(base_, seq, budget);
  EXPECT_EQ(a.setting.recompute, "keep-attention") << a.setting.describe();
  EXPECT_EQ(b.setting.recompute, "all") << b.setting.describe();
  EXPECT_LE(a.peak_bytes, budget);
  EXPECT_LE(b.peak_bytes, budget);
  EXPECT_FALSE(a.setting.offload || b.setting.offload);
  EXPECT_EQ(a.device_kind, "test");
  EXPECT_GT(a.predicted_step_s, 0);
}

}  // namespace
}  // namespace spindle::plan
