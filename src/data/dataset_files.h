// What a --data value names: the files of one dataset split, found where users keep them.
//
//   FILE                      a JSONL, Parquet or Arrow file (told apart by content, not extension)
//   FOLDER[[:CONFIG]:SPLIT]   the files of one split of a folder of shards (a local copy of a hub
//                             dataset, `datasets`' save_to_disk output, or plain shards)
//   ORG/NAME[@REV][[:CONFIG]:SPLIT]
//                             a dataset in the local Hugging Face caches: the hub cache's snapshot
//                             (huggingface_hub's layout, as `huggingface-cli download --repo-type
//                             dataset` leaves it), else the Arrow files `datasets` prepared under
//                             HF_DATASETS_CACHE. spindle never downloads.
//
// SPLIT defaults to "train". In a folder or snapshot the files map to splits as `datasets` maps
// them (its data_files.py): the `configs` of README.md's YAML header first, else the shard names
// data/SPLIT-00000-of-00002.*, else a folder or file name holding train/validation/test (or their
// synonyms), else every file is "train". Layouts these rules leave ambiguous (one split's files in
// several folders that look like configurations, several `datasets` cache versions of one dataset,
// Parquet and JSONL in one split) are refused with the choices, never merged silently. So are
// incomplete downloads: a sharded split missing one of its -0000K-of-0000N shards.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace spindle {

enum class DataFileFormat { kJsonl, kParquet, kArrow };
std::string_view data_file_format_name(DataFileFormat format);  // "JSONL", "Parquet", "Arrow"

struct DatasetFiles {
  std::string given;  // the --data value as written (without :WEIGHT)
  DataFileFormat format = DataFileFormat::kJsonl;
  std::vector<std::filesystem::path> files;  // read in this order
  std::string split;                          // empty for a single file
  std::string place;                          // where the files were found, for people
  // The row count `datasets` recorded for this split (dataset_info.json of its Arrow cache): the
  // rows read must match it.
  std::optional<int64_t> expected_rows;

  bool is_table() const { return format != DataFileFormat::kJsonl; }
  // "ORG/NAME split 'train': 2 Parquet files in the hub cache (/root/.cache/.../snapshots/abc)";
  // a single file is its path.
  std::string describe() const;
};

// Resolves one --data value (without :WEIGHT). Throws spindle::Error with what to do when it names
// nothing, a dataset missing from the caches (with the `huggingface-cli download` command), a
// missing split (with the splits there are) or an ambiguous layout. `option` names the flag in
// messages. Does not need the Arrow library: files are listed and told apart, not read.
DatasetFiles resolve_dataset(const std::string& value, std::string_view option = "--data");

// Where `datasets` keeps its Arrow cache: $HF_DATASETS_CACHE, else $HF_HOME/datasets, else
// $XDG_CACHE_HOME/huggingface/datasets, else ~/.cache/huggingface/datasets.
struct DatasetsCacheLocation {
  std::filesystem::path path;
  std::string source;  // "$HF_DATASETS_CACHE", "$HF_HOME/datasets", ...
};
DatasetsCacheLocation datasets_cache_location();

// The splits of a repository's files (paths relative to its root, '/'-separated) by `datasets`'
// default rules, without README configs; splits in `datasets`' order (train, validation, test, then
// the others by name), each with its files sorted. `rule` says which rule matched. Exposed for tests.
struct SplitFiles {
  struct Split {
    std::string name;
    std::vector<std::string> files;
    // The folders above the part of each path that names the split ("en" for en/train/x.parquet):
    // several of them look like configurations, which the caller refuses to merge.
    std::vector<std::string> folders;
  };
  std::vector<Split> splits;
  std::string rule;
};
SplitFiles infer_splits(const std::vector<std::string>& relative_paths);

// Glob matching as `datasets` resolves data_files patterns: '*' and '?' within one path component,
// [...] classes, and '**' as a whole component for any number of components. Exposed for tests.
bool glob_match(std::string_view pattern, std::string_view path);

}  // namespace spindle
