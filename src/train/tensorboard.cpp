#include "train/tensorboard.h"

#include <fcntl.h>
#include <isa-l/crc.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <climits>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "tensorboard_event.pb.h"

namespace spindle::train {
namespace {

namespace fs = std::filesystem;

constexpr std::string_view kFilePrefix = "events.out.tfevents.";

std::string errno_text() { return std::strerror(errno); }

void append_little_endian(std::string& out, uint64_t value, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((value >> (8 * i)) & 0xff));
}

double seconds_since_epoch() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  char name[HOST_NAME_MAX + 1] = {};
  if (::gethostname(name, sizeof name - 1) != 0 || name[0] == '\0') return "localhost";
  return name;
}

// The timestamp part of an event file's name, or -1 for other files.
int64_t file_timestamp(const std::string& name) {
  if (name.rfind(kFilePrefix, 0) != 0) return -1;
  int64_t seconds = 0;
  size_t i = kFilePrefix.size();
  if (i >= name.size() || name[i] < '0' || name[i] > '9') return -1;
  for (; i < name.size() && name[i] >= '0' && name[i] <= '9'; ++i) seconds = seconds * 10 + (name[i] - '0');
  return seconds;
}

// TensorBoard reads a folder's event files in name order, and the restart marker only drops steps
// it has already read: a resumed run's file must sort after every earlier one, even one created
// within the same second. The name's time is therefore now, or one past the latest existing file.
int64_t next_file_timestamp(const fs::path& dir) {
  int64_t seconds = static_cast<int64_t>(seconds_since_epoch());
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(dir, error))
    seconds = std::max(seconds, file_timestamp(entry.path().filename().string()) + 1);
  if (error) fail("cannot list the --tensorboard folder {}: {}", dir.string(), error.message());
  return seconds;
}

std::string serialized(const tensorboard::Event& event) {
  std::string bytes;
  if (!event.SerializeToString(&bytes)) fail("could not serialize a TensorBoard event (step {})", event.step());
  return bytes;
}

}  // namespace

uint32_t crc32c(std::string_view bytes) {
  // ISA-L's iSCSI CRC is CRC-32C without the customary final inversion; it reads but never writes
  // the buffer (its C signature lacks the const). Chunked because its length is an int.
  uint32_t state = 0xffffffffu;
  auto* data = reinterpret_cast<unsigned char*>(const_cast<char*>(bytes.data()));
  for (size_t done = 0; done < bytes.size();) {
    const int chunk = static_cast<int>(std::min<size_t>(bytes.size() - done, INT_MAX));
    state = crc32_iscsi(data + done, chunk, state);
    done += static_cast<size_t>(chunk);
  }
  return ~state;
}

uint32_t masked_crc32c(std::string_view bytes) {
  const uint32_t crc = crc32c(bytes);
  return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(std::string_view payload) {
  std::string length;
  append_little_endian(length, payload.size(), 8);
  std::string record = length;
  record.reserve(8 + 4 + payload.size() + 4);
  append_little_endian(record, masked_crc32c(length), 4);
  record.append(payload);
  append_little_endian(record, masked_crc32c(payload), 4);
  return record;
}

std::vector<TensorBoardScalar> tensorboard_scalars(const StepMetrics& metrics) {
  std::vector<TensorBoardScalar> scalars;
  for (const NamedMetric& metric : named_metrics(metrics)) {
    const std::string_view key = metric.key;
    const std::string tag = key.rfind("eval_", 0) == 0 ? "eval/" + std::string(key.substr(5))
                                                       : "train/" + std::string(key);
    scalars.push_back({tag, metric.as_double()});
  }
  return scalars;
}

TensorBoardLog TensorBoardLog::start(const fs::path& dir, int64_t resumed_step) {
  if (dir.empty()) fail("--tensorboard needs a folder");
  std::error_code error;
  fs::create_directories(dir, error);
  if (error) fail("cannot create the --tensorboard folder {}: {}", dir.string(), error.message());
  if (!fs::is_directory(dir)) fail("--tensorboard {} is not a folder", dir.string());

  const std::string host = host_name();
  int64_t seconds = next_file_timestamp(dir);
  fs::path path;
  int fd = -1;
  // O_EXCL: never append to another writer's file; a name taken meanwhile moves on a second.
  for (int attempt = 0; fd < 0 && attempt < 100; ++attempt, ++seconds) {
    path = dir / (std::string(kFilePrefix) + std::to_string(seconds) + "." + host);
    fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_APPEND | O_CLOEXEC, 0644);
    if (fd < 0 && errno != EEXIST) fail("cannot create the TensorBoard event file {}: {}", path.string(), errno_text());
  }
  if (fd < 0) fail("cannot create a new TensorBoard event file in {}: every name tried exists", dir.string());
  TensorBoardLog log(path, fd);

  tensorboard::Event header;
  header.set_wall_time(seconds_since_epoch());
  header.set_file_version("brain.Event:2");
  log.write_event(serialized(header));

  tensorboard::Event start;
  start.set_wall_time(seconds_since_epoch());
  start.set_step(resumed_step + 1);
  start.mutable_session_log()->set_status(tensorboard::SessionLog::START);
  log.write_event(serialized(start));
  return log;
}

TensorBoardLog::TensorBoardLog(TensorBoardLog&& other) noexcept
    : path_(std::move(other.path_)), fd_(std::exchange(other.fd_, -1)) {}

TensorBoardLog& TensorBoardLog::operator=(TensorBoardLog&& other) noexcept {
  std::swap(path_, other.path_);
  std::swap(fd_, other.fd_);
  return *this;
}

TensorBoardLog::~TensorBoardLog() {
  if (fd_ >= 0) ::close(fd_);
}

void TensorBoardLog::append(const StepMetrics& metrics) {
  tensorboard::Event event;
  event.set_wall_time(seconds_since_epoch());
  event.set_step(metrics.step);
  tensorboard::Summary* summary = event.mutable_summary();
  for (const TensorBoardScalar& scalar : tensorboard_scalars(metrics)) {
    tensorboard::Summary::Value* value = summary->add_value();
    value->set_tag(scalar.tag);
    value->set_simple_value(static_cast<float>(scalar.value));
  }
  write_event(serialized(event));
}

void TensorBoardLog::write_event(std::string_view serialized_event) {
  SPINDLE_CHECK(fd_ >= 0, "TensorBoard event file {} is not open", path_.string());
  // The whole record in one write to an O_APPEND file: no user-space buffer holds part of it, and
  // a reader polling the file meets at most a trailing record still being written, which
  // TensorBoard's reader waits on rather than rejects.
  const std::string record = tfrecord_frame(serialized_event);
  for (size_t written = 0; written < record.size();) {
    const ssize_t n = ::write(fd_, record.data() + written, record.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) fail("writing the TensorBoard event file {} failed: {}", path_.string(), errno_text());
    written += static_cast<size_t>(n);
  }
}

}  // namespace spindle::train
