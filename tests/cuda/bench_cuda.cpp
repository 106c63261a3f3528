// Throughput of the CUDA backend's heavy kernels on the current GPU, for docs/perf.md:
//   attention forward/backward (TFLOP/s), cuBLASLt GEMM (TFLOP/s), elementwise bandwidth (TB/s).
// FLOP counts: attention forward = 4·D·Hq per visible (query, key) pair (QKᵀ and PV), backward =
// 2.5× forward (FlashAttention's convention; 5 GEMM-shaped products instead of 2); for a causal
// sequence of T tokens the pairs are T(T+1)/2. GEMM = 2·M·N·K. Bandwidth = bytes read + written.
// Inputs are random (zeros run faster than real data), times are medians of CUDA-event timings
// after warm-up. Usage: bench_cuda [--quick | --profile | --profile-packed | --attention |
// --attention-d256 | --delta-states | --packed | --overlap | --lora]. Each attention variant compared here is a backend made with that choice
// (make_cuda_backend's CudaBackendOptions).
// --profile runs the engine's attention forward and backward once each at 32k causal (Hq=12, Hkv=2,
// D=128), for a profiler (scripts/gpu/profile_attention.sh); --profile-packed the same on a 32k row
// of 32 documents of 1k. --packed: the engine's kernels on packed 32k rows only (documents of 4k,
// 1k and 128, causal, and 1k bidirectional: every tile fully visible, no per-element mask).
// --attention-d256: head dim 256 at Qwen3.6's attention shape (Hq 16, Hkv 2), one causal document:
// the engine's own kernels (the simple ones: no tensor-core kernel takes 256) against cuDNN.
// --delta-states: the state-passing delta rule (ring sequence parallelism over DeltaNet layers) at
// Qwen3.6's DeltaNet shape (Hk 16, Hv 32, dk = dv = 128), one run, forward and backward.
// --cudnn-workspace: the workspace cuDNN's own plans ask for, forward and backward, one causal
// document at the attention shapes of the configs/ models, 4k to 1M tokens (builds plans only, runs
// nothing), for the plan's model of it (backend/cuda/attention_scratch.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/attention_cudnn.h"
#include "backend/cuda/cuda_backend.h"
#include "core/error.h"

using namespace spindle;

namespace {

struct Row {
  std::string what;
  double ms, rate;
  const char* unit;
};
std::vector<Row> rows;
bool g_profile = false;  // one warm-up and one timed launch per kernel

double median_ms(Backend& be, const std::function<void()>& fn, int warmup, int reps) {
  auto st = static_cast<cudaStream_t>(be.default_stream().handle);
  for (int i = 0; i < warmup; ++i) fn();
  be.synchronize(be.default_stream());
  std::vector<double> times;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, st);
    fn();
    cudaEventRecord(b, st);
    cudaEventSynchronize(b);
    float ms = 0;
    cudaEventElapsedTime(&ms, a, b);
    times.push_back(ms);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  be.synchronize(be.default_stream());
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

// Random values, uploaded as a repeating pattern of 4M + 7 values (rows never line up).
void fill_random(Backend& be, Tensor& t, double scale, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  const int64_t period = (int64_t{4} << 20) + 7;
  const int64_t n = t.numel();
  const size_t es = dtype_size(t.dtype());
  std::vector<unsigned char> host(static_cast<size_t>(std::min(n, period)) * es);
  for (int64_t i = 0; i < std::min(n, period); ++i) {
    const float v = dist(rng);
    if (t.dtype() == DType::BF16) {
      const uint16_t h = f32_to_bf16(v);
      std::memcpy(&host[i * es], &h, 2);
    } else {
      std::memcpy(&host[i * es], &v, 4);
    }
  }
  for (int64_t off = 0; off < n; off += period) {
    const int64_t count = std::min(period, n - off);
    Tensor part = t.flat(off, count);
    be.copy_from_host(be.default_stream(), host.data(), part);
  }
}

Tensor ints(Backend& be, const std::vector<int>& v) {
  Tensor t = be.empty(Shape{static_cast<int64_t>(v.size())}, DType::I32);
  be.copy_from_host(be.default_stream(), v.data(), t);
  return t;
}

void bench_bandwidth(Backend& be) {
  const int64_t n = int64_t{256} << 20;  // 256 Mi elements
  Tensor x = be.empty(Shape{n}, DType::F32), y = be.empty(Shape{n}, DType::F32);
  fill_random(be, x, 1.0, 1);
  fill_random(be, y, 1.0, 2);
  Stream s = be.default_stream();
  double ms = median_ms(be, [&] { be.copy(s, x, y); }, 3, 20);
  rows.push_back({"copy F32 1 GiB (cudaMemcpy D2D)", ms, 2.0 * n * 4 / ms / 1e9, "TB/s"});
  ms = median_ms(be, [&] { be.scale(s, x, 1.0000001); }, 3, 20);
  rows.push_back({"scale F32 1 GiB in place", ms, 2.0 * n * 4 / ms / 1e9, "TB/s"});
  ms = median_ms(be, [&] { be.axpy(s, 1e-7, x, y); }, 3, 20);
  rows.push_back({"axpy F32 2x1 GiB", ms, 3.0 * n * 4 / ms / 1e9, "TB/s"});
  Tensor xb = be.empty(Shape{n}, DType::BF16), yb = be.empty(Shape{n}, DType::BF16);
  fill_random(be, xb, 1.0, 3);
  fill_random(be, yb, 1.0, 4);
  ms = median_ms(be, [&] { be.axpy(s, 1e-3, xb, yb); }, 3, 20);
  rows.push_back({"axpy BF16 2x512 MiB", ms, 3.0 * n * 2 / ms / 1e9, "TB/s"});
  ms = median_ms(be, [&] { be.copy(s, x, xb); }, 3, 20);
  rows.push_back({"convert F32 -> BF16 1 GiB", ms, 1.0 * n * 6 / ms / 1e9, "TB/s"});
}

void bench_gemm(Backend& be, int64_t m, int64_t n, int64_t k, bool ta, bool tb, const char* label) {
  Tensor a = be.empty(ta ? Shape{k, m} : Shape{m, k}, DType::BF16);
  Tensor b = be.empty(tb ? Shape{n, k} : Shape{k, n}, DType::BF16);
  Tensor c = be.empty(Shape{m, n}, DType::BF16);
  fill_random(be, a, 1.0, 5);
  fill_random(be, b, 1.0, 6);
  const double ms = median_ms(be, [&] { be.gemm(be.default_stream(), a, ta, b, tb, c, 1.0, 0.0); }, 3, 10);
  rows.push_back({label, ms, 2.0 * m * n * k / ms / 1e9, "TFLOP/s"});
}

// Attention over a packed row of `docs` documents of `len` tokens each (docs = 1: one causal
// sequence). full = every key visible to every query (non-causal).
// which: 3 = forward and backward, 1 = forward only, 2 = backward only.
std::string doc_label(int64_t docs, const std::vector<int64_t>& lengths) {
  if (!lengths.empty()) return " docs=" + std::to_string(lengths.size()) + " mixed";
  return docs > 1 ? " docs=" + std::to_string(docs) : "";
}

// `lengths`, when given, replaces docs x len (documents of those lengths, causal, label "mixed").
void bench_attention(Backend& be, int64_t docs, int64_t len, int hq, int hkv, int d, bool full, const char* impl,
                     int which = 3, const std::vector<int64_t>& lengths = {}) {
  std::vector<int64_t> doc_len = lengths.empty() ? std::vector<int64_t>(docs, len) : lengths;
  int64_t t = 0;
  for (int64_t n : doc_len) t += n;
  std::vector<int> doc, pos;
  for (size_t dd = 0; dd < doc_len.size(); ++dd)
    for (int64_t i = 0; i < doc_len[dd]; ++i) {
      doc.push_back(static_cast<int>(dd));
      pos.push_back(full ? 0 : static_cast<int>(i));
    }
  docs = static_cast<int64_t>(doc_len.size());
  AttentionMask mask{ints(be, doc), ints(be, pos), ints(be, doc), ints(be, pos)};
  mask.plain_causal = docs == 1 && !full;  // as the trainer says it for a one-document row
  Tensor q = be.empty(Shape{t, hq, d}, DType::BF16), k = be.empty(Shape{t, hkv, d}, DType::BF16);
  Tensor v = be.empty(Shape{t, hkv, d}, DType::BF16), dout = be.empty(Shape{t, hq, d}, DType::BF16);
  fill_random(be, q, 2.0, 7);
  fill_random(be, k, 2.0, 8);
  fill_random(be, v, 1.0, 9);
  fill_random(be, dout, 1.0, 10);
  Tensor out = be.empty(q.shape(), DType::BF16), lse = be.empty(Shape{hq, t}, DType::F32);
  Tensor dq = be.empty(q.shape(), DType::BF16), dk = be.empty(k.shape(), DType::BF16);
  Tensor dv = be.empty(v.shape(), DType::BF16);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  Stream s = be.default_stream();
  const int reps = g_profile ? 1 : t >= 32768 ? 5 : 10;
  double f_ms = median_ms(be, [&] { be.attention_forward(s, q, k, v, mask, AttentionLogits{scale}, out, lse); }, 2,
                          which & 1 ? reps : 1);
  const double b_ms =
      which & 2 ? median_ms(
                      be, [&] { be.attention_backward(s, q, k, v, out, dout, lse, mask, AttentionLogits{scale}, dq, dk, dv, false); },
                      1, reps)
                : 0.0;
  // Sanity: every lse finite (each row sees at least its own key).
  std::vector<float> l(static_cast<size_t>(hq * t));
  be.copy_to_host(s, lse, l.data());
  int64_t bad = 0;
  for (float x : l) bad += !std::isfinite(x);
  double pairs = 0;
  for (int64_t n : doc_len) pairs += full ? double(n) * n : double(n) * (n + 1) / 2.0;
  const double fwd_flops = 4.0 * d * hq * pairs;
  char label[200];
  std::snprintf(label, sizeof label, "attn %s fwd T=%lld%s Hq=%d Hkv=%d D=%d %s%s", impl,
                static_cast<long long>(t), doc_label(docs, lengths).c_str(), hq, hkv, d,
                full ? "full" : "causal", bad ? " NONFINITE-LSE" : "");
  if (which & 1) rows.push_back({label, f_ms, fwd_flops / f_ms / 1e9, "TFLOP/s"});
  if (!(which & 2)) return;
  std::snprintf(label, sizeof label, "attn %s bwd T=%lld%s Hq=%d Hkv=%d D=%d %s", impl, static_cast<long long>(t),
                doc_label(docs, lengths).c_str(), hq, hkv, d, full ? "full" : "causal");
  rows.push_back({label, b_ms, 2.5 * fwd_flops / b_ms / 1e9, "TFLOP/s"});
  if (!(which & 1)) return;
  std::snprintf(label, sizeof label, "attn %s fwd+bwd T=%lld%s D=%d %s", impl, static_cast<long long>(t),
                doc_label(docs, lengths).c_str(), d, full ? "full" : "causal");
  rows.push_back({label, f_ms + b_ms, 3.5 * fwd_flops / (f_ms + b_ms) / 1e9, "TFLOP/s"});
}

// One causal document of t tokens at the Qwen2.5-1.5B attention shape (Hq 12, Hkv 2, D 128), BF16,
// declared plain causal as the trainer declares such a row: random inputs and the outputs of a
// forward and a backward.
struct CausalRow {
  static constexpr int kHq = 12, kHkv = 2, kD = 128;
  CausalRow(Backend& be, int64_t t, uint64_t seed) : be(be) {
    std::vector<int> doc(static_cast<size_t>(t), 0), pos(static_cast<size_t>(t));
    for (int64_t i = 0; i < t; ++i) pos[static_cast<size_t>(i)] = static_cast<int>(i);
    mask = AttentionMask{ints(be, doc), ints(be, pos), ints(be, doc), ints(be, pos)};
    mask.plain_causal = true;
    q = be.empty(Shape{t, kHq, kD}, DType::BF16);
    k = be.empty(Shape{t, kHkv, kD}, DType::BF16);
    v = be.empty(k.shape(), DType::BF16);
    dout = be.empty(q.shape(), DType::BF16);
    for (Tensor* x : {&q, &k, &v, &dout}) fill_random(be, *x, 1.0, seed);
    out = be.empty(q.shape(), DType::BF16);
    lse = be.empty(Shape{kHq, t}, DType::F32);
    dq = be.empty(q.shape(), DType::BF16);
    dk = be.empty(k.shape(), DType::BF16);
    dv = be.empty(k.shape(), DType::BF16);
  }
  void forward(Stream s) { be.attention_forward(s, q, k, v, mask, AttentionLogits{scale}, out, lse); }
  void backward(Stream s) { be.attention_backward(s, q, k, v, out, dout, lse, mask, AttentionLogits{scale}, dq, dk, dv, false); }

  Backend& be;
  AttentionMask mask;
  Tensor q, k, v, dout, out, lse, dq, dk, dv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(kD));
};

// The cost of a shape's first call (cuDNN builds its plans then; the engine's kernels have none):
// wall time of a first forward + backward at a length not seen before, less the same pair again.
void bench_first_call(Backend& be, int64_t t, const char* impl) {
  CausalRow row(be, t, 21);
  Stream s = be.default_stream();
  auto pair_ms = [&] {
    be.synchronize(s);
    const auto t0 = std::chrono::steady_clock::now();
    row.forward(s);
    row.backward(s);
    be.synchronize(s);
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  };
  const double first = pair_ms(), again = pair_ms();
  char label[160];
  std::snprintf(label, sizeof label, "attn %s first call T=%lld (fwd+bwd; rate = extra ms)", impl,
                static_cast<long long>(t));
  rows.push_back({label, first, first - again, "ms"});
}

// LoRA backward through B (dxa = s·dy·B, dB += s·dyᵀ·xa) at the step's shapes, rank 16: the fused
// kernel against the two GEMMs it replaces. Rate = dy's bytes (read once by the fused kernel, twice
// by the GEMMs) per second.
void bench_lora(Backend& be) {
  struct Case {
    int64_t t, out;
    const char* what;
  };
  for (const Case c : {Case{65536, 8960, "gate/up"}, Case{65536, 1536, "q/o/down"}, Case{65536, 256, "k/v"},
                       Case{32768, 8960, "gate/up"}}) {
    const int64_t r = 16;
    Tensor dy = be.empty(Shape{c.t, c.out}, DType::BF16), b = be.empty(Shape{c.out, r}, DType::BF16);
    Tensor xa = be.empty(Shape{c.t, r}, DType::BF16), dxa = be.empty(Shape{c.t, r}, DType::BF16);
    Tensor db = be.empty(Shape{c.out, r}, DType::BF16);
    for (Tensor* x : {&dy, &b, &xa, &db}) fill_random(be, *x, 1.0, 41);
    Stream s = be.default_stream();
    const double gb = 2.0 * c.t * c.out / 1e9;
    const double fused = median_ms(be, [&] { be.lora_b_backward(s, dy, b, xa, 2.0, dxa, &db); }, 3, 20);
    const double gemms = median_ms(be, [&] { be.Backend::lora_b_backward(s, dy, b, xa, 2.0, dxa, &db); }, 3, 20);
    char label[120];
    std::snprintf(label, sizeof label, "lora_b_backward fused %lldx%lldx16 (%s)", static_cast<long long>(c.t),
                  static_cast<long long>(c.out), c.what);
    rows.push_back({label, fused, gb / fused, "TB/s of dy"});
    std::snprintf(label, sizeof label, "lora_b_backward 2 gemms %lldx%lldx16 (%s)", static_cast<long long>(c.t),
                  static_cast<long long>(c.out), c.what);
    rows.push_back({label, gemms, gb / gemms, "TB/s of dy"});
  }
}

// Does work off the critical path hide under the attention backward? One layer's LoRA weight
// gradients at 64k (rank 16: dB and dA of gate, up and down, K = 64k, memory-bound) on a second
// backend's stream (its own cuBLASLt workspace) while the 64k causal backward runs on the first:
// the pair's time against each alone.
void bench_overlap(Backend& be) {
  const int64_t t = 65536, h = 1536, f = 8960, r = 16;
  auto aux = make_cuda_backend(0);
  CausalRow row(be, t, 31);
  Stream s = be.default_stream(), s2 = aux->default_stream();
  row.forward(s);
  // gate/up/down: dy [t, out], x [t, in], xa/dxa [t, r]; F32 gradients here (the step's are BF16)
  Tensor dy_gate = be.empty(Shape{t, f}, DType::BF16), dy_up = be.empty(Shape{t, f}, DType::BF16);
  Tensor dy_down = be.empty(Shape{t, h}, DType::BF16), xn = be.empty(Shape{t, h}, DType::BF16);
  Tensor act = be.empty(Shape{t, f}, DType::BF16), xa = be.empty(Shape{t, r}, DType::BF16);
  Tensor dxa = be.empty(Shape{t, r}, DType::BF16);
  for (Tensor* x : {&dy_gate, &dy_up, &dy_down, &xn, &act, &xa, &dxa}) fill_random(be, *x, 1.0, 32);
  Tensor db_f = be.zeros(Shape{f, r}, DType::F32), db_h = be.zeros(Shape{h, r}, DType::F32);
  Tensor da_h = be.zeros(Shape{r, h}, DType::F32), da_f = be.zeros(Shape{r, f}, DType::F32);
  be.synchronize(s);
  auto attention = [&] { row.backward(s); };
  auto grads = [&](Backend& b, Stream st) {
    b.gemm(st, dy_gate, true, xa, false, db_f, 1.0, 1.0);  // dB gate
    b.gemm(st, dy_up, true, xa, false, db_f, 1.0, 1.0);    // dB up
    b.gemm(st, dxa, true, xn, false, da_h, 1.0, 1.0);      // dA gate
    b.gemm(st, dxa, true, xn, false, da_h, 1.0, 1.0);      // dA up
    b.gemm(st, dy_down, true, xa, false, db_h, 1.0, 1.0);  // dB down
    b.gemm(st, dxa, true, act, false, da_f, 1.0, 1.0);     // dA down
  };
  const double a_ms = median_ms(be, attention, 1, 7);
  const double g_ms = median_ms(be, [&] { grads(be, s); }, 2, 7);
  const double both_ms = median_ms(be, [&] {
    be.stream_wait(s2, s);
    grads(*aux, s2);
    attention();
    be.stream_wait(s, s2);
  }, 2, 7);
  const double serial_ms = median_ms(be, [&] {
    grads(be, s);
    attention();
  }, 2, 7);
  rows.push_back({"overlap: attention bwd 64k alone", a_ms, 0, "-"});
  rows.push_back({"overlap: LoRA dA/dB of gate/up/down alone", g_ms, 0, "-"});
  rows.push_back({"overlap: both, one stream", serial_ms, 0, "-"});
  rows.push_back({"overlap: both, grads on a second stream", both_ms, serial_ms - both_ms, "ms saved"});
}

// Bandwidth, GEMMs, then attention at 32k causal: the default choice, the engine's own kernels
// and the mma.sync fallback; without `quick` also other shapes and the simple kernels.
void bench_suite(Backend& be, bool quick) {
  bench_bandwidth(be);
  bench_gemm(be, 8192, 8192, 8192, false, false, "gemm BF16 8192^3");
  bench_gemm(be, 32768, 8960, 1536, false, true, "gemm BF16 x[32k,1536]·W[8960,1536]^T");
  bench_gemm(be, 1536, 8960, 32768, true, false, "gemm BF16 dW = x^T·dy (K=32k)");
  bench_attention(be, 1, 32768, 12, 2, 128, false, "auto");
  auto own = make_cuda_backend(0, {CudaAttention::Own});
  auto mma = make_cuda_backend(0, {CudaAttention::Mma});
  bench_attention(*own, 1, 32768, 12, 2, 128, false, "own");
  bench_attention(*mma, 1, 32768, 12, 2, 128, false, "mma");
  if (quick) return;
  bench_attention(be, 1, 8192, 12, 2, 128, false, "auto");
  bench_attention(be, 1, 16384, 12, 2, 128, true, "auto");
  bench_attention(be, 8, 4096, 12, 2, 128, false, "auto");
  bench_attention(be, 1, 32768, 28, 4, 128, false, "auto");
  bench_attention(be, 1, 32768, 16, 4, 64, false, "auto");
  auto simple = make_cuda_backend(0, {CudaAttention::Simple});
  bench_attention(*simple, 1, 4096, 12, 2, 128, false, "simple");
}

// The state-passing delta rule over one run of t tokens: unit-sized keys (‖k‖ ≈ 1), β 0.5, a slow
// decay, so the state stays finite over the whole run as in a model.
void bench_delta_states(Backend& be, int64_t t) {
  const int64_t hk = 16, hv = 32, d = 128;
  Stream s = be.default_stream();
  Tensor q = be.empty(Shape{t, hk, d}, DType::BF16), k = be.empty(Shape{t, hk, d}, DType::BF16);
  Tensor v = be.empty(Shape{t, hv, d}, DType::BF16), dout = be.empty(Shape{t, hv, d}, DType::BF16);
  fill_random(be, q, 0.15, 11);
  fill_random(be, k, 0.15, 12);
  fill_random(be, v, 1.0, 13);
  fill_random(be, dout, 1.0, 14);
  Tensor g = be.empty(Shape{t, hv}, DType::F32), beta = be.empty(Shape{t, hv}, DType::BF16);
  be.fill(s, g, -0.02);
  be.fill(s, beta, 0.5);
  Tensor ids = ints(be, std::vector<int>(static_cast<size_t>(t), 0));
  Tensor initial = be.empty(Shape{1, hv, d, d}, DType::F32), finals = be.empty(initial.shape(), DType::F32);
  fill_random(be, initial, 0.1, 15);
  Tensor out = be.empty(v.shape(), DType::BF16), dq = be.empty(q.shape(), DType::BF16);
  Tensor dk = be.empty(k.shape(), DType::BF16), dv = be.empty(v.shape(), DType::BF16);
  Tensor dg = be.empty(g.shape(), DType::F32), dbeta = be.empty(beta.shape(), DType::BF16);
  Tensor d_initial = be.empty(initial.shape(), DType::F32);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const double f_ms = median_ms(
      be, [&] { be.gated_delta_rule_forward_states(s, q, k, v, g, beta, ids, scale, 64, initial, out, finals); }, 1,
      3);
  const double b_ms = median_ms(
      be,
      [&] {
        be.gated_delta_rule_backward_states(s, q, k, v, g, beta, ids, scale, 64, initial, dout, finals, dq, dk, dv, dg,
                                            dbeta, d_initial);
      },
      1, 3);
  char label[200];
  std::snprintf(label, sizeof label, "delta rule states fwd T=%lld Hv=%lld d=%lld", static_cast<long long>(t),
                static_cast<long long>(hv), static_cast<long long>(d));
  rows.push_back({label, f_ms, t / f_ms / 1e3, "Mtok/s"});
  std::snprintf(label, sizeof label, "delta rule states bwd T=%lld Hv=%lld d=%lld", static_cast<long long>(t),
                static_cast<long long>(hv), static_cast<long long>(d));
  rows.push_back({label, b_ms, t / b_ms / 1e3, "Mtok/s"});
}

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const bool profile = argc > 1 && std::strcmp(argv[1], "--profile") == 0;
  const bool profile_packed = argc > 1 && std::strcmp(argv[1], "--profile-packed") == 0;
  const bool packed = argc > 1 && std::strcmp(argv[1], "--packed") == 0;
  const bool attention = argc > 1 && std::strcmp(argv[1], "--attention") == 0;
  const bool attention_d256 = argc > 1 && std::strcmp(argv[1], "--attention-d256") == 0;
  const bool delta_states = argc > 1 && std::strcmp(argv[1], "--delta-states") == 0;
  const bool overlap = argc > 1 && std::strcmp(argv[1], "--overlap") == 0;
  const bool lora = argc > 1 && std::strcmp(argv[1], "--lora") == 0;
  const bool cudnn_workspace = argc > 1 && std::strcmp(argv[1], "--cudnn-workspace") == 0;
  if (cuda_device_count() == 0) {
    std::printf("bench_cuda: no CUDA device\n");
    return 0;
  }
  try {
    cudaDeviceProp prop{};
    cudaGetDeviceProperties(&prop, 0);
    std::printf("device: %s, %d SMs, %.0f MiB, L2 %d MiB\n", prop.name, prop.multiProcessorCount,
                prop.totalGlobalMem / 1048576.0, prop.l2CacheSize >> 20);
    auto be = make_cuda_backend(0);
    if (cudnn_workspace) {
      if (!cuda::attention_cudnn_built()) {
        std::printf("bench_cuda: built without cuDNN\n");
        return 0;
      }
      // hq, hkv, d: Qwen2.5-1.5B, Qwen2.5-7B, Qwen2.5-72B, Qwen3-30B-A3B, Qwen3.6-35B-A3B
      const int shapes[][3] = {{12, 2, 128}, {28, 4, 128}, {64, 8, 128}, {32, 4, 128}, {16, 2, 256}};
      std::printf("%5s %4s %4s %9s %16s %16s %14s\n", "hq", "hkv", "d", "tokens", "forward bytes", "backward bytes",
                  "bwd / (T·Hq·D)");
      for (const auto& sh : shapes)
        for (int64_t t : {4096, 32768, 131072, 524288, 1048576}) {
          const cuda::AttentionShape a{t, t, sh[0], sh[1], sh[2]};
          int64_t fwd = 0, bwd = 0;
          try {
            fwd = cuda::attention_cudnn_workspace_bytes(a, cuda::CudnnMask::Causal, false);
            bwd = cuda::attention_cudnn_workspace_bytes(a, cuda::CudnnMask::Causal, true);
          } catch (const Error& e) {
            std::printf("%5d %4d %4d %9lld  no plan: %s\n", sh[0], sh[1], sh[2], static_cast<long long>(t), e.what());
            continue;
          }
          std::printf("%5d %4d %4d %9lld %16lld %16lld %14.4f\n", sh[0], sh[1], sh[2], static_cast<long long>(t),
                      static_cast<long long>(fwd), static_cast<long long>(bwd),
                      static_cast<double>(bwd) / static_cast<double>(t * sh[0] * sh[2]));
        }
      return 0;
    }
    if (profile || profile_packed || packed) {
      g_profile = profile || profile_packed;
      auto own = make_cuda_backend(0, {CudaAttention::Own});  // the engine's own kernels
      if (profile) bench_attention(*own, 1, 32768, 12, 2, 128, false, "own", 3);
      if (profile_packed) bench_attention(*own, 32, 1024, 12, 2, 128, false, "own", 3);
      if (!packed) return 0;
      // Documents of 256..4096 tokens filling 32k (scripts/gpu/bench_torch_varlen.py has the same).
      std::vector<int64_t> mixed;
      int64_t filled = 0;
      for (uint64_t i = 0; filled < 32768 - 4096; ++i) {
        mixed.push_back(256 + static_cast<int64_t>(((i + 1) * 2654435761ull) % (1ull << 32) % 3841));
        filled += mixed.back();
      }
      mixed.push_back(32768 - filled);
      for (int i = 0; i < 2; ++i) {
        bench_attention(*own, 0, 0, 12, 2, 128, false, "own", 3, mixed);
        bench_attention(*own, 8, 4096, 12, 2, 128, false, "own");
        bench_attention(*own, 32, 1024, 12, 2, 128, false, "own");
        bench_attention(*own, 256, 128, 12, 2, 128, false, "own");
        bench_attention(*own, 32, 1024, 12, 2, 128, true, "own");
      }
    } else if (attention_d256) {
      auto own = make_cuda_backend(0, {CudaAttention::Own});
      for (int64_t t : {2048, 8192}) bench_attention(*own, 1, t, 16, 2, 256, false, "own");
      if (!cuda::attention_cudnn_built()) std::printf("bench_cuda: built without cuDNN\n");
      else {
        auto dnn = make_cuda_backend(0, {CudaAttention::Cudnn});
        for (int64_t t : {2048, 8192, 32768, 65536}) bench_attention(*dnn, 1, t, 16, 2, 256, false, "cudnn");
        bench_attention(*dnn, 1, 32768, 16, 2, 128, false, "cudnn");  // the same scores at head dim 128
      }
    } else if (delta_states) {
      for (int64_t t : {4096, 16384}) bench_delta_states(*be, t);
    } else if (lora) {
      bench_lora(*be);
    } else if (overlap) {
      bench_overlap(*be);
      bench_overlap(*be);
    } else if (attention) {  // 32k causal: the engine's own kernels three times, then the default
                             // (cuDNN for a plain causal row when built with it) twice
      auto own = make_cuda_backend(0, {CudaAttention::Own});
      for (int i = 0; i < 3; ++i) bench_attention(*own, 1, 32768, 12, 2, 128, false, "own");
      if (!cuda::attention_cudnn_built()) std::printf("bench_cuda: built without cuDNN, auto = own\n");
      for (int i = 0; i < 2; ++i) bench_attention(*be, 1, 32768, 12, 2, 128, false, "auto");
      bench_attention(*own, 1, 65536, 12, 2, 128, false, "own");
      bench_attention(*be, 1, 65536, 12, 2, 128, false, "auto");
      bench_attention(*be, 1, 131072, 6, 1, 128, false, "auto");  // a rank's share under Ulysses 2
      // packed rows (the common SFT case; always the engine's kernels): the same 32k in documents
      bench_attention(*own, 8, 4096, 12, 2, 128, false, "own");
      bench_attention(*own, 32, 1024, 12, 2, 128, false, "own");
      if (cuda::attention_cudnn_built()) {  // what a new shape's cuDNN plans cost (worth_a_cudnn_plan)
        auto dnn = make_cuda_backend(0, {CudaAttention::Cudnn});
        for (int64_t t : {4093, 16381, 32749, 8192}) {
          bench_first_call(*own, t, "own");
          bench_first_call(*dnn, t, "cudnn");
        }
      }
    } else {
      bench_suite(*be, quick);
    }
  } catch (const Error& e) {
    std::fprintf(stderr, "bench_cuda: %s\n", e.what());
    return 1;
  }
  std::printf("\n%-58s %10s %10s\n", "kernel", "ms", "rate");
  for (const Row& r : rows) std::printf("%-58s %10.3f %8.1f %s\n", r.what.c_str(), r.ms, r.rate, r.unit);
  return 0;
}
