// One .safetensors file, memory-mapped read-only and validated when opened: after the constructor
// returns, every tensor's bytes lie inside the file, tensors neither overlap nor leave holes, and
// each byte count matches its dtype and shape, so later code can trust a TensorRecord blindly.
// Format: docs/formats.md#safetensors.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "core/dtype.h"
#include "core/tensor.h"

namespace spindle::io {

// A tensor stored in a file: element bytes in the file's dtype, little-endian, row-major.
// `data` points into a mapping owned by the SafetensorsFile (or Checkpoint) it came from and lives
// as long as that object; it may be unaligned.
struct TensorRecord {
  std::string name;
  DType dtype = DType::U8;
  Shape shape;
  const void* data = nullptr;
  size_t bytes = 0;
  std::string file;
  std::string stored_dtype;  // the file's spelling: "BF16", "BOOL" (stored as U8), ...
};

// Headers larger than this are refused before parsing, as the reference implementation does, so a
// corrupt length field cannot make us allocate gigabytes.
inline constexpr size_t kMaxSafetensorsHeaderBytes = 100'000'000;

class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Every tensor in header order (for files spindle writes: the order they were given in).
  const std::vector<std::string>& names() const { return names_; }
  bool contains(std::string_view name) const { return records_.count(std::string(name)) != 0; }
  // nullptr if absent. A tensor whose dtype spindle cannot load (F8_*, I16, ...) throws here,
  // naming it, so a file that also holds such tensors still opens and serves the others.
  const TensorRecord* find(std::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  struct Entry {
    TensorRecord record;
    bool loadable = true;
  };
  void parse_header(std::string_view header_json, size_t data_begin, size_t data_bytes);

  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  std::vector<std::string> names_;
  std::unordered_map<std::string, Entry> records_;
  std::map<std::string, std::string> metadata_;
};

}  // namespace spindle::io
