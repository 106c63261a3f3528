#include "data/dataset_files.h"

#include <pwd.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/hub_cache.h"

namespace spindle {

namespace fs = std::filesystem;

namespace {

// ---- the environment -------------------------------------------------------------------------

std::string environment(const char* name) {
  const char* value = std::getenv(name);
  return value ? std::string(value) : std::string();
}

fs::path expand_user(const std::string& path) {
  if (path == "~" || path.starts_with("~/")) {
    std::string home = environment("HOME");
    if (home.empty())
      if (const passwd* entry = ::getpwuid(::getuid())) home = entry->pw_dir;
    return fs::path(home + path.substr(1));
  }
  return fs::path(path);
}

std::string plural(size_t n, const char* one, const char* many) {
  return fmt::format("{} {}", n, n == 1 ? one : many);
}

std::string joined(const std::vector<std::string>& items, const char* separator = ", ") {
  std::string out;
  for (const std::string& item : items) out += (out.empty() ? "" : separator) + item;
  return out;
}

// ---- kinds of files --------------------------------------------------------------------------

// Files `datasets` never takes as data (its FILES_TO_IGNORE, plus save_to_disk's state.json).
const std::set<std::string> kIgnoredNames = {"README.md", "config.json", "dataset_info.json", "dataset_infos.json",
                                             "dataset_dict.json", "state.json", "dummy_data.zip"};

enum class FileKind { kReadable, kOtherData, kNotData };

struct Classified {
  FileKind kind = FileKind::kNotData;
  DataFileFormat format = DataFileFormat::kJsonl;
};

std::string lower(std::string s) {
  for (char& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

// By extension, as `datasets` picks a builder: .parquet, .arrow and JSON Lines (.jsonl, and .json,
// which hub datasets use for JSON Lines too) are read; other data formats (CSV, text, compressed
// files) are recognised so that a split holding only them gets a message rather than "no files".
Classified classify(const std::string& relative) {
  const std::string name = lower(fs::path(relative).filename().string());
  if (kIgnoredNames.count(fs::path(relative).filename().string())) return {};
  auto ends = [&](const char* suffix) { return name.ends_with(suffix); };
  if (ends(".parquet")) return {FileKind::kReadable, DataFileFormat::kParquet};
  if (ends(".arrow")) return {FileKind::kReadable, DataFileFormat::kArrow};
  if (ends(".jsonl") || ends(".json") || ends(".ndjson")) return {FileKind::kReadable, DataFileFormat::kJsonl};
  for (const char* other : {".csv", ".tsv", ".txt", ".orc", ".avro", ".gz", ".zst", ".bz2", ".xz", ".lz4", ".zip",
                            ".tar", ".tgz", ".sql", ".xml"})
    if (ends(other)) return {FileKind::kOtherData, DataFileFormat::kJsonl};
  return {};
}

// A single file's format from its first bytes: Parquet starts with "PAR1", an Arrow IPC file with
// "ARROW1", an Arrow IPC stream with the continuation marker 0xFFFFFFFF; JSON Lines with none of them
// (0xFF is never UTF-8).
DataFileFormat sniff_format(const fs::path& file) {
  std::ifstream in(file, std::ios::binary);
  char head[6] = {};
  in.read(head, sizeof head);
  const std::string_view bytes(head, static_cast<size_t>(in.gcount()));
  if (bytes.starts_with("PAR1")) return DataFileFormat::kParquet;
  if (bytes.starts_with("ARROW1") || bytes.starts_with("\xFF\xFF\xFF\xFF")) return DataFileFormat::kArrow;
  return DataFileFormat::kJsonl;
}

// Every file under `root` (relative, '/'-separated, sorted), leaving out hidden files and folders
// and "__" folders as `datasets` does. Links are followed (hub snapshots are links into blobs/);
// a link whose target is gone is listed, and refused when chosen.
std::vector<std::string> list_files(const fs::path& root) {
  std::vector<std::string> files;
  std::error_code error;
  fs::recursive_directory_iterator it(root, fs::directory_options::follow_directory_symlink, error), end;
  if (error) fail("cannot list {}: {}", root.string(), error.message());
  for (; it != end; it.increment(error)) {
    if (error) fail("cannot list {}: {}", root.string(), error.message());
    const std::string name = it->path().filename().string();
    const bool hidden = name.starts_with(".");
    if (it->is_directory(error)) {
      if (hidden || name.starts_with("__")) it.disable_recursion_pending();
      continue;
    }
    if (hidden) continue;
    if (it->is_regular_file(error) || it->is_symlink(error))
      files.push_back(it->path().lexically_relative(root).generic_string());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::vector<std::string> components(std::string_view path) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start <= path.size()) {
    const size_t slash = path.find('/', start);
    const size_t stop = slash == std::string_view::npos ? path.size() : slash;
    if (stop > start) parts.emplace_back(path.substr(start, stop - start));
    if (slash == std::string_view::npos) break;
    start = slash + 1;
  }
  return parts;
}

// fnmatch within one component: '*', '?', [abc], [a-z], [!abc].
bool component_match(std::string_view pattern, std::string_view name) {
  size_t p = 0, n = 0, star_p = std::string_view::npos, star_n = 0;
  auto class_match = [&](size_t& at, char c) -> std::optional<bool> {  // at: on '['; nullopt: not a class
    size_t i = at + 1;
    bool negate = false;
    if (i < pattern.size() && (pattern[i] == '!' || pattern[i] == '^')) negate = true, ++i;
    bool matched = false, first = true;
    while (i < pattern.size() && (first || pattern[i] != ']')) {
      first = false;
      char lo = pattern[i], hi = lo;
      if (i + 2 < pattern.size() && pattern[i + 1] == '-' && pattern[i + 2] != ']') hi = pattern[i + 2], i += 2;
      matched |= lo <= c && c <= hi;
      ++i;
    }
    if (i >= pattern.size()) return std::nullopt;  // no closing ']': a literal '['
    at = i + 1;
    return matched != negate;
  };
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star_p = p++;
      star_n = n;
      continue;
    }
    if (p < pattern.size()) {
      if (pattern[p] == '?') {
        ++p, ++n;
        continue;
      }
      if (pattern[p] == '[') {
        size_t at = p;
        if (auto m = class_match(at, name[n])) {
          if (*m) {
            p = at, ++n;
            continue;
          }
        } else if (name[n] == '[') {
          ++p, ++n;
          continue;
        }
      } else if (pattern[p] == name[n]) {
        ++p, ++n;
        continue;
      }
    }
    if (star_p == std::string_view::npos) return false;
    p = star_p + 1;
    n = ++star_n;
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

bool glob_parts(const std::vector<std::string>& pattern, size_t p, const std::vector<std::string>& path, size_t n) {
  if (p == pattern.size()) return n == path.size();
  if (pattern[p] == "**") {
    for (size_t skip = n; skip <= path.size(); ++skip)
      if (glob_parts(pattern, p + 1, path, skip)) return true;
    return false;
  }
  return n < path.size() && component_match(pattern[p], path[n]) && glob_parts(pattern, p + 1, path, n + 1);
}

// ---- splits as `datasets` finds them ----------------------------------------------------------

const std::vector<std::pair<std::string, std::vector<std::string>>>& split_keywords() {
  static const std::vector<std::pair<std::string, std::vector<std::string>>> keywords = {
      {"train", {"train", "training"}},
      {"validation", {"validation", "valid", "dev", "val"}},
      {"test", {"test", "testing", "eval", "evaluation"}}};
  return keywords;
}

bool separator(char c) { return c == '-' || c == '.' || c == '_' || c == ' ' || (c >= '0' && c <= '9'); }

// `datasets`' patterns for a keyword in a folder name: the name is the keyword, starts with it and
// a separator, ends with a separator and it, or holds it between separators.
bool folder_names(std::string_view name, std::string_view keyword) {
  if (name == keyword) return true;
  if (name.size() > keyword.size() && name.starts_with(keyword) && separator(name[keyword.size()])) return true;
  for (size_t at = name.find(keyword, 1); at != std::string_view::npos; at = name.find(keyword, at + 1)) {
    if (!separator(name[at - 1])) continue;
    const size_t after = at + keyword.size();
    if (after == name.size() || separator(name[after])) return true;
  }
  return false;
}

// In a file name: it starts with the keyword and a separator, or holds it between separators.
bool file_names(std::string_view name, std::string_view keyword) {
  if (name.size() > keyword.size() && name.starts_with(keyword) && separator(name[keyword.size()])) return true;
  for (size_t at = name.find(keyword, 1); at != std::string_view::npos; at = name.find(keyword, at + 1)) {
    const size_t after = at + keyword.size();
    if (separator(name[at - 1]) && after < name.size() && separator(name[after])) return true;
  }
  return false;
}

bool valid_split_name(const std::string& name) {
  static const std::regex split_re(R"(^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*$)");
  return std::regex_match(name, split_re);
}

// train, validation, test first, then the other splits by name.
void order_splits(std::vector<SplitFiles::Split>& splits) {
  auto rank = [](const std::string& name) {
    const auto& keywords = split_keywords();
    for (size_t i = 0; i < keywords.size(); ++i)
      if (keywords[i].first == name) return static_cast<int>(i);
    return 99;
  };
  std::stable_sort(splits.begin(), splits.end(), [&](const auto& a, const auto& b) {
    return rank(a.name) != rank(b.name) ? rank(a.name) < rank(b.name) : a.name < b.name;
  });
}

// ---- README.md configs -----------------------------------------------------------------------

struct ReadmeConfig {
  std::string name;
  bool is_default = false;
  std::string data_dir;
  bool has_data_files = false;
  std::vector<std::pair<std::string, std::vector<std::string>>> data_files;  // split -> patterns
};

std::vector<std::string> string_list(const YAML::Node& node, const fs::path& readme, const std::string& where) {
  std::vector<std::string> out;
  if (node.IsScalar()) out.push_back(node.as<std::string>());
  else if (node.IsSequence())
    for (const auto& item : node) {
      if (!item.IsScalar()) fail("{}: {} must be a path pattern or a list of them", readme.string(), where);
      out.push_back(item.as<std::string>());
    }
  else fail("{}: {} must be a path pattern or a list of them", readme.string(), where);
  return out;
}

// The `configs` of the YAML block that opens a dataset card, as `datasets` reads them; empty when
// the card has none.
std::vector<ReadmeConfig> readme_configs(const fs::path& readme) {
  std::ifstream in(readme);
  if (!in) return {};
  std::string line, yaml;
  if (!std::getline(in, line) || (line != "---" && line != "---\r")) return {};
  bool closed = false;
  while (std::getline(in, line)) {
    if (line == "---" || line == "---\r") {
      closed = true;
      break;
    }
    yaml += line + "\n";
  }
  if (!closed) return {};
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const YAML::Exception& e) {
    fail("{}: its YAML header does not parse ({}), so its dataset configurations cannot be read", readme.string(),
         e.what());
  }
  std::vector<ReadmeConfig> configs;
  if (!root.IsMap() || !root["configs"]) return configs;
  const YAML::Node list = root["configs"];
  if (!list.IsSequence()) fail("{}: 'configs' must be a list", readme.string());
  try {
    for (const auto& entry : list) {
      ReadmeConfig c;
      c.name = entry["config_name"] ? entry["config_name"].as<std::string>() : "default";
      if (entry["default"]) c.is_default = entry["default"].as<bool>();
      if (entry["data_dir"]) c.data_dir = entry["data_dir"].as<std::string>();
      if (const YAML::Node files = entry["data_files"]) {
        c.has_data_files = true;
        const std::string where = "data_files of config '" + c.name + "'";
        if (files.IsMap()) {
          for (const auto& split : files) c.data_files.emplace_back(split.first.as<std::string>(),
                                                                   string_list(split.second, readme, where));
        } else if (files.IsSequence() && files.size() > 0 && files[0].IsMap()) {
          for (const auto& item : files) {
            if (!item.IsMap() || !item["split"] || !item["path"])
              fail("{}: each entry of {} needs a split and a path", readme.string(), where);
            c.data_files.emplace_back(item["split"].as<std::string>(), string_list(item["path"], readme, where));
          }
        } else {
          c.data_files.emplace_back("train", string_list(files, readme, where));
        }
      }
      configs.push_back(std::move(c));
    }
  } catch (const YAML::Exception& e) {
    fail("{}: its 'configs' cannot be read ({})", readme.string(), e.what());
  }
  return configs;
}

// `datasets`' default configuration: the only one, or the one named "default" or marked
// `default: true`; nullopt when there is none, an error when there are several.
std::optional<std::string> default_config(const std::vector<ReadmeConfig>& configs, const fs::path& readme) {
  std::optional<std::string> chosen;
  for (const ReadmeConfig& c : configs) {
    if (configs.size() == 1 || c.name == "default" || c.is_default) {
      if (chosen) fail("{} marks several configurations as the default ('{}' and '{}')", readme.string(), *chosen, c.name);
      chosen = c.name;
    }
  }
  return chosen;
}

// ---- one dataset folder: config, split, files ----------------------------------------------------

struct FolderRequest {
  fs::path root;
  std::string config;  // empty: the default
  std::string split;   // empty: train
  std::string name;    // how messages name the dataset ("ORG/NAME", "shards/")
  std::string syntax;  // how the user chooses ("ORG/NAME", "shards"), for "NAME:CONFIG:SPLIT" hints
  std::string download_hint;  // the command that fetches missing files again; empty for local folders
};

struct FolderChoice {
  std::string split;
  std::vector<std::string> files;  // relative to root
  std::string rule;
};

std::vector<std::string> data_files_under(const std::vector<std::string>& all, const std::string& base) {
  std::vector<std::string> out;
  const std::string prefix = base.empty() ? "" : base + "/";
  for (const std::string& f : all)
    if (f.starts_with(prefix) && classify(f).kind != FileKind::kNotData) out.push_back(f.substr(prefix.size()));
  return out;
}

std::string split_hint(const FolderRequest& request, const std::string& config, const std::string& split) {
  return config.empty() ? fmt::format("{}:{}", request.syntax, split)
                        : fmt::format("{}:{}:{}", request.syntax, config, split);
}

FolderChoice choose_split(const FolderRequest& request, const std::vector<SplitFiles::Split>& splits,
                          const std::string& rule, const std::string& config, const std::string& base) {
  const std::string wanted = request.split.empty() ? "train" : request.split;
  std::vector<std::string> names;
  for (const auto& s : splits) names.push_back(s.name);
  const auto it = std::find_if(splits.begin(), splits.end(), [&](const auto& s) { return s.name == wanted; });
  if (it == splits.end()) {
    if (names.empty())
      fail("{}{} holds no data files (Parquet, Arrow or JSON Lines)", request.name,
           config.empty() ? "" : " configuration '" + config + "'");
    fail("{}{} has no split '{}'{}; its splits ({}): {}. Choose one with {}", request.name,
         config.empty() ? "" : " configuration '" + config + "'", wanted,
         request.split.empty() ? " (the default)" : "", rule, joined(names), split_hint(request, config, names[0]));
  }
  if (it->folders.size() > 1) {
    std::vector<std::string> shown;
    for (const std::string& f : it->folders) shown.push_back(f.empty() ? "(top level)" : f + "/");
    const std::string first = it->folders[0].empty() ? it->folders[1] : it->folders[0];
    fail("{}: the files of split '{}' sit in several folders ({}), each of which looks like a configuration of the "
         "dataset; spindle does not merge them. Choose one with {}",
         request.name, wanted, joined(shown), split_hint(request, first, wanted));
  }
  FolderChoice choice{wanted, {}, rule};
  const std::string prefix = base.empty() ? "" : base + "/";
  for (const std::string& f : it->files) choice.files.push_back(prefix + f);
  return choice;
}

FolderChoice choose_folder_files(const FolderRequest& request) {
  const std::vector<std::string> all = list_files(request.root);
  const fs::path readme = request.root / "README.md";
  const std::vector<ReadmeConfig> configs = readme_configs(readme);
  if (!configs.empty()) {
    std::vector<std::string> names;
    for (const ReadmeConfig& c : configs) names.push_back(c.name);
    std::string wanted = request.config;
    if (wanted.empty()) {
      const std::optional<std::string> chosen = default_config(configs, readme);
      if (!chosen)
        fail("{} has several configurations and none is the default ({}): choose one with {}", request.name,
             joined(names), split_hint(request, names[0], request.split.empty() ? "train" : request.split));
      wanted = *chosen;
    }
    const auto it = std::find_if(configs.begin(), configs.end(), [&](const auto& c) { return c.name == wanted; });
    if (it == configs.end())
      fail("{} has no configuration '{}'; its README.md lists: {}", request.name, wanted, joined(names));
    const std::string base = it->data_dir;
    const std::vector<std::string> files = data_files_under(all, base);
    const std::string label = configs.size() > 1 || !request.config.empty() ? wanted : "";
    if (!it->has_data_files) {
      const SplitFiles inferred = infer_splits(files);
      return choose_split(request, inferred.splits, inferred.rule, label, base);
    }
    std::vector<SplitFiles::Split> splits;
    for (const auto& [split, patterns] : it->data_files) {
      SplitFiles::Split s{split, {}, {}};
      for (std::string pattern : patterns) {
        if (pattern.starts_with("./")) pattern.erase(0, 2);
        for (const std::string& f : files)
          if (glob_match(pattern, f) && std::find(s.files.begin(), s.files.end(), f) == s.files.end())
            s.files.push_back(f);
      }
      splits.push_back(std::move(s));
    }
    return choose_split(request, splits, "the data_files of README.md's configuration '" + wanted + "'", label, base);
  }
  std::string base;
  if (!request.config.empty()) {
    // No README configurations: a configuration is a folder (the layout of the hub's Parquet
    // conversion, CONFIG/SPLIT/0000.parquet).
    std::error_code error;
    if (!fs::is_directory(request.root / request.config, error)) {
      std::vector<std::string> folders;
      for (const auto& entry : fs::directory_iterator(request.root, error))
        if (entry.is_directory() && !entry.path().filename().string().starts_with("."))
          folders.push_back(entry.path().filename().string());
      std::sort(folders.begin(), folders.end());
      fail("{} has no configuration '{}': its README.md names no configurations and there is no folder {}/ ({})",
           request.name, request.config, request.config,
           folders.empty() ? "it has no folders" : "its folders: " + joined(folders));
    }
    base = request.config;
  }
  const SplitFiles inferred = infer_splits(data_files_under(all, base));
  return choose_split(request, inferred.splits, inferred.rule, request.config, base);
}

// Sharded names ("train-00001-of-00004.parquet"): every shard of the set must be there.
void check_shards(const std::string& name, const std::vector<std::string>& files, const std::string& download_hint) {
  static const std::regex shard(R"(^(.*)-([0-9]{5})-of-([0-9]{5})([^/]*)$)");
  std::map<std::tuple<std::string, int, std::string>, std::set<int>> sets;
  for (const std::string& f : files) {
    std::smatch m;
    if (std::regex_match(f, m, shard)) sets[{m[1].str(), std::stoi(m[3].str()), m[4].str()}].insert(std::stoi(m[2].str()));
  }
  for (const auto& [key, present] : sets) {
    const auto& [prefix, total, suffix] = key;
    for (int k = 0; k < total; ++k)
      if (!present.count(k))
        fail("{} is incomplete: {}-{:05d}-of-{:05d}{} is missing ({} of its {} shards are there){}", name, prefix, k,
             total, suffix, present.size(), total,
             download_hint.empty() ? "" : "; an interrupted download? Fetch it again with " + download_hint);
  }
}

DatasetFiles files_of(const std::string& given, const FolderRequest& request, const FolderChoice& choice,
                      const std::string& place) {
  DatasetFiles out;
  out.given = given;
  out.split = choice.split;
  out.place = place;
  std::map<DataFileFormat, int> readable;
  std::set<std::string> other;
  for (const std::string& f : choice.files) {
    const Classified c = classify(f);
    if (c.kind == FileKind::kReadable) ++readable[c.format];
    else if (c.kind == FileKind::kOtherData) other.insert(fs::path(f).extension().string());
  }
  const std::string what = fmt::format("{} split '{}'", request.name, choice.split);
  if (readable.empty())
    fail("{} holds no file spindle reads (only {} files); spindle reads Parquet, Arrow and JSON Lines (.jsonl, .json): "
         "convert the split, e.g. with `datasets`: load_dataset(...)[\"{}\"].to_parquet(\"{}.parquet\")",
         what, joined(std::vector<std::string>(other.begin(), other.end())), choice.split, choice.split);
  if (readable.size() > 1) {
    std::vector<std::string> kinds;
    for (const auto& [format, count] : readable)
      kinds.push_back(fmt::format("{} {}", count, data_file_format_name(format)));
    fail("{} mixes file formats ({}); spindle reads one format per dataset: pass the files of one format (a file or "
         "a folder of them)",
         what, joined(kinds));
  }
  out.format = readable.begin()->first;
  std::vector<std::string> chosen;
  for (const std::string& f : choice.files)
    if (classify(f).kind == FileKind::kReadable) chosen.push_back(f);
  check_shards(what, chosen, request.download_hint);
  for (const std::string& f : chosen) {
    const fs::path path = request.root / f;
    std::error_code error;
    if (!fs::exists(path, error))
      fail("{}: {} is a link to a file that is gone ({}){}", what, path.string(),
           fs::read_symlink(path, error).string(),
           request.download_hint.empty() ? "" : "; fetch the dataset again with " + request.download_hint);
    out.files.push_back(path);
  }
  return out;
}

// ---- the Hugging Face caches -----------------------------------------------------------------------

struct HubDatasetRef {
  io::HubModelId id;  // org, name, revision
  std::string config, split;
};

std::string download_command(const io::HubModelId& id) {
  return fmt::format("`huggingface-cli download {} --repo-type dataset{}`", id.repo_id(),
                     id.revision == "main" ? "" : " --revision " + id.revision);
}

std::string read_ref(const fs::path& path) {
  std::ifstream in(path);
  std::string commit;
  in >> commit;
  return commit;
}

// The snapshot folder of the revision in the hub cache; nullopt when the cache has no such
// dataset; an error when it has the dataset but not the revision.
std::optional<fs::path> hub_snapshot(const HubDatasetRef& ref, const io::HubCacheLocation& cache) {
  const fs::path repo = cache.path / ("datasets--" + ref.id.org + "--" + ref.id.name);
  std::error_code error;
  if (!fs::is_directory(repo, error)) return std::nullopt;
  const fs::path ref_file = repo / "refs" / ref.id.revision;
  const std::string commit = fs::is_regular_file(ref_file, error) ? read_ref(ref_file) : ref.id.revision;
  const fs::path snapshot = repo / "snapshots" / commit;
  if (!commit.empty() && commit.find('/') == std::string::npos && fs::is_directory(snapshot, error)) return snapshot;
  if (fs::is_regular_file(ref_file, error))
    fail("{} names commit '{}' but {} is missing (an interrupted download?); fetch it again with {}",
         ref_file.string(), commit, snapshot.string(), download_command(ref.id));
  fail("{} has no revision '{}' (neither refs/{} nor snapshots/{}); fetch it with {}", repo.string(), ref.id.revision,
       ref.id.revision, ref.id.revision, download_command(ref.id));
}

// "HuggingFaceH4" -> "hugging_face_h4", as `datasets` names builders (camelcase_to_snakecase).
std::string snake_case(const std::string& name) {
  static const std::regex upper_upper("([A-Z]+)([A-Z][a-z])"), lower_upper("([a-z0-9])([A-Z])");
  return lower(std::regex_replace(std::regex_replace(name, upper_upper, "$1_$2"), lower_upper, "$1_$2"));
}

// The folder `datasets` prepared the dataset in: ORG___NAME (older versions: lower or snake case).
std::optional<fs::path> datasets_cache_folder(const HubDatasetRef& ref, const fs::path& root) {
  std::error_code error;
  if (!fs::is_directory(root, error)) return std::nullopt;
  const std::set<std::string> names = {ref.id.org + "___" + ref.id.name, lower(ref.id.org + "___" + ref.id.name),
                                       snake_case(ref.id.org) + "___" + snake_case(ref.id.name)};
  for (const std::string& name : names)
    if (fs::is_directory(root / name, error)) return root / name;
  for (const auto& entry : fs::directory_iterator(root, error))
    if (entry.is_directory() && lower(entry.path().filename().string()) == lower(ref.id.org + "___" + ref.id.name))
      return entry.path();
  return std::nullopt;
}

std::vector<fs::path> subfolders(const fs::path& dir) {
  std::vector<fs::path> out;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error)) {
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && !name.starts_with(".") && !name.ends_with(".incomplete")) out.push_back(entry.path());
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::string names_of(const std::vector<fs::path>& paths) {
  std::vector<std::string> names;
  for (const fs::path& p : paths) names.push_back(p.filename().string());
  return joined(names);
}

// <ORG___NAME>/<config>/<version>/<hash>/<name>-<split>[-0000K-of-0000N].arrow + dataset_info.json.
DatasetFiles from_datasets_cache(const std::string& given, const HubDatasetRef& ref, const fs::path& folder) {
  const std::string name = ref.id.repo_id();
  const std::vector<fs::path> configs = subfolders(folder);
  fs::path config;
  if (!ref.config.empty()) {
    config = folder / ref.config;
    if (!fs::is_directory(config))
      fail("{}: the datasets cache {} has no configuration '{}' (it has: {})", name, folder.string(), ref.config,
           names_of(configs));
  } else if (configs.size() == 1) {
    config = configs[0];
  } else {
    fail("{}: the datasets cache {} holds several configurations ({}); choose one with {}:CONFIG:{}", name,
         folder.string(), names_of(configs), name, ref.split.empty() ? "train" : ref.split);
  }
  const std::vector<fs::path> versions = subfolders(config);
  if (versions.size() != 1)
    fail("{}: {} holds {} ({}); pass the folder of the one to read as --data FOLDER:SPLIT", name, config.string(),
         versions.empty() ? "no prepared version" : "several versions", names_of(versions));
  std::vector<fs::path> prepared;
  for (const fs::path& hash : subfolders(versions[0]))
    if (fs::exists(hash / "dataset_info.json")) prepared.push_back(hash);
  if (prepared.size() != 1) {
    std::vector<std::string> shown;
    for (const fs::path& p : prepared) {
      const auto written = fs::last_write_time(p / "dataset_info.json");
      const auto seconds = std::chrono::duration_cast<std::chrono::seconds>(
          written - fs::file_time_type::clock::now() + std::chrono::system_clock::now().time_since_epoch());
      const std::time_t t = static_cast<std::time_t>(seconds.count());
      char when[32] = {};
      std::strftime(when, sizeof when, "%Y-%m-%d %H:%M", std::localtime(&t));
      shown.push_back(fmt::format("{} ({})", p.filename().string(), when));
    }
    fail("{}: {} holds {}; `datasets` prepares one per revision and set of data files, and spindle cannot tell which "
         "you mean: pass the folder as --data FOLDER:SPLIT",
         name, versions[0].string(),
         prepared.empty() ? "no complete preparation (no dataset_info.json)"
                          : "several preparations: " + joined(shown));
  }
  const fs::path dir = prepared[0];
  // Split of each Arrow file; cache-*.arrow are outputs of map/filter, not the dataset.
  static const std::regex sharded(R"(^(.+)-([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)-[0-9]{5}-of-[0-9]{5}\.arrow$)");
  static const std::regex single(R"(^(.+)-([A-Za-z0-9_]+(?:\.[A-Za-z0-9_]+)*)\.arrow$)");
  std::map<std::string, std::vector<std::string>> splits;
  for (const std::string& f : list_files(dir)) {
    if (f.find('/') != std::string::npos || f.starts_with("cache-")) continue;
    std::smatch m;
    if (std::regex_match(f, m, sharded) || std::regex_match(f, m, single)) splits[m[2].str()].push_back(f);
  }
  nlohmann::json info;
  {
    std::ifstream in(dir / "dataset_info.json");
    info = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  }
  const std::string wanted = ref.split.empty() ? "train" : ref.split;
  if (!splits.count(wanted)) {
    std::vector<std::string> names;
    for (const auto& [split, files] : splits) names.push_back(split);
    fail("{}: the datasets cache {} has no split '{}'; its splits: {}. Choose one with {}:{}", name, dir.string(),
         wanted, names.empty() ? "none" : joined(names), name, names.empty() ? "train" : names[0]);
  }
  DatasetFiles out;
  out.given = given;
  out.format = DataFileFormat::kArrow;
  out.split = wanted;
  out.place = "the datasets cache (" + dir.string() + ")";
  check_shards(fmt::format("{} split '{}'", name, wanted), splits[wanted],
               "`load_dataset(\"" + name + "\", download_mode=\"force_redownload\")`");
  for (const std::string& f : splits[wanted]) out.files.push_back(dir / f);
  if (info.is_object() && info.contains("splits") && info["splits"].contains(wanted) &&
      info["splits"][wanted].contains("num_examples") && info["splits"][wanted]["num_examples"].is_number_integer())
    out.expected_rows = info["splits"][wanted]["num_examples"].get<int64_t>();
  return out;
}

// "A[:B[:C]]" -> parts.
std::vector<std::string> colon_parts(const std::string& value) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (;;) {
    const size_t colon = value.find(':', start);
    parts.push_back(value.substr(start, colon == std::string::npos ? std::string::npos : colon - start));
    if (colon == std::string::npos) break;
    start = colon + 1;
  }
  return parts;
}

DatasetFiles single_file(const std::string& given, const fs::path& path) {
  DatasetFiles out;
  out.given = given;
  out.format = sniff_format(path);
  out.files = {path};
  return out;
}

}  // namespace

std::string_view data_file_format_name(DataFileFormat format) {
  switch (format) {
    case DataFileFormat::kJsonl: return "JSONL";
    case DataFileFormat::kParquet: return "Parquet";
    case DataFileFormat::kArrow: return "Arrow";
  }
  return "?";
}

std::string DatasetFiles::describe() const {
  if (split.empty()) return given;
  return fmt::format("{} split '{}': {} in {}", given, split,
                     plural(files.size(), fmt::format("{} file", data_file_format_name(format)).c_str(),
                            fmt::format("{} files", data_file_format_name(format)).c_str()),
                     place);
}

DatasetsCacheLocation datasets_cache_location() {
  if (std::string v = environment("HF_DATASETS_CACHE"); !v.empty()) return {expand_user(v), "$HF_DATASETS_CACHE"};
  if (std::string v = environment("HF_HOME"); !v.empty()) return {expand_user(v) / "datasets", "$HF_HOME/datasets"};
  if (std::string v = environment("XDG_CACHE_HOME"); !v.empty())
    return {expand_user(v) / "huggingface" / "datasets", "$XDG_CACHE_HOME/huggingface/datasets"};
  return {expand_user("~/.cache/huggingface/datasets"), "~/.cache/huggingface/datasets"};
}

bool glob_match(std::string_view pattern, std::string_view path) {
  return glob_parts(components(pattern), 0, components(path), 0);
}

SplitFiles infer_splits(const std::vector<std::string>& relative_paths) {
  SplitFiles out;
  std::vector<std::string> paths = relative_paths;
  std::sort(paths.begin(), paths.end());
  // 1. data/SPLIT-00000-of-00002.* : any split name.
  {
    static const std::regex shard(R"(^data/(.+)-[0-9]{5}-of-[0-9]{5}[^/]*\.[^/]*$)");
    std::map<std::string, std::vector<std::string>> found;
    for (const std::string& p : paths) {
      std::smatch m;
      if (std::regex_match(p, m, shard) && valid_split_name(m[1].str())) found[m[1].str()].push_back(p);
    }
    if (!found.empty()) {
      for (auto& [split, files] : found) out.splits.push_back({split, files, {"data"}});
      order_splits(out.splits);
      out.rule = "from shard names data/SPLIT-0000K-of-0000N";
      return out;
    }
  }
  // 2. a folder named for the split; 3. a file named for it.
  for (const bool by_folder : {true, false}) {
    for (const auto& [split, keywords] : split_keywords()) {
      SplitFiles::Split s{split, {}, {}};
      std::set<std::string> folders;
      for (const std::string& p : paths) {
        const std::vector<std::string> parts = components(p);
        std::optional<size_t> at;  // the matching component
        for (size_t k = 0; k + (by_folder ? 1 : 0) < parts.size() && !at; ++k) {
          if (!by_folder && k + 1 != parts.size()) continue;
          for (const std::string& keyword : keywords)
            if (by_folder ? folder_names(parts[k], keyword) : file_names(parts[k], keyword)) at = k;
        }
        if (!at) continue;
        s.files.push_back(p);
        std::string prefix;
        for (size_t k = 0; k < *at; ++k) prefix += (k ? "/" : "") + parts[k];
        folders.insert(prefix);
      }
      if (!s.files.empty()) {
        s.folders.assign(folders.begin(), folders.end());
        out.splits.push_back(std::move(s));
      }
    }
    if (!out.splits.empty()) {
      out.rule = by_folder ? "from folder names (train/, validation/, test/ and their synonyms)"
                           : "from file names (train, validation, test and their synonyms)";
      return out;
    }
  }
  // 4. no split in any name: every file is train.
  if (!paths.empty()) out.splits.push_back({"train", paths, {}});
  out.rule = "no split in the file names, so every file is 'train'";
  return out;
}

DatasetFiles resolve_dataset(const std::string& value, std::string_view option) {
  std::error_code error;
  if (value.empty()) fail("{} is empty: give a file, a folder or a hub id ORG/NAME", option);
  // 1. A path: a file, or a folder (a prepared dataset is the caller's concern).
  if (fs::exists(value, error)) {
    if (!fs::is_directory(value, error)) return single_file(value, value);
    FolderRequest request{value, "", "", value, value, ""};
    return files_of(value, request, choose_folder_files(request), value);
  }
  const std::vector<std::string> parts = colon_parts(value);
  if (parts.size() > 3)
    fail("{} {}: too many ':' (the forms are PATH, FOLDER[:CONFIG]:SPLIT and ORG/NAME[:CONFIG]:SPLIT, each with an "
         "optional :WEIGHT)",
         option, value);
  const std::string base = parts[0];
  const std::string config = parts.size() == 3 ? parts[1] : "";
  const std::string split = parts.size() >= 2 ? parts.back() : "";
  if (parts.size() >= 2 && split.empty()) fail("{} {}: the split after ':' is empty", option, value);
  // 2. FOLDER:SPLIT / FOLDER:CONFIG:SPLIT.
  if (parts.size() >= 2 && fs::exists(base, error)) {
    if (!fs::is_directory(base, error))
      fail("{} {}: {} is one file; a split (':{}') chooses among the files of a folder or hub dataset", option, value,
           base, split);
    FolderRequest request{base, config, split, base, base, ""};
    return files_of(value, request, choose_folder_files(request), base);
  }
  // 3. ORG/NAME[@REVISION] in the caches.
  const std::optional<io::HubModelId> id = io::parse_hub_model_id(base);
  if (!id) {
    if (parts.size() >= 2 && fs::path(base).has_parent_path() && !fs::exists(base, error))
      fail("{} {} does not exist (nor {})", option, value, base);
    fail("{} {} does not exist", option, value);
  }
  const HubDatasetRef ref{*id, config, split};
  const io::HubCacheLocation hub = io::hub_cache_location();
  const DatasetsCacheLocation datasets = datasets_cache_location();
  const std::string download = download_command(*id);
  if (const std::optional<fs::path> snapshot = hub_snapshot(ref, hub)) {
    const bool has_data = [&] {
      for (const std::string& f : list_files(*snapshot))
        if (classify(f).kind != FileKind::kNotData) return true;
      return false;
    }();
    // A snapshot without data files (a dataset with a loading script) may have been prepared by
    // `datasets`: its Arrow cache is read then.
    const std::optional<fs::path> prepared = datasets_cache_folder(ref, datasets.path);
    if (has_data || !prepared) {
      FolderRequest request{*snapshot, config, split, id->repo_id(), id->repo_id(), download};
      return files_of(value, request, choose_folder_files(request), "the hub cache (" + snapshot->string() + ")");
    }
  }
  if (id->revision == "main")
    if (const std::optional<fs::path> prepared = datasets_cache_folder(ref, datasets.path))
      return from_datasets_cache(value, ref, *prepared);
  fail("{} {}: no such file or folder, and the dataset {} is not in the local Hugging Face caches: not in the hub "
       "cache ({}, chosen by {}: no datasets--{}--{}){}. spindle does not download; fetch it with {} (or `hf download "
       "{} --repo-type dataset`), set HF_HUB_CACHE or HF_HOME to the cache that holds it, or pass a local path",
       option, value, id->repo_id(), hub.path.string(), hub.source, id->org, id->name,
       id->revision == "main"
           ? fmt::format(" nor in the datasets cache ({}, chosen by {}: no {}___{})", datasets.path.string(),
                         datasets.source, id->org, id->name)
           : "",
       download, id->repo_id());
}

}  // namespace spindle
