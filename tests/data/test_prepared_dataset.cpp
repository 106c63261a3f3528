#include <gtest/gtest.h>

#include <fstream>
#include <random>

#include "data/pretokenized.h"
#include "data/prepared_dataset.h"
#include "byte_text_encoder.h"
#include "data_test_util.h"

using namespace spindle;
using spindle::testing::ScratchDir;
namespace fs = std::filesystem;

namespace {

constexpr int32_t X = kIgnoreIndex;

Document doc(std::vector<int32_t> ids, std::vector<int32_t> labels, std::vector<float> scale = {}) {
  return Document{std::move(ids), std::move(labels), std::move(scale)};
}

template <typename T>
std::vector<T> to_vector(std::span<const T> s) {
  return {s.begin(), s.end()};
}

std::vector<std::string> files_in(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::directory_iterator(dir)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

// Without BOS, so that a text sample's ids are its bytes and EOS.
struct ByteEncoder : spindle::testing::ByteTextEncoder {
  ByteEncoder() : ByteTextEncoder(/*adds_bos=*/false) {}
};

}  // namespace

TEST(PreparedDataset, WriterAndReaderRoundTrip) {
  ScratchDir dir;
  const auto path = dir.path() / "d.bin";
  std::vector<Document> docs = {doc({1, 2, 3}, {X, 2, 3}), doc({7}, {7}, {0.5f}),
                                doc({4, 5}, {4, X}, {1.0f, 2.0f})};
  {
    PreparedDatasetWriter writer(path, DatasetKind::kDocuments);
    for (const auto& d : docs) writer.add(view_of(d));
    EXPECT_FALSE(fs::exists(path)) << "the final name appears only when the file is complete";
    writer.finish();
  }
  EXPECT_EQ(files_in(dir.path()), (std::vector<std::string>{"d.bin"}));
  auto dataset = PreparedDataset::open(path);
  EXPECT_EQ(dataset.kind(), DatasetKind::kDocuments);
  ASSERT_EQ(dataset.num_documents(), 3);
  EXPECT_EQ(dataset.num_tokens(), 6);
  for (int i = 0; i < 3; ++i) {
    auto v = dataset.document(i);
    EXPECT_EQ(to_vector(v.input_ids), docs[i].input_ids);
    EXPECT_EQ(to_vector(v.labels), docs[i].labels);
    EXPECT_EQ(to_vector(v.loss_scale), docs[i].loss_scale);
  }
  EXPECT_THROW_WITH(dataset.document(3), Error, "document 3 is out of range");
  auto copy = dataset;  // copies share the mapping and outlive the original
  dataset = PreparedDataset{};
  EXPECT_EQ(copy.document(2).loss_scale[1], 2.0f);
}

TEST(PreparedDataset, UnfinishedWriterLeavesNothing) {
  ScratchDir dir;
  {
    PreparedDatasetWriter writer(dir.path() / "d.bin", DatasetKind::kDocuments);
    Document d = doc({1, 2}, {1, 2});
    writer.add(view_of(d));
  }
  EXPECT_TRUE(files_in(dir.path()).empty());
}

TEST(PreparedDataset, CorruptFilesAreRejectedWithTheReason) {
  ScratchDir dir;
  const auto good = dir.path() / "good.bin";
  {
    PreparedDatasetWriter writer(good, DatasetKind::kDocuments);
    Document d = doc({1, 2, 3, 4}, {1, 2, 3, 4});
    writer.add(view_of(d));
    writer.add(view_of(d));
    writer.finish();
  }
  std::string bytes;
  {
    std::ifstream in(good, std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  auto variant = [&](const std::string& name, std::string content) { return dir.write(name, content); };
  EXPECT_THROW_WITH(PreparedDataset::open(dir.path() / "missing.bin"), Error, "cannot open prepared dataset",
                    "spindle prepare");
  EXPECT_THROW_WITH(PreparedDataset::open(variant("short.bin", "SPNDL")), Error, "shorter than the header");
  std::string bad_magic = bytes;
  bad_magic[0] = 'X';
  EXPECT_THROW_WITH(PreparedDataset::open(variant("magic.bin", bad_magic)), Error, "bad magic");
  std::string bad_version = bytes;
  bad_version[8] = 9;
  EXPECT_THROW_WITH(PreparedDataset::open(variant("version.bin", bad_version)), Error, "version 9");
  EXPECT_THROW_WITH(PreparedDataset::open(variant("truncated.bin", bytes.substr(0, bytes.size() - 5))),
                    Error, "truncated");
  // Index entry of document 1: its length field claims more tokens than the records hold.
  std::string bad_entry = bytes;
  const size_t entry = bytes.size() - 16 + 8;
  bad_entry[entry] = 100;
  EXPECT_THROW_WITH(PreparedDataset::open(variant("entry.bin", bad_entry)), Error, "document 1 has an invalid index entry");
  EXPECT_NO_THROW(PreparedDataset::open(good));
}

TEST(Prepare, PretokenizedFileRoundTripsAndPacksLikeInMemoryDocuments) {
  ScratchDir dir;
  std::mt19937 rng(5);
  std::string jsonl;
  for (int i = 0; i < 200; ++i) {
    const int length = 1 + static_cast<int>(rng() % 40);
    nlohmann::json sample;
    std::vector<int> ids, mask;
    std::vector<double> scale;
    for (int j = 0; j < length; ++j) {
      ids.push_back(static_cast<int>(rng() % 1000));
      mask.push_back(rng() % 3 != 0);
      scale.push_back((rng() % 4) * 0.25);
    }
    sample["input_ids"] = ids;
    if (i % 2) sample["loss_mask"] = mask;
    if (i % 3 == 0) sample["loss_scale"] = scale;
    jsonl += sample.dump() + "\n";
  }
  jsonl += "{\"input_ids\": [1, 2], \"labels\": [1]}\n";  // bad, skipped
  const auto data = dir.write("train.jsonl", jsonl);

  PrepareOptions options;
  options.data = data;
  options.output_dir = dir.path() / "out";
  options.fit.max_length = 32;
  options.encode.read.on_bad_sample = BadSamplePolicy::kSkip;
  PrepareReport report = prepare_dataset(options, nullptr);
  EXPECT_EQ(report.read.samples, 200);
  EXPECT_EQ(report.read.skipped, 1);
  EXPECT_GT(report.fit.documents_truncated, 0);
  EXPECT_EQ(files_in(options.output_dir), (std::vector<std::string>{"dataset.bin", "dataset.json"}));
  EXPECT_NE(report.summary().find("skipped 1 bad samples"), std::string::npos) << report.summary();
  nlohmann::json info;
  std::ifstream(options.output_dir / "dataset.json") >> info;
  EXPECT_EQ(info["documents"], report.documents);
  EXPECT_EQ(info["skipped_samples"], 1);
  EXPECT_EQ(info["max_length"], 32);

  // Reference: the same file read into memory and packed directly.
  ReadOptions read;
  read.on_bad_sample = BadSamplePolicy::kSkip;
  auto docs = read_pretokenized_jsonl(data, read);
  PackOptions pack;
  pack.max_length = 64;
  pack.pad_to_multiple = 8;
  std::vector<Document> fitted;
  PackStats ignored;
  pack.max_length = 32;
  for (size_t i = 0; i < docs.size(); ++i) {
    auto slice = fit_document(i, view_of(docs[i]), pack, ignored, "x");
    if (!slice) continue;
    Document d;
    d.input_ids.assign(docs[i].input_ids.begin(), docs[i].input_ids.begin() + slice->length);
    d.labels.assign(docs[i].labels.begin(), docs[i].labels.begin() + slice->length);
    if (!docs[i].loss_scale.empty())
      d.loss_scale.assign(docs[i].loss_scale.begin(), docs[i].loss_scale.begin() + slice->length);
    fitted.push_back(std::move(d));
  }
  auto dataset = PreparedDataset::open(options.output_dir);
  ASSERT_EQ(dataset.num_documents(), static_cast<int64_t>(fitted.size()));
  for (size_t i = 0; i < fitted.size(); ++i) {
    EXPECT_EQ(to_vector(dataset.document(i).input_ids), fitted[i].input_ids);
    EXPECT_EQ(to_vector(dataset.document(i).labels), fitted[i].labels);
    EXPECT_EQ(to_vector(dataset.document(i).loss_scale), fitted[i].loss_scale);
  }
  pack.max_length = 64;
  PackStats from_memory, from_file;
  auto expected_rows = pack_documents(fitted, pack, &from_memory);
  auto plans = plan_prepared_rows(dataset, pack, from_file);
  ASSERT_EQ(plans.size(), expected_rows.size());
  for (size_t r = 0; r < plans.size(); ++r) {
    PackedRow row = build_row(plans[r], [&](int64_t i) { return dataset.document(i); }, pack, from_file);
    EXPECT_EQ(row.input_ids, expected_rows[r].input_ids);
    EXPECT_EQ(row.targets, expected_rows[r].targets);
    EXPECT_EQ(row.weights, expected_rows[r].weights);
    EXPECT_EQ(row.positions, expected_rows[r].positions);
  }
  EXPECT_EQ(from_file.targets, from_memory.targets);
}

TEST(Prepare, TextAndPreferenceFilesWithATokenizer) {
  ScratchDir dir;
  ByteEncoder bytes;
  PrepareOptions options;
  options.fit.max_length = 100;
  options.data = dir.write("text.jsonl", "{\"text\": \"abc\"}\n{\"prompt\": \"q\", \"completion\": \"a\"}\n");
  options.output_dir = dir.path() / "text";
  auto report = prepare_dataset(options, &bytes);
  EXPECT_EQ(report.kind, DatasetKind::kDocuments);
  auto dataset = PreparedDataset::open(options.output_dir);
  ASSERT_EQ(dataset.num_documents(), 2);
  EXPECT_EQ(to_vector(dataset.document(1).labels), (std::vector<int32_t>{X, 'a' + 10, 2}));

  options.data = dir.write("pairs.jsonl", "{\"prompt\": \"p\", \"chosen\": \"yes\", \"rejected\": \"no\"}\n");
  options.output_dir = dir.path() / "pairs";
  report = prepare_dataset(options, &bytes);
  EXPECT_EQ(report.kind, DatasetKind::kPreferencePairs);
  dataset = PreparedDataset::open(options.output_dir / kPreparedDataFile);
  EXPECT_EQ(dataset.kind(), DatasetKind::kPreferencePairs);
  ASSERT_EQ(dataset.num_documents(), 2);
  EXPECT_EQ(dataset.document_length(0), 5);  // p y e s EOS
  EXPECT_EQ(dataset.document_length(1), 4);  // p n o EOS
  EXPECT_NE(report.summary().find("wrote 1 preference pairs"), std::string::npos) << report.summary();

  // A text sample in a preference file is an error, not a skip.
  options.data = dir.write("mixed.jsonl",
                           "{\"prompt\": \"p\", \"chosen\": \"y\", \"rejected\": \"n\"}\n{\"text\": \"t\"}\n");
  options.output_dir = dir.path() / "mixed";
  options.encode.read.on_bad_sample = BadSamplePolicy::kSkip;
  EXPECT_THROW_WITH(prepare_dataset(options, &bytes), Error, "expected preference pairs");
  EXPECT_TRUE(files_in(options.output_dir).empty()) << "a failed prepare leaves no files";
}

TEST(Prepare, FailuresNameTheLineAndLeaveNoOutput) {
  ScratchDir dir;
  PrepareOptions options;
  options.fit.max_length = 4;
  options.output_dir = dir.path() / "out";
  options.data = dir.write("bad.jsonl", "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, \"x\"]}\n");
  EXPECT_THROW_WITH(prepare_dataset(options, nullptr), Error, "bad.jsonl:2:", "input_ids[1] must be an integer");
  EXPECT_TRUE(files_in(options.output_dir).empty());

  options.fit.over_length = OverLength::kFail;
  options.data = dir.write("long.jsonl", "{\"input_ids\": [1, 2]}\n{\"input_ids\": [1, 2, 3, 4, 5]}\n");
  EXPECT_THROW_WITH(prepare_dataset(options, nullptr), Error, "long.jsonl:2 has 5 tokens");
  EXPECT_TRUE(files_in(options.output_dir).empty());

  options.data = dir.write("empty.jsonl", "\n\n");
  EXPECT_THROW_WITH(prepare_dataset(options, nullptr), Error, "no training documents left");
  options.data = dir.write("untargeted.jsonl", "{\"input_ids\": [1, 2], \"loss_mask\": [1, 0]}\n");
  EXPECT_THROW_WITH(prepare_dataset(options, nullptr), Error, "no training documents left",
                    "1 without a supervised target");
  EXPECT_TRUE(files_in(options.output_dir).empty());
  options.data = dir.write("text.jsonl", "{\"text\": \"hello\"}\n");
  EXPECT_THROW_WITH(prepare_dataset(options, nullptr), Error, "text samples need a tokenizer");
}
