#include "data/table_reader.h"

#include <dlfcn.h>
#include <unistd.h>

#include <vector>

#include "core/error.h"

namespace spindle {

namespace fs = std::filesystem;

namespace {

#ifdef SPINDLE_HAVE_ARROW
constexpr bool kBuilt = true;
constexpr const char* kBuiltAgainst = "pyarrow " SPINDLE_PYARROW_VERSION " (libarrow.so." SPINDLE_ARROW_SO_VERSION
                                      ", libparquet.so." SPINDLE_ARROW_SO_VERSION ") in " SPINDLE_PYARROW_DIR;
constexpr const char* kBuildTreePlugin = SPINDLE_ARROW_PLUGIN_PATH;
#else
#ifndef SPINDLE_ARROW_ABSENT
#define SPINDLE_ARROW_ABSENT "its build found no pyarrow"
#endif
constexpr bool kBuilt = false;
constexpr const char* kBuiltAgainst = "";
constexpr const char* kBuildTreePlugin = "";
#endif
constexpr const char* kPluginFile = "libspindle_arrow.so";

// Where the plugin may be: beside the executable (an installed or packaged spindle), then where
// this build wrote it.
std::vector<fs::path> plugin_candidates() {
  std::vector<fs::path> out;
  std::error_code error;
  const fs::path exe = fs::read_symlink("/proc/self/exe", error);
  if (!error) out.push_back(exe.parent_path() / kPluginFile);
  if (*kBuildTreePlugin) out.push_back(kBuildTreePlugin);
  return out;
}

struct Loaded {
  TableSupport support;
  const table::Plugin* plugin = nullptr;
};

Loaded load(const std::vector<fs::path>& candidates) {
  Loaded out;
  out.support.built = kBuilt;
  out.support.built_against = kBuiltAgainst;
  if (!kBuilt) {
#ifndef SPINDLE_HAVE_ARROW
    out.support.problem =
        "this spindle was built without Parquet and Arrow support (" SPINDLE_ARROW_ABSENT "). Apache Arrow's C++ "
        "libraries come with pyarrow's wheel (Debian packages none): install it (`python3 -m pip install pyarrow`) "
        "and rebuild (`make`), or give the data as JSONL";
#endif
    return out;
  }
  std::string errors;
  for (const fs::path& candidate : candidates) {
    std::error_code error;
    if (!fs::exists(candidate, error)) {
      out.support.plugin = candidate.string();
      errors += (errors.empty() ? "" : "; ") + candidate.string() + " does not exist";
      continue;
    }
    out.support.plugin = candidate.string();
    void* handle = ::dlopen(candidate.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      errors += (errors.empty() ? "" : "; ") + std::string(::dlerror());
      continue;
    }
    auto entry = reinterpret_cast<table::PluginEntry>(::dlsym(handle, table::kPluginSymbol));
    const table::Plugin* plugin = entry ? entry() : nullptr;
    if (!plugin || plugin->abi != table::kPluginAbi) {
      errors += (errors.empty() ? "" : "; ") + candidate.string() + " is from another spindle build";
      ::dlclose(handle);
      continue;
    }
    out.plugin = plugin;  // never unloaded: Arrow keeps global state
    out.support.loaded = true;
    out.support.arrow_version = plugin->arrow_version;
    return out;
  }
  out.support.problem = fmt::format(
      "spindle's Arrow reader cannot be loaded ({}). It was built against {}: if pyarrow was upgraded or removed since, "
      "reinstall that version (`python3 -m pip install pyarrow=={}`) or rebuild spindle (`make`) against the one "
      "installed now",
      errors, kBuilt ? kBuiltAgainst : "an unknown pyarrow",
#ifdef SPINDLE_HAVE_ARROW
      SPINDLE_PYARROW_VERSION
#else
      "VERSION"
#endif
  );
  return out;
}

const Loaded& loaded() {
  static const Loaded instance = load(plugin_candidates());
  return instance;
}

}  // namespace

TableSupport table_support() { return loaded().support; }

TableSupport probe_table_plugin(const std::vector<fs::path>& candidates) { return load(candidates).support; }

std::unique_ptr<table::TableFile> open_table_file(const fs::path& path, table::TableFormat format) {
  const Loaded& plugin = loaded();
  const char* kind = format == table::TableFormat::kParquet ? "Parquet" : "Arrow";
  if (!plugin.plugin) fail("{} is a {} file, and {}", path.string(), kind, plugin.support.problem);
  table::Status status;
  std::unique_ptr<table::TableFile> file = plugin.plugin->open(path, format, status);
  if (!file) {
    const char* redo = format == table::TableFormat::kParquet
                           ? "; if it came from the hub, fetch it again (huggingface-cli download)"
                           : "";
    fail("{}: {}{}", path.string(), status.message, redo);
  }
  return file;
}

}  // namespace spindle
