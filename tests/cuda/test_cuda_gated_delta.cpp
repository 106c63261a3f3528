// The gated-attention and gated-DeltaNet ops of the CUDA backend against the CPU reference (F64)
// on random inputs, F32 and BF16. Inputs are rounded to the GPU dtype first, so the reference sees
// what the GPU sees; outputs an op overwrites are poisoned with NaN first. The delta rule runs
// packed rows with document boundaries inside chunks, at chunk starts and documents of one token,
// with slow-decay heads (exp(g) ≈ 1: a state leaking across a boundary would show), value heads
// sharing key heads (Hv = 2·Hk), at head dims 128 (the Qwen3.5 shape) and small odd ones.
// With no CUDA device every test is skipped.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/op_test_util.h"
#include "core/error.h"

using namespace spindle;
using namespace spindle::test;

namespace {

double round_to(DType t, double v) {
  switch (t) {
    case DType::BF16: return bf16_to_f32(f32_to_bf16(static_cast<float>(v)));
    case DType::F32: return static_cast<float>(v);
    default: return v;
  }
}

// Storage rounding of BF16 outputs is 2^-9 relative; F32 results carry the kernels' F32 sums.
double tol_for(DType t) { return t == DType::F32 ? 2e-5 : 1e-2; }

class CudaGated : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device: the CUDA op tests need a GPU";
    gpu = make_cuda_backend(0);
    gs = gpu->default_stream();
  }

  // Uniform in [lo, hi], rounded to t, never zero.
  std::vector<double> rand_values(int64_t n, DType t, double lo = -1.0, double hi = 1.0) {
    std::uniform_real_distribution<double> dist(lo, hi);
    std::vector<double> v(n);
    for (double& x : v) {
      do x = round_to(t, dist(rng));
      while (x == 0.0);
    }
    return v;
  }
  Tensor on_gpu(const std::vector<double>& v, Shape shape, DType t) {
    Tensor x = gpu->empty(shape, t);
    from_host(*gpu, v, x);
    return x;
  }
  Tensor on_cpu(const std::vector<double>& v, Shape shape) {
    Tensor x = cpu->empty(shape, DType::F64);
    from_host(*cpu, v, x);
    return x;
  }
  Tensor poisoned(Shape shape, DType t) {
    Tensor x = gpu->empty(shape, t);
    gpu->fill(gs, x, std::nan(""));
    return x;
  }
  void expect(const Tensor& got, const Tensor& want, double tol, const std::string& what) {
    expect_close(to_host(*gpu, got), to_host(*cpu, want), tol, what.c_str());
  }

  std::unique_ptr<Backend> cpu = make_cpu_backend();
  std::unique_ptr<Backend> gpu;
  Stream gs, cs{};
  std::mt19937_64 rng{20261202};
};

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaGated, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// Document ids of packed rows: runs of the given lengths.
std::vector<int> packed_docs(const std::vector<int>& lengths) {
  std::vector<int> ids;
  for (size_t d = 0; d < lengths.size(); ++d) ids.insert(ids.end(), lengths[d], static_cast<int>(d));
  return ids;
}

TEST_P(CudaGated, CopyColumnsMovesExactlyOneBlock) {
  const DType t = GetParam();
  // Odd offsets and widths (element by element); then offsets, widths and rows of whole 16-, 8- and
  // 4-byte words (the word-wise kernel).
  for (const auto& [src_cols, dst_cols, src_col, dst_col, width] :
       {std::tuple{29, 41, 5, 11, 17}, std::tuple{64, 48, 16, 8, 32}, std::tuple{12, 20, 4, 8, 4},
        std::tuple{6, 10, 2, 4, 2}}) {
    const int64_t rows = 37;
    auto src = rand_values(rows * src_cols, t), dst = rand_values(rows * dst_cols, t);
    Tensor gsrc = on_gpu(src, Shape{rows, src_cols}, t), gdst = on_gpu(dst, Shape{rows, dst_cols}, t);
    gpu->copy_columns(gs, gsrc, src_col, gdst, dst_col, width);
    auto got = to_host(*gpu, gdst);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < dst_cols; ++j) {
        const double want = j >= dst_col && j < dst_col + width ? src[r * src_cols + src_col + (j - dst_col)]
                                                                : dst[r * dst_cols + j];
        ASSERT_EQ(got[r * dst_cols + j], want) << src_cols << " into " << dst_cols << ": " << r << "," << j;
      }
    EXPECT_THROW(gpu->copy_columns(gs, gsrc, src_cols - 3, gdst, 0, 10), Error);  // past the source's columns
  }
}

TEST_P(CudaGated, PartialRopeMatchesCpu) {
  const DType t = GetParam();
  for (const auto& [heads, d, rotary] : {std::tuple{3, 256, 64}, std::tuple{2, 24, 8}, std::tuple{2, 16, 16}}) {
    const int64_t tokens = 45;
    auto x = rand_values(tokens * heads * d, t);
    std::vector<int> pos(tokens);
    for (int64_t i = 0; i < tokens; ++i) pos[i] = static_cast<int>((i * 977) % 40000);
    std::vector<double> freq(rotary / 2);
    for (int64_t i = 0; i < rotary / 2; ++i) freq[i] = static_cast<float>(std::pow(1e7, -2.0 * i / rotary));
    // 1.1902381: LongRoPE's attention factor of Phi-3.5/4-mini (cos and sin scaled by it).
    for (const auto& [sign, scale] : {std::pair{1, 1.0}, std::pair{-1, 1.0}, std::pair{1, 1.1902381}, std::pair{-1, 1.1902381}}) {
      Tensor gx = on_gpu(x, Shape{tokens, heads, d}, t), cx = on_cpu(x, Shape{tokens, heads, d});
      Tensor gf = on_gpu(freq, Shape{rotary / 2}, DType::F32), cf = cpu->empty(Shape{rotary / 2}, DType::F32);
      from_host(*cpu, freq, cf);
      gpu->rope_partial(gs, gx, int_tensor(*gpu, pos), gf, rotary, scale, sign);
      cpu->rope_partial(cs, cx, int_tensor(*cpu, pos), cf, rotary, scale, sign);
      expect(gx, cx, tol_for(t), "rope_partial d " + std::to_string(d) + " scale " + std::to_string(scale));
    }
  }
}

TEST_P(CudaGated, SigmoidGateAndBackward) {
  const DType t = GetParam();
  const int64_t n = 4099;
  auto x = rand_values(n, t, -3, 3), gate = rand_values(n, t, -4, 4), dout = rand_values(n, t);
  Tensor out = poisoned(Shape{n}, t), dx = poisoned(Shape{n}, t), dg = poisoned(Shape{n}, t);
  Tensor cout = cpu->empty(Shape{n}, DType::F64), cdx = cpu->empty(Shape{n}, DType::F64),
         cdg = cpu->empty(Shape{n}, DType::F64);
  gpu->sigmoid_gate_forward(gs, on_gpu(x, Shape{n}, t), on_gpu(gate, Shape{n}, t), out);
  cpu->sigmoid_gate_forward(cs, on_cpu(x, Shape{n}), on_cpu(gate, Shape{n}), cout);
  expect(out, cout, tol_for(t), "sigmoid_gate out");
  gpu->sigmoid_gate_backward(gs, on_gpu(x, Shape{n}, t), on_gpu(gate, Shape{n}, t), on_gpu(dout, Shape{n}, t), dx, dg);
  cpu->sigmoid_gate_backward(cs, on_cpu(x, Shape{n}), on_cpu(gate, Shape{n}), on_cpu(dout, Shape{n}), cdx, cdg);
  expect(dx, cdx, tol_for(t), "sigmoid_gate dx");
  expect(dg, cdg, tol_for(t), "sigmoid_gate dgate");
}

TEST_P(CudaGated, CausalConv1dRestartsAtDocumentsForwardAndBackward) {
  const DType t = GetParam();
  const int64_t width = 4, channels = 70;
  // A long document over the 64-row blocks of the backward, one-token documents, short ones.
  const std::vector<int> ids = packed_docs({3, 1, 90, 2, 1, 50, 4});
  const int64_t tokens = static_cast<int64_t>(ids.size());
  auto x = rand_values(tokens * channels, t, -2, 2), w = rand_values(channels * width, t),
       dy = rand_values(tokens * channels, t), dw0 = rand_values(channels * width, t);
  const Shape xs{tokens, channels}, ws{channels, 1, width};
  Tensor y = poisoned(xs, t), cy = cpu->empty(xs, DType::F64);
  gpu->causal_conv1d_silu_forward(gs, on_gpu(x, xs, t), on_gpu(w, ws, t), int_tensor(*gpu, ids), y);
  cpu->causal_conv1d_silu_forward(cs, on_cpu(x, xs), on_cpu(w, ws), int_tensor(*cpu, ids), cy);
  expect(y, cy, tol_for(t), "conv1d y");
  Tensor dx = poisoned(xs, t), cdx = cpu->empty(xs, DType::F64);
  Tensor dw = on_gpu(dw0, ws, t), cdw = on_cpu(dw0, ws);  // accumulated into
  gpu->causal_conv1d_silu_backward(gs, on_gpu(x, xs, t), on_gpu(w, ws, t), int_tensor(*gpu, ids), on_gpu(dy, xs, t),
                                   dx, &dw);
  cpu->causal_conv1d_silu_backward(cs, on_cpu(x, xs), on_cpu(w, ws), int_tensor(*cpu, ids), on_cpu(dy, xs), cdx, &cdw);
  expect(dx, cdx, tol_for(t), "conv1d dx");
  expect(dw, cdw, tol_for(t), "conv1d dw");
  Tensor dx2 = poisoned(xs, t);  // frozen weight
  gpu->causal_conv1d_silu_backward(gs, on_gpu(x, xs, t), on_gpu(w, ws, t), int_tensor(*gpu, ids), on_gpu(dy, xs, t),
                                   dx2, nullptr);
  expect(dx2, cdx, tol_for(t), "conv1d dx, frozen weight");
}

// The register-window kernels (channels a multiple of 4, widths 1-4; 128 channels and 16 or 32
// tokens a thread run, 256 tokens a dw partial) and the row-wise ones (width 5), against the CPU.
// Documents cross the runs and the blocks, start at a run's first token, and last one token; a
// second backward with the same inputs must give the same bits (dw is summed in a fixed order).
TEST_P(CudaGated, CausalConv1dWindowKernelsMatchCpu) {
  const DType t = GetParam();
  struct Case {
    int64_t channels, width;
    std::vector<int> docs;
  };
  const std::vector<Case> cases = {
      {132, 4, {3, 1, 90, 2, 1, 50, 4, 16, 32, 1, 300, 13}},  // 513 tokens: 3 blocks, lanes past C idle
      {8192, 4, {40, 1, 31, 200}},                             // Qwen3.6's channels
      {64, 3, {17, 1, 1, 2, 300}},
      {36, 2, {1, 255, 2, 40}},
      {8, 1, {5, 60}},
      {64, 5, {7, 1, 120}},  // wider than the window: the row-wise kernels
  };
  for (const Case& c : cases) {
    const std::vector<int> ids = packed_docs(c.docs);
    const int64_t tokens = static_cast<int64_t>(ids.size());
    const std::string what = "C " + std::to_string(c.channels) + " K " + std::to_string(c.width) + ": ";
    auto x = rand_values(tokens * c.channels, t, -2, 2), w = rand_values(c.channels * c.width, t),
         dy = rand_values(tokens * c.channels, t), dw0 = rand_values(c.channels * c.width, t);
    const Shape xs{tokens, c.channels}, ws{c.channels, 1, c.width};
    Tensor gx = on_gpu(x, xs, t), gw = on_gpu(w, ws, t), gdy = on_gpu(dy, xs, t), gids = int_tensor(*gpu, ids);
    Tensor cx = on_cpu(x, xs), cw = on_cpu(w, ws), cids = int_tensor(*cpu, ids);
    Tensor y = poisoned(xs, t), cy = cpu->empty(xs, DType::F64);
    gpu->causal_conv1d_silu_forward(gs, gx, gw, gids, y);
    cpu->causal_conv1d_silu_forward(cs, cx, cw, cids, cy);
    expect(y, cy, tol_for(t), what + "conv1d y");
    Tensor dx = poisoned(xs, t), cdx = cpu->empty(xs, DType::F64);
    Tensor dw = on_gpu(dw0, ws, t), cdw = on_cpu(dw0, ws);  // accumulated into
    gpu->causal_conv1d_silu_backward(gs, gx, gw, gids, gdy, dx, &dw);
    cpu->causal_conv1d_silu_backward(cs, cx, cw, cids, on_cpu(dy, xs), cdx, &cdw);
    expect(dx, cdx, tol_for(t), what + "conv1d dx");
    expect(dw, cdw, tol_for(t), what + "conv1d dw");
    Tensor dx2 = poisoned(xs, t), dw2 = on_gpu(dw0, ws, t);
    gpu->causal_conv1d_silu_backward(gs, gx, gw, gids, gdy, dx2, &dw2);
    EXPECT_EQ(to_host(*gpu, dx2), to_host(*gpu, dx)) << what << "dx run to run";
    EXPECT_EQ(to_host(*gpu, dw2), to_host(*gpu, dw)) << what << "dw run to run";
    Tensor dx3 = poisoned(xs, t);  // frozen weight
    gpu->causal_conv1d_silu_backward(gs, gx, gw, gids, gdy, dx3, nullptr);
    EXPECT_EQ(to_host(*gpu, dx3), to_host(*gpu, dx)) << what << "dx, frozen weight";
  }
}

// The conv with the layer's split fused (q, k L2-normalised per head, v as is) against the CPU's
// separate ops: Qwen3.6's heads (16 key heads of 128, 32 value heads of 128), small heads the
// fused kernels take (a head fewer lanes than a warp), and head dims they do not (3, 256: the
// separate ops on the GPU).
TEST_P(CudaGated, DeltaNetConvSplitMatchesCpu) {
  const DType t = GetParam();
  struct Case {
    int64_t key_heads, key_dim, value_heads, value_dim, width;
    std::vector<int> docs;
  };
  const std::vector<Case> cases = {
      {16, 128, 32, 128, 4, {40, 1, 31, 200}},
      {2, 8, 4, 8, 4, {3, 1, 90, 2, 1, 50, 4, 16, 32, 1, 300, 13}},
      {1, 4, 2, 6, 2, {1, 20, 70}},
      {2, 3, 4, 5, 4, {9, 1, 60}},
      {1, 256, 2, 128, 4, {30, 50}},
  };
  for (const Case& c : cases) {
    const std::vector<int> ids = packed_docs(c.docs);
    const int64_t tokens = static_cast<int64_t>(ids.size()), key = c.key_heads * c.key_dim,
                  value = c.value_heads * c.value_dim, channels = 2 * key + value;
    const std::string what = "dk " + std::to_string(c.key_dim) + ": ";
    auto x = rand_values(tokens * channels, t, -2, 2), w = rand_values(channels * c.width, t),
         dq = rand_values(tokens * key, t), dk = rand_values(tokens * key, t), dv = rand_values(tokens * value, t),
         dw0 = rand_values(channels * c.width, t);
    const Shape xs{tokens, channels}, ws{channels, 1, c.width}, qs{tokens, c.key_heads, c.key_dim},
        vs{tokens, c.value_heads, c.value_dim}, rs{tokens * c.key_heads};
    Tensor gx = on_gpu(x, xs, t), gw = on_gpu(w, ws, t), gids = int_tensor(*gpu, ids);
    Tensor cx = on_cpu(x, xs), cw = on_cpu(w, ws), cids = int_tensor(*cpu, ids);
    Tensor q = poisoned(qs, t), k = poisoned(qs, t), v = poisoned(vs, t), q_rstd = poisoned(rs, DType::F32),
           k_rstd = poisoned(rs, DType::F32);
    Tensor cq = cpu->empty(qs, DType::F64), ck = cpu->empty(qs, DType::F64), cv = cpu->empty(vs, DType::F64),
           cq_rstd = cpu->empty(rs, DType::F32), ck_rstd = cpu->empty(rs, DType::F32);
    gpu->deltanet_conv_split_forward(gs, gx, gw, gids, 1e-6, q, k, v, q_rstd, k_rstd);
    cpu->deltanet_conv_split_forward(cs, cx, cw, cids, 1e-6, cq, ck, cv, cq_rstd, ck_rstd);
    expect(q, cq, tol_for(t), what + "q");
    expect(k, ck, tol_for(t), what + "k");
    expect(v, cv, tol_for(t), what + "v");
    expect(q_rstd, cq_rstd, tol_for(t), what + "q rstd");  // of the stored conv output
    expect(k_rstd, ck_rstd, tol_for(t), what + "k rstd");

    // The backward from the GPU's own q, k and rstd, as the model runs it.
    auto to_cpu = [&](const Tensor& g, DType dt) {
      Tensor c = cpu->empty(g.shape(), dt);
      from_host(*cpu, to_host(*gpu, g), c);
      return c;
    };
    Tensor gdq = on_gpu(dq, qs, t), gdk = on_gpu(dk, qs, t), gdv = on_gpu(dv, vs, t);
    Tensor d_qkv = poisoned(xs, t), dw = on_gpu(dw0, ws, t);
    Tensor cd_qkv = cpu->empty(xs, DType::F64), cdw = on_cpu(dw0, ws);
    gpu->deltanet_conv_split_backward(gs, gx, gw, gids, q, k, q_rstd, k_rstd, gdq, gdk, gdv, d_qkv, &dw);
    cpu->deltanet_conv_split_backward(cs, cx, cw, cids, to_cpu(q, DType::F64), to_cpu(k, DType::F64),
                                      to_cpu(q_rstd, DType::F32), to_cpu(k_rstd, DType::F32), on_cpu(dq, qs),
                                      on_cpu(dk, qs), on_cpu(dv, vs), cd_qkv, &cdw);
    expect(d_qkv, cd_qkv, tol_for(t), what + "d_qkv");
    expect(dw, cdw, tol_for(t), what + "dw");
    Tensor d_qkv2 = poisoned(xs, t), dw2 = on_gpu(dw0, ws, t);
    gpu->deltanet_conv_split_backward(gs, gx, gw, gids, q, k, q_rstd, k_rstd, gdq, gdk, gdv, d_qkv2, &dw2);
    EXPECT_EQ(to_host(*gpu, d_qkv2), to_host(*gpu, d_qkv)) << what << "d_qkv run to run";
    EXPECT_EQ(to_host(*gpu, dw2), to_host(*gpu, dw)) << what << "dw run to run";
    Tensor d_qkv3 = poisoned(xs, t);  // frozen weight
    gpu->deltanet_conv_split_backward(gs, gx, gw, gids, q, k, q_rstd, k_rstd, gdq, gdk, gdv, d_qkv3, nullptr);
    EXPECT_EQ(to_host(*gpu, d_qkv3), to_host(*gpu, d_qkv)) << what << "d_qkv, frozen weight";
  }
}

TEST_P(CudaGated, L2NormForwardAndBackward) {
  const DType t = GetParam();
  for (int64_t c : {128, 13}) {
    const int64_t rows = 67;
    auto x = rand_values(rows * c, t, -2, 2), dy = rand_values(rows * c, t);
    const Shape s{rows, 1, c};
    Tensor y = poisoned(s, t), rstd = poisoned(Shape{rows}, DType::F32);
    Tensor cy = cpu->empty(s, DType::F64), crstd = cpu->empty(Shape{rows}, DType::F32);
    gpu->l2norm_forward(gs, on_gpu(x, s, t), 1e-6, y, rstd);
    cpu->l2norm_forward(cs, on_cpu(x, s), 1e-6, cy, crstd);
    expect(y, cy, tol_for(t), "l2norm y");
    expect(rstd, crstd, 1e-6, "l2norm rstd");
    // The backward from the GPU's own y and rstd, as the model runs it.
    Tensor dx = poisoned(s, t), cdx = cpu->empty(s, DType::F64);
    const auto gy = to_host(*gpu, y);
    Tensor crstd_gpu = cpu->empty(Shape{rows}, DType::F32);
    from_host(*cpu, to_host(*gpu, rstd), crstd_gpu);
    gpu->l2norm_backward(gs, y, rstd, on_gpu(dy, s, t), dx);
    cpu->l2norm_backward(cs, on_cpu(gy, s), crstd_gpu, on_cpu(dy, s), cdx);
    expect(dx, cdx, tol_for(t), "l2norm dx");
  }
}

TEST_P(CudaGated, DeltaGatesForwardAndBackward) {
  const DType t = GetParam();
  const int64_t tokens = 300, heads = 6;
  auto a = rand_values(tokens * heads, t, -4, 4), b = rand_values(tokens * heads, t, -4, 4),
       a_log = rand_values(heads, t, -1, 1.5), bias = rand_values(heads, t, -1, 1),
       dg = rand_values(tokens * heads, DType::F32), dbeta = rand_values(tokens * heads, t),
       dlog0 = rand_values(heads, t), dbias0 = rand_values(heads, t);
  a[0] = round_to(t, 25.0);  // softplus' linear branch
  const Shape th{tokens, heads}, h{heads};
  Tensor g = poisoned(th, DType::F32), beta = poisoned(th, t);
  Tensor cg = cpu->empty(th, DType::F32), cbeta = cpu->empty(th, DType::F64);
  gpu->gated_delta_gates_forward(gs, on_gpu(a, th, t), on_gpu(b, th, t), on_gpu(a_log, h, t), on_gpu(bias, h, t), g,
                                 beta);
  cpu->gated_delta_gates_forward(cs, on_cpu(a, th), on_cpu(b, th), on_cpu(a_log, h), on_cpu(bias, h), cg, cbeta);
  expect(g, cg, 1e-5, "gates g");
  expect(beta, cbeta, tol_for(t), "gates beta");
  // The backward reads the GPU's own g and beta.
  const auto gg = to_host(*gpu, g), gbeta = to_host(*gpu, beta);
  Tensor cg_gpu = cpu->empty(th, DType::F32);
  from_host(*cpu, gg, cg_gpu);
  Tensor da = poisoned(th, t), db = poisoned(th, t), dlog = on_gpu(dlog0, h, t), dbias = on_gpu(dbias0, h, t);
  Tensor cda = cpu->empty(th, DType::F64), cdb = cpu->empty(th, DType::F64), cdlog = on_cpu(dlog0, h),
         cdbias = on_cpu(dbias0, h);
  Tensor cdg = cpu->empty(th, DType::F32);
  from_host(*cpu, dg, cdg);
  gpu->gated_delta_gates_backward(gs, on_gpu(a, th, t), beta, on_gpu(a_log, h, t), on_gpu(bias, h, t), g,
                                  on_gpu(dg, th, DType::F32), on_gpu(dbeta, th, t), da, db, &dlog, &dbias);
  cpu->gated_delta_gates_backward(cs, on_cpu(a, th), on_cpu(gbeta, th), on_cpu(a_log, h), on_cpu(bias, h), cg_gpu, cdg,
                                  on_cpu(dbeta, th), cda, cdb, &cdlog, &cdbias);
  expect(da, cda, tol_for(t), "gates da");
  expect(db, cdb, tol_for(t), "gates db");
  expect(dlog, cdlog, tol_for(t), "gates dA_log");
  expect(dbias, cdbias, tol_for(t), "gates ddt_bias");
}

TEST_P(CudaGated, GatedRmsNormForwardAndBackward) {
  const DType t = GetParam();
  for (int64_t c : {128, 19}) {
    const int64_t rows = 300;  // more than one 256-row block of the weight gradient
    auto x = rand_values(rows * c, t, -2, 2), z = rand_values(rows * c, t, -3, 3), w = rand_values(c, t),
         dy = rand_values(rows * c, t), dw0 = rand_values(c, t);
    const Shape s{rows, c}, ws{c};
    Tensor y = poisoned(s, t), rstd = poisoned(Shape{rows}, DType::F32);
    Tensor cy = cpu->empty(s, DType::F64), crstd = cpu->empty(Shape{rows}, DType::F32);
    gpu->gated_rmsnorm_forward(gs, on_gpu(x, s, t), on_gpu(z, s, t), on_gpu(w, ws, t), 1e-6, y, rstd);
    cpu->gated_rmsnorm_forward(cs, on_cpu(x, s), on_cpu(z, s), on_cpu(w, ws), 1e-6, cy, crstd);
    expect(y, cy, tol_for(t), "gated_rmsnorm y");
    expect(rstd, crstd, 1e-6, "gated_rmsnorm rstd");
    Tensor dx = poisoned(s, t), dz = poisoned(s, t), dw = on_gpu(dw0, ws, t);
    Tensor cdx = cpu->empty(s, DType::F64), cdz = cpu->empty(s, DType::F64), cdw = on_cpu(dw0, ws);
    gpu->gated_rmsnorm_backward(gs, on_gpu(x, s, t), on_gpu(z, s, t), on_gpu(w, ws, t), rstd, on_gpu(dy, s, t), dx, dz,
                                &dw);
    cpu->gated_rmsnorm_backward(cs, on_cpu(x, s), on_cpu(z, s), on_cpu(w, ws), crstd, on_cpu(dy, s), cdx, cdz, &cdw);
    expect(dx, cdx, tol_for(t), "gated_rmsnorm dx");
    expect(dz, cdz, tol_for(t), "gated_rmsnorm dz");
    expect(dw, cdw, tol_for(t), "gated_rmsnorm dw");
  }
}

// Gated attention's softmax attention has head dim 256 (Qwen3.5/3.6): the backend's own kernels
// take it (the tensor-core ones and cuDNN stop at 128), packed documents and the plain causal row.
TEST_P(CudaGated, AttentionHeadDim256MatchesCpu) {
  const DType t = GetParam();
  const int64_t hq = 4, hkv = 2, d = 256;
  for (bool packed : {true, false}) {
    const std::vector<int> doc = packed ? packed_docs({70, 1, 79}) : packed_docs({150});
    const int64_t tokens = static_cast<int64_t>(doc.size());
    std::vector<int> pos(tokens);
    for (int64_t i = 0; i < tokens; ++i) pos[i] = i == 0 || doc[i] != doc[i - 1] ? 0 : pos[i - 1] + 1;
    const Shape qs{tokens, hq, d}, ks{tokens, hkv, d}, ls{hq, tokens};
    auto q = rand_values(tokens * hq * d, t, -2, 2), k = rand_values(tokens * hkv * d, t, -2, 2),
         v = rand_values(tokens * hkv * d, t), dout = rand_values(tokens * hq * d, t);
    AttentionMask gm{int_tensor(*gpu, doc), int_tensor(*gpu, pos), int_tensor(*gpu, doc), int_tensor(*gpu, pos)};
    AttentionMask cm{int_tensor(*cpu, doc), int_tensor(*cpu, pos), int_tensor(*cpu, doc), int_tensor(*cpu, pos)};
    gm.plain_causal = cm.plain_causal = !packed;
    const double scale = 1.0 / std::sqrt(static_cast<double>(d));
    Tensor gq = on_gpu(q, qs, t), gk = on_gpu(k, ks, t), gv = on_gpu(v, ks, t);
    Tensor cq = on_cpu(q, qs), ck = on_cpu(k, ks), cv = on_cpu(v, ks);
    Tensor out = poisoned(qs, t), lse = poisoned(ls, DType::F32);
    Tensor cout = cpu->empty(qs, DType::F64), clse = cpu->empty(ls, DType::F64);
    gpu->attention_forward(gs, gq, gk, gv, gm, AttentionLogits{scale}, out, lse);
    cpu->attention_forward(cs, cq, ck, cv, cm, AttentionLogits{scale}, cout, clse);
    const std::string what = packed ? "packed " : "causal ";
    expect(out, cout, tol_for(t), what + "attention out");
    Tensor dq = poisoned(qs, t), dk = poisoned(ks, t), dv = poisoned(ks, t);
    Tensor cdq = cpu->empty(qs, DType::F64), cdk = cpu->empty(ks, DType::F64), cdv = cpu->empty(ks, DType::F64);
    gpu->attention_backward(gs, gq, gk, gv, out, on_gpu(dout, qs, t), lse, gm, AttentionLogits{scale}, dq, dk, dv, false);
    cpu->attention_backward(cs, cq, ck, cv, cout, on_cpu(dout, qs), clse, cm, AttentionLogits{scale}, cdq, cdk, cdv, false);
    expect(dq, cdq, tol_for(t), what + "attention dq");
    expect(dk, cdk, tol_for(t), what + "attention dk");
    expect(dv, cdv, tol_for(t), what + "attention dv");
  }
}

struct DeltaCase {
  std::vector<int> lengths;  // packed documents
  int64_t hk, dk, hv, dv, chunk;
};

class CudaDeltaRule : public CudaGated {
 protected:
  void run_case(const DeltaCase& dc, DType t, double fwd_tol, double bwd_tol) {
    const std::vector<int> ids = packed_docs(dc.lengths);
    const int64_t tokens = static_cast<int64_t>(ids.size());
    const Shape qs{tokens, dc.hk, dc.dk}, vs{tokens, dc.hv, dc.dv}, hs{tokens, dc.hv};
    // q and k unit rows like the model's L2-normalised ones (scaled by 1/√dk inside), beta in
    // [0.1, 0.9], slow decay: a leak across a boundary would be of the size of the signal.
    auto unit_rows = [&](int64_t rows, int64_t d) {
      auto x = rand_values(rows * d, DType::F64);
      for (int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (int64_t j = 0; j < d; ++j) ss += x[r * d + j] * x[r * d + j];
        for (int64_t j = 0; j < d; ++j) x[r * d + j] = round_to(t, x[r * d + j] / std::sqrt(ss));
      }
      return x;
    };
    auto q = unit_rows(tokens * dc.hk, dc.dk), k = unit_rows(tokens * dc.hk, dc.dk);
    auto v = rand_values(tokens * dc.hv * dc.dv, t), dout = rand_values(tokens * dc.hv * dc.dv, t);
    auto g = rand_values(tokens * dc.hv, DType::F32, -0.03, -0.001), beta = rand_values(tokens * dc.hv, t, 0.1, 0.9);
    const double scale = 1.0 / std::sqrt(static_cast<double>(dc.dk));
    Tensor gids = int_tensor(*gpu, ids), cids = int_tensor(*cpu, ids);
    Tensor gq = on_gpu(q, qs, t), gk = on_gpu(k, qs, t), gv = on_gpu(v, vs, t), gg = on_gpu(g, hs, DType::F32),
           gb = on_gpu(beta, hs, t);
    Tensor cq = on_cpu(q, qs), ck = on_cpu(k, qs), cv = on_cpu(v, vs), cg = on_cpu(g, hs), cb = on_cpu(beta, hs);
    const std::string name = "T " + std::to_string(tokens) + " dk " + std::to_string(dc.dk) + " chunk " +
                             std::to_string(dc.chunk) + ": ";

    Tensor out = poisoned(vs, t), cout = cpu->empty(vs, DType::F64);
    gpu->gated_delta_rule_forward(gs, gq, gk, gv, gg, gb, gids, scale, dc.chunk, out);
    cpu->gated_delta_rule_forward(cs, cq, ck, cv, cg, cb, cids, scale, dc.chunk, cout);
    expect(out, cout, fwd_tol, name + "out");

    Tensor dq = poisoned(qs, t), dk = poisoned(qs, t), dv = poisoned(vs, t), dg = poisoned(hs, DType::F32),
           dbeta = poisoned(hs, t);
    Tensor cdq = cpu->empty(qs, DType::F64), cdk = cpu->empty(qs, DType::F64), cdv = cpu->empty(vs, DType::F64),
           cdg = cpu->empty(hs, DType::F64), cdbeta = cpu->empty(hs, DType::F64);
    gpu->gated_delta_rule_backward(gs, gq, gk, gv, gg, gb, gids, scale, dc.chunk, on_gpu(dout, vs, t), dq, dk, dv, dg,
                                   dbeta);
    cpu->gated_delta_rule_backward(cs, cq, ck, cv, cg, cb, cids, scale, dc.chunk, on_cpu(dout, vs), cdq, cdk, cdv, cdg,
                                   cdbeta);
    expect(dq, cdq, bwd_tol, name + "dq");
    expect(dk, cdk, bwd_tol, name + "dk");
    expect(dv, cdv, bwd_tol, name + "dv");
    expect(dg, cdg, bwd_tol, name + "dg");
    expect(dbeta, cdbeta, bwd_tol, name + "dbeta");
  }
};

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaDeltaRule, ::testing::Values(DType::F32, DType::BF16),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

// F32: the F32 sums of a recurrence over a few hundred tokens; BF16: the outputs' storage rounding.
double delta_tol(DType t) { return t == DType::F32 ? 1e-4 : 1e-2; }

TEST_P(CudaDeltaRule, SmallHeadsPackedDocumentsMatchCpu) {
  const DType t = GetParam();
  // Boundaries mid-chunk (40, 104), at a chunk start (128), one-token documents, a partial last chunk.
  run_case({{40, 64, 24, 1, 1, 70, 37}, 2, 16, 4, 24, 64}, t, delta_tol(t), delta_tol(t));
  run_case({{40, 64, 24, 1, 1, 70, 37}, 2, 16, 4, 24, 16}, t, delta_tol(t), delta_tol(t));
  run_case({{5}, 1, 8, 1, 8, 64}, t, delta_tol(t), delta_tol(t));  // one chunk, shorter than C
}

// BF16 takes the tensor-core kernels when head dims and chunk are multiples of 8 (every case above);
// other shapes keep the F32-FMA kernels, in BF16 too.
TEST_P(CudaDeltaRule, HeadDimsAndChunksTheTensorCoresDoNotTakeMatchCpu) {
  const DType t = GetParam();
  run_case({{40, 64, 24, 1, 1, 70, 37}, 2, 12, 4, 20, 64}, t, delta_tol(t), delta_tol(t));
  run_case({{40, 64, 24, 1, 1, 70, 37}, 2, 16, 4, 24, 12}, t, delta_tol(t), delta_tol(t));
}

TEST_P(CudaDeltaRule, HeadDim128PackedDocumentsMatchCpu) {
  const DType t = GetParam();
  run_case({{150, 64, 1, 33, 100}, 2, 128, 4, 128, 64}, t, delta_tol(t), delta_tol(t));
}

TEST_P(CudaDeltaRule, OneLongDocumentMatchesCpu) {
  const DType t = GetParam();
  run_case({{700}, 1, 64, 2, 128, 64}, t, delta_tol(t), delta_tol(t));
}

TEST_P(CudaDeltaRule, RefusesHeadDimsAboveTheKernelsLimit) {
  const DType t = GetParam();
  const int64_t tokens = 4;
  Tensor q = gpu->zeros(Shape{tokens, 1, 256}, t), v = gpu->zeros(Shape{tokens, 1, 128}, t);
  Tensor g = gpu->zeros(Shape{tokens, 1}, DType::F32), beta = gpu->zeros(Shape{tokens, 1}, t);
  Tensor out = gpu->empty(v.shape(), t);
  EXPECT_THROW(gpu->gated_delta_rule_forward(gs, q, q, v, g, beta, int_tensor(*gpu, {0, 0, 0, 0}), 1.0, 64, out),
               Error);
}

}  // namespace
