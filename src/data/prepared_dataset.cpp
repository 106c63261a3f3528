#include "data/prepared_dataset.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <fstream>

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "data/dataset_reader.h"
#include "data/pretokenized.h"

namespace spindle {

static_assert(std::endian::native == std::endian::little,
              "the prepared dataset format is little-endian; add byte swapping for this host");

namespace {

constexpr uint64_t kHeaderBytes = 64;
constexpr uint64_t kIndexEntryBytes = 16;
constexpr uint32_t kHasLossScale = 1;

struct Header {
  char magic[8];
  uint32_t version;
  uint32_t kind;
  uint64_t num_documents;
  uint64_t num_tokens;
  uint64_t index_offset;
  uint64_t file_bytes;
  uint64_t reserved[2];
};
static_assert(sizeof(Header) == kHeaderBytes);

uint64_t record_bytes(uint64_t length, uint32_t flags) {
  return length * (2 * sizeof(int32_t) + ((flags & kHasLossScale) ? sizeof(float) : 0));
}

template <typename T>
T load(const unsigned char* at) {
  T value;
  std::memcpy(&value, at, sizeof(T));
  return value;
}

}  // namespace

std::string_view dataset_kind_name(DatasetKind kind) {
  return kind == DatasetKind::kPreferencePairs ? "preference-pairs" : "documents";
}

// ---- writer ----

PreparedDatasetWriter::PreparedDatasetWriter(std::filesystem::path path, DatasetKind kind)
    : path_(std::move(path)), kind_(kind), stream_buffer_(size_t{1} << 22) {
  temp_path_ = path_;
  temp_path_ += fmt::format(".tmp-{}", ::getpid());
  file_ = std::fopen(temp_path_.c_str(), "wb");
  if (!file_)
    fail("cannot create {}: {}; check that the output directory is writable", temp_path_.string(),
         std::strerror(errno));
  std::setvbuf(file_, stream_buffer_.data(), _IOFBF, stream_buffer_.size());
  const Header placeholder{};  // zero magic: an unfinished file is never mistaken for a dataset
  write(&placeholder, sizeof placeholder);
}

PreparedDatasetWriter::~PreparedDatasetWriter() {
  if (file_) std::fclose(file_);
  if (!finished_) {
    std::error_code ec;
    std::filesystem::remove(temp_path_, ec);
  }
}

void PreparedDatasetWriter::write(const void* data, size_t bytes) {
  if (bytes == 0) return;
  if (std::fwrite(data, 1, bytes, file_) != bytes)
    fail("writing {} failed after {} bytes: {} (is the disk full?)", temp_path_.string(), offset_,
         std::strerror(errno));
  offset_ += bytes;
}

void PreparedDatasetWriter::add(const DocumentView& document) {
  SPINDLE_CHECK(!finished_, "add after finish");
  const uint64_t length = document.input_ids.size();
  if (length == 0) fail("cannot write an empty document to {}", path_.string());
  if (length > UINT32_MAX) fail("a document of {} tokens is too long for the prepared format", length);
  SPINDLE_CHECK(document.labels.size() == length &&
                    (document.loss_scale.empty() || document.loss_scale.size() == length),
                "document arrays differ in length");
  const uint32_t flags = document.loss_scale.empty() ? 0 : kHasLossScale;
  index_.push_back({offset_, static_cast<uint32_t>(length), flags});
  write(document.input_ids.data(), length * sizeof(int32_t));
  write(document.labels.data(), length * sizeof(int32_t));
  if (flags & kHasLossScale) write(document.loss_scale.data(), length * sizeof(float));
  tokens_ += static_cast<int64_t>(length);
}

void PreparedDatasetWriter::finish() {
  SPINDLE_CHECK(!finished_, "finish called twice");
  const uint64_t padding = (8 - offset_ % 8) % 8;
  const char zeros[8] = {};
  write(zeros, padding);
  const uint64_t index_offset = offset_;
  for (const auto& entry : index_) {
    unsigned char bytes[kIndexEntryBytes];
    std::memcpy(bytes, &entry.offset, 8);
    std::memcpy(bytes + 8, &entry.length, 4);
    std::memcpy(bytes + 12, &entry.flags, 4);
    write(bytes, sizeof bytes);
  }
  Header header{};
  std::memcpy(header.magic, kPreparedMagic, sizeof header.magic);
  header.version = kPreparedVersion;
  header.kind = static_cast<uint32_t>(kind_);
  header.num_documents = index_.size();
  header.num_tokens = static_cast<uint64_t>(tokens_);
  header.index_offset = index_offset;
  header.file_bytes = offset_;
  if (std::fseek(file_, 0, SEEK_SET) != 0 || std::fwrite(&header, sizeof header, 1, file_) != 1 ||
      std::fflush(file_) != 0 || ::fsync(::fileno(file_)) != 0)
    fail("writing {} failed: {} (is the disk full?)", temp_path_.string(), std::strerror(errno));
  std::fclose(file_);
  file_ = nullptr;
  std::error_code ec;
  std::filesystem::rename(temp_path_, path_, ec);
  if (ec) fail("cannot rename {} to {}: {}", temp_path_.string(), path_.string(), ec.message());
  finished_ = true;
}

// ---- reader ----

struct PreparedDataset::Mapping {
  void* data = MAP_FAILED;
  size_t bytes = 0;
  ~Mapping() {
    if (data != MAP_FAILED) ::munmap(data, bytes);
  }
  const unsigned char* begin() const { return static_cast<const unsigned char*>(data); }
};

PreparedDataset PreparedDataset::open(const std::filesystem::path& path) {
  PreparedDataset dataset;
  dataset.path_ = std::filesystem::is_directory(path) ? path / kPreparedDataFile : path;
  const std::string name = dataset.path_.string();
  const int fd = ::open(dataset.path_.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    fail("cannot open prepared dataset {}: {}; run `spindle prepare` first or check the path", name,
         std::strerror(errno));
  struct stat info {};
  if (::fstat(fd, &info) != 0) {
    ::close(fd);
    fail("cannot stat {}: {}", name, std::strerror(errno));
  }
  auto mapping = std::make_shared<Mapping>();
  mapping->bytes = static_cast<size_t>(info.st_size);
  if (mapping->bytes >= kHeaderBytes)
    mapping->data = ::mmap(nullptr, mapping->bytes, PROT_READ, MAP_SHARED, fd, 0);
  const int map_errno = errno;
  ::close(fd);
  if (mapping->bytes < kHeaderBytes)
    fail("{} is not a prepared dataset: {} bytes is shorter than the header", name, mapping->bytes);
  if (mapping->data == MAP_FAILED) fail("cannot map {}: {}", name, std::strerror(map_errno));

  Header header;
  std::memcpy(&header, mapping->begin(), sizeof header);
  if (std::memcmp(header.magic, kPreparedMagic, sizeof header.magic) != 0)
    fail("{} is not a prepared dataset (bad magic); create it with `spindle prepare`", name);
  if (header.version != kPreparedVersion)
    fail("{} has prepared-dataset version {}, this spindle reads version {}; prepare the data again",
         name, header.version, kPreparedVersion);
  if (header.kind > static_cast<uint32_t>(DatasetKind::kPreferencePairs))
    fail("{} has unknown dataset kind {}", name, header.kind);
  if (header.file_bytes != mapping->bytes)
    fail("{} is {} bytes but its header says {}: the file is truncated or was modified; prepare the "
         "data again",
         name, mapping->bytes, header.file_bytes);
  if (header.index_offset < kHeaderBytes || header.index_offset % 8 != 0 ||
      header.num_documents > (header.file_bytes - kHeaderBytes) / kIndexEntryBytes ||
      header.index_offset + header.num_documents * kIndexEntryBytes != header.file_bytes)
    fail("{} has an inconsistent document index (offset {}, {} documents, {} bytes); prepare the "
         "data again",
         name, header.index_offset, header.num_documents, header.file_bytes);

  dataset.index_ = mapping->begin() + header.index_offset;
  uint64_t tokens = 0;
  for (uint64_t i = 0; i < header.num_documents; ++i) {
    const unsigned char* entry = dataset.index_ + i * kIndexEntryBytes;
    const auto offset = load<uint64_t>(entry);
    const auto length = load<uint32_t>(entry + 8);
    const auto flags = load<uint32_t>(entry + 12);
    if (length == 0 || offset < kHeaderBytes || offset % 4 != 0 || (flags & ~kHasLossScale) != 0 ||
        offset > header.index_offset || record_bytes(length, flags) > header.index_offset - offset)
      fail("{}: document {} has an invalid index entry (offset {}, length {}); prepare the data again",
           name, i, offset, length);
    tokens += length;
  }
  if (tokens != header.num_tokens)
    fail("{}: the index holds {} tokens but the header says {}; prepare the data again", name, tokens,
         header.num_tokens);
  if (header.kind == static_cast<uint32_t>(DatasetKind::kPreferencePairs) && header.num_documents % 2)
    fail("{}: a preference dataset must hold an even number of documents, found {}", name,
         header.num_documents);
  dataset.kind_ = static_cast<DatasetKind>(header.kind);
  dataset.num_documents_ = static_cast<int64_t>(header.num_documents);
  dataset.num_tokens_ = static_cast<int64_t>(header.num_tokens);
  dataset.mapping_ = std::move(mapping);
  return dataset;
}

int64_t PreparedDataset::document_length(int64_t index) const {
  if (index < 0 || index >= num_documents_)
    fail("document {} is out of range: {} holds {} documents", index, path_.string(), num_documents_);
  return load<uint32_t>(index_ + index * kIndexEntryBytes + 8);
}

DocumentView PreparedDataset::document(int64_t index) const {
  const int64_t length = document_length(index);
  const unsigned char* entry = index_ + index * kIndexEntryBytes;
  // Records are 4-byte aligned (checked at open), so the arrays can be viewed in place.
  const auto* ids = reinterpret_cast<const int32_t*>(mapping_->begin() + load<uint64_t>(entry));
  const auto flags = load<uint32_t>(entry + 12);
  DocumentView view;
  view.input_ids = {ids, static_cast<size_t>(length)};
  view.labels = {ids + length, static_cast<size_t>(length)};
  if (flags & kHasLossScale)
    view.loss_scale = {reinterpret_cast<const float*>(ids + 2 * length), static_cast<size_t>(length)};
  return view;
}

std::vector<RowPlan> plan_prepared_rows(const PreparedDataset& dataset, const PackOptions& options,
                                        PackStats& stats) {
  options.validate();
  std::vector<DocumentSlice> slices;
  slices.reserve(static_cast<size_t>(dataset.num_documents()));
  for (int64_t i = 0; i < dataset.num_documents(); ++i) {
    auto slice = fit_document(i, dataset.document(i), options, stats,
                              fmt::format("{} document {}", dataset.path().string(), i));
    if (slice) slices.push_back(*slice);
  }
  return plan_rows(std::move(slices), options);
}

std::vector<std::vector<RowPlan>> plan_prepared_pairs(const PreparedDataset& dataset, const PackOptions& options,
                                                      PackStats& stats, int64_t& pairs_dropped) {
  options.validate();
  if (dataset.kind() != DatasetKind::kPreferencePairs)
    fail("{} holds {}, not preference pairs (chosen/rejected)", dataset.path().string(), dataset_kind_name(dataset.kind()));
  std::vector<std::pair<DocumentSlice, DocumentSlice>> pairs;  // kept pairs: (chosen, rejected)
  std::vector<DocumentSlice> units;  // one per pair packed as a whole: document = index into `pairs`
  std::vector<std::pair<int64_t, std::vector<RowPlan>>> groups;  // (first pair, rows)
  for (int64_t i = 0; i < dataset.num_documents() / 2; ++i) {
    auto side = [&](int64_t d, const char* name) {
      return fit_document(d, dataset.document(d), options, stats,
                          fmt::format("{} pair {} ({})", dataset.path().string(), i, name));
    };
    const auto chosen = side(2 * i, "chosen");
    const auto rejected = side(2 * i + 1, "rejected");
    if (!chosen || !rejected) {
      ++pairs_dropped;
      continue;
    }
    const int64_t together = chosen->length + rejected->length;
    if (together > options.max_length) {
      groups.push_back({i, {RowPlan{{*chosen}, chosen->length}, RowPlan{{*rejected}, rejected->length}}});
    } else if (!options.packing) {
      groups.push_back({i, {RowPlan{{*chosen, *rejected}, together}}});
    } else {
      units.push_back({static_cast<int64_t>(pairs.size()), 0, together});
      pairs.emplace_back(*chosen, *rejected);
    }
  }
  for (const RowPlan& packed : plan_rows(std::move(units), options)) {
    RowPlan row;
    for (const DocumentSlice& unit : packed.slices) {
      const auto& [chosen, rejected] = pairs[static_cast<size_t>(unit.document)];
      row.slices.push_back(chosen);
      row.slices.push_back(rejected);
    }
    row.tokens = packed.tokens;
    groups.push_back({row.slices.front().document / 2, {std::move(row)}});
  }
  std::stable_sort(groups.begin(), groups.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<std::vector<RowPlan>> out;
  out.reserve(groups.size());
  for (auto& g : groups) out.push_back(std::move(g.second));
  return out;
}

// ---- prepare ----

std::string PrepareReport::summary() const {
  std::string text = fmt::format("{}\nwrote {} {} ({} documents, {} tokens, {:.1f} MB) to {}",
                                 read.summary(), with_thousands(kind == DatasetKind::kPreferencePairs
                                                                    ? documents / 2
                                                                    : documents),
                                 kind == DatasetKind::kPreferencePairs ? "preference pairs" : "samples",
                                 with_thousands(documents), with_thousands(tokens),
                                 static_cast<double>(bytes_written) / 1e6, file.string());
  if (fit.documents_truncated)
    text += fmt::format("\ntruncated {} over-long documents, cutting {} tokens",
                        with_thousands(fit.documents_truncated), with_thousands(fit.tokens_truncated));
  if (fit.documents_dropped_over_length)
    text += fmt::format("\ndropped {} over-long documents ({} tokens)",
                        with_thousands(fit.documents_dropped_over_length),
                        with_thousands(fit.tokens_dropped_over_length));
  if (fit.documents_without_targets)
    text += fmt::format("\n{} documents have no supervised target{}",
                        with_thousands(fit.documents_without_targets),
                        fit.documents_dropped_without_targets ? " (dropped)" : " (kept)");
  if (pairs_dropped) text += fmt::format("\ndropped {} preference pairs with a dropped side", with_thousands(pairs_dropped));
  const double mb = static_cast<double>(read.bytes) / 1e6;
  text += fmt::format("\n{:.1f} MB of {} in {:.2f} s ({:.1f} MB/s)", mb, source_format, seconds,
                      seconds > 0 ? mb / seconds : 0.0);
  return text;
}

namespace {

// Applies the fit policies and returns the kept part of the document as an owned Document view.
std::optional<DocumentView> fitted(const Document& doc, const PackOptions& fit, PackStats& stats,
                                   const std::string& origin) {
  auto slice = fit_document(0, view_of(doc), fit, stats, origin);
  if (!slice) return std::nullopt;
  DocumentView view = view_of(doc);
  view.input_ids = view.input_ids.subspan(slice->begin, slice->length);
  view.labels = view.labels.subspan(slice->begin, slice->length);
  if (!view.loss_scale.empty()) view.loss_scale = view.loss_scale.subspan(slice->begin, slice->length);
  return view;
}

void write_info(const PrepareOptions& options, const DatasetFiles& data, const PrepareReport& report) {
  nlohmann::ordered_json info;
  info["format"] = "spindle prepared dataset";
  info["version"] = kPreparedVersion;
  info["data_file"] = kPreparedDataFile;
  info["kind"] = dataset_kind_name(report.kind);
  std::error_code error;
  info["source"] = std::filesystem::exists(options.data, error) ? std::filesystem::absolute(options.data).string()
                                                               : options.data.string();
  info["source_format"] = data_file_format_name(data.format);
  if (!data.split.empty()) info["source_split"] = data.split;
  if (data.files.size() != 1 || data.files[0] != options.data) {
    info["source_files"] = nlohmann::json::array();
    for (const auto& file : data.files) info["source_files"].push_back(std::filesystem::absolute(file).string());
  }
  info["source_bytes"] = report.read.bytes;
  info["tokenizer"] = options.tokenizer_description;
  info["sample_format"] = sample_format_name(options.encode.format);
  info["append_eos"] = options.encode.append_eos;
  info["max_length"] = options.fit.max_length;
  info["over_length"] = over_length_name(options.fit.over_length);
  info["drop_documents_without_targets"] = options.fit.drop_documents_without_targets;
  info["documents"] = report.documents;
  info["tokens"] = report.tokens;
  info["lines"] = report.read.lines;
  if (data.is_table()) info["rows"] = report.read.rows;
  info["samples"] = report.read.samples;
  info["skipped_samples"] = report.read.skipped;
  info["skip_examples"] = report.read.skip_examples;
  info["documents_truncated"] = report.fit.documents_truncated;
  info["tokens_truncated"] = report.fit.tokens_truncated;
  info["documents_dropped_over_length"] = report.fit.documents_dropped_over_length;
  info["documents_without_targets"] = report.fit.documents_without_targets;
  info["documents_dropped_without_targets"] = report.fit.documents_dropped_without_targets;
  info["preference_pairs_dropped"] = report.pairs_dropped;
  const auto path = options.output_dir / kPreparedInfoFile;
  auto temp = path;
  temp += fmt::format(".tmp-{}", ::getpid());
  {
    std::ofstream out(temp);
    out << info.dump(2) << '\n';
    if (!out) fail("cannot write {}", temp.string());
  }
  std::filesystem::rename(temp, path);
}

}  // namespace

PrepareReport prepare_dataset(const PrepareOptions& options, const TextEncoder* text_encoder) {
  const auto start = std::chrono::steady_clock::now();
  options.fit.validate();
  // Before anything is created: the files are there and readable, each table has a sample column.
  check_data_value(options.data.string());
  const DatasetFiles data = resolve_dataset(options.data.string());
  std::error_code ec;
  std::filesystem::create_directories(options.output_dir, ec);
  if (ec) fail("cannot create output directory {}: {}", options.output_dir.string(), ec.message());

  PrepareReport report;
  report.file = options.output_dir / kPreparedDataFile;
  SampleEncoder encoder(text_encoder, options.encode);
  std::unique_ptr<PreparedDatasetWriter> writer;
  std::optional<DatasetKind> kind;
  if (options.encode.format == SampleFormat::kPreference) kind = DatasetKind::kPreferencePairs;
  else if (options.encode.format != SampleFormat::kAuto) kind = DatasetKind::kDocuments;

  const bool may_be_pretokenized = options.encode.format == SampleFormat::kAuto ||
                                   options.encode.format == SampleFormat::kPretokenized;
  for_each_sample(data, options.encode.read, report.read, [&](const RawSample& raw) {
    const std::string origin = raw.location();
    auto add_document = [&](const Document& doc) {
      if (!writer) writer = std::make_unique<PreparedDatasetWriter>(report.file, *kind);
      if (auto view = fitted(doc, options.fit, report.fit, origin)) writer->add(*view);
    };
    // Pre-tokenized lines skip the JSON tree (the slow part); anything else takes the full path.
    if (!raw.row && may_be_pretokenized && kind != DatasetKind::kPreferencePairs) {
      if (auto doc = parse_pretokenized_line(raw.line, encoder.read_options())) {
        kind = DatasetKind::kDocuments;
        add_document(*doc);
        return;
      }
    }
    // Key order kept: chat templates print tool schemas and arguments in the data's order (a
    // table's in its schema's order).
    nlohmann::ordered_json parsed;
    if (!raw.row) parsed = SampleEncoder::parse_sample(raw.line);
    const nlohmann::ordered_json& sample = raw.row ? *raw.row : parsed;
    if (!kind)  // the first sample decides; later samples of the other kind are errors
      kind = encoder.format_of(sample) == SampleFormat::kPreference ? DatasetKind::kPreferencePairs
                                                                     : DatasetKind::kDocuments;
    if (*kind == DatasetKind::kDocuments) {
      add_document(encoder.encode(sample));
      return;
    }
    if (!writer) writer = std::make_unique<PreparedDatasetWriter>(report.file, *kind);
    PreferenceDocuments pair = encoder.encode_preference(sample);
    auto chosen = fitted(pair.chosen, options.fit, report.fit, origin + " (chosen)");
    auto rejected = fitted(pair.rejected, options.fit, report.fit, origin + " (rejected)");
    if (!chosen || !rejected) {
      ++report.pairs_dropped;
      return;
    }
    writer->add(*chosen);
    writer->add(*rejected);
  });

  if (!writer || writer->documents() == 0)
    fail("{}: no training documents left ({}; {} dropped as over-long, {} without a supervised "
         "target); nothing was written",
         data.describe(), report.read.summary(), report.fit.documents_dropped_over_length,
         report.fit.documents_dropped_without_targets);
  report.kind = *kind;
  report.source_format = data_file_format_name(data.format);
  report.documents = writer->documents();
  report.tokens = writer->tokens();
  writer->finish();
  report.bytes_written = writer->bytes_written();
  write_info(options, data, report);
  report.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return report;
}

}  // namespace spindle
