// What the decoder tests that compare whole training steps share: a packed row of two documents,
// an attention strategy that counts its calls, and the bit-for-bit comparison of two runs' losses
// and gradients (recompute modes, offload, MLP tiles and sparse checkpoints must all give the
// same numbers as keeping everything).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/attention_strategy.h"
#include "model/batch.h"

namespace spindle::test {

// `length` tokens drawn from [0, vocab): a first document of length / 3 tokens, a second one, and a
// two-token padding tail; the first two tokens of each document are unsupervised.
PackedRow two_document_row(int64_t length, int64_t vocab, uint64_t seed);

// The local attention, counting its forward and backward calls.
class CountingAttention final : public AttentionStrategy {
 public:
  void forward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
               const Tensor& v, const AttentionCall& call, Tensor& out, Tensor& lse) override;
  void backward(Backend& backend, Stream stream, const MicroBatch& batch, const Tensor& q, const Tensor& k,
                const Tensor& v, const Tensor& out, const Tensor& dout, const Tensor& lse, const AttentionCall& call, Tensor& dq,
                Tensor& dk, Tensor& dv) override;
  int forwards = 0, backwards = 0;

 private:
  LocalAttention inner_;
};

// The loss after each micro-batch of a run and every trainable parameter's gradient at its end.
struct StepOutcome {
  std::vector<double> loss;
  std::vector<std::vector<double>> grads;
};
// Fails the test unless both are equal bit for bit (each mismatch named with `what`).
void expect_bit_identical(const StepOutcome& got, const StepOutcome& want, const std::string& what);
// Σ|g| over every gradient: a comparison of zero gradients would prove nothing.
double gradient_mass(const StepOutcome& outcome);

}  // namespace spindle::test
