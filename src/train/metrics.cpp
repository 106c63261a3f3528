#include "train/metrics.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.h"

namespace spindle::train {
namespace {

using Json = nlohmann::ordered_json;

std::string errno_text() { return std::strerror(errno); }

Json finite_or_null(double value) { return std::isfinite(value) ? Json(value) : Json(nullptr); }

double number_or_nan(const Json& object, const char* key, bool required) {
  auto it = object.find(key);
  if (it == object.end()) {
    if (required) fail("missing key \"{}\"", key);
    return 0;
  }
  if (it->is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (!it->is_number()) fail("\"{}\" must be a number, got {}", key, it->dump());
  return it->get<double>();
}

int64_t integer(const Json& object, const char* key, bool required) {
  auto it = object.find(key);
  if (it == object.end()) {
    if (required) fail("missing key \"{}\"", key);
    return 0;
  }
  if (!it->is_number_integer()) fail("\"{}\" must be an integer, got {}", key, it->dump());
  return it->get<int64_t>();
}

std::string read_whole_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot open metrics file {}: {}", path.string(), errno_text());
  std::ostringstream contents;
  contents << in.rdbuf();
  if (in.bad()) fail("reading metrics file {} failed: {}", path.string(), errno_text());
  return std::move(contents).str();
}

struct LogLine {
  std::string_view text;  // without the newline
  int64_t line_number;
};

// Complete lines only: text after the last newline is a write cut short by a kill.
std::vector<LogLine> complete_lines(std::string_view contents) {
  std::vector<LogLine> lines;
  size_t start = 0;
  int64_t line_number = 1;
  for (size_t newline; (newline = contents.find('\n', start)) != std::string_view::npos;
       start = newline + 1, ++line_number) {
    std::string_view text = contents.substr(start, newline - start);
    if (text.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    lines.push_back({text, line_number});
  }
  return lines;
}

StepMetrics parse_line(const std::filesystem::path& path, const LogLine& line) {
  try {
    return metrics_from_json_line(line.text);
  } catch (const Error& e) {
    fail("metrics file {} line {}: {}", path.string(), line.line_number, e.what());
  }
}

}  // namespace

double NamedMetric::as_double() const {
  return std::visit([](auto number) { return static_cast<double>(number); }, value);
}

std::vector<NamedMetric> named_metrics(const StepMetrics& m) {
  std::vector<NamedMetric> values = {
      {"epoch", m.epoch},
      {"loss", m.loss},
      {"grad_norm", m.grad_norm},
      {"lr", m.lr},
      {"num_items", m.num_items},
      {"tokens", m.tokens},
      {"total_tokens", m.total_tokens},
      {"tokens_per_s", m.tokens_per_s},
      {"step_seconds", m.step_seconds},
      {"peak_memory", m.peak_memory_bytes},
      {"elapsed_s", m.elapsed_seconds},
  };
  if (m.offload_host_bytes > 0) {
    values.push_back({"offload_host_memory", m.offload_host_bytes});
    values.push_back({"offload_copy_bytes", m.offload_copy_bytes});
    values.push_back({"offload_copy_s", m.offload_copy_seconds});
    values.push_back({"offload_wait_s", m.offload_wait_seconds});
  }
  if (m.aux_loss) values.push_back({"aux_loss", *m.aux_loss});
  if (m.eval_loss) values.push_back({"eval_loss", *m.eval_loss});
  if (m.eval_num_items) values.push_back({"eval_num_items", *m.eval_num_items});
  if (m.eval_accuracy) values.push_back({"eval_rewards/accuracies", *m.eval_accuracy});
  if (const auto& p = m.preference) {
    values.push_back({"rewards/chosen", p->rewards_chosen});
    values.push_back({"rewards/rejected", p->rewards_rejected});
    values.push_back({"rewards/margins", p->margins});
    values.push_back({"rewards/accuracies", p->accuracy});
    values.push_back({"logps/chosen", p->logps_chosen});
    values.push_back({"logps/rejected", p->logps_rejected});
    values.push_back({"nll_loss", p->nll_loss});
    values.push_back({"pairs", p->pairs});
    if (p->log_odds_ratio) values.push_back({"log_odds_ratio", *p->log_odds_ratio});
    if (p->log_odds_chosen) values.push_back({"log_odds_chosen", *p->log_odds_chosen});
  }
  return values;
}

std::string metrics_to_json_line(const StepMetrics& m) {
  Json line;
  line["step"] = m.step;
  for (const NamedMetric& metric : named_metrics(m)) {
    Json& slot = line[std::string(metric.key)];
    if (const int64_t* count = std::get_if<int64_t>(&metric.value)) slot = *count;
    else slot = finite_or_null(std::get<double>(metric.value));
  }
  return line.dump();
}

StepMetrics metrics_from_json_line(std::string_view text) {
  Json line = Json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (line.is_discarded()) fail("not valid JSON: {}", text.substr(0, 200));
  if (!line.is_object()) fail("expected a JSON object, got {}", text.substr(0, 200));
  StepMetrics m;
  m.step = integer(line, "step", true);
  m.epoch = number_or_nan(line, "epoch", false);
  m.loss = number_or_nan(line, "loss", true);
  m.grad_norm = number_or_nan(line, "grad_norm", false);
  m.lr = number_or_nan(line, "lr", false);
  m.num_items = integer(line, "num_items", false);
  m.tokens = integer(line, "tokens", false);
  m.total_tokens = integer(line, "total_tokens", false);
  m.tokens_per_s = number_or_nan(line, "tokens_per_s", false);
  m.step_seconds = number_or_nan(line, "step_seconds", false);
  m.peak_memory_bytes = integer(line, "peak_memory", false);
  m.elapsed_seconds = number_or_nan(line, "elapsed_s", false);
  if (line.contains("offload_host_memory")) m.offload_host_bytes = integer(line, "offload_host_memory", true);
  if (line.contains("offload_copy_bytes")) m.offload_copy_bytes = integer(line, "offload_copy_bytes", true);
  if (line.contains("offload_copy_s")) m.offload_copy_seconds = number_or_nan(line, "offload_copy_s", true);
  if (line.contains("offload_wait_s")) m.offload_wait_seconds = number_or_nan(line, "offload_wait_s", true);
  if (line.contains("aux_loss")) m.aux_loss = number_or_nan(line, "aux_loss", true);
  if (line.contains("eval_loss")) m.eval_loss = number_or_nan(line, "eval_loss", true);
  if (line.contains("eval_num_items")) m.eval_num_items = integer(line, "eval_num_items", true);
  if (line.contains("eval_rewards/accuracies")) m.eval_accuracy = number_or_nan(line, "eval_rewards/accuracies", true);
  if (line.contains("rewards/chosen")) {
    StepMetrics::Preference p;
    p.rewards_chosen = number_or_nan(line, "rewards/chosen", true);
    p.rewards_rejected = number_or_nan(line, "rewards/rejected", true);
    p.margins = number_or_nan(line, "rewards/margins", true);
    p.accuracy = number_or_nan(line, "rewards/accuracies", true);
    p.logps_chosen = number_or_nan(line, "logps/chosen", false);
    p.logps_rejected = number_or_nan(line, "logps/rejected", false);
    p.nll_loss = number_or_nan(line, "nll_loss", false);
    p.pairs = integer(line, "pairs", false);
    if (line.contains("log_odds_ratio")) p.log_odds_ratio = number_or_nan(line, "log_odds_ratio", true);
    if (line.contains("log_odds_chosen")) p.log_odds_chosen = number_or_nan(line, "log_odds_chosen", true);
    m.preference = p;
  }
  return m;
}

std::vector<StepMetrics> read_metrics_file(const std::filesystem::path& path) {
  std::string contents = read_whole_file(path);
  std::vector<StepMetrics> records;
  for (const LogLine& line : complete_lines(contents)) records.push_back(parse_line(path, line));
  return records;
}

void write_file_atomically(const std::filesystem::path& path, std::string_view contents) {
  std::filesystem::path temp_path = path;
  temp_path += ".tmp." + std::to_string(::getpid());
  int fd = ::open(temp_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create {}: {}", temp_path.string(), errno_text());
  auto give_up = [&](const char* what) {
    std::string reason = errno_text();
    ::close(fd);
    ::unlink(temp_path.c_str());
    fail("{} {} failed: {}", what, temp_path.string(), reason);
  };
  for (size_t written = 0; written < contents.size();) {
    ssize_t n = ::write(fd, contents.data() + written, contents.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) give_up("writing");
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) give_up("flushing");
  if (::close(fd) != 0) {
    std::string reason = errno_text();
    ::unlink(temp_path.c_str());
    fail("closing {} failed: {}", temp_path.string(), reason);
  }
  if (::rename(temp_path.c_str(), path.c_str()) != 0) {
    std::string reason = errno_text();
    ::unlink(temp_path.c_str());
    fail("renaming {} to {} failed: {}", temp_path.string(), path.string(), reason);
  }
  // The rename is only durable once the directory entry is on disk too.
  std::filesystem::path directory = path.parent_path().empty() ? "." : path.parent_path();
  int dir_fd = ::open(directory.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);
    ::close(dir_fd);
  }
}

MetricsLog::MetricsLog(std::filesystem::path path) : path_(std::move(path)) {
  if (path_.empty()) fail("the metrics file path is empty");
  if (path_.has_parent_path()) {
    std::error_code error;
    std::filesystem::create_directories(path_.parent_path(), error);
    if (error)
      fail("cannot create the folder {} for the metrics file: {}", path_.parent_path().string(),
           error.message());
  }
}

MetricsLog MetricsLog::start_new(const std::filesystem::path& path) {
  MetricsLog log(path);
  log.stream_.open(path, std::ios::binary | std::ios::trunc);
  if (!log.stream_) fail("cannot create metrics file {}: {}", path.string(), errno_text());
  return log;
}

MetricsLog MetricsLog::resume(const std::filesystem::path& path, int64_t resumed_step) {
  MetricsLog log(path);
  if (std::filesystem::exists(path))
    log.truncate_after(resumed_step);
  else
    log.open_for_append();
  return log;
}

void MetricsLog::open_for_append() {
  stream_.open(path_, std::ios::binary | std::ios::app);
  if (!stream_) fail("cannot open metrics file {} for appending: {}", path_.string(), errno_text());
}

void MetricsLog::append(const StepMetrics& metrics) {
  SPINDLE_CHECK(stream_.is_open(), "metrics file {} is not open", path_.string());
  stream_ << metrics_to_json_line(metrics) << '\n';
  stream_.flush();
  if (!stream_) fail("writing to metrics file {} failed: {}", path_.string(), errno_text());
}

void MetricsLog::truncate_after(int64_t step) {
  if (stream_.is_open()) stream_.close();
  std::string contents = read_whole_file(path_);
  std::string kept;
  kept.reserve(contents.size());
  for (const LogLine& line : complete_lines(contents)) {
    if (parse_line(path_, line).step > step) continue;
    kept.append(line.text);
    kept.push_back('\n');
  }
  write_file_atomically(path_, kept);
  open_for_append();
}

void LossSmoother::add(double loss) {
  if (!std::isfinite(loss)) return;
  biased_average_ = weight_ * biased_average_ + (1 - weight_) * loss;
  correction_ *= weight_;
  ++count_;
}

std::optional<double> LossSmoother::value() const {
  if (count_ == 0) return std::nullopt;
  return biased_average_ / (1 - correction_);
}

}  // namespace spindle::train
