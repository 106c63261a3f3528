// `spindle check`: trust a mesh before a long job. The first global batch of the configured run is
// computed on the requested mesh and, on the main rank, in one process with plain attention (sp = 1,
// dp = 1, same weights, same adapter initialisation); loss, gradient norm and every gradient tensor
// are compared. docs/design.md §2: any mesh must give the single device's numbers to rounding.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "parallel/mesh.h"
#include "train/train_config.h"

namespace spindle {

struct CheckOptions {
  // Relative tolerances; negative picks the default of the compute dtype (f32: 1e-5 loss,
  // 1e-4 gradients; f64: 1e-10 and 1e-9).
  double loss_tolerance = -1;
  double grad_tolerance = -1;
};

struct GradientDifference {
  std::string name;
  double reference_norm = 0;
  double relative_error = 0;  // ‖g_mesh − g_single‖ / ‖g_single‖ (absolute when ‖g_single‖ = 0)
};

struct CheckReport {
  parallel::MeshConfig mesh;
  int64_t rows = 0, num_items = 0, tokens = 0;
  double loss_mesh = 0, loss_single = 0, loss_relative_error = 0;
  // MoE runs with the router load-balancing loss: its value on both (held to the loss tolerance).
  std::optional<double> aux_loss_mesh, aux_loss_single, aux_loss_relative_error;
  double grad_norm_mesh = 0, grad_norm_single = 0;
  std::vector<GradientDifference> gradients;  // every trainable tensor, worst first
  double loss_tolerance = 0, grad_tolerance = 0;
  bool passed = false;

  std::string to_text() const;
  nlohmann::ordered_json to_json() const;
};

// Collective over the job's processes; the report is returned on the main rank (nullopt elsewhere).
// config.output may be empty (JSONL data is then tokenized into a temporary folder).
std::optional<CheckReport> run_check(TrainConfig config, const CheckOptions& options);

}  // namespace spindle
