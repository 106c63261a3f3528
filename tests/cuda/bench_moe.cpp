// Where a mixture-of-experts layer's time goes on the GPU, op by op (docs/perf.md): router GEMM,
// softmax/top-k, permutation, gather, the grouped expert GEMMs (TFLOP/s), SwiGLU, the weighted
// combine, and the backward's ops; against its bytes, and against one cuBLAS GEMM of the same
// total size and the per-expert path (offsets read on the host, one cuBLAS GEMM per expert); the
// shared expert's gate of qwen3_5_moe against its bytes; the grouped GEMM kernels side by side.
// SPINDLE_MOE_GEMM (auto, mma, wgmma) picks the kernel of the layer's rows.
// Median of many runs, timed with CUDA events. Not a test: run it by hand.
//
//   bench_moe [tokens [hidden experts top_k width]]   (default: Qwen3-30B-A3B and Qwen3.6-35B-A3B sizes)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/moe.h"
#include "core/error.h"

using namespace spindle;

namespace {

struct Sizes {
  const char* name;
  int64_t tokens, hidden, experts, top_k, width;
};

// Median milliseconds of `reps` runs of f on the backend's stream.
double median_ms(Backend& be, const std::function<void()>& f, int reps = 25) {
  cudaStream_t s = static_cast<cudaStream_t>(be.default_stream().handle);
  f();  // warm-up (plans, first-touch of the pool)
  be.synchronize(be.default_stream());
  std::vector<double> ms;
  cudaEvent_t a, b;
  cudaEventCreate(&a);
  cudaEventCreate(&b);
  for (int i = 0; i < reps; ++i) {
    cudaEventRecord(a, s);
    f();
    cudaEventRecord(b, s);
    cudaEventSynchronize(b);
    float t = 0;
    cudaEventElapsedTime(&t, a, b);
    ms.push_back(t);
  }
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  be.synchronize(be.default_stream());
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

Tensor random_bf16(Backend& be, Shape shape, std::mt19937_64& rng, double scale) {
  std::vector<float> v(static_cast<size_t>(shape.numel()));
  std::normal_distribution<float> d(0.0f, static_cast<float>(scale));
  for (float& x : v) x = d(rng);
  Tensor f = be.empty(shape, DType::F32), t = be.empty(shape, DType::BF16);
  be.copy_from_host(be.default_stream(), v.data(), f);
  be.copy(be.default_stream(), f, t);
  return t;
}

void row(const char* op, double ms, double flops, double bytes) {
  std::printf("  %-44s %9.3f ms", op, ms);
  if (flops > 0) std::printf("  %7.1f TFLOP/s", flops / ms / 1e9);
  else std::printf("  %15s", "");
  if (bytes > 0) std::printf("  %7.0f GB/s (%.0f MB)", bytes / ms / 1e6, bytes / 1e6);
  std::printf("\n");
}

void bench(Backend& be, const Sizes& z) {
  const Stream st = be.default_stream();
  const int64_t T = z.tokens, H = z.hidden, E = z.experts, k = z.top_k, I = z.width, N = T * k;
  std::printf("%s: T %lld, H %lld, E %lld, k %lld, I %lld (N = T·k = %lld routed rows)\n", z.name, (long long)T,
              (long long)H, (long long)E, (long long)k, (long long)I, (long long)N);
  std::mt19937_64 rng(7);
  Tensor xn = random_bf16(be, Shape{T, H}, rng, 1.0);
  Tensor router_w = random_bf16(be, Shape{E, H}, rng, 0.02);
  std::vector<Tensor> gate, up, down;
  for (int64_t e = 0; e < E; ++e) {
    gate.push_back(random_bf16(be, Shape{I, H}, rng, 0.02));
    up.push_back(random_bf16(be, Shape{I, H}, rng, 0.02));
    down.push_back(random_bf16(be, Shape{H, I}, rng, 0.02));
  }
  Tensor logits = be.empty(Shape{T, E}, DType::BF16), probs = be.empty(Shape{T, E}, DType::F32);
  Tensor topk_index = be.empty(Shape{T, k}, DType::I32), topk_weight = be.empty(Shape{T, k}, DType::F32);
  Tensor rows_token = be.empty(Shape{N}, DType::I32), row_of_slot = be.empty(Shape{N}, DType::I32);
  Tensor offsets = be.empty(Shape{E + 1}, DType::I32);
  Tensor x = be.empty(Shape{N, H}, DType::BF16), g = be.empty(Shape{N, I}, DType::BF16),
         u = be.empty(Shape{N, I}, DType::BF16), act = be.empty(Shape{N, I}, DType::BF16),
         y = be.empty(Shape{N, H}, DType::BF16), out = be.empty(Shape{T, H}, DType::BF16);
  const double b2 = 2.0;  // bytes per bf16

  double fwd = 0, bwd = 0;
  auto add = [&](double& total, const char* op, double ms, double flops, double bytes) {
    total += ms;
    row(op, ms, flops, bytes);
  };
  std::printf(" forward\n");
  add(fwd, "router GEMM [T,H]x[E,H]^T (cuBLAS)",
      median_ms(be, [&] { be.gemm(st, xn, false, router_w, true, logits, 1.0, 0.0); }), 2.0 * T * E * H,
      b2 * (T * H + E * H + T * E));
  add(fwd, "moe_router_forward (softmax, top-k)",
      median_ms(be, [&] { be.moe_router_forward(st, logits, k, true, probs, topk_index, topk_weight); }), 0,
      b2 * T * E + 4.0 * T * E + 8.0 * T * k);
  add(fwd, "moe_permute (stable radix sort)",
      median_ms(be, [&] { be.moe_permute(st, topk_index, E, rows_token, row_of_slot, offsets); }), 0,
      4.0 * N * 4);
  add(fwd, "gather_rows [N,H]", median_ms(be, [&] { be.gather_rows(st, xn, rows_token, x); }), 0, 2 * b2 * N * H);
  const double gemm_gu = 2.0 * N * I * H;
  const double w_bytes = b2 * E * I * H;
  add(fwd, "grouped GEMM gate x·W_gᵀ",
      median_ms(be, [&] { be.moe_grouped_gemm(st, x, gate, true, offsets, g, false); }), gemm_gu,
      b2 * (N * H + N * I) + w_bytes);
  add(fwd, "grouped GEMM up x·W_uᵀ", median_ms(be, [&] { be.moe_grouped_gemm(st, x, up, true, offsets, u, false); }),
      gemm_gu, b2 * (N * H + N * I) + w_bytes);
  add(fwd, "swiglu_forward", median_ms(be, [&] { be.swiglu_forward(st, g, u, act); }), 0, 3 * b2 * N * I);
  add(fwd, "grouped GEMM down act·W_dᵀ",
      median_ms(be, [&] { be.moe_grouped_gemm(st, act, down, true, offsets, y, false); }), gemm_gu,
      b2 * (N * I + N * H) + w_bytes);
  add(fwd, "moe_combine (weighted sum)",
      median_ms(be, [&] { be.moe_combine(st, y, row_of_slot, topk_index, topk_weight, out); }), 0,
      b2 * (N * H + T * H));
  std::printf("  %-44s %9.3f ms\n", "forward total", fwd);

  std::printf(" backward (frozen experts: input gradients only)\n");
  Tensor dout = random_bf16(be, Shape{T, H}, rng, 1.0);
  Tensor dy = be.empty(Shape{N, H}, DType::BF16), d_w = be.empty(Shape{T, k}, DType::F32);
  Tensor d_act = be.empty(Shape{N, I}, DType::BF16), dg = be.empty(Shape{N, I}, DType::BF16),
         du = be.empty(Shape{N, I}, DType::BF16), dx = be.empty(Shape{N, H}, DType::BF16);
  Tensor dxn = be.zeros(Shape{T, H}, DType::BF16), dlogits = be.empty(Shape{T, E}, DType::BF16);
  add(bwd, "grouped GEMM down again (recompute y)",
      median_ms(be, [&] { be.moe_grouped_gemm(st, act, down, true, offsets, y, false); }), gemm_gu,
      b2 * (N * I + N * H) + w_bytes);
  add(bwd, "moe_combine_backward",
      median_ms(be, [&] { be.moe_combine_backward(st, dout, y, row_of_slot, topk_weight, dy, d_w); }), 0,
      b2 * (T * H + 2 * N * H));
  add(bwd, "grouped GEMM d_act = dy·W_d",
      median_ms(be, [&] { be.moe_grouped_gemm(st, dy, down, false, offsets, d_act, false); }), gemm_gu,
      b2 * (N * H + N * I) + w_bytes);
  add(bwd, "swiglu_backward", median_ms(be, [&] { be.swiglu_backward(st, g, u, d_act, dg, du); }), 0,
      5 * b2 * N * I);
  add(bwd, "grouped GEMM dx = d_gate·W_g",
      median_ms(be, [&] { be.moe_grouped_gemm(st, dg, gate, false, offsets, dx, false); }), gemm_gu,
      b2 * (N * I + N * H) + w_bytes);
  add(bwd, "grouped GEMM dx += d_up·W_u",
      median_ms(be, [&] { be.moe_grouped_gemm(st, du, up, false, offsets, dx, true); }), gemm_gu,
      b2 * (N * I + 2 * N * H) + w_bytes);
  add(bwd, "scatter_add_rows dx -> dxn", median_ms(be, [&] { be.scatter_add_rows(st, dx, rows_token, dxn); }), 0,
      b2 * (N * H + 2 * T * H));
  add(bwd, "moe_router_backward",
      median_ms(be, [&] { be.moe_router_backward(st, probs, topk_index, d_w, true, Tensor(), Tensor(), dlogits); }),
      0, 4.0 * T * E + b2 * T * E);
  std::printf("  %-44s %9.3f ms  (+ router GEMMs dx, dW: as any projection)\n", "backward total", bwd);

  std::printf(" full fine-tuning adds the expert weight gradients\n");
  {
    std::vector<Tensor> grads;
    for (int64_t e = 0; e < E; ++e) grads.push_back(be.zeros(Shape{I, H}, DType::F32));
    row("grouped dW_g += d_gateᵀ·x (F32 dW)",
        median_ms(be, [&] { be.moe_grouped_gemm_weight_grad(st, dg, x, offsets, grads); }, 10), gemm_gu, 0);
    std::vector<Tensor> dgrads;
    for (int64_t e = 0; e < E; ++e) dgrads.push_back(be.zeros(Shape{H, I}, DType::F32));
    row("grouped dW_d += dyᵀ·act (F32 dW)",
        median_ms(be, [&] { be.moe_grouped_gemm_weight_grad(st, dy, act, offsets, dgrads); }, 10), gemm_gu, 0);
  }

  // The grouped GEMM kernels side by side (whichever SPINDLE_MOE_GEMM picked above) on the four
  // shapes of the layer: mma.sync, and the Hopper kernel with 128- and 256-wide tiles, its tile
  // staged in shared memory ("smem"; F32 with the old values added when accumulating) or stored
  // from registers ("regs") (launched directly; skipped off Hopper).
  std::printf(" grouped GEMM kernels\n");
  {
    cuda::ExpertPointers gate_table{}, down_table{};
    for (int64_t e = 0; e < E; ++e) {
      gate_table.p[e] = gate[static_cast<size_t>(e)].data();
      down_table.p[e] = down[static_cast<size_t>(e)].data();
    }
    cudaStream_t cs = static_cast<cudaStream_t>(st.handle);
    const int32_t* off = offsets.data_as<int32_t>();
    int major = 0, device = 0;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    struct Shape4 {
      const char* name;
      const Tensor* in;
      const std::vector<Tensor>* w;
      const cuda::ExpertPointers* table;
      bool transpose;
      Tensor* out;
      bool accumulate;
    };
    const Shape4 shapes[] = {{"gate x·W_gᵀ (n I, k H)", &x, &gate, &gate_table, true, &g, false},
                             {"down act·W_dᵀ (n H, k I)", &act, &down, &down_table, true, &y, false},
                             {"d_act = dy·W_d (n I, k H)", &dy, &down, &down_table, false, &d_act, false},
                             {"dx += d_gate·W_g (n H, k I, accumulating)", &dg, &gate, &gate_table, false, &dx, true}};
    const char* saved = std::getenv("SPINDLE_MOE_GEMM");
    const std::string restore = saved ? saved : "";
    for (const Shape4& z4 : shapes) {
      ::setenv("SPINDLE_MOE_GEMM", "mma", 1);
      row((std::string("mma.sync  ") + z4.name).c_str(), median_ms(be, [&] {
            be.moe_grouped_gemm(st, *z4.in, *z4.w, z4.transpose, offsets, *z4.out, z4.accumulate);
          }),
          gemm_gu, 0);
      for (int tile_n : {128, 256})
        for (bool staged : {true, false}) {
          if (major != 9) continue;
          const std::string label = std::string("wgmma ") + std::to_string(tile_n) + (staged ? " smem " : " regs ") +
                                    z4.name;
          row(label.c_str(), median_ms(be, [&] {
                cuda::moe_grouped_gemm_wgmma(cs, z4.in->data(), N, z4.in->dim(1), *z4.table, static_cast<int>(E),
                                             z4.transpose, off, z4.out->data(), z4.out->dim(1), z4.accumulate, tile_n,
                                             staged, /*staged_accumulate=*/staged);
              }),
              gemm_gu, 0);
        }
    }
    if (restore.empty()) ::unsetenv("SPINDLE_MOE_GEMM");
    else ::setenv("SPINDLE_MOE_GEMM", restore.c_str(), 1);
    // Where the Hopper kernel's time goes, on the gate's shape: every row in expert 0 (one dense
    // GEMM: no ragged tiles, one expert's weights; against cuBLAS below), and the real routing with
    // every expert reading expert 0's weights (no weight traffic beyond the L2).
    if (major == 9) {
      std::vector<int32_t> one(static_cast<size_t>(E + 1), static_cast<int32_t>(N));
      one[0] = 0;
      Tensor one_offsets = be.empty(Shape{E + 1}, DType::I32);
      be.copy_from_host(st, one.data(), one_offsets);
      cuda::ExpertPointers same{};
      for (int64_t e = 0; e < E; ++e) same.p[e] = gate[0].data();
      row("wgmma 256 gate, all rows in one expert", median_ms(be, [&] {
            cuda::moe_grouped_gemm_wgmma(cs, x.data(), N, H, gate_table, static_cast<int>(E), true,
                                         one_offsets.data_as<int32_t>(), g.data(), I, false, 256, true);
          }),
          gemm_gu, 0);
      row("wgmma 256 gate, every expert W_g of expert 0", median_ms(be, [&] {
            cuda::moe_grouped_gemm_wgmma(cs, x.data(), N, H, same, static_cast<int>(E), true, off, g.data(), I, false,
                                         256, true);
          }),
          gemm_gu, 0);
    }
  }

  std::printf(" references\n");
  {
    Tensor w_all = random_bf16(be, Shape{I, H}, rng, 0.02);
    row("one cuBLAS GEMM [N,H]x[I,H]^T (same FLOPs)",
        median_ms(be, [&] { be.gemm(st, x, false, w_all, true, g, 1.0, 0.0); }), gemm_gu, 0);
    // The per-expert path the model takes with LoRA or quantised experts: offsets to the host, then
    // one GEMM per expert (as model/blocks/moe.cpp's Linear loop).
    row("per-expert cuBLAS gate (host offsets + E GEMMs)", median_ms(be, [&] {
          std::vector<int32_t> off(static_cast<size_t>(E + 1));
          be.copy_to_host(st, offsets, off.data());
          for (int64_t e = 0; e < E; ++e) {
            if (off[e] == off[e + 1]) continue;
            Tensor ge = g.rows(off[e], off[e + 1]);
            be.gemm(st, x.rows(off[e], off[e + 1]), false, gate[e], true, ge, 1.0, 0.0);
          }
        }),
        gemm_gu, 0);
  }
  // Qwen3.5-MoE / Qwen3.6's shared expert behind its sigmoid gate: pure traffic, against the bandwidth.
  std::printf(" shared expert gate (qwen3_5_moe)\n");
  {
    Tensor shared = random_bf16(be, Shape{T, H}, rng, 1.0), logit = random_bf16(be, Shape{T, 1}, rng, 1.0);
    Tensor d_shared = be.empty(Shape{T, H}, DType::BF16), d_logit = be.empty(Shape{T, 1}, DType::BF16);
    row("shared_expert_gate_forward out += σ(g)·shared",
        median_ms(be, [&] { be.shared_expert_gate_forward(st, shared, logit, out); }), 0, b2 * (3 * T * H + T));
    row("shared_expert_gate_backward", median_ms(be, [&] {
          be.shared_expert_gate_backward(st, shared, logit, out, d_shared, d_logit);
        }),
        0, b2 * (3 * T * H + 2 * T));
  }
  std::printf("\n");
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (cuda_device_count() == 0) {
      std::fprintf(stderr, "bench_moe: no CUDA device\n");
      return 1;
    }
    auto be = make_cuda_backend(0);
    const char* kernel = std::getenv("SPINDLE_MOE_GEMM");
    std::printf("grouped GEMMs: SPINDLE_MOE_GEMM=%s (%s)\n\n", kernel ? kernel : "",
                cuda::moe_gemm_kernel_choice() == cuda::MoeGemmKernel::Mma     ? "mma.sync"
                : cuda::moe_gemm_kernel_choice() == cuda::MoeGemmKernel::Wgmma ? "wgmma where it applies"
                                                                               : "wgmma where it applies, mma.sync for dW");
    std::vector<Sizes> runs{{"Qwen3-30B-A3B MoE layer", 16384, 2048, 128, 8, 768},
                            {"Qwen3.6-35B-A3B MoE layer (routed experts)", 16384, 2048, 256, 8, 512}};
    if (argc >= 2) {
      const int64_t t = std::atoll(argv[1]);
      for (Sizes& s : runs) s.tokens = t;
      if (argc >= 6)
        runs = {{"custom", t, std::atoll(argv[2]), std::atoll(argv[3]), std::atoll(argv[4]), std::atoll(argv[5])}};
    }
    for (const Sizes& s : runs) bench(*be, s);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_moe: %s\n", e.what());
    return 1;
  }
}
