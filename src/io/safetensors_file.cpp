#include "io/safetensors_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <optional>
#include <set>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace spindle::io {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian; big-endian hosts are unsupported");

namespace {

struct StoredDtype {
  std::string_view name;
  unsigned bits;
  std::optional<DType> loads_as;  // empty: known to the format, not loadable by spindle
};

// Every dtype of the safetensors format; sizes are needed even for those spindle cannot load, to
// validate the file's layout.
constexpr StoredDtype kStoredDtypes[] = {
    {"F64", 64, DType::F64},  {"F32", 32, DType::F32},  {"BF16", 16, DType::BF16}, {"F16", 16, DType::F16},
    {"I64", 64, DType::I64},  {"I32", 32, DType::I32},  {"U8", 8, DType::U8},      {"BOOL", 8, DType::U8},
    {"U64", 64, {}},          {"U32", 32, {}},          {"I16", 16, {}},           {"U16", 16, {}},
    {"I8", 8, {}},            {"F8_E4M3", 8, {}},       {"F8_E5M2", 8, {}},        {"F8_E8M0", 8, {}},
    {"C64", 64, {}},          {"F6_E2M3", 6, {}},       {"F6_E3M2", 6, {}},        {"F4", 4, {}},
};

const StoredDtype* stored_dtype(std::string_view name) {
  for (const StoredDtype& d : kStoredDtypes)
    if (d.name == name) return &d;
  return nullptr;
}

std::string errno_text() { return std::strerror(errno); }

// nlohmann keeps the last of duplicate keys silently; a duplicated tensor name means a corrupt or
// hand-edited header, so the parser callback records the first duplicate at any nesting level.
struct DuplicateKeyFinder {
  std::vector<std::set<std::string>> open_objects;
  std::string duplicate;
  bool duplicate_at_top = false;

  bool operator()(int /*depth*/, nlohmann::ordered_json::parse_event_t event, nlohmann::ordered_json& parsed) {
    using Event = nlohmann::ordered_json::parse_event_t;
    if (event == Event::object_start) open_objects.emplace_back();
    else if (event == Event::object_end) open_objects.pop_back();
    else if (event == Event::key && !open_objects.empty()) {
      if (!open_objects.back().insert(parsed.get<std::string>()).second && duplicate.empty()) {
        duplicate = parsed.get<std::string>();
        duplicate_at_top = open_objects.size() == 1;
      }
    }
    return true;
  }
};

}  // namespace

SafetensorsFile::SafetensorsFile(const std::string& path) : path_(path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail("cannot open safetensors file {}: {}", path, errno_text());
  struct stat info {};
  if (::fstat(fd, &info) != 0 || !S_ISREG(info.st_mode)) {
    ::close(fd);
    fail("{} is not a regular file; pass a .safetensors file or a model folder", path);
  }
  const size_t file_bytes = static_cast<size_t>(info.st_size);
  if (file_bytes < 8) {
    ::close(fd);
    fail("{} is truncated: {} bytes, but a safetensors file starts with an 8-byte header length; "
         "re-download or re-save it", path, file_bytes);
  }
  void* mapping = ::mmap(nullptr, file_bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  int mmap_errno = errno;
  ::close(fd);  // the mapping keeps the file alive
  if (mapping == MAP_FAILED) fail("cannot memory-map {}: {}", path, std::strerror(mmap_errno));
  mapping_ = mapping;
  mapping_bytes_ = file_bytes;

  try {
    uint64_t header_bytes = 0;
    std::memcpy(&header_bytes, mapping_, 8);
    if (header_bytes > kMaxSafetensorsHeaderBytes)
      fail("{}: header length field says {} bytes, above the {}-byte limit of the format; the file is "
           "corrupt or not a safetensors file", path, header_bytes, kMaxSafetensorsHeaderBytes);
    if (header_bytes > file_bytes - 8)
      fail("{}: header length field says {} bytes but only {} bytes follow it; the file is truncated or "
           "not a safetensors file (re-download it)", path, header_bytes, file_bytes - 8);
    const char* base = static_cast<const char*>(mapping_);
    parse_header(std::string_view(base + 8, header_bytes), 8 + header_bytes, file_bytes - 8 - header_bytes);
  } catch (...) {
    ::munmap(mapping_, mapping_bytes_);
    throw;
  }
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_) ::munmap(mapping_, mapping_bytes_);
}

void SafetensorsFile::parse_header(std::string_view header_json, size_t data_begin, size_t data_bytes) {
  using Json = nlohmann::ordered_json;
  DuplicateKeyFinder duplicates;
  Json header;
  try {
    header = Json::parse(header_json.begin(), header_json.end(), std::ref(duplicates));
  } catch (const Json::exception& e) {
    fail("{}: the safetensors header is not valid JSON ({}); the file is corrupt or not a safetensors file",
         path_, e.what());
  }
  if (!header.is_object())
    fail("{}: the safetensors header must be a JSON object of tensors, got a JSON {}", path_, header.type_name());
  if (!duplicates.duplicate.empty()) {
    if (duplicates.duplicate_at_top)
      fail("{}: tensor '{}' appears twice in the header; the file is corrupt", path_, duplicates.duplicate);
    fail("{}: key '{}' appears twice in one object of the header; the file is corrupt", path_, duplicates.duplicate);
  }

  struct Span {
    size_t begin, end;
    const std::string* name;
  };
  std::vector<Span> spans;
  const char* data = static_cast<const char*>(mapping_) + data_begin;

  for (const auto& [name, value] : header.items()) {
    if (name == "__metadata__") {
      if (!value.is_object()) fail("{}: __metadata__ must be an object of strings, got a JSON {}", path_, value.type_name());
      for (const auto& [key, text] : value.items()) {
        if (!text.is_string())
          fail("{}: __metadata__ entry '{}' must be a string, got a JSON {}", path_, key, text.type_name());
        metadata_[key] = text.get<std::string>();
      }
      continue;
    }
    auto bad = [&](std::string_view what) {
      fail("{}: tensor '{}' has a malformed header entry: {}; the file is corrupt", path_, name, what);
    };
    if (!value.is_object()) bad("expected an object with dtype, shape and data_offsets");
    auto dtype_it = value.find("dtype"), shape_it = value.find("shape"), offsets_it = value.find("data_offsets");
    if (dtype_it == value.end() || !dtype_it->is_string()) bad("'dtype' missing or not a string");
    if (shape_it == value.end() || !shape_it->is_array()) bad("'shape' missing or not an array");
    if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2 ||
        !(*offsets_it)[0].is_number_unsigned() || !(*offsets_it)[1].is_number_unsigned())
      bad("'data_offsets' must be two non-negative integers [begin, end]");

    Entry entry;
    TensorRecord& rec = entry.record;
    rec.name = name;
    rec.file = path_;
    rec.stored_dtype = dtype_it->get<std::string>();

    if (shape_it->size() > static_cast<size_t>(Shape::kMaxDims))
      fail("{}: tensor '{}' has {} dimensions; spindle supports at most {}", path_, name, shape_it->size(),
           Shape::kMaxDims);
    uint64_t numel = 1;
    bool numel_overflows = false;
    for (const Json& dim : *shape_it) {
      if (!dim.is_number_unsigned()) bad("'shape' must hold non-negative integers");
      uint64_t d = dim.get<uint64_t>();
      if (d > static_cast<uint64_t>(INT64_MAX)) bad("a dimension is too large");
      rec.shape.push(static_cast<int64_t>(d));
      numel_overflows |= __builtin_mul_overflow(numel, d, &numel);
    }

    const uint64_t begin = (*offsets_it)[0].get<uint64_t>(), end = (*offsets_it)[1].get<uint64_t>();
    if (begin > end) fail("{}: tensor '{}' has data_offsets [{}, {}] that end before they begin; the file is corrupt",
                          path_, name, begin, end);
    if (end > data_bytes)
      fail("{}: tensor '{}' has data_offsets [{}, {}] but the file holds only {} data bytes after the header; "
           "the file is truncated or corrupt (re-download it)", path_, name, begin, end, data_bytes);

    if (const StoredDtype* known = stored_dtype(rec.stored_dtype)) {
      uint64_t bits = 0;
      std::string needed;
      if (numel_overflows || __builtin_mul_overflow(numel, uint64_t{known->bits}, &bits))
        needed = "more bytes than a 64-bit size holds";
      else if (bits % 8 != 0)
        needed = fmt::format("{} bits, not a whole number of bytes", bits);
      else if (bits / 8 != end - begin)
        needed = fmt::format("{} bytes", bits / 8);
      if (!needed.empty())
        fail("{}: tensor '{}' is {}{} which needs {}, but its data_offsets [{}, {}] span {} bytes; the header's "
             "shape or offsets are wrong", path_, name, rec.stored_dtype, rec.shape.str(), needed, begin, end,
             end - begin);
      entry.loadable = known->loads_as.has_value();
      if (entry.loadable) rec.dtype = *known->loads_as;
    } else {
      // Not in the format's dtype list: still laid out in the file, so keep it for the layout checks
      // and fail only if someone asks for it.
      entry.loadable = false;
    }
    rec.data = data + begin;
    rec.bytes = static_cast<size_t>(end - begin);

    names_.push_back(name);
    auto inserted = records_.emplace(name, std::move(entry)).first;
    spans.push_back({begin, end, &inserted->first});
  }

  // The data buffer must be tiled exactly: what one tensor owns no other may, and no byte is unowned
  // (the reference implementation rejects both, and a hole usually means a truncated rewrite).
  std::stable_sort(spans.begin(), spans.end(),
                   [](const Span& a, const Span& b) { return a.begin != b.begin ? a.begin < b.begin : a.end < b.end; });
  size_t covered = 0;
  const std::string* last_name = nullptr;
  for (const Span& span : spans) {
    if (span.begin < covered)
      fail("{}: tensors '{}' and '{}' overlap in the data buffer (bytes {} to {}); the file is corrupt", path_,
           *last_name, *span.name, span.begin, covered);
    if (span.begin > covered)
      fail("{}: data bytes [{}, {}) belong to no tensor (a hole before tensor '{}'); the file is corrupt", path_,
           covered, span.begin, *span.name);
    covered = span.end;
    last_name = span.name;
  }
  if (covered != data_bytes)
    fail("{}: data bytes [{}, {}) at the end of the file belong to no tensor; the file is corrupt", path_, covered,
         data_bytes);
}

const TensorRecord* SafetensorsFile::find(std::string_view name) const {
  auto it = records_.find(std::string(name));
  if (it == records_.end()) return nullptr;
  if (!it->second.loadable)
    fail("tensor '{}' in {} has dtype {}, which spindle cannot load (it loads F32, F64, BF16, F16, I32, I64, U8 "
         "and BOOL); convert the checkpoint to BF16 or F32 first", name, path_, it->second.record.stored_dtype);
  return &it->second.record;
}

}  // namespace spindle::io
