// The gated delta rule with given entering states and returned leaving states, one per run of
// equal run ids: the same chunked computation as gated_delta_ops.cpp (gated_delta_chunk.h), the
// state of run n starting at initial_states[n] instead of zero. With zero initial states the
// outputs and gradients are those of gated_delta_rule_forward / _backward.
#include "backend/cpu/gated_delta_state_ops.h"

#include "backend/cpu/gated_delta_chunk.h"

namespace spindle::cpu {

using namespace delta;

namespace {

// The runs of run_ids and the states' layout: [N, Hv, dk, dv], N runs.
void check_states(const DeltaShape& s, size_t runs, const Tensor& states, const char* what) {
  require_float(states, what);
  SPINDLE_CHECK(states.numel() == static_cast<int64_t>(runs) * s.value_heads * s.dk * s.dv,
                "{}: {} for {} runs of {} value heads with [{}, {}] states", what, states.describe(), runs,
                s.value_heads, s.dk, s.dv);
}

// State n of head h in a flat [N, Hv, dk, dv] vector.
size_t state_offset(const DeltaShape& s, size_t run, int64_t head) {
  return (run * static_cast<size_t>(s.value_heads) + static_cast<size_t>(head)) * static_cast<size_t>(s.dk * s.dv);
}

}  // namespace

void gated_delta_rule_forward_states(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                     const Tensor& beta, const Tensor& run_ids, double scale, int64_t chunk_size,
                                     const Tensor& initial_states, Tensor& out, Tensor& final_states) {
  const DeltaInputs in = delta_inputs(q, k, v, g, beta, run_ids, chunk_size);
  const DeltaShape& s = in.s;
  SPINDLE_CHECK(out.shape() == v.shape(), "gated_delta_rule_forward_states: out {} for v {}", out.describe(),
                v.describe());
  check_states(s, in.runs.size(), initial_states, "gated_delta_rule_forward_states initial_states");
  check_states(s, in.runs.size(), final_states, "gated_delta_rule_forward_states final_states");
  const std::vector<double> initial = values(initial_states, "gated_delta_rule initial_states");
  std::vector<double> o(static_cast<size_t>(s.tokens * s.value_heads * s.dv), 0.0), finals(initial.size(), 0.0);
#pragma omp parallel for schedule(dynamic, 1) if (s.value_heads > 1)
  for (int64_t h = 0; h < s.value_heads; ++h) {
    Chunk chunk;
    std::vector<double> S(s.dk * s.dv), rows;
    for (size_t n = 0; n < in.runs.size(); ++n) {
      const auto [begin, end] = in.runs[n];
      std::copy_n(initial.begin() + static_cast<std::ptrdiff_t>(state_offset(s, n, h)), s.dk * s.dv, S.begin());
      for (int64_t c0 = begin; c0 < end; c0 += chunk_size) {
        chunk.load(s, in.q, in.k, in.v, in.g, in.beta, h, c0, std::min(chunk_size, end - c0), scale);
        chunk.solve(S);
        rows.assign(chunk.n * s.dv, 0.0);
        chunk.output(S, rows.data());
        chunk.advance(S);
        for (int64_t r = 0; r < chunk.n; ++r)
          std::copy(&rows[r * s.dv], &rows[r * s.dv] + s.dv, &o[((c0 + r) * s.value_heads + h) * s.dv]);
      }
      std::copy(S.begin(), S.end(), finals.begin() + static_cast<std::ptrdiff_t>(state_offset(s, n, h)));
    }
  }
  store(out, o, "gated_delta_rule_forward_states out");
  store(final_states, finals, "gated_delta_rule_forward_states final_states");
}

void gated_delta_rule_backward_states(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                      const Tensor& beta, const Tensor& run_ids, double scale, int64_t chunk_size,
                                      const Tensor& initial_states, const Tensor& dout, const Tensor& d_final_states,
                                      Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dg, Tensor& dbeta,
                                      Tensor& d_initial_states) {
  const DeltaInputs in = delta_inputs(q, k, v, g, beta, run_ids, chunk_size);
  const DeltaShape& s = in.s;
  SPINDLE_CHECK(dout.shape() == v.shape() && dq.shape() == q.shape() && dk.shape() == k.shape() &&
                    dv.shape() == v.shape() && dg.numel() == g.numel() && dbeta.numel() == beta.numel(),
                "gated_delta_rule_backward_states: dout {} dq {} dk {} dv {} dg {} dbeta {}", dout.describe(),
                dq.describe(), dk.describe(), dv.describe(), dg.describe(), dbeta.describe());
  const size_t runs = in.runs.size();
  check_states(s, runs, initial_states, "gated_delta_rule_backward_states initial_states");
  check_states(s, runs, d_final_states, "gated_delta_rule_backward_states d_final_states");
  check_states(s, runs, d_initial_states, "gated_delta_rule_backward_states d_initial_states");
  const std::vector<double> douts = values(dout, "gated_delta_rule dout"),
                            initial = values(initial_states, "gated_delta_rule initial_states"),
                            d_final = values(d_final_states, "gated_delta_rule d_final_states");
  std::vector<double> dqs(in.q.size(), 0.0), dks(in.k.size(), 0.0), dvs(in.v.size(), 0.0), dgs(in.g.size(), 0.0),
      dbetas(in.beta.size(), 0.0), d_initial(initial.size(), 0.0);
  // Parallel over key heads: the value heads that share a key head add into its dq and dk.
#pragma omp parallel for schedule(dynamic, 1) if (s.key_heads > 1)
  for (int64_t kh = 0; kh < s.key_heads; ++kh) {
    Chunk chunk;
    std::vector<double> cq, ck, cv, cb, cg, rows_dout;
    for (int64_t h = kh * s.group; h < (kh + 1) * s.group; ++h)
      for (size_t n = 0; n < runs; ++n) {
        const auto [begin, end] = in.runs[n];
        const auto at = static_cast<std::ptrdiff_t>(state_offset(s, n, h));
        // The state entering each chunk of the run, recomputed from the run's initial state.
        std::vector<int64_t> starts;
        std::vector<std::vector<double>> states;
        std::vector<double> S(initial.begin() + at, initial.begin() + at + s.dk * s.dv);
        for (int64_t c0 = begin; c0 < end; c0 += chunk_size) {
          starts.push_back(c0);
          states.push_back(S);
          chunk.load(s, in.q, in.k, in.v, in.g, in.beta, h, c0, std::min(chunk_size, end - c0), scale);
          chunk.solve(S);
          chunk.advance(S);
        }
        // ∂L/∂(the run's last state) as given, carried back chunk by chunk to ∂L/∂(its initial state).
        std::vector<double> dS(d_final.begin() + at, d_final.begin() + at + s.dk * s.dv);
        for (size_t c = starts.size(); c-- > 0;) {
          const int64_t c0 = starts[c];
          chunk.load(s, in.q, in.k, in.v, in.g, in.beta, h, c0, std::min(chunk_size, end - c0), scale);
          chunk.solve(states[c]);
          rows_dout.assign(chunk.n * s.dv, 0.0);
          for (int64_t r = 0; r < chunk.n; ++r)
            std::copy(&douts[((c0 + r) * s.value_heads + h) * s.dv],
                      &douts[((c0 + r) * s.value_heads + h) * s.dv] + s.dv, &rows_dout[r * s.dv]);
          chunk.backward(states[c], rows_dout.data(), dS, cq, ck, cv, cb, cg);
          for (int64_t r = 0; r < chunk.n; ++r) {
            const int64_t t = c0 + r;
            for (int64_t e = 0; e < s.dk; ++e) {
              dqs[(t * s.key_heads + kh) * s.dk + e] += scale * cq[r * s.dk + e];
              dks[(t * s.key_heads + kh) * s.dk + e] += ck[r * s.dk + e];
            }
            for (int64_t e = 0; e < s.dv; ++e) dvs[(t * s.value_heads + h) * s.dv + e] = cv[r * s.dv + e];
            dgs[t * s.value_heads + h] = cg[r];
            dbetas[t * s.value_heads + h] = cb[r];
          }
        }
        std::copy(dS.begin(), dS.end(), d_initial.begin() + at);
      }
  }
  store(dq, dqs, "gated_delta_rule_backward_states dq");
  store(dk, dks, "gated_delta_rule_backward_states dk");
  store(dv, dvs, "gated_delta_rule_backward_states dv");
  store(dg, dgs, "gated_delta_rule_backward_states dg");
  store(dbeta, dbetas, "gated_delta_rule_backward_states dbeta");
  store(d_initial_states, d_initial, "gated_delta_rule_backward_states d_initial_states");
}

}  // namespace spindle::cpu
