// Gated DeltaNet and gated-attention ops of the CPU reference backend (declared in
// backend/backend.h, forwarded to from cpu_backend.cpp). Inputs are read into double, computed in
// double and stored once in the output's dtype: the reference is more precise than what it checks.
//
// The gated delta rule is computed in chunks exactly as the GPU kernels will (docs/models.md):
// within a chunk the recurrence becomes a unit lower triangular solve (the WY/UT form), across
// chunks the state S [dk, dv] is carried in double; the backward recomputes the chunk-boundary
// states of a document from the inputs, then walks its chunks in reverse.
#include "backend/cpu/gated_delta_ops.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#include "backend/cpu/gated_delta_chunk.h"
#include "core/error.h"

namespace spindle::cpu {

using namespace delta;

namespace {

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }
double silu(double x) { return x * sigmoid(x); }
double silu_grad(double x) {
  const double s = sigmoid(x);
  return s * (1.0 + x * (1.0 - s));
}

// torch.nn.functional.softplus with its default threshold: linear above 20, as transformers computes g.
double softplus(double x) { return x > 20.0 ? x : std::log1p(std::exp(x)); }
double softplus_grad(double x) { return x > 20.0 ? 1.0 : sigmoid(x); }

}  // namespace

// ---- gated attention -------------------------------------------------------------------------------

void copy_columns(const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width) {
  SPINDLE_CHECK(src.rank() == 2 && dst.rank() == 2 && src.dim(0) == dst.dim(0) && src.dtype() == dst.dtype() &&
                    src_col >= 0 && dst_col >= 0 && width >= 0 && src_col + width <= src.dim(1) &&
                    dst_col + width <= dst.dim(1),
                "copy_columns: [{}, {}) of {} into column {} of {}", src_col, src_col + width, src.describe(), dst_col,
                dst.describe());
  SPINDLE_CHECK(src.device().kind == DeviceKind::CPU && dst.device().kind == DeviceKind::CPU,
                "copy_columns: tensors must be on the CPU");
  const size_t elem = dtype_size(src.dtype());
  const int64_t rows = src.dim(0);
  const char* from = static_cast<const char*>(src.data());
  char* to = static_cast<char*>(dst.data());
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(to + (r * dst.dim(1) + dst_col) * elem, from + (r * src.dim(1) + src_col) * elem, width * elem);
}

void rope_partial(Tensor& x, const Tensor& positions, const Tensor& inv_freq, int64_t rotary_dim, double attention_scale,
                  int sign) {
  require_float(x, "rope_partial");
  SPINDLE_CHECK(x.rank() == 3 && rotary_dim > 0 && rotary_dim % 2 == 0 && rotary_dim <= x.dim(2) &&
                    inv_freq.dtype() == DType::F32 && inv_freq.numel() == rotary_dim / 2 &&
                    positions.dtype() == DType::I32 && positions.numel() == x.dim(0),
                "rope_partial: x {} positions {} inv_freq {} rotary_dim {}", x.describe(), positions.describe(),
                inv_freq.describe(), rotary_dim);
  const int64_t tokens = x.dim(0), heads = x.dim(1), d = x.dim(2), half = rotary_dim / 2;
  const int32_t* pos = positions.data_as<int32_t>();
  const float* freq = inv_freq.data_as<float>();
  auto rotate = [&](auto* p) {
    using T = std::remove_pointer_t<decltype(p)>;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t i = 0; i < half; ++i) {
        // The angle rounded to F32 as transformers computes it (an fp32 product).
        const float angle = static_cast<float>(pos[t]) * freq[i];
        const double cs = std::cos(static_cast<double>(angle)) * attention_scale;
        const double sn = std::sin(static_cast<double>(angle)) * attention_scale * sign;
        for (int64_t h = 0; h < heads; ++h) {
          T* row = p + (t * heads + h) * d;
          const double a = row[i], b = row[i + half];
          row[i] = static_cast<T>(a * cs - b * sn);
          row[i + half] = static_cast<T>(b * cs + a * sn);
        }
      }
  };
  if (x.dtype() == DType::F64) rotate(x.data_as<double>());
  else rotate(x.data_as<float>());
}

void sigmoid_gate_forward(const Tensor& x, const Tensor& gate, Tensor& out) {
  SPINDLE_CHECK(gate.numel() == x.numel() && out.numel() == x.numel(), "sigmoid_gate_forward: {} {} {}",
                x.describe(), gate.describe(), out.describe());
  const std::vector<double> xs = values(x, "sigmoid_gate x"), gs = values(gate, "sigmoid_gate gate");
  std::vector<double> o(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) o[i] = xs[i] * sigmoid(gs[i]);
  store(out, o, "sigmoid_gate out");
}

void sigmoid_gate_backward(const Tensor& x, const Tensor& gate, const Tensor& dout, Tensor& dx, Tensor& dgate) {
  SPINDLE_CHECK(gate.numel() == x.numel() && dout.numel() == x.numel() && dx.numel() == x.numel() &&
                    dgate.numel() == x.numel(),
                "sigmoid_gate_backward shapes");
  const std::vector<double> xs = values(x, "sigmoid_gate x"), gs = values(gate, "sigmoid_gate gate"),
                            dys = values(dout, "sigmoid_gate dout");
  std::vector<double> dxs(xs.size()), dgs(xs.size());
  for (size_t i = 0; i < xs.size(); ++i) {
    const double s = sigmoid(gs[i]);
    dxs[i] = dys[i] * s;
    dgs[i] = dys[i] * xs[i] * s * (1.0 - s);
  }
  store(dx, dxs, "sigmoid_gate dx");
  store(dgate, dgs, "sigmoid_gate dgate");
}

// ---- gated DeltaNet ------------------------------------------------------------------------------

void causal_conv1d_silu_forward(const Tensor& x, const Tensor& w, const Tensor& doc_ids, Tensor& y) {
  SPINDLE_CHECK(x.rank() == 2 && y.shape() == x.shape() && w.dim(0) == x.dim(1) && w.numel() % x.dim(1) == 0,
                "causal_conv1d_silu_forward: x {} w {} y {}", x.describe(), w.describe(), y.describe());
  const int64_t tokens = x.dim(0), channels = x.dim(1), width = w.numel() / channels;
  require_ids(doc_ids, tokens, "causal_conv1d_silu_forward");
  const std::vector<double> xs = values(x, "conv1d x"), ws = values(w, "conv1d w");
  std::vector<double> out(xs.size(), 0.0);
  for (const auto& [begin, end] : document_runs(doc_ids))
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < channels; ++c) {
        double pre = 0;
        for (int64_t j = 0; j < width; ++j) {
          const int64_t src = t - (width - 1) + j;  // the window's tap j; taps before the document read zero
          if (src >= begin) pre += ws[c * width + j] * xs[src * channels + c];
        }
        out[t * channels + c] = silu(pre);
      }
  store(y, out, "conv1d y");
}

void causal_conv1d_silu_backward(const Tensor& x, const Tensor& w, const Tensor& doc_ids, const Tensor& dy, Tensor& dx,
                                 Tensor* dw) {
  SPINDLE_CHECK(x.rank() == 2 && dy.shape() == x.shape() && dx.shape() == x.shape() && w.dim(0) == x.dim(1) &&
                    w.numel() % x.dim(1) == 0 && (!dw || dw->shape() == w.shape()),
                "causal_conv1d_silu_backward: x {} w {} dy {} dx {}", x.describe(), w.describe(), dy.describe(),
                dx.describe());
  const int64_t tokens = x.dim(0), channels = x.dim(1), width = w.numel() / channels;
  require_ids(doc_ids, tokens, "causal_conv1d_silu_backward");
  const std::vector<double> xs = values(x, "conv1d x"), ws = values(w, "conv1d w"), dys = values(dy, "conv1d dy");
  std::vector<double> dxs(xs.size(), 0.0), dws(ws.size(), 0.0);
  for (const auto& [begin, end] : document_runs(doc_ids))
    for (int64_t t = begin; t < end; ++t)
      for (int64_t c = 0; c < channels; ++c) {
        double pre = 0;  // the pre-activation again, from x and w
        for (int64_t j = 0; j < width; ++j) {
          const int64_t src = t - (width - 1) + j;
          if (src >= begin) pre += ws[c * width + j] * xs[src * channels + c];
        }
        const double dpre = dys[t * channels + c] * silu_grad(pre);
        for (int64_t j = 0; j < width; ++j) {
          const int64_t src = t - (width - 1) + j;
          if (src < begin) continue;
          dxs[src * channels + c] += ws[c * width + j] * dpre;
          dws[c * width + j] += xs[src * channels + c] * dpre;
        }
      }
  store(dx, dxs, "conv1d dx");
  if (dw) store(*dw, dws, "conv1d dw", true);
}

void l2norm_forward(const Tensor& x, double eps, Tensor& y, Tensor& rstd) {
  SPINDLE_CHECK(x.rank() >= 1 && y.shape() == x.shape(), "l2norm_forward: x {} y {}", x.describe(), y.describe());
  const int64_t c = x.dim(x.rank() - 1), rows = c ? x.numel() / c : 0;
  SPINDLE_CHECK(rstd.numel() == rows, "l2norm_forward: rstd {} for {} rows", rstd.describe(), rows);
  const std::vector<double> xs = values(x, "l2norm x");
  std::vector<double> ys(xs.size()), rs(rows);
  for (int64_t r = 0; r < rows; ++r) {
    rs[r] = 1.0 / std::sqrt(dot(&xs[r * c], &xs[r * c], c) + eps);
    if (rstd.dtype() == DType::F32) rs[r] = static_cast<float>(rs[r]);  // used as stored, like rmsnorm
    for (int64_t j = 0; j < c; ++j) ys[r * c + j] = xs[r * c + j] * rs[r];
  }
  store(y, ys, "l2norm y");
  store(rstd, rs, "l2norm rstd");
}

void l2norm_backward(const Tensor& y, const Tensor& rstd, const Tensor& dy, Tensor& dx) {
  SPINDLE_CHECK(dy.shape() == y.shape() && dx.shape() == y.shape(), "l2norm_backward: y {} dy {} dx {}",
                y.describe(), dy.describe(), dx.describe());
  const int64_t c = y.dim(y.rank() - 1), rows = c ? y.numel() / c : 0;
  SPINDLE_CHECK(rstd.numel() == rows, "l2norm_backward: rstd {}", rstd.describe());
  const std::vector<double> ys = values(y, "l2norm y"), rs = values(rstd, "l2norm rstd"), dys = values(dy, "l2norm dy");
  std::vector<double> dxs(ys.size());
  // y = x·r, r = (Σx² + eps)^-½: dx = r·(dy − y·(y·dy)).
  for (int64_t r = 0; r < rows; ++r) {
    const double yd = dot(&ys[r * c], &dys[r * c], c);
    for (int64_t j = 0; j < c; ++j) dxs[r * c + j] = rs[r] * (dys[r * c + j] - ys[r * c + j] * yd);
  }
  store(dx, dxs, "l2norm dx");
}

void gated_delta_gates_forward(const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias, Tensor& g,
                               Tensor& beta) {
  const int64_t heads = a_log.numel(), tokens = heads ? a.numel() / heads : 0;
  SPINDLE_CHECK(tokens * heads == a.numel() && b.numel() == a.numel() && dt_bias.numel() == heads &&
                    g.numel() == a.numel() && beta.numel() == a.numel(),
                "gated_delta_gates_forward: a {} b {} A_log {} dt_bias {} g {} beta {}", a.describe(), b.describe(),
                a_log.describe(), dt_bias.describe(), g.describe(), beta.describe());
  const std::vector<double> as = values(a, "gates a"), bs = values(b, "gates b"), logs = values(a_log, "gates A_log"),
                            bias = values(dt_bias, "gates dt_bias");
  std::vector<double> gs(as.size()), betas(as.size());
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t i = t * heads + h;
      gs[i] = -std::exp(logs[h]) * softplus(as[i] + bias[h]);
      betas[i] = sigmoid(bs[i]);
    }
  store(g, gs, "gates g");
  store(beta, betas, "gates beta");
}

void gated_delta_gates_backward(const Tensor& a, const Tensor& beta, const Tensor& a_log, const Tensor& dt_bias,
                                const Tensor& g, const Tensor& dg, const Tensor& dbeta, Tensor& da, Tensor& db,
                                Tensor* da_log, Tensor* ddt_bias) {
  const int64_t heads = a_log.numel(), tokens = heads ? a.numel() / heads : 0;
  SPINDLE_CHECK(tokens * heads == a.numel() && beta.numel() == a.numel() && g.numel() == a.numel() &&
                    dg.numel() == a.numel() && dbeta.numel() == a.numel() && da.numel() == a.numel() &&
                    db.numel() == a.numel() && dt_bias.numel() == heads,
                "gated_delta_gates_backward shapes: a {} A_log {}", a.describe(), a_log.describe());
  const std::vector<double> as = values(a, "gates a"), betas = values(beta, "gates beta"),
                            logs = values(a_log, "gates A_log"), bias = values(dt_bias, "gates dt_bias"),
                            gs = values(g, "gates g"), dgs = values(dg, "gates dg"), dbetas = values(dbeta, "gates dbeta");
  std::vector<double> das(as.size()), dbs(as.size()), dlog(heads, 0.0), dbias(heads, 0.0);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < heads; ++h) {
      const int64_t i = t * heads + h;
      // g = −exp(A_log)·softplus(a + dt_bias): ∂g/∂A_log = g, ∂g/∂a = ∂g/∂dt_bias = −exp(A_log)·softplus′.
      das[i] = dgs[i] * -std::exp(logs[h]) * softplus_grad(as[i] + bias[h]);
      dlog[h] += dgs[i] * gs[i];
      dbias[h] += das[i];
      dbs[i] = dbetas[i] * betas[i] * (1.0 - betas[i]);
    }
  store(da, das, "gates da");
  store(db, dbs, "gates db");
  if (da_log) store(*da_log, dlog, "gates dA_log", true);
  if (ddt_bias) store(*ddt_bias, dbias, "gates ddt_bias", true);
}

void gated_delta_rule_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                              const Tensor& doc_ids, double scale, int64_t chunk_size, Tensor& out) {
  const DeltaInputs in = delta_inputs(q, k, v, g, beta, doc_ids, chunk_size);
  const DeltaShape& s = in.s;
  SPINDLE_CHECK(out.shape() == v.shape(), "gated_delta_rule_forward: out {} for v {}", out.describe(), v.describe());
  std::vector<double> o(static_cast<size_t>(s.tokens * s.value_heads * s.dv), 0.0);
#pragma omp parallel for schedule(dynamic, 1) if (s.value_heads > 1)
  for (int64_t h = 0; h < s.value_heads; ++h) {
    Chunk chunk;
    std::vector<double> S(s.dk * s.dv), rows;
    for (const auto& [begin, end] : in.runs) {
      std::fill(S.begin(), S.end(), 0.0);  // every document starts from the zero state
      for (int64_t c0 = begin; c0 < end; c0 += chunk_size) {
        chunk.load(s, in.q, in.k, in.v, in.g, in.beta, h, c0, std::min(chunk_size, end - c0), scale);
        chunk.solve(S);
        rows.assign(chunk.n * s.dv, 0.0);
        chunk.output(S, rows.data());
        chunk.advance(S);
        for (int64_t r = 0; r < chunk.n; ++r)
          std::copy(&rows[r * s.dv], &rows[r * s.dv] + s.dv, &o[((c0 + r) * s.value_heads + h) * s.dv]);
      }
    }
  }
  store(out, o, "gated_delta_rule out");
}

void gated_delta_rule_backward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g, const Tensor& beta,
                               const Tensor& doc_ids, double scale, int64_t chunk_size, const Tensor& dout, Tensor& dq,
                               Tensor& dk, Tensor& dv, Tensor& dg, Tensor& dbeta) {
  const DeltaInputs in = delta_inputs(q, k, v, g, beta, doc_ids, chunk_size);
  const DeltaShape& s = in.s;
  SPINDLE_CHECK(dout.shape() == v.shape() && dq.shape() == q.shape() && dk.shape() == k.shape() &&
                    dv.shape() == v.shape() && dg.numel() == g.numel() && dbeta.numel() == beta.numel(),
                "gated_delta_rule_backward: dout {} dq {} dk {} dv {} dg {} dbeta {}", dout.describe(), dq.describe(),
                dk.describe(), dv.describe(), dg.describe(), dbeta.describe());
  const std::vector<double> douts = values(dout, "gated_delta_rule dout");
  std::vector<double> dqs(in.q.size(), 0.0), dks(in.k.size(), 0.0), dvs(in.v.size(), 0.0), dgs(in.g.size(), 0.0),
      dbetas(in.beta.size(), 0.0);
  // Parallel over key heads: the value heads that share a key head add into its dq and dk.
#pragma omp parallel for schedule(dynamic, 1) if (s.key_heads > 1)
  for (int64_t kh = 0; kh < s.key_heads; ++kh) {
    Chunk chunk;
    std::vector<double> cq, ck, cv, cb, cg, rows_dout;
    for (int64_t h = kh * s.group; h < (kh + 1) * s.group; ++h)
      for (const auto& [begin, end] : in.runs) {
        // The state entering each chunk of the document, recomputed from the inputs.
        std::vector<int64_t> starts;
        std::vector<std::vector<double>> states;
        std::vector<double> S(s.dk * s.dv, 0.0);
        for (int64_t c0 = begin; c0 < end; c0 += chunk_size) {
          starts.push_back(c0);
          states.push_back(S);
          chunk.load(s, in.q, in.k, in.v, in.g, in.beta, h, c0, std::min(chunk_size, end - c0), scale);
          chunk.solve(S);
          chunk.advance(S);
        }
        std::vector<double> dS(s.dk * s.dv, 0.0);  // nothing flows out of the document's last state
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
      }
  }
  store(dq, dqs, "gated_delta_rule dq");
  store(dk, dks, "gated_delta_rule dk");
  store(dv, dvs, "gated_delta_rule dv");
  store(dg, dgs, "gated_delta_rule dg");
  store(dbeta, dbetas, "gated_delta_rule dbeta");
}

void gated_rmsnorm_forward(const Tensor& x, const Tensor& z, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
  const int64_t c = w.numel(), rows = c ? x.numel() / c : 0;
  SPINDLE_CHECK(rows * c == x.numel() && z.numel() == x.numel() && y.numel() == x.numel() && rstd.numel() == rows,
                "gated_rmsnorm_forward: x {} z {} w {} y {} rstd {}", x.describe(), z.describe(), w.describe(),
                y.describe(), rstd.describe());
  const std::vector<double> xs = values(x, "gated_rmsnorm x"), zs = values(z, "gated_rmsnorm z"),
                            ws = values(w, "gated_rmsnorm w");
  std::vector<double> ys(xs.size()), rs(rows);
  for (int64_t r = 0; r < rows; ++r) {
    rs[r] = 1.0 / std::sqrt(dot(&xs[r * c], &xs[r * c], c) / static_cast<double>(c) + eps);
    if (rstd.dtype() == DType::F32) rs[r] = static_cast<float>(rs[r]);
    for (int64_t j = 0; j < c; ++j) ys[r * c + j] = xs[r * c + j] * rs[r] * ws[j] * silu(zs[r * c + j]);
  }
  store(y, ys, "gated_rmsnorm y");
  store(rstd, rs, "gated_rmsnorm rstd");
}

void gated_rmsnorm_backward(const Tensor& x, const Tensor& z, const Tensor& w, const Tensor& rstd, const Tensor& dy,
                            Tensor& dx, Tensor& dz, Tensor* dw) {
  const int64_t c = w.numel(), rows = c ? x.numel() / c : 0;
  SPINDLE_CHECK(rows * c == x.numel() && z.numel() == x.numel() && dy.numel() == x.numel() &&
                    dx.numel() == x.numel() && dz.numel() == x.numel() && rstd.numel() == rows &&
                    (!dw || dw->numel() == c),
                "gated_rmsnorm_backward shapes: x {} w {}", x.describe(), w.describe());
  const std::vector<double> xs = values(x, "gated_rmsnorm x"), zs = values(z, "gated_rmsnorm z"),
                            ws = values(w, "gated_rmsnorm w"), rs = values(rstd, "gated_rmsnorm rstd"),
                            dys = values(dy, "gated_rmsnorm dy");
  std::vector<double> dxs(xs.size()), dzs(xs.size()), dws(c, 0.0), dn(c);
  // y = n·w·silu(z), n = x·r: dn = dy·w·silu(z), dx = r·(dn − n·mean(n·dn)), dz = dy·w·n·silu′(z).
  for (int64_t r = 0; r < rows; ++r) {
    double mean = 0;
    for (int64_t j = 0; j < c; ++j) {
      const int64_t i = r * c + j;
      const double n = xs[i] * rs[r], gate = silu(zs[i]);
      dn[j] = dys[i] * ws[j] * gate;
      mean += n * dn[j];
      dzs[i] = dys[i] * ws[j] * n * silu_grad(zs[i]);
      dws[j] += dys[i] * n * gate;
    }
    mean /= static_cast<double>(c);
    for (int64_t j = 0; j < c; ++j) dxs[r * c + j] = rs[r] * (dn[j] - xs[r * c + j] * rs[r] * mean);
  }
  store(dx, dxs, "gated_rmsnorm dx");
  store(dz, dzs, "gated_rmsnorm dz");
  if (dw) store(*dw, dws, "gated_rmsnorm dw", true);
}

}  // namespace spindle::cpu
