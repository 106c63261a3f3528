// Times the gated DeltaNet kernels of the CUDA backend (docs/perf.md): the chunked delta rule
// forward and backward at Qwen3.5/3.6 head shapes (16 key heads, 32 value heads of 128), the causal
// conv1d (alone and with the layer's split fused, each against what it replaced), a column copy and
// the gated RMSNorm, BF16, one document per row. Median of many runs, CUDA events; and the
// delta rule's device scratch per call, measured on the memory pool against what spindle plan counts.
// Not a test. usage: bench_gated_delta [tokens ...]   (default 16384 32768)
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gated_delta.h"
#include "backend/cuda/gated_delta_scratch.h"
#include "core/dtype.h"

using namespace spindle;

namespace {

Tensor random_bf16(Backend& be, Shape shape, std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint16_t> v(static_cast<size_t>(shape.numel()));
  for (auto& x : v) x = f32_to_bf16(dist(rng));
  Tensor t = be.empty(shape, DType::BF16);
  be.copy_from_host(be.default_stream(), v.data(), t);
  return t;
}

Tensor random_f32(Backend& be, Shape shape, std::mt19937_64& rng, float lo, float hi) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(static_cast<size_t>(shape.numel()));
  for (auto& x : v) x = dist(rng);
  Tensor t = be.empty(shape, DType::F32);
  be.copy_from_host(be.default_stream(), v.data(), t);
  return t;
}

// Median milliseconds of `reps` timed runs after two warm-up runs.
double median_ms(Backend& be, const std::function<void()>& op, int reps) {
  cudaStream_t s = static_cast<cudaStream_t>(be.default_stream().handle);
  for (int i = 0; i < 2; ++i) op();
  be.synchronize(be.default_stream());
  std::vector<double> ms;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, s);
    op();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  if (cuda_device_count() == 0) {
    std::fprintf(stderr, "bench_gated_delta: no CUDA device\n");
    return 1;
  }
  std::vector<int64_t> lengths;
  for (int i = 1; i < argc; ++i) lengths.push_back(std::atoll(argv[i]));
  if (lengths.empty()) lengths = {16384, 32768};
  auto be = make_cuda_backend(0);
  const Stream st = be->default_stream();
  std::mt19937_64 rng(7);
  const int64_t hk = 16, hv = 32, d = 128, chunk = 64, conv_width = 4;
  for (int64_t t : lengths) {
    const Shape qs{t, hk, d}, vs{t, hv, d}, hs{t, hv};
    Tensor q = random_bf16(*be, qs, rng, -0.15f, 0.15f), k = random_bf16(*be, qs, rng, -0.15f, 0.15f);
    Tensor v = random_bf16(*be, vs, rng, -1, 1), dout = random_bf16(*be, vs, rng, -1, 1);
    Tensor g = random_f32(*be, hs, rng, -0.5f, -0.001f), beta = random_bf16(*be, hs, rng, 0.1f, 0.9f);
    std::vector<int32_t> ids(static_cast<size_t>(t), 0);
    Tensor doc = be->empty(Shape{t}, DType::I32);
    be->copy_from_host(st, ids.data(), doc);
    Tensor out = be->empty(vs, DType::BF16), dq = be->empty(qs, DType::BF16), dk = be->empty(qs, DType::BF16),
           dv = be->empty(vs, DType::BF16), dg = be->empty(hs, DType::F32), dbeta = be->empty(hs, DType::BF16);
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    const double fwd = median_ms(*be, [&] { be->gated_delta_rule_forward(st, q, k, v, g, beta, doc, scale, chunk, out); }, 10);
    const double bwd = median_ms(*be, [&] {
      be->gated_delta_rule_backward(st, q, k, v, g, beta, doc, scale, chunk, dout, dq, dk, dv, dg, dbeta);
    }, 5);
    // The device scratch of one call: the pool's high-water mark above what was live before it,
    // against the list spindle plan counts for the tensor-core kernels (gated_delta_scratch.h).
    auto scratch_peak = [&](const std::function<void()>& op) {
      be->synchronize(st);
      const int64_t before = be->memory_stats().allocated_bytes;
      be->reset_peak_memory();
      op();
      be->synchronize(st);
      return static_cast<double>(be->memory_stats().peak_allocated_bytes - before);
    };
    const double fwd_scratch =
        scratch_peak([&] { be->gated_delta_rule_forward(st, q, k, v, g, beta, doc, scale, chunk, out); });
    const double bwd_scratch = scratch_peak([&] {
      be->gated_delta_rule_backward(st, q, k, v, g, beta, doc, scale, chunk, dout, dq, dk, dv, dg, dbeta);
    });
    const cuda::DeltaRuleShape sh{t, static_cast<int>(hk), static_cast<int>(hv), static_cast<int>(d),
                                  static_cast<int>(d), static_cast<int>(chunk)};
    double planned_fwd = 0, planned_bwd = 0;
    for (size_t b : cuda::delta_rule_mma_scratch(sh).forward()) planned_fwd += static_cast<double>(b);
    for (size_t b : cuda::delta_rule_mma_scratch(sh).backward()) planned_bwd += static_cast<double>(b);
    const double gib = 1024.0 * 1024.0 * 1024.0;
    std::printf("delta rule T %lld scratch: forward %.3f GiB (planned %.3f), backward %.3f GiB (planned %.3f)\n",
                static_cast<long long>(t), fwd_scratch / gib, planned_fwd / gib, bwd_scratch / gib,
                planned_bwd / gib);
    // Nominal multiply-adds per token and value head of the chunked algorithm (C = 64, dk = dv = d):
    // W·S, Q·S, Kᵀ·V_new (3·d²), Q·Kᵀ and K·Kᵀ lower halves (C·d), P·V_new (C·d/2), the solve (C·d).
    const double macs = 3.0 * d * d + 2.5 * chunk * d;
    const double fwd_flop = 2.0 * macs * t * hv, bwd_flop = 3.0 * fwd_flop;  // backward: recompute + 2x
    const double io_bytes = 2.0 * (2.0 * t * hk * d + 2.0 * t * hv * d) + 6.0 * t * hv;  // q, k, v, out, g, beta
    std::printf("delta rule T %lld Hk %lld Hv %lld d %lld bf16: forward %.3f ms (%.1f TFLOP/s nominal, %.0f GB/s of "
                "q/k/v/out), backward %.3f ms (%.1f TFLOP/s nominal)\n",
                static_cast<long long>(t), static_cast<long long>(hk), static_cast<long long>(hv),
                static_cast<long long>(d), fwd, fwd_flop / fwd / 1e9, io_bytes / fwd / 1e6, bwd,
                bwd_flop / bwd / 1e9);

    // The conv over the projected q, k, v channels: the register-window kernels against the row-wise
    // ones they replaced, and the layer's conv + split (q, k L2-normalised, v) fused against the
    // separate ops the layer ran before (row-wise conv, three column copies, two L2 norms).
    const int64_t channels = 2 * hk * d + hv * d, key = hk * d, value = hv * d;
    cudaStream_t cs = static_cast<cudaStream_t>(st.handle);
    Tensor x = random_bf16(*be, Shape{t, channels}, rng, -1, 1), y = be->empty(Shape{t, channels}, DType::BF16);
    Tensor w = random_bf16(*be, Shape{channels, 1, conv_width}, rng, -0.5f, 0.5f);
    Tensor dw = be->zeros(w.shape(), DType::BF16), dx = be->empty(x.shape(), DType::BF16);
    const double conv_f = median_ms(*be, [&] { be->causal_conv1d_silu_forward(st, x, w, doc, y); }, 20);
    const double conv_b = median_ms(*be, [&] { be->causal_conv1d_silu_backward(st, x, w, doc, y, dx, &dw); }, 20);
    const double row_f = median_ms(*be, [&] {
      cuda::causal_conv1d_silu_forward_rowwise(cs, x.data(), w.data(), DType::BF16, doc.data_as<int32_t>(), y.data(),
                                               DType::BF16, t, channels, conv_width);
    }, 20);
    const double row_b = median_ms(*be, [&] {
      cuda::causal_conv1d_silu_backward_rowwise(cs, x.data(), w.data(), DType::BF16, doc.data_as<int32_t>(),
                                                y.data(), dx.data(), dw.data(), DType::BF16, t, channels, conv_width);
    }, 20);
    const double conv_bytes = 2.0 * t * channels * 2;  // read x, write y
    std::printf("conv1d T %lld C %lld: forward %.3f ms (%.0f GB/s; row-wise %.3f ms, %.0f GB/s), backward %.3f ms "
                "(%.0f GB/s of x, dy, dx; row-wise %.3f ms, %.0f GB/s)\n",
                static_cast<long long>(t), static_cast<long long>(channels), conv_f, conv_bytes / conv_f / 1e6, row_f,
                conv_bytes / row_f / 1e6, conv_b, 1.5 * conv_bytes / conv_b / 1e6, row_b,
                1.5 * conv_bytes / row_b / 1e6);
    Tensor qn = be->empty(qs, DType::BF16), kn = be->empty(qs, DType::BF16), vn = be->empty(vs, DType::BF16);
    Tensor q_rstd = be->empty(Shape{t * hk}, DType::F32), k_rstd = be->empty(Shape{t * hk}, DType::F32);
    Tensor d_qkv = be->empty(x.shape(), DType::BF16);
    const double split_f =
        median_ms(*be, [&] { be->deltanet_conv_split_forward(st, x, w, doc, 1e-6, qn, kn, vn, q_rstd, k_rstd); }, 20);
    const double split_b = median_ms(*be, [&] {
      be->deltanet_conv_split_backward(st, x, w, doc, qn, kn, q_rstd, k_rstd, dq, dk, dv, d_qkv, &dw);
    }, 20);
    const double parts_f = median_ms(*be, [&] {
      Tensor mixed = be->empty(x.shape(), DType::BF16);
      cuda::causal_conv1d_silu_forward_rowwise(cs, x.data(), w.data(), DType::BF16, doc.data_as<int32_t>(),
                                               mixed.data(), DType::BF16, t, channels, conv_width);
      Tensor q_raw = be->empty(Shape{t, key}, DType::BF16), k_raw = be->empty(Shape{t, key}, DType::BF16);
      Tensor v_flat = vn.reshape(Shape{t, value});
      be->copy_columns(st, mixed, 0, q_raw, 0, key);
      be->copy_columns(st, mixed, key, k_raw, 0, key);
      be->copy_columns(st, mixed, 2 * key, v_flat, 0, value);
      be->l2norm_forward(st, q_raw.reshape(qs), 1e-6, qn, q_rstd);
      be->l2norm_forward(st, k_raw.reshape(qs), 1e-6, kn, k_rstd);
    }, 20);
    const double parts_b = median_ms(*be, [&] {
      Tensor d_mixed = be->empty(x.shape(), DType::BF16);
      Tensor dq_raw = be->empty(qs, DType::BF16), dk_raw = be->empty(qs, DType::BF16);
      be->l2norm_backward(st, qn, q_rstd, dq, dq_raw);
      be->l2norm_backward(st, kn, k_rstd, dk, dk_raw);
      be->copy_columns(st, dq_raw.reshape(Shape{t, key}), 0, d_mixed, 0, key);
      be->copy_columns(st, dk_raw.reshape(Shape{t, key}), 0, d_mixed, key, key);
      be->copy_columns(st, dv.reshape(Shape{t, value}), 0, d_mixed, 2 * key, value);
      cuda::causal_conv1d_silu_backward_rowwise(cs, x.data(), w.data(), DType::BF16, doc.data_as<int32_t>(),
                                                d_mixed.data(), d_qkv.data(), dw.data(), DType::BF16, t, channels,
                                                conv_width);
    }, 20);
    // Fused: the forward reads qkv and writes q, k, v; the backward reads qkv, q, k, dq, dk, dv and
    // writes d_qkv (the rstd rows are 1/64 of that).
    const double split_f_bytes = 2.0 * t * channels * 2, split_b_bytes = 2.0 * t * (3 * channels + 2 * key);
    std::printf("conv + split T %lld: forward %.3f ms (%.0f GB/s; separate ops %.3f ms), backward %.3f ms (%.0f GB/s; "
                "separate ops %.3f ms)\n",
                static_cast<long long>(t), split_f, split_f_bytes / split_f / 1e6, parts_f, split_b,
                split_b_bytes / split_b / 1e6, parts_b);
    const int64_t copy_rows = t * 16;  // gated attention's query/gate split: 16 heads of [query 256 | gate 256]
    Tensor fused_qg = random_bf16(*be, Shape{copy_rows, 512}, rng, -1, 1), half = be->empty(Shape{copy_rows, 256}, DType::BF16);
    const double copy_ms = median_ms(*be, [&] { be->copy_columns(st, fused_qg, 256, half, 0, 256); }, 20);
    std::printf("copy_columns %lld rows, 256 of 512 columns: %.3f ms (%.0f GB/s)\n", static_cast<long long>(copy_rows),
                copy_ms, 2.0 * copy_rows * 256 * 2 / copy_ms / 1e6);
    const Shape rows{t * hv, d};
    Tensor xn = random_bf16(*be, rows, rng, -1, 1), z = random_bf16(*be, rows, rng, -2, 2),
           nw = random_bf16(*be, Shape{d}, rng, 0.5f, 1.5f), yn = be->empty(rows, DType::BF16);
    Tensor rstd = be->empty(Shape{t * hv}, DType::F32), dxn = be->empty(rows, DType::BF16),
           dz = be->empty(rows, DType::BF16), dnw = be->zeros(Shape{d}, DType::BF16);
    const double norm_f = median_ms(*be, [&] { be->gated_rmsnorm_forward(st, xn, z, nw, 1e-6, yn, rstd); }, 20);
    const double norm_b =
        median_ms(*be, [&] { be->gated_rmsnorm_backward(st, xn, z, nw, rstd, yn, dxn, dz, &dnw); }, 20);
    const double row_bytes = 2.0 * t * hv * d;
    std::printf("gated rmsnorm rows %lld x %lld: forward %.3f ms (%.0f GB/s), backward %.3f ms (%.0f GB/s)\n",
                static_cast<long long>(t * hv), static_cast<long long>(d), norm_f, 3 * row_bytes / norm_f / 1e6,
                norm_b, 5 * row_bytes / norm_b / 1e6);
  }
  return 0;
}
