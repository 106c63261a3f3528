#include "parallel/sequence_shard.h"

#include <algorithm>

#include "core/error.h"

namespace spindle::parallel {

namespace {

// A padded piece of the row: `length` tokens from `begin`, followed by padding up to `padded`.
struct Segment {
  int64_t begin = 0, length = 0, padded = 0;
};

int64_t round_up(int64_t n, int64_t multiple) { return (n + multiple - 1) / multiple * multiple; }

// Token `offset` of a padded segment as a plan entry: the row index, or −1 with the position the
// padding continues from the segment's own tokens.
void append(const Segment& s, int64_t offset, std::vector<int64_t>& source, std::vector<int32_t>& pad_position) {
  source.push_back(offset < s.length ? s.begin + offset : -1);
  pad_position.push_back(static_cast<int32_t>(offset));
}

}  // namespace

ShardPlan plan_shards(const std::vector<int32_t>& doc_ids, const MeshConfig& mesh) {
  const int64_t length = static_cast<int64_t>(doc_ids.size());
  const int sp = mesh.sp, ring = mesh.ring, ulysses = mesh.ulysses;
  if (sp < 1 || ring < 1 || ulysses < 1 || ring * ulysses != sp)
    fail("cannot shard a row over --sp {} = --ulysses {} × --ring {}: the degrees must be positive and multiply to sp",
         sp, ulysses, ring);
  ShardPlan plan;
  plan.source.resize(sp);
  plan.pad_position.resize(sp);
  const SequenceLayout layout = sequence_layout(mesh);

  if (layout == SequenceLayout::None || layout == SequenceLayout::Contiguous) {
    // The whole row is one segment whose padding starts its own run (positions 0, 1, ...).
    const int64_t padded = round_up(length, sp);
    plan.shard_length = padded / sp;
    for (int r = 0; r < sp; ++r)
      for (int64_t i = r * plan.shard_length; i < (r + 1) * plan.shard_length; ++i) {
        plan.source[r].push_back(i < length ? i : -1);
        plan.pad_position[r].push_back(static_cast<int32_t>(i - length));
      }
    return plan;
  }

  // Zigzag and hybrid: segments are maximal runs of one document id, each padded on its own.
  const int64_t multiple = sequence_multiple(mesh);  // 2·ring (·ulysses for hybrid)
  std::vector<Segment> segments;
  for (int64_t i = 0; i < length;) {
    int64_t j = i;
    while (j < length && doc_ids[j] == doc_ids[i]) ++j;
    segments.push_back(Segment{i, j - i, round_up(j - i, multiple)});
    i = j;
  }
  // Ring shard of ring rank r: chunks r and 2·ring−1−r of every segment, in row order.
  std::vector<std::vector<int64_t>> ring_source(ring);
  std::vector<std::vector<int32_t>> ring_pad(ring);
  for (const Segment& s : segments) {
    const int64_t chunk = s.padded / (2 * ring);
    for (int r = 0; r < ring; ++r)
      for (int64_t c : {int64_t{r}, int64_t{2 * ring - 1 - r}})
        for (int64_t k = c * chunk; k < (c + 1) * chunk; ++k) append(s, k, ring_source[r], ring_pad[r]);
  }
  // Every ring shard has Σ 2·chunk tokens, a multiple of ulysses: cut each into ulysses slices.
  const int64_t ring_length = static_cast<int64_t>(ring_source[0].size());
  plan.shard_length = ring_length / ulysses;
  for (int r = 0; r < ring; ++r)
    for (int u = 0; u < ulysses; ++u) {
      const int sp_rank = r * ulysses + u;
      const int64_t begin = u * plan.shard_length, end = begin + plan.shard_length;
      plan.source[sp_rank].assign(ring_source[r].begin() + begin, ring_source[r].begin() + end);
      plan.pad_position[sp_rank].assign(ring_pad[r].begin() + begin, ring_pad[r].begin() + end);
    }
  return plan;
}

PackedRow take_shard(const PackedRow& row, const ShardPlan& plan, int sp_rank) {
  SPINDLE_CHECK(sp_rank >= 0 && sp_rank < static_cast<int>(plan.source.size()), "sp rank {} of {}", sp_rank,
                plan.source.size());
  const auto& source = plan.source[sp_rank];
  const auto& pad_position = plan.pad_position[sp_rank];
  PackedRow shard;
  const size_t n = source.size();
  shard.input_ids.reserve(n);
  shard.positions.reserve(n);
  shard.doc_ids.reserve(n);
  shard.targets.reserve(n);
  shard.weights.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t s = source[i];
    if (s < 0) {
      shard.input_ids.push_back(0);
      shard.positions.push_back(pad_position[i]);
      shard.doc_ids.push_back(-1);
      shard.targets.push_back(kIgnoreIndex);
      shard.weights.push_back(0.0f);
    } else {
      shard.input_ids.push_back(row.input_ids[s]);
      shard.positions.push_back(row.positions[s]);
      shard.doc_ids.push_back(row.doc_ids[s]);
      shard.targets.push_back(row.targets[s]);
      shard.weights.push_back(row.weights[s]);
    }
  }
  return shard;
}

std::vector<PackedRow> shard_row(const PackedRow& row, const MeshConfig& mesh) {
  const size_t n = row.input_ids.size();
  if (row.positions.size() != n || row.doc_ids.size() != n || row.targets.size() != n || row.weights.size() != n)
    fail("cannot shard a packed row whose arrays differ in length: {} input ids, {} positions, {} document ids, "
         "{} targets, {} weights",
         n, row.positions.size(), row.doc_ids.size(), row.targets.size(), row.weights.size());
  const ShardPlan plan = plan_shards(row.doc_ids, mesh);
  std::vector<PackedRow> shards;
  shards.reserve(mesh.sp);
  for (int r = 0; r < mesh.sp; ++r) shards.push_back(take_shard(row, plan, r));
  return shards;
}

PackedRow concatenate_rows(const std::vector<PackedRow>& rows) {
  PackedRow all;
  int32_t doc_offset = 0;
  for (const PackedRow& row : rows) {
    int32_t max_doc = -1;
    for (int32_t d : row.doc_ids) max_doc = std::max(max_doc, d);
    for (int32_t d : row.doc_ids) all.doc_ids.push_back(d < 0 ? -1 : d + doc_offset);
    all.input_ids.insert(all.input_ids.end(), row.input_ids.begin(), row.input_ids.end());
    all.positions.insert(all.positions.end(), row.positions.begin(), row.positions.end());
    all.targets.insert(all.targets.end(), row.targets.begin(), row.targets.end());
    all.weights.insert(all.weights.end(), row.weights.begin(), row.weights.end());
    doc_offset += max_doc + 1;
  }
  return all;
}

}  // namespace spindle::parallel
