// The gated delta rule with states entering and leaving every run (gated_delta_rule_forward_states /
// _backward_states), which sequence parallelism uses to carry a document's recurrence from rank to
// rank: the backward against F64 finite differences (the initial states included), the result
// independent of the chunk size, zero initial states equal to the plain op, and a document cut in
// two pieces, the second started from the first's final state, equal to the document in one piece
// (forward, and backward with ∂L/∂(first final state) = ∂L/∂(second initial state)).
#include <gtest/gtest.h>

#include <random>

#include "backend/backend.h"
#include "finite_differences.h"

using namespace spindle;
using namespace spindle::test;

namespace {

constexpr int64_t kHk = 2, kDk = 3, kHv = 4, kDv = 2;

struct Inputs {
  int64_t tokens = 0, runs = 0;
  Tensor q, k, v, g, beta, ids;
};

// Random inputs over runs of the given lengths (ids 0, 1, …); slow decay so states matter.
Inputs make_inputs(Backend& be, std::mt19937_64& rng, const std::vector<int>& lengths, DType dtype = DType::F64) {
  Inputs in;
  std::vector<int> ids;
  for (size_t r = 0; r < lengths.size(); ++r) ids.insert(ids.end(), lengths[r], static_cast<int>(r));
  in.tokens = static_cast<int64_t>(ids.size());
  in.runs = static_cast<int64_t>(lengths.size());
  in.q = random_tensor(be, Shape{in.tokens, kHk, kDk}, dtype, rng, 0.6);
  in.k = random_tensor(be, Shape{in.tokens, kHk, kDk}, dtype, rng, 0.6);
  in.v = random_tensor(be, Shape{in.tokens, kHv, kDv}, dtype, rng);
  std::uniform_real_distribution<double> decay(-0.2, -0.01), strength(0.1, 0.9);
  std::vector<double> gs(in.tokens * kHv), betas(in.tokens * kHv);
  for (double& x : gs) x = decay(rng);
  for (double& x : betas) x = strength(rng);
  in.g = be.empty(Shape{in.tokens, kHv}, dtype);
  in.beta = be.empty(Shape{in.tokens, kHv}, dtype);
  from_host(be, gs, in.g);
  from_host(be, betas, in.beta);
  in.ids = int_tensor(be, ids);
  return in;
}

Shape state_shape(int64_t runs) { return Shape{runs, kHv, kDk, kDv}; }

struct Forward {
  std::vector<double> out, finals;
};

Forward forward(Backend& be, const Inputs& in, const Tensor& initial, int64_t chunk, double scale = 0.6) {
  Tensor out = be.empty(in.v.shape(), in.v.dtype()), finals = be.empty(initial.shape(), initial.dtype());
  be.gated_delta_rule_forward_states(be.default_stream(), in.q, in.k, in.v, in.g, in.beta, in.ids, scale, chunk,
                                     initial, out, finals);
  return {to_host(be, out), to_host(be, finals)};
}

struct Backward {
  std::vector<double> dq, dk, dv, dg, dbeta, d_initial;
};

Backward backward(Backend& be, const Inputs& in, const Tensor& initial, const Tensor& dout, const Tensor& d_final,
                  int64_t chunk, double scale = 0.6) {
  const DType dt = in.v.dtype();
  Tensor dq = be.empty(in.q.shape(), dt), dk = be.empty(in.k.shape(), dt), dv = be.empty(in.v.shape(), dt);
  Tensor dg = be.empty(in.g.shape(), dt), dbeta = be.empty(in.beta.shape(), dt);
  Tensor d_initial = be.empty(initial.shape(), dt);
  be.gated_delta_rule_backward_states(be.default_stream(), in.q, in.k, in.v, in.g, in.beta, in.ids, scale, chunk,
                                      initial, dout, d_final, dq, dk, dv, dg, dbeta, d_initial);
  return {to_host(be, dq), to_host(be, dk), to_host(be, dv), to_host(be, dg), to_host(be, dbeta),
          to_host(be, d_initial)};
}

// Rows [begin, end) of a [T, …] host vector of `width` values per token.
std::vector<double> token_rows(const std::vector<double>& x, int64_t width, int64_t begin, int64_t end) {
  return {x.begin() + begin * width, x.begin() + end * width};
}

class GatedDeltaStates : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
  std::mt19937_64 rng{91};
};

}  // namespace

TEST_F(GatedDeltaStates, BackwardMatchesFiniteDifferences) {
  // Three runs (5, 3 and 4 tokens) with chunks of 3: every run enters with its own state, states
  // cross chunk boundaries, and every final state reaches the objective.
  Inputs in = make_inputs(*be, rng, {5, 3, 4});
  Tensor initial = random_tensor(*be, state_shape(in.runs), DType::F64, rng, 0.5);
  Tensor proj = random_tensor(*be, in.v.shape(), DType::F64, rng);
  Tensor proj_final = random_tensor(*be, state_shape(in.runs), DType::F64, rng);
  const int64_t chunk = 3;
  Tensor out = be->empty(in.v.shape(), DType::F64), finals = be->empty(initial.shape(), DType::F64);
  auto objective = [&] {
    be->gated_delta_rule_forward_states(be->default_stream(), in.q, in.k, in.v, in.g, in.beta, in.ids, 0.6, chunk,
                                        initial, out, finals);
    return dot(*be, out, proj) + dot(*be, finals, proj_final);
  };
  const Backward grads = backward(*be, in, initial, proj, proj_final, chunk);
  expect_gradient(*be, in.q, objective, grads.dq, 1e-7, "dq");
  expect_gradient(*be, in.k, objective, grads.dk, 1e-7, "dk");
  expect_gradient(*be, in.v, objective, grads.dv, 1e-7, "dv");
  expect_gradient(*be, in.g, objective, grads.dg, 1e-7, "dg");
  expect_gradient(*be, in.beta, objective, grads.dbeta, 1e-7, "dbeta");
  expect_gradient(*be, initial, objective, grads.d_initial, 1e-7, "d_initial_states");
}

TEST_F(GatedDeltaStates, ChunkSizeDoesNotChangeTheResult) {
  Inputs in = make_inputs(*be, rng, {70, 33});
  Tensor initial = random_tensor(*be, state_shape(in.runs), DType::F64, rng, 0.5);
  Tensor dout = random_tensor(*be, in.v.shape(), DType::F64, rng);
  Tensor d_final = random_tensor(*be, state_shape(in.runs), DType::F64, rng);
  const Forward f64 = forward(*be, in, initial, 64);
  const Backward b64 = backward(*be, in, initial, dout, d_final, 64);
  for (int64_t chunk : {16, 5, 1}) {
    const Forward f = forward(*be, in, initial, chunk);
    EXPECT_LE(max_abs_difference(f.out, f64.out), 1e-12) << "out, chunk " << chunk;
    EXPECT_LE(max_abs_difference(f.finals, f64.finals), 1e-12) << "final states, chunk " << chunk;
    const Backward b = backward(*be, in, initial, dout, d_final, chunk);
    EXPECT_LE(relative_error(b.dq, b64.dq), 1e-12) << "dq, chunk " << chunk;
    EXPECT_LE(relative_error(b.dk, b64.dk), 1e-12) << "dk, chunk " << chunk;
    EXPECT_LE(relative_error(b.dv, b64.dv), 1e-12) << "dv, chunk " << chunk;
    EXPECT_LE(relative_error(b.dg, b64.dg), 1e-12) << "dg, chunk " << chunk;
    EXPECT_LE(relative_error(b.dbeta, b64.dbeta), 1e-12) << "dbeta, chunk " << chunk;
    EXPECT_LE(relative_error(b.d_initial, b64.d_initial), 1e-12) << "d_initial_states, chunk " << chunk;
  }
}

TEST_F(GatedDeltaStates, ZeroInitialStatesGiveThePlainOp) {
  for (DType dtype : {DType::F64, DType::F32}) {
    Inputs in = make_inputs(*be, rng, {9, 4, 6}, dtype);
    Tensor zeros = be->zeros(state_shape(in.runs), dtype);
    Tensor dout = random_tensor(*be, in.v.shape(), dtype, rng);
    Tensor plain = be->empty(in.v.shape(), dtype);
    be->gated_delta_rule_forward(be->default_stream(), in.q, in.k, in.v, in.g, in.beta, in.ids, 0.6, 4, plain);
    EXPECT_EQ(forward(*be, in, zeros, 4).out, to_host(*be, plain));
    Tensor dq = be->empty(in.q.shape(), dtype), dk = be->empty(in.k.shape(), dtype);
    Tensor dv = be->empty(in.v.shape(), dtype);
    Tensor dg = be->empty(in.g.shape(), dtype), dbeta = be->empty(in.beta.shape(), dtype);
    be->gated_delta_rule_backward(be->default_stream(), in.q, in.k, in.v, in.g, in.beta, in.ids, 0.6, 4, dout, dq, dk,
                                  dv, dg, dbeta);
    const Backward b = backward(*be, in, zeros, dout, zeros, 4);
    EXPECT_EQ(b.dq, to_host(*be, dq));
    EXPECT_EQ(b.dk, to_host(*be, dk));
    EXPECT_EQ(b.dv, to_host(*be, dv));
    EXPECT_EQ(b.dg, to_host(*be, dg));
    EXPECT_EQ(b.dbeta, to_host(*be, dbeta));
  }
}

TEST_F(GatedDeltaStates, ADocumentCutInTwoPiecesEqualsItInOne) {
  // One run of 23 tokens, then the same tokens as two runs (10 + 13): the second piece starts from
  // the first's final state; in backward the first piece's ∂L/∂(final state) is the second's
  // ∂L/∂(initial state). Chunks of 4 fall differently in the two runs.
  const int64_t first = 10, tokens = 23;
  Inputs whole = make_inputs(*be, rng, {static_cast<int>(tokens)});
  Tensor initial = random_tensor(*be, state_shape(1), DType::F64, rng, 0.5);
  Tensor dout = random_tensor(*be, whole.v.shape(), DType::F64, rng);
  Tensor d_final = random_tensor(*be, state_shape(1), DType::F64, rng);
  const Forward want = forward(*be, whole, initial, 4);
  const Backward want_grads = backward(*be, whole, initial, dout, d_final, 4);

  auto piece = [&](int64_t begin, int64_t end) {
    Inputs p;
    p.tokens = end - begin;
    p.runs = 1;
    p.q = whole.q.rows(begin, end);
    p.k = whole.k.rows(begin, end);
    p.v = whole.v.rows(begin, end);
    p.g = whole.g.rows(begin, end);
    p.beta = whole.beta.rows(begin, end);
    p.ids = whole.ids.rows(begin, end);
    return p;
  };
  const Inputs a = piece(0, first), b = piece(first, tokens);
  const Forward fa = forward(*be, a, initial, 4);
  Tensor middle = be->empty(state_shape(1), DType::F64);
  from_host(*be, fa.finals, middle);
  const Forward fb = forward(*be, b, middle, 4);
  EXPECT_LE(max_abs_difference(fa.out, token_rows(want.out, kHv * kDv, 0, first)), 1e-13);
  EXPECT_LE(max_abs_difference(fb.out, token_rows(want.out, kHv * kDv, first, tokens)), 1e-13);
  EXPECT_LE(max_abs_difference(fb.finals, want.finals), 1e-13);

  const Backward gb = backward(*be, b, middle, dout.rows(first, tokens), d_final, 4);
  Tensor d_middle = be->empty(state_shape(1), DType::F64);
  from_host(*be, gb.d_initial, d_middle);
  const Backward ga = backward(*be, a, initial, dout.rows(0, first), d_middle, 4);
  const int64_t kw = kHk * kDk, vw = kHv * kDv;
  EXPECT_LE(relative_error(ga.dq, token_rows(want_grads.dq, kw, 0, first)), 1e-12);
  EXPECT_LE(relative_error(gb.dq, token_rows(want_grads.dq, kw, first, tokens)), 1e-12);
  EXPECT_LE(relative_error(ga.dk, token_rows(want_grads.dk, kw, 0, first)), 1e-12);
  EXPECT_LE(relative_error(gb.dk, token_rows(want_grads.dk, kw, first, tokens)), 1e-12);
  EXPECT_LE(relative_error(ga.dv, token_rows(want_grads.dv, vw, 0, first)), 1e-12);
  EXPECT_LE(relative_error(gb.dv, token_rows(want_grads.dv, vw, first, tokens)), 1e-12);
  EXPECT_LE(relative_error(ga.dg, token_rows(want_grads.dg, kHv, 0, first)), 1e-12);
  EXPECT_LE(relative_error(gb.dg, token_rows(want_grads.dg, kHv, first, tokens)), 1e-12);
  EXPECT_LE(relative_error(ga.dbeta, token_rows(want_grads.dbeta, kHv, 0, first)), 1e-12);
  EXPECT_LE(relative_error(gb.dbeta, token_rows(want_grads.dbeta, kHv, first, tokens)), 1e-12);
  EXPECT_LE(relative_error(ga.d_initial, want_grads.d_initial), 1e-12);
}
