#include "data/dataset_reader.h"

#include <algorithm>
#include <fstream>
#include <system_error>

#include "data/prepared_dataset.h"
#include "data/sample_formats.h"
#include "data/table_reader.h"

namespace spindle {

namespace fs = std::filesystem;

namespace {

// A .json file may be one JSON array (the json builder of `datasets` reads both); spindle reads
// JSON Lines, so say so before the first line fails to parse as an object.
void refuse_json_array(const fs::path& file) {
  if (file.extension() != ".json") return;
  std::ifstream in(file, std::ios::binary);
  char c = 0;
  while (in.get(c) && (c == ' ' || c == '\n' || c == '\r' || c == '\t' || c == '\xEF' || c == '\xBB' || c == '\xBF')) {
  }
  if (in && c == '[')
    fail("{} holds one JSON array, not JSON Lines (one object per line); convert it, e.g. `jq -c '.[]' {} > {}l`",
         file.string(), file.string(), file.string());
}

table::TableFormat table_format(const DatasetFiles& data) {
  return data.format == DataFileFormat::kParquet ? table::TableFormat::kParquet : table::TableFormat::kArrowIpc;
}

// The columns of `table` a sample format reads; an Error naming the file and its columns when none
// of them selects a format.
std::vector<std::string> sample_columns(const fs::path& file, const table::TableFile& table) {
  std::vector<std::string> wanted, present;
  for (const table::Column& column : table.columns()) {
    present.push_back(column.name);
    const auto& fields = sample_fields();
    if (std::find(fields.begin(), fields.end(), column.name) != fields.end()) wanted.push_back(column.name);
  }
  const auto& selecting = format_selecting_fields();
  if (std::none_of(wanted.begin(), wanted.end(), [&](const std::string& name) {
        return std::find(selecting.begin(), selecting.end(), name) != selecting.end();
      })) {
    std::string names;
    for (const std::string& name : present) names += (names.empty() ? "" : ", ") + name;
    fail("{}: no column selects a sample format (its columns: {}); spindle reads the columns of the JSONL formats: "
         "input_ids, messages, conversations, instruction with output, prompt with completion or response, text, or "
         "chosen with rejected (docs/formats.md). Rename the column that holds the samples",
         file.string(), names.empty() ? "none" : names);
  }
  return wanted;
}

void read_table(const DatasetFiles& data, const fs::path& file, const ReadOptions& options, ReadStats& stats,
                int64_t& rows, const std::function<void(const RawSample&)>& handle) {
  std::unique_ptr<table::TableFile> table = open_table_file(file, table_format(data));
  table::Status status = table->select(sample_columns(file, *table));
  if (status.code != table::Status::kOk) fail("{}: {}", file.string(), status.message);
  nlohmann::ordered_json row;
  for (int64_t index = 0;; ++index) {
    status = table->next(row);
    if (status.code == table::Status::kEnd) break;
    if (status.code == table::Status::kFileError)
      fail("{}: {}; nothing of it was used", file.string(), status.message);
    ++rows;
    ++stats.rows;
    const RawSample sample{{}, &row, &file, index};
    try {
      if (status.code == table::Status::kBadRow) throw BadSample(status.message);
      handle(sample);
      ++stats.samples;
    } catch (const BadSample& e) {
      std::string reason = fmt::format("{}: {}", sample.location(), e.what());
      if (options.on_bad_sample == BadSamplePolicy::kFail)
        throw Error(reason + " (fix or remove the row, or skip bad samples with --skip-bad-samples)");
      stats.record_skip(std::move(reason));
    }
  }
  std::error_code error;
  const auto bytes = fs::file_size(file, error);
  if (!error) stats.bytes += static_cast<int64_t>(bytes);
}

}  // namespace

std::string RawSample::location() const {
  const std::string name = file ? file->string() : "?";
  return row ? fmt::format("{} row {}", name, index) : fmt::format("{}:{}", name, index);
}

void for_each_sample(const DatasetFiles& data, const ReadOptions& options, ReadStats& stats,
                     const std::function<void(const RawSample&)>& handle) {
  if (!data.is_table()) {
    for (const fs::path& file : data.files) {
      refuse_json_array(file);
      for_each_jsonl_line(file, options, stats, [&](std::string_view line, int64_t number) {
        handle(RawSample{line, nullptr, &file, number});
      });
    }
    return;
  }
  int64_t rows = 0;
  for (const fs::path& file : data.files) read_table(data, file, options, stats, rows, handle);
  if (rows == 0) fail("{} holds no rows: the split is empty", data.describe());
  if (data.expected_rows && rows != *data.expected_rows)
    fail("{}: read {} rows but `datasets` recorded {} for this split in its dataset_info.json; the cache is incomplete "
         "or was changed: prepare it again (load_dataset with download_mode=\"force_redownload\")",
         data.describe(), with_thousands(rows), with_thousands(*data.expected_rows));
}

void check_data_value(const std::string& value, std::string_view option) {
  std::error_code error;
  const fs::path path = value;
  if ((fs::is_directory(path, error) && fs::exists(path / kPreparedDataFile, error)) ||
      (path.extension() == ".bin" && fs::is_regular_file(path, error)))
    return;
  const DatasetFiles data = resolve_dataset(value, option);
  if (!data.is_table()) return;
  const TableSupport support = table_support();
  if (!support.loaded)
    fail("{} {}: {} {} {}, and {}", option, value, data.describe(), data.split.empty() ? "is a" : "holds",
         data.split.empty() ? fmt::format("{} file", data_file_format_name(data.format))
                            : fmt::format("{} files", data_file_format_name(data.format)),
         support.problem);
  // Each file opens (its footer or schema: cheap) and has a column that selects a sample format, so
  // a wrong file stops the run before any work rather than after the others were tokenized.
  for (const fs::path& file : data.files) sample_columns(file, *open_table_file(file, table_format(data)));
}

}  // namespace spindle
