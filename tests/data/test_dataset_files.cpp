// What --data names: files, folders of shards and their splits, and datasets in the Hugging Face
// caches (hub snapshots and `datasets`' Arrow cache), mapped to splits as `datasets` maps them,
// with the errors for what is missing or ambiguous. Only listing here: no file is read (the
// Parquet contents are placeholders), so none of this needs Arrow.
#include <gtest/gtest.h>

#include "core/error.h"
#include "data/dataset_files.h"
#include "dataset_test_util.h"

using namespace spindle;
using spindle::testing::CacheEnvironment;
using spindle::testing::ScratchDir;
namespace fs = std::filesystem;

namespace {

std::vector<std::string> names(const DatasetFiles& data, const fs::path& root) {
  std::vector<std::string> out;
  for (const fs::path& f : data.files) out.push_back(f.lexically_relative(root).generic_string());
  return out;
}

std::vector<std::string> split_names(const SplitFiles& s) {
  std::vector<std::string> out;
  for (const auto& split : s.splits) out.push_back(split.name);
  return out;
}

const std::vector<std::string>& files_of(const SplitFiles& s, const std::string& split) {
  for (const auto& x : s.splits)
    if (x.name == split) return x.files;
  static const std::vector<std::string> none;
  return none;
}

// A folder of files (placeholder contents) under a scratch directory.
fs::path make_folder(const ScratchDir& dir, const std::string& name, const std::vector<std::string>& files,
                     const std::string& content = "{\"text\": \"x\"}\n") {
  const fs::path root = dir.path() / name;
  for (const std::string& f : files) {
    fs::create_directories((root / f).parent_path());
    std::ofstream(root / f) << content;
  }
  return root;
}

}  // namespace

TEST(GlobMatch, MatchesAsDatasetsResolvesPatterns) {
  EXPECT_TRUE(glob_match("data/train-*", "data/train-00000-of-00002.parquet"));
  EXPECT_FALSE(glob_match("data/train-*", "data/sub/train-0.parquet"));  // '*' stays in one component
  EXPECT_TRUE(glob_match("**/*.parquet", "a/b/c.parquet"));
  EXPECT_TRUE(glob_match("**/*.parquet", "c.parquet"));  // '**' is zero or more components
  EXPECT_TRUE(glob_match("data/**", "data/x/y.jsonl"));
  EXPECT_TRUE(glob_match("train-[0-9][0-9].jsonl", "train-07.jsonl"));
  EXPECT_FALSE(glob_match("train-[!0-9]*.jsonl", "train-07.jsonl"));
  EXPECT_TRUE(glob_match("t?st.json", "test.json"));
  EXPECT_TRUE(glob_match("exact/path.parquet", "exact/path.parquet"));
  EXPECT_FALSE(glob_match("exact/path.parquet", "exact/path.parquet2"));
}

TEST(InferSplits, ShardNamesUnderDataComeFirstWithAnySplitName) {
  const SplitFiles s = infer_splits({"data/train_sft-00000-of-00002.parquet", "data/train_sft-00001-of-00002.parquet",
                                     "data/test_sft-00000-of-00001.parquet", "data/test-00000-of-00001.parquet",
                                     "train/other.parquet"});
  EXPECT_EQ(split_names(s), (std::vector<std::string>{"test", "test_sft", "train_sft"}));
  EXPECT_EQ(files_of(s, "train_sft").size(), 2u);
  EXPECT_NE(s.rule.find("shard names"), std::string::npos);
}

TEST(InferSplits, FolderNamesThenFileNamesThenEverythingIsTrain) {
  SplitFiles s = infer_splits({"data/train/a.parquet", "data/train/b.parquet", "data/valid/c.parquet",
                               "data/test/d.parquet", "data/evaluation_set/e.parquet"});
  EXPECT_EQ(split_names(s), (std::vector<std::string>{"train", "validation", "test"}));
  EXPECT_EQ(files_of(s, "train"), (std::vector<std::string>{"data/train/a.parquet", "data/train/b.parquet"}));
  EXPECT_EQ(files_of(s, "test"), (std::vector<std::string>{"data/evaluation_set/e.parquet", "data/test/d.parquet"}));

  s = infer_splits({"train.jsonl", "my_test_file.jsonl", "dev-0.jsonl", "contest.jsonl"});
  EXPECT_EQ(split_names(s), (std::vector<std::string>{"train", "validation", "test"}));
  EXPECT_EQ(files_of(s, "test"), (std::vector<std::string>{"my_test_file.jsonl"}));  // "contest" names no split

  s = infer_splits({"shards/part-0.parquet", "shards/part-1.parquet"});
  EXPECT_EQ(split_names(s), (std::vector<std::string>{"train"}));
  EXPECT_EQ(files_of(s, "train").size(), 2u);
}

TEST(ResolveDataset, AFileIsItselfAndItsFormatComesFromItsBytes) {
  ScratchDir dir;
  const fs::path jsonl = dir.write("a.jsonl", "{\"text\": \"x\"}\n");
  const fs::path parquet = dir.write("table.bin2", "PAR1....PAR1");
  const fs::path stream = dir.write("s.arrow", std::string("\xFF\xFF\xFF\xFF", 4) + "rest");
  DatasetFiles d = resolve_dataset(jsonl.string());
  EXPECT_EQ(d.format, DataFileFormat::kJsonl);
  EXPECT_EQ(d.files, std::vector<fs::path>{jsonl});
  EXPECT_TRUE(d.split.empty());
  EXPECT_EQ(resolve_dataset(parquet.string()).format, DataFileFormat::kParquet);
  EXPECT_EQ(resolve_dataset(stream.string()).format, DataFileFormat::kArrow);
  EXPECT_THROW_WITH(resolve_dataset(jsonl.string() + ":test"), Error, "is one file", "a split");
  EXPECT_THROW_WITH(resolve_dataset((dir.path() / "missing.jsonl").string()), Error, "missing.jsonl does not exist");
}

TEST(ResolveDataset, AFolderOfShardsAndItsSplits) {
  ScratchDir dir;
  const fs::path root = make_folder(dir, "ds", {"data/train-00000-of-00002.parquet", "data/train-00001-of-00002.parquet",
                                                "data/test-00000-of-00001.parquet", "README.md", ".hidden/x.parquet"},
                                    "PAR1");
  DatasetFiles d = resolve_dataset(root.string());
  EXPECT_EQ(d.format, DataFileFormat::kParquet);
  EXPECT_EQ(d.split, "train");
  EXPECT_EQ(names(d, root), (std::vector<std::string>{"data/train-00000-of-00002.parquet",
                                                      "data/train-00001-of-00002.parquet"}));
  EXPECT_NE(d.describe().find("split 'train': 2 Parquet files"), std::string::npos) << d.describe();
  d = resolve_dataset(root.string() + ":test");
  EXPECT_EQ(names(d, root), (std::vector<std::string>{"data/test-00000-of-00001.parquet"}));
  EXPECT_THROW_WITH(resolve_dataset(root.string() + ":validation"), Error, "no split 'validation'",
                    "its splits (from shard names data/SPLIT-0000K-of-0000N): train, test", ":train");
  // A plain folder of shards: every file is train.
  const fs::path plain = make_folder(dir, "plain", {"part-0.jsonl", "part-1.jsonl", "notes.md"});
  d = resolve_dataset(plain.string());
  EXPECT_EQ(d.format, DataFileFormat::kJsonl);
  EXPECT_EQ(names(d, plain), (std::vector<std::string>{"part-0.jsonl", "part-1.jsonl"}));
}

TEST(ResolveDataset, RefusesMissingShardsMixedFormatsAndUnreadableFiles) {
  ScratchDir dir;
  const fs::path gap = make_folder(dir, "gap", {"data/train-00000-of-00003.parquet", "data/train-00002-of-00003.parquet"},
                                   "PAR1");
  EXPECT_THROW_WITH(resolve_dataset(gap.string()), Error, "is incomplete",
                    "data/train-00001-of-00003.parquet is missing", "2 of its 3 shards");
  const fs::path mixed = make_folder(dir, "mixed", {"train/a.parquet", "train/b.jsonl"});
  EXPECT_THROW_WITH(resolve_dataset(mixed.string()), Error, "mixes file formats", "1 JSONL", "1 Parquet");
  const fs::path csv = make_folder(dir, "csv", {"train.csv", "test.csv"});
  EXPECT_THROW_WITH(resolve_dataset(csv.string()), Error, "holds no file spindle reads", ".csv",
                    "Parquet, Arrow and JSON Lines");
}

TEST(ResolveDataset, OneSplitInSeveralConfigurationFoldersIsRefusedUntilOneIsChosen) {
  ScratchDir dir;
  // The layout of the hub's Parquet conversion: CONFIG/SPLIT/0000.parquet.
  const fs::path root = make_folder(dir, "conv", {"en/train/0000.parquet", "en/test/0000.parquet",
                                                  "fr/train/0000.parquet", "fr/train/0001.parquet"}, "PAR1");
  const std::string hint = root.string() + ":en:train";
  EXPECT_THROW_WITH(resolve_dataset(root.string()), Error, "several folders (en/, fr/)", "does not merge",
                    hint.c_str());
  DatasetFiles d = resolve_dataset(root.string() + ":fr:train");
  EXPECT_EQ(names(d, root), (std::vector<std::string>{"fr/train/0000.parquet", "fr/train/0001.parquet"}));
  d = resolve_dataset(root.string() + ":en:test");
  EXPECT_EQ(names(d, root), (std::vector<std::string>{"en/test/0000.parquet"}));
  EXPECT_THROW_WITH(resolve_dataset(root.string() + ":de:train"), Error, "no configuration 'de'", "en, fr");
}

TEST(ResolveDataset, ReadmeConfigurationsDecideAsInDatasets) {
  ScratchDir dir;
  const fs::path root = make_folder(dir, "cfg", {"main/train.jsonl", "main/test.jsonl", "extra/all-0.jsonl",
                                                 "extra/all-1.jsonl", "other.jsonl"});
  std::ofstream(root / "README.md") << "---\nlicense: mit\nconfigs:\n"
                                       "- config_name: main\n  default: true\n  data_files:\n"
                                       "  - split: train\n    path: main/train.jsonl\n"
                                       "  - split: test\n    path: \"main/test*\"\n"
                                       "- config_name: extra\n  data_files: \"extra/*.jsonl\"\n"
                                       "---\n# A dataset card\n";
  DatasetFiles d = resolve_dataset(root.string());
  EXPECT_EQ(names(d, root), (std::vector<std::string>{"main/train.jsonl"}));
  d = resolve_dataset(root.string() + ":test");
  EXPECT_EQ(names(d, root), (std::vector<std::string>{"main/test.jsonl"}));
  d = resolve_dataset(root.string() + ":extra:train");
  EXPECT_EQ(names(d, root), (std::vector<std::string>{"extra/all-0.jsonl", "extra/all-1.jsonl"}));
  EXPECT_THROW_WITH(resolve_dataset(root.string() + ":extra:test"), Error, "configuration 'extra' has no split 'test'");
  // Without a default, a choice is needed.
  std::ofstream(root / "README.md") << "---\nconfigs:\n- config_name: a\n  data_files: main/*.jsonl\n"
                                       "- config_name: b\n  data_files: extra/*.jsonl\n---\n";
  const std::string hint = root.string() + ":a:train";
  EXPECT_THROW_WITH(resolve_dataset(root.string()), Error, "several configurations and none is the default (a, b)",
                    hint.c_str());
  EXPECT_EQ(resolve_dataset(root.string() + ":b:train").files.size(), 2u);
}

TEST(ResolveDataset, HubIdsResolveInTheHubCacheSnapshot) {
  ScratchDir dir;
  CacheEnvironment env(dir.path() / "home");
  const fs::path cache = dir.path() / "hub";
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  const fs::path snapshot = spindle::testing::add_hub_dataset(
      cache, "Org", "Chat",
      {{"README.md", "# card"}, {"data/train-00000-of-00002.parquet", "PAR1 a"},
       {"data/train-00001-of-00002.parquet", "PAR1 b"}, {"data/test-00000-of-00001.parquet", "PAR1 c"}});
  DatasetFiles d = resolve_dataset("Org/Chat");
  EXPECT_EQ(d.format, DataFileFormat::kParquet);
  EXPECT_EQ(d.split, "train");
  EXPECT_EQ(names(d, snapshot), (std::vector<std::string>{"data/train-00000-of-00002.parquet",
                                                          "data/train-00001-of-00002.parquet"}));
  EXPECT_NE(d.describe().find("the hub cache (" + snapshot.string()), std::string::npos) << d.describe();
  EXPECT_EQ(names(resolve_dataset("Org/Chat:test"), snapshot),
            (std::vector<std::string>{"data/test-00000-of-00001.parquet"}));
  EXPECT_THROW_WITH(resolve_dataset("Org/Chat:dev"), Error, "Org/Chat has no split 'dev'", "train, test",
                    "Org/Chat:train");
  // HF_HOME/hub is the same cache.
  ::unsetenv("HF_HUB_CACHE");
  fs::create_directories(dir.path() / "hfhome");
  fs::rename(cache, dir.path() / "hfhome" / "hub");
  ::setenv("HF_HOME", (dir.path() / "hfhome").c_str(), 1);
  EXPECT_EQ(resolve_dataset("Org/Chat").files.size(), 2u);
}

TEST(ResolveDataset, AnIncompleteHubDownloadIsRefused) {
  ScratchDir dir;
  CacheEnvironment env(dir.path() / "home");
  const fs::path cache = dir.path() / "hub";
  ::setenv("HF_HUB_CACHE", cache.c_str(), 1);
  const fs::path snapshot = spindle::testing::add_hub_dataset(
      cache, "Org", "Big", {{"data/train-00000-of-00002.parquet", "PAR1 a"}, {"data/train-00001-of-00002.parquet", "b"}});
  EXPECT_EQ(resolve_dataset("Org/Big").files.size(), 2u);
  fs::remove(snapshot / "data" / "train-00001-of-00002.parquet");
  EXPECT_THROW_WITH(resolve_dataset("Org/Big"), Error, "train-00001-of-00002.parquet is missing",
                    "huggingface-cli download Org/Big --repo-type dataset");
}

TEST(ResolveDataset, ADatasetInNeitherCacheNamesTheDownloadCommand) {
  ScratchDir dir;
  CacheEnvironment env(dir.path() / "home");
  ::setenv("HF_HUB_CACHE", (dir.path() / "hub").c_str(), 1);
  ::setenv("HF_DATASETS_CACHE", (dir.path() / "ds").c_str(), 1);
  const std::string hub = (dir.path() / "hub").string(), datasets = (dir.path() / "ds").string();
  EXPECT_THROW_WITH(resolve_dataset("Org/Absent:test"), Error, "--data Org/Absent:test: no such file or folder",
                    "not in the local Hugging Face caches", hub.c_str(), "chosen by $HF_HUB_CACHE",
                    datasets.c_str(), "chosen by $HF_DATASETS_CACHE",
                    "spindle does not download", "`huggingface-cli download Org/Absent --repo-type dataset`");
  EXPECT_THROW_WITH(resolve_dataset("Org/Absent", "--eval-data"), Error, "--eval-data Org/Absent");
  // Not a hub id and not a path.
  EXPECT_THROW_WITH(resolve_dataset("nothing-here.jsonl"), Error, "--data nothing-here.jsonl does not exist");
}

TEST(ResolveDataset, TheDatasetsArrowCacheWhenTheHubCacheLacksTheDataset) {
  ScratchDir dir;
  CacheEnvironment env(dir.path() / "home");
  ::setenv("HF_HOME", (dir.path() / "hf").c_str(), 1);  // both caches under it
  EXPECT_EQ(datasets_cache_location().path, dir.path() / "hf" / "datasets");
  EXPECT_EQ(datasets_cache_location().source, "$HF_HOME/datasets");
  const fs::path prepared = dir.path() / "hf" / "datasets" / "Org___Chat" / "default" / "0.0.0" / "abc123";
  fs::create_directories(prepared);
  for (const char* f : {"chat-train-00000-of-00002.arrow", "chat-train-00001-of-00002.arrow", "chat-test.arrow",
                        "cache-0f1e2d3c4b5a6978.arrow"})
    std::ofstream(prepared / f) << "\xFF\xFF\xFF\xFF";
  std::ofstream(prepared / "dataset_info.json")
      << R"({"dataset_name": "chat", "splits": {"train": {"name": "train", "num_examples": 7}, "test": {"num_examples": 2}}})";
  fs::create_directories(prepared.parent_path() / "def456.incomplete");  // an interrupted preparation
  DatasetFiles d = resolve_dataset("Org/Chat");
  EXPECT_EQ(d.format, DataFileFormat::kArrow);
  EXPECT_EQ(names(d, prepared), (std::vector<std::string>{"chat-train-00000-of-00002.arrow",
                                                          "chat-train-00001-of-00002.arrow"}));
  EXPECT_EQ(d.expected_rows, 7);
  EXPECT_NE(d.describe().find("the datasets cache (" + prepared.string()), std::string::npos) << d.describe();
  d = resolve_dataset("Org/Chat:test");
  EXPECT_EQ(names(d, prepared), (std::vector<std::string>{"chat-test.arrow"}));
  EXPECT_EQ(d.expected_rows, 2);
  EXPECT_THROW_WITH(resolve_dataset("Org/Chat:validation"), Error, "no split 'validation'", "test, train");
  // A second complete preparation: which one is meant is not guessed.
  const fs::path second = prepared.parent_path() / "fed987";
  fs::create_directories(second);
  std::ofstream(second / "dataset_info.json") << "{}";
  EXPECT_THROW_WITH(resolve_dataset("Org/Chat"), Error, "several preparations", "abc123", "fed987",
                    "--data FOLDER:SPLIT");
  // ... and the folder itself can be given, with its split.
  d = resolve_dataset(prepared.string() + ":test");
  EXPECT_EQ(names(d, prepared), (std::vector<std::string>{"chat-test.arrow"}));
}
