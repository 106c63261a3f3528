// The --tensorboard writer: CRC-32C against published check values and ISA-L itself, TFRecord
// frames against bytes written by TensorBoard's own Python RecordWriter, and the event files'
// contents (header, restart marker, one record per step with every metric) and naming.
#include <gtest/gtest.h>
#include <isa-l/crc.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>

#include "train/tensorboard.h"
#include "tensorboard_event.pb.h"

using namespace spindle;
using namespace spindle::train;
namespace fs = std::filesystem;

namespace {

std::string from_hex(std::string_view hex) {
  std::string bytes;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    bytes.push_back(static_cast<char>(std::stoi(std::string(hex.substr(i, 2)), nullptr, 16)));
  return bytes;
}

uint64_t read_little_endian(std::string_view bytes) {
  uint64_t value = 0;
  for (size_t i = bytes.size(); i-- > 0;) value = (value << 8) | static_cast<unsigned char>(bytes[i]);
  return value;
}

// Splits an event file into its payloads, checking every frame's length and both CRCs.
std::vector<std::string> read_records(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream buffer;
  buffer << in.rdbuf();
  const std::string file = buffer.str();
  std::vector<std::string> payloads;
  size_t at = 0;
  while (at < file.size()) {
    EXPECT_LE(at + 12, file.size()) << "truncated frame header at byte " << at;
    if (at + 12 > file.size()) break;
    const std::string_view length_bytes = std::string_view(file).substr(at, 8);
    const uint64_t length = read_little_endian(length_bytes);
    EXPECT_EQ(read_little_endian(std::string_view(file).substr(at + 8, 4)), masked_crc32c(length_bytes));
    EXPECT_LE(at + 12 + length + 4, file.size()) << "truncated record at byte " << at;
    if (at + 12 + length + 4 > file.size()) break;
    const std::string payload = file.substr(at + 12, length);
    EXPECT_EQ(read_little_endian(std::string_view(file).substr(at + 12 + length, 4)), masked_crc32c(payload));
    payloads.push_back(payload);
    at += 12 + length + 4;
  }
  return payloads;
}

tensorboard::Event parse_event(const std::string& payload) {
  tensorboard::Event event;
  EXPECT_TRUE(event.ParseFromString(payload));
  return event;
}

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(dir))
    if (entry.path().filename().string().rfind("events.out.tfevents.", 0) == 0) files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  return files;
}

fs::path fresh_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / ("spindle-test-tensorboard-" + name + "-" + std::to_string(getpid()));
  fs::remove_all(p);
  return p;
}

StepMetrics sample_metrics(int64_t step) {
  StepMetrics m;
  m.step = step;
  m.epoch = 0.25 * step;
  m.loss = 2.5 / step;
  m.grad_norm = 0.75;
  m.lr = 1e-4;
  m.num_items = 120;
  m.tokens = 256;
  m.total_tokens = 256 * step;
  m.tokens_per_s = 1234.5;
  m.step_seconds = 0.2;
  m.peak_memory_bytes = int64_t{3} << 30;
  m.elapsed_seconds = 0.2 * step;
  return m;
}

}  // namespace

TEST(Crc32c, PublishedCheckValues) {
  EXPECT_EQ(crc32c(""), 0u);
  EXPECT_EQ(crc32c("123456789"), 0xE3069283u);  // the catalogue check value of CRC-32C
  // RFC 3720 (iSCSI), appendix B.4.
  EXPECT_EQ(crc32c(std::string(32, '\0')), 0x8A9136AAu);
  EXPECT_EQ(crc32c(std::string(32, '\xff')), 0x62A8AB43u);
  std::string ascending, descending;
  for (int i = 0; i < 32; ++i) {
    ascending.push_back(static_cast<char>(i));
    descending.push_back(static_cast<char>(31 - i));
  }
  EXPECT_EQ(crc32c(ascending), 0x46DD794Eu);
  EXPECT_EQ(crc32c(descending), 0x113FDB5Cu);
}

TEST(Crc32c, EqualsTheLibraryOnAnyLengthAndAlignment) {
  std::mt19937 random(7);
  std::string buffer(4096 + 64, '\0');
  for (char& c : buffer) c = static_cast<char>(random());
  for (size_t offset : {0, 1, 3, 7}) {
    for (size_t length : {0, 1, 2, 7, 8, 15, 16, 63, 64, 255, 1000, 4096}) {
      std::string copy = buffer.substr(offset, length);
      const uint32_t library = ~crc32_iscsi(reinterpret_cast<unsigned char*>(copy.data()),
                                            static_cast<int>(copy.size()), 0xffffffffu);
      EXPECT_EQ(crc32c(std::string_view(buffer).substr(offset, length)), library)
          << "offset " << offset << " length " << length;
    }
  }
}

TEST(Crc32c, MaskRotatesAndOffsets) {
  // Value from TensorBoard's own Python implementation (tensorboard.compat...masked_crc32c).
  EXPECT_EQ(masked_crc32c("123456789"), 0xC78AB0E5u);
  EXPECT_EQ(masked_crc32c(""), 0xA282EAD8u);  // crc 0: only the offset
}

TEST(TfRecord, FramesAsTensorBoardsRecordWriter) {
  // Bytes TensorBoard's RecordWriter (tensorboard.summary.writer.record_writer) writes for these
  // payloads: length, its masked CRC, the payload, its masked CRC.
  EXPECT_EQ(tfrecord_frame("brain.Event:2"),
            from_hex("0d000000000000003c37b834627261696e2e4576656e743a32ee01067c"));
  EXPECT_EQ(tfrecord_frame(""), from_hex("000000000000000029039807d8ea82a2"));
}

TEST(TfRecord, LongPayloadRoundTrips) {
  std::string payload(70000, '\0');
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<char>(i * 31 + 7);
  const std::string frame = tfrecord_frame(payload);
  ASSERT_EQ(frame.size(), 8 + 4 + payload.size() + 4);
  EXPECT_EQ(read_little_endian(std::string_view(frame).substr(0, 8)), payload.size());
  EXPECT_EQ(read_little_endian(std::string_view(frame).substr(8, 4)), masked_crc32c(frame.substr(0, 8)));
  EXPECT_EQ(frame.substr(12, payload.size()), payload);
  EXPECT_EQ(read_little_endian(std::string_view(frame).substr(12 + payload.size(), 4)), masked_crc32c(payload));
}

TEST(TensorBoardScalars, EveryMetricsLogKeyUnderTrainOrEval) {
  StepMetrics m = sample_metrics(3);
  m.eval_loss = 1.75;
  m.eval_num_items = 40;
  StepMetrics::Preference p;
  p.rewards_chosen = 0.5;
  p.accuracy = 0.75;
  p.pairs = 4;
  m.preference = p;
  m.eval_accuracy = 0.5;
  const auto scalars = tensorboard_scalars(m);
  const auto named = named_metrics(m);
  ASSERT_EQ(scalars.size(), named.size());
  std::map<std::string, double> by_tag;
  for (const auto& s : scalars) by_tag[s.tag] = s.value;
  EXPECT_EQ(by_tag.at("train/loss"), m.loss);
  EXPECT_EQ(by_tag.at("train/grad_norm"), 0.75);
  EXPECT_EQ(by_tag.at("train/lr"), 1e-4);
  EXPECT_EQ(by_tag.at("train/tokens_per_s"), 1234.5);
  EXPECT_EQ(by_tag.at("train/num_items"), 120);
  EXPECT_EQ(by_tag.at("train/peak_memory"), static_cast<double>(int64_t{3} << 30));
  EXPECT_EQ(by_tag.at("eval/loss"), 1.75);
  EXPECT_EQ(by_tag.at("eval/num_items"), 40);
  EXPECT_EQ(by_tag.at("eval/rewards/accuracies"), 0.5);
  EXPECT_EQ(by_tag.at("train/rewards/chosen"), 0.5);
  EXPECT_EQ(by_tag.at("train/rewards/accuracies"), 0.75);
  EXPECT_EQ(by_tag.at("train/pairs"), 4);
  EXPECT_EQ(by_tag.count("train/step"), 0u);  // the step is the event's, not a scalar
}

TEST(TensorBoardLog, HeaderRestartMarkerThenOneRecordPerStep) {
  const fs::path dir = fresh_dir("steps");
  auto metrics_of_step = [](int64_t step) {
    StepMetrics m = sample_metrics(step);
    if (step == 2) m.eval_loss = 0.0;  // a zero is still written
    return m;
  };
  fs::path file;
  {
    TensorBoardLog log = TensorBoardLog::start(dir / "nested", /*resumed_step=*/0);
    file = log.path();
    for (int64_t step = 1; step <= 3; ++step) {
      log.append(metrics_of_step(step));
      // Flushed per step: the file already holds this step's record while the log is open.
      EXPECT_EQ(read_records(file).size(), static_cast<size_t>(2 + step));
    }
  }
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const std::string name = file.filename().string();
  EXPECT_EQ(name.rfind("events.out.tfevents.", 0), 0u) << name;
  EXPECT_EQ(name.substr(name.size() - std::strlen(host) - 1), std::string(".") + host) << name;

  const auto records = read_records(file);
  ASSERT_EQ(records.size(), 5u);
  const tensorboard::Event header = parse_event(records[0]);
  EXPECT_EQ(header.what_case(), tensorboard::Event::kFileVersion);
  EXPECT_EQ(header.file_version(), "brain.Event:2");
  EXPECT_GT(header.wall_time(), 1.5e9);
  const tensorboard::Event start = parse_event(records[1]);
  ASSERT_EQ(start.what_case(), tensorboard::Event::kSessionLog);
  EXPECT_EQ(start.session_log().status(), tensorboard::SessionLog::START);
  EXPECT_EQ(start.step(), 1);
  for (int64_t step = 1; step <= 3; ++step) {
    const tensorboard::Event event = parse_event(records[1 + step]);
    EXPECT_EQ(event.step(), step);
    ASSERT_EQ(event.what_case(), tensorboard::Event::kSummary);
    const auto expected = tensorboard_scalars(metrics_of_step(step));
    ASSERT_EQ(event.summary().value_size(), static_cast<int>(expected.size()));
    for (int i = 0; i < event.summary().value_size(); ++i) {
      const auto& value = event.summary().value(i);
      EXPECT_EQ(value.tag(), expected[i].tag);
      ASSERT_EQ(value.value_case(), tensorboard::Summary::Value::kSimpleValue) << value.tag();
      EXPECT_EQ(value.simple_value(), static_cast<float>(expected[i].value)) << value.tag();
    }
  }
  fs::remove_all(dir);
}

TEST(TensorBoardLog, ResumedRunWritesANewFileThatSortsLastAndRestartsAfterItsCheckpoint) {
  const fs::path dir = fresh_dir("resume");
  fs::path first, second;
  {
    TensorBoardLog log = TensorBoardLog::start(dir, 0);
    first = log.path();
    for (int64_t step = 1; step <= 5; ++step) log.append(sample_metrics(step));
  }
  {
    // Within the same second: the name must still sort after the first file's.
    TensorBoardLog log = TensorBoardLog::start(dir, /*resumed_step=*/4);
    second = log.path();
    log.append(sample_metrics(5));
  }
  EXPECT_NE(first, second);
  EXPECT_EQ(event_files(dir), (std::vector<fs::path>{first, second}));
  const auto records = read_records(second);
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(parse_event(records[0]).file_version(), "brain.Event:2");
  const tensorboard::Event start = parse_event(records[1]);
  EXPECT_EQ(start.session_log().status(), tensorboard::SessionLog::START);
  EXPECT_EQ(start.step(), 5);
  EXPECT_EQ(parse_event(records[2]).step(), 5);
  fs::remove_all(dir);
}

TEST(TensorBoardLog, UnusableFolderIsAnErrorNamingIt) {
  const fs::path dir = fresh_dir("file");
  fs::create_directories(dir);
  std::ofstream(dir / "plain-file") << "x";
  try {
    TensorBoardLog::start(dir / "plain-file", 0);
    FAIL() << "a file given as the --tensorboard folder was accepted";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("plain-file"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
