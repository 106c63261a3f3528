// The weights of a Hugging Face model folder: a single model.safetensors, or shards listed by
// model.safetensors.index.json. Everything is opened and cross-checked up front, so an incomplete
// download fails at open with the missing shard's name rather than halfway through loading.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "io/safetensors_file.h"

namespace spindle::io {

class Checkpoint {
 public:
  // `path`: a model folder (model.safetensors is preferred over the index, as transformers does),
  // a model.safetensors.index.json, or one .safetensors file.
  explicit Checkpoint(const std::string& path);

  const std::string& path() const { return path_; }
  // Tensor names: shard by shard, in each file's header order.
  const std::vector<std::string>& names() const { return names_; }
  const TensorRecord* find(std::string_view name) const;  // nullptr if absent
  // The tensor, or an error naming it and the expected and found shapes.
  const TensorRecord& require(std::string_view name, const Shape& expected) const;
  const std::vector<std::unique_ptr<SafetensorsFile>>& files() const { return files_; }

 private:
  void open_index(const std::string& index_path);

  std::string path_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, const SafetensorsFile*> owner_;
};

}  // namespace spindle::io
