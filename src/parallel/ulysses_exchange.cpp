#include "parallel/ulysses_exchange.h"

#include "core/error.h"

namespace spindle::parallel {

namespace {

// [rows, D] view of a [tokens, heads, D] tensor (one row per token and head).
Tensor head_rows(const Tensor& t) { return t.reshape(Shape{t.dim(0) * t.dim(1), t.dim(2)}); }

}  // namespace

Tensor upload_index(Backend& backend, Stream stream, const std::vector<int32_t>& values) {
  Tensor t = backend.empty(Shape{static_cast<int64_t>(values.size())}, DType::I32);
  if (!values.empty()) backend.copy_from_host(stream, values.data(), t);
  return t;
}

std::vector<int32_t> inverse_permutation(const std::vector<int32_t>& p) {
  std::vector<int32_t> inverse(p.size());
  for (size_t s = 0; s < p.size(); ++s) inverse[static_cast<size_t>(p[s])] = static_cast<int32_t>(s);
  return inverse;
}

const UlyssesExchange::EvenSplit& UlyssesExchange::even_split(Backend& backend, Stream stream, int64_t t,
                                                              int64_t heads) {
  const auto key = std::make_tuple(static_cast<const Backend*>(&backend), t, heads);
  auto found = even_splits_.find(key);
  if (found != even_splits_.end()) return found->second;
  const int64_t u = group_.size();
  SPINDLE_CHECK(heads % u == 0, "Ulysses over {} ranks cannot split {} heads evenly", u, heads);
  const int64_t heads_u = heads / u;
  std::vector<int32_t> send;
  send.reserve(static_cast<size_t>(t * heads));
  for (int64_t j = 0; j < u; ++j)
    for (int64_t i = 0; i < t; ++i)
      for (int64_t h = 0; h < heads_u; ++h) send.push_back(static_cast<int32_t>(i * heads + j * heads_u + h));
  EvenSplit split{upload_index(backend, stream, send), upload_index(backend, stream, inverse_permutation(send))};
  return even_splits_.emplace(key, std::move(split)).first->second;
}

Tensor UlyssesExchange::heads_to_sequence(Backend& backend, Stream stream, const Tensor& local,
                                          const Tensor& send_index, int64_t heads_u) {
  const int64_t u = group_.size(), t = local.dim(0), d = local.dim(2);
  Tensor send = backend.empty(Shape{u * t * heads_u, d}, local.dtype());  // [u (dest), t, heads_u, D]
  backend.gather_rows(stream, head_rows(local), send_index, send);
  Tensor received = backend.empty(Shape{u * t * heads_u, d}, local.dtype());  // [u (source), t, heads_u, D]
  group_.all_to_all(stream, send, received);
  return received.reshape(Shape{u * t, heads_u, d});
}

void UlyssesExchange::sequence_to_heads(Backend& backend, Stream stream, const Tensor& sharded, const Tensor& inverse,
                                        Tensor& local) {
  Tensor send = head_rows(sharded);                                // [u (dest), t, heads_u, D]
  Tensor received = backend.empty(send.shape(), sharded.dtype());  // [u (source), t, heads_u, D]
  group_.all_to_all(stream, send, received);
  Tensor local_rows = head_rows(local);
  backend.gather_rows(stream, received, inverse, local_rows);
}

void UlyssesExchange::sequence_to_heads_summed(Backend& backend, Stream stream, const Tensor& sharded,
                                               const Tensor& send_index, Tensor& local) {
  Tensor send = head_rows(sharded);                                // [u (dest), t, heads_u, D]
  Tensor received = backend.empty(send.shape(), sharded.dtype());  // [u (source), t, heads_u, D]
  group_.all_to_all(stream, send, received);
  backend.fill(stream, local, 0.0);
  Tensor local_rows = head_rows(local);
  backend.scatter_add_rows(stream, received, send_index, local_rows);  // copies of one head add up
}

MicroBatch UlyssesExchange::gather_batch(Backend& backend, Stream stream, const MicroBatch& batch) {
  const int64_t u = group_.size(), t = batch.doc_ids.numel();
  MicroBatch gathered;
  gathered.num_tokens = u * t;
  gathered.doc_ids = backend.empty(Shape{u * t}, DType::I32);
  gathered.positions = backend.empty(Shape{u * t}, DType::I32);
  group_.all_gather(stream, batch.doc_ids, gathered.doc_ids);
  group_.all_gather(stream, batch.positions, gathered.positions);
  // The shards of a contiguous layout gather back into the whole row, in order.
  gathered.one_causal_document = batch.row_one_causal_document;
  gathered.row_one_causal_document = batch.row_one_causal_document;
  return gathered;
}

}  // namespace spindle::parallel
