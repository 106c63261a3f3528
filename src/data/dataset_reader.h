// The samples of a dataset (dataset_files.h) in file order, whatever the files: a JSONL line's text,
// or a Parquet/Arrow row as the JSON object that line would hold. Bad samples are reported with
// their file and line or row, or counted and skipped (ReadOptions), as jsonl_reader.h does; a
// problem of a file (corrupt, truncated, wrong columns) always stops the read with an Error naming
// the file and column, so nothing trains on part of a file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "data/dataset_files.h"
#include "data/jsonl_reader.h"

namespace spindle {

struct RawSample {
  std::string_view line;                        // JSONL: the line's text
  const nlohmann::ordered_json* row = nullptr;  // Parquet/Arrow: the row (null values left out)
  const std::filesystem::path* file = nullptr;
  int64_t index = 0;  // JSONL: line number from 1; table: row number from 0, as `datasets` counts them

  std::string location() const;  // "a.jsonl:7", "train-00000-of-00002.parquet row 6"
};

// Calls handle(sample) for every sample. handle may throw BadSample (counted or fatal per options);
// other exceptions propagate. Throws Error for a table without a column that selects a sample
// format, an empty split, or a row count other than the one `datasets` recorded.
void for_each_sample(const DatasetFiles& data, const ReadOptions& options, ReadStats& stats,
                     const std::function<void(const RawSample&)>& handle);

// A --data value (without :WEIGHT) checked before any work starts: a prepared dataset (the folder
// `spindle prepare` wrote, or its .bin), or a dataset that resolves (dataset_files.h) to files this
// spindle can read: a Parquet or Arrow one needs the Arrow plugin, and each of its files must open
// and have a column that selects a sample format (only footers and schemas are read). Throws Error
// naming `option`.
void check_data_value(const std::string& value, std::string_view option = "--data");

}  // namespace spindle
