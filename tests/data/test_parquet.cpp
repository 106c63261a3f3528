// Parquet and Arrow datasets read through the Arrow plugin: the same rows as JSONL give the same
// prepared dataset, byte for byte, and the same packed rows, in every sample format; the hub cache
// and `datasets`' Arrow cache resolve and read; bad files (wrong columns, a corrupt or truncated
// file, an empty split, a NaN) give errors naming the file and column, and leave nothing written.
//
// The files are written by pyarrow in the test. Without pyarrow, or in a build without the plugin,
// the tests are skipped with the reason; SPINDLE_TEST_REQUIRE_PARQUET=1 (CI: .ci/run, since `make`
// installs pyarrow) or SPINDLE_TEST_REQUIRE_DATA=1 turns each skip into a failure.
#include <gtest/gtest.h>

#include <cstdlib>
#include <fstream>
#include <sstream>

#include "byte_text_encoder.h"
#include "core/error.h"
#include "data/dataset_files.h"
#include "data/prepared_dataset.h"
#include "data/table_reader.h"
#include "dataset_test_util.h"

using namespace spindle;
using spindle::testing::CacheEnvironment;
using spindle::testing::ScratchDir;
namespace fs = std::filesystem;

namespace {

bool parquet_required() {
  for (const char* name : {"SPINDLE_TEST_REQUIRE_PARQUET", "SPINDLE_TEST_REQUIRE_DATA"})
    if (const char* v = std::getenv(name); v && std::string(v) == "1") return true;
  return false;
}

// Why these tests cannot run here, or empty.
std::string missing_parquet() {
  const TableSupport support = table_support();
  if (!support.loaded) return "Parquet support is not available: " + support.problem;
  if (std::system("python3 -c 'import pyarrow' >/dev/null 2>&1") != 0)
    return "python3 has no pyarrow (python3 -m pip install pyarrow) to write the test files";
  return "";
}

#define REQUIRE_PARQUET()                                                                                  \
  do {                                                                                                     \
    const std::string why_ = missing_parquet();                                                            \
    if (!why_.empty()) {                                                                                   \
      if (parquet_required()) GTEST_FAIL() << why_ << " (SPINDLE_TEST_REQUIRE_PARQUET=1: it must be there)"; \
      GTEST_SKIP() << why_;                                                                                \
    }                                                                                                      \
  } while (0)

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// Runs a Python script (pyarrow imported as pa, pyarrow.parquet as pq, json, and table(rows): the
// rows as a table whose columns are every key of any row, in order of first appearance, and whose
// types pyarrow infers from all the rows, as `datasets` builds tables from JSON); fails the test on
// error.
constexpr const char* kPythonPrelude = R"(import json, sys
import pyarrow as pa
import pyarrow.parquet as pq

def table(rows):
    keys = []
    for row in rows:
        keys += [k for k in row if k not in keys]
    return pa.Table.from_pydict({k: pa.array([row.get(k) for row in rows]) for k in keys})
)";

void python(const ScratchDir& dir, const std::string& body, const std::string& args = "") {
  const fs::path script = dir.write("script.py", kPythonPrelude + body);
  const fs::path log = dir.path() / "python.log";
  const int status = std::system(("python3 '" + script.string() + "' " + args + " >'" + log.string() + "' 2>&1").c_str());
  ASSERT_EQ(status, 0) << read_bytes(log);
}

// From rows.jsonl (one JSON object per line): NAME.parquet (row groups of 2, page checksums),
// NAME.arrow (an IPC stream of one-row batches, as `datasets` writes them) and NAME.file.arrow (an
// IPC file).
constexpr const char* kWriteTables = R"(
src, out = sys.argv[1], sys.argv[2]
rows = [json.loads(line) for line in open(src, encoding="utf-8") if line.strip()]
t = table(rows)
pq.write_table(t, out + ".parquet", row_group_size=2, write_page_checksum=True)
with pa.OSFile(out + ".arrow", "wb") as f:
    with pa.ipc.new_stream(f, t.schema) as w:
        for batch in t.to_batches(max_chunksize=1):
            w.write_batch(batch)
with pa.OSFile(out + ".file.arrow", "wb") as f:
    with pa.ipc.new_file(f, t.schema) as w:
        w.write_table(t, max_chunksize=2)
)";

struct Prepared {
  std::string bin;  // dataset.bin's bytes
  std::vector<PackedRow> rows;
  PrepareReport report;
};

Prepared prepare(const std::string& data, const fs::path& output, bool skip_bad = false) {
  static const spindle::testing::ByteTextEncoder encoder(/*adds_bos=*/false);
  PrepareOptions options;
  options.data = data;
  options.output_dir = output;
  options.fit.max_length = 4096;
  if (skip_bad) options.encode.read.on_bad_sample = BadSamplePolicy::kSkip;
  Prepared out;
  out.report = prepare_dataset(options, &encoder);
  out.bin = read_bytes(output / kPreparedDataFile);
  const PreparedDataset set = PreparedDataset::open(output);
  PackOptions pack;
  pack.max_length = 1024;
  PackStats stats;
  if (set.kind() == DatasetKind::kDocuments) {
    for (const RowPlan& plan : plan_prepared_rows(set, pack, stats))
      out.rows.push_back(build_row(plan, [&](int64_t i) { return set.document(i); }, pack, stats));
  } else {
    int64_t dropped = 0;
    for (const auto& group : plan_prepared_pairs(set, pack, stats, dropped))
      for (const RowPlan& plan : group)
        out.rows.push_back(build_row(plan, [&](int64_t i) { return set.document(i); }, pack, stats));
  }
  return out;
}

void expect_same_rows(const Prepared& a, const Prepared& b, const std::string& what) {
  EXPECT_TRUE(a.bin == b.bin) << what << ": dataset.bin differs (" << a.bin.size() << " and " << b.bin.size()
                              << " bytes)";
  ASSERT_EQ(a.rows.size(), b.rows.size()) << what;
  for (size_t r = 0; r < a.rows.size(); ++r) {
    EXPECT_EQ(a.rows[r].input_ids, b.rows[r].input_ids) << what << " row " << r;
    EXPECT_EQ(a.rows[r].positions, b.rows[r].positions) << what << " row " << r;
    EXPECT_EQ(a.rows[r].doc_ids, b.rows[r].doc_ids) << what << " row " << r;
    EXPECT_EQ(a.rows[r].targets, b.rows[r].targets) << what << " row " << r;
    EXPECT_EQ(a.rows[r].weights, b.rows[r].weights) << what << " row " << r;
  }
}

std::string jsonl(const std::vector<std::string>& lines) {
  std::string text;
  for (const std::string& line : lines) text += line + "\n";
  return text;
}

// The same rows as JSONL, Parquet, an Arrow stream and an Arrow file prepare identically.
void expect_tables_match_jsonl(const std::string& name, const std::vector<std::string>& lines) {
  ScratchDir dir;
  const fs::path source = dir.write(name + ".jsonl", jsonl(lines));
  python(dir, kWriteTables, "'" + source.string() + "' '" + (dir.path() / name).string() + "'");
  if (::testing::Test::HasFatalFailure()) return;
  const Prepared reference = prepare(source.string(), dir.path() / "from_jsonl");
  EXPECT_EQ(reference.report.read.samples, static_cast<int64_t>(lines.size())) << name;
  ASSERT_FALSE(reference.rows.empty()) << name;
  for (const char* suffix : {".parquet", ".arrow", ".file.arrow"}) {
    const std::string table = (dir.path() / (name + suffix)).string();
    const Prepared got = prepare(table, dir.path() / ("from" + std::string(suffix)));
    expect_same_rows(reference, got, name + suffix);
    EXPECT_EQ(got.report.read.rows, static_cast<int64_t>(lines.size())) << name << suffix;
    EXPECT_EQ(got.report.read.samples, static_cast<int64_t>(lines.size())) << name << suffix;
    EXPECT_NE(got.report.read.summary().find("rows"), std::string::npos) << got.report.read.summary();
  }
}

// prepare_dataset failed with an Error holding every fragment, and left no dataset behind.
template <typename... Fragments>
void expect_refused(const std::string& data, const fs::path& output, Fragments... fragments) {
  EXPECT_THROW_WITH(prepare(data, output), Error, fragments...);
  EXPECT_FALSE(fs::exists(output / kPreparedDataFile)) << "a refused dataset must leave nothing to train on";
}

}  // namespace

TEST(Parquet, PretokenizedRowsMatchJsonl) {
  REQUIRE_PARQUET();
  expect_tables_match_jsonl("pretokenized", {
      R"({"input_ids": [15, 16, 17, 18], "labels": [-100, 16, 17, 18]})",
      R"({"input_ids": [19, 20, 21], "loss_mask": [0, 1, 1], "loss_scale": [1, 0.5, 2]})",
      R"({"input_ids": [22, 23]})",
      R"({"input_ids": [24, 25, 26, 27, 28], "labels": [-100, -100, 26, 27, 28], "attention_mask": [1, 1, 1, 1, 1]})",
  });
}

TEST(Parquet, TextAndPromptCompletionRowsMatchJsonl) {
  REQUIRE_PARQUET();
  // Rows of different formats in one table: the columns one row lacks are nulls there, read as absent.
  expect_tables_match_jsonl("text", {
      R"({"text": "plain text, supervised"})",
      R"({"prompt": "Question? ", "completion": "Answer."})",
      R"({"prompt": "", "response": "A response with an empty prompt"})",
      R"({"text": "unicode: é 漢字 🙂"})",
  });
}

TEST(Parquet, AlpacaRowsMatchJsonl) {
  REQUIRE_PARQUET();
  expect_tables_match_jsonl("alpaca", {
      R"({"instruction": "Add the numbers", "input": "1 + 1", "output": "2"})",
      R"({"instruction": "Say hi", "output": "hi", "system": "Be brief", "history": [["a", "b"], ["c", "d"]]})",
      R"({"instruction": "No input", "input": "", "output": "ok", "history": []})",
  });
}

TEST(Parquet, MessagesRowsMatchJsonl) {
  REQUIRE_PARQUET();
  // Message structs whose fields some messages lack (loss_scale, tool_calls, tool_call_id).
  expect_tables_match_jsonl("messages", {
      R"({"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello", "loss_scale": 0.5}]})",
      R"({"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "get", "arguments": "{\"city\": \"Paris\"}"}}]}, {"role": "tool", "content": "sunny", "tool_call_id": "c1"}, {"role": "assistant", "content": "Sunny."}]})",
      R"({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "loss_scale": 0}, {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "loss_scale": 2}]})",
  });
}

TEST(Parquet, ShareGptRowsMatchJsonl) {
  REQUIRE_PARQUET();
  expect_tables_match_jsonl("sharegpt", {
      R"({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}], "system": "sys"})",
      R"({"conversations": [{"from": "human", "value": "1"}, {"from": "gpt", "value": "2", "weight": 0}, {"from": "human", "value": "3"}, {"from": "gpt", "value": "4"}]})",
  });
}

TEST(Parquet, PreferencePairsMatchJsonl) {
  REQUIRE_PARQUET();
  expect_tables_match_jsonl("dpo_text", {
      R"({"prompt": "P1 ", "chosen": "good", "rejected": "bad"})",
      R"({"prompt": "P2 ", "chosen": "better answer", "rejected": "worse"})",
  });
  expect_tables_match_jsonl("dpo_messages", {
      R"({"chosen": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "rejected": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "B"}]})",
      R"({"chosen": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "long A"}], "rejected": [{"role": "user", "content": "Q2"}, {"role": "assistant", "content": "C"}]})",
  });
  expect_tables_match_jsonl("dpo_swift", {
      R"({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "chosen"}], "rejected_response": "rejected"})",
  });
}

TEST(Parquet, HubCacheShardsReadAsTheirRowsInJsonl) {
  REQUIRE_PARQUET();
  ScratchDir dir;
  CacheEnvironment env(dir.path() / "home");
  const std::vector<std::string> lines = {R"({"text": "first"})", R"({"text": "second"})", R"({"text": "third"})"};
  const fs::path source = dir.write("all.jsonl", jsonl(lines));
  // The shards as the hub stores them (data/train-0000K-of-00002.parquet), with a test split.
  python(dir, R"(
rows = [json.loads(l) for l in open(sys.argv[1])]
t = table(rows)
pq.write_table(t.slice(0, 2), sys.argv[2] + "/train-00000-of-00002.parquet")
pq.write_table(t.slice(2), sys.argv[2] + "/train-00001-of-00002.parquet")
pq.write_table(t.slice(0, 1), sys.argv[2] + "/test-00000-of-00001.parquet")
)", "'" + source.string() + "' '" + dir.path().string() + "'");
  std::map<std::string, std::string> files;
  for (const char* f : {"train-00000-of-00002.parquet", "train-00001-of-00002.parquet", "test-00000-of-00001.parquet"})
    files[std::string("data/") + f] = read_bytes(dir.path() / f);
  const fs::path cache = dir.path() / "hub";
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  spindle::testing::add_hub_dataset(cache, "Org", "Chat", files);
  const Prepared reference = prepare(source.string(), dir.path() / "a");
  expect_same_rows(reference, prepare("Org/Chat", dir.path() / "b"), "Org/Chat");
  const Prepared test = prepare("Org/Chat:test", dir.path() / "c");
  EXPECT_EQ(test.report.read.samples, 1);
  // dataset.json says where the rows came from.
  std::ifstream info(dir.path() / "b" / kPreparedInfoFile);
  const nlohmann::json j = nlohmann::json::parse(info);
  EXPECT_EQ(j["source"], "Org/Chat");
  EXPECT_EQ(j["source_format"], "Parquet");
  EXPECT_EQ(j["source_split"], "train");
  EXPECT_EQ(j["source_files"].size(), 2u);
  EXPECT_EQ(j["rows"], 3);
}

TEST(Parquet, DatasetsArrowCacheReadsAndChecksTheRecordedRowCount) {
  REQUIRE_PARQUET();
  ScratchDir dir;
  CacheEnvironment env(dir.path() / "home");
  const std::vector<std::string> lines = {R"({"prompt": "a", "completion": "b"})", R"({"prompt": "c", "completion": "d"})",
                                          R"({"prompt": "e", "completion": "f"})"};
  const fs::path source = dir.write("all.jsonl", jsonl(lines));
  const fs::path prepared = dir.path() / "ds" / "Org___Pairs" / "default" / "0.0.0" / "0123abcd";
  fs::create_directories(prepared);
  // As `datasets` writes its cache: Arrow IPC streams named NAME-SPLIT[-0000K-of-0000N].arrow.
  python(dir, R"(
rows = [json.loads(l) for l in open(sys.argv[1])]
t = table(rows)
for name, part in (("pairs-train-00000-of-00002.arrow", t.slice(0, 1)), ("pairs-train-00001-of-00002.arrow", t.slice(1))):
    with pa.OSFile(sys.argv[2] + "/" + name, "wb") as f:
        with pa.ipc.new_stream(f, t.schema) as w:
            w.write_table(part)
)", "'" + source.string() + "' '" + prepared.string() + "'");
  std::ofstream(prepared / "dataset_info.json") << R"({"splits": {"train": {"name": "train", "num_examples": 3}}})";
  ::setenv("HF_DATASETS_CACHE", (dir.path() / "ds").c_str(), 1);
  ::setenv("HF_HUB_CACHE", (dir.path() / "hub").c_str(), 1);
  const Prepared reference = prepare(source.string(), dir.path() / "a");
  expect_same_rows(reference, prepare("Org/Pairs", dir.path() / "b"), "Org/Pairs from the datasets cache");
  // A count other than the recorded one: the cache was changed or cut.
  std::ofstream(prepared / "dataset_info.json") << R"({"splits": {"train": {"name": "train", "num_examples": 5}}})";
  expect_refused("Org/Pairs", dir.path() / "c", "read 3 rows but `datasets` recorded 5", "dataset_info.json");
}

TEST(Parquet, WrongColumnsAreRefusedNamingTheFileAndColumns) {
  REQUIRE_PARQUET();
  ScratchDir dir;
  python(dir, R"(
d = sys.argv[1]
pq.write_table(pa.table({"question": ["q"], "answer": ["a"]}), d + "/cols.parquet")
pq.write_table(pa.table({"text": pa.array([b"\x00\x01"], pa.binary())}), d + "/binary.parquet")
pq.write_table(pa.table({"text": pa.array([], pa.string())}), d + "/empty.parquet")
)", "'" + dir.path().string() + "'");
  const std::string cols = (dir.path() / "cols.parquet").string();
  expect_refused(cols, dir.path() / "o1", cols.c_str(), "no column selects a sample format",
                 "its columns: question, answer", "Rename the column");
  const std::string binary = (dir.path() / "binary.parquet").string();
  expect_refused(binary, dir.path() / "o2", binary.c_str(), "column 'text' has Arrow type binary", "no JSON form");
  const std::string empty = (dir.path() / "empty.parquet").string();
  expect_refused(empty, dir.path() / "o3", "empty.parquet holds no rows: the split is empty");
}

TEST(Parquet, CorruptAndTruncatedFilesAreRefusedWhole) {
  REQUIRE_PARQUET();
  ScratchDir dir;
  python(dir, R"(
d = sys.argv[1]
rows = [{"text": "row %d " % i + "x" * 200} for i in range(400)]
t = table(rows)
pq.write_table(t, d + "/good.parquet", compression="none", row_group_size=100, write_page_checksum=True)
with pa.OSFile(d + "/good.arrow", "wb") as f:
    with pa.ipc.new_stream(f, t.schema) as w:
        for b in t.to_batches(max_chunksize=50):
            w.write_batch(b)
)", "'" + dir.path().string() + "'");
  const std::string good = read_bytes(dir.path() / "good.parquet");
  ASSERT_GT(good.size(), 10000u);
  EXPECT_EQ(prepare((dir.path() / "good.parquet").string(), dir.path() / "ok").report.read.samples, 400);
  // Cut short: the footer is gone.
  const fs::path cut = dir.write("cut.parquet", good.substr(0, good.size() * 6 / 10));
  expect_refused(cut.string(), dir.path() / "o1", cut.string().c_str(), "not a readable Parquet file",
                 "fetch it again");
  // A byte flipped in the data of a late row group: its page checksum fails after earlier rows were read.
  std::string flipped = good;
  flipped[good.size() * 7 / 10] ^= 0x5A;
  const fs::path bad = dir.write("flipped.parquet", flipped);
  expect_refused(bad.string(), dir.path() / "o2", bad.string().c_str(), "corrupt", "nothing of it was used");
  // An Arrow stream cut at a batch boundary (its end-of-stream marker gone) or in the middle.
  const std::string stream = read_bytes(dir.path() / "good.arrow");
  const fs::path no_end = dir.write("no_end.arrow", stream.substr(0, stream.size() - 8));
  expect_refused(no_end.string(), dir.path() / "o3", no_end.string().c_str(), "end-of-stream marker", "cut short");
  const fs::path half = dir.write("half.arrow", stream.substr(0, stream.size() / 2));
  expect_refused(half.string(), dir.path() / "o4", half.string().c_str(), "cut short");
}

TEST(Parquet, ARowWithoutJsonFormIsABadSampleWithItsRowAndColumn) {
  REQUIRE_PARQUET();
  ScratchDir dir;
  python(dir, R"(
rows = [{"input_ids": [11, 12], "loss_scale": [1.0, 1.0]}, {"input_ids": [13, 14], "loss_scale": [1.0, float("nan")]},
        {"input_ids": [15, 16], "loss_scale": [0.5, 1.0]}]
pq.write_table(table(rows), sys.argv[1] + "/nan.parquet")
)", "'" + dir.path().string() + "'");
  const std::string file = (dir.path() / "nan.parquet").string();
  expect_refused(file, dir.path() / "o1", (file + " row 1: column loss_scale[1] holds NaN").c_str(),
                 "--skip-bad-samples");
  const Prepared skipped = prepare(file, dir.path() / "o2", /*skip_bad=*/true);
  EXPECT_EQ(skipped.report.read.samples, 2);
  EXPECT_EQ(skipped.report.read.skipped, 1);
  EXPECT_NE(skipped.report.read.summary().find("row 1"), std::string::npos) << skipped.report.read.summary();
}

TEST(Parquet, AReaderThatCannotLoadIsAMessageWithTheFix) {
  // Runs with or without pyarrow: only the plugin's loading is probed.
  ScratchDir dir;
  const fs::path not_a_library = dir.write("libspindle_arrow.so", "not an ELF file");
  const TableSupport missing = probe_table_plugin({dir.path() / "absent.so"});
  EXPECT_FALSE(missing.loaded);
  if (!missing.built) {
    EXPECT_NE(missing.problem.find("built without Parquet and Arrow support"), std::string::npos) << missing.problem;
    EXPECT_NE(missing.problem.find("python3 -m pip install pyarrow"), std::string::npos) << missing.problem;
    return;
  }
  EXPECT_NE(missing.problem.find("absent.so does not exist"), std::string::npos) << missing.problem;
  EXPECT_NE(missing.problem.find("python3 -m pip install pyarrow=="), std::string::npos) << missing.problem;
  EXPECT_NE(missing.problem.find("rebuild spindle (`make`)"), std::string::npos) << missing.problem;
  const TableSupport broken = probe_table_plugin({not_a_library});
  EXPECT_FALSE(broken.loaded);
  EXPECT_NE(broken.problem.find("cannot be loaded"), std::string::npos) << broken.problem;
  EXPECT_NE(broken.problem.find(not_a_library.string()), std::string::npos) << broken.problem;  // dlerror names it
  EXPECT_TRUE(table_support().loaded) << "probing leaves the plugin in use alone";
}
