// Opens Parquet and Arrow files through the Arrow plugin (table_file.h), loading it on first use.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "data/table_file.h"

namespace spindle {

// Whether this spindle reads Parquet and Arrow files, for `spindle doctor` and messages.
struct TableSupport {
  bool built = false;         // the build found pyarrow and made the plugin
  std::string built_against;  // "pyarrow 26.0.1 (libarrow.so.2600, libparquet.so.2600) in DIR"
  bool loaded = false;        // the plugin loaded (and with it libarrow and libparquet)
  std::string plugin;         // the plugin file loaded, or the last one tried
  std::string arrow_version;  // of the loaded library
  std::string problem;        // when not loaded: why, and what to do
};

// Loads the plugin if it is not loaded yet: the one beside the executable (an installed or packaged
// spindle), else the one this build made. Never throws.
TableSupport table_support();

// What loading the plugin from the first of `candidates` that loads would report (tests: the
// messages for a plugin that is missing or not a plugin). The plugin table_support() uses is not
// changed.
TableSupport probe_table_plugin(const std::vector<std::filesystem::path>& candidates);

// Opens `path` for reading; throws spindle::Error naming the file when the plugin is missing or the
// file cannot be opened.
std::unique_ptr<table::TableFile> open_table_file(const std::filesystem::path& path, table::TableFormat format);

}  // namespace spindle
