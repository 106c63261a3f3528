// Writing safetensors files and HF-layout model folders. Every file is written to
// `<path>.tmp.<pid>`, fsynced and renamed into place, so a crash leaves either the old file or the
// new one, never half of one.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "backend/backend.h"

namespace spindle::io {

using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// One file; tensors in the order given, copied to the host through `backend`. The header is padded
// with spaces to a multiple of 8 bytes, as the Python library does, so the data stays aligned.
// Files that transformers' from_pretrained reads need metadata {"format": "pt"}.
void write_safetensors(const std::string& path, const NamedTensors& tensors, Backend& backend,
                       const std::map<std::string, std::string>& metadata = {});

// A model folder: model-0000k-of-0000n.safetensors shards of at most max_shard_bytes of tensor data
// (a larger tensor gets a shard of its own) plus model.safetensors.index.json, or one
// model.safetensors when everything fits. {"format": "pt"} is added to the metadata unless given.
// Weight files of an earlier save that this one does not replace (stale shards, an index beside a new
// single file) are removed, as transformers' save_pretrained does, so the folder never mixes saves.
void write_sharded_safetensors(const std::string& dir, const NamedTensors& tensors, Backend& backend,
                               size_t max_shard_bytes, const std::map<std::string, std::string>& metadata = {});

}  // namespace spindle::io
