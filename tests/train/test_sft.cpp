// spindle sft end to end on the CPU: one step at lr 0 reproduces transformers' loss and gradient
// norm, accumulation over micro-batches equals one large batch, a run killed with SIGKILL and
// resumed logs the same losses as an uninterrupted run, and bad configurations fail before work.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <thread>

#include "backend/op_test_util.h"
#include "io/checkpoint.h"
#include "io/load_tensor.h"
#include "train/metrics.h"
#include "train/trainer.h"

using namespace spindle;
namespace fs = std::filesystem;

namespace {

std::string ref_dir(const std::string& name) { return std::string(SPINDLE_SOURCE_DIR) + "/testdata/hf/" + name; }

fs::path fresh_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / fmt::format("spindle-test-sft-{}-{}", name, getpid());
  fs::remove_all(p);
  return p;
}

double reference_grad_norm(const std::string& dir) {
  io::Checkpoint expected(dir + "/expected.safetensors");
  auto cpu = make_cpu_backend();
  double sum = 0;
  for (const std::string& name : expected.names()) {
    if (name.rfind("grad.", 0) != 0) continue;
    for (double g : test::to_host(*cpu, io::load_tensor(*cpu, *expected.find(name), DType::F64))) sum += g * g;
  }
  return std::sqrt(sum);
}

double reference_loss(const std::string& dir) {
  std::ifstream in(dir + "/expected.json");
  nlohmann::json j;
  in >> j;
  return j["loss"].get<double>();
}

TrainConfig base_config(const std::string& case_name, const fs::path& out) {
  TrainConfig c;
  c.model = ref_dir(case_name);
  c.data = {ref_dir(case_name) + "/data.jsonl"};
  c.output = out.string();
  c.threads = 1;
  c.log_every = 1000;
  return c;
}

std::vector<train::StepMetrics> run_and_read(const TrainConfig& c) {
  run_sft(c);
  return train::read_metrics_file(fs::path(c.output) / "metrics.jsonl");
}

}  // namespace

TEST(Sft, OneStepAtLrZeroReproducesTransformersLossAndGradNorm) {
  for (const std::string name : {"qwen2", "qwen3", "qwen2_lora"}) {
    const std::string dir = ref_dir(name);
    if (!fs::exists(dir)) GTEST_SKIP() << "missing " << dir;
    const fs::path out = fresh_dir(name);
    TrainConfig c = base_config(name, out);
    c.lr = 0;
    c.max_steps = 1;
    c.max_grad_norm = 0;
    c.max_length = 80;  // every document in one row: one micro-batch
    if (fs::exists(dir + "/adapter")) c.adapter = dir + "/adapter";
    else c.full = true;
    c.eval_data = c.data[0];  // at lr 0 the held-out loss of the same data is the training loss
    c.eval_steps = 1;
    auto metrics = run_and_read(c);
    ASSERT_EQ(metrics.size(), 1u);
    ASSERT_TRUE(metrics[0].eval_loss.has_value()) << name;
    EXPECT_NEAR(*metrics[0].eval_loss, metrics[0].loss, 1e-6 * metrics[0].loss) << name;
    EXPECT_EQ(metrics[0].eval_num_items, std::optional<int64_t>(44)) << name << ": eval_num_items is logged";
    EXPECT_NEAR(metrics[0].loss, reference_loss(dir), 1e-5 * reference_loss(dir)) << name;
    const double norm = reference_grad_norm(dir);
    EXPECT_NEAR(metrics[0].grad_norm, norm, 1e-4 * norm) << name;
    EXPECT_EQ(metrics[0].num_items, 44) << name;
    fs::remove_all(out);
  }
}

TEST(Sft, AccumulatingMicroBatchesEqualsOneLargeBatch) {
  const std::string dir = ref_dir("qwen3");
  if (!fs::exists(dir)) GTEST_SKIP() << "missing " << dir;
  TrainConfig one = base_config("qwen3", fresh_dir("one"));
  one.full = true;
  one.lr = 1e-3;
  one.max_steps = 2;
  one.max_length = 80;  // one row holds every document
  TrainConfig three = base_config("qwen3", fresh_dir("three"));
  three.full = true;
  three.lr = 1e-3;
  three.max_steps = 2;
  three.max_length = 32;  // the same documents in three rows...
  three.grad_accum = 3;   // ...accumulated into one optimizer step
  auto a = run_and_read(one), b = run_and_read(three);
  ASSERT_EQ(a.size(), 2u);
  ASSERT_EQ(b.size(), 2u);
  EXPECT_DOUBLE_EQ(b[0].epoch, 1.0) << "the three micro-batches must cover the data once";
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(a[i].num_items, b[i].num_items);
    EXPECT_NEAR(a[i].loss, b[i].loss, 2e-6 * std::fabs(a[i].loss)) << "step " << i + 1;
    EXPECT_NEAR(a[i].grad_norm, b[i].grad_norm, 2e-5 * a[i].grad_norm) << "step " << i + 1;
  }
  fs::remove_all(one.output);
  fs::remove_all(three.output);
}

TEST(Sft, KilledRunResumesWithTheSameLosses) {
  const std::string dir = ref_dir("qwen3");
  if (!fs::exists(dir)) GTEST_SKIP() << "missing " << dir;
  // The uninterrupted reference.
  TrainConfig c = base_config("qwen3", fresh_dir("whole"));
  c.lr = 5e-3;
  c.max_steps = 600;  // long enough that the kill below lands mid-run
  c.save_steps = 25;
  c.max_length = 24;
  c.lora_rank = 4;
  c.threads = 2;  // several threads: a checkpoint must not change how the later steps compute
  auto whole = run_and_read(c);
  ASSERT_EQ(whole.size(), 600u);

  // The same run as a process, killed with SIGKILL once a few steps are logged.
  const fs::path out = fresh_dir("killed");
  fs::create_directories(out);
  const fs::path metrics = out / "metrics.jsonl";
  const std::vector<std::string> args = {SPINDLE_BINARY, "sft", "--model", c.model, "--data", c.data[0],
                                         "--output", out.string(), "--lr", "5e-3", "--max-steps", "600",
                                         "--save-steps", "25", "--max-length", "24", "--lora-rank", "4",
                                         "--threads", "2", "--log-every", "1000"};
  const pid_t child = fork();
  if (child == 0) {
    std::vector<char*> argv;
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    freopen("/dev/null", "w", stderr);
    execv(argv[0], argv.data());
    _exit(127);
  }
  ASSERT_GT(child, 0);
  bool killed = false;
  for (int i = 0; i < 20000 && !killed; ++i) {
    std::ifstream in(metrics);
    int lines = 0;
    for (std::string line; std::getline(in, line);) ++lines;
    if (lines >= 40) {
      kill(child, SIGKILL);
      killed = true;
    }
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  int status = 0;
  waitpid(child, &status, 0);
  ASSERT_TRUE(killed && WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)
      << "the run was meant to die by SIGKILL mid-run; it ended with status " << status;
  // A crash in the middle of a save leaves a temporary folder, never a checkpoint that looks whole.
  fs::create_directories(out / ".checkpoint-999.tmp.1");
  std::ofstream(out / ".checkpoint-999.tmp.1" / "trainer_state.json") << "{";
  const fs::path latest = latest_checkpoint(out);
  ASSERT_FALSE(latest.empty());
  EXPECT_NE(latest.filename().string().find("checkpoint-"), std::string::npos);

  TrainConfig resumed = c;
  resumed.output = out.string();
  resumed.resume = true;
  auto after = run_and_read(resumed);
  ASSERT_EQ(after.size(), whole.size());
  for (size_t i = 0; i < whole.size(); ++i) {
    EXPECT_EQ(after[i].step, whole[i].step);
    EXPECT_EQ(after[i].loss, whole[i].loss) << "step " << i + 1;
    EXPECT_EQ(after[i].grad_norm, whole[i].grad_norm) << "step " << i + 1;
  }
  fs::remove_all(c.output);
  fs::remove_all(out);
}

// The bytes of every tensor of a safetensors file, by name.
std::map<std::string, std::string> tensor_bytes(const fs::path& file) {
  io::Checkpoint checkpoint(file.string());
  std::map<std::string, std::string> out;
  for (const std::string& name : checkpoint.names()) {
    const io::TensorRecord* record = checkpoint.find(name);
    out[name] = std::string(reinterpret_cast<const char*>(record->data), record->bytes);
  }
  return out;
}

// A run resumed from a checkpoint ends where the uninterrupted run ends, bit for bit: every logged
// loss and gradient norm, the optimizer state and the trained weights. Both on two threads, with
// checkpoints written between steps, LoRA and full.
TEST(Sft, ResumedRunIsBitIdenticalToTheUninterruptedOne) {
  // qwen3_5_moe: a model whose projections come in another order than --lora-targets names them.
  for (const auto& [model, full] : {std::pair{"qwen3", false}, {"qwen3", true}, {"qwen3_5_moe", false}}) {
    const std::string dir = ref_dir(model);
    if (!fs::exists(dir)) GTEST_SKIP() << "missing " << dir;
    const std::string kind = std::string(model) + (full ? "-full" : "-lora");
    TrainConfig c = base_config(model, fresh_dir("exact-whole-" + kind));
    c.full = full;
    c.lr = full ? 1e-3 : 1e-2;
    c.lr_scheduler = "cosine";
    c.warmup_steps = 2;
    c.weight_decay = 0.1;
    c.max_steps = 6;
    c.save_steps = 2;
    c.max_length = 24;
    c.grad_accum = 2;
    c.lora_rank = 4;
    c.threads = 2;
    const auto whole = run_and_read(c);
    ASSERT_EQ(whole.size(), 6u);

    // The same run cut after its checkpoint at step 2: later checkpoints and the exports removed.
    const fs::path cut = fresh_dir("exact-cut-" + kind);
    fs::copy(c.output, cut, fs::copy_options::recursive);
    for (const char* later : {"checkpoint-4", "checkpoint-6", "adapter", "model"}) fs::remove_all(cut / later);
    TrainConfig resumed = c;
    resumed.output = cut.string();
    resumed.resume = true;
    const auto after = run_and_read(resumed);
    ASSERT_EQ(after.size(), whole.size());
    for (size_t i = 0; i < whole.size(); ++i) {
      EXPECT_EQ(after[i].loss, whole[i].loss) << kind << " step " << i + 1;
      EXPECT_EQ(after[i].grad_norm, whole[i].grad_norm) << kind << " step " << i + 1;
    }
    const std::string trained = full ? "checkpoint-6/model/model.safetensors" : "checkpoint-6/adapter/adapter_model.safetensors";
    for (const std::string file : {trained, std::string("checkpoint-6/optimizer.safetensors")}) {
      const auto a = tensor_bytes(fs::path(c.output) / file), b = tensor_bytes(cut / file);
      ASSERT_EQ(a.size(), b.size()) << file;
      for (const auto& [name, bytes] : a) EXPECT_TRUE(b.at(name) == bytes) << kind << " " << file << ": " << name;
    }
    fs::remove_all(c.output);
    fs::remove_all(cut);
  }
}

TEST(Sft, BadConfigurationsFailBeforeAnyWork) {
  const fs::path out = fresh_dir("bad");
  auto error_of = [&](const std::function<void(TrainConfig&)>& change) {
    TrainConfig c = base_config("qwen2", out);
    change(c);
    try {
      run_sft(c);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  EXPECT_NE(error_of([](TrainConfig& c) { c.grad_accum = 0; }).find("--grad-accum must be positive"), std::string::npos);
  EXPECT_NE(error_of([](TrainConfig& c) { c.lr_scheduler = "step"; }).find("unknown --lr-scheduler \"step\""), std::string::npos);
  EXPECT_NE(error_of([](TrainConfig& c) { c.full = true; c.adapter = "x"; }).find("--full and --adapter exclude"), std::string::npos);
  EXPECT_NE(error_of([](TrainConfig& c) { c.model = "/nonexistent"; }).find("no config.json"), std::string::npos);
  EXPECT_NE(error_of([](TrainConfig& c) { c.warmup_ratio = 1.5; }).find("--warmup-ratio must be in [0, 1)"), std::string::npos);
  EXPECT_NE(error_of([](TrainConfig& c) { c.lora_targets = {"lm_head"}; }).find("LoRA target \"lm_head\""), std::string::npos);
  EXPECT_NE(error_of([](TrainConfig& c) { c.resume = true; }).find("--resume: no checkpoint"), std::string::npos);
  EXPECT_NE(error_of([](TrainConfig& c) { c.recompute_layers = 1; }).find("--recompute-layers 1 needs --recompute"),
            std::string::npos);
  EXPECT_NE(error_of([](TrainConfig& c) {
              c.recompute = "all";
              c.recompute_layers = 3;
            }).find("--recompute-layers 3 but the model has 2 layers"),
            std::string::npos);
  EXPECT_FALSE(fs::exists(out / "checkpoint-1"));
  fs::remove_all(out);
}
