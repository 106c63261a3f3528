// Streaming JSONL input: one sample per line, read in fixed-size blocks so a file of any size is
// read in bounded memory (one block plus the longest line). Every problem with a sample is
// reported with its file and line number, or counted and skipped when the user asks for skipping.
#pragma once

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace spindle {

// A problem with one sample's content (not with the file, nor a bug in spindle). Sample readers
// throw it without a location; the JSONL loop adds "file:line: " and applies the skip policy.
class BadSample : public Error {
 public:
  using Error::Error;
};

template <typename... Args>
[[noreturn]] void bad_sample(fmt::format_string<Args...> format, Args&&... args) {
  throw BadSample(fmt::format(format, std::forward<Args>(args)...));
}

enum class BadSamplePolicy { kFail, kSkip };

struct ReadOptions {
  BadSamplePolicy on_bad_sample = BadSamplePolicy::kFail;
  // > 0: every token id must be below it (the tokenizer's vocabulary size, added tokens included).
  int64_t vocab_size = 0;
  // Pre-tokenized `labels` must equal `input_ids` wherever supervised. Catches the common mistake
  // of passing labels that are already shifted (spindle shifts them itself, docs/design.md §2.1).
  bool require_labels_match_input_ids = true;
};

struct ReadStats {
  static constexpr size_t kMaxSkipExamples = 5;

  int64_t lines = 0;        // lines read, blank ones included
  int64_t rows = 0;         // table rows read (Parquet, Arrow: dataset_reader.h)
  int64_t blank_lines = 0;  // whitespace-only lines: ignored, not samples
  int64_t samples = 0;      // samples accepted
  int64_t skipped = 0;      // bad samples skipped under BadSamplePolicy::kSkip
  int64_t bytes = 0;        // bytes of input consumed
  std::vector<std::string> skip_examples;  // the first few skip reasons, each with file:line

  void record_skip(std::string reason);
  // One line for the user, e.g. "read 1,000 samples from 1,002 lines (2 skipped: a.jsonl:7: ...)"
  // ("from N rows" for a table).
  std::string summary() const;
};

// Reads a file line by line. Lines may end in "\n" or "\r\n"; a UTF-8 byte order mark at the start
// of the file is ignored; the last line needs no newline.
class JsonlReader {
 public:
  explicit JsonlReader(std::filesystem::path path, size_t block_bytes = size_t{1} << 22);
  ~JsonlReader();
  JsonlReader(const JsonlReader&) = delete;
  JsonlReader& operator=(const JsonlReader&) = delete;

  // The next line without its line ending; false at end of file. The view stays valid until the
  // next call.
  bool next_line(std::string_view& line);

  int64_t line_number() const { return line_number_; }  // of the line last returned, from 1
  int64_t bytes_consumed() const { return bytes_consumed_; }
  int64_t file_bytes() const { return file_bytes_; }
  const std::filesystem::path& path() const { return path_; }
  std::string location() const;  // "path:line"

 private:
  bool refill();

  std::filesystem::path path_;
  std::FILE* file_ = nullptr;
  std::vector<char> buffer_;
  size_t begin_ = 0;  // first unread byte in buffer_
  size_t end_ = 0;    // one past the last valid byte in buffer_
  bool eof_ = false;
  int64_t line_number_ = 0;
  int64_t bytes_consumed_ = 0;
  int64_t file_bytes_ = 0;
};

// Parses one line as a JSON object. Malformed JSON (invalid UTF-8 included) and non-object values
// throw BadSample with the parser's column.
nlohmann::json parse_jsonl_line(std::string_view line);

// Reads every non-blank line of a JSONL file and calls handle(sample, line_number). Malformed JSON
// and BadSample thrown by handle become an Error "path:line: reason" under kFail, or a counted
// skip under kSkip; other errors propagate unchanged. stats accumulates (it may be shared by
// several files).
void for_each_jsonl_sample(const std::filesystem::path& path, const ReadOptions& options,
                           ReadStats& stats,
                           const std::function<void(const nlohmann::json&, int64_t)>& handle);

// The same loop one level lower: handle(line, line_number) gets each non-blank line as text (for
// parsers that do not need a JSON tree); parse it with parse_jsonl_line where needed.
void for_each_jsonl_line(const std::filesystem::path& path, const ReadOptions& options,
                         ReadStats& stats,
                         const std::function<void(std::string_view, int64_t)>& handle);

// "12,345,678": counts in user-facing messages.
std::string with_thousands(int64_t value);

}  // namespace spindle
