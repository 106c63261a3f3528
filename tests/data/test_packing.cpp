#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <tuple>

#include "core/error.h"
#include "data/packing.h"
#include "data_test_util.h"

using namespace spindle;

namespace {

constexpr int32_t X = kIgnoreIndex;

Document doc(std::vector<int32_t> ids, std::vector<int32_t> labels = {},
             std::vector<float> scale = {}) {
  Document d;
  d.input_ids = std::move(ids);
  d.labels = labels.empty() ? d.input_ids : std::move(labels);
  d.loss_scale = std::move(scale);
  return d;
}

PackOptions options(int64_t max_length, int64_t multiple = 1) {
  PackOptions o;
  o.max_length = max_length;
  o.pad_to_multiple = multiple;
  return o;
}

// Checks the invariants every row must hold whatever the input.
void expect_well_formed(const PackedRow& row, const PackOptions& o) {
  const auto n = row.length();
  ASSERT_EQ(row.positions.size(), size_t(n));
  ASSERT_EQ(row.doc_ids.size(), size_t(n));
  ASSERT_EQ(row.targets.size(), size_t(n));
  ASSERT_EQ(row.weights.size(), size_t(n));
  EXPECT_LE(n, o.max_length);
  EXPECT_EQ(n % o.pad_to_multiple, 0);
  for (int64_t i = 0; i < n; ++i) {
    if (row.doc_ids[i] == -1) {
      EXPECT_EQ(row.input_ids[i], o.pad_token_id);
      EXPECT_EQ(row.targets[i], X);
      EXPECT_EQ(row.weights[i], 0.0f);
      continue;
    }
    const bool starts = i == 0 || row.doc_ids[i - 1] != row.doc_ids[i];
    if (starts) {
      EXPECT_EQ(row.positions[i], 0) << i;
      EXPECT_EQ(row.doc_ids[i], i == 0 ? 0 : row.doc_ids[i - 1] + 1) << i;
    } else {
      EXPECT_EQ(row.positions[i], row.positions[i - 1] + 1) << i;
    }
    const bool ends = i + 1 == n || row.doc_ids[i + 1] != row.doc_ids[i];
    if (ends) {
      EXPECT_EQ(row.targets[i], X) << "last token of a document predicts nothing, at " << i;
    }
    if (row.targets[i] == X) {
      EXPECT_EQ(row.weights[i], 0.0f) << i;
    }
    if (i > 0 && row.doc_ids[i - 1] == -1) ADD_FAILURE() << "padding inside a row at " << i;
  }
}

}  // namespace

TEST(Packing, SingleDocumentShiftsLabelsWithinTheDocument) {
  auto rows = pack_documents({doc({10, 11, 12, 13}, {X, X, 12, 13})}, options(8));
  ASSERT_EQ(rows.size(), 1u);
  const auto& r = rows[0];
  EXPECT_EQ(r.input_ids, (std::vector<int32_t>{10, 11, 12, 13}));
  EXPECT_EQ(r.positions, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(r.doc_ids, (std::vector<int32_t>{0, 0, 0, 0}));
  EXPECT_EQ(r.targets, (std::vector<int32_t>{X, 12, 13, X}));
  EXPECT_EQ(r.weights, (std::vector<float>{0, 1, 1, 0}));
  EXPECT_EQ(r.num_items(), 2);
}

TEST(Packing, TwoDocumentsWithLossScaleAndPadding) {
  PackOptions o = options(8, 4);
  o.pad_token_id = 99;
  PackStats stats;
  auto rows = pack_documents(
      {doc({1, 2, 3}, {1, 2, 3}, {0.1f, 0.2f, 0.3f}), doc({4, 5}, {X, 5}, {9.0f, 0.5f})}, o, &stats);
  ASSERT_EQ(rows.size(), 1u);
  const auto& r = rows[0];
  EXPECT_EQ(r.input_ids, (std::vector<int32_t>{1, 2, 3, 4, 5, 99, 99, 99}));
  EXPECT_EQ(r.positions, (std::vector<int32_t>{0, 1, 2, 0, 1, 0, 0, 0}));
  EXPECT_EQ(r.doc_ids, (std::vector<int32_t>{0, 0, 0, 1, 1, -1, -1, -1}));
  // Position 2 is the last token of document 0: it must not predict token 4 of document 1.
  EXPECT_EQ(r.targets, (std::vector<int32_t>{2, 3, X, 5, X, X, X, X}));
  // loss_scale[i] weights predicting labels[i]: position i carries loss_scale[i+1].
  EXPECT_EQ(r.weights, (std::vector<float>{0.2f, 0.3f, 0, 0.5f, 0, 0, 0, 0}));
  EXPECT_EQ(stats.rows, 1);
  EXPECT_EQ(stats.tokens, 5);
  EXPECT_EQ(stats.padding_tokens, 3);
  EXPECT_EQ(stats.targets, 3);
  EXPECT_EQ(stats.documents_packed, 2);
  expect_well_formed(r, o);
}

TEST(Packing, SupervisedTargetWithZeroScaleStillCountsInTheDenominator) {
  auto rows = pack_documents({doc({1, 2, 3}, {}, {1.0f, 0.0f, 2.0f})}, options(4));
  EXPECT_EQ(rows[0].targets, (std::vector<int32_t>{2, 3, X}));
  EXPECT_EQ(rows[0].weights, (std::vector<float>{0.0f, 2.0f, 0.0f}));
  EXPECT_EQ(rows[0].num_items(), 2);  // loss_scale multiplies the numerator only (docs/design.md §2.2)
}

TEST(Packing, BestFitDecreasingIsDeterministicAndKeepsDatasetOrderInRows) {
  // Lengths 6,5,4,3,2 into rows of 10: 6 opens row A (room 4), 5 opens row B (room 5), 4 goes to
  // A (tightest fit, room 0), 3 and 2 go to B.
  std::vector<Document> docs;
  for (int32_t length : {6, 5, 4, 3, 2}) docs.push_back(doc(std::vector<int32_t>(length, length)));
  auto rows = pack_documents(docs, options(10));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].input_ids, (std::vector<int32_t>{6, 6, 6, 6, 6, 6, 4, 4, 4, 4}));
  EXPECT_EQ(rows[1].input_ids, (std::vector<int32_t>{5, 5, 5, 5, 5, 3, 3, 3, 2, 2}));
  // First fit in dataset order would put 4 into row B next to 5; best fit picks the tighter row.
  std::vector<Document> order_test = {doc({1, 1, 1, 1, 1, 1, 1}), doc({2, 2, 2, 2, 2, 2}),
                                      doc({3, 3})};
  rows = pack_documents(order_test, options(9));
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].input_ids, (std::vector<int32_t>{1, 1, 1, 1, 1, 1, 1, 3, 3}));
  EXPECT_EQ(rows[1].input_ids, (std::vector<int32_t>{2, 2, 2, 2, 2, 2}));
}

TEST(Packing, OverLengthPolicies) {
  std::vector<Document> docs = {doc({1, 2, 3, 4, 5, 6}), doc({7, 8})};
  PackOptions o = options(4);
  PackStats stats;
  auto rows = pack_documents(docs, o, &stats);
  ASSERT_EQ(rows.size(), 2u);
  EXPECT_EQ(rows[0].input_ids, (std::vector<int32_t>{1, 2, 3, 4}));
  EXPECT_EQ(rows[0].targets, (std::vector<int32_t>{2, 3, 4, X}));  // label 5 left the row with token 5
  EXPECT_EQ(stats.documents_truncated, 1);
  EXPECT_EQ(stats.tokens_truncated, 2);

  o.over_length = OverLength::kTruncateLeft;
  rows = pack_documents(docs, o);
  EXPECT_EQ(rows[0].input_ids, (std::vector<int32_t>{3, 4, 5, 6}));
  EXPECT_EQ(rows[0].positions, (std::vector<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(rows[0].targets, (std::vector<int32_t>{4, 5, 6, X}));

  o.over_length = OverLength::kDrop;
  stats = {};
  rows = pack_documents(docs, o, &stats);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].input_ids, (std::vector<int32_t>{7, 8}));
  EXPECT_EQ(stats.documents_dropped_over_length, 1);
  EXPECT_EQ(stats.tokens_dropped_over_length, 6);
  EXPECT_NE(stats.summary().find("dropped 1 over-long documents (6 tokens)"), std::string::npos)
      << stats.summary();

  o.over_length = OverLength::kFail;
  EXPECT_THROW_WITH(pack_documents(docs, o), Error, "document 0 has 6 tokens", "--max-length");
  EXPECT_EQ(parse_over_length("truncate-left"), OverLength::kTruncateLeft);
  EXPECT_THROW_WITH(parse_over_length("cut"), Error, "unknown over-length policy 'cut'");
}

TEST(Packing, DocumentsWithoutTargetsAfterShiftingAreCountedAndDropped) {
  // Only labels[0] supervised: nothing predicts it. Truncation can also remove every target.
  std::vector<Document> docs = {doc({5, 6, 7}, {5, X, X}), doc({1, 2, 3, 4, 5, 6}, {X, X, X, X, 5, 6}),
                                doc({9}), doc({8, 9})};
  PackStats stats;
  auto rows = pack_documents(docs, options(4), &stats);
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].input_ids, (std::vector<int32_t>{8, 9}));
  EXPECT_EQ(stats.documents_without_targets, 3);
  EXPECT_EQ(stats.documents_dropped_without_targets, 3);

  PackOptions keep = options(4);
  keep.drop_documents_without_targets = false;
  stats = {};
  rows = pack_documents(docs, keep, &stats);
  int64_t items = 0;
  for (const auto& r : rows) items += r.num_items();
  EXPECT_EQ(items, 1);
  EXPECT_EQ(stats.documents_packed, 4);
  EXPECT_EQ(stats.documents_without_targets, 3);
  EXPECT_EQ(stats.documents_dropped_without_targets, 0);
}

TEST(Packing, NoPackingModeGivesOneDocumentPerRowInOrder) {
  PackOptions o = options(8, 4);
  o.packing = false;
  auto rows = pack_documents({doc({1, 2}), doc({3, 4, 5, 6, 7}), doc({8, 9})}, o);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[0].input_ids, (std::vector<int32_t>{1, 2, 0, 0}));
  EXPECT_EQ(rows[1].length(), 8);
  EXPECT_EQ(rows[1].targets, (std::vector<int32_t>{4, 5, 6, 7, X, X, X, X}));
  EXPECT_EQ(rows[2].input_ids, (std::vector<int32_t>{8, 9, 0, 0}));
  o.pad_to_max_length = true;
  rows = pack_documents({doc({1, 2})}, o);
  EXPECT_EQ(rows[0].length(), 8);
}

TEST(Packing, OptionsAreValidated) {
  EXPECT_THROW_WITH(pack_documents({doc({1})}, options(0)), Error, "--max-length");
  EXPECT_THROW_WITH(pack_documents({doc({1})}, options(10, 4)), Error,
                    "max_length 10 is not a multiple of 4", "--max-length 8");
  Document mismatched = doc({1, 2});
  mismatched.labels = {1};
  EXPECT_THROW_WITH(pack_documents({mismatched}, options(4)), Error, "document 0", "same length");
}

// For random documents, every (token, target, weight) triple of a document appears in the rows at
// the right position of its document, and the number of supervised targets is exactly Σ over
// documents of supervised labels excluding index 0.
TEST(Packing, PropertyRandomDocumentsKeepEveryTripleAndTheItemCount) {
  std::mt19937 rng(1234);
  for (int trial = 0; trial < 60; ++trial) {
    const int64_t multiple = std::vector<int64_t>{1, 2, 4, 8}[trial % 4];
    PackOptions o = options(64, multiple);
    o.packing = trial % 5 != 0;
    o.drop_documents_without_targets = trial % 2 == 0;
    o.pad_to_max_length = trial % 7 == 0;
    o.pad_token_id = -7;
    const int num_docs = 1 + static_cast<int>(rng() % 40);
    std::vector<Document> docs;
    // (document, position, token, target, weight), expected and observed.
    std::vector<std::tuple<int64_t, int32_t, int32_t, int32_t, float>> expected, observed;
    int64_t expected_items = 0;
    for (int d = 0; d < num_docs; ++d) {
      const int length = 1 + static_cast<int>(rng() % 64);
      Document x;
      const bool scaled = rng() % 2;
      const int mask_kind = static_cast<int>(rng() % 3);  // none, all, random
      for (int i = 0; i < length; ++i) {
        // Token ids encode (document, position) so each triple can be traced back.
        x.input_ids.push_back(d * 1000 + i);
        const bool supervised = mask_kind == 1 || (mask_kind == 2 && rng() % 2);
        x.labels.push_back(supervised ? x.input_ids.back() : X);
        if (scaled) x.loss_scale.push_back(static_cast<float>(rng() % 5) * 0.5f);
      }
      int64_t items = 0;
      for (int i = 1; i < length; ++i) items += x.labels[i] != X;
      if (items > 0 || !o.drop_documents_without_targets) {
        expected_items += items;
        for (int i = 0; i < length; ++i) {
          const int32_t target = i + 1 < length ? x.labels[i + 1] : X;
          const float weight = target == X ? 0.0f : (scaled ? x.loss_scale[i + 1] : 1.0f);
          expected.emplace_back(d, i, x.input_ids[i], target, weight);
        }
      }
      docs.push_back(std::move(x));
    }
    PackStats stats;
    auto rows = pack_documents(docs, o, &stats);
    int64_t items = 0;
    for (const auto& row : rows) {
      expect_well_formed(row, o);
      items += row.num_items();
      for (int64_t i = 0; i < row.length(); ++i)
        if (row.doc_ids[i] >= 0)
          observed.emplace_back(row.input_ids[i] / 1000, row.positions[i], row.input_ids[i],
                                row.targets[i], row.weights[i]);
    }
    EXPECT_EQ(items, expected_items) << "trial " << trial;
    EXPECT_EQ(stats.targets, expected_items);
    std::sort(expected.begin(), expected.end());
    std::sort(observed.begin(), observed.end());
    EXPECT_EQ(observed, expected) << "trial " << trial;
    // Position p of document d holds token d*1000+p: the position travels with its token.
    for (const auto& [d, p, token, target, weight] : observed) EXPECT_EQ(token, d * 1000 + p);
    // Same input, same rows.
    auto again = pack_documents(docs, o);
    ASSERT_EQ(again.size(), rows.size());
    for (size_t r = 0; r < rows.size(); ++r) EXPECT_EQ(again[r].input_ids, rows[r].input_ids);
  }
}

TEST(StreamingPacker, MatchesInMemoryPackingContentWithBoundedWindows) {
  std::mt19937 rng(99);
  std::vector<Document> docs;
  for (int d = 0; d < 300; ++d) {
    std::vector<int32_t> ids;
    const int length = 2 + static_cast<int>(rng() % 99);  // >= 2 tokens: every document has a target
    for (int i = 0; i < length; ++i) ids.push_back(d * 1000 + i);
    docs.push_back(doc(ids));
  }
  PackOptions o = options(128, 8);
  o.window_tokens = 1000;
  o.pad_token_id = -1;
  std::vector<PackedRow> streamed;
  size_t most_buffered_rows = 0;
  StreamingPacker packer(o, [&](PackedRow&& row) { streamed.push_back(std::move(row)); });
  for (auto& d : docs) {
    const size_t before = streamed.size();
    packer.add(d);
    most_buffered_rows = std::max(most_buffered_rows, streamed.size() - before);
  }
  packer.finish();
  PackStats whole_stats;
  auto whole = pack_documents(docs, o, &whole_stats);
  EXPECT_EQ(packer.stats().tokens, whole_stats.tokens);
  EXPECT_EQ(packer.stats().targets, whole_stats.targets);
  EXPECT_EQ(packer.stats().documents_packed, 300);
  // A flush holds < 1000 + 100 tokens; best fit leaves no two rows that could be merged, so rows
  // are more than half full on average: at most 2 * 1100 / 128 + 1 rows per flush.
  EXPECT_LE(most_buffered_rows, 20u);
  std::vector<int32_t> a, b;
  for (const auto& r : streamed) {
    expect_well_formed(r, o);
    a.insert(a.end(), r.input_ids.begin(), r.input_ids.end());
  }
  for (const auto& r : whole) b.insert(b.end(), r.input_ids.begin(), r.input_ids.end());
  std::erase(a, -1);
  std::erase(b, -1);
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  EXPECT_EQ(a, b);
  // The whole-dataset window packs at least as tightly as small windows.
  EXPECT_LE(whole.size(), streamed.size());
}

TEST(StreamingPacker, TruncatedDocumentsKeepOnlyTheirSliceAndReportOrigin) {
  PackOptions o = options(4);
  std::vector<PackedRow> rows;
  StreamingPacker packer(o, [&](PackedRow&& row) { rows.push_back(std::move(row)); });
  packer.add(doc({1, 2, 3, 4, 5, 6}, {}, {1, 2, 3, 4, 5, 6}));
  packer.finish();
  ASSERT_EQ(rows.size(), 1u);
  EXPECT_EQ(rows[0].weights, (std::vector<float>{2, 3, 4, 0}));
  o.over_length = OverLength::kFail;
  StreamingPacker strict(o, [](PackedRow&&) {});
  EXPECT_THROW_WITH(strict.add(doc({1, 2, 3, 4, 5}), "train.jsonl:17"), Error,
                    "train.jsonl:17 has 5 tokens");
}
