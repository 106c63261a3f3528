// What a user watching `spindle sft` sees: on a terminal one self-updating progress line; in CI or
// a log file (no terminal, so carriage returns would only pile up) plain lines every few steps.
// Then a summary block once training ends. Everything renders into an injected stream and takes
// its times from the metrics, so tests see exactly what a user would.
#pragma once

#include <cstdint>
#include <deque>
#include <filesystem>
#include <optional>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "train/metrics.h"

namespace spindle::train {

// Set by spindle's launcher for its ranks when its own stderr is a terminal: the columns a rank's
// lines have after the launcher's "[rank N] " prefix.
inline constexpr const char* kLauncherTerminalColumns = "SPINDLE_TERMINAL_COLUMNS";

// True when stderr is a terminal (or the launcher's is); and its width in columns, or `fallback`
// when it cannot be asked.
bool stderr_is_terminal();
int stderr_terminal_columns(int fallback = 100);

struct ProgressOptions {
  int64_t total_steps = 0;   // steps the run will take; 0 when unknown (no bar, no ETA)
  int64_t log_every = 10;    // plain-line mode: one line every this many steps
  bool is_terminal = false;  // one self-updating line instead of plain lines
  int terminal_columns = 100;
  // Redrawing faster than the eye reads only costs terminal bandwidth (and ssh latency).
  double min_redraw_seconds = 0.1;
};

class ProgressDisplay {
 public:
  ProgressDisplay(std::ostream& out, ProgressOptions options);

  // After every optimizer step. Times come from `step.elapsed_seconds`.
  void update(const StepMetrics& step);
  // A line that must stay on screen (a checkpoint written, a warning). On a terminal the progress
  // line is cleared first and redrawn after it.
  void message(std::string_view text);
  // Draws the latest state if a redraw was skipped, and ends the progress line so later output
  // starts on a fresh line. Safe to call more than once.
  void finish();

  // Exposed for tests: the text of the terminal line and of a plain line for the latest step.
  std::string terminal_line() const;
  std::string plain_line() const;

 private:
  void draw_terminal_line();
  std::optional<double> seconds_per_step() const;

  std::ostream& out_;
  ProgressOptions options_;
  std::optional<StepMetrics> latest_;
  LossSmoother smoother_;
  std::deque<std::pair<int64_t, double>> recent_steps_;  // (step, elapsed) for the ETA
  std::optional<double> last_draw_seconds_;
  bool line_is_drawn_ = false;  // the terminal line is on screen (and not yet ended)
  bool latest_is_drawn_ = false;
};

struct RunSummary {
  int64_t steps = 0;  // last step logged
  double epoch = 0;
  int64_t tokens = 0;
  int64_t num_items = 0;
  double wall_seconds = 0;
  double mean_tokens_per_s = 0;  // tokens / time spent in steps (evaluation and saving excluded)
  std::optional<double> final_loss;
  std::optional<double> final_smoothed_loss;
  std::optional<std::pair<int64_t, double>> best_loss;  // (step, loss)
  std::optional<std::pair<int64_t, double>> final_eval_loss;
  std::optional<std::pair<int64_t, double>> best_eval_loss;
  int64_t non_finite_losses = 0;
  int64_t peak_memory_bytes = 0;
};

// From the whole metrics log, so a resumed run's summary covers the steps before the resume too.
RunSummary summarize_run(const std::vector<StepMetrics>& records);

struct OutputLocation {
  std::string what;  // "adapter", "metrics", "loss plot", ...
  std::filesystem::path where;
};

void write_run_summary(std::ostream& out, const RunSummary& summary, int64_t planned_steps,
                       const std::vector<OutputLocation>& outputs);

// Human-readable forms shared by the display, the summary and the plot.
std::string format_duration(double seconds);       // 0:07, 12:34, 1:02:03, 27:46:40
std::string format_rate(double per_second);        // 850, 12.3k, 4.56M
std::string format_memory(int64_t bytes);          // 512 MiB, 3.21 GiB
// Activation offload's copies of a step: their bandwidth and the time compute waited for them
// ("24.1 GB/s, +0.12 s"); needs offload_copy_seconds > 0.
std::string format_offload_copies(const StepMetrics& step);
std::string format_count(int64_t count);           // 12,345,678

}  // namespace spindle::train
