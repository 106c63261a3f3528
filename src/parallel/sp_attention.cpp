#include "parallel/sp_attention.h"

#include <limits>
#include <utility>
#include <vector>

#include "core/error.h"
#include "parallel/sp_deltanet.h"

namespace spindle::parallel {

namespace {

// [n, 1] view of any tensor: gather_rows over single elements.
Tensor element_rows(const Tensor& t) { return t.reshape(Shape{t.numel(), 1}); }

void check_attention_shapes(const char* who, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                            const Tensor& v) {
  SPINDLE_CHECK(q.rank() == 3 && k.rank() == 3 && v.rank() == 3 && k.shape() == v.shape() && q.dim(0) == k.dim(0) &&
                    q.dim(2) == k.dim(2) && batch.doc_ids.numel() == q.dim(0) && batch.positions.numel() == q.dim(0),
                "{}: q {} k {} v {} with {} document ids", who, q.describe(), k.describe(), v.describe(),
                batch.doc_ids.numel());
}

}  // namespace

// ---- Ulysses ------------------------------------------------------------------------------------
//
// Communication per layer and rank, t local tokens, u ranks, Hkv' = max(Hkv, u) KV heads sent
// (replicas included), each all-to-all sending (u−1)/u of its buffer to other ranks:
//   forward:  q, k, v in and out back: t·D·(2·Hq + 2·Hkv') elements, plus lse t·Hq (stat dtype)
//             and an all-gather of the document ids and positions (2·t I32).
//   backward: q, k, v, out, dout in and dq, dk, dv back: t·D·(4·Hq + 4·Hkv'), plus lse t·Hq.
// Backward re-sends q, k, v and out instead of keeping the head-sharded copies from forward: the
// strategy then holds no activations between calls (the decoder owns them, and recomputed layers
// work unchanged), at the price of 2·t·D·(Hq + Hkv') more elements per layer.

UlyssesAttention::UlyssesAttention(comm::Communicator& group, AttentionStrategy& inner, int64_t num_q_heads,
                                   int64_t num_kv_heads)
    : exchange_(group), group_(group), inner_(inner), num_q_heads_(num_q_heads), num_kv_heads_(num_kv_heads) {
  const int64_t u = group.size();
  if (num_q_heads % u != 0 || num_kv_heads < 1 || num_q_heads % num_kv_heads != 0 ||
      (num_kv_heads % u != 0 && u % num_kv_heads != 0))
    fail("Ulysses over {} ranks (group '{}') cannot split {} query and {} KV heads: --ulysses must divide the query "
         "heads and either divide the KV heads or be a multiple of them; choose another --ulysses (see "
         "docs/parallelism.md)",
         u, group.name(), num_q_heads, num_kv_heads);
  q_heads_per_rank_ = num_q_heads / u;
  kv_heads_per_rank_ = num_kv_heads >= u ? num_kv_heads / u : 1;
}

UlyssesAttention::UlyssesAttention(comm::Communicator& group, std::unique_ptr<AttentionStrategy> inner,
                                   int64_t num_q_heads, int64_t num_kv_heads)
    : UlyssesAttention(group, *inner, num_q_heads, num_kv_heads) {
  owned_inner_ = std::move(inner);
}

const UlyssesAttention::Indices& UlyssesAttention::indices(Backend& backend, Stream stream, int64_t t) {
  auto key = std::make_pair(static_cast<const Backend*>(&backend), t);
  auto found = indices_.find(key);
  if (found != indices_.end()) return found->second;
  const int64_t u = group_.size(), hkv = num_kv_heads_;
  const int64_t hq_u = q_heads_per_rank_, hkv_u = kv_heads_per_rank_;
  // KV head h of rank j's group: its own slice when the heads split, else the one it shares.
  auto kv_head = [&](int64_t j, int64_t h) { return hkv >= u ? j * hkv_u + h : j * hkv / u; };
  std::vector<int32_t> kv_send, lse_send;
  kv_send.reserve(u * t * hkv_u);
  lse_send.reserve(u * t * hq_u);
  for (int64_t j = 0; j < u; ++j)
    for (int64_t i = 0; i < t; ++i)
      for (int64_t h = 0; h < hkv_u; ++h) kv_send.push_back(static_cast<int32_t>(i * hkv + kv_head(j, h)));
  for (int64_t j = 0; j < u; ++j)
    for (int64_t h = 0; h < hq_u; ++h)
      for (int64_t i = 0; i < t; ++i) lse_send.push_back(static_cast<int32_t>(h * u * t + j * t + i));
  const UlyssesExchange::EvenSplit& q = exchange_.even_split(backend, stream, t, num_q_heads_);
  Indices idx;
  idx.q_send = q.send;
  idx.q_inverse = q.inverse;
  idx.kv_send = upload_index(backend, stream, kv_send);
  idx.lse_send = upload_index(backend, stream, lse_send);
  idx.lse_inverse = upload_index(backend, stream, inverse_permutation(lse_send));
  return indices_.emplace(key, std::move(idx)).first->second;
}

AttentionCall UlyssesAttention::head_group_call(const AttentionCall& call, Tensor* sinks_grad_rows) const {
  AttentionCall inner{call.logits};
  if (!call.sinks.defined()) return inner;
  // The even split gives rank j query heads j·Hq/u … (j+1)·Hq/u − 1 (UlyssesExchange::even_split).
  const int64_t first = group_.rank() * q_heads_per_rank_;
  inner.sinks = call.sinks.flat(first, q_heads_per_rank_);
  if (sinks_grad_rows && call.sinks_grad) {
    *sinks_grad_rows = call.sinks_grad->flat(first, q_heads_per_rank_);
    inner.sinks_grad = sinks_grad_rows;
  }
  return inner;
}

void UlyssesAttention::forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q,
                               const Tensor& k, const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) {
  check_attention_shapes("UlyssesAttention", batch, q, k, v);
  SPINDLE_CHECK(q.dim(1) == num_q_heads_ && k.dim(1) == num_kv_heads_, "UlyssesAttention built for {}/{} heads: q {} k {}",
                num_q_heads_, num_kv_heads_, q.describe(), k.describe());
  const int64_t u = group_.size(), t = q.dim(0), d = q.dim(2);
  const Indices& idx = indices(backend, stream, t);
  const MicroBatch gathered = exchange_.gather_batch(backend, stream, batch);
  // [u·t, Hq/u, D], [u·t, Hkv_u, D], [u·t, Hkv_u, D]
  const Tensor qh = exchange_.heads_to_sequence(backend, stream, q, idx.q_send, q_heads_per_rank_);
  const Tensor kh = exchange_.heads_to_sequence(backend, stream, k, idx.kv_send, kv_heads_per_rank_);
  const Tensor vh = exchange_.heads_to_sequence(backend, stream, v, idx.kv_send, kv_heads_per_rank_);
  Tensor out_h = backend.empty(Shape{u * t, q_heads_per_rank_, d}, out.dtype());  // [u·t, Hq/u, D]
  Tensor lse_h = backend.empty(Shape{q_heads_per_rank_, u * t}, lse.dtype());      // [Hq/u, u·t]
  inner_.forward(backend, stream, gathered, qh, kh, vh, head_group_call(call), out_h, lse_h);
  exchange_.sequence_to_heads(backend, stream, out_h, idx.q_inverse, out);
  // lse: chunk j = [Hq/u, t] of rank j's tokens; what arrives, in source order, is [Hq, t].
  Tensor lse_send = backend.empty(Shape{lse.numel(), 1}, lse.dtype());
  backend.gather_rows(stream, element_rows(lse_h), idx.lse_send, lse_send);
  Tensor lse_rows = element_rows(lse);
  group_.all_to_all(stream, lse_send, lse_rows);
}

void UlyssesAttention::backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q,
                                const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                                const Tensor& lse, const AttentionCall& call, Tensor& dq, Tensor& dk, Tensor& dv) {
  check_attention_shapes("UlyssesAttention", batch, q, k, v);
  const int64_t u = group_.size(), t = q.dim(0);
  const Indices& idx = indices(backend, stream, t);
  const MicroBatch gathered = exchange_.gather_batch(backend, stream, batch);
  const Tensor qh = exchange_.heads_to_sequence(backend, stream, q, idx.q_send, q_heads_per_rank_);
  const Tensor kh = exchange_.heads_to_sequence(backend, stream, k, idx.kv_send, kv_heads_per_rank_);
  const Tensor vh = exchange_.heads_to_sequence(backend, stream, v, idx.kv_send, kv_heads_per_rank_);
  const Tensor out_h = exchange_.heads_to_sequence(backend, stream, out, idx.q_send, q_heads_per_rank_);
  const Tensor dout_h = exchange_.heads_to_sequence(backend, stream, dout, idx.q_send, q_heads_per_rank_);
  // lse [Hq, t]: chunk j (rows of head group j) goes to rank j; the [u (source), Hq/u, t] that
  // arrives is permuted to [Hq/u, u·t].
  Tensor lse_received = backend.empty(Shape{lse.numel(), 1}, lse.dtype());
  group_.all_to_all(stream, element_rows(lse), lse_received);
  Tensor lse_h = backend.empty(Shape{q_heads_per_rank_, u * t}, lse.dtype());
  Tensor lse_h_rows = element_rows(lse_h);
  backend.gather_rows(stream, lse_received, idx.lse_inverse, lse_h_rows);

  Tensor dq_h = backend.empty(qh.shape(), q.dtype());
  Tensor dk_h = backend.empty(kh.shape(), k.dtype());
  Tensor dv_h = backend.empty(vh.shape(), v.dtype());
  Tensor sinks_grad_h;  // this rank's query heads' rows of the sinks' gradient (the other ranks add theirs)
  inner_.backward(backend, stream, gathered, qh, kh, vh, out_h, dout_h, lse_h, head_group_call(call, &sinks_grad_h),
                  dq_h, dk_h, dv_h);
  exchange_.sequence_to_heads(backend, stream, dq_h, idx.q_inverse, dq);
  exchange_.sequence_to_heads_summed(backend, stream, dk_h, idx.kv_send, dk);
  exchange_.sequence_to_heads_summed(backend, stream, dv_h, idx.kv_send, dv);
}

// ---- Ring ---------------------------------------------------------------------------------------
//
// Communication per layer and rank, t local tokens, R ranks: forward sends the k/v block R−1
// times (2·t·Hkv·D elements each); backward sends it R−1 times and the dK/dV accumulators R times
// (the last hop returns them to their owner): (4R−2)·t·Hkv·D elements. Every step also needs each
// block's document ids and positions: one all-gather of 2·t I32 per call replaces sending them.
// No block is skipped: whether one can contribute depends on device data (documents and positions),
// which the host does not read.

RingAttention::RingAttention(comm::Communicator& ring_group) : ring_(ring_group) {}

namespace {

// The ring's document ids and positions: table [2R, t], rows 2s and 2s+1 = rank s's ids and positions.
Tensor gather_mask_table(Backend& backend, Stream stream, comm::Communicator& ring, const MicroBatch& batch,
                         int64_t t) {
  Tensor mine = backend.empty(Shape{2, t}, DType::I32);
  Tensor doc_row = mine.rows(0, 1), pos_row = mine.rows(1, 2);
  backend.copy(stream, batch.doc_ids, doc_row);
  backend.copy(stream, batch.positions, pos_row);
  Tensor table = backend.empty(Shape{2 * ring.size(), t}, DType::I32);
  ring.all_gather(stream, mine, table);
  return table;
}

AttentionMask block_mask(const MicroBatch& batch, const Tensor& table, int source, int64_t t) {
  return AttentionMask{batch.doc_ids, batch.positions, table.rows(2 * source, 2 * source + 1).reshape(Shape{t}),
                       table.rows(2 * source + 1, 2 * source + 2).reshape(Shape{t})};
}

// k and v side by side in one buffer [2, t, Hkv, D], so a ring step is one message.
struct KvPair {
  Tensor both;
  Tensor k() const { return both.rows(0, 1).reshape(Shape{both.dim(1), both.dim(2), both.dim(3)}); }
  Tensor v() const { return both.rows(1, 2).reshape(Shape{both.dim(1), both.dim(2), both.dim(3)}); }
};

KvPair empty_pair(Backend& backend, const Tensor& like) {
  return KvPair{backend.empty(Shape{2, like.dim(0), like.dim(1), like.dim(2)}, like.dtype())};
}

}  // namespace

// Overlap (CUDA; on the CPU every call runs to completion in program order, so the same code is
// the plain sequential loop). Attention runs on the caller's stream C, the ring's transfers on the
// backend's comm stream M, ordered only by stream_wait. K/V are double-buffered: at step s the
// attention reads kv[s % 2] while M sends it on and receives block s+1 into kv[(s+1) % 2], which
// step s−1's attention has finished reading. Each stream_wait is issued at the one point of the
// host's program order where the other stream's queue ends with exactly the work to wait for, so
// a step's attention never waits for the transfer that it should overlap. Every buffer M touches
// is allocated (and first written) on C before M's first wait for C, and outlives the final wait
// of C for M, so the stream-ordered allocator (whose frees follow C) cannot hand it out while M
// still uses it. The arithmetic and its order are those of the sequential loop.

void RingAttention::forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q,
                            const Tensor& k, const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) {
  check_attention_shapes("RingAttention", batch, q, k, v);
  const int size = ring_.size(), rank = ring_.rank();
  const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
  const int64_t t = q.dim(0);
  const Stream comm = backend.comm_stream();
  const Tensor table = gather_mask_table(backend, stream, ring_, batch, t);
  const KvPair kv[2] = {empty_pair(backend, k), empty_pair(backend, k)};
  Tensor ck = kv[0].k(), cv = kv[0].v();
  backend.copy(stream, k, ck);
  backend.copy(stream, v, cv);
  // The accumulator is in the statistics dtype (F32, F64 for F64 models): out itself when it
  // already has that dtype, so nothing is rounded between blocks.
  const bool accumulate_in_out = out.dtype() == lse.dtype();
  Tensor acc = accumulate_in_out ? out : backend.empty(out.shape(), lse.dtype());  // [t, Hq, D]
  Tensor out_b = backend.empty(q.shape(), q.dtype());                              // [t, Hq, D]
  Tensor lse_b = backend.empty(lse.shape(), lse.dtype());                          // [Hq, t]
  backend.stream_wait(comm, stream);  // kv[0] written, kv[1] allocated, the table gathered
  for (int step = 0; step < size; ++step) {
    const int source = (rank - step + size) % size;  // whose k/v block this rank holds now
    const KvPair& current = kv[step % 2];
    const KvPair& incoming = kv[(step + 1) % 2];
    // M: block step+1 arrives while C attends over this one (M already waited for step−1's attention).
    if (step + 1 < size) {
      Tensor into = incoming.both;
      ring_.send_recv(comm, current.both, next, into, previous);
    }
    const AttentionMask mask = block_mask(batch, table, source, t);
    if (step == 0) {
      // The own block starts the accumulator (rows with no visible key: out 0, lse −inf).
      if (accumulate_in_out) {
        backend.attention_forward(stream, q, current.k(), current.v(), mask, call.logits, acc, lse);
      } else {
        backend.attention_forward(stream, q, current.k(), current.v(), mask, call.logits, out_b, lse);
      }
    } else {
      backend.attention_forward(stream, q, current.k(), current.v(), mask, call.logits, out_b, lse_b);
    }
    // The next receive lands in this block's buffer: only once this attention has read it.
    if (step + 2 < size) backend.stream_wait(comm, stream);
    if (step == 0) {
      if (!accumulate_in_out) backend.copy(stream, out_b, acc);
    } else {
      backend.attention_merge(stream, acc, lse, out_b, lse_b);
    }
    // Step step+1's attention reads what M received (M's queue ends with that send_recv now).
    if (step + 1 < size) backend.stream_wait(stream, comm);
  }
  backend.stream_wait(stream, comm);  // before the buffers go back to the pool (see above)
  // Every key block is merged: the sinks join each row's denominator once.
  merge_attention_sinks(backend, stream, call, acc, lse);
  if (!accumulate_in_out) backend.copy(stream, acc, out);
}

void RingAttention::backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                             const Tensor& lse, const AttentionCall& call, Tensor& dq, Tensor& dk, Tensor& dv) {
  check_attention_shapes("RingAttention", batch, q, k, v);
  const int size = ring_.size(), rank = ring_.rank();
  const int next = (rank + 1) % size, previous = (rank + size - 1) % size;
  const int64_t t = q.dim(0);
  const Stream comm = backend.comm_stream();
  const Tensor table = gather_mask_table(backend, stream, ring_, batch, t);
  const KvPair kv[2] = {empty_pair(backend, k), empty_pair(backend, k)};
  Tensor ck = kv[0].k(), cv = kv[0].v();
  backend.copy(stream, k, ck);
  backend.copy(stream, v, cv);
  // Partial gradients of the blocks cancel each other (dS = P∘(dP − D)), so with BF16/F16
  // activations each block's partials come out of the backend in F32 (never rounded to 16 bits),
  // are summed in F32 (the travelling dK/dV too) and rounded once at the end; F32/F64 models
  // accumulate in place.
  const bool widen = k.dtype() != DType::F32 && k.dtype() != DType::F64;
  const DType acc_dtype = widen ? DType::F32 : k.dtype();
  auto pair_of = [&](DType dtype) { return KvPair{backend.empty(Shape{2, k.dim(0), k.dim(1), k.dim(2)}, dtype)}; };
  // grad[step % 2]: dK/dV of the block this rank holds, with the contributions of the ranks it has
  // visited; the other buffer receives the next block's accumulator.
  const KvPair grad[2] = {pair_of(acc_dtype), pair_of(acc_dtype)};
  Tensor dq_acc = widen ? backend.empty(q.shape(), DType::F32) : dq;
  KvPair partial = widen ? pair_of(DType::F32) : KvPair{};
  backend.stream_wait(comm, stream);  // kv[0] written, the other buffers allocated, the table gathered
  for (int step = 0; step < size; ++step) {
    const int source = (rank - step + size) % size;
    const KvPair& current = kv[step % 2];
    const KvPair& incoming = kv[(step + 1) % 2];
    Tensor g = grad[step % 2].both, g_incoming = grad[(step + 1) % 2].both;
    // Exact partial gradients from the final out and lse: dq accumulates here, dK/dV in the
    // travelling accumulator; step 0 (own block, fresh accumulator) overwrites both. C already
    // waited for this block's K/V (end of the previous step).
    const AttentionMask mask = block_mask(batch, table, source, t);
    if (widen) {
      // dK/dV into scratch first: this part needs no accumulator, so it overlaps the
      // accumulator's hop; dQ stays on this rank and accumulates directly (so the scratch is
      // zeroed: one accumulate flag serves all three).
      Tensor pk = partial.k(), pv = partial.v();
      if (step > 0) backend.fill(stream, partial.both, 0.0);
      backend.attention_backward(stream, q, current.k(), current.v(), out, dout, lse, mask, call.logits, dq_acc, pk, pv,
                                 step > 0);
    }
    // The accumulator of this block has arrived (M's queue ends with the previous step's hop).
    if (step > 0) backend.stream_wait(stream, comm);
    if (!widen) {
      Tensor gk = grad[step % 2].k(), gv = grad[step % 2].v();
      backend.attention_backward(stream, q, current.k(), current.v(), out, dout, lse, mask, call.logits, dq, gk, gv,
                                 step > 0);
    } else if (step == 0) {
      backend.copy(stream, partial.both, g);
    } else {
      backend.axpy(stream, 1.0, partial.both, g);
    }
    // M: the next block's K/V, into the buffer the previous step's attention read (M waited for
    // that step before its accumulator hop); C's next attention waits for exactly this transfer.
    if (step + 1 < size) {
      Tensor into = incoming.both;
      ring_.send_recv(comm, current.both, next, into, previous);
      backend.stream_wait(stream, comm);
    }
    // Pass the accumulator on once this step's contribution is in it; after the last step what
    // arrives is this rank's own block, complete.
    if (size > 1) {
      backend.stream_wait(comm, stream);
      ring_.send_recv(comm, g, next, g_incoming, previous);
    }
  }
  backend.stream_wait(stream, comm);  // the last hop arrived; the buffers may go back to the pool
  // After `size` hops the own block's accumulator is in grad[size % 2] (with one rank nothing moved).
  const KvPair& own = grad[size > 1 ? size % 2 : 0];
  if (widen) backend.copy(stream, dq_acc, dq);
  backend.copy(stream, own.k(), dk);
  backend.copy(stream, own.v(), dv);
  // The sinks' gradient over this rank's rows, from the final out and lse (the sinks in it).
  attention_sinks_backward(backend, stream, call, out, dout, lse);
}

// ---- factory ------------------------------------------------------------------------------------

namespace {

// Softmax attention's strategy with gated DeltaNet's, for a model that has both kinds of layer.
class HybridSequenceParallel final : public AttentionStrategy {
 public:
  HybridSequenceParallel(std::unique_ptr<AttentionStrategy> attention, std::unique_ptr<DeltaNetSequence> deltanet)
      : attention_(std::move(attention)), deltanet_(std::move(deltanet)) {}
  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
               const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) override {
    attention_->forward(backend, stream, batch, q, k, v, call, out, lse);
  }
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse, const AttentionCall& call,
                Tensor& dq, Tensor& dk, Tensor& dv) override {
    attention_->backward(backend, stream, batch, q, k, v, out, dout, lse, call, dq, dk, dv);
  }
  DeltaNetSequence* deltanet() override { return deltanet_.get(); }

 private:
  std::unique_ptr<AttentionStrategy> attention_;
  std::unique_ptr<DeltaNetSequence> deltanet_;
};

std::unique_ptr<AttentionStrategy> make_softmax_attention(const Mesh& mesh, const ModelConfig& model) {
  const MeshConfig& c = mesh.config();
  const int64_t hq = model.num_heads, hkv = model.num_kv_heads;
  switch (sequence_layout(c)) {
    case SequenceLayout::None: return std::make_unique<LocalAttention>();
    case SequenceLayout::Contiguous:
      return std::make_unique<UlyssesAttention>(mesh.ulysses(), std::make_unique<LocalAttention>(), hq, hkv);
    case SequenceLayout::Zigzag: return std::make_unique<RingAttention>(mesh.ring());
    case SequenceLayout::Hybrid:
      return std::make_unique<UlyssesAttention>(mesh.ulysses(), std::make_unique<RingAttention>(mesh.ring()), hq, hkv);
  }
  fail("unknown sequence layout for --ulysses {} --ring {}", c.ulysses, c.ring);
}

}  // namespace

std::unique_ptr<DeltaNetSequence> make_sequence_parallel_deltanet(const Mesh& mesh, const ModelConfig& model) {
  const MeshConfig& c = mesh.config();
  if (c.sp == 1) return nullptr;
  const int64_t key_heads = model.linear_attention.num_key_heads;
  if (c.ulysses > 1 && key_heads % c.ulysses == 0) {
    std::unique_ptr<DeltaNetSequence> inner;
    if (c.ring > 1) inner = std::make_unique<StatePassingDeltaNet>(mesh.ring());
    else inner = std::make_unique<LocalDeltaNet>();
    return std::make_unique<UlyssesDeltaNet>(mesh.ulysses(), std::move(inner));
  }
  // The Ulysses degree does not divide the key heads (or there is no Ulysses group): every rank
  // keeps its tokens and the state passes over the whole sequence-parallel group.
  return std::make_unique<StatePassingDeltaNet>(mesh.sp());
}

std::unique_ptr<AttentionStrategy> make_sequence_parallel_attention(const Mesh& mesh, const ModelConfig& model) {
  std::unique_ptr<AttentionStrategy> attention = make_softmax_attention(mesh, model);
  bool has_deltanet = false;
  for (int64_t l = 0; l < model.num_layers; ++l) has_deltanet |= model.layer_kind(l).mixer == MixerKind::GatedDeltaNet;
  if (!has_deltanet || mesh.config().sp == 1) return attention;
  return std::make_unique<HybridSequenceParallel>(std::move(attention), make_sequence_parallel_deltanet(mesh, model));
}

}  // namespace spindle::parallel
