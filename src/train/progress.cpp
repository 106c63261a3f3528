#include "train/progress.h"

#include <sys/ioctl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include <fmt/format.h>

namespace spindle::train {
namespace {

// Enough steps to even out per-step noise, few enough that the ETA follows a change of pace
// (sequence lengths growing, evaluation pauses).
constexpr size_t kEtaWindowSteps = 20;
constexpr int kMinBarColumns = 10;
constexpr int kMaxBarColumns = 30;

std::string format_loss(double loss) {
  if (std::isnan(loss)) return "nan";
  if (std::isinf(loss)) return loss > 0 ? "inf" : "-inf";
  return fmt::format("{:.4f}", loss);
}

std::string format_optional_loss(const std::optional<double>& loss) {
  return loss ? format_loss(*loss) : "-";
}

// `fraction` of `columns` filled, in eighths of a cell so slow runs still visibly move.
std::string render_bar(double fraction, int columns) {
  static const char* const kPartialBlocks[] = {"", "▏", "▎", "▍", "▌", "▋", "▊", "▉"};
  fraction = std::clamp(fraction, 0.0, 1.0);
  int eighths = static_cast<int>(fraction * columns * 8);
  int full = eighths / 8;
  int partial = eighths % 8;
  std::string bar;
  for (int i = 0; i < full; ++i) bar += "█";
  int used = full;
  if (partial > 0 && used < columns) {
    bar += kPartialBlocks[partial];
    ++used;
  }
  bar.append(static_cast<size_t>(columns - used), ' ');
  return bar;
}

}  // namespace

bool stderr_is_terminal() {
  // Under spindle's launcher stderr is a pipe to it; it says whether its own stderr is a terminal.
  if (std::getenv(kLauncherTerminalColumns)) return true;
  return ::isatty(STDERR_FILENO) == 1;
}

int stderr_terminal_columns(int fallback) {
  if (const char* forwarded = std::getenv(kLauncherTerminalColumns)) {
    const int value = std::atoi(forwarded);
    if (value > 0) return value;
  }
  winsize size{};
  if (::ioctl(STDERR_FILENO, TIOCGWINSZ, &size) == 0 && size.ws_col > 0) return size.ws_col;
  if (const char* columns = std::getenv("COLUMNS")) {
    int value = std::atoi(columns);
    if (value > 0) return value;
  }
  return fallback;
}

std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  auto total = static_cast<int64_t>(std::llround(seconds));
  int64_t hours = total / 3600, minutes = total / 60 % 60, secs = total % 60;
  if (hours > 0) return fmt::format("{}:{:02}:{:02}", hours, minutes, secs);
  return fmt::format("{}:{:02}", minutes, secs);
}

std::string format_rate(double per_second) {
  if (!std::isfinite(per_second) || per_second < 0) return "?";
  if (per_second < 1e3) return fmt::format("{:.0f}", per_second);
  if (per_second < 1e6) return fmt::format("{:.1f}k", per_second / 1e3);
  if (per_second < 1e9) return fmt::format("{:.2f}M", per_second / 1e6);
  return fmt::format("{:.2f}G", per_second / 1e9);
}

std::string format_offload_copies(const StepMetrics& step) {
  const double rate = static_cast<double>(step.offload_copy_bytes) / step.offload_copy_seconds;
  const double wait = step.offload_wait_seconds;
  return fmt::format("{:.1f} GB/s, +{}", rate / 1e9,
                     wait < 60 ? fmt::format("{:.2f} s", wait) : format_duration(wait));
}

std::string format_memory(int64_t bytes) {
  constexpr double kMiB = 1024.0 * 1024.0, kGiB = kMiB * 1024.0;
  if (bytes < static_cast<int64_t>(kGiB)) return fmt::format("{:.0f} MiB", bytes / kMiB);
  return fmt::format("{:.2f} GiB", bytes / kGiB);
}

std::string format_count(int64_t count) {
  std::string digits = std::to_string(count < 0 ? -count : count);
  std::string grouped;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) grouped += ',';
    grouped += digits[i];
  }
  return count < 0 ? "-" + grouped : grouped;
}

ProgressDisplay::ProgressDisplay(std::ostream& out, ProgressOptions options)
    : out_(out), options_(options) {
  if (options_.log_every < 1) options_.log_every = 1;
}

std::optional<double> ProgressDisplay::seconds_per_step() const {
  if (recent_steps_.size() >= 2) {
    auto [first_step, first_seconds] = recent_steps_.front();
    auto [last_step, last_seconds] = recent_steps_.back();
    if (last_step > first_step && last_seconds >= first_seconds)
      return (last_seconds - first_seconds) / static_cast<double>(last_step - first_step);
  }
  if (latest_ && latest_->step_seconds > 0) return latest_->step_seconds;
  return std::nullopt;
}

std::string ProgressDisplay::terminal_line() const {
  if (!latest_) return {};
  const StepMetrics& step = *latest_;
  const int64_t total = options_.total_steps;

  std::string prefix;
  if (total > 0) {
    double percent = 100.0 * static_cast<double>(step.step) / static_cast<double>(total);
    prefix = fmt::format("{:3.0f}% ", std::floor(percent));
  }
  std::string rest = total > 0 ? fmt::format(" {}/{}", step.step, total) : fmt::format("step {}", step.step);
  rest += fmt::format("  loss {} (last {})", format_optional_loss(smoother_.value()), format_loss(step.loss));
  rest += fmt::format("  {} tok/s", format_rate(step.tokens_per_s));
  if (step.peak_memory_bytes > 0) rest += "  " + format_memory(step.peak_memory_bytes);
  if (step.offload_host_bytes > 0) {
    rest += " +" + format_memory(step.offload_host_bytes) + " host";
    if (step.offload_copy_seconds > 0) rest += " (" + format_offload_copies(step) + ")";
  }
  rest += "  " + format_duration(step.elapsed_seconds);
  if (auto per_step = seconds_per_step(); per_step && total > 0)
    rest += "<" + format_duration(*per_step * static_cast<double>(std::max<int64_t>(total - step.step, 0)));

  // One column spare: writing into the last column makes some terminals wrap, and a wrapped line
  // can no longer be rewritten with \r.
  const int columns = std::max(options_.terminal_columns - 1, 1);
  const int text_columns = static_cast<int>(prefix.size() + rest.size());
  if (total > 0) {
    int bar_columns = std::min(columns - text_columns - 2, kMaxBarColumns);
    if (bar_columns >= kMinBarColumns) {
      double fraction = static_cast<double>(step.step) / static_cast<double>(total);
      return prefix + "|" + render_bar(fraction, bar_columns) + "|" + rest;
    }
  }
  std::string line = prefix + (total > 0 ? rest.substr(1) : rest);
  if (static_cast<int>(line.size()) > columns) line.resize(static_cast<size_t>(columns));
  return line;
}

std::string ProgressDisplay::plain_line() const {
  if (!latest_) return {};
  const StepMetrics& step = *latest_;
  const int64_t total = options_.total_steps;
  std::string line = total > 0 ? fmt::format("step {}/{} ({:.0f}%)", step.step, total,
                                             std::floor(100.0 * static_cast<double>(step.step) /
                                                        static_cast<double>(total)))
                               : fmt::format("step {}", step.step);
  line += fmt::format(" | epoch {:.2f} | loss {} (smoothed {}) | grad_norm {:.3g} | lr {:.3e}", step.epoch,
                      format_loss(step.loss), format_optional_loss(smoother_.value()), step.grad_norm,
                      step.lr);
  if (step.aux_loss) line += " | aux_loss " + format_loss(*step.aux_loss);
  line += fmt::format(" | {} tokens/s", format_rate(step.tokens_per_s));
  if (step.peak_memory_bytes > 0) line += " | peak " + format_memory(step.peak_memory_bytes);
  if (step.offload_host_bytes > 0) {
    line += " | offloaded " + format_memory(step.offload_host_bytes) + " to host";
    if (step.offload_copy_seconds > 0) line += ", copies " + format_offload_copies(step);
  }
  line += " | elapsed " + format_duration(step.elapsed_seconds);
  if (auto per_step = seconds_per_step(); per_step && total > 0 && step.step < total)
    line += " | eta " +
            format_duration(*per_step * static_cast<double>(std::max<int64_t>(total - step.step, 0)));
  if (step.eval_loss) line += " | eval_loss " + format_loss(*step.eval_loss);
  return line;
}

void ProgressDisplay::draw_terminal_line() {
  // \x1b[K clears what a longer previous line left to the right.
  out_ << '\r' << terminal_line() << "\x1b[K";
  out_.flush();
  line_is_drawn_ = true;
  latest_is_drawn_ = true;
  last_draw_seconds_ = latest_->elapsed_seconds;
}

void ProgressDisplay::update(const StepMetrics& step) {
  const bool first_update = !latest_;
  latest_ = step;
  latest_is_drawn_ = false;
  smoother_.add(step.loss);
  recent_steps_.emplace_back(step.step, step.elapsed_seconds);
  if (recent_steps_.size() > kEtaWindowSteps) recent_steps_.pop_front();
  const bool last_step = options_.total_steps > 0 && step.step >= options_.total_steps;

  if (options_.is_terminal) {
    // An evaluation result is worth keeping on screen, not just a moment in the bar.
    if (step.eval_loss) {
      message(fmt::format("step {}: eval_loss {}", step.step, format_loss(*step.eval_loss)));
      return;  // message() redrew the line
    }
    const bool due = !last_draw_seconds_ ||
                     step.elapsed_seconds - *last_draw_seconds_ >= options_.min_redraw_seconds ||
                     step.elapsed_seconds < *last_draw_seconds_;
    if (first_update || last_step || due) draw_terminal_line();
    return;
  }
  if (first_update || last_step || step.step % options_.log_every == 0 || step.eval_loss) {
    out_ << plain_line() << '\n';
    out_.flush();
    latest_is_drawn_ = true;
  }
}

void ProgressDisplay::message(std::string_view text) {
  if (options_.is_terminal && line_is_drawn_) out_ << "\r\x1b[K";
  out_ << text << '\n';
  line_is_drawn_ = false;
  if (options_.is_terminal && latest_)
    draw_terminal_line();
  else
    out_.flush();
}

void ProgressDisplay::finish() {
  if (latest_ && !latest_is_drawn_) {
    if (options_.is_terminal) {
      draw_terminal_line();
    } else {
      out_ << plain_line() << '\n';
      latest_is_drawn_ = true;
    }
  }
  if (options_.is_terminal && line_is_drawn_) out_ << '\n';
  line_is_drawn_ = false;
  out_.flush();
}

RunSummary summarize_run(const std::vector<StepMetrics>& records) {
  RunSummary summary;
  if (records.empty()) return summary;
  LossSmoother smoother;
  double step_seconds = 0;
  int64_t summed_tokens = 0;
  for (const StepMetrics& record : records) {
    smoother.add(record.loss);
    summed_tokens += record.tokens;
    summary.num_items += record.num_items;
    if (std::isfinite(record.step_seconds) && record.step_seconds > 0) step_seconds += record.step_seconds;
    summary.peak_memory_bytes = std::max(summary.peak_memory_bytes, record.peak_memory_bytes);
    if (!std::isfinite(record.loss)) {
      ++summary.non_finite_losses;
    } else if (!summary.best_loss || record.loss < summary.best_loss->second) {
      summary.best_loss = {record.step, record.loss};
    }
    if (record.eval_loss && std::isfinite(*record.eval_loss)) {
      summary.final_eval_loss = {record.step, *record.eval_loss};
      if (!summary.best_eval_loss || *record.eval_loss < summary.best_eval_loss->second)
        summary.best_eval_loss = {record.step, *record.eval_loss};
    }
  }
  const StepMetrics& last = records.back();
  summary.steps = last.step;
  summary.epoch = last.epoch;
  // total_tokens carries steps from before a resume whose lines may have been pruned by hand.
  summary.tokens = std::max(last.total_tokens, summed_tokens);
  summary.wall_seconds = last.elapsed_seconds;
  summary.mean_tokens_per_s = step_seconds > 0 ? static_cast<double>(summed_tokens) / step_seconds : 0;
  summary.final_loss = last.loss;
  summary.final_smoothed_loss = smoother.value();
  return summary;
}

void write_run_summary(std::ostream& out, const RunSummary& summary, int64_t planned_steps,
                       const std::vector<OutputLocation>& outputs) {
  constexpr int kLabelWidth = 13;
  auto row = [&](std::string_view label, const std::string& value) {
    out << fmt::format("  {:<{}}{}\n", label, kLabelWidth, value);
  };

  if (summary.steps == 0) {
    out << "Training finished: no steps were taken\n";
  } else if (planned_steps > 0 && summary.steps < planned_steps) {
    out << fmt::format("Training stopped at step {} of {} (epoch {:.2f}) after {}\n", format_count(summary.steps),
                       format_count(planned_steps), summary.epoch, format_duration(summary.wall_seconds));
  } else {
    out << fmt::format("Training finished: {} steps (epoch {:.2f}) in {}\n", format_count(summary.steps),
                       summary.epoch, format_duration(summary.wall_seconds));
  }
  if (summary.steps > 0) {
    row("tokens", fmt::format("{} ({} supervised), {} tokens/s on average", format_count(summary.tokens),
                              format_count(summary.num_items), format_rate(summary.mean_tokens_per_s)));
    std::string loss = fmt::format("final {} (smoothed {})", format_optional_loss(summary.final_loss),
                                   format_optional_loss(summary.final_smoothed_loss));
    if (summary.best_loss)
      loss += fmt::format(", lowest {} at step {}", format_loss(summary.best_loss->second),
                          format_count(summary.best_loss->first));
    row("loss", loss);
  }
  if (summary.final_eval_loss) {
    std::string eval = fmt::format("final {} at step {}", format_loss(summary.final_eval_loss->second),
                                   format_count(summary.final_eval_loss->first));
    if (summary.best_eval_loss && summary.best_eval_loss->first != summary.final_eval_loss->first)
      eval += fmt::format(", lowest {} at step {}", format_loss(summary.best_eval_loss->second),
                          format_count(summary.best_eval_loss->first));
    row("eval loss", eval);
  }
  if (summary.peak_memory_bytes > 0) row("peak memory", format_memory(summary.peak_memory_bytes));
  if (summary.non_finite_losses > 0)
    row("warning", fmt::format("{} step{} had a non-finite loss", format_count(summary.non_finite_losses),
                               summary.non_finite_losses == 1 ? "" : "s"));
  size_t what_width = 0;
  for (const OutputLocation& output : outputs) what_width = std::max(what_width, output.what.size());
  for (size_t i = 0; i < outputs.size(); ++i)
    row(i == 0 ? "outputs" : "",
        fmt::format("{:<{}}  {}", outputs[i].what, what_width, outputs[i].where.string()));
  out.flush();
}

}  // namespace spindle::train
