// Splitting one packed row over the sequence-parallel ranks (docs/design.md §2.1, §2.4, §2.5). The row's
// targets are already shifted on the full row, so each shard carries, per token, its own input id,
// position, document id, target and weight; nothing is recomputed after the split. The layouts
// (mesh.h, SequenceLayout):
//  - Contiguous (Ulysses only): the row is padded to a multiple of sp and cut into sp equal slices.
//  - Zigzag (ring only): every segment (maximal run of one document id; padding runs count as a
//    segment) is padded to a multiple of 2·ring and cut into 2·ring equal chunks; ring rank r keeps
//    chunks r and 2·ring−1−r of every segment, in row order, so each rank does the same causal work.
//  - Hybrid: zigzag over the ring with segments padded to a multiple of 2·ring·ulysses; ring rank
//    r's shard is then cut contiguously into ulysses equal slices, slice j going to sp rank
//    r·ulysses + j. Concatenating the slices in Ulysses-rank order gives back the ring shard, which
//    is what the Ulysses all-to-all reconstructs before ring attention.
// Padding tokens: input id 0, document −1, target kIgnoreIndex, weight 0, position = their offset
// in the padded segment (or in the row's padding tail for the contiguous layout). They never see or are seen by a real token. All shards of a row have the
// same length, so every rank calls every collective with tensors of one shape.
#pragma once

#include <cstdint>
#include <vector>

#include "data/document.h"
#include "parallel/mesh.h"

namespace spindle::parallel {

// Where each token of each shard comes from.
struct ShardPlan {
  int64_t shard_length = 0;
  // source[sp_rank][i]: index in the full row of shard token i, or −1 for a padding token.
  // `pad_position[sp_rank][i]`: the position a padding token takes (unused for real tokens).
  std::vector<std::vector<int64_t>> source;
  std::vector<std::vector<int32_t>> pad_position;
};

// The plan for a row with these document ids (−1 = padding) under the mesh's layout.
ShardPlan plan_shards(const std::vector<int32_t>& doc_ids, const MeshConfig& mesh);

// The shard of sp rank `sp_rank` (0 ≤ sp_rank < mesh.sp) following `plan`.
PackedRow take_shard(const PackedRow& row, const ShardPlan& plan, int sp_rank);

// One shard per sp rank (index = sp rank). Throws spindle::Error if the row's arrays differ in length.
std::vector<PackedRow> shard_row(const PackedRow& row, const MeshConfig& mesh);

// Several rows as one (documents renumbered so they stay distinct, padding stays −1). Under
// sequence parallelism a micro-batch of several rows is sharded as this one row, so document ids
// agree on every rank of the group.
PackedRow concatenate_rows(const std::vector<PackedRow>& rows);

}  // namespace spindle::parallel
