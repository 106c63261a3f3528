// The chunked gated delta rule of the CPU backend: its backward against finite differences, the
// result independent of the chunk size (and equal to the plain per-token recurrence), and packed
// documents exact: the state restarts at every document boundary, checked with slow-decay heads
// (exp(g) ≈ 1), since a fast decay would hide a state leaking from one document into the next.
#include <gtest/gtest.h>

#include <random>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

namespace {

struct DeltaCase {
  int64_t tokens, key_heads, dk, value_heads, dv;
  std::vector<int> doc_ids;
  Tensor q, k, v, g, beta, ids;
};

// Random inputs; g uniform in [g_low, g_high] (≤ 0), beta in [0.1, 0.9].
DeltaCase make_case(Backend& be, std::mt19937_64& rng, std::vector<int> doc_ids, int64_t hk, int64_t dk, int64_t hv,
                    int64_t dv, double g_low, double g_high, DType dtype = DType::F64) {
  DeltaCase c{static_cast<int64_t>(doc_ids.size()), hk, dk, hv, dv, std::move(doc_ids), {}, {}, {}, {}, {}, {}};
  const int64_t t = c.tokens;
  c.q = random_tensor(be, Shape{t, hk, dk}, dtype, rng, 0.6);
  c.k = random_tensor(be, Shape{t, hk, dk}, dtype, rng, 0.6);
  c.v = random_tensor(be, Shape{t, hv, dv}, dtype, rng);
  std::uniform_real_distribution<double> decay(g_low, g_high), strength(0.1, 0.9);
  std::vector<double> gs(t * hv), betas(t * hv);
  for (double& x : gs) x = decay(rng);
  for (double& x : betas) x = strength(rng);
  c.g = be.empty(Shape{t, hv}, dtype);  // the stat dtype of an F32 or F64 model is its own
  c.beta = be.empty(Shape{t, hv}, dtype);
  from_host(be, gs, c.g);
  from_host(be, betas, c.beta);
  c.ids = int_tensor(be, c.doc_ids);
  return c;
}

std::vector<double> run_forward(Backend& be, const DeltaCase& c, double scale, int64_t chunk) {
  Tensor out = be.empty(c.v.shape(), c.v.dtype());
  be.gated_delta_rule_forward(be.default_stream(), c.q, c.k, c.v, c.g, c.beta, c.ids, scale, chunk, out);
  return to_host(be, out);
}

struct Grads {
  std::vector<double> dq, dk, dv, dg, dbeta;
};

Grads run_backward(Backend& be, const DeltaCase& c, double scale, int64_t chunk, const Tensor& dout) {
  const DType dt = c.v.dtype();
  Tensor dq = be.empty(c.q.shape(), dt), dk = be.empty(c.k.shape(), dt), dv = be.empty(c.v.shape(), dt);
  Tensor dg = be.empty(c.g.shape(), dt), dbeta = be.empty(c.beta.shape(), dt);
  be.gated_delta_rule_backward(be.default_stream(), c.q, c.k, c.v, c.g, c.beta, c.ids, scale, chunk, dout, dq, dk, dv,
                               dg, dbeta);
  return {to_host(be, dq), to_host(be, dk), to_host(be, dv), to_host(be, dg), to_host(be, dbeta)};
}

// The definition, token by token (transformers' recurrent form): per document and value head,
//   S ← exp(g_t)·S;  S ← S + k_t·(β_t·(v_t − Sᵀk_t))ᵀ;  out_t = Sᵀ·(scale·q_t).
std::vector<double> token_recurrence(Backend& be, const DeltaCase& c, double scale) {
  const auto q = to_host(be, c.q), k = to_host(be, c.k), v = to_host(be, c.v), g = to_host(be, c.g),
             beta = to_host(be, c.beta);
  const int64_t group = c.value_heads / c.key_heads, dk = c.dk, dv = c.dv;
  std::vector<double> out(c.tokens * c.value_heads * dv, 0.0);
  for (int64_t h = 0; h < c.value_heads; ++h) {
    const int64_t kh = h / group;
    std::vector<double> S(dk * dv, 0.0);
    for (int64_t t = 0; t < c.tokens; ++t) {
      if (t == 0 || c.doc_ids[t] != c.doc_ids[t - 1]) std::fill(S.begin(), S.end(), 0.0);
      const double* kt = &k[(t * c.key_heads + kh) * dk];
      const double* qt = &q[(t * c.key_heads + kh) * dk];
      const double* vt = &v[(t * c.value_heads + h) * dv];
      const double b = beta[t * c.value_heads + h];
      for (double& s : S) s *= std::exp(g[t * c.value_heads + h]);
      for (int64_t e = 0; e < dv; ++e) {
        double mem = 0;
        for (int64_t a = 0; a < dk; ++a) mem += S[a * dv + e] * kt[a];
        const double delta = b * (vt[e] - mem);
        for (int64_t a = 0; a < dk; ++a) S[a * dv + e] += kt[a] * delta;
      }
      for (int64_t e = 0; e < dv; ++e) {
        double o = 0;
        for (int64_t a = 0; a < dk; ++a) o += S[a * dv + e] * scale * qt[a];
        out[(t * c.value_heads + h) * dv + e] = o;
      }
    }
  }
  return out;
}

std::vector<int> documents(std::initializer_list<std::pair<int, int>> id_and_length) {
  std::vector<int> ids;
  for (auto [id, length] : id_and_length) ids.insert(ids.end(), length, id);
  return ids;
}

class GatedDeltaRule : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::mt19937_64 rng{77};
};

}  // namespace

TEST_F(GatedDeltaRule, BackwardMatchesFiniteDifferences) {
  // Two documents (6 and 4 tokens) and a padding token, chunks of 4: full and partial chunks, a
  // state carried across a chunk boundary, two value heads per key head.
  DeltaCase c = make_case(*be, rng, documents({{0, 6}, {1, 4}, {-1, 1}}), 2, 3, 4, 2, -0.6, -0.05);
  const double scale = 0.7;
  const int64_t chunk = 4;
  Tensor proj = random_tensor(*be, c.v.shape(), DType::F64, rng);
  Tensor out = be->empty(c.v.shape(), DType::F64);
  auto objective = [&] {
    be->gated_delta_rule_forward(be->default_stream(), c.q, c.k, c.v, c.g, c.beta, c.ids, scale, chunk, out);
    return dot(*be, out, proj);
  };
  const Grads grads = run_backward(*be, c, scale, chunk, proj);
  expect_gradient(*be, c.q, objective, grads.dq, 1e-7, "dq");
  expect_gradient(*be, c.k, objective, grads.dk, 1e-7, "dk");
  expect_gradient(*be, c.v, objective, grads.dv, 1e-7, "dv");
  expect_gradient(*be, c.g, objective, grads.dg, 1e-7, "dg");
  expect_gradient(*be, c.beta, objective, grads.dbeta, 1e-7, "dbeta");
}

TEST_F(GatedDeltaRule, ChunkSizeDoesNotChangeTheResult) {
  // 100 + 50 tokens: chunks of 64 and 16 split the documents differently; chunk 1 is the
  // recurrence one token at a time.
  DeltaCase c = make_case(*be, rng, documents({{0, 100}, {1, 50}}), 1, 4, 2, 3, -0.3, -0.01);
  const double scale = 0.5;
  const std::vector<double> reference = token_recurrence(*be, c, scale);
  for (int64_t chunk : {64, 16, 7, 1})
    EXPECT_LE(max_abs_difference(run_forward(*be, c, scale, chunk), reference), 1e-12) << "chunk " << chunk;

  Tensor dout = random_tensor(*be, c.v.shape(), DType::F64, rng);
  const Grads g64 = run_backward(*be, c, scale, 64, dout);
  for (int64_t chunk : {16, 1}) {
    const Grads other = run_backward(*be, c, scale, chunk, dout);
    EXPECT_LE(relative_error(other.dq, g64.dq), 1e-12) << "dq, chunk " << chunk;
    EXPECT_LE(relative_error(other.dk, g64.dk), 1e-12) << "dk, chunk " << chunk;
    EXPECT_LE(relative_error(other.dv, g64.dv), 1e-12) << "dv, chunk " << chunk;
    EXPECT_LE(relative_error(other.dg, g64.dg), 1e-12) << "dg, chunk " << chunk;
    EXPECT_LE(relative_error(other.dbeta, g64.dbeta), 1e-12) << "dbeta, chunk " << chunk;
  }
}

TEST_F(GatedDeltaRule, F32MatchesTheRecurrenceToItsRounding) {
  DeltaCase c = make_case(*be, rng, documents({{0, 90}, {1, 40}}), 2, 4, 2, 4, -0.2, -0.001, DType::F32);
  const double scale = 0.5;
  const std::vector<double> reference = token_recurrence(*be, c, scale);
  for (int64_t chunk : {64, 16})
    EXPECT_LE(relative_error(run_forward(*be, c, scale, chunk), reference), 1e-6) << "chunk " << chunk;
}

TEST_F(GatedDeltaRule, PackedDocumentsWithSlowDecayGiveWhatEachGivesAlone) {
  // exp(g) ≥ 0.999: a state leaking across the boundary would survive into the whole second document.
  const int64_t first = 40, second = 30;
  DeltaCase packed = make_case(*be, rng, documents({{0, first}, {1, second}}), 1, 4, 2, 3, -1e-3, -1e-4);
  const double scale = 0.5;
  const int64_t chunk = 16;  // the boundary falls inside a chunk of the packed row
  const std::vector<double> packed_out = run_forward(*be, packed, scale, chunk);
  Tensor dout = random_tensor(*be, packed.v.shape(), DType::F64, rng);
  const Grads packed_grads = run_backward(*be, packed, scale, chunk, dout);

  // Each document alone: its rows of every input.
  auto rows = [&](const Tensor& t, int64_t begin, int64_t count) {
    const int64_t width = t.numel() / t.dim(0);
    const auto all = to_host(*be, t);
    Shape shape{count};
    for (int d = 1; d < t.rank(); ++d) shape.push(t.dim(d));
    Tensor out = be->empty(shape, t.dtype());
    from_host(*be, std::vector<double>(all.begin() + begin * width, all.begin() + (begin + count) * width), out);
    return out;
  };
  auto slice = [&](const std::vector<double>& all, int64_t width, int64_t begin, int64_t count) {
    return std::vector<double>(all.begin() + begin * width, all.begin() + (begin + count) * width);
  };
  const int64_t vw = packed.value_heads * packed.dv, kw = packed.key_heads * packed.dk, hw = packed.value_heads;
  for (auto [begin, count] : {std::pair<int64_t, int64_t>{0, first}, {first, second}}) {
    DeltaCase alone = packed;
    alone.tokens = count;
    alone.doc_ids.assign(count, 5);
    alone.q = rows(packed.q, begin, count);
    alone.k = rows(packed.k, begin, count);
    alone.v = rows(packed.v, begin, count);
    alone.g = rows(packed.g, begin, count);
    alone.beta = rows(packed.beta, begin, count);
    alone.ids = int_tensor(*be, alone.doc_ids);
    EXPECT_EQ(run_forward(*be, alone, scale, chunk), slice(packed_out, vw, begin, count)) << "document at " << begin;
    const Grads g = run_backward(*be, alone, scale, chunk, rows(dout, begin, count));
    EXPECT_EQ(g.dq, slice(packed_grads.dq, kw, begin, count));
    EXPECT_EQ(g.dk, slice(packed_grads.dk, kw, begin, count));
    EXPECT_EQ(g.dv, slice(packed_grads.dv, vw, begin, count));
    EXPECT_EQ(g.dg, slice(packed_grads.dg, hw, begin, count));
    EXPECT_EQ(g.dbeta, slice(packed_grads.dbeta, hw, begin, count));
  }

  // The test can see a leak: the same tokens as one document change the second document's output.
  DeltaCase joined = packed;
  joined.doc_ids.assign(first + second, 0);
  joined.ids = int_tensor(*be, joined.doc_ids);
  const std::vector<double> joined_out = run_forward(*be, joined, scale, chunk);
  EXPECT_GT(max_abs_difference(slice(joined_out, vw, first, second), slice(packed_out, vw, first, second)), 1e-2);
}
