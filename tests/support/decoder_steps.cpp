#include "support/decoder_steps.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/op_test_util.h"

namespace spindle::test {

PackedRow two_document_row(int64_t length, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  PackedRow r;
  const int64_t first = length / 3;
  for (int64_t i = 0; i < length; ++i) {
    const bool padding = i + 2 >= length;
    const int64_t doc = padding ? -1 : (i < first ? 0 : 1), pos = i < first ? i : i - first;
    r.input_ids.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
    r.positions.push_back(static_cast<int32_t>(pos));
    r.doc_ids.push_back(static_cast<int32_t>(doc));
  }
  for (int64_t i = 0; i < length; ++i) {
    const bool supervised = r.doc_ids[i] >= 0 && r.positions[i] >= 2 && i + 1 < length && r.doc_ids[i + 1] == r.doc_ids[i];
    r.targets.push_back(supervised ? r.input_ids[i + 1] : kIgnoreIndex);
    r.weights.push_back(supervised ? 1.0f : 0.0f);
  }
  return r;
}

void CountingAttention::forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q,
                                const Tensor& k, const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) {
  ++forwards;
  inner_.forward(backend, stream, batch, q, k, v, call, out, lse);
}

void CountingAttention::backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q,
                                 const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& dout,
                                 const Tensor& lse, const AttentionCall& call, Tensor& dq, Tensor& dk, Tensor& dv) {
  ++backwards;
  inner_.backward(backend, stream, batch, q, k, v, out, dout, lse, call, dq, dk, dv);
}

void expect_bit_identical(const StepOutcome& got, const StepOutcome& want, const std::string& what) {
  ASSERT_EQ(got.loss.size(), want.loss.size()) << what;
  for (size_t i = 0; i < want.loss.size(); ++i) EXPECT_EQ(got.loss[i], want.loss[i]) << what << ", micro-batch " << i;
  ASSERT_EQ(got.grads.size(), want.grads.size()) << what;
  for (size_t i = 0; i < want.grads.size(); ++i)
    EXPECT_TRUE(got.grads[i] == want.grads[i]) << what << ": gradient " << i << " differs (relative error "
                                               << relative_error(got.grads[i], want.grads[i]) << ")";
}

double gradient_mass(const StepOutcome& outcome) {
  double sum = 0;
  for (const auto& g : outcome.grads)
    for (double x : g) sum += std::fabs(x);
  return sum;
}

}  // namespace spindle::test
