#include "data/jsonl_reader.h"

#include <cerrno>
#include <cstring>

namespace spindle {

namespace {

bool is_blank(std::string_view line) {
  for (char c : line)
    if (c != ' ' && c != '\t' && c != '\r') return false;
  return true;
}

// nlohmann's messages start with "[json.exception.parse_error.101] parse error at line 1, ...";
// the bracketed id means nothing to a user and the line is always 1 (we parse one line).
std::string describe_parse_error(const nlohmann::json::exception& e) {
  std::string message = e.what();
  if (auto pos = message.find("] "); pos != std::string::npos) message.erase(0, pos + 2);
  if (auto pos = message.find("parse error at line 1, "); pos == 0)
    message.erase(0, std::strlen("parse error at line 1, "));
  return message;
}

}  // namespace

void ReadStats::record_skip(std::string reason) {
  ++skipped;
  if (skip_examples.size() < kMaxSkipExamples) skip_examples.push_back(std::move(reason));
}

std::string ReadStats::summary() const {
  std::string text = rows > 0 && lines == 0
                         ? fmt::format("read {} samples from {} rows", with_thousands(samples), with_thousands(rows))
                         : fmt::format("read {} samples from {} lines", with_thousands(samples), with_thousands(lines));
  if (blank_lines > 0) text += fmt::format(", {} blank", with_thousands(blank_lines));
  if (skipped > 0) {
    text += fmt::format("; skipped {} bad samples, first: ", with_thousands(skipped));
    for (size_t i = 0; i < skip_examples.size(); ++i)
      text += (i ? " | " : "") + skip_examples[i];
  }
  return text;
}

std::string with_thousands(int64_t value) {
  std::string digits = std::to_string(value < 0 ? -value : value);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return value < 0 ? "-" + out : out;
}

JsonlReader::JsonlReader(std::filesystem::path path, size_t block_bytes)
    : path_(std::move(path)), buffer_(block_bytes < 16 ? 16 : block_bytes) {
  std::error_code ec;
  if (std::filesystem::is_directory(path_, ec))
    fail("{} is a directory; pass a JSONL file (one JSON object per line)", path_.string());
  file_ = std::fopen(path_.c_str(), "rb");
  if (!file_)
    fail("cannot open dataset {}: {}; check the --data path", path_.string(), std::strerror(errno));
  auto size = std::filesystem::file_size(path_, ec);
  file_bytes_ = ec ? -1 : static_cast<int64_t>(size);
}

JsonlReader::~JsonlReader() {
  if (file_) std::fclose(file_);
}

std::string JsonlReader::location() const {
  return fmt::format("{}:{}", path_.string(), line_number_);
}

bool JsonlReader::refill() {
  if (eof_) return false;
  // Keep the unread tail, grow only when one line is longer than the whole buffer.
  size_t unread = end_ - begin_;
  if (begin_ > 0) {
    std::memmove(buffer_.data(), buffer_.data() + begin_, unread);
    begin_ = 0;
    end_ = unread;
  }
  if (end_ == buffer_.size()) buffer_.resize(buffer_.size() * 2);
  size_t got = std::fread(buffer_.data() + end_, 1, buffer_.size() - end_, file_);
  if (got == 0) {
    if (std::ferror(file_))
      fail("read error in {} after line {}: {}", path_.string(), line_number_,
           std::strerror(errno));
    eof_ = true;
    return false;
  }
  end_ += got;
  return true;
}

bool JsonlReader::next_line(std::string_view& line) {
  size_t scanned = 0;  // bytes after begin_ already known to hold no newline
  for (;;) {
    const char* start = buffer_.data() + begin_;
    const void* newline = std::memchr(start + scanned, '\n', end_ - begin_ - scanned);
    if (newline) {
      size_t length = static_cast<const char*>(newline) - start;
      line = std::string_view(start, length);
      begin_ += length + 1;
      bytes_consumed_ += static_cast<int64_t>(length + 1);
      break;
    }
    scanned = end_ - begin_;
    if (!refill()) {
      if (begin_ == end_) return false;
      line = std::string_view(buffer_.data() + begin_, end_ - begin_);
      bytes_consumed_ += static_cast<int64_t>(line.size());
      begin_ = end_;
      break;
    }
  }
  ++line_number_;
  if (line_number_ == 1 && line.starts_with("\xEF\xBB\xBF")) line.remove_prefix(3);
  if (line.ends_with('\r')) line.remove_suffix(1);
  return true;
}

nlohmann::json parse_jsonl_line(std::string_view line) {
  nlohmann::json sample;
  try {
    sample = nlohmann::json::parse(line.begin(), line.end());
  } catch (const nlohmann::json::parse_error& e) {
    bad_sample("not valid JSON ({}); every line must be one JSON object", describe_parse_error(e));
  } catch (const nlohmann::json::exception& e) {  // e.g. a number too large for a double
    bad_sample("not valid JSON ({})", describe_parse_error(e));
  }
  if (!sample.is_object())
    bad_sample("expected a JSON object ({{\"field\": ...}}), found a JSON {}", sample.type_name());
  return sample;
}

void for_each_jsonl_line(const std::filesystem::path& path, const ReadOptions& options,
                         ReadStats& stats,
                         const std::function<void(std::string_view, int64_t)>& handle) {
  JsonlReader reader(path);
  std::string_view line;
  int64_t bytes_before = 0;
  while (reader.next_line(line)) {
    ++stats.lines;
    stats.bytes += reader.bytes_consumed() - bytes_before;
    bytes_before = reader.bytes_consumed();
    if (is_blank(line)) {
      ++stats.blank_lines;
      continue;
    }
    try {
      handle(line, reader.line_number());
      ++stats.samples;
    } catch (const BadSample& e) {
      std::string reason = fmt::format("{}: {}", reader.location(), e.what());
      if (options.on_bad_sample == BadSamplePolicy::kFail)
        throw Error(reason + " (fix or remove the line, or skip bad samples with --skip-bad-samples)");
      stats.record_skip(std::move(reason));
    }
  }
}

void for_each_jsonl_sample(const std::filesystem::path& path, const ReadOptions& options,
                           ReadStats& stats,
                           const std::function<void(const nlohmann::json&, int64_t)>& handle) {
  for_each_jsonl_line(path, options, stats, [&](std::string_view line, int64_t line_number) {
    handle(parse_jsonl_line(line), line_number);
  });
}

}  // namespace spindle
