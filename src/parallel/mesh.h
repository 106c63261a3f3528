// The device mesh: world = dp × sp, sp = ulysses × ring. Resolved from the flags and checked
// against the world size and the model's heads before anything is allocated, then turned into the
// four process groups the trainer uses. docs/parallelism.md explains how to choose the degrees.
//
// Rank layout (Ulysses innermost, so its all-to-all stays inside a node on GPUs):
//   rank = dp_index·sp + ring_index·ulysses + ulysses_index,   sp_rank = ring_index·ulysses + ulysses_index
#pragma once

#include <array>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "comm/communicator.h"

namespace spindle::parallel {

// The degrees as given on the command line (--dp, --sp, --ulysses, --ring); nullopt = not given.
struct MeshFlags {
  std::optional<int> dp = std::nullopt, sp = std::nullopt, ulysses = std::nullopt, ring = std::nullopt;
};

struct MeshConfig {
  int dp = 1, sp = 1, ulysses = 1, ring = 1;
  int world_size() const { return dp * sp; }
  bool operator==(const MeshConfig&) const = default;
};

// Fills in what the flags leave out, then validates:
//  - sp: given; else the product of the given --ulysses/--ring; else world / --dp if --dp is
//    given; else 1.
//  - ulysses: given; else sp / --ring if --ring is given; else the largest divisor of sp that the
//    head counts allow (valid_ulysses_degrees). ring = sp / ulysses.
//  - dp: given; else world / sp.
// Throws spindle::Error naming the flags to change and the valid choices.
MeshConfig resolve_mesh(const MeshFlags& flags, int world_size, int num_q_heads, int num_kv_heads);

// Checks a complete config: positive degrees, dp·sp = world, ulysses·ring = sp, ulysses divides
// the query heads, and the KV heads either split evenly over Ulysses ranks or (fewer KV heads than
// the degree) are replicated: the degree must then be a multiple of the KV heads.
void validate(const MeshConfig& config, int world_size, int num_q_heads, int num_kv_heads);

// Divisors d of sp with q % d == 0 and (kv % d == 0 or d % kv == 0), ascending.
std::vector<int> valid_ulysses_degrees(int sp, int num_q_heads, int num_kv_heads);

// True when each Ulysses rank holds a copy of a KV head shared with other ranks (kv < ulysses);
// their gradients are then summed back over the ranks that share it.
inline bool kv_heads_replicated(const MeshConfig& config, int num_kv_heads) { return config.ulysses > num_kv_heads; }

struct MeshCoordinates {
  int dp = 0, ring = 0, ulysses = 0;
  bool operator==(const MeshCoordinates&) const = default;
};
MeshCoordinates coordinates_of(const MeshConfig& config, int rank);
int rank_of(const MeshConfig& config, const MeshCoordinates& coordinates);
inline int sp_rank_of(const MeshConfig& config, const MeshCoordinates& c) { return c.ring * config.ulysses + c.ulysses; }

// How a sequence is split over the sp ranks, and the multiple its length must be padded to.
//  - None (sp = 1): multiple 1.
//  - Contiguous (Ulysses only): sp equal consecutive slices of the row: multiple sp.
//  - Zigzag (ring only): each document cut into 2·ring chunks, ring rank r keeps chunks r and
//    2·ring−1−r (causal work balanced): multiple 2·ring, per document.
//  - Hybrid: zigzag over ring, then each ring rank's shard cut into ulysses consecutive slices:
//    multiple 2·ring·ulysses, per document.
// Padding tokens carry weight 0 and their own document id.
enum class SequenceLayout { None, Contiguous, Zigzag, Hybrid };
SequenceLayout sequence_layout(const MeshConfig& config);
int64_t sequence_multiple(const MeshConfig& config);
int64_t padded_length(int64_t length, const MeshConfig& config);  // rounded up to sequence_multiple

// The split of the world that makes one of a rank's groups: ranks passing the same color form the
// group, ordered by key. Mesh makes these four splits, in this order, on every rank.
struct GroupSplit {
  const char* name;  // "dp", "sp", "ulysses", "ring"
  int color, key;
};
std::array<GroupSplit, 4> mesh_splits(const MeshConfig& config, int world_rank);

class Mesh {
 public:
  // Collective over `world` (which must outlive the mesh and have config.world_size() ranks):
  // every rank builds its dp, sp, ulysses and ring groups. Group ranks follow the coordinates:
  // dp().rank() = dp index, sp().rank() = sp rank, ulysses().rank() = ulysses index, ring().rank() = ring index.
  Mesh(const MeshConfig& config, comm::Communicator& world);

  const MeshConfig& config() const { return config_; }
  const MeshCoordinates& coordinates() const { return coordinates_; }
  int sp_rank() const { return sp_rank_of(config_, coordinates_); }

  comm::Communicator& world() const { return world_; }  // FSDP shards over all dp·sp ranks
  comm::Communicator& dp() const { return *dp_; }
  comm::Communicator& sp() const { return *sp_; }
  comm::Communicator& ulysses() const { return *ulysses_; }
  comm::Communicator& ring() const { return *ring_; }

 private:
  MeshConfig config_;
  MeshCoordinates coordinates_;
  comm::Communicator& world_;
  std::unique_ptr<comm::Communicator> dp_, sp_, ulysses_, ring_;
};

}  // namespace spindle::parallel
