// make_micro_batch's host-side mask facts (MicroBatch::one_causal_document), which let a backend
// take its plain-causal attention path without reading the mask on the device.
#include <gtest/gtest.h>

#include "backend/backend.h"
#include "model/batch.h"

using namespace spindle;

namespace {

PackedRow make_row(std::vector<int32_t> docs, std::vector<int32_t> positions) {
  PackedRow r;
  const size_t n = docs.size();
  r.input_ids.assign(n, 1);
  r.doc_ids = std::move(docs);
  r.positions = std::move(positions);
  r.targets.assign(n, kIgnoreIndex);
  r.weights.assign(n, 0.0f);
  return r;
}

}  // namespace

TEST(MicroBatchFacts, OneCausalDocumentOnlyForOneDocumentAtPositionsFromZero) {
  EXPECT_TRUE(is_one_causal_document(make_row({3, 3, 3, 3}, {0, 1, 2, 3})));
  EXPECT_FALSE(is_one_causal_document(make_row({}, {})));
  EXPECT_FALSE(is_one_causal_document(make_row({0, 0, 1, 1}, {0, 1, 0, 1})));   // two documents
  EXPECT_FALSE(is_one_causal_document(make_row({0, 0, 0, -1}, {0, 1, 2, 0})));  // padding tail
  EXPECT_FALSE(is_one_causal_document(make_row({0, 0, 0}, {4, 5, 6})));         // a later shard
  EXPECT_FALSE(is_one_causal_document(make_row({-1, -1}, {0, 1})));             // padding only
}

TEST(MicroBatchFacts, MakeMicroBatchSetsThemForOneRowOnly) {
  auto be = make_cpu_backend();
  const PackedRow one = make_row({0, 0, 0}, {0, 1, 2});
  const MicroBatch single = make_micro_batch(*be, {one}, DType::F32);
  EXPECT_TRUE(single.one_causal_document);
  EXPECT_TRUE(single.row_one_causal_document);
  // Two such rows laid end to end are two documents.
  const MicroBatch two = make_micro_batch(*be, {one, one}, DType::F32);
  EXPECT_FALSE(two.one_causal_document);
  EXPECT_FALSE(two.row_one_causal_document);
  const MicroBatch packed = make_micro_batch(*be, {make_row({0, 0, 1}, {0, 1, 0})}, DType::F32);
  EXPECT_FALSE(packed.one_causal_document);
}
