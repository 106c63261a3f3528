#include "io/checkpoint.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace spindle::io {

namespace fs = std::filesystem;

namespace {

constexpr const char* kSingleFile = "model.safetensors";
constexpr const char* kIndexFile = "model.safetensors.index.json";

bool ends_with(std::string_view text, std::string_view suffix) {
  return text.size() >= suffix.size() && text.substr(text.size() - suffix.size()) == suffix;
}

}  // namespace

Checkpoint::Checkpoint(const std::string& path) : path_(path) {
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    fs::path folder(path);
    if (fs::exists(folder / kSingleFile, ec)) {
      files_.push_back(std::make_unique<SafetensorsFile>((folder / kSingleFile).string()));
    } else if (fs::exists(folder / kIndexFile, ec)) {
      open_index((folder / kIndexFile).string());
      return;
    } else {
      fail("{} holds neither {} nor {}; pass a Hugging Face model folder with safetensors weights "
           "(a PyTorch .bin checkpoint must be converted to safetensors first)", path, kSingleFile, kIndexFile);
    }
  } else if (!fs::exists(path, ec)) {
    fail("model path {} does not exist; pass a model folder or a .safetensors file", path);
  } else if (ends_with(path, ".json")) {
    open_index(path);
    return;
  } else {
    files_.push_back(std::make_unique<SafetensorsFile>(path));
  }
  const SafetensorsFile& file = *files_.front();
  for (const std::string& name : file.names()) {
    names_.push_back(name);
    owner_.emplace(name, &file);
  }
}

void Checkpoint::open_index(const std::string& index_path) {
  nlohmann::json index;
  {
    std::ifstream in(index_path);
    if (!in) fail("cannot read the shard index {}", index_path);
    try {
      index = nlohmann::json::parse(in);
    } catch (const nlohmann::json::exception& e) {
      fail("{} is not valid JSON ({}); re-download it", index_path, e.what());
    }
  }
  auto weight_map = index.is_object() ? index.find("weight_map") : index.end();
  if (!index.is_object() || weight_map == index.end() || !weight_map->is_object())
    fail("{} has no \"weight_map\" object; a shard index maps each tensor name to its shard file", index_path);
  if (weight_map->empty()) fail("{}: \"weight_map\" is empty; the index lists no tensors", index_path);

  // Shards in file-name order, which for HF's model-0000k-of-0000n names is k order.
  std::map<std::string, std::vector<std::string>> tensors_by_shard;
  for (const auto& [name, shard] : weight_map->items()) {
    if (!shard.is_string())
      fail("{}: weight_map entry for '{}' must be a shard file name, got a JSON {}", index_path, name, shard.type_name());
    const std::string shard_name = shard.get<std::string>();
    fs::path relative(shard_name);
    if (shard_name.empty() || relative.is_absolute() ||
        std::any_of(relative.begin(), relative.end(), [](const fs::path& part) { return part == ".."; }))
      fail("{}: weight_map puts '{}' in shard '{}', which is not a file name inside the model folder", index_path,
           name, shard_name);
    tensors_by_shard[shard_name].push_back(name);
  }

  const fs::path folder = fs::path(index_path).parent_path();
  for (const auto& [shard_name, tensors] : tensors_by_shard) {
    const fs::path shard_path = folder / shard_name;
    std::error_code ec;
    if (!fs::exists(shard_path, ec))
      fail("shard {} is missing: {} lists {} tensors in it (e.g. '{}'); the download is incomplete, fetch the "
           "missing shard", shard_path.string(), index_path, tensors.size(), tensors.front());
    files_.push_back(std::make_unique<SafetensorsFile>(shard_path.string()));
    const SafetensorsFile& file = *files_.back();
    for (const std::string& name : tensors)
      if (!file.contains(name))
        fail("{} says tensor '{}' is in {}, but that shard has no such tensor; the index and the shards come "
             "from different saves (re-download the model)", index_path, name, shard_path.string());
    // Tensors a shard holds beyond the index are ignored, as transformers ignores them.
    for (const std::string& name : file.names())
      if (owner_.count(name) == 0 && weight_map->contains(name) &&
          weight_map->at(name).get<std::string>() == shard_name) {
        names_.push_back(name);
        owner_.emplace(name, &file);
      }
  }
}

const TensorRecord* Checkpoint::find(std::string_view name) const {
  auto it = owner_.find(std::string(name));
  return it == owner_.end() ? nullptr : it->second->find(name);
}

const TensorRecord& Checkpoint::require(std::string_view name, const Shape& expected) const {
  const TensorRecord* rec = find(name);
  if (!rec) {
    std::string examples;
    for (size_t i = 0; i < names_.size() && i < 3; ++i) examples += (i ? ", '" : "'") + names_[i] + "'";
    fail("checkpoint {} has no tensor '{}' (expected shape {}); it holds {} tensors, e.g. {}. The weights do not "
         "belong to the architecture config.json describes, or the checkpoint is incomplete", path_, name,
         expected.str(), names_.size(), examples.empty() ? std::string("none") : examples);
  }
  if (!(rec->shape == expected))
    fail("tensor '{}' in {} has shape {}, but the model expects {}; config.json does not match these weights "
         "(check hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, head_dim, "
         "vocab_size)", name, rec->file, rec->shape.str(), expected.str());
  return *rec;
}

}  // namespace spindle::io
