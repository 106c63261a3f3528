// Sequence-parallel attention strategies (docs/design.md §2.9, docs/parallelism.md §2). Each rank holds
// its shard of the sequence (sequence_shard.h) and the decoder hands the strategy that shard's
// q [t, Hq, D], k/v [t, Hkv, D]; the strategy returns the shard's out [t, Hq, D] and lse [Hq, t]
// exactly as single-device attention over the whole sequence would, and the matching gradients.
//
//  - UlyssesAttention: an all-to-all turns "my tokens, all heads" into "the group's tokens, my
//    head group", the inner strategy attends over the group's sequence, and the inverse all-to-all
//    returns the output. Needs the contiguous split over the group (or, under the hybrid layout,
//    a split whose Ulysses slices concatenate to the ring shard).
//  - RingAttention: each rank keeps its queries; key/value blocks travel round the ring and the
//    partial results are merged by log-sum-exp in F32 (F64 for F64 models). In backward the dK/dV
//    accumulators travel with their blocks and arrive back at their owner.
//  - Hybrid (USP): UlyssesAttention over the Ulysses group wrapping RingAttention over the ring.
//
// Every rank of a group calls every collective in the same order whatever its tokens are
// (padding only, no supervised target). The strategies never read element data on the host; they
// keep small index tensors built from the shapes alone.
#pragma once

#include <cstdint>
#include <map>
#include <memory>

#include "comm/communicator.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/deltanet_sequence.h"
#include "parallel/mesh.h"
#include "parallel/ulysses_exchange.h"

namespace spindle::parallel {

class UlyssesAttention final : public AttentionStrategy {
 public:
  // group: the Ulysses ranks, whose size u must divide num_q_heads; KV heads split evenly when
  // num_kv_heads ≥ u (u must then divide them), else each rank gets a copy of KV head
  // rank·Hkv/u (u a multiple of Hkv) and the copies' gradients are summed in backward.
  // `inner` attends over the gathered sequence with Hq/u query heads.
  UlyssesAttention(comm::Communicator& group, AttentionStrategy& inner, int64_t num_q_heads, int64_t num_kv_heads);
  UlyssesAttention(comm::Communicator& group, std::unique_ptr<AttentionStrategy> inner, int64_t num_q_heads,
                   int64_t num_kv_heads);

  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
               const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse, const AttentionCall& call, Tensor& dq,
                Tensor& dk, Tensor& dv) override;

 private:
  // Row permutations between the local layout and the all-to-all send layout, for t local tokens.
  struct Indices {
    Tensor q_send;       // I32 [u·t·Hq/u]: the even split of the query heads (UlyssesExchange::even_split)
    Tensor q_inverse;    // I32 [t·Hq]: its inverse (received rows back to [t, Hq])
    Tensor kv_send;      // I32 [u·t·Hkv_u]: send row (j, i, h) ← local kv row i·Hkv + kv head of (j, h)
    Tensor lse_send;     // I32 [Hq/u·u·t]: send element (j, h, i) ← inner lse element h·u·t + j·t + i
    Tensor lse_inverse;  // I32 [Hq/u·u·t]: the inverse permutation
  };
  const Indices& indices(Backend& backend, Stream stream, int64_t tokens);
  // The call the inner strategy makes over this rank's query heads: the same logits, the sinks of
  // those heads, and their rows of the sinks' gradient (viewed through *sinks_grad_rows).
  AttentionCall head_group_call(const AttentionCall& call, Tensor* sinks_grad_rows = nullptr) const;

  UlyssesExchange exchange_;  // the all-to-all, shared with gated DeltaNet (sp_deltanet.h)
  comm::Communicator& group_;
  std::unique_ptr<AttentionStrategy> owned_inner_;
  AttentionStrategy& inner_;
  int64_t num_q_heads_, num_kv_heads_;
  int64_t q_heads_per_rank_, kv_heads_per_rank_;
  std::map<std::pair<const Backend*, int64_t>, Indices> indices_;  // by (backend, local tokens)
};

class RingAttention final : public AttentionStrategy {
 public:
  explicit RingAttention(comm::Communicator& ring_group);

  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
               const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse, const AttentionCall& call, Tensor& dq,
                Tensor& dk, Tensor& dv) override;

 private:
  comm::Communicator& ring_;
};

// The strategy a mesh needs: LocalAttention for sp = 1, UlyssesAttention over LocalAttention
// (ring = 1), RingAttention (ulysses = 1), or UlyssesAttention over RingAttention (hybrid). For a
// model with gated DeltaNet layers it also carries their strategy (deltanet(), sp_deltanet.h). The
// result owns what it wraps and refers to the mesh's groups, so the mesh must outlive it.
// Throws spindle::Error if the model's heads do not fit the Ulysses degree.
std::unique_ptr<AttentionStrategy> make_sequence_parallel_attention(const Mesh& mesh, const ModelConfig& model);

// Gated DeltaNet's strategy for the mesh (null for sp = 1): Ulysses over the Ulysses group when its
// degree divides the DeltaNet key heads (around the local rule, or state passing over the ring for
// a hybrid mesh), else state passing over the whole sp group.
std::unique_ptr<DeltaNetSequence> make_sequence_parallel_deltanet(const Mesh& mesh, const ModelConfig& model);

}  // namespace spindle::parallel
