// `spindle check`: trust a mesh before a long job. The first global batch of the configured run is
// computed on the requested mesh and, on the main rank, in one process with plain attention (sp = 1,
// dp = 1, same weights, same adapter initialisation); loss, gradient norm and every gradient tensor
// are compared. docs/design.md §2: any mesh must give the single device's numbers to rounding.
#pragma once

#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "parallel/mesh.h"
#include "train/train_config.h"

namespace spindle {

struct CheckOptions {
  // Relative tolerances; negative picks the default of the compute dtype (f32: 1e-5 loss, and for
  // gradients the measured rounding on the CPU, 1e-4 on a GPU; f64: 1e-10 and 1e-9).
  double loss_tolerance = -1;
  double grad_tolerance = -1;
};

// How far the mesh may stray from one process when the tolerance comes from measured rounding
// (CheckReport::rounding_measured): kRoundingFactor times the F32 rounding error of the one-process
// gradient itself, and never less than kRoundingFactor × kRoundingFloor. Two F32 computations of the
// same sums in different orders each carry rounding errors of that size, so their distance stays
// within a small multiple of it; a sharding defect (a lost state, a target counted twice) moves a
// gradient by orders of magnitude more. The factor is the largest ratio seen over the F32 parity
// matrix (2.6, with OpenBLAS's AVX2, AVX-512 and SSE kernels), doubled (docs/parallelism.md).
inline constexpr double kRoundingFactor = 5.0;
inline constexpr double kRoundingFloor = 1e-7;  // about one F32 ulp, relative

struct GradientDifference {
  std::string name;
  double reference_norm = 0;
  double relative_error = 0;  // ‖g_mesh − g_single‖ / ‖g_single‖ (absolute when ‖g_single‖ = 0)
  // With measured rounding: the one-process and mesh gradients against the same step in F64.
  double single_rounding = 0, mesh_rounding = 0;
  double tolerance = 0;  // what relative_error is held to
  double excess() const { return tolerance > 0 ? relative_error / tolerance : relative_error > 0 ? INFINITY : 0; }
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
  // F32 on the CPU without --grad-tolerance: each gradient's tolerance is kRoundingFactor times the
  // rounding error of the one-process F32 gradient, measured against the same step in F64.
  bool rounding_measured = false;
  bool passed = false;

  std::string to_text() const;
  nlohmann::ordered_json to_json() const;
};

class Objective;

// Collective over the job's processes; the report is returned on the main rank (nullopt elsewhere).
// config.output may be empty (JSONL data is then tokenized into a temporary folder). The step is
// `objective`'s (objective.h; sft's cross-entropy by default) over the first global batch.
std::optional<CheckReport> run_check(TrainConfig config, const CheckOptions& options);
std::optional<CheckReport> run_check(TrainConfig config, const CheckOptions& options, const Objective& objective);

}  // namespace spindle
