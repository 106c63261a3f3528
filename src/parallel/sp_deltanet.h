// Gated DeltaNet under sequence parallelism (docs/parallelism.md §2, model/deltanet_sequence.h).
// Each rank holds its shard of the sequence (sequence_shard.h) and the mixer hands the strategy the
// shard's projections qkv [t, C], a, b [t, Hv]; the strategy returns the shard's delta-rule output
// [t, Hv, dv] exactly as one device would compute it over the whole sequence, and the gradients.
//
//  - LocalDeltaNet: the whole sequence is on this rank (the inner strategy of Ulysses without ring).
//  - UlyssesDeltaNet: the all-to-all shared with UlyssesAttention (ulysses_exchange.h) turns "my
//    tokens, all heads" into "the group's tokens, Hk/u key heads and their Hv/u value heads"; the
//    conv weight, A_log and dt_bias are sliced to those heads (their gradients land in the slices'
//    rows: summed over the group by the trainer's gradient reduction, each row is complete); the
//    inner strategy runs, and the output goes back. Needs u to divide the key heads.
//  - StatePassingDeltaNet: the ranks of a group keep their tokens. A rank's tokens fall into
//    pieces, maximal runs of one document at consecutive positions (a zigzag shard holds two per
//    document; a contiguous one, one); the piece before a piece (same document, the position before
//    its first) is on another rank or nowhere. The delta rule's state after a piece is affine in the
//    state before it, S_end = P·S_0 + B (P [dk, dk], B [dk, dv] per value head: B from the zero
//    state, P by running the rule on v = 0 from S_0 = I), so every rank summarises its pieces, the
//    summaries are all-gathered, and each rank composes the states entering its pieces along their
//    chains of predecessors, then runs its pieces from those states. The conv's window reads the
//    K−1 tokens before each piece from the ranks that hold them (all-gathered). Backward is the
//    mirror: ∂L/∂S_0 of each piece with nothing from later tokens is all-gathered and composed along
//    the chains of successors (∂L/∂S_end = Pᵀ·∂L/∂S_0(next) + D(next)), the halo's gradient is
//    reduce-scattered back to its owners. Works for any layout and any group.
//
// make_sequence_parallel_attention (sp_attention.h) picks: Ulysses over the Ulysses group when it
// divides the key heads, around Local (ring 1) or state passing over the ring; else state passing
// over the whole sp group.
#pragma once

#include <cstdint>
#include <memory>

#include "comm/communicator.h"
#include "model/deltanet_sequence.h"
#include "parallel/ulysses_exchange.h"

namespace spindle::parallel {

class LocalDeltaNet final : public DeltaNetSequence {
 public:
  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const DeltaNetHeads& heads,
               const Tensor& qkv, const Tensor& a, const Tensor& b, Tensor& core) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const DeltaNetHeads& heads,
                const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& d_core, Tensor& d_qkv, Tensor& da,
                Tensor& db) override;
};

class UlyssesDeltaNet final : public DeltaNetSequence {
 public:
  UlyssesDeltaNet(comm::Communicator& group, std::unique_ptr<DeltaNetSequence> inner);

  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const DeltaNetHeads& heads,
               const Tensor& qkv, const Tensor& a, const Tensor& b, Tensor& core) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const DeltaNetHeads& heads,
                const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& d_core, Tensor& d_qkv, Tensor& da,
                Tensor& db) override;

 private:
  struct Sharded;  // this rank's heads over the group's tokens (sp_deltanet.cpp)
  Sharded to_heads(Backend& backend, Stream stream, const MicroBatch& batch, const DeltaNetHeads& heads,
                   const Tensor& qkv, const Tensor& a, const Tensor& b);

  UlyssesExchange exchange_;
  std::unique_ptr<DeltaNetSequence> inner_;
};

class StatePassingDeltaNet final : public DeltaNetSequence {
 public:
  explicit StatePassingDeltaNet(comm::Communicator& group) : group_(group) {}

  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const DeltaNetHeads& heads,
               const Tensor& qkv, const Tensor& a, const Tensor& b, Tensor& core) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const DeltaNetHeads& heads,
                const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& d_core, Tensor& d_qkv, Tensor& da,
                Tensor& db) override;

 private:
  comm::Communicator& group_;
};

}  // namespace spindle::parallel
