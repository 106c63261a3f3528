// Splitting a packed row over the sp ranks: explicit small layouts worked out by hand, then the
// invariants (every token exactly once with its own data, equal shard lengths, the item count,
// the zigzag chunk rule, the causal balance of the ring) over many meshes and rows.
#include <gtest/gtest.h>

#include <map>
#include <random>

#include "core/error.h"
#include "parallel/sequence_shard.h"

namespace spindle::parallel {
namespace {

MeshConfig mesh(int ulysses, int ring) { return MeshConfig{1, ulysses * ring, ulysses, ring}; }

// Documents of the given lengths, then `padding` padding tokens. Targets are the next token of the
// same document (the last token of each document ignored), the first token also ignored (a prompt)
// when the document has more than two tokens; weights vary.
PackedRow make_row(const std::vector<int>& doc_lengths, int padding, uint64_t seed = 1) {
  std::mt19937_64 rng(seed);
  PackedRow row;
  for (size_t d = 0; d < doc_lengths.size(); ++d) {
    const int n = doc_lengths[d];
    const size_t begin = row.input_ids.size();
    for (int i = 0; i < n; ++i) {
      row.input_ids.push_back(static_cast<int32_t>(1 + rng() % 50));
      row.positions.push_back(i);
      row.doc_ids.push_back(static_cast<int32_t>(d));
    }
    for (int i = 0; i < n; ++i) {
      const bool supervised = i + 1 < n && !(i == 0 && n > 2);
      row.targets.push_back(supervised ? row.input_ids[begin + i + 1] : kIgnoreIndex);
      row.weights.push_back(supervised ? 0.5f + static_cast<float>(rng() % 4) : 0.0f);
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

std::vector<int64_t> sources(const ShardPlan& plan, int sp_rank) { return plan.source[sp_rank]; }

TEST(SequenceShardLayout, ContiguousPadsTheRowTail) {
  PackedRow row = make_row({6}, 0);
  ShardPlan plan = plan_shards(row.doc_ids, mesh(4, 1));
  EXPECT_EQ(plan.shard_length, 2);
  EXPECT_EQ(sources(plan, 0), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(sources(plan, 1), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(sources(plan, 2), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(sources(plan, 3), (std::vector<int64_t>{-1, -1}));
  std::vector<PackedRow> shards = shard_row(row, mesh(4, 1));
  EXPECT_EQ(shards[3].doc_ids, (std::vector<int32_t>{-1, -1}));
  EXPECT_EQ(shards[3].positions, (std::vector<int32_t>{0, 1}));
  EXPECT_EQ(shards[3].targets, (std::vector<int32_t>{kIgnoreIndex, kIgnoreIndex}));
}

TEST(SequenceShardLayout, ZigzagKeepsChunksRAndTwoRMinusOneMinusR) {
  // One document of 8 over a ring of 2: chunks of 2, rank 0 keeps chunks 0 and 3, rank 1 chunks 1 and 2.
  ShardPlan plan = plan_shards(make_row({8}, 0).doc_ids, mesh(1, 2));
  EXPECT_EQ(sources(plan, 0), (std::vector<int64_t>{0, 1, 6, 7}));
  EXPECT_EQ(sources(plan, 1), (std::vector<int64_t>{2, 3, 4, 5}));
  // Documents of 3 and 5: padded to 4 (chunks of 1) and 8 (chunks of 2), each zigzagged on its own.
  plan = plan_shards(make_row({3, 5}, 0).doc_ids, mesh(1, 2));
  EXPECT_EQ(sources(plan, 0), (std::vector<int64_t>{0, -1, 3, 4, -1, -1}));
  EXPECT_EQ(sources(plan, 1), (std::vector<int64_t>{1, 2, 5, 6, 7, -1}));
  EXPECT_EQ(plan.pad_position[0][1], 3);  // the padding continues its segment
}

TEST(SequenceShardLayout, HybridCutsEachRingShardOverUlysses) {
  // Ring shards {0,1,6,7} and {2,3,4,5}; sp rank = ring·ulysses + ulysses index.
  ShardPlan plan = plan_shards(make_row({8}, 0).doc_ids, mesh(2, 2));
  EXPECT_EQ(sources(plan, 0), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(sources(plan, 1), (std::vector<int64_t>{6, 7}));
  EXPECT_EQ(sources(plan, 2), (std::vector<int64_t>{2, 3}));
  EXPECT_EQ(sources(plan, 3), (std::vector<int64_t>{4, 5}));
  // A document of 2 is padded to 2·ring·ulysses = 8.
  plan = plan_shards(make_row({2}, 0).doc_ids, mesh(2, 2));
  EXPECT_EQ(sources(plan, 0), (std::vector<int64_t>{0, 1}));
  EXPECT_EQ(sources(plan, 1), (std::vector<int64_t>{-1, -1}));
  EXPECT_EQ(sources(plan, 2), (std::vector<int64_t>{-1, -1}));
}

TEST(SequenceShardLayout, NoSplitIsTheRowItself) {
  PackedRow row = make_row({3, 2}, 1);
  std::vector<PackedRow> shards = shard_row(row, mesh(1, 1));
  ASSERT_EQ(shards.size(), 1u);
  EXPECT_EQ(shards[0].input_ids, row.input_ids);
  EXPECT_EQ(shards[0].targets, row.targets);
}

// Maximal runs of one document id: [begin, end).
std::vector<std::pair<int64_t, int64_t>> segments_of(const PackedRow& row) {
  std::vector<std::pair<int64_t, int64_t>> segments;
  for (int64_t i = 0; i < row.length();) {
    int64_t j = i;
    while (j < row.length() && row.doc_ids[j] == row.doc_ids[i]) ++j;
    segments.emplace_back(i, j);
    i = j;
  }
  return segments;
}

void check_invariants(const PackedRow& row, const MeshConfig& m) {
  SCOPED_TRACE(::testing::Message() << "ulysses " << m.ulysses << " ring " << m.ring << ", row of "
                                    << row.length());
  const ShardPlan plan = plan_shards(row.doc_ids, m);
  const std::vector<PackedRow> shards = shard_row(row, m);
  ASSERT_EQ(static_cast<int>(shards.size()), m.sp);
  std::vector<int> seen(row.length(), 0);
  int64_t items = 0;
  for (int r = 0; r < m.sp; ++r) {
    const PackedRow& s = shards[r];
    ASSERT_EQ(s.length(), plan.shard_length);
    ASSERT_EQ(s.positions.size(), s.input_ids.size());
    ASSERT_EQ(s.doc_ids.size(), s.input_ids.size());
    ASSERT_EQ(s.targets.size(), s.input_ids.size());
    ASSERT_EQ(s.weights.size(), s.input_ids.size());
    items += s.num_items();
    for (int64_t i = 0; i < s.length(); ++i) {
      const int64_t src = plan.source[r][i];
      if (src < 0) {
        EXPECT_EQ(s.doc_ids[i], -1);
        EXPECT_EQ(s.targets[i], kIgnoreIndex);
        EXPECT_EQ(s.weights[i], 0.0f);
        continue;
      }
      ASSERT_LT(src, row.length());
      ++seen[src];
      EXPECT_EQ(s.input_ids[i], row.input_ids[src]);
      EXPECT_EQ(s.positions[i], row.positions[src]);
      EXPECT_EQ(s.doc_ids[i], row.doc_ids[src]);
      EXPECT_EQ(s.targets[i], row.targets[src]);
      EXPECT_EQ(s.weights[i], row.weights[src]);
    }
  }
  for (int64_t i = 0; i < row.length(); ++i) EXPECT_EQ(seen[i], 1) << "row token " << i;
  EXPECT_EQ(items, row.num_items());

  const auto segments = segments_of(row);
  const SequenceLayout layout = sequence_layout(m);
  if (layout == SequenceLayout::None || layout == SequenceLayout::Contiguous) {
    EXPECT_EQ(plan.shard_length * m.sp, padded_length(row.length(), m));
    for (int r = 0; r < m.sp; ++r)
      for (int64_t i = 0; i < plan.shard_length; ++i) {
        const int64_t at = r * plan.shard_length + i;
        EXPECT_EQ(plan.source[r][i], at < row.length() ? at : -1);
      }
    return;
  }
  // Zigzag / hybrid: each segment padded on its own to the layout's multiple.
  const int64_t multiple = sequence_multiple(m);
  int64_t total = 0;
  std::vector<int64_t> segment_of(row.length()), begin_of;
  std::vector<int64_t> padded_of;
  for (size_t g = 0; g < segments.size(); ++g) {
    const auto [b, e] = segments[g];
    const int64_t padded = (e - b + multiple - 1) / multiple * multiple;
    total += padded;
    for (int64_t i = b; i < e; ++i) segment_of[i] = static_cast<int64_t>(g);
    begin_of.push_back(b);
    padded_of.push_back(padded);
  }
  EXPECT_EQ(plan.shard_length * m.sp, total);
  // Ring shard r = the Ulysses slices of sp ranks r·u .. r·u+u−1 in order: every token of it lies
  // in chunk r or 2R−1−r of its padded segment, and tokens keep the row order.
  for (int r = 0; r < m.ring; ++r) {
    int64_t last = -1;
    for (int u = 0; u < m.ulysses; ++u)
      for (int64_t src : plan.source[r * m.ulysses + u]) {
        if (src < 0) continue;
        EXPECT_GT(src, last);
        last = src;
        const int64_t g = segment_of[src], chunk = padded_of[g] / (2 * m.ring);
        const int64_t c = (src - begin_of[g]) / chunk;
        EXPECT_TRUE(c == r || c == 2 * m.ring - 1 - r) << "token " << src << " in chunk " << c << " on ring rank " << r;
      }
  }
}

TEST(SequenceShardInvariants, EveryMeshAndRow) {
  const std::vector<MeshConfig> meshes = {mesh(1, 1), mesh(2, 1), mesh(4, 1), mesh(1, 2), mesh(1, 4),
                                          mesh(2, 2), mesh(4, 2), mesh(2, 4), mesh(3, 1), mesh(1, 3)};
  const std::vector<PackedRow> rows = {
      make_row({5, 1, 9, 3}, 2, 1),      // packed documents, one shorter than the ranks, padding tail
      make_row({1, 1, 1}, 0, 2),         // documents of one token
      make_row({}, 7, 3),                // only padding
      make_row({37}, 0, 4),              // one long document
      make_row({16, 16}, 0, 5),          // already a multiple of every layout
      make_row({2, 7, 4, 11, 1, 6}, 5, 6),
  };
  for (const MeshConfig& m : meshes)
    for (const PackedRow& row : rows) check_invariants(row, m);
}

TEST(SequenceShardInvariants, RingRanksDoEqualCausalWorkPerDocument) {
  // Causal work of a rank on a document: Σ over its queries of the keys it sees (position + 1).
  for (const MeshConfig& m : {mesh(1, 2), mesh(1, 4), mesh(2, 2), mesh(2, 4)}) {
    const int64_t multiple = sequence_multiple(m);
    PackedRow row = make_row({static_cast<int>(multiple), static_cast<int>(3 * multiple), static_cast<int>(2 * multiple)}, 0);
    const std::vector<PackedRow> shards = shard_row(row, m);
    for (int32_t doc = 0; doc < 3; ++doc) {
      std::vector<int64_t> work(m.ring, 0), tokens(m.ring, 0);
      for (int r = 0; r < m.sp; ++r)
        for (int64_t i = 0; i < shards[r].length(); ++i)
          if (shards[r].doc_ids[i] == doc) {
            work[r / m.ulysses] += shards[r].positions[i] + 1;
            ++tokens[r / m.ulysses];
          }
      for (int r = 1; r < m.ring; ++r) {
        EXPECT_EQ(work[r], work[0]) << "doc " << doc << " ring " << m.ring << " ulysses " << m.ulysses;
        EXPECT_EQ(tokens[r], tokens[0]);
      }
    }
  }
}

TEST(SequenceShardInvariants, EmptyRowGivesEmptyShards) {
  for (const MeshConfig& m : {mesh(2, 1), mesh(1, 2), mesh(2, 2)}) {
    std::vector<PackedRow> shards = shard_row(PackedRow{}, m);
    ASSERT_EQ(static_cast<int>(shards.size()), m.sp);
    for (const PackedRow& s : shards) EXPECT_EQ(s.length(), 0);
  }
}

TEST(SequenceShardErrors, RowArraysOfDifferentLengths) {
  PackedRow row = make_row({4}, 0);
  row.weights.pop_back();
  try {
    shard_row(row, mesh(2, 1));
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "cannot shard a packed row whose arrays differ in length: 4 input ids, 4 positions, 4 document ids, "
                 "4 targets, 3 weights");
  }
}

TEST(SequenceShardRows, ConcatenationKeepsDocumentsDistinct) {
  PackedRow a = make_row({2, 3}, 1), b = make_row({4}, 2);
  PackedRow all = concatenate_rows({a, b});
  EXPECT_EQ(all.doc_ids, (std::vector<int32_t>{0, 0, 1, 1, 1, -1, 2, 2, 2, 2, -1, -1}));
  EXPECT_EQ(all.num_items(), a.num_items() + b.num_items());
  EXPECT_EQ(all.positions[6], 0);
  EXPECT_EQ(all.targets[7], b.targets[1]);
}

}  // namespace
}  // namespace spindle::parallel
