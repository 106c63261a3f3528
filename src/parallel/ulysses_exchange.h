// The Ulysses all-to-all over a group of u ranks, shared by softmax attention (UlyssesAttention)
// and gated DeltaNet (UlyssesDeltaNet, sp_deltanet.h): "my t tokens, all heads" becomes "the
// group's u·t tokens in rank order, my heads", and back. Heads are rows of a [t, heads, D] tensor;
// which rows go to which rank is a row permutation built from the shapes alone (never from element
// data), cached per (backend, tokens, heads).
#pragma once

#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "comm/communicator.h"
#include "model/batch.h"

namespace spindle::parallel {

// A device I32 index uploaded from the host.
Tensor upload_index(Backend& backend, Stream stream, const std::vector<int32_t>& values);
std::vector<int32_t> inverse_permutation(const std::vector<int32_t>& permutation);

class UlyssesExchange {
 public:
  explicit UlyssesExchange(comm::Communicator& group) : group_(group) {}

  comm::Communicator& group() const { return group_; }
  int size() const { return group_.size(); }

  // The permutations of `heads` heads split evenly over the group (u divides heads), t local tokens.
  struct EvenSplit {
    Tensor send;     // I32 [u·t·heads/u]: send row (j, i, h) ← local row i·heads + j·heads/u + h
    Tensor inverse;  // I32 [t·heads]: received rows (in [u (source), t, heads/u] order) back to [t, heads]
  };
  const EvenSplit& even_split(Backend& backend, Stream stream, int64_t tokens, int64_t heads);

  // local [t, heads, D] → [u·t, heads_u, D]: the group's tokens (rank order) of the heads that
  // send_index gives this rank, heads_u per token.
  Tensor heads_to_sequence(Backend& backend, Stream stream, const Tensor& local, const Tensor& send_index,
                           int64_t heads_u);
  // [u·t, heads_u, D] → local [t, heads, D] through the inverse of an even split's send permutation.
  void sequence_to_heads(Backend& backend, Stream stream, const Tensor& sharded, const Tensor& inverse,
                         Tensor& local);
  // [u·t, heads_u, D] → local [t, heads, D] when several ranks hold copies of one head (send_index
  // names a local row more than once): the copies' contributions are summed.
  void sequence_to_heads_summed(Backend& backend, Stream stream, const Tensor& sharded, const Tensor& send_index,
                                Tensor& local);
  // The group's document ids and positions in rank order [u·t]: what the gathered sequence's mask
  // and recurrence need. The row flags carry over (the contiguous layout gathers back whole rows).
  MicroBatch gather_batch(Backend& backend, Stream stream, const MicroBatch& batch);

 private:
  comm::Communicator& group_;
  std::map<std::tuple<const Backend*, int64_t, int64_t>, EvenSplit> even_splits_;  // by (backend, t, heads)
};

}  // namespace spindle::parallel
