// Per-step training metrics and the --metrics-file log: JSON Lines, one object per optimizer step,
// flushed as each line is written so `tail -f` and a crashed run both see every finished step.
// A resumed run first truncates the log back to the step it resumes from, so the file never holds
// the killed run's steps twice (docs/usage.md, "Metrics").
#pragma once

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

namespace spindle::train {

struct StepMetrics {
  int64_t step = 0;                 // optimizer steps finished, counting from 1
  double epoch = 0;                 // fractional: passes over the training data so far
  double loss = 0;                  // mean over the supervised tokens of the whole optimizer step
  double grad_norm = 0;             // global L2 norm before clipping
  double lr = 0;                    // learning rate the step was taken with
  int64_t num_items = 0;            // supervised (loss-bearing) tokens in the step
  int64_t tokens = 0;               // all tokens the step processed, supervised or not
  int64_t total_tokens = 0;         // tokens over the whole run so far, resumed sessions included
  double tokens_per_s = 0;          // tokens / step_seconds
  double step_seconds = 0;          // wall time of the step: forward, backward, optimizer
  int64_t peak_memory_bytes = 0;    // memory high-water mark during the step
  int64_t offload_host_bytes = 0;   // host memory of activation offload at its peak (0: no offload)
  // Activation offload's copies in the step (Backend::offload_stats): bytes both ways, the copies'
  // summed duration (bytes / seconds: the bandwidth they achieved) and how long compute waited for
  // them (the time offload added to the step). Written when offload_host_bytes > 0.
  int64_t offload_copy_bytes = 0;
  double offload_copy_seconds = 0;
  double offload_wait_seconds = 0;
  double elapsed_seconds = 0;       // wall time since the run started, resumed sessions included
  std::optional<double> aux_loss;   // MoE router load-balancing loss of the step, when trained with one
                                    // (without its coefficient; `loss` is the cross-entropy alone)
  std::optional<double> eval_loss;  // set on steps after which the eval set was scored
  std::optional<int64_t> eval_num_items;  // supervised tokens the eval loss averages over

  // Preference training (spindle dpo) only, under TRL's names; SFT lines leave them out. The
  // log-probabilities are the scores the loss compares (sums, or per-token averages for simpo and orpo).
  struct Preference {
    double rewards_chosen = 0;    // "rewards/chosen": mean β·(π_c − ρ_c) over the step's pairs
    double rewards_rejected = 0;  // "rewards/rejected"
    double margins = 0;           // "rewards/margins": rewards_chosen − rewards_rejected
    double accuracy = 0;          // "rewards/accuracies": share of pairs with reward_c > reward_r
    double logps_chosen = 0;      // "logps/chosen": mean Σ log π over chosen responses
    double logps_rejected = 0;    // "logps/rejected"
    double nll_loss = 0;          // "nll_loss": chosen responses' NLL per token
    int64_t pairs = 0;            // "pairs" in the step
    std::optional<double> log_odds_ratio;   // orpo: "log_odds_ratio", mean logσ of the log odds ratio
    std::optional<double> log_odds_chosen;  // orpo: "log_odds_chosen", mean log odds ratio
  };
  std::optional<Preference> preference;
  std::optional<double> eval_accuracy;  // dpo: "eval_rewards/accuracies" over the eval pairs
};

// One value of a record under its metrics.jsonl key ("loss", "rewards/chosen", "eval_loss"). Every
// output that shows the metrics (the JSON line, TensorBoard's scalars) names them from this one list,
// so the outputs cannot drift apart. Counts stay integers, as the JSON line writes them.
struct NamedMetric {
  std::string_view key;
  std::variant<int64_t, double> value;
  double as_double() const;
};
// Every value of the record except the step, in the JSON line's order; the eval and preference
// values only when the record has them.
std::vector<NamedMetric> named_metrics(const StepMetrics& metrics);

// JSON text of one log line (no newline). Non-finite numbers are written as null, since JSON has
// no NaN; reading turns null back into NaN.
std::string metrics_to_json_line(const StepMetrics& metrics);
StepMetrics metrics_from_json_line(std::string_view line);

// Every record of a metrics file in order. A last line without its newline is the torn write of a
// killed process and is ignored; any other unreadable line is an error naming the file and line.
std::vector<StepMetrics> read_metrics_file(const std::filesystem::path& path);

// Replaces the file's contents with `contents` so that a reader (or a crash) sees either the old
// file or the new one, never a mix: written to a temporary beside it, fsynced, renamed into place.
void write_file_atomically(const std::filesystem::path& path, std::string_view contents);

class MetricsLog {
 public:
  // A new run: the file is created, or emptied if an earlier run left one.
  static MetricsLog start_new(const std::filesystem::path& path);
  // A run resumed from a checkpoint taken after `resumed_step`: lines of later steps (written by
  // the interrupted run after that checkpoint) are dropped and logging continues after the rest.
  static MetricsLog resume(const std::filesystem::path& path, int64_t resumed_step);

  MetricsLog(MetricsLog&&) = default;
  MetricsLog& operator=(MetricsLog&&) = default;

  // One line, flushed to the OS before returning.
  void append(const StepMetrics& metrics);
  // Atomically rewrites the file keeping only lines with step <= `step`, then reopens it for
  // appending. Kept lines are copied byte for byte.
  void truncate_after(int64_t step);
  std::vector<StepMetrics> read() const { return read_metrics_file(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  explicit MetricsLog(std::filesystem::path path);
  void open_for_append();

  std::filesystem::path path_;
  std::ofstream stream_;
};

// Exponential moving average of the loss with TensorBoard's bias correction, so the first values
// are not dragged towards zero. Non-finite losses are left out rather than poisoning the average.
// `weight` in [0, 1): how much of the previous average each new loss keeps (0: no smoothing).
class LossSmoother {
 public:
  explicit LossSmoother(double weight = 0.9) : weight_(weight) {}
  void add(double loss);
  std::optional<double> value() const;

 private:
  double weight_;
  double biased_average_ = 0;
  double correction_ = 1;  // weight^n after n finite losses
  int64_t count_ = 0;
};

}  // namespace spindle::train
