// The CPU backend's grouped expert GEMMs: each expert's rows give exactly (bit for bit) what one
// gemm on that row block gives, the way a per-expert Linear computes them; empty experts and frozen
// experts are skipped; bad offsets and weights are refused with a message.
#include <gtest/gtest.h>

#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/op_test_util.h"
#include "core/error.h"

using namespace spindle;
using namespace spindle::test;

namespace {

class MoeGroupedGemm : public ::testing::TestWithParam<DType> {
 protected:
  std::unique_ptr<Backend> be = make_cpu_backend(2);
  Stream st = be->default_stream();
  std::mt19937_64 rng{20261202};
  // 5 experts: 3 rows, none, 1 row, 6 rows, none.
  std::vector<int> offsets{0, 3, 3, 4, 10, 10};
  int64_t experts() const { return static_cast<int64_t>(offsets.size()) - 1; }
  int64_t rows() const { return offsets.back(); }
};

INSTANTIATE_TEST_SUITE_P(Dtypes, MoeGroupedGemm, ::testing::Values(DType::F32, DType::F64),
                         [](const auto& info) { return std::string(dtype_name(info.param)); });

TEST_P(MoeGroupedGemm, EachExpertIsOneGemmOnItsRows) {
  const DType t = GetParam();
  const int64_t in = 7, out = 5;
  Tensor off = int_tensor(*be, offsets);
  std::vector<Tensor> w;
  for (int64_t e = 0; e < experts(); ++e) w.push_back(random_tensor(*be, Shape{out, in}, t, rng));
  Tensor x = random_tensor(*be, Shape{rows(), in}, t, rng), dy = random_tensor(*be, Shape{rows(), out}, t, rng);

  Tensor y = be->empty(Shape{rows(), out}, t);
  be->moe_grouped_gemm(st, x, w, true, off, y, false);
  Tensor dx = random_tensor(*be, Shape{rows(), in}, t, rng), dx_want = be->empty(Shape{rows(), in}, t);
  be->copy(st, dx, dx_want);
  be->moe_grouped_gemm(st, dy, w, false, off, dx, true);
  std::vector<Tensor> grads, grads_want;
  for (int64_t e = 0; e < experts(); ++e) {
    grads.push_back(e == 3 ? Tensor() : be->zeros(Shape{out, in}, t));  // expert 3 frozen
    grads_want.push_back(be->zeros(Shape{out, in}, t));
  }
  be->moe_grouped_gemm_weight_grad(st, dy, x, off, grads);

  Tensor y_want = be->empty(Shape{rows(), out}, t);
  for (int64_t e = 0; e < experts(); ++e) {
    if (offsets[e] == offsets[e + 1]) continue;
    Tensor ye = y_want.rows(offsets[e], offsets[e + 1]), dxe = dx_want.rows(offsets[e], offsets[e + 1]);
    be->gemm(st, x.rows(offsets[e], offsets[e + 1]), false, w[e], true, ye, 1.0, 0.0);
    be->gemm(st, dy.rows(offsets[e], offsets[e + 1]), false, w[e], false, dxe, 1.0, 1.0);
    be->gemm(st, dy.rows(offsets[e], offsets[e + 1]), true, x.rows(offsets[e], offsets[e + 1]), false, grads_want[e],
             1.0, 1.0);
  }
  EXPECT_EQ(to_host(*be, y), to_host(*be, y_want));
  EXPECT_EQ(to_host(*be, dx), to_host(*be, dx_want));
  for (int64_t e = 0; e < experts(); ++e) {
    if (e == 3) continue;
    EXPECT_EQ(to_host(*be, grads[e]), to_host(*be, grads_want[e])) << "expert " << e;
    if (offsets[e] == offsets[e + 1])
      for (double v : to_host(*be, grads[e])) ASSERT_EQ(v, 0.0) << "empty expert " << e << " got a gradient";
  }
}

TEST_F(MoeGroupedGemm, RefusesOffsetsAndWeightsThatDoNotFit) {
  Tensor x = be->zeros(Shape{rows(), 4}, DType::F32), y = be->zeros(Shape{rows(), 3}, DType::F32);
  std::vector<Tensor> w(static_cast<size_t>(experts()), be->zeros(Shape{3, 4}, DType::F32));
  auto message = [&](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  // One expert too few for the offsets.
  std::vector<Tensor> fewer(w.begin(), w.end() - 1);
  EXPECT_NE(message([&] { be->moe_grouped_gemm(st, x, fewer, true, int_tensor(*be, offsets), y, false); }).find("offsets"),
            std::string::npos);
  // Offsets that do not end at the row count, and that decrease.
  EXPECT_NE(message([&] { be->moe_grouped_gemm(st, x, w, true, int_tensor(*be, {0, 3, 3, 4, 10, 9}), y, false); })
                .find("offsets run from 0 to 9"),
            std::string::npos);
  EXPECT_NE(message([&] { be->moe_grouped_gemm(st, x, w, true, int_tensor(*be, {0, 3, 2, 4, 10, 10}), y, false); })
                .find("decrease at expert 1"),
            std::string::npos);
  // A weight of the wrong shape fails in the expert's gemm.
  w[2] = be->zeros(Shape{4, 3}, DType::F32);
  EXPECT_NE(message([&] { be->moe_grouped_gemm(st, x, w, true, int_tensor(*be, offsets), y, false); }).find("gemm"),
            std::string::npos);
}

}  // namespace
