// Parquet files and Arrow IPC files read row by row, each row as the JSON object the same sample
// would be as a JSONL line, so every sample format (sample_formats.h) reads them unchanged.
//
// The reading is done by Apache Arrow's C++ library. It is not linked into spindle: it lives in a
// plugin, libspindle_arrow.so (arrow_plugin.cpp), built when the build finds pyarrow (its wheel
// ships libarrow and libparquet with their headers; Debian has no Arrow) and loaded the first time
// a Parquet or Arrow file is read. So spindle starts, and reads JSONL, whatever happens to pyarrow
// after the build; only reading a table needs the plugin, and its absence is a message saying how
// to get it. Both sides are built by the same compiler in the same build: the interface below is
// plain C++, but nothing but std::bad_alloc crosses it as an exception (errors are statuses).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace spindle::table {

enum class TableFormat {
  kParquet,   // .parquet
  kArrowIpc,  // .arrow: an IPC stream (what `datasets` writes) or an IPC file ("ARROW1" magic)
};

struct Column {
  std::string name;
  std::string type;  // Arrow's spelling: "list<element: struct<role: string, content: string>>"
};

struct Status {
  enum Code {
    kOk,
    kEnd,        // next(): no more rows (the file was read whole and its row count checked)
    kBadRow,     // next(): this row has a value JSON cannot hold; the row is consumed, reading goes on
    kFileError,  // the file cannot be read (corrupt, truncated, a column of the wrong type): stop
  };
  Code code = kOk;
  std::string message;  // for kBadRow and kFileError: what is wrong, naming the column (not the file)
};

// One open file. Rows come in file order.
class TableFile {
 public:
  virtual ~TableFile() = default;
  // Every top-level column of the file, in schema order.
  virtual const std::vector<Column>& columns() const = 0;
  // The row count the file's metadata states (Parquet footer, IPC file footer); -1 for an IPC
  // stream, which states none.
  virtual int64_t rows_in_metadata() const = 0;
  // Reads only these top-level columns (by name, each present; the others are never decoded) and
  // checks that their types have a JSON form: strings, integers, floating point, booleans, lists,
  // structs and maps with string keys, nested in any way (a dictionary-encoded column is decoded).
  virtual Status select(const std::vector<std::string>& names) = 0;
  // The next row as a JSON object of the selected columns, in schema order. A null value is left
  // out (a struct field too): Parquet cannot leave a field out of one row, and `datasets` stores
  // the fields one row lacks as nulls, so null reads as absent, as the sample formats treat it.
  virtual Status next(nlohmann::ordered_json& row) = 0;
};

// What the plugin exports as `spindle_table_plugin` (extern "C").
struct Plugin {
  int abi;                     // kPluginAbi of the build that made it
  const char* arrow_version;   // "26.0.1"
  std::unique_ptr<TableFile> (*open)(const std::filesystem::path& path, TableFormat format, Status& status);
};
inline constexpr int kPluginAbi = 1;
inline constexpr const char* kPluginSymbol = "spindle_table_plugin";
using PluginEntry = const Plugin* (*)();

}  // namespace spindle::table
