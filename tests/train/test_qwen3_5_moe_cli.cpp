// qwen3_5_moe through the spindle binary on CPU processes: `spindle check` with data parallelism
// (dp 2; routing is per token, so each rank routes its own tokens, and the load-balancing loss's
// statistics are summed over every rank and micro-batch) and with sequence parallelism (Ulysses,
// ring x dp) agrees with one process on the multimodal checkpoint (fused experts, vision tower and
// mtp.* in the file) and on a text-only per-expert folder, full fine-tune and LoRA; one `spindle sft`
// step on two processes saves a full model that keeps the fused layout and carries model.visual.*
// and mtp.* byte for byte; and `spindle plan` plans it (one process and Ulysses sp 2, aux loss on).
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "backend/op_test_util.h"
#include "io/checkpoint.h"
#include "io/io_test_util.h"
#include "support/tiny_model.h"
#include "train/metrics.h"

using namespace spindle;
using namespace spindle::test;
namespace fs = std::filesystem;

namespace {

struct CliRun {
  int exit_code = -1;
  std::string out, err;
};

std::string slurp(const fs::path& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The spindle binary with `arguments`, its stdout and stderr kept.
CliRun run_spindle(const fs::path& scratch, std::vector<std::string> arguments) {
  arguments.insert(arguments.begin(), SPINDLE_BINARY);
  const fs::path out_path = scratch / "stdout", err_path = scratch / "stderr";
  const pid_t pid = ::fork();
  if (pid == 0) {
    const int out = ::open(out_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open(err_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    ::dup2(out, 1);
    ::dup2(err, 2);
    ::alarm(240);
    std::vector<char*> argv;
    for (std::string& a : arguments) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::unsetenv("RANK");
    ::unsetenv("WORLD_SIZE");
    ::execv(argv[0], argv.data());
    ::_exit(127);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, slurp(out_path), slurp(err_path)};
}

// Packed documents with prompt masking and loss_scale, one of them without a target.
void write_data(const fs::path& path) {
  std::mt19937_64 rng(13);
  std::ofstream out(path);
  for (auto [length, prompt] : {std::pair{9, 3}, {17, 5}, {5, 0}, {12, 12}, {20, 7}, {7, 2}, {14, 4}, {11, 0}}) {
    nlohmann::json ids = nlohmann::json::array(), labels = nlohmann::json::array(), scale = nlohmann::json::array();
    for (int i = 0; i < length; ++i) {
      const int id = static_cast<int>(rng() % 60);
      ids.push_back(id);
      labels.push_back(i < prompt ? -100 : id);
      scale.push_back(0.5 * static_cast<double>(1 + rng() % 4));
    }
    out << nlohmann::json{{"input_ids", ids}, {"labels", labels}, {"loss_scale", scale}}.dump() << "\n";
  }
}

// The JSON report `spindle check --json` prints (on rank 0's prefixed line).
nlohmann::json check_report(const CliRun& run) {
  std::string last;
  std::stringstream lines(run.out);
  for (std::string line; std::getline(lines, line);) {
    const size_t brace = line.find('{');
    if (brace != std::string::npos) last = line.substr(brace);
  }
  if (last.empty()) return {};
  return nlohmann::json::parse(last);
}

io::NamedTensors vision_and_mtp(Backend& cpu) {
  std::mt19937_64 rng(21);
  io::NamedTensors out;
  out.emplace_back("model.visual.blocks.0.attn.qkv.weight", random_tensor(cpu, Shape{12, 4}, DType::BF16, rng));
  out.emplace_back("mtp.fc.weight", random_tensor(cpu, Shape{32, 64}, DType::BF16, rng));
  out.emplace_back("mtp.layers.0.mlp.experts.gate_up_proj", random_tensor(cpu, Shape{4, 24, 32}, DType::BF16, rng));
  return out;
}

class Qwen35MoeCli : public ::testing::Test {
 protected:
  void SetUp() override {
    auto cpu = make_cpu_backend(1);
    write_model_folder(multimodal, multimodal_config_json(tiny_qwen3_5_moe()), 7, 8.0,
                       {.fused_experts = true, .extra = vision_and_mtp(*cpu)});
    write_model_folder(text_only, tiny_qwen3_5_moe().config_json(), 8, 8.0, {.fused_experts = false});
    write_data(data);
  }
  io::testing::ScratchDir scratch;
  const fs::path multimodal = scratch.path() / "multimodal", text_only = scratch.path() / "text";
  const fs::path data = scratch.path() / "data.jsonl";
};

}  // namespace

TEST_F(Qwen35MoeCli, CheckOnMeshesOfProcessesAgreesWithOne) {
  struct Case {
    const char* name;
    fs::path model;
    std::vector<std::string> mesh, training;
  };
  const std::vector<std::string> dp2 = {"--dp", "2", "--nproc-per-node", "2"};
  const std::vector<Case> cases = {
      {"multimodal, full, dp 2", multimodal, dp2, {"--full", "--router-aux-loss-coef", "0.05"}},
      {"text-only per expert, full, dp 2", text_only, dp2, {"--full", "--router-aux-loss-coef", "0.05"}},
      // LoRA on the default targets: attention and the shared expert's projections here.
      {"multimodal, LoRA, dp 2", multimodal, dp2, {"--lora-rank", "4", "--router-aux-loss-coef", "0.05"}},
      // Sequence parallelism (DeltaNet heads over Ulysses, or its state passed over a ring), in F64: the
      // sharded sums' F32 rounding reaches 2e-5 on the gradient of an expert that sees few tokens.
      {"multimodal, full, ulysses sp 2, f64", multimodal, {"--sp", "2", "--ulysses", "2", "--nproc-per-node", "2"},
       {"--full", "--router-aux-loss-coef", "0.05", "--dtype", "f64"}},
      {"text-only, full, ring sp 2 x dp 2, f64", text_only,
       {"--sp", "2", "--ring", "2", "--dp", "2", "--nproc-per-node", "4"},
       {"--full", "--router-aux-loss-coef", "0.05", "--dtype", "f64"}},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const bool f64 = std::find(c.training.begin(), c.training.end(), "f64") != c.training.end();
    std::vector<std::string> args = {"check", "--model", c.model.string(), "--data", data.string(), "--max-length",
                                     "24", "--grad-accum", "2", "--json", "--threads", "1", "--loss-tolerance",
                                     f64 ? "1e-10" : "1e-6", "--grad-tolerance", f64 ? "1e-9" : "1e-5"};
    args.insert(args.end(), c.mesh.begin(), c.mesh.end());
    args.insert(args.end(), c.training.begin(), c.training.end());
    const CliRun run = run_spindle(scratch.path(), args);
    ASSERT_EQ(run.exit_code, 0) << run.out << run.err;
    const nlohmann::json report = check_report(run);
    ASSERT_TRUE(report.is_object()) << run.out << run.err;
    EXPECT_TRUE(report["passed"].get<bool>()) << report.dump();
    EXPECT_GT(report["num_items"].get<int64_t>(), 0);
    ASSERT_TRUE(report.contains("aux_loss_single")) << report.dump();
    EXPECT_GT(report["aux_loss_single"].get<double>(), 0.0);
    EXPECT_LE(report["aux_loss_relative_error"].get<double>(), f64 ? 1e-10 : 1e-6);
  }
}

TEST_F(Qwen35MoeCli, OneSftStepOnTwoProcessesSavesTheCheckpointsLayout) {
  const fs::path out = scratch.path() / "run";
  const CliRun run = run_spindle(scratch.path(), {"sft", "--model", multimodal.string(), "--data", data.string(),
                                               "--output", out.string(), "--max-length", "24", "--full",
                                               "--max-steps", "1", "--lr", "1e-3", "--nproc-per-node", "2",
                                               "--threads", "1", "--log-every", "100", "--router-aux-loss-coef",
                                               "0.05"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const std::vector<train::StepMetrics> metrics = train::read_metrics_file(out / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 1u);
  EXPECT_TRUE(std::isfinite(metrics[0].loss));
  ASSERT_TRUE(metrics[0].aux_loss.has_value());
  EXPECT_GT(*metrics[0].aux_loss, 0.0);

  const io::Checkpoint saved((out / "model").string()), source(multimodal.string());
  auto cpu = make_cpu_backend(1);
  for (const auto& [name, tensor] : vision_and_mtp(*cpu)) {
    const io::TensorRecord* record = saved.find(name);
    ASSERT_NE(record, nullptr) << name;
    const io::TensorRecord& original = source.require(name, tensor.shape());
    ASSERT_EQ(record->bytes, original.bytes) << name;
    EXPECT_EQ(std::memcmp(record->data, original.data, original.bytes), 0) << name << " changed";
  }
  const std::string mlp = "model.language_model.layers.0.mlp.";
  EXPECT_NE(saved.find(mlp + "experts.gate_up_proj"), nullptr);
  EXPECT_EQ(saved.find(mlp + "experts.0.up_proj.weight"), nullptr);
  // Saved in the source's dtype (F32), found under the multimodal prefix.
  EXPECT_EQ(saved.find("model.language_model.embed_tokens.weight")->dtype, DType::F32);
  EXPECT_EQ(saved.names().size(), source.names().size());
}

TEST_F(Qwen35MoeCli, PlanModelsItsMixtureOfExpertsLayers) {
  // The routed experts' buffers are sized by the T·k routed rows, so the plan needs no routing
  // (tests/cli/check_plan.py compares it with bench's measured peak); the aux loss is planned as given.
  for (const std::vector<std::string>& mesh : {std::vector<std::string>{},
                                               std::vector<std::string>{"--world", "2", "--sp", "2", "--ulysses", "2"}}) {
    std::vector<std::string> args{"plan", "--model", multimodal.string(), "--seq", "64", "--device", "cpu",
                                  "--router-aux-loss-coef", "0.05", "--json"};
    args.insert(args.end(), mesh.begin(), mesh.end());
    const CliRun run = run_spindle(scratch.path(), args);
    ASSERT_EQ(run.exit_code, 0) << run.err;
    const nlohmann::json plan = nlohmann::json::parse(run.out);
    EXPECT_EQ(plan["router_aux_loss_coef"].get<double>(), 0.05);
    EXPECT_GT(plan["results"][0]["peak_allocated_bytes"].get<int64_t>(), 0);
  }
  // Planned for a GPU too (the family runs there), with the CUDA kernels' scratch.
  const CliRun gpu = run_spindle(scratch.path(), {"plan", "--model", multimodal.string(), "--seq", "64"});
  EXPECT_EQ(gpu.exit_code, 0) << gpu.err;
}

TEST_F(Qwen35MoeCli, SftWithRandomWeightsTrainsLoraOnTheArchitectureAlone) {
  // Only config.json (what a 35B model's measurement has at hand): sp 2 over two processes, LoRA on
  // random base weights, an adapter saved; the options it cannot honour are refused before any work.
  const fs::path arch = scratch.path() / "arch.json", out = scratch.path() / "random_run";
  fs::copy_file(multimodal / "config.json", arch);
  const CliRun run = run_spindle(scratch.path(), {"sft", "--model", arch.string(), "--random-weights", "--data",
                                               data.string(), "--output", out.string(), "--max-length", "24",
                                               "--max-steps", "2", "--lr", "1e-2", "--nproc-per-node", "2",
                                               "--sp", "2", "--threads", "1", "--log-every", "100"});
  ASSERT_EQ(run.exit_code, 0) << run.err;
  const std::vector<train::StepMetrics> metrics = train::read_metrics_file(out / "metrics.jsonl");
  ASSERT_EQ(metrics.size(), 2u);
  for (const train::StepMetrics& m : metrics) EXPECT_TRUE(std::isfinite(m.loss) && m.grad_norm > 0);
  const io::Checkpoint adapter((out / "adapter" / "adapter_model.safetensors").string());
  EXPECT_FALSE(adapter.names().empty());
  EXPECT_NE(adapter.find("base_model.model.model.language_model.layers.0.mlp.shared_expert.up_proj.lora_A.weight"),
            nullptr);

  const CliRun full = run_spindle(scratch.path(), {"sft", "--model", arch.string(), "--random-weights", "--full",
                                                "--data", data.string(), "--output", (out / "x").string()});
  EXPECT_NE(full.exit_code, 0);
  EXPECT_NE(full.err.find("--random-weights trains new LoRA adapters"), std::string::npos) << full.err;
}
