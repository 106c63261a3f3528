#include "train/check.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <optional>
#include <tuple>
#include <unistd.h>

#include <fmt/format.h>

#include "core/error.h"
#include "model/decoder.h"
#include "model/router_aux_loss.h"
#include "train/objective.h"
#include "train/run_assembly.h"
#include "train/setup.h"
#include "train/step_runner.h"
#include "train/trainable_state.h"

namespace spindle {

namespace fs = std::filesystem;

namespace {

std::vector<double> to_host_f64(Backend& backend, const Tensor& t) {
  Tensor wide = backend.empty(t.shape(), DType::F64);
  backend.copy(backend.default_stream(), t, wide);
  std::vector<double> out(static_cast<size_t>(t.numel()));
  backend.copy_to_host(backend.default_stream(), wide, out.data());
  return out;
}

double norm_of(const std::vector<double>& v) {
  double s = 0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

// ‖a − b‖ / ‖b‖ (absolute when ‖b‖ = 0).
double relative_distance(const std::vector<double>& a, const std::vector<double>& b) {
  SPINDLE_CHECK(a.size() == b.size(), "comparing {} numbers with {}", a.size(), b.size());
  double diff = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    ref += b[i] * b[i];
  }
  return ref > 0 ? std::sqrt(diff / ref) : std::sqrt(diff);
}

}  // namespace

std::string CheckReport::to_text() const {
  std::string out = fmt::format("spindle check: dp {} x sp {} (ulysses {} x ring {}) against one process\n", mesh.dp,
                                mesh.sp, mesh.ulysses, mesh.ring);
  out += fmt::format("  batch      {} rows, {} tokens, {} supervised targets\n", rows, tokens, num_items);
  out += fmt::format("  loss       mesh {:.9g}  single {:.9g}  relative error {:.2e} (tolerance {:.0e})\n", loss_mesh,
                     loss_single, loss_relative_error, loss_tolerance);
  if (aux_loss_single)
    out += fmt::format("  aux loss   mesh {:.9g}  single {:.9g}  relative error {:.2e} (tolerance {:.0e})\n",
                       *aux_loss_mesh, *aux_loss_single, *aux_loss_relative_error, loss_tolerance);
  out += fmt::format("  grad norm  mesh {:.9g}  single {:.9g}\n", grad_norm_mesh, grad_norm_single);
  if (!gradients.empty() && rounding_measured) {
    out += fmt::format("  gradients  {} tensors; closest to their tolerance ({:g} x the one-process F32 rounding, "
                       "measured against F64):\n",
                       gradients.size(), kRoundingFactor);
    for (size_t i = 0; i < std::min<size_t>(5, gradients.size()); ++i)
      out += fmt::format("             {:.2e}  (rounding {:.2e}, tolerance {:.2e})  {}\n", gradients[i].relative_error,
                         gradients[i].single_rounding, gradients[i].tolerance, gradients[i].name);
  } else if (!gradients.empty()) {
    out += fmt::format("  gradients  {} tensors; largest relative errors (tolerance {:.0e}):\n", gradients.size(),
                       grad_tolerance);
    for (size_t i = 0; i < std::min<size_t>(5, gradients.size()); ++i)
      out += fmt::format("             {:.2e}  {}\n", gradients[i].relative_error, gradients[i].name);
  }
  out += passed ? "  PASS: this mesh computes what one process computes\n"
                : "  FAIL: the mesh differs from one process beyond the tolerance\n";
  return out;
}

nlohmann::ordered_json CheckReport::to_json() const {
  nlohmann::ordered_json j;
  j["dp"] = mesh.dp;
  j["sp"] = mesh.sp;
  j["ulysses"] = mesh.ulysses;
  j["ring"] = mesh.ring;
  j["rows"] = rows;
  j["tokens"] = tokens;
  j["num_items"] = num_items;
  j["loss_mesh"] = loss_mesh;
  j["loss_single"] = loss_single;
  j["loss_relative_error"] = loss_relative_error;
  if (aux_loss_single) {
    j["aux_loss_mesh"] = *aux_loss_mesh;
    j["aux_loss_single"] = *aux_loss_single;
    j["aux_loss_relative_error"] = *aux_loss_relative_error;
  }
  j["grad_norm_mesh"] = grad_norm_mesh;
  j["grad_norm_single"] = grad_norm_single;
  double largest = 0;
  for (const GradientDifference& g : gradients) largest = std::max(largest, g.relative_error);
  j["max_grad_relative_error"] = largest;
  j["worst_tensor"] = gradients.empty() ? "" : gradients.front().name;  // closest to its tolerance
  j["worst_relative_error"] = gradients.empty() ? 0.0 : gradients.front().relative_error;
  j["worst_tolerance"] = gradients.empty() ? 0.0 : gradients.front().tolerance;
  j["worst_excess"] = gradients.empty() ? 0.0 : gradients.front().excess();
  j["rounding_measured"] = rounding_measured;
  if (rounding_measured && !gradients.empty()) {
    j["worst_single_rounding"] = gradients.front().single_rounding;
    j["worst_mesh_rounding"] = gradients.front().mesh_rounding;
  }
  j["tensors"] = gradients.size();
  j["loss_tolerance"] = loss_tolerance;
  j["grad_tolerance"] = grad_tolerance;
  j["passed"] = passed;
  return j;
}

std::optional<CheckReport> run_check(TrainConfig config, const CheckOptions& options) {
  return run_check(std::move(config), options, SftObjective());
}

std::optional<CheckReport> run_check(TrainConfig config, const CheckOptions& options, const Objective& objective) {
  const ModelConfig model_config = ModelConfig::from_file(config.model);
  objective.check_models(model_config);
  const ComputeDevice device = choose_device(config, process_group_from_environment());
  RunTopology run = connect_training_run(config, model_config, device);
  objective.check_mesh(config, run);
  const bool temporary_output = config.output.empty();
  if (temporary_output)  // one folder per job, the same name on every rank
    config.output = (fs::temp_directory_path() /
                     fmt::format("spindle-check-{}", run.world ? run.process.master_port : static_cast<int>(getpid())))
                        .string();
  config.validate();
  const parallel::MeshConfig& mesh = run.mesh_config;
  const TrainingData data = prepare_training_data(config, run);
  const PackOptions pack = pack_options(config);
  TrainDataLoader loader(data.sources, pack, config.seed, objective.data_kind());
  const int64_t items_per_step = config.grad_accum * mesh.dp;
  std::vector<LoaderItem> items;
  for (int64_t i = 0; i < items_per_step; ++i) items.push_back(loader.next_item());
  const ObjectiveData objective_data{loader, {}, pack, config.seed, items_per_step};

  // The same run on the mesh, on one process, and on one process in F64: assembled alike
  // (run_assembly.h), with the same weights and adapter initialisation; no optimizer state.
  const DType dtype = device.dtype;
  auto backend = make_backend(device, threads_per_process(config, run));
  RunDescription description = describe_training_run(config, model_config, dtype);
  description.optimizer.reset();
  const std::unique_ptr<AssembledRun> on_mesh_run =
      assemble_run(*backend, description, RunPlacement{run.world.get(), run.mesh.get()});
  const std::unique_ptr<ObjectiveRunner> mesh_steps = objective.bind({*backend, run, *on_mesh_run, config});
  mesh_steps->prepare(objective_data);
  on_mesh_run->state->zero_grads();
  const ObjectiveStep on_mesh = mesh_steps->step(items, /*backward=*/true);
  const std::vector<std::pair<std::string, Tensor>> mesh_gradients = on_mesh_run->state->full_gradients();
  if (!run.is_main()) {
    if (run.world) run.world->barrier();  // stay alive while the main rank computes the reference
    return std::nullopt;
  }

  // The reference: one process, plain attention, the same items, weights and adapter initialisation.
  const RunTopology one_process;
  auto one_step = [&](const RunDescription& d) {
    std::unique_ptr<AssembledRun> single_run = assemble_run(*backend, d);
    const std::unique_ptr<ObjectiveRunner> steps = objective.bind({*backend, one_process, *single_run, config});
    steps->prepare(objective_data);
    single_run->state->zero_grads();
    const ObjectiveStep outcome = steps->step(items, /*backward=*/true);
    return std::make_pair(std::move(single_run), outcome);
  };
  const auto [single_run, single] = one_step(description);
  ModelWeights& single_weights = single_run->weights;

  // F32 on the CPU: the same process once more in F64 measures what F32 rounding alone does to each
  // number on one process; the mesh is then held to that rounding instead of a fixed tolerance.
  const bool measure_rounding = !device.cuda && dtype == DType::F32 && options.grad_tolerance < 0;
  std::unique_ptr<AssembledRun> exact_run;
  ObjectiveStep exact;
  if (measure_rounding) {
    RunDescription wide = description;
    wide.dtype = DType::F64;
    std::tie(exact_run, exact) = one_step(wide);
  }
  ModelWeights* exact_weights = exact_run ? &exact_run->weights : nullptr;

  CheckReport report;
  report.mesh = mesh;
  report.rows = single.rows;
  report.num_items = single.num_items;
  report.tokens = single.tokens;
  report.loss_mesh = on_mesh.loss;
  report.loss_single = single.loss;
  report.loss_relative_error = std::abs(on_mesh.loss - single.loss) / std::max(std::abs(single.loss), 1e-30);
  if (on_mesh.aux_loss && single.aux_loss) {
    report.aux_loss_mesh = *on_mesh.aux_loss;
    report.aux_loss_single = *single.aux_loss;
    report.aux_loss_relative_error =
        std::abs(*on_mesh.aux_loss - *single.aux_loss) / std::max(std::abs(*single.aux_loss), 1e-30);
  }
  // Defaults per dtype: rounding of a different summation order (bf16 rounds every stored activation).
  const double default_loss = dtype == DType::F64 ? 1e-10 : dtype == DType::BF16 ? 1e-2 : 1e-5;
  const double default_grad = dtype == DType::F64 ? 1e-9 : dtype == DType::BF16 ? 5e-2 : 1e-4;
  report.loss_tolerance = options.loss_tolerance >= 0 ? options.loss_tolerance : default_loss;
  if (measure_rounding && options.loss_tolerance < 0) {
    // The loss and aux loss are held to their own measured rounding, as the gradients are.
    double rounding = std::abs(single.loss - exact.loss) / std::max(std::abs(exact.loss), 1e-30);
    if (single.aux_loss && exact.aux_loss)
      rounding = std::max(rounding, std::abs(*single.aux_loss - *exact.aux_loss) / std::max(std::abs(*exact.aux_loss), 1e-30));
    report.loss_tolerance = kRoundingFactor * std::max(rounding, kRoundingFloor);
  }
  report.grad_tolerance = options.grad_tolerance >= 0 ? options.grad_tolerance : default_grad;
  report.rounding_measured = measure_rounding;
  double mesh_sq = 0, single_sq = 0;
  for (const auto& [name, grad] : mesh_gradients) {
    Parameter* reference = single_weights.find(name);
    SPINDLE_CHECK(reference && reference->trainable, "the one-process model has no trainable {}", name);
    const std::vector<double> g = to_host_f64(*backend, grad), r = to_host_f64(*backend, reference->grad);
    SPINDLE_CHECK(g.size() == r.size(), "gradient {} has {} elements on the mesh, {} in one process", name, g.size(),
                  r.size());
    const double gn = norm_of(g), rn = norm_of(r);
    mesh_sq += gn * gn;
    single_sq += rn * rn;
    GradientDifference d{name, rn, relative_distance(g, r)};
    if (measure_rounding) {
      Parameter* truth = exact_weights->find(name);
      SPINDLE_CHECK(truth && truth->trainable, "the F64 model has no trainable {}", name);
      const std::vector<double> x = to_host_f64(*backend, truth->grad);
      d.single_rounding = relative_distance(r, x);
      d.mesh_rounding = relative_distance(g, x);
      d.tolerance = kRoundingFactor * std::max(d.single_rounding, kRoundingFloor);
    } else {
      d.tolerance = report.grad_tolerance;
    }
    report.gradients.push_back(d);
  }
  // Worst first: by the error against what is allowed.
  std::sort(report.gradients.begin(), report.gradients.end(), [](const GradientDifference& a, const GradientDifference& b) {
    return a.excess() > b.excess();
  });
  report.grad_norm_mesh = std::sqrt(mesh_sq);
  report.grad_norm_single = std::sqrt(single_sq);
  const bool gradients_pass = report.gradients.empty() || report.gradients.front().excess() <= 1.0;
  report.passed = on_mesh.num_items == single.num_items && report.loss_relative_error <= report.loss_tolerance &&
                  (!report.aux_loss_single || *report.aux_loss_relative_error <= report.loss_tolerance) &&
                  gradients_pass;
  if (run.world) run.world->barrier();
  if (temporary_output) fs::remove_all(config.output);
  return report;
}

}  // namespace spindle
