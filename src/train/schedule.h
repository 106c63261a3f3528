// Learning-rate schedules with linear warm-up, as transformers' get_*_schedule_with_warmup define
// them (lr at optimizer step s, counting from 0 for the first update).
#pragma once

#include <cstdint>
#include <string>

namespace spindle {

enum class LrSchedule { kConstant, kLinear, kCosine };
LrSchedule parse_lr_schedule(const std::string& name);  // "constant" | "linear" | "cosine"

struct LrScheduleConfig {
  LrSchedule kind = LrSchedule::kLinear;
  double peak_lr = 1e-4;
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
};

double learning_rate(const LrScheduleConfig& config, int64_t step);

}  // namespace spindle
