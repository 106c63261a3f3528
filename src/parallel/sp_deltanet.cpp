#include "parallel/sp_deltanet.h"

#include <algorithm>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "core/error.h"

namespace spindle::parallel {

namespace {

// ---- the token-local work between the conv and the delta rule ------------------------------------

// What the delta rule reads, from the conv's output, for T tokens of the heads of `h`.
struct RuleInputs {
  Tensor q, k;            // [T, Hk, dk] L2-normed
  Tensor q_rstd, k_rstd;  // [T·Hk] stat dtype
  Tensor v;               // [T, Hv, dv]
  Tensor g;               // [T, Hv] stat dtype
  Tensor beta;            // [T, Hv]
};

// mixed [T, C] = silu(conv(qkv)); a, b [T, Hv]. The same ops, in the same order, as the mixer's own
// single-device path (blocks/gated_deltanet.cpp), so every head computes what it computes there.
RuleInputs rule_inputs(Backend& be, Stream st, const DeltaNetHeads& h, const Tensor& mixed, const Tensor& a,
                       const Tensor& b) {
  const int64_t t = mixed.dim(0), kw = h.key_width(), vw = h.value_width();
  const DType dt = mixed.dtype(), sdt = stat_dtype(dt);
  RuleInputs x;
  Tensor q_raw = be.empty(Shape{t, kw}, dt), k_raw = be.empty(Shape{t, kw}, dt);
  x.v = be.empty(Shape{t, h.value_heads, h.value_dim}, dt);
  Tensor v_flat = x.v.reshape(Shape{t, vw});
  be.copy_columns(st, mixed, 0, q_raw, 0, kw);
  be.copy_columns(st, mixed, kw, k_raw, 0, kw);
  be.copy_columns(st, mixed, 2 * kw, v_flat, 0, vw);
  const Shape key_shape{t, h.key_heads, h.key_dim};
  x.q = be.empty(key_shape, dt);
  x.k = be.empty(key_shape, dt);
  x.q_rstd = be.empty(Shape{t * h.key_heads}, sdt);
  x.k_rstd = be.empty(Shape{t * h.key_heads}, sdt);
  be.l2norm_forward(st, q_raw.reshape(key_shape), h.l2norm_eps, x.q, x.q_rstd);
  be.l2norm_forward(st, k_raw.reshape(key_shape), h.l2norm_eps, x.k, x.k_rstd);
  x.g = be.empty(Shape{t, h.value_heads}, sdt);
  x.beta = be.empty(Shape{t, h.value_heads}, dt);
  be.gated_delta_gates_forward(st, a, b, h.a_log, h.dt_bias, x.g, x.beta);
  return x;
}

// The same from qkv [T, C] of the tokens' own documents (no halo): the conv, split and norms as one
// op (Backend::deltanet_conv_split_forward; a backend may fuse them), then the gates.
RuleInputs conv_rule_inputs(Backend& be, Stream st, const DeltaNetHeads& h, const Tensor& doc_ids, const Tensor& qkv,
                            const Tensor& a, const Tensor& b) {
  const int64_t t = qkv.dim(0);
  const DType dt = qkv.dtype(), sdt = stat_dtype(dt);
  const Shape key_shape{t, h.key_heads, h.key_dim};
  RuleInputs x;
  x.q = be.empty(key_shape, dt);
  x.k = be.empty(key_shape, dt);
  x.q_rstd = be.empty(Shape{t * h.key_heads}, sdt);
  x.k_rstd = be.empty(Shape{t * h.key_heads}, sdt);
  x.v = be.empty(Shape{t, h.value_heads, h.value_dim}, dt);
  be.deltanet_conv_split_forward(st, qkv, h.conv, doc_ids, h.l2norm_eps, x.q, x.k, x.v, x.q_rstd, x.k_rstd);
  x.g = be.empty(Shape{t, h.value_heads}, sdt);
  x.beta = be.empty(Shape{t, h.value_heads}, dt);
  be.gated_delta_gates_forward(st, a, b, h.a_log, h.dt_bias, x.g, x.beta);
  return x;
}

struct RuleGrads {
  Tensor dq, dk, dv, dg, dbeta;
};

RuleGrads empty_rule_grads(Backend& be, const RuleInputs& x) {
  return {be.empty(x.q.shape(), x.q.dtype()), be.empty(x.k.shape(), x.k.dtype()), be.empty(x.v.shape(), x.v.dtype()),
          be.empty(x.g.shape(), x.g.dtype()), be.empty(x.beta.shape(), x.beta.dtype())};
}

// The delta rule's input gradients → d_mixed [T, C], da, db [T, Hv] (overwritten); A_log and
// dt_bias gradients accumulate.
void rule_inputs_backward(Backend& be, Stream st, const DeltaNetHeads& h, const RuleInputs& x, const Tensor& a,
                          const RuleGrads& d, Tensor& d_mixed, Tensor& da, Tensor& db) {
  const int64_t t = d_mixed.dim(0), kw = h.key_width(), vw = h.value_width();
  const DType dt = d_mixed.dtype();
  be.gated_delta_gates_backward(st, a, x.beta, h.a_log, h.dt_bias, x.g, d.dg, d.dbeta, da, db, h.a_log_grad,
                                h.dt_bias_grad);
  Tensor dq_raw = be.empty(x.q.shape(), dt), dk_raw = be.empty(x.k.shape(), dt);
  be.l2norm_backward(st, x.q, x.q_rstd, d.dq, dq_raw);
  be.l2norm_backward(st, x.k, x.k_rstd, d.dk, dk_raw);
  be.copy_columns(st, dq_raw.reshape(Shape{t, kw}), 0, d_mixed, 0, kw);
  be.copy_columns(st, dk_raw.reshape(Shape{t, kw}), 0, d_mixed, kw, kw);
  be.copy_columns(st, d.dv.reshape(Shape{t, vw}), 0, d_mixed, 2 * kw, vw);
}

}  // namespace

// ---- Local ----------------------------------------------------------------------------------------

void LocalDeltaNet::forward(Backend& be, Stream st, const MicroBatch& batch, const DeltaNetHeads& h, const Tensor& qkv,
                            const Tensor& a, const Tensor& b, Tensor& core) {
  const RuleInputs x = conv_rule_inputs(be, st, h, batch.doc_ids, qkv, a, b);
  be.gated_delta_rule_forward(st, x.q, x.k, x.v, x.g, x.beta, batch.doc_ids, h.scale, h.chunk_size, core);
}

void LocalDeltaNet::backward(Backend& be, Stream st, const MicroBatch& batch, const DeltaNetHeads& h,
                             const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& d_core, Tensor& d_qkv,
                             Tensor& da, Tensor& db) {
  const RuleInputs x = conv_rule_inputs(be, st, h, batch.doc_ids, qkv, a, b);  // recomputed: the strategy keeps nothing
  RuleGrads d = empty_rule_grads(be, x);
  be.gated_delta_rule_backward(st, x.q, x.k, x.v, x.g, x.beta, batch.doc_ids, h.scale, h.chunk_size, d_core, d.dq,
                               d.dk, d.dv, d.dg, d.dbeta);
  be.gated_delta_gates_backward(st, a, x.beta, h.a_log, h.dt_bias, x.g, d.dg, d.dbeta, da, db, h.a_log_grad,
                                h.dt_bias_grad);
  be.deltanet_conv_split_backward(st, qkv, h.conv, batch.doc_ids, x.q, x.k, x.q_rstd, x.k_rstd, d.dq, d.dk, d.dv,
                                  d_qkv, h.conv_grad);
}

// ---- Ulysses --------------------------------------------------------------------------------------
//
// Communication per layer and rank, t local tokens, u ranks, each all-to-all sending (u−1)/u of its
// buffer: forward q, k, v, a, b in (t·C + 2·t·Hv elements) and the core back (t·Hv·dv), plus the
// document ids and positions (2·t I32, all-gathered); backward the same inputs again, d_core in and
// d_qkv, da, db back. The gated norm and out_proj stay sequence-sharded: the core returns before
// them, so z never travels and the norm weight needs no slicing.

struct UlyssesDeltaNet::Sharded {
  MicroBatch batch;           // the group's document ids and positions [u·t], in rank order
  DeltaNetHeads heads;        // Hk/u key heads and their Hv/u value heads, parameters sliced
  Tensor qkv, a, b;           // [u·t, C/u], [u·t, Hv/u], [u·t, Hv/u]
  Tensor conv_rows;           // I32 [C/u] this rank's rows of the conv weight
  Tensor value_rows;          // I32 [Hv/u] this rank's value heads (rows of A_log, dt_bias)
  Tensor conv_grad, a_log_grad, dt_bias_grad;  // the slices' gradients (backward, trainable only)
};

UlyssesDeltaNet::UlyssesDeltaNet(comm::Communicator& group, std::unique_ptr<DeltaNetSequence> inner)
    : exchange_(group), inner_(std::move(inner)) {}

UlyssesDeltaNet::Sharded UlyssesDeltaNet::to_heads(Backend& be, Stream st, const MicroBatch& batch,
                                                   const DeltaNetHeads& h, const Tensor& qkv, const Tensor& a,
                                                   const Tensor& b) {
  const int64_t u = exchange_.size(), j = exchange_.group().rank(), t = qkv.dim(0);
  if (h.key_heads % u != 0)
    fail("Ulysses over {} ranks cannot split the gated DeltaNet's {} key heads; choose --ulysses dividing them",
         u, h.key_heads);
  const int64_t hk_u = h.key_heads / u, hv_u = h.value_heads / u, kw = h.key_width(), vw = h.value_width();
  const int64_t kw_u = hk_u * h.key_dim, vw_u = hv_u * h.value_dim, tu = u * t;
  const DType dt = qkv.dtype();
  Sharded s;
  s.batch = exchange_.gather_batch(be, st, batch);

  // qkv's three column blocks as heads, each split over the group.
  Tensor q = be.empty(Shape{t, h.key_heads, h.key_dim}, dt), k = be.empty(q.shape(), dt);
  Tensor v = be.empty(Shape{t, h.value_heads, h.value_dim}, dt);
  Tensor q_flat = q.reshape(Shape{t, kw}), k_flat = k.reshape(Shape{t, kw}), v_flat = v.reshape(Shape{t, vw});
  be.copy_columns(st, qkv, 0, q_flat, 0, kw);
  be.copy_columns(st, qkv, kw, k_flat, 0, kw);
  be.copy_columns(st, qkv, 2 * kw, v_flat, 0, vw);
  const UlyssesExchange::EvenSplit& keys = exchange_.even_split(be, st, t, h.key_heads);
  const UlyssesExchange::EvenSplit& values = exchange_.even_split(be, st, t, h.value_heads);
  const Tensor qh = exchange_.heads_to_sequence(be, st, q, keys.send, hk_u);    // [u·t, Hk/u, dk]
  const Tensor kh = exchange_.heads_to_sequence(be, st, k, keys.send, hk_u);    // [u·t, Hk/u, dk]
  const Tensor vh = exchange_.heads_to_sequence(be, st, v, values.send, hv_u);  // [u·t, Hv/u, dv]
  s.qkv = be.empty(Shape{tu, 2 * kw_u + vw_u}, dt);
  be.copy_columns(st, qh.reshape(Shape{tu, kw_u}), 0, s.qkv, 0, kw_u);
  be.copy_columns(st, kh.reshape(Shape{tu, kw_u}), 0, s.qkv, kw_u, kw_u);
  be.copy_columns(st, vh.reshape(Shape{tu, vw_u}), 0, s.qkv, 2 * kw_u, vw_u);
  s.a = exchange_.heads_to_sequence(be, st, a.reshape(Shape{t, h.value_heads, 1}), values.send, hv_u)
            .reshape(Shape{tu, hv_u});
  s.b = exchange_.heads_to_sequence(be, st, b.reshape(Shape{t, h.value_heads, 1}), values.send, hv_u)
            .reshape(Shape{tu, hv_u});

  // The parameters of this rank's heads: conv rows q | k | v of its heads, A_log/dt_bias of its value heads.
  std::vector<int32_t> conv_rows, value_rows;
  for (int64_t c = 0; c < kw_u; ++c) conv_rows.push_back(static_cast<int32_t>(j * kw_u + c));
  for (int64_t c = 0; c < kw_u; ++c) conv_rows.push_back(static_cast<int32_t>(kw + j * kw_u + c));
  for (int64_t c = 0; c < vw_u; ++c) conv_rows.push_back(static_cast<int32_t>(2 * kw + j * vw_u + c));
  for (int64_t c = 0; c < hv_u; ++c) value_rows.push_back(static_cast<int32_t>(j * hv_u + c));
  s.conv_rows = upload_index(be, st, conv_rows);
  s.value_rows = upload_index(be, st, value_rows);
  const int64_t width = h.conv.numel() / h.channels();
  s.heads = h;
  s.heads.key_heads = hk_u;
  s.heads.value_heads = hv_u;
  s.heads.conv = be.empty(Shape{2 * kw_u + vw_u, 1, width}, h.conv.dtype());
  Tensor conv_slice = s.heads.conv.reshape(Shape{2 * kw_u + vw_u, width});
  be.gather_rows(st, h.conv.reshape(Shape{h.channels(), width}), s.conv_rows, conv_slice);
  s.heads.a_log = be.empty(Shape{hv_u}, h.a_log.dtype());
  s.heads.dt_bias = be.empty(Shape{hv_u}, h.dt_bias.dtype());
  Tensor a_log_slice = s.heads.a_log.reshape(Shape{hv_u, 1}), dt_bias_slice = s.heads.dt_bias.reshape(Shape{hv_u, 1});
  be.gather_rows(st, h.a_log.reshape(Shape{h.value_heads, 1}), s.value_rows, a_log_slice);
  be.gather_rows(st, h.dt_bias.reshape(Shape{h.value_heads, 1}), s.value_rows, dt_bias_slice);
  s.heads.conv_grad = s.heads.a_log_grad = s.heads.dt_bias_grad = nullptr;  // set by backward
  return s;
}

void UlyssesDeltaNet::forward(Backend& be, Stream st, const MicroBatch& batch, const DeltaNetHeads& h,
                              const Tensor& qkv, const Tensor& a, const Tensor& b, Tensor& core) {
  const Sharded s = to_heads(be, st, batch, h, qkv, a, b);
  const int64_t t = qkv.dim(0);
  Tensor core_h = be.empty(Shape{s.qkv.dim(0), s.heads.value_heads, h.value_dim}, core.dtype());  // [u·t, Hv/u, dv]
  inner_->forward(be, st, s.batch, s.heads, s.qkv, s.a, s.b, core_h);
  exchange_.sequence_to_heads(be, st, core_h, exchange_.even_split(be, st, t, h.value_heads).inverse, core);
}

void UlyssesDeltaNet::backward(Backend& be, Stream st, const MicroBatch& batch, const DeltaNetHeads& h,
                               const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& d_core,
                               Tensor& d_qkv, Tensor& da, Tensor& db) {
  Sharded s = to_heads(be, st, batch, h, qkv, a, b);
  // The slices' gradients start at zero and are added into the parameters' rows afterwards.
  if (h.conv_grad) {
    s.conv_grad = be.zeros(s.heads.conv.shape(), h.conv_grad->dtype());
    s.heads.conv_grad = &s.conv_grad;
  }
  if (h.a_log_grad) {
    s.a_log_grad = be.zeros(s.heads.a_log.shape(), h.a_log_grad->dtype());
    s.heads.a_log_grad = &s.a_log_grad;
  }
  if (h.dt_bias_grad) {
    s.dt_bias_grad = be.zeros(s.heads.dt_bias.shape(), h.dt_bias_grad->dtype());
    s.heads.dt_bias_grad = &s.dt_bias_grad;
  }
  const int64_t t = qkv.dim(0), tu = s.qkv.dim(0), hk_u = s.heads.key_heads, hv_u = s.heads.value_heads;
  const int64_t kw = h.key_width(), vw = h.value_width(), kw_u = s.heads.key_width(), vw_u = s.heads.value_width();
  const DType dt = qkv.dtype();
  const UlyssesExchange::EvenSplit& keys = exchange_.even_split(be, st, t, h.key_heads);
  const UlyssesExchange::EvenSplit& values = exchange_.even_split(be, st, t, h.value_heads);
  const Tensor d_core_h = exchange_.heads_to_sequence(be, st, d_core, values.send, hv_u);  // [u·t, Hv/u, dv]
  Tensor d_qkv_h = be.empty(s.qkv.shape(), dt), da_h = be.empty(s.a.shape(), dt), db_h = be.empty(s.b.shape(), dt);
  inner_->backward(be, st, s.batch, s.heads, s.qkv, s.a, s.b, d_core_h, d_qkv_h, da_h, db_h);

  // Back to this rank's tokens, all heads.
  Tensor dq_h = be.empty(Shape{tu, hk_u, h.key_dim}, dt), dk_h = be.empty(dq_h.shape(), dt);
  Tensor dv_h = be.empty(Shape{tu, hv_u, h.value_dim}, dt);
  Tensor dq_h_flat = dq_h.reshape(Shape{tu, kw_u}), dk_h_flat = dk_h.reshape(Shape{tu, kw_u});
  Tensor dv_h_flat = dv_h.reshape(Shape{tu, vw_u});
  be.copy_columns(st, d_qkv_h, 0, dq_h_flat, 0, kw_u);
  be.copy_columns(st, d_qkv_h, kw_u, dk_h_flat, 0, kw_u);
  be.copy_columns(st, d_qkv_h, 2 * kw_u, dv_h_flat, 0, vw_u);
  Tensor dq = be.empty(Shape{t, h.key_heads, h.key_dim}, dt), dk = be.empty(dq.shape(), dt);
  Tensor dv = be.empty(Shape{t, h.value_heads, h.value_dim}, dt);
  exchange_.sequence_to_heads(be, st, dq_h, keys.inverse, dq);
  exchange_.sequence_to_heads(be, st, dk_h, keys.inverse, dk);
  exchange_.sequence_to_heads(be, st, dv_h, values.inverse, dv);
  be.copy_columns(st, dq.reshape(Shape{t, kw}), 0, d_qkv, 0, kw);
  be.copy_columns(st, dk.reshape(Shape{t, kw}), 0, d_qkv, kw, kw);
  be.copy_columns(st, dv.reshape(Shape{t, vw}), 0, d_qkv, 2 * kw, vw);
  Tensor da_heads = da.reshape(Shape{t, h.value_heads, 1}), db_heads = db.reshape(Shape{t, h.value_heads, 1});
  exchange_.sequence_to_heads(be, st, da_h.reshape(Shape{tu, hv_u, 1}), values.inverse, da_heads);
  exchange_.sequence_to_heads(be, st, db_h.reshape(Shape{tu, hv_u, 1}), values.inverse, db_heads);

  // This rank's heads' rows of the parameter gradients (the other rows come from the other ranks).
  if (h.conv_grad) {
    const int64_t width = h.conv.numel() / h.channels();
    Tensor full = h.conv_grad->reshape(Shape{h.channels(), width});
    be.scatter_add_rows(st, s.conv_grad.reshape(Shape{2 * kw_u + vw_u, width}), s.conv_rows, full);
  }
  if (h.a_log_grad) {
    Tensor full = h.a_log_grad->reshape(Shape{h.value_heads, 1});
    be.scatter_add_rows(st, s.a_log_grad.reshape(Shape{hv_u, 1}), s.value_rows, full);
  }
  if (h.dt_bias_grad) {
    Tensor full = h.dt_bias_grad->reshape(Shape{h.value_heads, 1});
    be.scatter_add_rows(st, s.dt_bias_grad.reshape(Shape{hv_u, 1}), s.value_rows, full);
  }
}

// ---- state passing --------------------------------------------------------------------------------
//
// Communication per layer and rank, t local tokens, P pieces on the rank holding most, R ranks:
// an all-gather of the document ids and positions (2·t I32), of the conv halo (at most (K−1)
// rows of C per piece), and of the pieces' summaries (P·Hv·dk·(dk + dv) stat-dtype elements); the
// backward repeats them, all-gathers the pieces' ∂L/∂S_0 (P·Hv·dk·dv) and reduce-scatters the
// halo's gradient. The host reads the gathered document ids and positions to find the pieces.

namespace {

// A maximal run of one document at consecutive positions on one rank.
struct Piece {
  int rank = 0;
  int64_t begin = 0, end = 0;  // local tokens [begin, end) on its rank
  int32_t doc = 0, first_position = 0, last_position = 0;
  int previous = -1, next = -1;  // the pieces holding the document's tokens just before / after
};

// Every rank's pieces and what this rank does with them; identical on every rank of the group.
struct PiecePlan {
  int ranks = 0, rank = 0;
  int64_t tokens = 0;          // per rank
  std::vector<Piece> pieces;   // in rank order, then token order
  std::vector<int> first;      // [ranks + 1] each rank's first piece
  int64_t max_pieces = 0;      // on any rank
  int64_t halo_slots = 0;      // rows each rank contributes to the halo all-gather
  std::vector<int32_t> halo_send;      // [halo_slots] this rank's rows in its slots (0 in unused slots)
  std::vector<int32_t> ext_source;     // [E] row of [local tokens | gathered halo] each extended row copies
  std::vector<int32_t> ext_run;        // [E] the local piece of each extended row (the conv's run ids)
  std::vector<int32_t> token_ext_row;  // [t] the extended row of each local token
  std::vector<int32_t> token_piece;    // [t] the local piece of each local token (the delta rule's run ids)

  int local_pieces() const { return first[rank + 1] - first[rank]; }
  // Row of piece p in the all-gathered [ranks·max_pieces, …] summaries.
  int64_t slot(int p) const { return pieces[p].rank * max_pieces + (p - first[pieces[p].rank]); }
};

PiecePlan plan_pieces(Backend& be, Stream st, comm::Communicator& group, const MicroBatch& batch, int64_t halo) {
  PiecePlan plan;
  plan.ranks = group.size();
  plan.rank = group.rank();
  const int64_t t = batch.doc_ids.numel();
  plan.tokens = t;
  Tensor mine = be.empty(Shape{2, t}, DType::I32);  // [document ids; positions]
  Tensor doc_row = mine.rows(0, 1), position_row = mine.rows(1, 2);
  be.copy(st, batch.doc_ids.reshape(Shape{1, t}), doc_row);
  be.copy(st, batch.positions.reshape(Shape{1, t}), position_row);
  Tensor table = be.empty(Shape{2 * plan.ranks, t}, DType::I32);
  group.all_gather(st, mine, table);
  std::vector<int32_t> host(static_cast<size_t>(2 * plan.ranks * t));
  be.copy_to_host(st, table, host.data());
  auto doc = [&](int r, int64_t i) { return host[static_cast<size_t>((2 * r) * t + i)]; };
  auto position = [&](int r, int64_t i) { return host[static_cast<size_t>((2 * r + 1) * t + i)]; };

  for (int r = 0; r < plan.ranks; ++r) {
    plan.first.push_back(static_cast<int>(plan.pieces.size()));
    for (int64_t i = 0; i < t; ++i) {
      // Positions inside a document are distinct; equal neighbours mean the batch is malformed (or
      // its ids were never uploaded).
      if (i > 0 && doc(r, i) >= 0 && doc(r, i) == doc(r, i - 1) && position(r, i) == position(r, i - 1))
        fail("sequence-parallel gated DeltaNet: document {} has two neighbouring tokens at position {} on rank {} of "
             "group '{}'; passing the state between ranks needs each token's document and position",
             doc(r, i), position(r, i), r, group.name());
      const bool continues = i > 0 && doc(r, i) == doc(r, i - 1) && position(r, i) == position(r, i - 1) + 1;
      if (continues) {
        plan.pieces.back().end = i + 1;
        plan.pieces.back().last_position = position(r, i);
      } else {
        plan.pieces.push_back(Piece{r, i, i + 1, doc(r, i), position(r, i), position(r, i)});
      }
    }
    plan.max_pieces = std::max<int64_t>(plan.max_pieces, static_cast<int64_t>(plan.pieces.size()) - plan.first.back());
  }
  plan.first.push_back(static_cast<int>(plan.pieces.size()));

  // A document's pieces chain by position. Padding (document −1) is never continued: its tokens
  // see no real token and no real token sees them.
  std::map<std::pair<int32_t, int32_t>, int> ending;  // (document, last position) → piece
  for (int p = 0; p < static_cast<int>(plan.pieces.size()); ++p)
    if (plan.pieces[p].doc >= 0) ending[{plan.pieces[p].doc, plan.pieces[p].last_position}] = p;
  for (int p = 0; p < static_cast<int>(plan.pieces.size()); ++p) {
    Piece& piece = plan.pieces[p];
    if (piece.doc < 0 || piece.first_position == 0) continue;
    auto found = ending.find({piece.doc, piece.first_position - 1});
    if (found == ending.end())
      fail("sequence-parallel gated DeltaNet: document {} resumes at position {} on rank {} of group '{}', but no "
           "rank holds its position {}",
           piece.doc, piece.first_position, piece.rank, group.name(), piece.first_position - 1);
    piece.previous = found->second;
    plan.pieces[found->second].next = p;
  }

  // The conv halo: the (up to) `halo` tokens before each piece, oldest first, as (rank, row).
  std::vector<std::vector<std::pair<int, int64_t>>> halo_rows(plan.pieces.size());
  std::vector<std::map<int64_t, int>> slot_of(plan.ranks);  // per rank: row → slot
  for (size_t p = 0; p < plan.pieces.size(); ++p) {
    std::vector<std::pair<int, int64_t>> rows;
    for (int q = plan.pieces[p].previous; q >= 0 && static_cast<int64_t>(rows.size()) < halo;
         q = plan.pieces[q].previous)
      for (int64_t i = plan.pieces[q].end; i-- > plan.pieces[q].begin && static_cast<int64_t>(rows.size()) < halo;)
        rows.emplace_back(plan.pieces[q].rank, i);
    std::reverse(rows.begin(), rows.end());
    for (const auto& [r, i] : rows) slot_of[r].emplace(i, static_cast<int>(slot_of[r].size()));
    halo_rows[p] = std::move(rows);
  }
  plan.halo_slots = 1;
  for (const auto& slots : slot_of) plan.halo_slots = std::max<int64_t>(plan.halo_slots, slots.size());
  plan.halo_send.assign(static_cast<size_t>(plan.halo_slots), 0);
  for (const auto& [row, slot] : slot_of[plan.rank])
    plan.halo_send[static_cast<size_t>(slot)] = static_cast<int32_t>(row);

  // This rank's extended rows: each piece after its halo, pieces apart (their own conv run).
  plan.token_ext_row.assign(static_cast<size_t>(t), 0);
  plan.token_piece.assign(static_cast<size_t>(t), 0);
  for (int p = plan.first[plan.rank]; p < plan.first[plan.rank + 1]; ++p) {
    const int32_t local = p - plan.first[plan.rank];
    for (const auto& [r, i] : halo_rows[p]) {
      plan.ext_source.push_back(static_cast<int32_t>(t + r * plan.halo_slots + slot_of[r].at(i)));
      plan.ext_run.push_back(local);
    }
    for (int64_t i = plan.pieces[p].begin; i < plan.pieces[p].end; ++i) {
      plan.token_ext_row[static_cast<size_t>(i)] = static_cast<int32_t>(plan.ext_source.size());
      plan.token_piece[static_cast<size_t>(i)] = local;
      plan.ext_source.push_back(static_cast<int32_t>(i));
      plan.ext_run.push_back(local);
    }
  }
  return plan;
}

// [runs, heads, n, n] identity matrices in `dtype` (F32/F64).
Tensor identity_states(Backend& be, Stream st, int64_t runs, int64_t heads, int64_t n, DType dtype) {
  std::vector<double> values(static_cast<size_t>(runs * heads * n * n), 0.0);
  for (int64_t m = 0; m < runs * heads; ++m)
    for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>((m * n + i) * n + i)] = 1.0;
  Tensor out = be.empty(Shape{runs, heads, n, n}, dtype);
  SPINDLE_CHECK(dtype == DType::F32 || dtype == DType::F64, "identity states in {}", dtype_name(dtype));
  if (dtype == DType::F64) {
    be.copy_from_host(st, values.data(), out);
  } else {
    const std::vector<float> narrow(values.begin(), values.end());
    be.copy_from_host(st, narrow.data(), out);
  }
  return out;
}

// What forward and backward both compute first (the backward recomputes it: nothing is kept).
struct StatePass {
  PiecePlan plan;
  Tensor ext_source, ext_run, token_ext_row, run_ids, halo_send;  // I32, from the plan
  Tensor ext;                  // [E, C] each local piece's conv input after its halo
  RuleInputs x;                // [t, …]
  Tensor transitions, finals;  // all-gathered summaries [R·Pmax·Hv·dk, dk], [R·Pmax·Hv·dk, dv] stat dtype
  Tensor initial;              // [P, Hv, dk, dv] stat dtype: the state entering each local piece
};

// Rows of head h of slot s in an all-gathered [slots·Hv·dk, n] summary.
Tensor head_block(const Tensor& all, int64_t slot, int64_t h, int64_t heads, int64_t dk) {
  const int64_t row = (slot * heads + h) * dk;
  return all.rows(row, row + dk);
}

StatePass prepare_pass(Backend& be, Stream st, comm::Communicator& group, const MicroBatch& batch,
                       const DeltaNetHeads& h, const Tensor& qkv, const Tensor& a, const Tensor& b) {
  const int64_t t = qkv.dim(0), c = qkv.dim(1), width = h.conv.numel() / h.channels();
  const DType dt = qkv.dtype(), sdt = stat_dtype(dt);
  const int64_t hv = h.value_heads, dk = h.key_dim, dv = h.value_dim;
  StatePass s;
  s.plan = plan_pieces(be, st, group, batch, width - 1);
  const PiecePlan& plan = s.plan;
  s.ext_source = upload_index(be, st, plan.ext_source);
  s.ext_run = upload_index(be, st, plan.ext_run);
  s.token_ext_row = upload_index(be, st, plan.token_ext_row);
  s.run_ids = upload_index(be, st, plan.token_piece);
  s.halo_send = upload_index(be, st, plan.halo_send);

  // The conv: [local rows | every rank's halo rows] → each piece after its halo.
  const int64_t gathered_rows = plan.ranks * plan.halo_slots;
  Tensor source = be.empty(Shape{t + gathered_rows, c}, dt);
  Tensor local_part = source.rows(0, t), halo_part = source.rows(t, t + gathered_rows);
  be.copy(st, qkv, local_part);
  Tensor halo_send = be.empty(Shape{plan.halo_slots, c}, dt);
  be.gather_rows(st, qkv, s.halo_send, halo_send);
  group.all_gather(st, halo_send, halo_part);
  const int64_t e = static_cast<int64_t>(plan.ext_source.size());
  s.ext = be.empty(Shape{e, c}, dt);
  be.gather_rows(st, source, s.ext_source, s.ext);
  Tensor mixed_ext = be.empty(Shape{e, c}, dt);
  be.causal_conv1d_silu_forward(st, s.ext, h.conv, s.ext_run, mixed_ext);
  Tensor mixed = be.empty(Shape{t, c}, dt);
  be.gather_rows(st, mixed_ext, s.token_ext_row, mixed);
  s.x = rule_inputs(be, st, h, mixed, a, b);

  // Each local piece's summary S_end = P·S_0 + B: B from the zero state, P from the identity with v = 0.
  const int64_t pieces = plan.local_pieces(), pmax = plan.max_pieces;
  Tensor finals = be.zeros(Shape{pmax, hv, dk, dv}, sdt), transitions = be.zeros(Shape{pmax, hv, dk, dk}, sdt);
  Tensor finals_mine = finals.rows(0, pieces), transitions_mine = transitions.rows(0, pieces);
  Tensor scratch = be.empty(s.x.v.shape(), dt);
  be.gated_delta_rule_forward_states(st, s.x.q, s.x.k, s.x.v, s.x.g, s.x.beta, s.run_ids, h.scale, h.chunk_size,
                                     be.zeros(Shape{pieces, hv, dk, dv}, sdt), scratch, finals_mine);
  Tensor no_values = be.zeros(Shape{t, hv, dk}, dt), scratch_k = be.empty(Shape{t, hv, dk}, dt);
  be.gated_delta_rule_forward_states(st, s.x.q, s.x.k, no_values, s.x.g, s.x.beta, s.run_ids, h.scale, h.chunk_size,
                                     identity_states(be, st, pieces, hv, dk, sdt), scratch_k, transitions_mine);
  s.finals = be.empty(Shape{plan.ranks * pmax * hv * dk, dv}, sdt);
  s.transitions = be.empty(Shape{plan.ranks * pmax * hv * dk, dk}, sdt);
  group.all_gather(st, finals.reshape(Shape{pmax * hv * dk, dv}), s.finals);
  group.all_gather(st, transitions.reshape(Shape{pmax * hv * dk, dk}), s.transitions);

  // The state entering each piece, along its chain of predecessors (rank order: no cycles).
  std::map<int, Tensor> entering;  // piece → [Hv·dk, dv]; absent: the zero state
  std::function<const Tensor*(int)> state_into = [&](int p) -> const Tensor* {
    const int q = plan.pieces[p].previous;
    if (q < 0) return nullptr;
    if (auto found = entering.find(p); found != entering.end()) return &found->second;
    const Tensor* before = state_into(q);
    Tensor state = be.empty(Shape{hv * dk, dv}, sdt);
    const int64_t slot = plan.slot(q);
    be.copy(st, s.finals.rows(slot * hv * dk, (slot + 1) * hv * dk), state);
    if (before)
      for (int64_t head = 0; head < hv; ++head) {
        Tensor out = state.rows(head * dk, (head + 1) * dk);
        be.gemm(st, head_block(s.transitions, slot, head, hv, dk), false, before->rows(head * dk, (head + 1) * dk),
                false, out, 1.0, 1.0);
      }
    return &entering.emplace(p, std::move(state)).first->second;
  };
  s.initial = be.zeros(Shape{pieces, hv, dk, dv}, sdt);
  for (int p = plan.first[plan.rank]; p < plan.first[plan.rank + 1]; ++p)
    if (const Tensor* state = state_into(p)) {
      const int64_t n = p - plan.first[plan.rank];
      Tensor into = s.initial.rows(n, n + 1).reshape(Shape{hv * dk, dv});
      be.copy(st, *state, into);
    }
  return s;
}

}  // namespace

void StatePassingDeltaNet::forward(Backend& be, Stream st, const MicroBatch& batch, const DeltaNetHeads& h,
                                   const Tensor& qkv, const Tensor& a, const Tensor& b, Tensor& core) {
  const StatePass s = prepare_pass(be, st, group_, batch, h, qkv, a, b);
  Tensor finals = be.empty(s.initial.shape(), s.initial.dtype());
  be.gated_delta_rule_forward_states(st, s.x.q, s.x.k, s.x.v, s.x.g, s.x.beta, s.run_ids, h.scale, h.chunk_size,
                                     s.initial, core, finals);
}

void StatePassingDeltaNet::backward(Backend& be, Stream st, const MicroBatch& batch, const DeltaNetHeads& h,
                                    const Tensor& qkv, const Tensor& a, const Tensor& b, const Tensor& d_core,
                                    Tensor& d_qkv, Tensor& da, Tensor& db) {
  const StatePass s = prepare_pass(be, st, group_, batch, h, qkv, a, b);
  const PiecePlan& plan = s.plan;
  const int64_t t = qkv.dim(0), c = qkv.dim(1), hv = h.value_heads, dk = h.key_dim, dv = h.value_dim;
  const int64_t pieces = plan.local_pieces(), pmax = plan.max_pieces;
  const DType dt = qkv.dtype(), sdt = s.initial.dtype();
  RuleGrads d = empty_rule_grads(be, s.x);

  // ∂L/∂S_0 of each local piece from its own outputs alone (nothing from its final state), gathered.
  Tensor own = be.zeros(Shape{pmax, hv, dk, dv}, sdt);
  Tensor own_mine = own.rows(0, pieces);
  be.gated_delta_rule_backward_states(st, s.x.q, s.x.k, s.x.v, s.x.g, s.x.beta, s.run_ids, h.scale, h.chunk_size,
                                      s.initial, d_core, be.zeros(s.initial.shape(), sdt), d.dq, d.dk, d.dv, d.dg,
                                      d.dbeta, own_mine);
  Tensor owns = be.empty(Shape{plan.ranks * pmax * hv * dk, dv}, sdt);
  group_.all_gather(st, own.reshape(Shape{pmax * hv * dk, dv}), owns);

  // ∂L/∂S_end of each piece along its chain of successors: the next piece's ∂L/∂S_0 in full,
  // Pᵀ·∂L/∂S_end(next) + own(next).
  std::map<int, Tensor> leaving;  // piece → [Hv·dk, dv]; absent: zero
  std::function<const Tensor*(int)> gradient_out_of = [&](int p) -> const Tensor* {
    const int n = plan.pieces[p].next;
    if (n < 0) return nullptr;
    if (auto found = leaving.find(p); found != leaving.end()) return &found->second;
    const Tensor* after = gradient_out_of(n);
    Tensor grad = be.empty(Shape{hv * dk, dv}, sdt);
    const int64_t slot = plan.slot(n);
    be.copy(st, owns.rows(slot * hv * dk, (slot + 1) * hv * dk), grad);
    if (after)
      for (int64_t head = 0; head < hv; ++head) {
        Tensor out = grad.rows(head * dk, (head + 1) * dk);
        be.gemm(st, head_block(s.transitions, slot, head, hv, dk), true, after->rows(head * dk, (head + 1) * dk),
                false, out, 1.0, 1.0);
      }
    return &leaving.emplace(p, std::move(grad)).first->second;
  };
  Tensor d_final = be.zeros(s.initial.shape(), sdt);
  for (int p = plan.first[plan.rank]; p < plan.first[plan.rank + 1]; ++p)
    if (const Tensor* grad = gradient_out_of(p)) {
      const int64_t n = p - plan.first[plan.rank];
      Tensor into = d_final.rows(n, n + 1).reshape(Shape{hv * dk, dv});
      be.copy(st, *grad, into);
    }

  // The delta rule's backward with what later ranks make of each piece's final state.
  Tensor d_initial = be.empty(s.initial.shape(), sdt);
  be.gated_delta_rule_backward_states(st, s.x.q, s.x.k, s.x.v, s.x.g, s.x.beta, s.run_ids, h.scale, h.chunk_size,
                                      s.initial, d_core, d_final, d.dq, d.dk, d.dv, d.dg, d.dbeta, d_initial);
  Tensor d_mixed = be.empty(Shape{t, c}, dt);
  rule_inputs_backward(be, st, h, s.x, a, d, d_mixed, da, db);

  // Back through the conv over the extended rows, then to the rows' owners.
  const int64_t e = s.ext.dim(0), gathered_rows = plan.ranks * plan.halo_slots;
  Tensor d_mixed_ext = be.zeros(Shape{e, c}, dt);
  be.scatter_add_rows(st, d_mixed, s.token_ext_row, d_mixed_ext);
  Tensor d_ext = be.empty(Shape{e, c}, dt);
  be.causal_conv1d_silu_backward(st, s.ext, h.conv, s.ext_run, d_mixed_ext, d_ext, h.conv_grad);
  Tensor d_source = be.zeros(Shape{t + gathered_rows, c}, dt);
  be.scatter_add_rows(st, d_ext, s.ext_source, d_source);
  be.copy(st, d_source.rows(0, t), d_qkv);
  Tensor d_halo = be.empty(Shape{plan.halo_slots, c}, dt);
  group_.reduce_scatter_sum(st, d_source.rows(t, t + gathered_rows), d_halo);
  be.scatter_add_rows(st, d_halo, s.halo_send, d_qkv);
}

}  // namespace spindle::parallel
