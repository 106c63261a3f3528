// Sequence-parallel attention on CPU processes against single-process attention: every rank
// shards one packed row, runs the strategy the mesh calls for (make_sequence_parallel_attention)
// on its shard, and compares out, lse, dq, dk, dv with LocalAttention over the whole sequence
// (all shards laid end to end, padding included) restricted to the rank's tokens.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/op_test_util.h"
#include "comm/cpu_communicator.h"
#include "comm/multiprocess.h"
#include "core/error.h"
#include "model/batch.h"
#include "parallel/sequence_shard.h"
#include "parallel/sp_attention.h"

namespace spindle::parallel {
namespace {

using spindle::test::from_host;
using spindle::test::to_host;
using spindle::testing::expect_all_succeeded;
using spindle::testing::require;
using spindle::testing::run_ranks;

struct Case {
  int ulysses, ring;
  int64_t q_heads, kv_heads;
  DType dtype;
  // The layer's attention spec: a sliding window (crossing shard and zigzag chunk boundaries of the
  // test row), a soft-cap, sinks.
  int64_t window = 0;
  double softcap = 0;
  bool sinks = false;
};

std::string case_name(const Case& c) {
  std::string name = fmt::format("u{}_r{}_hq{}_hkv{}_{}", c.ulysses, c.ring, c.q_heads, c.kv_heads,
                                 c.dtype == DType::F64 ? "f64" : "f32");
  if (c.window) name += fmt::format("_window{}", c.window);
  if (c.softcap) name += "_softcap";
  if (c.sinks) name += "_sinks";
  return name;
}

// Four packed documents (one of a single token, shorter than any ring) and a padding tail.
PackedRow test_row() {
  PackedRow row;
  const std::vector<int> lengths = {7, 1, 10, 4};
  for (size_t d = 0; d < lengths.size(); ++d)
    for (int i = 0; i < lengths[d]; ++i) {
      row.input_ids.push_back(static_cast<int32_t>(1 + (d * 13 + i * 7) % 29));
      row.positions.push_back(i);
      row.doc_ids.push_back(static_cast<int32_t>(d));
      row.targets.push_back(i + 1 < lengths[d] ? 5 : kIgnoreIndex);
      row.weights.push_back(i + 1 < lengths[d] ? 1.0f : 0.0f);
    }
  for (int i = 0; i < 3; ++i) {
    row.input_ids.push_back(0);
    row.positions.push_back(i);
    row.doc_ids.push_back(-1);
    row.targets.push_back(kIgnoreIndex);
    row.weights.push_back(0.0f);
  }
  return row;
}

// max |got − want| / max |want| over the finite entries; −inf entries must agree exactly.
double max_relative_error(const std::vector<double>& got, const std::vector<double>& want, const char* what) {
  require(got.size() == want.size(), "{}: {} values, want {}", what, got.size(), want.size());
  double diff = 0, scale = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (std::isinf(want[i]) || std::isinf(got[i])) {
      require(got[i] == want[i], "{}[{}] = {}, want {}", what, i, got[i], want[i]);
      continue;
    }
    require(!std::isnan(got[i]), "{}[{}] is NaN", what, i);
    diff = std::max(diff, std::fabs(got[i] - want[i]));
    scale = std::max(scale, std::fabs(want[i]));
  }
  return scale > 0 ? diff / scale : diff;
}

// Rows [begin, begin + n) of a host array of [rows, width] values.
std::vector<double> row_slice(const std::vector<double>& all, int64_t width, int64_t begin, int64_t n) {
  return std::vector<double>(all.begin() + begin * width, all.begin() + (begin + n) * width);
}
// Columns [begin, begin + n) of lse [H, T].
std::vector<double> lse_slice(const std::vector<double>& all, int64_t heads, int64_t tokens, int64_t begin, int64_t n) {
  std::vector<double> out;
  for (int64_t h = 0; h < heads; ++h)
    out.insert(out.end(), all.begin() + h * tokens + begin, all.begin() + h * tokens + begin + n);
  return out;
}

class SpAttention : public ::testing::TestWithParam<Case> {};

TEST_P(SpAttention, ShardResultsEqualSingleProcessAttention) {
  const Case c = GetParam();
  const MeshConfig config{1, c.ulysses * c.ring, c.ulysses, c.ring};
  expect_all_succeeded(run_ranks(config.world_size(), [c, config](const ProcessGroupInfo& info) {
    auto be = make_cpu_backend(1);
    Stream st = be->default_stream();
    auto world = comm::connect_cpu_world(info, comm::CommOptions{std::chrono::seconds(30)});
    Mesh mesh(config, *world);
    ModelConfig model;
    model.num_heads = c.q_heads;
    model.num_kv_heads = c.kv_heads;
    auto strategy = make_sequence_parallel_attention(mesh, model);

    const PackedRow row = test_row();
    const std::vector<PackedRow> shards = shard_row(row, config);
    const int64_t t = shards[0].length(), total = t * config.sp, d = 4;
    const int64_t hq = c.q_heads, hkv = c.kv_heads;
    PackedRow whole = concatenate_rows(shards);  // padding included, sp ranks in order
    // concatenate_rows renumbers documents per row; the whole sequence keeps the original ids.
    whole.doc_ids.clear();
    for (const PackedRow& s : shards) whole.doc_ids.insert(whole.doc_ids.end(), s.doc_ids.begin(), s.doc_ids.end());
    const MicroBatch full = make_micro_batch(*be, {whole}, c.dtype);
    const MicroBatch mine = make_micro_batch(*be, {shards[mesh.sp_rank()]}, c.dtype);

    // The same random inputs on every rank for the whole sequence; each rank takes its rows.
    std::mt19937_64 rng(99);
    auto random_values = [&](int64_t n) {
      std::uniform_real_distribution<double> dist(-1.5, 1.5);
      std::vector<double> v(n);
      for (double& x : v) x = dist(rng);
      return v;
    };
    const std::vector<double> q_all = random_values(total * hq * d), k_all = random_values(total * hkv * d),
                              v_all = random_values(total * hkv * d), dout_all = random_values(total * hq * d);
    auto upload = [&](const std::vector<double>& values, Shape shape) {
      Tensor tensor = be->empty(shape, c.dtype);
      from_host(*be, values, tensor);
      return tensor;
    };
    const DType stat = stat_dtype(c.dtype);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    // Sinks away from zero (some above the rows' logits, some below); each process adds the
    // gradient of its rows and heads, summed over the group as training sums gradients.
    const std::vector<double> sink_values = random_values(hq);
    Tensor sinks, sinks_grad, sinks_grad_local;
    if (c.sinks) {
      sinks = upload(sink_values, Shape{hq});
      sinks_grad = be->zeros(Shape{hq}, c.dtype);
      sinks_grad_local = be->zeros(Shape{hq}, c.dtype);
    }
    const AttentionLogits logits{scale, c.softcap, c.window};
    const AttentionCall forward_call{logits, sinks};
    const AttentionCall whole_call{logits, sinks, c.sinks ? &sinks_grad : nullptr};
    const AttentionCall shard_call{logits, sinks, c.sinks ? &sinks_grad_local : nullptr};

    // Reference: the whole sequence in one process.
    LocalAttention local;
    Tensor q = upload(q_all, Shape{total, hq, d}), k = upload(k_all, Shape{total, hkv, d}),
           v = upload(v_all, Shape{total, hkv, d}), dout = upload(dout_all, Shape{total, hq, d});
    Tensor out = be->empty(q.shape(), c.dtype), lse = be->empty(Shape{hq, total}, stat);
    local.forward(*be, st, full, q, k, v, forward_call, out, lse);
    Tensor dq = be->empty(q.shape(), c.dtype), dk = be->empty(k.shape(), c.dtype), dv = be->empty(v.shape(), c.dtype);
    local.backward(*be, st, full, q, k, v, out, dout, lse, whole_call, dq, dk, dv);

    // This rank's shard through the sequence-parallel strategy.
    const int64_t begin = mesh.sp_rank() * t;
    Tensor sq = upload(row_slice(q_all, hq * d, begin, t), Shape{t, hq, d});
    Tensor sk = upload(row_slice(k_all, hkv * d, begin, t), Shape{t, hkv, d});
    Tensor sv = upload(row_slice(v_all, hkv * d, begin, t), Shape{t, hkv, d});
    Tensor sdout = upload(row_slice(dout_all, hq * d, begin, t), Shape{t, hq, d});
    Tensor sout = be->empty(sq.shape(), c.dtype), slse = be->empty(Shape{hq, t}, stat);
    strategy->forward(*be, st, mine, sq, sk, sv, forward_call, sout, slse);
    Tensor sdq = be->empty(sq.shape(), c.dtype), sdk = be->empty(sk.shape(), c.dtype),
           sdv = be->empty(sv.shape(), c.dtype);
    strategy->backward(*be, st, mine, sq, sk, sv, sout, sdout, slse, shard_call, sdq, sdk, sdv);

    const double tolerance = c.dtype == DType::F64 ? 1e-12 : 1e-5;
    double worst = 0;
    auto check = [&](const char* what, const Tensor& got, const std::vector<double>& want) {
      const double error = max_relative_error(to_host(*be, got), want, what);
      worst = std::max(worst, error);
      require(error <= tolerance, "rank {}: {} relative error {:.3g} > {:.1g}", info.rank, what, error, tolerance);
    };
    check("out", sout, row_slice(to_host(*be, out), hq * d, begin, t));
    check("lse", slse, lse_slice(to_host(*be, lse), hq, total, begin, t));
    check("dq", sdq, row_slice(to_host(*be, dq), hq * d, begin, t));
    check("dk", sdk, row_slice(to_host(*be, dk), hkv * d, begin, t));
    check("dv", sdv, row_slice(to_host(*be, dv), hkv * d, begin, t));
    if (c.sinks) {
      world->all_reduce_sum(st, sinks_grad_local);
      check("dsinks", sinks_grad_local, to_host(*be, sinks_grad));
      require(max_relative_error(to_host(*be, sinks_grad), std::vector<double>(hq, 0.0), "dsinks") > 0,
              "the sinks' gradient is zero");
    }
    if (info.rank == 0) fmt::print("{}: worst relative error {:.2g}\n", case_name(c), worst);
  }));
}

INSTANTIATE_TEST_SUITE_P(
    Strategies, SpAttention,
    ::testing::Values(Case{2, 1, 4, 2, DType::F64}, Case{2, 1, 4, 1, DType::F32},   // Ulysses 2, KV split / replicated
                      Case{4, 1, 4, 2, DType::F64}, Case{4, 1, 8, 1, DType::F32},   // Ulysses 4, KV replicated
                      Case{4, 1, 4, 4, DType::F32},                                 // Ulysses 4, one KV head each
                      Case{1, 2, 4, 2, DType::F64}, Case{1, 2, 2, 2, DType::F32},   // ring 2
                      Case{1, 4, 4, 2, DType::F64}, Case{1, 4, 4, 1, DType::F32},   // ring 4
                      Case{2, 2, 4, 2, DType::F64}, Case{2, 2, 4, 1, DType::F32},   // hybrid 2×2
                      // The attention spec: windows of 3 and 5 keys (shorter than the documents of 7
                      // and 10 tokens), soft-cap, sinks, alone and together, on every strategy.
                      Case{2, 1, 4, 2, DType::F64, 3, 0, true}, Case{1, 2, 4, 2, DType::F64, 5, 0, false},
                      Case{1, 4, 4, 2, DType::F64, 3, 0.5, true}, Case{4, 1, 8, 1, DType::F64, 0, 0.7, true},
                      Case{2, 2, 4, 2, DType::F64, 3, 0.5, true}, Case{1, 4, 4, 1, DType::F32, 5, 0.5, true}),
    [](const auto& info) { return case_name(info.param); });

TEST(SpAttentionErrors, HeadsThatUlyssesCannotSplit) {
  const MeshConfig config{1, 2, 2, 1};
  expect_all_succeeded(run_ranks(2, [config](const ProcessGroupInfo& info) {
    auto world = comm::connect_cpu_world(info, comm::CommOptions{std::chrono::seconds(30)});
    Mesh mesh(config, *world);
    ModelConfig model;
    model.num_heads = 3;
    model.num_kv_heads = 3;
    std::string message = "no error";
    try {
      make_sequence_parallel_attention(mesh, model);
    } catch (const Error& e) {
      message = e.what();
    }
    require(message ==
                "Ulysses over 2 ranks (group 'world/ulysses') cannot split 3 query and 3 KV heads: --ulysses must "
                "divide the query heads and either divide the KV heads or be a multiple of them; choose another "
                "--ulysses (see docs/parallelism.md)",
            "got: {}", message);
  }));
}

}  // namespace
}  // namespace spindle::parallel
