// The chunked gated delta rule of the CPU backend, shared by gated_delta_ops.cpp (documents
// starting from the zero state) and gated_delta_state_ops.cpp (runs entering and leaving with given
// states). Internal to the CPU backend; everything is computed in double.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <utility>
#include <vector>

#include "core/error.h"
#include "core/tensor.h"

namespace spindle::cpu::delta {

inline void require_float(const Tensor& t, const char* what) {
  SPINDLE_CHECK(t.defined(), "{}: tensor not allocated", what);
  SPINDLE_CHECK(t.device().kind == DeviceKind::CPU, "{}: tensor {} is not on the CPU", what, t.describe());
  if (t.dtype() != DType::F32 && t.dtype() != DType::F64)
    fail("{}: the CPU backend computes in F32 or F64, got {}", what, t.describe());
}

inline void require_ids(const Tensor& t, int64_t tokens, const char* what) {
  SPINDLE_CHECK(t.defined() && t.device().kind == DeviceKind::CPU && t.dtype() == DType::I32 && t.numel() == tokens,
                "{}: document ids must be I32 [{}] on the CPU, got {}", what, tokens, t.describe());
}

// Host doubles of an F32/F64 tensor.
inline std::vector<double> values(const Tensor& t, const char* what) {
  require_float(t, what);
  std::vector<double> out(static_cast<size_t>(t.numel()));
  if (t.dtype() == DType::F64) std::memcpy(out.data(), t.data(), t.bytes());
  else std::copy(t.data_as<float>(), t.data_as<float>() + t.numel(), out.begin());
  return out;
}

// t = v (rounded to t's dtype once), or t += v when accumulate.
inline void store(Tensor& t, const std::vector<double>& v, const char* what, bool accumulate = false) {
  require_float(t, what);
  SPINDLE_CHECK(static_cast<int64_t>(v.size()) == t.numel(), "{}: {} values for {}", what, v.size(), t.describe());
  const int64_t n = t.numel();
  if (t.dtype() == DType::F64) {
    double* p = t.data_as<double>();
    for (int64_t i = 0; i < n; ++i) p[i] = accumulate ? p[i] + v[i] : v[i];
  } else {
    float* p = t.data_as<float>();
    for (int64_t i = 0; i < n; ++i) p[i] = static_cast<float>(accumulate ? p[i] + v[i] : v[i]);
  }
}


// [begin, end) of each run of equal document ids: packed documents lie end to end, so a run is a
// document (or a padding span) and nothing crosses its start.
inline std::vector<std::pair<int64_t, int64_t>> document_runs(const Tensor& doc_ids) {
  const int32_t* doc = doc_ids.data_as<int32_t>();
  const int64_t t = doc_ids.numel();
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t begin = 0; begin < t;) {
    int64_t end = begin + 1;
    while (end < t && doc[end] == doc[begin]) ++end;
    runs.emplace_back(begin, end);
    begin = end;
  }
  return runs;
}

inline double dot(const double* a, const double* b, int64_t n) {
  double s = 0;
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

// ---- the chunked gated delta rule, one value head ------------------------------------------------

struct DeltaShape {
  int64_t tokens, key_heads, dk, value_heads, dv, group;  // group: value heads per key head
};

inline DeltaShape delta_shape(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                              const Tensor& beta, const Tensor& doc_ids, int64_t chunk_size) {
  SPINDLE_CHECK(q.rank() == 3 && k.shape() == q.shape() && v.rank() == 3 && v.dim(0) == q.dim(0),
                "gated_delta_rule: q {} k {} v {}", q.describe(), k.describe(), v.describe());
  DeltaShape s{q.dim(0), q.dim(1), q.dim(2), v.dim(1), v.dim(2), 0};
  SPINDLE_CHECK(s.key_heads > 0 && s.value_heads % s.key_heads == 0,
                "gated_delta_rule: {} value heads are not a multiple of {} key heads", s.value_heads, s.key_heads);
  s.group = s.value_heads / s.key_heads;
  SPINDLE_CHECK(g.numel() == s.tokens * s.value_heads && beta.numel() == s.tokens * s.value_heads,
                "gated_delta_rule: g {} beta {} for {} tokens of {} value heads", g.describe(), beta.describe(),
                s.tokens, s.value_heads);
  SPINDLE_CHECK(chunk_size >= 1, "gated_delta_rule: chunk size {} must be positive", chunk_size);
  require_ids(doc_ids, s.tokens, "gated_delta_rule");
  return s;
}

// One chunk of n ≤ C tokens of one value head, with G the cumulative log decay inside the chunk.
//   A = strictly_lower(diag(β)·K·Kᵀ ⊙ exp(G_i − G_j)),  (I + A)·U = diag(β)·V,  (I + A)·W = diag(β·γ)·K
//   V_new = U − W·S,   O = diag(γ)·Q·S + (lower(Q·Kᵀ ⊙ exp(G_i − G_j)))·V_new,
//   S' = γ_n·S + Kᵀ·diag(exp(G_n − G_r))·V_new                                           (γ = exp(G))
struct Chunk {
  int64_t n = 0, dk = 0, dv = 0;
  std::vector<double> q, k, v;  // [n, dk] (scaled), [n, dk], [n, dv]
  std::vector<double> beta, G;  // [n]
  // Derived by solve():
  std::vector<double> A, U, W, v_new;  // [n, n], [n, dv], [n, dk], [n, dv]

  double gamma(int64_t r) const { return std::exp(G[r]); }
  double decay(int64_t i, int64_t j) const { return std::exp(G[i] - G[j]); }  // i ≥ j: ≤ 1

  void load(const DeltaShape& s, const std::vector<double>& Q, const std::vector<double>& Kx,
            const std::vector<double>& V, const std::vector<double>& g, const std::vector<double>& b, int64_t head,
            int64_t begin, int64_t count, double scale) {
    n = count;
    dk = s.dk;
    dv = s.dv;
    const int64_t kh = head / s.group;
    q.assign(n * dk, 0.0);
    k.assign(n * dk, 0.0);
    v.assign(n * dv, 0.0);
    beta.assign(n, 0.0);
    G.assign(n, 0.0);
    double cumulative = 0;
    for (int64_t r = 0; r < n; ++r) {
      const int64_t t = begin + r;
      for (int64_t e = 0; e < dk; ++e) {
        q[r * dk + e] = scale * Q[(t * s.key_heads + kh) * dk + e];
        k[r * dk + e] = Kx[(t * s.key_heads + kh) * dk + e];
      }
      for (int64_t e = 0; e < dv; ++e) v[r * dv + e] = V[(t * s.value_heads + head) * dv + e];
      beta[r] = b[t * s.value_heads + head];
      cumulative += g[t * s.value_heads + head];
      G[r] = cumulative;
    }
  }

  // The in-chunk triangular solve and V_new for the incoming state S [dk, dv].
  void solve(const std::vector<double>& S) {
    A.assign(n * n, 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < i; ++j) A[i * n + j] = beta[i] * dot(&k[i * dk], &k[j * dk], dk) * decay(i, j);
    U.assign(n * dv, 0.0);
    W.assign(n * dk, 0.0);
    for (int64_t i = 0; i < n; ++i) {  // forward substitution, row by row
      for (int64_t e = 0; e < dv; ++e) U[i * dv + e] = beta[i] * v[i * dv + e];
      for (int64_t e = 0; e < dk; ++e) W[i * dk + e] = beta[i] * gamma(i) * k[i * dk + e];
      for (int64_t j = 0; j < i; ++j) {
        const double a = A[i * n + j];
        for (int64_t e = 0; e < dv; ++e) U[i * dv + e] -= a * U[j * dv + e];
        for (int64_t e = 0; e < dk; ++e) W[i * dk + e] -= a * W[j * dk + e];
      }
    }
    v_new = U;
    for (int64_t i = 0; i < n; ++i)
      for (int64_t a = 0; a < dk; ++a) {
        const double w = W[i * dk + a];
        for (int64_t e = 0; e < dv; ++e) v_new[i * dv + e] -= w * S[a * dv + e];
      }
  }

  // out [n, dv] of the chunk (after solve with the same S).
  void output(const std::vector<double>& S, double* out) const {
    for (int64_t i = 0; i < n; ++i) {
      double* o = out + i * dv;
      std::fill(o, o + dv, 0.0);
      const double gi = gamma(i);
      for (int64_t a = 0; a < dk; ++a) {
        const double qa = gi * q[i * dk + a];
        for (int64_t e = 0; e < dv; ++e) o[e] += qa * S[a * dv + e];
      }
      for (int64_t j = 0; j <= i; ++j) {
        const double p = decay(i, j) * dot(&q[i * dk], &k[j * dk], dk);
        for (int64_t e = 0; e < dv; ++e) o[e] += p * v_new[j * dv + e];
      }
    }
  }

  // S ← the state after the chunk.
  void advance(std::vector<double>& S) const {
    const double gn = gamma(n - 1);
    for (double& x : S) x *= gn;
    for (int64_t r = 0; r < n; ++r) {
      const double d = decay(n - 1, r);
      for (int64_t a = 0; a < dk; ++a) {
        const double ka = d * k[r * dk + a];
        for (int64_t e = 0; e < dv; ++e) S[a * dv + e] += ka * v_new[r * dv + e];
      }
    }
  }

  // The backward of output() and advance() through solve(), for the chunk's incoming S. dS holds
  // ∂L/∂S' on entry and ∂L/∂S on exit. Writes dq (w.r.t. the scaled q), dk, dv [n, ·], dbeta and
  // dg (w.r.t. each token's own log decay) [n].
  void backward(const std::vector<double>& S, const double* dout, std::vector<double>& dS, std::vector<double>& dq,
                std::vector<double>& dk_out, std::vector<double>& dv_out, std::vector<double>& dbeta,
                std::vector<double>& dg) const {
    dq.assign(n * dk, 0.0);
    dk_out.assign(n * dk, 0.0);
    dv_out.assign(n * dv, 0.0);
    dbeta.assign(n, 0.0);
    std::vector<double> dG(n, 0.0), dv_new(n * dv, 0.0), tmp(dk);
    const int64_t last = n - 1;
    const double gn = gamma(last);

    // S' = γ_n·S + Σ_r exp(G_n − G_r)·k_r·v_newᵣᵀ
    double state_dot = 0;
    for (int64_t x = 0; x < dk * dv; ++x) state_dot += S[x] * dS[x];
    dG[last] += gn * state_dot;
    for (int64_t r = 0; r < n; ++r) {
      const double d = decay(last, r);
      for (int64_t a = 0; a < dk; ++a) tmp[a] = dot(&dS[a * dv], &v_new[r * dv], dv);  // dS'·v_new_r
      for (int64_t a = 0; a < dk; ++a) dk_out[r * dk + a] += d * tmp[a];
      const double dd = dot(&k[r * dk], tmp.data(), dk);
      dG[last] += d * dd;
      dG[r] -= d * dd;
      for (int64_t e = 0; e < dv; ++e) {  // ∂/∂v_new_r = d·dS'ᵀ·k_r
        double s = 0;
        for (int64_t a = 0; a < dk; ++a) s += k[r * dk + a] * dS[a * dv + e];
        dv_new[r * dv + e] += d * s;
      }
    }

    // O_i = γ_i·q_i·S + Σ_{j ≤ i} exp(G_i − G_j)·(q_i·k_j)·v_new_j
    for (int64_t i = 0; i < n; ++i) {
      const double* doi = dout + i * dv;
      const double gi = gamma(i);
      for (int64_t a = 0; a < dk; ++a) tmp[a] = dot(&S[a * dv], doi, dv);  // S·do_i
      for (int64_t a = 0; a < dk; ++a) dq[i * dk + a] += gi * tmp[a];
      dG[i] += gi * dot(&q[i * dk], tmp.data(), dk);
      for (int64_t j = 0; j <= i; ++j) {
        const double m = decay(i, j), dp = dot(doi, &v_new[j * dv], dv), qk = dot(&q[i * dk], &k[j * dk], dk);
        for (int64_t a = 0; a < dk; ++a) {
          dq[i * dk + a] += m * dp * k[j * dk + a];
          dk_out[j * dk + a] += m * dp * q[i * dk + a];
        }
        for (int64_t e = 0; e < dv; ++e) dv_new[j * dv + e] += m * qk * doi[e];
        dG[i] += dp * qk * m;
        dG[j] -= dp * qk * m;
      }
    }

    // ∂L/∂S of the incoming state: through S', the inter-chunk read and V_new = U − W·S.
    std::vector<double> dS_in(dk * dv);
    for (int64_t x = 0; x < dk * dv; ++x) dS_in[x] = gn * dS[x];
    for (int64_t i = 0; i < n; ++i)
      for (int64_t a = 0; a < dk; ++a) {
        const double qa = gamma(i) * q[i * dk + a], wa = W[i * dk + a];
        for (int64_t e = 0; e < dv; ++e) dS_in[a * dv + e] += qa * dout[i * dv + e] - wa * dv_new[i * dv + e];
      }

    // V_new = U − W·S: dU = dV_new, dW_i = −S·dv_new_i; then through (I + A)·U = diag(β)·V and
    // (I + A)·W = diag(βγ)·K: (I + A)ᵀ·Y = dU gives Y = ∂/∂(diag(β)·V), by back substitution.
    std::vector<double> dBu = dv_new, dBw(n * dk);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t a = 0; a < dk; ++a) dBw[i * dk + a] = -dot(&S[a * dv], &dv_new[i * dv], dv);
    for (int64_t j = n - 1; j >= 0; --j)
      for (int64_t i = j + 1; i < n; ++i) {
        const double a = A[i * n + j];
        for (int64_t e = 0; e < dv; ++e) dBu[j * dv + e] -= a * dBu[i * dv + e];
        for (int64_t e = 0; e < dk; ++e) dBw[j * dk + e] -= a * dBw[i * dk + e];
      }
    for (int64_t r = 0; r < n; ++r) {
      for (int64_t e = 0; e < dv; ++e) dv_out[r * dv + e] = beta[r] * dBu[r * dv + e];
      dbeta[r] += dot(&v[r * dv], &dBu[r * dv], dv);
      const double gr = gamma(r), kd = dot(&k[r * dk], &dBw[r * dk], dk);
      for (int64_t a = 0; a < dk; ++a) dk_out[r * dk + a] += beta[r] * gr * dBw[r * dk + a];
      dbeta[r] += gr * kd;
      dG[r] += gr * beta[r] * kd;
    }
    // dA = −(dBu·Uᵀ + dBw·Wᵀ) on the strict lower triangle; A_ij = β_i·(k_i·k_j)·exp(G_i − G_j).
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < i; ++j) {
        const double da = -(dot(&dBu[i * dv], &U[j * dv], dv) + dot(&dBw[i * dk], &W[j * dk], dk));
        const double l = decay(i, j), kk = dot(&k[i * dk], &k[j * dk], dk);
        dbeta[i] += da * l * kk;
        for (int64_t a = 0; a < dk; ++a) {
          dk_out[i * dk + a] += da * beta[i] * l * k[j * dk + a];
          dk_out[j * dk + a] += da * beta[i] * l * k[i * dk + a];
        }
        const double dl = da * beta[i] * kk * l;
        dG[i] += dl;
        dG[j] -= dl;
      }

    // G_r = Σ_{s ≤ r} g_s: each g_r reaches every G_s with s ≥ r.
    dg.assign(n, 0.0);
    double suffix = 0;
    for (int64_t r = n - 1; r >= 0; --r) {
      suffix += dG[r];
      dg[r] = suffix;
    }
    dS = std::move(dS_in);
  }
};

struct DeltaInputs {
  DeltaShape s;
  std::vector<double> q, k, v, g, beta;
  std::vector<std::pair<int64_t, int64_t>> runs;
};

inline DeltaInputs delta_inputs(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& doc_ids, int64_t chunk_size) {
  DeltaInputs in;
  in.s = delta_shape(q, k, v, g, beta, doc_ids, chunk_size);
  in.q = values(q, "gated_delta_rule q");
  in.k = values(k, "gated_delta_rule k");
  in.v = values(v, "gated_delta_rule v");
  in.g = values(g, "gated_delta_rule g");
  in.beta = values(beta, "gated_delta_rule beta");
  in.runs = document_runs(doc_ids);
  return in;
}

}  // namespace spindle::cpu::delta
