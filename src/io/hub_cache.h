// Models named by their Hugging Face hub id (`--model Qwen/Qwen2.5-7B`), found in the local hub
// cache as transformers finds them with HF_HUB_OFFLINE=1: spindle never downloads.
//
// The cache (huggingface_hub's layout, filled by `hf download` / `huggingface-cli download` or by
// transformers itself):
//   CACHE/models--ORG--NAME/refs/main                 the commit id the branch "main" points to
//   CACHE/models--ORG--NAME/snapshots/COMMIT/FILE     a symlink to ../../blobs/<hash> per file
#pragma once

#include <filesystem>
#include <optional>
#include <string>
#include <string_view>

namespace spindle::io {

struct HubCacheLocation {
  std::filesystem::path path;
  std::string source;  // how it was chosen: "$HF_HUB_CACHE", "$HF_HOME/hub", "~/.cache/huggingface/hub", ...
};

// $HF_HUB_CACHE, else $HUGGINGFACE_HUB_CACHE (its older name), else $HF_HOME/hub, else
// $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub: huggingface_hub's order.
HubCacheLocation hub_cache_location();

// A hub id: "ORG/NAME" or "ORG/NAME@REVISION" (a branch, a tag or a commit id; default "main").
struct HubModelId {
  std::string org, name;
  std::string revision = "main";
  std::string repo_id() const { return org + "/" + name; }
  std::string cache_folder_name() const { return "models--" + org + "--" + name; }
};

// nullopt when `text` does not have the form of a hub id (a path with more or fewer parts, "..", ...).
std::optional<HubModelId> parse_hub_model_id(std::string_view text);

// What options naming a model folder take (--model, --tokenizer, --ref-model, --adapter):
//  - an existing path: returned unchanged;
//  - a hub id: the snapshot folder of its revision in the hub cache (refs/REVISION names the commit;
//    a revision without a ref is taken as a commit id);
//  - anything else: returned unchanged, for the caller's own "no config.json there" message.
// Throws spindle::Error for a hub id that is not in the cache, naming where it looked, which
// variable chose that cache, and the command that downloads the model. `option` is the flag
// ("--model") the error names.
std::string resolve_model_reference(const std::string& reference, std::string_view option);

}  // namespace spindle::io
