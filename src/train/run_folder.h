// The output folder of a training run holds one run, never a mix of two. A run writes into a new or
// empty folder, or into one that holds its own run when --resume continues it; --overwrite-output
// replaces the run a folder holds. Everything else is refused before any work, with a message
// naming the folder and these choices.
//
// The run a folder holds is described by OUT/run.json, written before anything else: the run's
// identity (what decides what it computes: the command, the contents of the model's config and the
// size of its weights, the data's contents, the trajectory options) and, for people, the paths and
// the command line. Contents rather than paths identify the data, so a job that copies its data to
// node-local storage under another name still resumes. docs/usage.md, "The output folder".
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "train/train_config.h"

namespace spindle {

inline constexpr const char* kRunFile = "run.json";
// The key of a run's identity that holds its length (--max-steps, --epochs): recorded, but a resumed
// run may change it (identity_differences leaves it out).
inline constexpr const char* kRunLength = "length";

// Size and CRC-32C of a file's contents, {"bytes": N, "crc32c": "1a2b3c4d"}; for a folder (a
// prepared dataset) of its dataset.bin. Cached per process for an unchanged file (size and mtime).
nlohmann::ordered_json file_fingerprint(const std::filesystem::path& path);
// The same for a --data value: a prepared dataset or one file as file_fingerprint says; the files of
// a split (a folder's, a hub dataset's: data/dataset_files.h) as {"files": [one per file, in order]}.
nlohmann::ordered_json data_fingerprint(const std::string& value);

// The identity of a run of `command` ("sft", "dpo") with these options. `command_options`: what the
// command adds to sft's (dpo: the loss and the reference); `data_parallel`: data-parallel replicas
// (rows per step are grad_accum · dp). Reads the data and the model's config to fingerprint them.
nlohmann::ordered_json run_identity(const TrainConfig& config, const std::string& command,
                                    const nlohmann::json& command_options, int data_parallel);

// Where two identities differ, one line per difference in the options' own names
// ("--max-length: 64 in the folder's run, 128 here"); empty when they are equal.
std::vector<std::string> identity_differences(const nlohmann::json& folder_run, const nlohmann::json& this_run);

// Read-only: whether this run may use config.output (and --merge-output and an outside
// --metrics-file) as the options say, or a spindle::Error naming the folder and the choices.
// `identity` is this run's (run_identity).
void check_run_output(const TrainConfig& config, const nlohmann::ordered_json& identity);

// The main rank's claim on the output folder, once every check has passed: --overwrite-output
// removes what the earlier run wrote, a new run writes run.json, and half-written checkpoints of a
// killed session are removed. Until keep() (called as training starts), destroying the claim undoes
// what this run created — run.json, the folder itself, the paths given to created() — so a run that
// fails before its first step leaves the folder as it found it.
class RunOutputClaim {
 public:
  RunOutputClaim() = default;  // claims nothing (the ranks other than the main one)
  RunOutputClaim(const TrainConfig& config, const nlohmann::ordered_json& identity);
  ~RunOutputClaim();
  RunOutputClaim(RunOutputClaim&& other) noexcept;
  RunOutputClaim& operator=(RunOutputClaim&& other) noexcept;
  RunOutputClaim(const RunOutputClaim&) = delete;
  RunOutputClaim& operator=(const RunOutputClaim&) = delete;

  // A path this run created in the folder (a tokenized dataset): removed if the run fails before training.
  void created(const std::filesystem::path& path);
  void keep() { kept_ = true; }

 private:
  void undo() noexcept;
  std::vector<std::filesystem::path> created_;  // in creation order; undone in reverse
  std::filesystem::path created_folder_;        // the output folder, when this run made it
  bool kept_ = true;
};

// What a run writes in its output folder, by name or pattern: what --overwrite-output removes.
bool is_run_output_entry(const std::string& name);

}  // namespace spindle
