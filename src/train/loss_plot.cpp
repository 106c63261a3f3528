#include "train/loss_plot.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "core/error.h"

namespace spindle::train {
namespace {

// Drawing every step as a dot turns into a smear past a few hundred; the line alone reads better.
constexpr size_t kMaxRawDots = 300;
constexpr double kLogScaleMinRatio = 10;

constexpr std::string_view kRawColor = "#9ecae1";
constexpr std::string_view kSmoothedColor = "#08519c";
constexpr std::string_view kEvalColor = "#d94801";

struct Point {
  double step;
  double loss;
};

std::string escape_xml(std::string_view text) {
  std::string escaped;
  for (char c : text) {
    switch (c) {
      case '&': escaped += "&amp;"; break;
      case '<': escaped += "&lt;"; break;
      case '>': escaped += "&gt;"; break;
      case '"': escaped += "&quot;"; break;
      case '\'': escaped += "&apos;"; break;
      default: escaped += c;
    }
  }
  return escaped;
}

// A step of 1, 2 or 5 times a power of ten giving roughly `target` intervals over [low, high].
double nice_tick_step(double low, double high, int target) {
  double raw = (high - low) / target;
  double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double normalized = raw / magnitude;
  double nice = normalized < 1.5 ? 1 : normalized < 3.5 ? 2 : normalized < 7.5 ? 5 : 10;
  return nice * magnitude;
}

std::vector<double> ticks_between(double low, double high, double step) {
  std::vector<double> ticks;
  // Counting in whole steps (not adding step to a running value) so rounding can neither stall
  // the loop nor drift; the tolerance keeps a tick sitting exactly on an end.
  const double first = std::ceil(low / step - 1e-9), last = std::floor(high / step + 1e-9);
  if (!(last - first < 1000)) return ticks;
  for (double index = first; index <= last; ++index) ticks.push_back(index == 0 ? 0.0 : index * step);
  return ticks;
}

// Ranges narrower than this share of their magnitude are one value plus rounding noise (the
// smoothed loss of a single step differs from the loss in the last bit).
bool is_degenerate_range(double low, double high) {
  return high - low <= 1e-9 * std::max({std::abs(low), std::abs(high), 1e-300});
}

int decimals_for(double tick_step) {
  return std::max(0, static_cast<int>(-std::floor(std::log10(tick_step) + 1e-9)));
}

std::string format_step_tick(double step) {
  auto value = static_cast<int64_t>(std::llround(step));
  if (value >= 10000 && value % 1000 == 0) return fmt::format("{}k", value / 1000);
  return std::to_string(value);
}

std::string format_loss_tick(double value, int decimals) { return fmt::format("{:.{}f}", value, decimals); }

struct Axis {
  double low = 0, high = 1;  // data range shown, in plotted units (log10 of the loss on a log axis)
  bool log = false;
  std::vector<std::pair<double, std::string>> ticks;  // (value in plotted units, label)

  double plotted(double value) const { return log ? std::log10(value) : value; }
};

Axis step_axis(double first, double last) {
  Axis axis;
  if (first == last) {
    first = std::max(0.0, first - 1);
    last = last + 1;
  }
  axis.low = first;
  axis.high = last;
  double step = std::max(1.0, nice_tick_step(first, last, 8));
  for (double tick : ticks_between(first, last, step)) axis.ticks.emplace_back(tick, format_step_tick(tick));
  return axis;
}

Axis linear_loss_axis(double low, double high) {
  Axis axis;
  if (is_degenerate_range(low, high)) {
    double pad = low == 0 ? 1 : std::abs(low) * 0.1;
    low -= pad;
    high += pad;
  }
  double step = nice_tick_step(low, high, 6);
  // Snapping the range outwards to whole ticks leaves a margin and labels both ends.
  axis.low = std::floor(low / step + 1e-9) * step;
  axis.high = std::ceil(high / step - 1e-9) * step;
  int decimals = decimals_for(step);
  for (double tick : ticks_between(axis.low, axis.high, step))
    axis.ticks.emplace_back(tick, format_loss_tick(tick, decimals));
  return axis;
}

Axis log_loss_axis(double low, double high) {
  Axis axis;
  axis.log = true;
  double log_low = std::log10(low), log_high = std::log10(high);
  double pad = std::max((log_high - log_low) * 0.05, 0.02);
  axis.low = log_low - pad;
  axis.high = log_high + pad;
  // Decades alone are too sparse when the curve spans less than about two of them.
  const bool with_intermediate = axis.high - axis.low < 2.5;
  for (int decade = static_cast<int>(std::floor(axis.low)); decade <= static_cast<int>(std::ceil(axis.high));
       ++decade) {
    for (double mantissa : {1.0, 2.0, 5.0}) {
      if (mantissa != 1.0 && !with_intermediate) continue;
      double value = mantissa * std::pow(10.0, decade);
      double plotted = std::log10(value);
      if (plotted < axis.low || plotted > axis.high) continue;
      axis.ticks.emplace_back(plotted, fmt::format("{:g}", value));
    }
  }
  if (axis.ticks.size() < 2) {
    // Less than a factor of 2 between the ends: label evenly spaced values instead.
    // The padded range, not the data's: a single point has no width of its own.
    const double shown_low = std::pow(10.0, axis.low), shown_high = std::pow(10.0, axis.high);
    double step = nice_tick_step(shown_low, shown_high, 4);
    int decimals = decimals_for(step);
    axis.ticks.clear();
    for (double tick : ticks_between(shown_low, shown_high, step))
      if (tick > 0) axis.ticks.emplace_back(std::log10(tick), format_loss_tick(tick, decimals));
  }
  return axis;
}

class Canvas {
 public:
  Canvas(double left, double top, double right, double bottom, const Axis& x, const Axis& y)
      : left_(left), top_(top), right_(right), bottom_(bottom), x_(x), y_(y) {}

  double x(double step) const { return left_ + (step - x_.low) / (x_.high - x_.low) * (right_ - left_); }
  double y(double loss) const {
    return bottom_ - (y_.plotted(loss) - y_.low) / (y_.high - y_.low) * (bottom_ - top_);
  }
  double y_plotted(double plotted) const {
    return bottom_ - (plotted - y_.low) / (y_.high - y_.low) * (bottom_ - top_);
  }

 private:
  double left_, top_, right_, bottom_;
  const Axis& x_;
  const Axis& y_;
};

std::string polyline(std::string_view css_class, const std::vector<Point>& points, const Canvas& canvas,
                     std::string_view stroke, double width, std::string_view extra = "") {
  std::string svg = fmt::format(R"(  <polyline class="{}" fill="none" stroke="{}" stroke-width="{}"{} points=")",
                                css_class, stroke, width, extra);
  for (size_t i = 0; i < points.size(); ++i)
    svg += fmt::format("{}{:.1f},{:.1f}", i == 0 ? "" : " ", canvas.x(points[i].step), canvas.y(points[i].loss));
  svg += "\"/>\n";
  return svg;
}

}  // namespace

std::filesystem::path loss_plot_path_for(const std::filesystem::path& metrics_file) {
  std::filesystem::path plot = metrics_file;
  plot.replace_extension(".svg");
  if (plot == metrics_file) plot += ".svg";  // metrics file already named *.svg: never overwrite it
  return plot;
}

std::string render_loss_plot_svg(const std::vector<StepMetrics>& records, const LossPlotOptions& options) {
  std::vector<Point> raw, smoothed, eval;
  std::optional<int64_t> first_bad_loss_step;
  int64_t bad_losses = 0, bad_eval_losses = 0;
  LossSmoother smoother;
  for (const StepMetrics& record : records) {
    if (std::isfinite(record.loss)) {
      raw.push_back({static_cast<double>(record.step), record.loss});
      smoother.add(record.loss);
      smoothed.push_back({static_cast<double>(record.step), *smoother.value()});
    } else {
      ++bad_losses;
      if (!first_bad_loss_step) first_bad_loss_step = record.step;
    }
    if (record.eval_loss) {
      if (std::isfinite(*record.eval_loss))
        eval.push_back({static_cast<double>(record.step), *record.eval_loss});
      else
        ++bad_eval_losses;
    }
  }

  double first_step = std::numeric_limits<double>::infinity(), last_step = -first_step;
  double lowest = std::numeric_limits<double>::infinity(), highest = -lowest;
  for (const auto* series : {&raw, &smoothed, &eval}) {
    for (const Point& p : *series) {
      first_step = std::min(first_step, p.step);
      last_step = std::max(last_step, p.step);
      lowest = std::min(lowest, p.loss);
      highest = std::max(highest, p.loss);
    }
  }
  const bool has_points = std::isfinite(first_step);
  if (!has_points) {
    first_step = 0;
    last_step = 1;
    lowest = 0;
    highest = 1;
  }
  bool use_log = false;
  if (has_points && lowest > 0) {
    use_log = options.y_scale == LossPlotScale::Log ||
              (options.y_scale == LossPlotScale::Auto && highest / lowest >= kLogScaleMinRatio);
  }
  const Axis x_axis = step_axis(first_step, last_step);
  const Axis y_axis = use_log ? log_loss_axis(lowest, highest) : linear_loss_axis(lowest, highest);

  const double width = std::max(options.width, 300), height = std::max(options.height, 200);
  const double left = 70, right = width - 20, top = 60, bottom = height - 55;
  const Canvas canvas(left, top, right, bottom, x_axis, y_axis);

  std::string svg;
  svg += "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  svg += fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"Helvetica, Arial, sans-serif\" font-size=\"12\">\n",
      width, height);
  svg += fmt::format("  <title>{}</title>\n", escape_xml(options.title));
  svg += fmt::format("  <rect width=\"{}\" height=\"{}\" fill=\"white\"/>\n", width, height);
  svg += fmt::format("  <text class=\"title\" x=\"{:.1f}\" y=\"24\" text-anchor=\"middle\" font-size=\"16\" "
                     "font-weight=\"bold\">{}</text>\n",
                     width / 2, escape_xml(options.title));
  std::string subtitle;
  if (!raw.empty()) {
    const size_t steps = raw.size() + static_cast<size_t>(bad_losses);
    subtitle = fmt::format("{} step{}, final loss {:.4f} (smoothed {:.4f})", steps, steps == 1 ? "" : "s",
                           raw.back().loss, smoothed.back().loss);
    if (!eval.empty()) subtitle += fmt::format(", final eval loss {:.4f}", eval.back().loss);
  } else if (!eval.empty()) {
    subtitle = fmt::format("final eval loss {:.4f}", eval.back().loss);
  }
  if (use_log) subtitle += subtitle.empty() ? "log scale" : ", log scale";
  if (!subtitle.empty())
    svg += fmt::format("  <text class=\"subtitle\" x=\"{:.1f}\" y=\"42\" text-anchor=\"middle\" fill=\"#555\">{}</text>\n",
                       width / 2, escape_xml(subtitle));

  // Grid and tick labels.
  svg += "  <g class=\"grid\" stroke=\"#e5e5e5\" stroke-width=\"1\">\n";
  for (const auto& [value, label] : x_axis.ticks)
    svg += fmt::format("    <line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\"/>\n", canvas.x(value),
                       top, bottom);
  for (const auto& [value, label] : y_axis.ticks)
    svg += fmt::format("    <line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\"/>\n", left,
                       canvas.y_plotted(value), right);
  svg += "  </g>\n";
  svg += "  <g class=\"axes\" stroke=\"#333\" stroke-width=\"1\">\n";
  svg += fmt::format("    <line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\"/>\n", left, bottom, right);
  svg += fmt::format("    <line x1=\"{0}\" y1=\"{1}\" x2=\"{0}\" y2=\"{2}\"/>\n", left, top, bottom);
  for (const auto& [value, label] : x_axis.ticks)
    svg += fmt::format("    <line x1=\"{0:.1f}\" y1=\"{1}\" x2=\"{0:.1f}\" y2=\"{2}\"/>\n", canvas.x(value), bottom,
                       bottom + 5);
  for (const auto& [value, label] : y_axis.ticks)
    svg += fmt::format("    <line x1=\"{0}\" y1=\"{1:.1f}\" x2=\"{2}\" y2=\"{1:.1f}\"/>\n", left - 5,
                       canvas.y_plotted(value), left);
  svg += "  </g>\n";
  svg += "  <g class=\"tick-labels\" fill=\"#333\">\n";
  for (const auto& [value, label] : x_axis.ticks)
    svg += fmt::format("    <text x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n", canvas.x(value),
                       bottom + 18, label);
  for (const auto& [value, label] : y_axis.ticks)
    svg += fmt::format("    <text x=\"{}\" y=\"{:.1f}\" text-anchor=\"end\" dominant-baseline=\"middle\">{}</text>\n",
                       left - 8, canvas.y_plotted(value), label);
  svg += "  </g>\n";
  svg += fmt::format("  <text class=\"axis-label\" x=\"{:.1f}\" y=\"{}\" text-anchor=\"middle\">optimizer step</text>\n",
                     (left + right) / 2, height - 15);
  svg += fmt::format("  <text class=\"axis-label\" transform=\"translate(18 {:.1f}) rotate(-90)\" "
                     "text-anchor=\"middle\">loss{}</text>\n",
                     (top + bottom) / 2, use_log ? " (log scale)" : "");

  // Data: raw first so the smoothed line and eval points sit on top of it.
  if (!raw.empty()) {
    svg += polyline("train-raw", raw, canvas, kRawColor, 1);
    if (raw.size() <= kMaxRawDots) {
      svg += fmt::format("  <g class=\"train-raw-points\" fill=\"{}\">\n", kRawColor);
      for (const Point& p : raw)
        svg += fmt::format("    <circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"2\"/>\n", canvas.x(p.step), canvas.y(p.loss));
      svg += "  </g>\n";
    }
    svg += polyline("train-smoothed", smoothed, canvas, kSmoothedColor, 2);
  }
  if (!eval.empty()) {
    if (eval.size() >= 2) svg += polyline("eval-line", eval, canvas, kEvalColor, 1.5, " stroke-dasharray=\"5 3\"");
    svg += fmt::format("  <g class=\"eval-points\" fill=\"{}\">\n", kEvalColor);
    for (const Point& p : eval)
      svg += fmt::format("    <circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\"><title>step {}: eval loss {:.4f}</title></circle>\n",
                         canvas.x(p.step), canvas.y(p.loss), static_cast<int64_t>(p.step), p.loss);
    svg += "  </g>\n";
  }

  // Legend, top right inside the plot area.
  std::vector<std::pair<std::string_view, std::string_view>> legend;
  if (!raw.empty()) {
    legend.emplace_back("loss per step", kRawColor);
    legend.emplace_back("smoothed loss", kSmoothedColor);
  }
  if (!eval.empty()) legend.emplace_back("eval loss", kEvalColor);
  if (!legend.empty()) {
    const double legend_left = right - 130, legend_top = top + 8;
    svg += "  <g class=\"legend\">\n";
    svg += fmt::format("    <rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"122\" height=\"{}\" fill=\"white\" "
                       "fill-opacity=\"0.85\" stroke=\"#ccc\"/>\n",
                       legend_left, legend_top, 8 + 18 * legend.size());
    for (size_t i = 0; i < legend.size(); ++i) {
      double y = legend_top + 16 + 18.0 * static_cast<double>(i);
      svg += fmt::format("    <line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{2:.1f}\" y2=\"{1:.1f}\" stroke=\"{3}\" "
                         "stroke-width=\"3\"/>\n",
                         legend_left + 8, y - 4, legend_left + 28, legend[i].second);
      svg += fmt::format("    <text x=\"{:.1f}\" y=\"{:.1f}\">{}</text>\n", legend_left + 34, y, legend[i].first);
    }
    svg += "  </g>\n";
  }

  // Notes about what is not drawn, so an empty or gappy plot explains itself.
  std::vector<std::string> notes;
  if (!has_points) notes.push_back(records.empty() ? "no steps logged yet" : "no finite loss to plot");
  if (bad_losses > 0)
    notes.push_back(fmt::format("{} step{} with a non-finite loss not shown (first at step {})", bad_losses,
                                bad_losses == 1 ? "" : "s", *first_bad_loss_step));
  if (bad_eval_losses > 0)
    notes.push_back(fmt::format("{} non-finite eval loss{} not shown", bad_eval_losses, bad_eval_losses == 1 ? "" : "es"));
  for (size_t i = 0; i < notes.size(); ++i)
    svg += fmt::format("  <text class=\"note\" x=\"{}\" y=\"{:.1f}\" fill=\"#b00\">{}</text>\n", left + 10,
                       top + 20 + 16.0 * static_cast<double>(i), escape_xml(notes[i]));
  svg += "</svg>\n";
  return svg;
}

void write_loss_plot_svg(const std::vector<StepMetrics>& records, const std::filesystem::path& svg,
                         const LossPlotOptions& options) {
  if (svg.empty()) fail("the loss plot path is empty");
  write_file_atomically(svg, render_loss_plot_svg(records, options));
}

}  // namespace spindle::train
