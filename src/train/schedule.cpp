#include "train/schedule.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace spindle {

LrSchedule parse_lr_schedule(const std::string& name) {
  if (name == "constant") return LrSchedule::kConstant;
  if (name == "linear") return LrSchedule::kLinear;
  if (name == "cosine") return LrSchedule::kCosine;
  fail("unknown --lr-scheduler \"{}\"; choose constant, linear or cosine", name);
}

double learning_rate(const LrScheduleConfig& c, int64_t step) {
  if (step < c.warmup_steps) return c.peak_lr * static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, c.warmup_steps));
  if (c.kind == LrSchedule::kConstant) return c.peak_lr;
  const double progress = static_cast<double>(step - c.warmup_steps) /
                          static_cast<double>(std::max<int64_t>(1, c.total_steps - c.warmup_steps));
  if (c.kind == LrSchedule::kLinear) return c.peak_lr * std::max(0.0, 1.0 - progress);
  return c.peak_lr * std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * progress)));
}

}  // namespace spindle
