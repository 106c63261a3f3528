#include "io/write_safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace spindle::io {

namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

// A file that appears at its final path only once it is complete and on disk.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path) : path_(std::move(path)) {
    temp_path_ = path_ + ".tmp." + std::to_string(::getpid());
    fd_ = ::open(temp_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) fail("cannot create {}: {}; check that the folder exists and is writable", temp_path_, errno_text());
  }
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  ~AtomicFile() {
    if (fd_ >= 0) ::close(fd_);
    if (!committed_) ::unlink(temp_path_.c_str());
  }

  void write(const void* data, size_t bytes) {
    const char* p = static_cast<const char*>(data);
    while (bytes > 0) {
      ssize_t n = ::write(fd_, p, bytes);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) fail("writing {} failed: {} (is the disk full?)", path_, n < 0 ? errno_text() : "no progress");
      p += n;
      bytes -= static_cast<size_t>(n);
    }
  }

  void commit() {
    if (::fsync(fd_) != 0) fail("flushing {} to disk failed: {}", path_, errno_text());
    int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) fail("closing {} failed: {}", path_, errno_text());
    if (::rename(temp_path_.c_str(), path_.c_str()) != 0)
      fail("cannot move {} to {}: {}", temp_path_, path_, errno_text());
    committed_ = true;
    // The rename itself must survive a crash too.
    std::string folder = fs::path(path_).parent_path().string();
    int dir_fd = ::open(folder.empty() ? "." : folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dir_fd >= 0) {
      ::fsync(dir_fd);
      ::close(dir_fd);
    }
  }

 private:
  std::string path_, temp_path_;
  int fd_ = -1;
  bool committed_ = false;
};

void check_names(const std::string& path, const NamedTensors& tensors) {
  std::set<std::string_view> seen;
  for (const auto& [name, tensor] : tensors) {
    if (name.empty()) fail("cannot write {}: a tensor has an empty name", path);
    if (name == "__metadata__") fail("cannot write {}: '__metadata__' is reserved and cannot name a tensor", path);
    if (!seen.insert(name).second) fail("cannot write {}: tensor name '{}' is given twice", path, name);
    if (!tensor.defined()) fail("cannot write {}: tensor '{}' is undefined (never allocated)", path, name);
  }
}

std::string header_json(const std::string& path, const NamedTensors& tensors,
                        const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    std::vector<int64_t> shape;
    for (int i = 0; i < tensor.rank(); ++i) shape.push_back(tensor.dim(i));
    nlohmann::ordered_json entry;
    entry["dtype"] = std::string(dtype_name(tensor.dtype()));
    entry["shape"] = shape;
    entry["data_offsets"] = {offset, offset + tensor.bytes()};
    header[name] = std::move(entry);
    offset += tensor.bytes();
  }
  std::string text;
  try {
    text = header.dump();
  } catch (const nlohmann::json::exception& e) {
    fail("cannot write {}: a tensor name or metadata string is not valid UTF-8 ({})", path, e.what());
  }
  // Padding keeps the data buffer 8-byte aligned in the file, so mapped tensors are aligned.
  text.append((8 - text.size() % 8) % 8, ' ');
  return text;
}

const std::regex kShardName(R"(model-\d{5}-of-\d{5}\.safetensors)");

// Weight files of an earlier save that the one just written does not include.
void remove_stale_weight_files(const fs::path& folder, const std::set<std::string>& written) {
  for (const fs::directory_entry& entry : fs::directory_iterator(folder)) {
    const std::string name = entry.path().filename().string();
    const bool weight_file = name == "model.safetensors" || name == "model.safetensors.index.json" ||
                             std::regex_match(name, kShardName);
    if (weight_file && written.count(name) == 0) {
      std::error_code ec;
      fs::remove(entry.path(), ec);
      if (ec) fail("cannot remove stale weight file {} from an earlier save: {}", entry.path().string(), ec.message());
    }
  }
}

}  // namespace

void write_safetensors(const std::string& path, const NamedTensors& tensors, Backend& backend,
                       const std::map<std::string, std::string>& metadata) {
  check_names(path, tensors);
  const std::string header = header_json(path, tensors, metadata);
  AtomicFile file(path);
  const uint64_t header_bytes = header.size();
  file.write(&header_bytes, 8);  // little-endian: the only byte order spindle builds for
  file.write(header.data(), header.size());
  std::vector<char> host;
  Stream stream = backend.default_stream();
  for (const auto& [name, tensor] : tensors) {
    host.resize(tensor.bytes());
    backend.copy_to_host(stream, tensor, host.data());
    file.write(host.data(), host.size());
  }
  file.commit();
}

void write_sharded_safetensors(const std::string& dir, const NamedTensors& tensors, Backend& backend,
                               size_t max_shard_bytes, const std::map<std::string, std::string>& metadata) {
  if (max_shard_bytes == 0) fail("cannot write {}: the maximum shard size must be positive", dir);
  check_names(dir, tensors);
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) fail("cannot create model folder {}: {}", dir, ec.message());

  std::map<std::string, std::string> file_metadata = metadata;
  file_metadata.emplace("format", "pt");  // transformers refuses safetensors weights without it

  // Greedy in the given order, as huggingface_hub splits state dicts: a tensor that would overflow the
  // current shard starts the next one.
  std::vector<NamedTensors> shards(1);
  size_t shard_bytes = 0, total_bytes = 0;
  for (const auto& named : tensors) {
    const size_t bytes = named.second.bytes();
    if (!shards.back().empty() && shard_bytes + bytes > max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(named);
    shard_bytes += bytes;
    total_bytes += bytes;
  }

  const fs::path folder(dir);
  if (shards.size() == 1) {
    write_safetensors((folder / "model.safetensors").string(), tensors, backend, file_metadata);
    remove_stale_weight_files(folder, {"model.safetensors"});
    return;
  }

  nlohmann::json weight_map = nlohmann::json::object();
  std::set<std::string> written;
  for (size_t k = 0; k < shards.size(); ++k) {
    const std::string shard_name = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size());
    write_safetensors((folder / shard_name).string(), shards[k], backend, file_metadata);
    for (const auto& named : shards[k]) weight_map[named.first] = shard_name;
    written.insert(shard_name);
  }
  // Written last: until the index is in place, a reader never sees the new shards as a checkpoint.
  nlohmann::json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", weight_map}};
  const std::string index_text = index.dump(2, ' ', /*ensure_ascii=*/true) + "\n";  // as json.dumps(indent=2, sort_keys=True)
  AtomicFile index_file((folder / "model.safetensors.index.json").string());
  index_file.write(index_text.data(), index_text.size());
  index_file.commit();
  written.insert("model.safetensors.index.json");
  remove_stale_weight_files(folder, written);
}

}  // namespace spindle::io
