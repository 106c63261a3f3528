// The loss curve as a standalone SVG next to the metrics file, so a user can look instead of read:
// every step's loss as light points and line, a smoothed line over it, evaluation losses as marked
// points. Written by hand (SVG is a few elements) rather than pulling in a plotting library.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "train/metrics.h"

namespace spindle::train {

enum class LossPlotScale {
  Auto,    // log when every loss is positive and they span at least a factor of 10
  Linear,
  Log,     // falls back to linear if a loss is zero or negative
};

struct LossPlotOptions {
  std::string title = "Training loss";
  LossPlotScale y_scale = LossPlotScale::Auto;
  int width = 900;
  int height = 500;
};

// metrics.jsonl -> metrics.svg, in the same folder.
std::filesystem::path loss_plot_path_for(const std::filesystem::path& metrics_file);

// The SVG document. Records with a non-finite loss (or eval loss) are left out of the curves and
// counted in a note on the plot, so a NaN step is visible rather than silently missing.
std::string render_loss_plot_svg(const std::vector<StepMetrics>& records, const LossPlotOptions& options = {});

// Renders and writes atomically: a viewer refreshing the file never sees half a plot.
void write_loss_plot_svg(const std::vector<StepMetrics>& records, const std::filesystem::path& svg,
                         const LossPlotOptions& options = {});

}  // namespace spindle::train
