#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "train/loss_plot.h"
#include "train/metrics.h"
#include "train/progress.h"

using namespace spindle;
using namespace spindle::train;
namespace fs = std::filesystem;

namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

class TempDir {
 public:
  TempDir() {
    const auto* test = ::testing::UnitTest::GetInstance()->current_test_info();
    path_ = fs::temp_directory_path() /
            ("spindle_test_metrics_" + std::to_string(::getpid()) + "_" + test->test_suite_name() + "_" + test->name());
    fs::remove_all(path_);
    fs::create_directories(path_);
  }
  ~TempDir() { fs::remove_all(path_); }
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

StepMetrics make_step(int64_t step, double loss, double seconds_per_step = 1.0) {
  StepMetrics m;
  m.step = step;
  m.epoch = 0.01 * static_cast<double>(step);
  m.loss = loss;
  m.grad_norm = 0.5;
  m.lr = 2e-5;
  m.num_items = 100;
  m.tokens = 1000;
  m.total_tokens = 1000 * step;
  m.step_seconds = seconds_per_step;
  m.tokens_per_s = 1000 / seconds_per_step;
  m.peak_memory_bytes = int64_t{3} << 30;
  m.elapsed_seconds = seconds_per_step * static_cast<double>(step);
  return m;
}

std::vector<StepMetrics> steps_with_losses(const std::vector<double>& losses) {
  std::vector<StepMetrics> records;
  for (size_t i = 0; i < losses.size(); ++i) records.push_back(make_step(static_cast<int64_t>(i + 1), losses[i]));
  return records;
}

std::vector<int64_t> steps_of(const std::vector<StepMetrics>& records) {
  std::vector<int64_t> steps;
  for (const auto& r : records) steps.push_back(r.step);
  return steps;
}

int count_of(const std::string& text, const std::string& needle) {
  int count = 0;
  for (size_t at = text.find(needle); at != std::string::npos; at = text.find(needle, at + needle.size())) ++count;
  return count;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// Terminal columns a string takes: one per UTF-8 code point (the bar's block characters are single-width).
int display_columns(const std::string& text) {
  int columns = 0;
  for (unsigned char c : text)
    if ((c & 0xC0) != 0x80) ++columns;
  return columns;
}

}  // namespace

// ---- JSON lines -----------------------------------------------------------------------------------

TEST(MetricsJson, LineHasExactlyTheDocumentedKeys) {
  StepMetrics m = make_step(7, 1.25);
  auto line = nlohmann::json::parse(metrics_to_json_line(m));
  std::vector<std::string> keys;
  for (auto& [key, value] : line.items()) keys.push_back(key);
  std::sort(keys.begin(), keys.end());
  EXPECT_EQ(keys, (std::vector<std::string>{"elapsed_s", "epoch", "grad_norm", "loss", "lr", "num_items", "peak_memory",
                                            "step", "step_seconds", "tokens", "tokens_per_s", "total_tokens"}));
  EXPECT_EQ(line["step"], 7);
  EXPECT_EQ(line["peak_memory"], int64_t{3} << 30);
  EXPECT_EQ(line["num_items"], 100);
  EXPECT_DOUBLE_EQ(line["lr"].get<double>(), 2e-5);

  m.eval_loss = 1.5;
  m.eval_num_items = 4096;
  line = nlohmann::json::parse(metrics_to_json_line(m));
  EXPECT_DOUBLE_EQ(line["eval_loss"].get<double>(), 1.5);
  EXPECT_EQ(line["eval_num_items"], 4096);
}

TEST(MetricsJson, OffloadKeysOnlyWithOffloadAndTheyRoundTrip) {
  StepMetrics m = make_step(3, 1.0);
  m.offload_host_bytes = int64_t{5} << 30;
  m.offload_copy_bytes = int64_t{10} << 30;
  m.offload_copy_seconds = 0.2;
  m.offload_wait_seconds = 0.0125;
  const auto line = nlohmann::json::parse(metrics_to_json_line(m));
  EXPECT_EQ(line["offload_host_memory"], int64_t{5} << 30);
  EXPECT_EQ(line["offload_copy_bytes"], int64_t{10} << 30);
  EXPECT_DOUBLE_EQ(line["offload_copy_s"].get<double>(), 0.2);
  EXPECT_DOUBLE_EQ(line["offload_wait_s"].get<double>(), 0.0125);
  const StepMetrics back = metrics_from_json_line(metrics_to_json_line(m));
  EXPECT_EQ(back.offload_host_bytes, m.offload_host_bytes);
  EXPECT_EQ(back.offload_copy_bytes, m.offload_copy_bytes);
  EXPECT_EQ(back.offload_copy_seconds, m.offload_copy_seconds);
  EXPECT_EQ(back.offload_wait_seconds, m.offload_wait_seconds);
  // Without offload none of them is written.
  const auto plain = nlohmann::json::parse(metrics_to_json_line(make_step(3, 1.0)));
  for (const char* key : {"offload_host_memory", "offload_copy_bytes", "offload_copy_s", "offload_wait_s"})
    EXPECT_FALSE(plain.contains(key)) << key;
}

TEST(MetricsJson, RoundTripsEveryField) {
  StepMetrics m = make_step(12, 0.123456789012345);
  m.epoch = 1.0 / 3.0;
  m.eval_loss = 0.987654321;
  m.eval_num_items = 77;
  StepMetrics back = metrics_from_json_line(metrics_to_json_line(m));
  EXPECT_EQ(back.step, 12);
  EXPECT_EQ(back.epoch, m.epoch);  // shortest round-trip formatting: exact
  EXPECT_EQ(back.loss, m.loss);
  EXPECT_EQ(back.grad_norm, m.grad_norm);
  EXPECT_EQ(back.lr, m.lr);
  EXPECT_EQ(back.num_items, m.num_items);
  EXPECT_EQ(back.tokens, m.tokens);
  EXPECT_EQ(back.total_tokens, m.total_tokens);
  EXPECT_EQ(back.tokens_per_s, m.tokens_per_s);
  EXPECT_EQ(back.step_seconds, m.step_seconds);
  EXPECT_EQ(back.peak_memory_bytes, m.peak_memory_bytes);
  EXPECT_EQ(back.elapsed_seconds, m.elapsed_seconds);
  EXPECT_EQ(back.eval_loss, m.eval_loss);
  EXPECT_EQ(back.eval_num_items, m.eval_num_items);
  EXPECT_FALSE(metrics_from_json_line(metrics_to_json_line(make_step(1, 1))).eval_loss.has_value());
}

TEST(MetricsJson, NonFiniteNumbersBecomeNullAndReadBackAsNaN) {
  StepMetrics m = make_step(3, kNaN);
  m.grad_norm = kInf;
  m.eval_loss = kNaN;
  std::string text = metrics_to_json_line(m);
  auto line = nlohmann::json::parse(text);  // strict JSON: no NaN literal
  EXPECT_TRUE(line["loss"].is_null());
  EXPECT_TRUE(line["grad_norm"].is_null());
  EXPECT_TRUE(line["eval_loss"].is_null());
  StepMetrics back = metrics_from_json_line(text);
  EXPECT_TRUE(std::isnan(back.loss));
  EXPECT_TRUE(std::isnan(back.grad_norm));
  ASSERT_TRUE(back.eval_loss.has_value());
  EXPECT_TRUE(std::isnan(*back.eval_loss));
}

TEST(MetricsJson, RejectsLinesThatAreNotMetrics) {
  EXPECT_THROW(metrics_from_json_line("not json"), Error);
  EXPECT_THROW(metrics_from_json_line("[1, 2]"), Error);
  EXPECT_THROW(metrics_from_json_line(R"({"loss": 1.0})"), Error);
  EXPECT_THROW(metrics_from_json_line(R"({"step": "3", "loss": 1.0})"), Error);
  EXPECT_THROW(metrics_from_json_line(R"({"step": 3, "loss": "low"})"), Error);
}

// ---- MetricsLog -----------------------------------------------------------------------------------

TEST(MetricsLog, EachLineIsOnDiskBeforeAppendReturns) {
  TempDir dir;
  fs::path file = dir.path() / "nested" / "metrics.jsonl";
  MetricsLog log = MetricsLog::start_new(file);
  for (int64_t step = 1; step <= 3; ++step) {
    log.append(make_step(step, 1.0 / static_cast<double>(step)));
    // Read through a separate handle while the log is still open: only flushed lines are visible.
    EXPECT_EQ(steps_of(read_metrics_file(file)).size(), static_cast<size_t>(step));
  }
  std::string text = read_text(file);
  EXPECT_EQ(count_of(text, "\n"), 3);
  EXPECT_EQ(text.back(), '\n');
  EXPECT_EQ(steps_of(log.read()), (std::vector<int64_t>{1, 2, 3}));
}

TEST(MetricsLog, StartNewEmptiesAnEarlierRunsFile) {
  TempDir dir;
  fs::path file = dir.path() / "metrics.jsonl";
  {
    MetricsLog log = MetricsLog::start_new(file);
    log.append(make_step(1, 2.0));
    log.append(make_step(2, 1.0));
  }
  MetricsLog log = MetricsLog::start_new(file);
  EXPECT_TRUE(log.read().empty());
  log.append(make_step(1, 3.0));
  auto records = log.read();
  ASSERT_EQ(records.size(), 1u);
  EXPECT_EQ(records[0].loss, 3.0);
}

TEST(MetricsLog, TruncateAfterKeepsEarlierLinesByteForByteAndAppendsAfterThem) {
  TempDir dir;
  fs::path file = dir.path() / "metrics.jsonl";
  MetricsLog log = MetricsLog::start_new(file);
  for (int64_t step = 1; step <= 10; ++step) log.append(make_step(step, 10.0 / static_cast<double>(step)));
  std::string before = read_text(file);
  auto lines_before = lines_of(before);

  log.truncate_after(6);
  auto lines_after = lines_of(read_text(file));
  ASSERT_EQ(lines_after.size(), 6u);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(lines_after[i], lines_before[i]);

  log.append(make_step(7, 0.5));
  EXPECT_EQ(steps_of(log.read()), (std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7}));
  EXPECT_EQ(log.read().back().loss, 0.5);

  log.truncate_after(0);
  EXPECT_TRUE(log.read().empty());
  for (const auto& entry : fs::directory_iterator(dir.path()))
    EXPECT_EQ(entry.path().filename(), "metrics.jsonl") << "temporary file left behind";
}

TEST(MetricsLog, ResumeDropsStepsAfterTheCheckpointAndATornLastLine) {
  TempDir dir;
  fs::path file = dir.path() / "metrics.jsonl";
  {
    MetricsLog log = MetricsLog::start_new(file);
    for (int64_t step = 1; step <= 8; ++step) log.append(make_step(step, 1.0));
  }
  {
    // The killed process was half-way through writing step 9.
    std::ofstream out(file, std::ios::app | std::ios::binary);
    out << R"({"step": 9, "epoch": 0.09, "lo)";
  }
  EXPECT_EQ(steps_of(read_metrics_file(file)).size(), 8u) << "a torn last line is ignored when reading";

  MetricsLog log = MetricsLog::resume(file, 5);
  EXPECT_EQ(steps_of(log.read()), (std::vector<int64_t>{1, 2, 3, 4, 5}));
  log.append(make_step(6, 0.25));
  EXPECT_EQ(steps_of(log.read()), (std::vector<int64_t>{1, 2, 3, 4, 5, 6}));
  for (const std::string& line : lines_of(read_text(file))) EXPECT_NO_THROW(metrics_from_json_line(line)) << line;

  // Resuming past the last logged step (the checkpoint came after the log) keeps everything.
  MetricsLog again = MetricsLog::resume(file, 100);
  EXPECT_EQ(steps_of(again.read()).size(), 6u);
}

TEST(MetricsLog, ResumeWithoutAFileStartsOne) {
  TempDir dir;
  fs::path file = dir.path() / "metrics.jsonl";
  MetricsLog log = MetricsLog::resume(file, 40);
  log.append(make_step(41, 1.0));
  EXPECT_EQ(steps_of(read_metrics_file(file)), (std::vector<int64_t>{41}));
}

TEST(MetricsLog, CorruptLineInTheMiddleIsAnErrorNamingTheLine) {
  TempDir dir;
  fs::path file = dir.path() / "metrics.jsonl";
  {
    std::ofstream out(file, std::ios::binary);
    out << metrics_to_json_line(make_step(1, 1.0)) << "\n"
        << "garbage\n"
        << metrics_to_json_line(make_step(3, 1.0)) << "\n";
  }
  try {
    read_metrics_file(file);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("line 2"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("metrics.jsonl"), std::string::npos) << e.what();
  }
  EXPECT_THROW(MetricsLog::resume(file, 1), Error);
  EXPECT_THROW(read_metrics_file(dir.path() / "missing.jsonl"), Error);
}

TEST(WriteFileAtomically, ReplacesContentsAndLeavesNoTemporary) {
  TempDir dir;
  fs::path file = dir.path() / "out.txt";
  write_file_atomically(file, "first");
  write_file_atomically(file, "second, longer");
  EXPECT_EQ(read_text(file), "second, longer");
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 1);
  EXPECT_THROW(write_file_atomically(dir.path() / "no" / "such" / "dir.txt", "x"), Error);
}

TEST(LossSmoother, IsUnbiasedFromTheFirstValueAndSkipsNonFinite) {
  LossSmoother smoother(0.9);
  EXPECT_FALSE(smoother.value().has_value());
  smoother.add(4.0);
  EXPECT_DOUBLE_EQ(*smoother.value(), 4.0);
  smoother.add(kNaN);
  smoother.add(kInf);
  EXPECT_DOUBLE_EQ(*smoother.value(), 4.0);
  for (int i = 0; i < 5; ++i) smoother.add(4.0);
  EXPECT_NEAR(*smoother.value(), 4.0, 1e-12);
  smoother.add(0.0);
  // Weights after 7 values: the newest has 0.1 / (1 - 0.9^7) of the total.
  EXPECT_NEAR(*smoother.value(), 4.0 * (1 - 0.1 / (1 - std::pow(0.9, 7))), 1e-12);
}

// ---- Progress display -----------------------------------------------------------------------------

TEST(ProgressDisplay, PlainLinesOnFirstEveryNthAndLastStep) {
  std::ostringstream out;
  ProgressOptions options;
  options.total_steps = 25;
  options.log_every = 10;
  options.is_terminal = false;
  ProgressDisplay display(out, options);
  for (int64_t step = 1; step <= 25; ++step) display.update(make_step(step, 2.0));
  display.finish();
  std::string text = out.str();
  EXPECT_EQ(text.find('\r'), std::string::npos);
  EXPECT_EQ(text.find('\x1b'), std::string::npos);
  auto lines = lines_of(text);
  ASSERT_EQ(lines.size(), 4u) << text;
  EXPECT_EQ(lines[0].rfind("step 1/25 (4%)", 0), 0u) << lines[0];
  EXPECT_EQ(lines[1].rfind("step 10/25 (40%)", 0), 0u) << lines[1];
  EXPECT_EQ(lines[2].rfind("step 20/25 (80%)", 0), 0u) << lines[2];
  EXPECT_EQ(lines[3].rfind("step 25/25 (100%)", 0), 0u) << lines[3];
  EXPECT_NE(lines[1].find("loss 2.0000 (smoothed 2.0000)"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("1.0k tokens/s"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("peak 3.00 GiB"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("lr 2.000e-05"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("elapsed 0:10"), std::string::npos) << lines[1];
  EXPECT_NE(lines[1].find("eta 0:15"), std::string::npos) << lines[1];
}

TEST(ProgressDisplay, OffloadShowsHostMemoryCopyBandwidthAndTheTimeItAdded) {
  StepMetrics m = make_step(1, 2.0);
  m.offload_host_bytes = int64_t{5} << 30;
  m.offload_copy_bytes = 10'420'000'000;  // 10.42 GB in 0.2 s: 52.1 GB/s
  m.offload_copy_seconds = 0.2;
  m.offload_wait_seconds = 0.031;
  for (bool terminal : {false, true}) {
    std::ostringstream out;
    ProgressOptions options;
    options.total_steps = 1;
    options.is_terminal = terminal;
    options.terminal_columns = 200;
    ProgressDisplay display(out, options);
    display.update(m);
    display.finish();
    const std::string text = out.str();
    EXPECT_NE(text.find("5.00 GiB"), std::string::npos) << text;
    EXPECT_NE(text.find("52.1 GB/s, +0.03 s"), std::string::npos) << text;
  }
  EXPECT_EQ(format_offload_copies(m), "52.1 GB/s, +0.03 s");
}

TEST(ProgressDisplay, PlainModeShowsEvalStepsAndTheStepAStoppedRunEndedOn) {
  std::ostringstream out;
  ProgressOptions options;
  options.total_steps = 100;
  options.log_every = 10;
  ProgressDisplay display(out, options);
  for (int64_t step = 1; step <= 13; ++step) {
    StepMetrics m = make_step(step, 1.5);
    if (step == 7) m.eval_loss = 1.75;
    display.update(m);
  }
  display.finish();
  display.finish();
  auto lines = lines_of(out.str());
  ASSERT_EQ(lines.size(), 4u) << out.str();
  EXPECT_EQ(lines[1].rfind("step 7/100", 0), 0u);
  EXPECT_NE(lines[1].find("eval_loss 1.7500"), std::string::npos) << lines[1];
  EXPECT_EQ(lines[2].rfind("step 10/100", 0), 0u);
  EXPECT_EQ(lines[3].rfind("step 13/100", 0), 0u) << "finish() shows where a stopped run ended";
}

TEST(ProgressDisplay, TerminalLineRedrawsAtMostTenTimesASecond) {
  std::ostringstream out;
  ProgressOptions options;
  options.total_steps = 200;
  options.is_terminal = true;
  options.terminal_columns = 120;
  ProgressDisplay display(out, options);
  // 200 steps of 10 ms: 2 seconds.
  for (int64_t step = 1; step <= 200; ++step) display.update(make_step(step, 1.0, 0.01));
  display.finish();
  std::string text = out.str();
  int redraws = count_of(text, "\r");
  EXPECT_GE(redraws, 20);
  EXPECT_LE(redraws, 22);
  EXPECT_EQ(count_of(text, "\n"), 1) << "one line, ended once by finish()";
  EXPECT_EQ(text.back(), '\n');
  std::string last = text.substr(text.rfind('\r') + 1);
  EXPECT_NE(last.find("100% |"), std::string::npos) << last;
  EXPECT_NE(last.find("200/200"), std::string::npos) << last;
  EXPECT_NE(last.find("\x1b[K"), std::string::npos) << "clears what a longer previous line left";
}

TEST(ProgressDisplay, TerminalLineShowsBarLossesSpeedMemoryAndEta) {
  std::ostringstream out;
  ProgressOptions options;
  options.total_steps = 100;
  options.is_terminal = true;
  options.terminal_columns = 120;
  ProgressDisplay display(out, options);
  for (int64_t step = 1; step <= 10; ++step) display.update(make_step(step, step == 10 ? 1.0 : 2.0, 2.0));
  std::string line = display.terminal_line();
  EXPECT_EQ(line.rfind(" 10% |███", 0), 0u) << line;
  EXPECT_NE(line.find("| 10/100"), std::string::npos) << line;
  EXPECT_NE(line.find("(last 1.0000)"), std::string::npos) << line;
  EXPECT_NE(line.find("500 tok/s"), std::string::npos) << line;
  EXPECT_NE(line.find("3.00 GiB"), std::string::npos) << line;
  // 90 steps left at 2 s each.
  EXPECT_NE(line.find("0:20<3:00"), std::string::npos) << line;
  std::string smoothed = line.substr(line.find("loss ") + 5, 6);
  EXPECT_GT(std::stod(smoothed), 1.0);
  EXPECT_LT(std::stod(smoothed), 2.0);
}

TEST(ProgressDisplay, TerminalLineFitsTheTerminal) {
  for (int columns : {200, 100, 70, 40, 20}) {
    std::ostringstream out;
    ProgressOptions options;
    options.total_steps = 123456;
    options.is_terminal = true;
    options.terminal_columns = columns;
    ProgressDisplay display(out, options);
    display.update(make_step(61728, 1.2345678, 0.5));
    std::string line = display.terminal_line();
    EXPECT_LE(display_columns(line), columns - 1) << columns << ": " << line;
    EXPECT_EQ(line.find("|") != std::string::npos, columns >= 100) << columns << ": " << line;
    EXPECT_NE(line.find(" 50%"), std::string::npos) << line;
  }
}

TEST(ProgressDisplay, MessagesStayAboveTheRedrawnLine) {
  std::ostringstream out;
  ProgressOptions options;
  options.total_steps = 10;
  options.is_terminal = true;
  ProgressDisplay display(out, options);
  display.update(make_step(1, 1.0));
  display.message("checkpoint-1 saved");
  StepMetrics with_eval = make_step(2, 1.0);
  with_eval.eval_loss = 0.75;
  display.update(with_eval);
  display.finish();
  std::string text = out.str();
  EXPECT_NE(text.find("\r\x1b[Kcheckpoint-1 saved\n\r"), std::string::npos) << text;
  EXPECT_NE(text.find("\r\x1b[Kstep 2: eval_loss 0.7500\n\r"), std::string::npos) << text;
  EXPECT_EQ(text.back(), '\n');
}

TEST(ProgressDisplay, UnknownTotalShowsNoBarOrEta) {
  std::ostringstream out;
  ProgressOptions options;
  options.is_terminal = true;
  ProgressDisplay display(out, options);
  display.update(make_step(5, 1.0));
  std::string line = display.terminal_line();
  EXPECT_EQ(line.rfind("step 5  loss", 0), 0u) << line;
  EXPECT_EQ(line.find('<'), std::string::npos) << line;
}

TEST(Formatting, HumanReadableForms) {
  EXPECT_EQ(format_duration(7.4), "0:07");
  EXPECT_EQ(format_duration(754), "12:34");
  EXPECT_EQ(format_duration(3723), "1:02:03");
  EXPECT_EQ(format_duration(100000), "27:46:40");
  EXPECT_EQ(format_duration(kNaN), "?");
  EXPECT_EQ(format_rate(850.4), "850");
  EXPECT_EQ(format_rate(12345), "12.3k");
  EXPECT_EQ(format_rate(4561000), "4.56M");
  EXPECT_EQ(format_memory(512 << 20), "512 MiB");
  EXPECT_EQ(format_memory(int64_t{3} << 30), "3.00 GiB");
  EXPECT_EQ(format_count(12345678), "12,345,678");
  EXPECT_EQ(format_count(999), "999");
  EXPECT_EQ(format_count(-1000), "-1,000");
}

// ---- Summary --------------------------------------------------------------------------------------

TEST(RunSummary, CoversTheWholeLogAndPointsAtTheOutputs) {
  auto records = steps_with_losses({3.0, 2.0, kNaN, 1.0, 1.5});
  records[1].eval_loss = 2.5;
  records[3].eval_loss = 1.25;
  records[4].eval_loss = 1.75;
  records[2].peak_memory_bytes = int64_t{5} << 30;
  RunSummary summary = summarize_run(records);
  EXPECT_EQ(summary.steps, 5);
  EXPECT_EQ(summary.tokens, 5000);
  EXPECT_EQ(summary.num_items, 500);
  EXPECT_DOUBLE_EQ(summary.mean_tokens_per_s, 1000);
  EXPECT_EQ(summary.final_loss, 1.5);
  ASSERT_TRUE(summary.best_loss);
  EXPECT_EQ(*summary.best_loss, (std::pair<int64_t, double>{4, 1.0}));
  EXPECT_EQ(*summary.final_eval_loss, (std::pair<int64_t, double>{5, 1.75}));
  EXPECT_EQ(*summary.best_eval_loss, (std::pair<int64_t, double>{4, 1.25}));
  EXPECT_EQ(summary.non_finite_losses, 1);
  EXPECT_EQ(summary.peak_memory_bytes, int64_t{5} << 30);

  std::ostringstream out;
  write_run_summary(out, summary, 5, {{"adapter", "out/adapter"}, {"loss plot", "out/metrics.svg"}});
  std::string text = out.str();
  EXPECT_NE(text.find("Training finished: 5 steps (epoch 0.05) in 0:05"), std::string::npos) << text;
  EXPECT_NE(text.find("5,000 (500 supervised), 1.0k tokens/s on average"), std::string::npos) << text;
  EXPECT_NE(text.find("final 1.5000 (smoothed "), std::string::npos) << text;
  EXPECT_NE(text.find("lowest 1.0000 at step 4"), std::string::npos) << text;
  EXPECT_NE(text.find("eval loss    final 1.7500 at step 5, lowest 1.2500 at step 4"), std::string::npos) << text;
  EXPECT_NE(text.find("peak memory  5.00 GiB"), std::string::npos) << text;
  EXPECT_NE(text.find("1 step had a non-finite loss"), std::string::npos) << text;
  EXPECT_NE(text.find("outputs      adapter    out/adapter\n"), std::string::npos) << text;
  EXPECT_NE(text.find("             loss plot  out/metrics.svg\n"), std::string::npos) << text;
}

TEST(RunSummary, SaysWhenARunStoppedEarlyOrNeverStepped) {
  std::ostringstream stopped;
  write_run_summary(stopped, summarize_run(steps_with_losses({2.0, 1.0})), 10, {});
  EXPECT_EQ(lines_of(stopped.str())[0], "Training stopped at step 2 of 10 (epoch 0.02) after 0:02");
  EXPECT_EQ(stopped.str().find("eval loss"), std::string::npos);

  std::ostringstream empty;
  write_run_summary(empty, summarize_run({}), 10, {{"metrics", "m.jsonl"}});
  EXPECT_EQ(lines_of(empty.str())[0], "Training finished: no steps were taken");
}

// ---- Loss plot ------------------------------------------------------------------------------------

namespace {

bool python_available() { return std::system("python3 -c 'import xml.etree.ElementTree' >/dev/null 2>&1") == 0; }

// Parses the SVG as XML and reports what it draws, one "name=value" per line.
std::string inspect_svg(const fs::path& svg) {
  const char* script = R"PY(
import sys, xml.etree.ElementTree as ET
ns = {'s': 'http://www.w3.org/2000/svg'}
root = ET.parse(sys.argv[1]).getroot()
assert root.tag == '{http://www.w3.org/2000/svg}svg', root.tag
def points(cls):
    line = root.find(f"s:polyline[@class='{cls}']", ns)
    return -1 if line is None else len(line.get('points').split())
def circles(cls):
    group = root.find(f"s:g[@class='{cls}']", ns)
    return 0 if group is None else len(group.findall('s:circle', ns))
print('raw', points('train-raw'))
print('smoothed', points('train-smoothed'))
print('raw_dots', circles('train-raw-points'))
print('eval', circles('eval-points'))
print('x_ticks', len(root.findall("s:g[@class='tick-labels']/s:text[@text-anchor='middle']", ns)))
print('y_ticks', len(root.findall("s:g[@class='tick-labels']/s:text[@text-anchor='end']", ns)))
for note in root.findall("s:text[@class='note']", ns): print('note', note.text)
print('title', root.find("s:text[@class='title']", ns).text)
)PY";
  fs::path script_file = svg.parent_path() / "inspect_svg.py";
  std::ofstream(script_file) << script;
  std::string command = "python3 '" + script_file.string() + "' '" + svg.string() + "' 2>&1";
  std::string output;
  FILE* pipe = ::popen(command.c_str(), "r");
  if (!pipe) return "popen failed";
  char buffer[4096];
  while (size_t n = std::fread(buffer, 1, sizeof buffer, pipe)) output.append(buffer, n);
  int status = ::pclose(pipe);
  if (status != 0) return "python failed: " + output;
  return output;
}

}  // namespace

TEST(LossPlot, PathSitsNextToTheMetricsFile) {
  EXPECT_EQ(loss_plot_path_for("out/metrics.jsonl"), fs::path("out/metrics.svg"));
  EXPECT_EQ(loss_plot_path_for("/runs/a/log"), fs::path("/runs/a/log.svg"));
  EXPECT_EQ(loss_plot_path_for("weird.svg"), fs::path("weird.svg.svg"));
}

TEST(LossPlot, IsValidSvgWithOnePointPerFiniteStepAndNotesTheRest) {
  if (!python_available()) GTEST_SKIP() << "python3 is needed to parse the SVG";
  TempDir dir;
  std::vector<double> losses;
  for (int i = 0; i < 50; ++i) losses.push_back(2.0 + std::exp(-0.1 * i) + 0.05 * std::sin(i));
  losses[10] = kNaN;
  losses[30] = kInf;
  auto records = steps_with_losses(losses);
  records[19].eval_loss = 2.4;
  records[39].eval_loss = 2.2;
  records[49].eval_loss = 2.1;
  LossPlotOptions options;
  options.title = "Run <A & B>";
  fs::path svg = loss_plot_path_for(dir.path() / "metrics.jsonl");
  write_loss_plot_svg(records, svg, options);
  std::string report = inspect_svg(svg);
  EXPECT_NE(report.find("raw 48\n"), std::string::npos) << report;
  EXPECT_NE(report.find("smoothed 48\n"), std::string::npos) << report;
  EXPECT_NE(report.find("raw_dots 48\n"), std::string::npos) << report;
  EXPECT_NE(report.find("eval 3\n"), std::string::npos) << report;
  EXPECT_NE(report.find("note 2 steps with a non-finite loss not shown (first at step 11)"), std::string::npos) << report;
  EXPECT_NE(report.find("title Run <A & B>"), std::string::npos) << report;
  EXPECT_EQ(report.find("x_ticks 0\n"), std::string::npos) << report;
  EXPECT_EQ(report.find("y_ticks 0\n"), std::string::npos) << report;
  EXPECT_EQ(std::distance(fs::directory_iterator(dir.path()), fs::directory_iterator()), 2)
      << "the SVG and the inspection script, no temporary";
}

TEST(LossPlot, ZeroOneAndOnlyNonFinitePointsStillMakeValidSvg) {
  if (!python_available()) GTEST_SKIP() << "python3 is needed to parse the SVG";
  TempDir dir;
  fs::path svg = dir.path() / "metrics.svg";

  write_loss_plot_svg({}, svg);
  std::string report = inspect_svg(svg);
  EXPECT_NE(report.find("raw -1\n"), std::string::npos) << report;
  EXPECT_NE(report.find("note no steps logged yet"), std::string::npos) << report;

  write_loss_plot_svg(steps_with_losses({1.75}), svg);
  report = inspect_svg(svg);
  EXPECT_NE(report.find("raw 1\n"), std::string::npos) << report;
  EXPECT_NE(report.find("raw_dots 1\n"), std::string::npos) << report;
  EXPECT_EQ(report.find("note"), std::string::npos) << report;

  write_loss_plot_svg(steps_with_losses({kNaN, kInf}), svg);
  report = inspect_svg(svg);
  EXPECT_NE(report.find("raw -1\n"), std::string::npos) << report;
  EXPECT_NE(report.find("note no finite loss to plot"), std::string::npos) << report;
  EXPECT_NE(report.find("note 2 steps with a non-finite loss"), std::string::npos) << report;
}

TEST(LossPlot, ManyStepsDrawLinesWithoutPerStepDots) {
  if (!python_available()) GTEST_SKIP() << "python3 is needed to parse the SVG";
  TempDir dir;
  std::vector<double> losses;
  for (int i = 0; i < 5000; ++i) losses.push_back(1.0 + 1.0 / (1 + i));
  fs::path svg = dir.path() / "metrics.svg";
  write_loss_plot_svg(steps_with_losses(losses), svg);
  std::string report = inspect_svg(svg);
  EXPECT_NE(report.find("raw 5000\n"), std::string::npos) << report;
  EXPECT_NE(report.find("raw_dots 0\n"), std::string::npos) << report;
}

TEST(LossPlot, LogScaleWhenLossesSpanAFactorOfTen) {
  auto falling = steps_with_losses({12.0, 6.0, 3.0, 1.0, 0.5});
  EXPECT_NE(render_loss_plot_svg(falling).find("log scale"), std::string::npos);
  LossPlotOptions linear;
  linear.y_scale = LossPlotScale::Linear;
  EXPECT_EQ(render_loss_plot_svg(falling, linear).find("log scale"), std::string::npos);
  auto flat = steps_with_losses({2.0, 1.9, 1.8});
  EXPECT_EQ(render_loss_plot_svg(flat).find("log scale"), std::string::npos);
  LossPlotOptions log;
  log.y_scale = LossPlotScale::Log;
  EXPECT_NE(render_loss_plot_svg(flat, log).find("log scale"), std::string::npos);
  auto with_zero = steps_with_losses({2.0, 0.0});
  EXPECT_EQ(render_loss_plot_svg(with_zero, log).find("log scale"), std::string::npos)
      << "a zero loss cannot go on a log axis";
}

TEST(LossPlot, PointsStayInsideThePlotArea) {
  LossPlotOptions options;
  for (auto scale : {LossPlotScale::Linear, LossPlotScale::Log}) {
    options.y_scale = scale;
    std::string svg = render_loss_plot_svg(steps_with_losses({9.0, 0.3, 5.0, 0.31, 0.29}), options);
    size_t at = svg.find("class=\"train-raw\"");
    ASSERT_NE(at, std::string::npos);
    size_t begin = svg.find("points=\"", at) + 8;
    std::istringstream points(svg.substr(begin, svg.find('"', begin) - begin));
    int count = 0;
    for (std::string point; points >> point; ++count) {
      double x = std::stod(point.substr(0, point.find(',')));
      double y = std::stod(point.substr(point.find(',') + 1));
      EXPECT_GE(x, 70);
      EXPECT_LE(x, options.width - 20);
      EXPECT_GE(y, 60);
      EXPECT_LE(y, options.height - 55);
    }
    EXPECT_EQ(count, 5);
  }
}

TEST(LossPlot, SinglePointsOfAnyMagnitudeGetAnAxis) {
  // One step's smoothed loss can differ from its loss in the last bit: a near-empty range.
  for (double loss : {12.384772379863158, 0.0, 1e-7, 3.3e6, -2.5}) {
    for (auto scale : {LossPlotScale::Auto, LossPlotScale::Log}) {
      LossPlotOptions options;
      options.y_scale = scale;
      std::string svg = render_loss_plot_svg(steps_with_losses({loss}), options);
      EXPECT_NE(svg.find("class=\"train-raw\""), std::string::npos) << loss;
      EXPECT_GE(count_of(svg, "text-anchor=\"end\" dominant-baseline"), 2) << loss << ": y ticks\n" << svg;
    }
  }
}
