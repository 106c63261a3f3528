#include "train/run_folder.h"

#include <fcntl.h>
#include <isa-l/crc.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <climits>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <regex>
#include <sstream>

#include <fmt/format.h>

#include "core/error.h"
#include "data/dataset_files.h"
#include "data/prepared_dataset.h"
#include "train/data_loader.h"
#include "train/metrics.h"

namespace spindle {

namespace fs = std::filesystem;
using Json = nlohmann::ordered_json;

namespace {

std::string errno_text() { return std::strerror(errno); }

struct CachedFingerprint {
  int64_t bytes = 0;
  int64_t mtime_ns = 0;
  Json value;
};

uint32_t file_crc32c(const fs::path& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot read {}: {}", path.string(), errno_text());
  std::vector<unsigned char> buffer(8 << 20);
  uint32_t state = 0xffffffffu;  // ISA-L's iSCSI CRC is CRC-32C without the final inversion
  for (;;) {
    const ssize_t n = ::read(fd, buffer.data(), buffer.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const std::string why = errno_text();
      ::close(fd);
      fail("reading {} failed: {}", path.string(), why);
    }
    if (n == 0) break;
    state = crc32_iscsi(buffer.data(), static_cast<int>(n), state);
  }
  ::close(fd);
  return ~state;
}

bool is_prepared_input(const fs::path& path) {
  return (fs::is_directory(path) && fs::exists(path / kPreparedDataFile)) || path.extension() == ".bin";
}

// Total size of the weight files of a model folder: a cheap stand-in for their contents (reading
// tens of gigabytes at every start would cost minutes).
int64_t weights_bytes(const fs::path& model) {
  int64_t total = 0;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(model, error))
    if (entry.is_regular_file() && entry.path().extension() == ".safetensors") total += entry.file_size();
  return total;
}

// "--max-length" for "max_length"; the few keys that are not options are spelled out.
std::string option_of(const std::string& path) {
  static const std::map<std::string, std::string> named = {
      {"command", "the command (sft or dpo)"},
      {"data_parallel", "data-parallel replicas (--dp, or processes / --sp)"},
      {"model.config", "--model (its config.json)"},
      {"model.weights_bytes", "--model (the size of its weights)"},
      {"tokenizer", "the tokenizer (tokenizer.json or tokenizer_config.json of --tokenizer or --model)"},
      {"eval_data", "--eval-data (its contents)"},
      {"adapter", "--adapter (its contents)"},
      {"dpo.ref_model", "--ref-model"},
      {"dpo.ref_model.config", "--ref-model (its config.json)"},
  };
  if (auto it = named.find(path); it != named.end()) return it->second;
  if (path.rfind("data", 0) == 0) return "--data (" + path + ": its contents or weight)";
  std::string leaf = path.substr(path.rfind('.') + 1);
  std::replace(leaf.begin(), leaf.end(), '_', '-');
  return "--" + leaf;
}

std::string shown(const Json* value) {
  if (!value) return "not set";
  if (value->is_object() && value->contains("crc32c"))
    return fmt::format("{} bytes, CRC-32C {}", (*value)["bytes"].get<int64_t>(), (*value)["crc32c"].get<std::string>());
  if (value->is_string()) return value->get<std::string>();
  return value->dump();
}

void differences(const Json* folder, const Json* here, const std::string& path, std::vector<std::string>& out) {
  if (folder && here && *folder == *here) return;
  const bool objects = folder && here && folder->is_object() && here->is_object() && !folder->contains("crc32c");
  if (objects) {
    for (const auto& [key, value] : folder->items())
      differences(&value, here->contains(key) ? &(*here)[key] : nullptr, path.empty() ? key : path + "." + key, out);
    for (const auto& [key, value] : here->items())
      if (!folder->contains(key)) differences(nullptr, &value, path.empty() ? key : path + "." + key, out);
    return;
  }
  const bool arrays = folder && here && folder->is_array() && here->is_array() && folder->size() == here->size() &&
                      path != "options.lora_targets";
  if (arrays) {
    for (size_t i = 0; i < folder->size(); ++i)
      differences(&(*folder)[i], &(*here)[i], fmt::format("{}[{}]", path, i), out);
    return;
  }
  out.push_back(fmt::format("{}: {} in the folder's run, {} here", option_of(path), shown(folder), shown(here)));
}

Json read_json_file(const fs::path& path) {
  std::ifstream in(path);
  if (!in) fail("cannot read {}: {}", path.string(), errno_text());
  Json j = Json::parse(in, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    fail("{} is not a run description spindle wrote (not a JSON object); move the folder's contents away or "
         "choose another --output",
         path.string());
  return j;
}

// The newest checkpoint step in `folder` (checkpoint-<step>/trainer_state.json), or -1.
int64_t newest_checkpoint_step(const fs::path& folder) {
  static const std::regex pattern("checkpoint-([0-9]+)");
  int64_t best = -1;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(folder, error)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, m, pattern) && fs::exists(entry.path() / "trainer_state.json"))
      best = std::max<int64_t>(best, std::stoll(m[1]));
  }
  return best;
}

int64_t logged_steps(const fs::path& metrics) {
  std::error_code error;
  if (!fs::is_regular_file(metrics, error) || fs::file_size(metrics, error) == 0) return 0;
  try {
    const auto records = train::read_metrics_file(metrics);
    return records.empty() ? 0 : records.back().step;
  } catch (const Error&) {
    return 1;  // unreadable, but not empty: something was logged
  }
}

fs::path metrics_path(const TrainConfig& config) {
  return config.metrics_file.empty() ? fs::path(config.output) / "metrics.jsonl" : fs::path(config.metrics_file);
}

// "trained to step 4 (newest checkpoint: checkpoint-4)", "logged 3 steps, no checkpoint", or "nothing trained yet".
std::string progress_of(const TrainConfig& config) {
  const int64_t checkpoint = newest_checkpoint_step(config.output);
  const int64_t logged = logged_steps(metrics_path(config));
  const bool exported = fs::exists(fs::path(config.output) / "adapter") || fs::exists(fs::path(config.output) / "model");
  if (checkpoint >= 0)
    return fmt::format("logged {} step{}, newest checkpoint: checkpoint-{}{}", logged, logged == 1 ? "" : "s",
                       checkpoint, exported ? ", trained model exported" : "");
  if (logged > 0) return fmt::format("logged {} step{}, no checkpoint", logged, logged == 1 ? "" : "s");
  return exported ? "a trained model exported" : "";
}

bool same_folder(const fs::path& a, const fs::path& b) {
  std::error_code error;
  return fs::exists(a, error) && fs::exists(b, error) && fs::equivalent(a, b, error);
}

std::vector<std::string> folder_entries(const fs::path& folder) {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(folder, error)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::string some_names(const std::vector<std::string>& names) {
  std::string text;
  for (size_t i = 0; i < names.size() && i < 4; ++i) text += fmt::format("{}{}", i ? ", " : "", names[i]);
  if (names.size() > 4) text += fmt::format(", … ({} entries)", names.size());
  return text;
}

void check_merge_output(const TrainConfig& config, const Json* folder_run) {
  if (config.merge_output.empty()) return;
  const fs::path merge = config.merge_output;
  if (same_folder(merge, config.model))
    fail("--merge-output {} is the --model folder: the merged model would replace the weights it is made from; "
         "choose another folder",
         config.merge_output);
  if (same_folder(merge, config.output))
    fail("--merge-output {} is the --output folder; choose a folder of its own (e.g. {}/merged)", config.merge_output,
         config.output);
  std::error_code error;
  if (!fs::exists(merge, error)) return;
  if (!fs::is_directory(merge, error)) fail("--merge-output {} is a file; choose a folder", config.merge_output);
  if (fs::is_empty(merge, error)) return;
  // The run in --output merged into this folder before (a resumed run that had finished): it is its own.
  if (config.resume && folder_run && folder_run->value("merge_output", std::string()) == fs::absolute(merge).string())
    return;
  const bool earlier_export = fs::exists(merge / "config.json");
  if (config.overwrite_output && earlier_export) return;
  fail("--merge-output {} is not empty ({}){}; choose a new or empty folder{}", config.merge_output,
       some_names(folder_entries(merge)),
       earlier_export ? "" : ", and it holds no model (no config.json), so spindle never replaces it",
       earlier_export ? ", or add --overwrite-output to replace the model there" : "");
}

void check_outside_metrics_file(const TrainConfig& config) {
  if (config.metrics_file.empty() || config.resume || config.overwrite_output) return;
  const fs::path metrics = config.metrics_file;
  std::error_code error;
  if (fs::exists(metrics, error) && fs::is_directory(metrics, error))
    fail("--metrics-file {} is a folder; name a file", config.metrics_file);
  if (fs::exists(metrics, error) && fs::file_size(metrics, error) > 0 &&
      !fs::equivalent(metrics.parent_path().empty() ? "." : metrics.parent_path(), config.output, error))
    fail("--metrics-file {} already holds metrics; a new run would replace them: name another file, or add "
         "--overwrite-output to replace it",
         config.metrics_file);
}

std::string run_json_text(const TrainConfig& config, const Json& identity) {
  Json j;
  j["identity"] = identity;
  // For people reading the folder; not compared (the identity holds what is).
  j["model"] = config.model;
  j["data"] = config.data;
  if (!config.eval_data.empty()) j["eval_data"] = config.eval_data;
  if (!config.merge_output.empty()) j["merge_output"] = fs::absolute(config.merge_output).string();
  return j.dump(1) + "\n";
}

}  // namespace

Json file_fingerprint(const fs::path& given) {
  const fs::path path = fs::is_directory(given) ? given / kPreparedDataFile : given;
  struct stat info {};
  if (::stat(path.c_str(), &info) != 0) fail("cannot read {}: {}", path.string(), errno_text());
  const int64_t mtime_ns = static_cast<int64_t>(info.st_mtim.tv_sec) * 1'000'000'000 + info.st_mtim.tv_nsec;
  static std::mutex mutex;
  static std::map<std::string, CachedFingerprint> cache;
  const std::string key = fs::absolute(path).string();
  {
    std::lock_guard lock(mutex);
    if (auto it = cache.find(key); it != cache.end() && it->second.bytes == info.st_size && it->second.mtime_ns == mtime_ns)
      return it->second.value;
  }
  Json value;
  value["bytes"] = static_cast<int64_t>(info.st_size);
  value["crc32c"] = fmt::format("{:08x}", file_crc32c(path));
  std::lock_guard lock(mutex);
  cache[key] = {static_cast<int64_t>(info.st_size), mtime_ns, value};
  return value;
}

Json data_fingerprint(const std::string& value) {
  if (is_prepared_input(value)) return file_fingerprint(value);
  const DatasetFiles data = resolve_dataset(value);
  if (data.files.size() == 1) return file_fingerprint(data.files[0]);
  Json files = Json::array();
  for (const fs::path& file : data.files) files.push_back(file_fingerprint(file));
  return Json{{"files", files}};
}

Json run_identity(const TrainConfig& config, const std::string& command, const nlohmann::json& command_options,
                  int data_parallel) {
  Json j;
  j["command"] = command;
  const fs::path model = config.model;
  const bool config_file = config.random_weights && fs::is_regular_file(model);
  j["model"]["config"] = file_fingerprint(config_file ? model : model / "config.json");
  j["model"]["weights_bytes"] = config.random_weights ? 0 : weights_bytes(model);
  bool text_data = false;
  j["data"] = Json::array();
  for (const std::string& spec : config.data) {
    const DataSource source = parse_data_spec(spec);
    text_data |= !is_prepared_input(source.path);
    j["data"].push_back({{"weight", source.weight}, {"contents", data_fingerprint(source.path.string())}});
  }
  if (!config.eval_data.empty()) {
    text_data |= !is_prepared_input(config.eval_data);
    j["eval_data"] = data_fingerprint(config.eval_data);
  }
  // JSONL is tokenized with the tokenizer and the chat template: they decide the tokens as much as the data.
  const fs::path tokenizer = config.tokenizer_folder();
  if (text_data)
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
      if (fs::exists(tokenizer / file)) j["tokenizer"][file] = file_fingerprint(tokenizer / file);
  if (!config.adapter.empty()) j["adapter"] = file_fingerprint(fs::path(config.adapter) / "adapter_model.safetensors");
  j["options"] = config.trajectory_options();
  j["data_parallel"] = data_parallel;
  j[kRunLength] = {{"max_steps", config.max_steps}, {"epochs", config.max_steps > 0 ? 0.0 : config.epochs}};
  if (!command_options.is_null()) j[command] = command_options;
  return j;
}

std::vector<std::string> identity_differences(const nlohmann::json& folder_run, const nlohmann::json& this_run) {
  const Json a = folder_run, b = this_run;
  std::vector<std::string> out;
  // Another command's run differs in options this command does not have: that it is another is enough.
  if (a.contains("command") && b.contains("command") && a["command"] != b["command"]) {
    out.push_back(fmt::format("the folder holds a spindle {} run, this is spindle {}", a["command"].get<std::string>(),
                              b["command"].get<std::string>()));
    return out;
  }
  Json a_compared = a, b_compared = b;
  a_compared.erase(kRunLength);  // a resumed run may be longer or shorter
  b_compared.erase(kRunLength);
  differences(&a_compared, &b_compared, "", out);
  return out;
}

bool is_run_output_entry(const std::string& name) {
  static const std::regex written(
      "(run\\.json|adapter|model|metrics\\.jsonl|metrics\\.svg|data|checkpoint-[0-9]+)"
      "|\\.checkpoint-[0-9]+\\.tmp\\.[0-9]+|(run\\.json|adapter|model|metrics\\.jsonl|metrics\\.svg)\\.(tmp|old)\\.[0-9]+");
  return std::regex_match(name, written);
}

void check_run_output(const TrainConfig& config, const Json& identity) {
  const fs::path out = config.output;
  std::error_code error;
  const bool exists = fs::exists(out, error);
  if (exists && !fs::is_directory(out, error))
    fail("--output {} is a file; name a folder for the run (a new one is created)", config.output);
  const bool empty = !exists || fs::is_empty(out, error);
  const bool has_run = exists && fs::exists(out / kRunFile);
  const bool earlier_spindle = exists && !has_run && newest_checkpoint_step(out) >= 0;
  Json folder_run;
  if (has_run) folder_run = read_json_file(out / kRunFile);
  check_merge_output(config, has_run ? &folder_run : nullptr);
  check_outside_metrics_file(config);
  const std::string choices =
      "add --resume to continue it (with the same options), choose a new --output for this run, or add "
      "--overwrite-output to replace it";

  if (config.resume) {
    if (empty)
      fail("--resume: no checkpoint in {} (the folder {}); run without --resume to start the run there",
           config.output, exists ? "is empty" : "does not exist");
    if (!has_run && !earlier_spindle)
      fail("--resume: {} holds no spindle run ({}); choose the folder of the run to continue", config.output,
           some_names(folder_entries(out)));
    if (has_run) {
      const std::vector<std::string> changed = identity_differences(folder_run.value("identity", Json()), identity);
      if (!changed.empty()) {
        std::string list;
        for (const std::string& line : changed) list += "\n  " + line;
        fail("--resume: {} holds a run with other settings:{}\nresume it with the settings it was started with, or "
             "start this run in a new --output (or replace that run with --overwrite-output instead of --resume)",
             config.output, list);
      }
    }
    if (newest_checkpoint_step(out) < 0)
      fail("--resume: no checkpoint in {} yet ({}; checkpoints are written every --save-steps, on a stop signal "
           "and at the end); start the run again with --overwrite-output",
           config.output, progress_of(config).empty() ? "nothing trained" : progress_of(config));
    return;
  }
  if (empty || config.overwrite_output) return;
  if (has_run || earlier_spindle) {
    const bool same = has_run && identity_differences(folder_run.value("identity", Json()), identity).empty();
    const std::string progress = progress_of(config);
    if (same && progress.empty()) return;  // its own run, which stopped before its first step: start it again
    fail("--output {} already holds a{} run ({}): {}", config.output, same ? "n identical" : "nother",
         progress.empty() ? "nothing trained yet" : progress, choices);
  }
  fail("--output {} is not empty and holds no spindle run ({}): choose a new or empty folder, or add "
       "--overwrite-output to replace what a run writes there (run.json, adapter/, model/, checkpoint-*/, data/, "
       "metrics.jsonl, metrics.svg; other files stay)",
       config.output, some_names(folder_entries(out)));
}

RunOutputClaim::RunOutputClaim(const TrainConfig& config, const Json& identity) {
  const fs::path out = config.output;
  std::error_code error;
  const bool existed = fs::exists(out, error);
  if (existed) {
    // --overwrite-output: the earlier run goes. A resumed or new run: what a killed session left half-written.
    for (const std::string& name : folder_entries(out)) {
      const bool half_written = name.find(".tmp.") != std::string::npos || name.find(".old.") != std::string::npos;
      if (is_run_output_entry(name) && (config.overwrite_output || half_written)) {
        fs::remove_all(out / name, error);
        if (error) fail("--overwrite-output: cannot remove {}: {}", (out / name).string(), error.message());
      }
    }
  } else {
    fs::create_directories(out, error);
    if (error) fail("cannot create the output folder {}: {}", config.output, error.message());
    created_folder_ = out;
  }
  kept_ = false;
  if (!fs::exists(out / kRunFile)) {
    train::write_file_atomically(out / kRunFile, run_json_text(config, identity));
    created_.push_back(out / kRunFile);
  }
}

RunOutputClaim::~RunOutputClaim() { undo(); }

RunOutputClaim::RunOutputClaim(RunOutputClaim&& other) noexcept
    : created_(std::move(other.created_)), created_folder_(std::move(other.created_folder_)), kept_(other.kept_) {
  other.kept_ = true;
}

RunOutputClaim& RunOutputClaim::operator=(RunOutputClaim&& other) noexcept {
  if (this != &other) {
    undo();
    created_ = std::move(other.created_);
    created_folder_ = std::move(other.created_folder_);
    kept_ = other.kept_;
    other.kept_ = true;
  }
  return *this;
}

void RunOutputClaim::created(const fs::path& path) {
  if (!kept_) created_.push_back(path);
}

void RunOutputClaim::undo() noexcept {
  if (kept_) return;
  kept_ = true;
  std::error_code error;
  for (auto it = created_.rbegin(); it != created_.rend(); ++it) fs::remove_all(*it, error);
  created_.clear();
  // The folder itself goes only if nothing else appeared in it meanwhile.
  if (!created_folder_.empty()) fs::remove(created_folder_, error);
}

}  // namespace spindle
