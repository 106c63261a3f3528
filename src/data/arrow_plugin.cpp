// libspindle_arrow.so: Parquet and Arrow IPC files through Apache Arrow's C++ library, each row as
// a JSON object (table_file.h). Loaded by table_reader.cpp; never linked into spindle itself.
#include <arrow/api.h>
#include <arrow/io/file.h>
#include <arrow/ipc/reader.h>
#include <arrow/util/config.h>
#include <arrow/util/float16.h>
#include <parquet/arrow/reader.h>
#include <parquet/arrow/schema.h>
#include <parquet/exception.h>
#include <parquet/file_reader.h>
#include <parquet/properties.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <fstream>
#include <optional>

#include "data/table_file.h"

namespace spindle::table {

namespace {

using json = nlohmann::ordered_json;

// Rows per decoded Parquet batch: few, because a long-context row may hold a million token ids.
constexpr int64_t kParquetBatchRows = 64;

Status ok() { return {}; }
Status file_error(std::string message) { return {Status::kFileError, std::move(message)}; }

// A value of one row that has no JSON form (a NaN, text that is not UTF-8): the row is bad, the
// file is fine.
struct BadValue {
  std::string message;
};

// The strict UTF-8 that JSON text (and nlohmann's parser, which reads JSONL) requires: no overlong
// forms, no surrogates, nothing above U+10FFFF.
bool valid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const auto* end = p + s.size();
  while (p < end) {
    const unsigned char c = *p;
    if (c < 0x80) {
      ++p;
      continue;
    }
    int extra;
    uint32_t min, cp;
    if ((c & 0xE0) == 0xC0) extra = 1, min = 0x80, cp = c & 0x1F;
    else if ((c & 0xF0) == 0xE0) extra = 2, min = 0x800, cp = c & 0x0F;
    else if ((c & 0xF8) == 0xF0) extra = 3, min = 0x10000, cp = c & 0x07;
    else return false;
    if (end - p <= extra) return false;
    for (int k = 1; k <= extra; ++k) {
      if ((p[k] & 0xC0) != 0x80) return false;
      cp = (cp << 6) | (p[k] & 0x3F);
    }
    if (cp < min || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;
    p += extra + 1;
  }
  return true;
}

// Whether values of `type` have a JSON form; `why` gets the part that does not.
bool has_json_form(const arrow::DataType& type, std::string& why) {
  using arrow::Type;
  switch (type.id()) {
    case Type::NA:
    case Type::BOOL:
    case Type::INT8: case Type::INT16: case Type::INT32: case Type::INT64:
    case Type::UINT8: case Type::UINT16: case Type::UINT32: case Type::UINT64:
    case Type::HALF_FLOAT: case Type::FLOAT: case Type::DOUBLE:
    case Type::STRING: case Type::LARGE_STRING: case Type::STRING_VIEW:
      return true;
    case Type::LIST: case Type::LARGE_LIST: case Type::FIXED_SIZE_LIST: case Type::LIST_VIEW:
    case Type::LARGE_LIST_VIEW:
      return has_json_form(*type.field(0)->type(), why);
    case Type::STRUCT:
      for (const auto& field : type.fields())
        if (!has_json_form(*field->type(), why)) return false;
      return true;
    case Type::MAP: {
      const auto& map = static_cast<const arrow::MapType&>(type);
      const auto key = map.key_type()->id();
      if (key != Type::STRING && key != Type::LARGE_STRING && key != Type::STRING_VIEW) {
        why = type.ToString() + " (a map's keys must be strings to be JSON object keys)";
        return false;
      }
      return has_json_form(*map.item_type(), why);
    }
    case Type::DICTIONARY:
      return has_json_form(*static_cast<const arrow::DictionaryType&>(type).value_type(), why);
    default:
      why = type.ToString();
      return false;
  }
}

// One array of a batch, with its children resolved once per batch; value(i) is row i's JSON.
class Node {
 public:
  explicit Node(std::shared_ptr<arrow::Array> array) : array_(std::move(array)) {
    using arrow::Type;
    switch (array_->type_id()) {
      case Type::LIST: add(static_cast<const arrow::ListArray&>(*array_).values()); break;
      case Type::LARGE_LIST: add(static_cast<const arrow::LargeListArray&>(*array_).values()); break;
      case Type::FIXED_SIZE_LIST: add(static_cast<const arrow::FixedSizeListArray&>(*array_).values()); break;
      case Type::LIST_VIEW: add(static_cast<const arrow::ListViewArray&>(*array_).values()); break;
      case Type::LARGE_LIST_VIEW: add(static_cast<const arrow::LargeListViewArray&>(*array_).values()); break;
      case Type::MAP: {
        const auto& map = static_cast<const arrow::MapArray&>(*array_);
        add(map.keys());
        add(map.items());
        break;
      }
      case Type::STRUCT: {
        const auto& st = static_cast<const arrow::StructArray&>(*array_);
        for (int k = 0; k < st.num_fields(); ++k) add(st.field(k));  // offset and length applied
        break;
      }
      case Type::DICTIONARY: add(static_cast<const arrow::DictionaryArray&>(*array_).dictionary()); break;
      default: break;
    }
  }

  bool is_null(int64_t i) const { return array_->IsNull(i); }

  // Row i's value; `path` names it in messages ("messages[2].content").
  json value(int64_t i, const std::string& path) const {
    using arrow::Type;
    const arrow::Array& a = *array_;
    switch (a.type_id()) {
      case Type::NA: return nullptr;
      case Type::BOOL: return static_cast<const arrow::BooleanArray&>(a).Value(i);
      case Type::INT8: return integer(static_cast<const arrow::Int8Array&>(a).Value(i));
      case Type::INT16: return integer(static_cast<const arrow::Int16Array&>(a).Value(i));
      case Type::INT32: return integer(static_cast<const arrow::Int32Array&>(a).Value(i));
      case Type::INT64: return integer(static_cast<const arrow::Int64Array&>(a).Value(i));
      case Type::UINT8: return static_cast<uint64_t>(static_cast<const arrow::UInt8Array&>(a).Value(i));
      case Type::UINT16: return static_cast<uint64_t>(static_cast<const arrow::UInt16Array&>(a).Value(i));
      case Type::UINT32: return static_cast<uint64_t>(static_cast<const arrow::UInt32Array&>(a).Value(i));
      case Type::UINT64: return static_cast<uint64_t>(static_cast<const arrow::UInt64Array&>(a).Value(i));
      case Type::HALF_FLOAT:
        return real(arrow::util::Float16::FromBits(static_cast<const arrow::HalfFloatArray&>(a).Value(i)).ToFloat(),
                    path);
      case Type::FLOAT: return real(static_cast<const arrow::FloatArray&>(a).Value(i), path);
      case Type::DOUBLE: return real(static_cast<const arrow::DoubleArray&>(a).Value(i), path);
      case Type::STRING: return text(static_cast<const arrow::StringArray&>(a).GetView(i), path);
      case Type::LARGE_STRING: return text(static_cast<const arrow::LargeStringArray&>(a).GetView(i), path);
      case Type::STRING_VIEW: return text(static_cast<const arrow::StringViewArray&>(a).GetView(i), path);
      case Type::LIST: return list(static_cast<const arrow::ListArray&>(a), i, path);
      case Type::LARGE_LIST: return list(static_cast<const arrow::LargeListArray&>(a), i, path);
      case Type::FIXED_SIZE_LIST: return list(static_cast<const arrow::FixedSizeListArray&>(a), i, path);
      case Type::LIST_VIEW: return list(static_cast<const arrow::ListViewArray&>(a), i, path);
      case Type::LARGE_LIST_VIEW: return list(static_cast<const arrow::LargeListViewArray&>(a), i, path);
      case Type::MAP: {
        const auto& map = static_cast<const arrow::MapArray&>(a);
        json object = json::object();
        const int64_t begin = map.value_offset(i), end = begin + map.value_length(i);
        for (int64_t k = begin; k < end; ++k) {
          const std::string key = children_[0]->value(k, path).get<std::string>();
          if (!children_[1]->is_null(k)) object[key] = children_[1]->value(k, path + "." + key);
        }
        return object;
      }
      case Type::STRUCT: {
        const auto& type = static_cast<const arrow::StructType&>(*a.type());
        json object = json::object();
        for (size_t k = 0; k < children_.size(); ++k) {
          if (children_[k]->is_null(i)) continue;  // null: the field is absent from this row
          const std::string& name = type.field(static_cast<int>(k))->name();
          object[name] = children_[k]->value(i, path + "." + name);
        }
        return object;
      }
      case Type::DICTIONARY:
        return children_[0]->value(static_cast<const arrow::DictionaryArray&>(a).GetValueIndex(i), path);
      default:  // select() refused every other type
        throw BadValue{path + ": unsupported type " + a.type()->ToString()};
    }
  }

 private:
  void add(std::shared_ptr<arrow::Array> child) { children_.push_back(std::make_unique<Node>(std::move(child))); }

  // As nlohmann's parser types JSON numbers: non-negative integers unsigned, negative ones signed.
  static json integer(int64_t v) { return v >= 0 ? json(static_cast<uint64_t>(v)) : json(v); }

  static json real(double v, const std::string& path) {
    if (!std::isfinite(v)) throw BadValue{path + " holds " + (std::isnan(v) ? "NaN" : "an infinity") +
                                          ", which JSON cannot hold"};
    return v;
  }

  static json text(std::string_view s, const std::string& path) {
    if (!valid_utf8(s)) throw BadValue{path + " holds text that is not valid UTF-8"};
    return std::string(s);
  }

  template <typename ListArray>
  json list(const ListArray& a, int64_t i, const std::string& path) const {
    json array = json::array();
    const int64_t begin = a.value_offset(i), length = a.value_length(i);
    array.get_ref<json::array_t&>().reserve(static_cast<size_t>(length));
    const Node& values = *children_[0];
    for (int64_t k = 0; k < length; ++k) {
      if (values.is_null(begin + k)) array.push_back(nullptr);
      else array.push_back(values.value(begin + k, path + "[" + std::to_string(k) + "]"));
    }
    return array;
  }

  std::shared_ptr<arrow::Array> array_;
  std::vector<std::unique_ptr<Node>> children_;
};

// Everything Arrow reports as text, without Arrow's "Invalid: " style prefix when there is one.
std::string describe(const arrow::Status& status) { return status.message(); }

// Source of record batches: a Parquet file or an Arrow IPC stream/file.
class ArrowTableFile : public TableFile {
 public:
  ArrowTableFile(std::filesystem::path path, TableFormat format) : path_(std::move(path)), format_(format) {}

  Status open() {
    try {
      return format_ == TableFormat::kParquet ? open_parquet() : open_ipc();
    } catch (const std::exception& e) {  // parquet::ParquetException and friends
      return file_error(e.what());
    }
  }

  const std::vector<Column>& columns() const override { return columns_; }
  int64_t rows_in_metadata() const override { return rows_in_metadata_; }

  Status select(const std::vector<std::string>& names) override {
    try {
      std::vector<int> fields;
      for (const std::string& name : names) {
        const int index = schema_->GetFieldIndex(name);
        if (index < 0) return file_error("no column '" + name + "'");
        std::string why;
        if (!has_json_form(*schema_->field(index)->type(), why))
          return file_error("column '" + name + "' has Arrow type " + schema_->field(index)->type()->ToString() +
                            ", whose values have no JSON form (" + why +
                            "); spindle reads strings, numbers, booleans, lists, structs and maps with string keys");
        fields.push_back(index);
      }
      std::sort(fields.begin(), fields.end());  // schema order, as a JSONL writer would keep it
      return format_ == TableFormat::kParquet ? select_parquet(fields) : select_ipc(fields);
    } catch (const std::exception& e) {
      return file_error(e.what());
    }
  }

  Status next(json& row) override {
    try {
      while (!batch_ || next_row_ >= batch_->num_rows()) {
        Status status = read_batch();
        if (status.code != Status::kOk) return status;
      }
      const int64_t i = next_row_++;
      ++rows_read_;
      row = json::object();
      try {
        for (size_t c = 0; c < nodes_.size(); ++c) {
          if (nodes_[c]->is_null(i)) continue;
          const std::string& name = batch_->schema()->field(static_cast<int>(c))->name();
          row[name] = nodes_[c]->value(i, name);
        }
      } catch (const BadValue& bad) {
        return {Status::kBadRow, "column " + bad.message};
      }
      return ok();
    } catch (const std::exception& e) {
      return file_error(e.what());
    }
  }

 private:
  Status open_parquet() {
    parquet::ReaderProperties properties;
    properties.set_page_checksum_verification(true);  // where the writer stored page checksums
    parquet::arrow::FileReaderBuilder builder;
    if (auto st = builder.OpenFile(path_.string(), /*memory_map=*/false, properties); !st.ok())
      return file_error("not a readable Parquet file (" + describe(st) + ")");
    parquet::ArrowReaderProperties arrow_properties;
    arrow_properties.set_batch_size(kParquetBatchRows);
    arrow_properties.set_use_threads(false);
    builder.properties(arrow_properties);
    auto reader = builder.Build();
    if (!reader.ok()) return file_error("not a readable Parquet file (" + describe(reader.status()) + ")");
    parquet_ = std::move(*reader);
    if (auto st = parquet_->GetSchema(&schema_); !st.ok())
      return file_error("the Parquet schema has no Arrow form (" + describe(st) + ")");
    rows_in_metadata_ = parquet_->parquet_reader()->metadata()->num_rows();
    fill_columns();
    return ok();
  }

  Status select_parquet(const std::vector<int>& fields) {
    // The Parquet reader selects leaf columns: those under each chosen top-level field.
    std::vector<int> leaves;
    std::function<void(const parquet::arrow::SchemaField&)> collect = [&](const parquet::arrow::SchemaField& f) {
      if (f.is_leaf()) leaves.push_back(f.column_index);
      for (const auto& child : f.children) collect(child);
    };
    for (int field : fields) collect(parquet_->manifest().schema_fields[field]);
    std::vector<int> row_groups(parquet_->num_row_groups());
    for (size_t g = 0; g < row_groups.size(); ++g) row_groups[g] = static_cast<int>(g);
    auto batches = parquet_->GetRecordBatchReader(row_groups, leaves);
    if (!batches.ok()) return file_error("cannot read the Parquet columns (" + describe(batches.status()) + ")");
    parquet_batches_ = std::move(*batches);
    return ok();
  }

  Status open_ipc() {
    auto mapped = arrow::io::MemoryMappedFile::Open(path_.string(), arrow::io::FileMode::READ);
    if (!mapped.ok()) return file_error("cannot open (" + describe(mapped.status()) + ")");
    mapped_ = *mapped;
    auto size = mapped_->GetSize();
    if (!size.ok()) return file_error(describe(size.status()));
    char magic[8] = {};
    if (*size >= 8) {
      auto got = mapped_->ReadAt(0, 8, magic);
      if (!got.ok()) return file_error(describe(got.status()));
    }
    ipc_file_format_ = *size >= 8 && std::memcmp(magic, "ARROW1", 6) == 0;
    if (ipc_file_format_) {
      auto reader = arrow::ipc::RecordBatchFileReader::Open(mapped_);
      if (!reader.ok())
        return file_error("not a readable Arrow IPC file (" + describe(reader.status()) +
                          "); it may be truncated or corrupt");
      schema_ = (*reader)->schema();
      auto rows = (*reader)->CountRows();
      rows_in_metadata_ = rows.ok() ? *rows : -1;
    } else {
      // A stream states no row count; its end is an end-of-stream marker (continuation 0xFFFFFFFF,
      // then length 0), which a stream cut short at a batch boundary lacks. Without this check such
      // a file would read as a shorter, valid stream.
      unsigned char tail[8] = {};
      if (*size < 8 || !mapped_->ReadAt(*size - 8, 8, tail).ok() ||
          std::memcmp(tail, "\xFF\xFF\xFF\xFF\x00\x00\x00\x00", 8) != 0)
        return file_error("the Arrow IPC stream does not end with the end-of-stream marker: the file was cut "
                          "short (an interrupted write or copy)");
      auto reader = arrow::ipc::RecordBatchStreamReader::Open(mapped_);
      if (!reader.ok())
        return file_error("not a readable Arrow IPC stream (" + describe(reader.status()) +
                          "); it may be truncated or corrupt");
      schema_ = (*reader)->schema();
    }
    fill_columns();
    return ok();
  }

  Status select_ipc(const std::vector<int>& fields) {
    arrow::ipc::IpcReadOptions options = arrow::ipc::IpcReadOptions::Defaults();
    options.included_fields = fields;
    // open() read the schema from this file: read again from its start.
    if (auto st = mapped_->Seek(0); !st.ok()) return file_error(describe(st));
    if (ipc_file_format_) {
      auto reader = arrow::ipc::RecordBatchFileReader::Open(mapped_, options);
      if (!reader.ok()) return file_error("not a readable Arrow IPC file (" + describe(reader.status()) + ")");
      ipc_file_ = *reader;
    } else {
      auto reader = arrow::ipc::RecordBatchStreamReader::Open(mapped_, options);
      if (!reader.ok()) return file_error("not a readable Arrow IPC stream (" + describe(reader.status()) + ")");
      ipc_stream_ = *reader;
    }
    return ok();
  }

  Status read_batch() {
    std::shared_ptr<arrow::RecordBatch> batch;
    arrow::Status st;
    if (parquet_batches_) {
      st = parquet_batches_->ReadNext(&batch);
    } else if (ipc_stream_) {
      st = ipc_stream_->ReadNext(&batch);
    } else if (ipc_file_) {
      if (next_ipc_batch_ < ipc_file_->num_record_batches()) {
        auto got = ipc_file_->ReadRecordBatch(next_ipc_batch_++);
        if (got.ok()) batch = *got;
        else st = got.status();
      }
    } else {
      return file_error("internal error: next() before select()");
    }
    if (!st.ok())
      return file_error("reading failed after row " + std::to_string(rows_read_) + " (" + describe(st) +
                        "); the file is corrupt or truncated");
    if (!batch) {
      if (rows_in_metadata_ >= 0 && rows_read_ != rows_in_metadata_)
        return file_error("read " + std::to_string(rows_read_) + " rows but the file's metadata states " +
                          std::to_string(rows_in_metadata_) + "; the file is corrupt");
      batch_.reset();
      nodes_.clear();
      return {Status::kEnd, ""};
    }
    batch_ = std::move(batch);
    next_row_ = 0;
    nodes_.clear();
    for (int c = 0; c < batch_->num_columns(); ++c) nodes_.push_back(std::make_unique<Node>(batch_->column(c)));
    return ok();
  }

  void fill_columns() {
    for (const auto& field : schema_->fields()) columns_.push_back({field->name(), field->type()->ToString()});
  }

  std::filesystem::path path_;
  TableFormat format_;
  std::shared_ptr<arrow::Schema> schema_;
  std::vector<Column> columns_;
  int64_t rows_in_metadata_ = -1;
  // Parquet
  std::unique_ptr<parquet::arrow::FileReader> parquet_;
  std::unique_ptr<arrow::RecordBatchReader> parquet_batches_;
  // Arrow IPC
  std::shared_ptr<arrow::io::MemoryMappedFile> mapped_;
  bool ipc_file_format_ = false;
  std::shared_ptr<arrow::ipc::RecordBatchStreamReader> ipc_stream_;
  std::shared_ptr<arrow::ipc::RecordBatchFileReader> ipc_file_;
  int next_ipc_batch_ = 0;
  // The batch being read
  std::shared_ptr<arrow::RecordBatch> batch_;
  std::vector<std::unique_ptr<Node>> nodes_;
  int64_t next_row_ = 0;
  int64_t rows_read_ = 0;
};

std::unique_ptr<TableFile> open_table(const std::filesystem::path& path, TableFormat format, Status& status) {
  auto file = std::make_unique<ArrowTableFile>(path, format);
  status = file->open();
  if (status.code != Status::kOk) return nullptr;
  return file;
}

const Plugin kPlugin{kPluginAbi, ARROW_VERSION_STRING, &open_table};

}  // namespace

}  // namespace spindle::table

extern "C" __attribute__((visibility("default"))) const spindle::table::Plugin* spindle_table_plugin() {
  return &spindle::table::kPlugin;
}
