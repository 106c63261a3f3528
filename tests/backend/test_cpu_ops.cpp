// Every backward op of the CPU backend against central finite differences in double, and every
// forward op against a direct formula. The CUDA backend is then tested against this backend.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <random>

#include "backend/backend.h"
#include "op_test_util.h"

using namespace spindle;
using namespace spindle::test;

namespace {

// Checks d(Σ proj·f(x))/dx against `analytic` for each element of `x` (F64).
void expect_grad_matches(Backend& be, Tensor& x, const std::function<double()>& objective, const Tensor& analytic,
                         double tol = 1e-6, const char* what = "") {
  std::vector<double> xs = to_host(be, x), an = to_host(be, analytic);
  ASSERT_EQ(xs.size(), an.size());
  const double h = 1e-6;
  double max_err = 0, max_ref = 0;
  for (size_t i = 0; i < xs.size(); ++i) {
    std::vector<double> p = xs;
    p[i] = xs[i] + h;
    from_host(be, p, x);
    const double fp = objective();
    p[i] = xs[i] - h;
    from_host(be, p, x);
    const double fm = objective();
    const double num = (fp - fm) / (2 * h);
    max_err = std::max(max_err, std::fabs(num - an[i]));
    max_ref = std::max(max_ref, std::fabs(num));
  }
  from_host(be, xs, x);
  EXPECT_LE(max_err, tol * std::max(1.0, max_ref)) << what << ": max |numeric - analytic| = " << max_err;
}

double dot(Backend& be, const Tensor& a, const Tensor& b) {
  auto x = to_host(be, a), y = to_host(be, b);
  double s = 0;
  for (size_t i = 0; i < x.size(); ++i) s += x[i] * y[i];
  return s;
}

class CpuOps : public ::testing::Test {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend();
  Stream st = be->default_stream();
  std::mt19937_64 rng{1234};
};

}  // namespace

TEST_F(CpuOps, GemmMatchesNaiveInAllTransposes) {
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      const int m = 5, n = 7, k = 3;
      Tensor a = random_tensor(*be, ta ? Shape{k, m} : Shape{m, k}, DType::F64, rng);
      Tensor b = random_tensor(*be, tb ? Shape{n, k} : Shape{k, n}, DType::F64, rng);
      Tensor c = random_tensor(*be, Shape{m, n}, DType::F64, rng);
      auto A = to_host(*be, a), B = to_host(*be, b), C = to_host(*be, c);
      be->gemm(st, a, ta, b, tb, c, 0.5, 2.0);
      auto got = to_host(*be, c);
      for (int i = 0; i < m; ++i)
        for (int j = 0; j < n; ++j) {
          double s = 0;
          for (int e = 0; e < k; ++e) s += (ta ? A[e * m + i] : A[i * k + e]) * (tb ? B[j * k + e] : B[e * n + j]);
          EXPECT_NEAR(got[i * n + j], 0.5 * s + 2.0 * C[i * n + j], 1e-12);
        }
    }
}

TEST_F(CpuOps, RmsNormBackwardMatchesFiniteDifferences) {
  const int rows = 3, c = 6;
  Tensor x = random_tensor(*be, Shape{rows, c}, DType::F64, rng);
  Tensor w = random_tensor(*be, Shape{c}, DType::F64, rng);
  Tensor proj = random_tensor(*be, Shape{rows, c}, DType::F64, rng);
  Tensor y = be->empty(Shape{rows, c}, DType::F64), rstd = be->empty(Shape{rows}, DType::F64);
  auto objective = [&] {
    be->rmsnorm_forward(st, x, w, 1e-5, y, rstd);
    return dot(*be, y, proj);
  };
  objective();
  Tensor dx = be->zeros(Shape{rows, c}, DType::F64), dw = be->zeros(Shape{c}, DType::F64);
  be->rmsnorm_backward(st, x, w, rstd, proj, dx, &dw, false);
  expect_grad_matches(*be, x, objective, dx, 1e-6, "dx");
  expect_grad_matches(*be, w, objective, dw, 1e-6, "dw");
  // accumulate_dx adds instead of overwriting; without dw (a frozen weight) dx is the same
  Tensor dx2 = be->zeros(Shape{rows, c}, DType::F64);
  be->fill(st, dx2, 1.0);
  be->rmsnorm_backward(st, x, w, rstd, proj, dx2, nullptr, true);
  auto a = to_host(*be, dx), b = to_host(*be, dx2);
  for (size_t i = 0; i < a.size(); ++i) EXPECT_NEAR(b[i], a[i] + 1.0, 1e-12);
}

TEST_F(CpuOps, RopeInverseIsItsTransposeAndMatchesHalfSplitFormula) {
  const int t = 4, heads = 2, d = 8;
  Tensor x = random_tensor(*be, Shape{t, heads, d}, DType::F64, rng);
  auto orig = to_host(*be, x);
  Tensor pos = int_tensor(*be, {0, 5, 2, 1000});
  std::vector<float> freq = {1.0f, 0.1f, 0.01f, 0.001f};
  Tensor inv = be->empty(Shape{4}, DType::F32);
  be->copy_from_host(st, freq.data(), inv);
  be->rope(st, x, pos, inv, 1.0, +1);
  auto rot = to_host(*be, x);
  const int p[] = {0, 5, 2, 1000};
  for (int ti = 0; ti < t; ++ti)
    for (int h = 0; h < heads; ++h)
      for (int i = 0; i < d / 2; ++i) {
        const double ang = static_cast<float>(p[ti]) * freq[i];
        const int base = (ti * heads + h) * d;
        EXPECT_NEAR(rot[base + i], orig[base + i] * std::cos(ang) - orig[base + i + 4] * std::sin(ang), 1e-12);
        EXPECT_NEAR(rot[base + i + 4], orig[base + i + 4] * std::cos(ang) + orig[base + i] * std::sin(ang), 1e-12);
      }
  be->rope(st, x, pos, inv, 1.0, -1);
  auto back = to_host(*be, x);
  for (size_t i = 0; i < orig.size(); ++i) EXPECT_NEAR(back[i], orig[i], 1e-12);
}

TEST_F(CpuOps, RopeBackwardMatchesFiniteDifferencesWithAttentionScale) {
  const int t = 3, heads = 1, d = 4;
  Tensor x = random_tensor(*be, Shape{t, heads, d}, DType::F64, rng);
  Tensor proj = random_tensor(*be, Shape{t, heads, d}, DType::F64, rng);
  Tensor pos = int_tensor(*be, {3, 1, 7});
  std::vector<float> freq = {0.7f, 0.05f};
  Tensor inv = be->empty(Shape{2}, DType::F32);
  be->copy_from_host(st, freq.data(), inv);
  Tensor y = be->empty(x.shape(), DType::F64);
  auto objective = [&] {
    be->copy(st, x, y);
    be->rope(st, y, pos, inv, 1.3, +1);
    return dot(*be, y, proj);
  };
  Tensor g = be->empty(x.shape(), DType::F64);
  be->copy(st, proj, g);
  be->rope(st, g, pos, inv, 1.3, -1);
  expect_grad_matches(*be, x, objective, g, 1e-6, "rope");
}

namespace {
// Packed rows: documents {0,0,0,1,1,pad}, positions restart per document; padding is doc -1.
struct PackedMask {
  Tensor doc, pos;
};
PackedMask packed_mask(Backend& be, const std::vector<int>& docs, const std::vector<int>& pos) {
  return {int_tensor(be, docs), int_tensor(be, pos)};
}
}  // namespace

TEST_F(CpuOps, AttentionForwardMatchesNaiveSoftmaxWithPackingAndGqa) {
  const int t = 6, hq = 4, hkv = 2, d = 3;
  std::vector<int> docs = {0, 0, 0, 1, 1, -1}, pos = {0, 1, 2, 0, 1, 0};
  auto pm = packed_mask(*be, docs, pos);
  AttentionMask mask{pm.doc, pm.pos, pm.doc, pm.pos};
  Tensor q = random_tensor(*be, Shape{t, hq, d}, DType::F64, rng);
  Tensor k = random_tensor(*be, Shape{t, hkv, d}, DType::F64, rng);
  Tensor v = random_tensor(*be, Shape{t, hkv, d}, DType::F64, rng);
  Tensor out = be->empty(q.shape(), DType::F64), lse = be->empty(Shape{hq, t}, DType::F64);
  be->attention_forward(st, q, k, v, mask, AttentionLogits{0.7}, out, lse);
  auto Q = to_host(*be, q), K = to_host(*be, k), V = to_host(*be, v), O = to_host(*be, out), L = to_host(*be, lse);
  for (int h = 0; h < hq; ++h)
    for (int i = 0; i < t; ++i) {
      const int hk = h / 2;
      std::vector<double> s;
      std::vector<int> js;
      for (int j = 0; j < t; ++j)
        if (docs[j] == docs[i] && pos[j] <= pos[i]) {
          double dp = 0;
          for (int e = 0; e < d; ++e) dp += Q[(i * hq + h) * d + e] * K[(j * hkv + hk) * d + e];
          s.push_back(0.7 * dp);
          js.push_back(j);
        }
      double z = 0;
      for (double x : s) z += std::exp(x);
      EXPECT_NEAR(L[h * t + i], std::log(z), 1e-12);
      for (int e = 0; e < d; ++e) {
        double o = 0;
        for (size_t n = 0; n < js.size(); ++n) o += std::exp(s[n]) / z * V[(js[n] * hkv + hk) * d + e];
        EXPECT_NEAR(O[(i * hq + h) * d + e], o, 1e-12);
      }
    }
}

TEST_F(CpuOps, AttentionBackwardMatchesFiniteDifferences) {
  const int t = 5, hq = 4, hkv = 2, d = 3;
  auto pm = packed_mask(*be, {0, 0, 1, 1, 1}, {0, 1, 0, 1, 2});
  AttentionMask mask{pm.doc, pm.pos, pm.doc, pm.pos};
  Tensor q = random_tensor(*be, Shape{t, hq, d}, DType::F64, rng);
  Tensor k = random_tensor(*be, Shape{t, hkv, d}, DType::F64, rng);
  Tensor v = random_tensor(*be, Shape{t, hkv, d}, DType::F64, rng);
  Tensor proj = random_tensor(*be, q.shape(), DType::F64, rng);
  Tensor out = be->empty(q.shape(), DType::F64), lse = be->empty(Shape{hq, t}, DType::F64);
  auto objective = [&] {
    be->attention_forward(st, q, k, v, mask, AttentionLogits{0.5}, out, lse);
    return dot(*be, out, proj);
  };
  objective();
  Tensor dq = be->empty(q.shape(), DType::F64), dk = be->empty(k.shape(), DType::F64),
         dv = be->empty(v.shape(), DType::F64);
  be->attention_backward(st, q, k, v, out, proj, lse, mask, AttentionLogits{0.5}, dq, dk, dv, false);
  expect_grad_matches(*be, q, objective, dq, 1e-6, "dq");
  expect_grad_matches(*be, k, objective, dk, 1e-6, "dk");
  expect_grad_matches(*be, v, objective, dv, 1e-6, "dv");
}

// The attention spec's parts, each against F64 finite differences of out·proj: a sliding window
// shorter than the documents, soft-capped logits, sinks (their own gradient too), all together.
TEST_F(CpuOps, AttentionSpecBackwardMatchesFiniteDifferences) {
  const int t = 9, hq = 4, hkv = 2, d = 3;
  auto pm = packed_mask(*be, {0, 0, 0, 0, 0, 0, 1, 1, 1}, {0, 1, 2, 3, 4, 5, 0, 1, 2});
  AttentionMask mask{pm.doc, pm.pos, pm.doc, pm.pos};
  struct Spec {
    const char* name;
    AttentionLogits logits;
    bool sinks;
  };
  for (const Spec& spec : {Spec{"window 2", {0.5, 0, 2}, false}, Spec{"soft-cap 0.8", {1.5, 0.8, 0}, false},
                           Spec{"sinks", {0.5, 0, 0}, true}, Spec{"window 3, soft-cap, sinks", {1.5, 0.8, 3}, true}}) {
    SCOPED_TRACE(spec.name);
    Tensor q = random_tensor(*be, Shape{t, hq, d}, DType::F64, rng);
    Tensor k = random_tensor(*be, Shape{t, hkv, d}, DType::F64, rng);
    Tensor v = random_tensor(*be, Shape{t, hkv, d}, DType::F64, rng);
    Tensor sinks = random_tensor(*be, Shape{hq}, DType::F64, rng);
    Tensor proj = random_tensor(*be, q.shape(), DType::F64, rng);
    Tensor out = be->empty(q.shape(), DType::F64), lse = be->empty(Shape{hq, t}, DType::F64);
    auto objective = [&] {
      be->attention_forward(st, q, k, v, mask, spec.logits, out, lse);
      if (spec.sinks) be->attention_sink_forward(st, out, lse, sinks);
      return dot(*be, out, proj);
    };
    objective();
    Tensor dq = be->empty(q.shape(), DType::F64), dk = be->empty(k.shape(), DType::F64),
           dv = be->empty(v.shape(), DType::F64), dsinks = be->zeros(Shape{hq}, DType::F64);
    be->attention_backward(st, q, k, v, out, proj, lse, mask, spec.logits, dq, dk, dv, false);
    if (spec.sinks) be->attention_sink_backward(st, out, proj, lse, sinks, dsinks);
    expect_grad_matches(*be, q, objective, dq, 1e-6, "dq");
    expect_grad_matches(*be, k, objective, dk, 1e-6, "dk");
    expect_grad_matches(*be, v, objective, dv, 1e-6, "dv");
    if (spec.sinks) expect_grad_matches(*be, sinks, objective, dsinks, 1e-6, "dsinks");
  }
}

// GeGLU with GELU-tanh (Gemma's MLP) and soft-capped logits, against F64 finite differences.
TEST_F(CpuOps, GegluTanhAndSoftcapMatchFiniteDifferences) {
  const Shape shape{5, 7};
  Tensor gate = random_tensor(*be, shape, DType::F64, rng, 3.0), up = random_tensor(*be, shape, DType::F64, rng);
  Tensor proj = random_tensor(*be, shape, DType::F64, rng), out = be->empty(shape, DType::F64);
  auto geglu = [&] {
    be->geglu_tanh_forward(st, gate, up, out);
    return dot(*be, out, proj);
  };
  geglu();
  // gelu_tanh(1) = 0.8411920…, transformers' gelu_pytorch_tanh at 1.
  Tensor one = be->empty(Shape{1}, DType::F64), ones = be->empty(Shape{1}, DType::F64), y = be->empty(Shape{1}, DType::F64);
  be->fill(st, one, 1.0);
  be->fill(st, ones, 1.0);
  be->geglu_tanh_forward(st, one, ones, y);
  EXPECT_NEAR(to_host(*be, y)[0], 0.8411919906082768, 1e-15);
  Tensor dgate = be->empty(shape, DType::F64), dup = be->empty(shape, DType::F64);
  be->geglu_tanh_backward(st, gate, up, proj, dgate, dup);
  expect_grad_matches(*be, gate, geglu, dgate, 1e-6, "dgate");
  expect_grad_matches(*be, up, geglu, dup, 1e-6, "dup");

  Tensor x = random_tensor(*be, shape, DType::F64, rng, 4.0), capped = be->empty(shape, DType::F64);
  auto softcap = [&] {
    be->softcap_forward(st, x, 1.5, capped);
    return dot(*be, capped, proj);
  };
  softcap();
  for (double v : to_host(*be, capped)) EXPECT_LT(std::fabs(v), 1.5);
  Tensor d = be->empty(shape, DType::F64);
  be->copy(st, proj, d);
  be->softcap_backward(st, capped, 1.5, d);
  expect_grad_matches(*be, x, softcap, d, 1e-6, "dx");
}

// The window as transformers defines it: query q sees keys q − W + 1 … q of its document.
TEST_F(CpuOps, SlidingWindowSeesTheLastWindowKeys) {
  const int t = 6, d = 2;
  auto pm = packed_mask(*be, std::vector<int>(t, 0), {0, 1, 2, 3, 4, 5});
  AttentionMask mask{pm.doc, pm.pos, pm.doc, pm.pos};
  Tensor q = be->zeros(Shape{t, 1, d}, DType::F64), k = be->zeros(Shape{t, 1, d}, DType::F64);
  std::vector<double> values(t * d);
  for (int j = 0; j < t; ++j) values[j * d] = j, values[j * d + 1] = 1;
  Tensor v = be->empty(Shape{t, 1, d}, DType::F64);
  from_host(*be, values, v);
  Tensor out = be->empty(q.shape(), DType::F64), lse = be->empty(Shape{1, t}, DType::F64);
  be->attention_forward(st, q, k, v, mask, AttentionLogits{1.0, 0, 3}, out, lse);
  const std::vector<double> o = to_host(*be, out), l = to_host(*be, lse);
  for (int i = 0; i < t; ++i) {  // equal logits: the mean of the visible keys' first value
    const int first = std::max(0, i - 2);
    EXPECT_DOUBLE_EQ(o[i * d], (first + i) / 2.0) << "query " << i;
    EXPECT_NEAR(l[i], std::log(i - first + 1.0), 1e-15) << "query " << i;
  }
}

TEST_F(CpuOps, AttentionRowWithoutKeysGivesZeroAndNegInfLse) {
  // Query block sees a key block from a later part of the same document: every row is empty.
  auto qm = packed_mask(*be, {0, 0}, {0, 1});
  auto km = packed_mask(*be, {0, 0}, {2, 3});
  AttentionMask mask{qm.doc, qm.pos, km.doc, km.pos};
  Tensor q = random_tensor(*be, Shape{2, 1, 2}, DType::F32, rng);
  Tensor k = random_tensor(*be, Shape{2, 1, 2}, DType::F32, rng);
  Tensor v = random_tensor(*be, Shape{2, 1, 2}, DType::F32, rng);
  Tensor out = be->empty(q.shape(), DType::F32), lse = be->empty(Shape{1, 2}, DType::F32);
  be->attention_forward(st, q, k, v, mask, AttentionLogits{1.0}, out, lse);
  for (double o : to_host(*be, out)) EXPECT_EQ(o, 0.0);
  for (double l : to_host(*be, lse)) EXPECT_TRUE(std::isinf(l) && l < 0);
  Tensor dq = be->empty(q.shape(), DType::F32), dk = be->empty(k.shape(), DType::F32),
         dv = be->empty(v.shape(), DType::F32);
  be->attention_backward(st, q, k, v, out, random_tensor(*be, q.shape(), DType::F32, rng), lse, mask, AttentionLogits{1.0}, dq, dk, dv,
                         false);
  for (const Tensor* g : {&dq, &dk, &dv})
    for (double x : to_host(*be, *g)) EXPECT_EQ(x, 0.0);
}

TEST_F(CpuOps, MergingKeyBlocksEqualsAttentionOverAllKeys) {
  // Split the keys of a causal sequence into two blocks, attend to each, merge: same as all keys.
  const int t = 6, hq = 2, d = 4;
  std::vector<int> docs(t, 0), pos = {0, 1, 2, 3, 4, 5};
  auto full = packed_mask(*be, docs, pos);
  auto first = packed_mask(*be, {0, 0, 0}, {0, 1, 2});
  auto second = packed_mask(*be, {0, 0, 0}, {3, 4, 5});
  Tensor q = random_tensor(*be, Shape{t, hq, d}, DType::F64, rng);
  Tensor k = random_tensor(*be, Shape{t, hq, d}, DType::F64, rng);
  Tensor v = random_tensor(*be, Shape{t, hq, d}, DType::F64, rng);
  Tensor ref = be->empty(q.shape(), DType::F64), ref_lse = be->empty(Shape{hq, t}, DType::F64);
  be->attention_forward(st, q, k, v, {full.doc, full.pos, full.doc, full.pos}, AttentionLogits{0.5}, ref, ref_lse);

  Tensor out = be->empty(q.shape(), DType::F64), lse = be->empty(Shape{hq, t}, DType::F64);
  Tensor ob = be->empty(q.shape(), DType::F64), lb = be->empty(Shape{hq, t}, DType::F64);
  // The second block first: rows 0..2 see none of its keys (−inf), which the merge must ignore.
  be->attention_forward(st, q, k.rows(3, 6), v.rows(3, 6), {full.doc, full.pos, second.doc, second.pos}, AttentionLogits{0.5}, out,
                        lse);
  be->attention_forward(st, q, k.rows(0, 3), v.rows(0, 3), {full.doc, full.pos, first.doc, first.pos}, AttentionLogits{0.5}, ob, lb);
  be->attention_merge(st, out, lse, ob, lb);
  expect_close(to_host(*be, out), to_host(*be, ref), 1e-12, "merged out");
  expect_close(to_host(*be, lse), to_host(*be, ref_lse), 1e-12, "merged lse");

  // Backward per block with the final out/lse sums to the full backward.
  Tensor dout = random_tensor(*be, q.shape(), DType::F64, rng);
  Tensor dq = be->empty(q.shape(), DType::F64), dk = be->empty(k.shape(), DType::F64),
         dv = be->empty(v.shape(), DType::F64);
  be->attention_backward(st, q, k, v, ref, dout, ref_lse, {full.doc, full.pos, full.doc, full.pos}, AttentionLogits{0.5}, dq, dk, dv,
                         false);
  Tensor dq2 = be->zeros(q.shape(), DType::F64), dk2 = be->zeros(k.shape(), DType::F64),
         dv2 = be->zeros(v.shape(), DType::F64);
  for (int b = 0; b < 2; ++b) {
    auto& m = b ? second : first;
    Tensor dkb = dk2.rows(3 * b, 3 * b + 3), dvb = dv2.rows(3 * b, 3 * b + 3);
    be->attention_backward(st, q, k.rows(3 * b, 3 * b + 3), v.rows(3 * b, 3 * b + 3), out, dout, lse,
                           {full.doc, full.pos, m.doc, m.pos}, AttentionLogits{0.5}, dq2, dkb, dvb, true);
  }
  expect_close(to_host(*be, dq2), to_host(*be, dq), 1e-12, "dq");
  expect_close(to_host(*be, dk2), to_host(*be, dk), 1e-12, "dk");
  expect_close(to_host(*be, dv2), to_host(*be, dv), 1e-12, "dv");
}

TEST_F(CpuOps, SwigluBackwardMatchesFiniteDifferences) {
  Tensor gate = random_tensor(*be, Shape{3, 4}, DType::F64, rng, 3.0);
  Tensor up = random_tensor(*be, Shape{3, 4}, DType::F64, rng);
  Tensor proj = random_tensor(*be, Shape{3, 4}, DType::F64, rng);
  Tensor out = be->empty(Shape{3, 4}, DType::F64);
  auto objective = [&] {
    be->swiglu_forward(st, gate, up, out);
    return dot(*be, out, proj);
  };
  Tensor dg = be->empty(gate.shape(), DType::F64), du = be->empty(up.shape(), DType::F64);
  be->swiglu_backward(st, gate, up, proj, dg, du);
  expect_grad_matches(*be, gate, objective, dg, 1e-6, "dgate");
  expect_grad_matches(*be, up, objective, du, 1e-6, "dup");
}

TEST_F(CpuOps, CrossEntropyValueAndGradient) {
  const int n = 4, vocab = 7;
  Tensor logits = random_tensor(*be, Shape{n, vocab}, DType::F64, rng, 4.0);
  Tensor targets = int_tensor(*be, {1, 6, 0, 3});
  std::vector<double> w = {1.0, 0.0, 2.5, 0.5};
  Tensor weights = be->empty(Shape{n}, DType::F64);
  from_host(*be, w, weights);
  Tensor work = be->empty(logits.shape(), DType::F64);
  Tensor loss = be->zeros(Shape{1}, DType::F64), ce = be->empty(Shape{n}, DType::F32);
  auto objective = [&] {
    be->copy(st, logits, work);
    Tensor l = be->zeros(Shape{1}, DType::F64);
    be->cross_entropy(st, work, targets, weights, 0.25, 0.25, l, ce);
    return to_host(*be, l)[0];
  };
  const double value = objective();
  auto L = to_host(*be, logits);
  double expect = 0;
  const int tg[] = {1, 6, 0, 3};
  for (int r = 0; r < n; ++r) {
    double z = 0;
    for (int j = 0; j < vocab; ++j) z += std::exp(L[r * vocab + j]);
    const double c = std::log(z) - L[r * vocab + tg[r]];
    EXPECT_NEAR(to_host(*be, ce)[r], c, 1e-5);
    expect += w[r] * c;
  }
  EXPECT_NEAR(value, expect * 0.25, 1e-12);
  be->copy(st, logits, work);
  be->cross_entropy(st, work, targets, weights, 0.25, 0.25, loss, ce);
  expect_grad_matches(*be, logits, objective, work, 1e-6, "dlogits");
}

TEST_F(CpuOps, EmbeddingGatherScatterAndBias) {
  Tensor table = random_tensor(*be, Shape{5, 3}, DType::F64, rng);
  Tensor ids = int_tensor(*be, {4, 0, 4});
  Tensor out = be->empty(Shape{3, 3}, DType::F64);
  be->embedding_forward(st, ids, table, out);
  auto T = to_host(*be, table), O = to_host(*be, out);
  for (int e = 0; e < 3; ++e) {
    EXPECT_EQ(O[e], T[12 + e]);
    EXPECT_EQ(O[3 + e], T[e]);
  }
  Tensor dtable = be->zeros(table.shape(), DType::F64);
  Tensor ones = be->empty(Shape{3, 3}, DType::F64);
  be->fill(st, ones, 1.0);
  be->embedding_backward(st, ids, ones, dtable, -1);
  auto D = to_host(*be, dtable);
  EXPECT_EQ(D[12], 2.0);
  EXPECT_EQ(D[0], 1.0);
  EXPECT_EQ(D[3], 0.0);
  // The padding row (transformers' padding_idx) gets nothing from its lookups; the others as before.
  be->embedding_backward(st, ids, ones, dtable, 4);
  D = to_host(*be, dtable);
  EXPECT_EQ(D[12], 2.0);
  EXPECT_EQ(D[0], 2.0);
  Tensor one_row = out.rows(0, 1);
  EXPECT_THROW(be->embedding_forward(st, int_tensor(*be, {5}), table, one_row), Error);

  Tensor g = be->empty(Shape{2, 3}, DType::F64);
  be->gather_rows(st, table, int_tensor(*be, {2, 1}), g);
  auto G = to_host(*be, g);
  EXPECT_EQ(G[0], T[6]);
  EXPECT_EQ(G[3], T[3]);
  Tensor acc = be->zeros(Shape{5, 3}, DType::F64);
  be->scatter_add_rows(st, g, int_tensor(*be, {2, 2}), acc);
  EXPECT_EQ(to_host(*be, acc)[6], T[6] + T[3]);

  Tensor dy = random_tensor(*be, Shape{4, 3}, DType::F64, rng);
  Tensor db = be->zeros(Shape{3}, DType::F64);
  be->bias_backward(st, dy, db);
  auto Y = to_host(*be, dy);
  EXPECT_NEAR(to_host(*be, db)[1], Y[1] + Y[4] + Y[7] + Y[10], 1e-12);
}

TEST_F(CpuOps, AdamWMatchesTorchFormula) {
  Tensor p = random_tensor(*be, Shape{6}, DType::F32, rng), g = random_tensor(*be, Shape{6}, DType::F32, rng);
  Tensor m = be->zeros(Shape{6}, DType::F32), v = be->zeros(Shape{6}, DType::F32);
  auto P = to_host(*be, p), Gr = to_host(*be, g);
  Backend::AdamW hp{1e-2, 0.9, 0.999, 1e-8, 0.1, 1, 0.5};
  be->adamw_step(st, p, g, m, v, hp);
  auto P2 = to_host(*be, p);
  for (int i = 0; i < 6; ++i) {
    const double gi = Gr[i] * 0.5;
    double pi = P[i] * (1 - 1e-2 * 0.1);
    const double mi = 0.1 * gi, vi = 0.001 * gi * gi;
    pi -= (1e-2 / 0.1) * mi / (std::sqrt(vi) / std::sqrt(0.001) + 1e-8);
    EXPECT_NEAR(P2[i], pi, 1e-6);
  }
}

TEST_F(CpuOps, RejectsWrongDtypesWithAClearMessage) {
  Tensor a = be->empty(Shape{2, 2}, DType::BF16);
  Tensor b = be->empty(Shape{2, 2}, DType::BF16);
  try {
    be->gemm(st, a, false, b, false, a, 1, 0);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("F32 or F64"), std::string::npos) << e.what();
  }
}
