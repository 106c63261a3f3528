// `spindle dpo`'s training loop (run_dpo) in one process: one step at lr 0 on the PyTorch + PEFT
// reference (testdata/dpo: a tiny Qwen2 with a trained LoRA adapter, four pre-tokenized pairs)
// reproduces TRL's loss, rewards, accuracy and gradient norm; new adapters start at exactly ln 2;
// a precomputed reference gives the losses of the per-step one; data of the wrong kind fails;
// activation offload is reported per step and changes no bit; MoE models train with the router loss.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/prepared_dataset.h"
#include "support/tiny_model.h"
#include "train/dpo_trainer.h"
#include "train/metrics.h"

using namespace spindle;
namespace fs = std::filesystem;

namespace {

const std::string kDir = std::string(SPINDLE_SOURCE_DIR) + "/testdata/dpo";

fs::path fresh_dir(const std::string& name) {
  fs::path p = fs::temp_directory_path() / fmt::format("spindle-test-dpo-run-{}-{}", name, getpid());
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// testdata/dpo/pairs.jsonl as a prepared preference dataset: pair i = documents 2i (prompt +
// chosen) and 2i+1 (prompt + rejected), only the responses supervised.
fs::path write_pairs(const fs::path& dir) {
  const fs::path file = dir / "pairs.bin";
  PreparedDatasetWriter writer(file, DatasetKind::kPreferencePairs);
  std::ifstream in(kDir + "/pairs.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const nlohmann::json j = nlohmann::json::parse(line);
    const auto prompt = j["prompt_input_ids"].get<std::vector<int32_t>>();
    for (const char* side : {"chosen_input_ids", "rejected_input_ids"}) {
      Document d;
      d.input_ids = prompt;
      d.labels.assign(prompt.size(), kIgnoreIndex);
      for (int32_t t : j[side].get<std::vector<int32_t>>()) {
        d.input_ids.push_back(t);
        d.labels.push_back(t);
      }
      writer.add(view_of(d));
    }
  }
  writer.finish();
  return file;
}

DpoConfig base_config(const fs::path& dir, const fs::path& data) {
  DpoConfig c;
  c.train.model = kDir;
  c.train.data = {data.string()};
  c.train.output = (dir / "out").string();
  c.train.max_length = 128;  // all four pairs fit in one packed row: one step sees them all
  c.train.max_steps = 1;
  c.train.threads = 1;
  c.train.log_every = 1000;
  c.beta = 0.5;
  return c;
}

std::vector<train::StepMetrics> metrics_of(const DpoConfig& c) {
  return train::read_metrics_file(fs::path(c.train.output) / "metrics.jsonl");
}

nlohmann::json expected(const std::string& variant) {
  std::ifstream in(kDir + "/expected.json");
  nlohmann::json j;
  in >> j;
  return j["variants"][variant];
}

double mean(const nlohmann::json& values) {
  double s = 0;
  for (const auto& v : values) s += v.get<double>();
  return s / static_cast<double>(values.size());
}

}  // namespace

TEST(RunDpo, OneStepMatchesTrl) {
  if (!fs::exists(kDir + "/expected.json")) GTEST_SKIP() << "testdata/dpo missing";
  const fs::path dir = fresh_dir("trl");
  const fs::path data = write_pairs(dir);
  for (const std::string variant : {"sigmoid", "ipo"}) {
    const nlohmann::json want = expected(variant);
    DpoConfig c = base_config(dir, data);
    c.train.output = (dir / variant).string();
    c.train.adapter = kDir + "/adapter";
    c.train.lr = 0;
    c.loss_type = want["options"]["loss_type"];
    c.beta = want["options"]["beta"];
    if (variant == "ipo") {  // one pair per row, four rows in the step: the same pairs
      c.train.no_packing = true;
      c.train.grad_accum = 4;
    }
    ASSERT_EQ(run_dpo(c).steps, 1);
    const auto lines = metrics_of(c);
    ASSERT_EQ(lines.size(), 1u);
    const train::StepMetrics& m = lines[0];
    ASSERT_TRUE(m.preference.has_value());
    const auto& p = *m.preference;
    EXPECT_EQ(p.pairs, 4);
    EXPECT_NEAR(m.loss, want["loss"].get<double>(), 1e-5 * want["loss"].get<double>()) << variant;
    EXPECT_NEAR(p.rewards_chosen, mean(want["rewards_chosen"]), 1e-5) << variant;
    EXPECT_NEAR(p.rewards_rejected, mean(want["rewards_rejected"]), 1e-5) << variant;
    EXPECT_NEAR(p.margins, want["margins"].get<double>(), 1e-5) << variant;
    EXPECT_DOUBLE_EQ(p.accuracy, want["accuracy"].get<double>()) << variant;
    EXPECT_NEAR(p.logps_chosen, mean(want["policy_chosen"]), 1e-4) << variant;
    double norm = 0;
    for (const auto& [name, g] : want["grad_norms"].items()) norm += g.get<double>() * g.get<double>();
    norm = std::sqrt(norm);
    EXPECT_NEAR(m.grad_norm, norm, 1e-4 * norm) << variant;
    int64_t targets = 0;
    for (const char* side : {"tokens_chosen", "tokens_rejected"})
      for (const auto& n : want[side]) targets += n.get<int64_t>();
    EXPECT_EQ(m.num_items, targets);
    EXPECT_TRUE(fs::exists(fs::path(c.train.output) / "adapter" / "adapter_model.safetensors"));
  }
  fs::remove_all(dir);
}

TEST(RunDpo, NewAdaptersStartAtLn2AndLearn) {
  const fs::path dir = fresh_dir("ln2");
  const fs::path data = write_pairs(dir);
  DpoConfig c = base_config(dir, data);
  c.train.no_packing = true;  // a pair per row, the four pairs in every step
  c.train.grad_accum = 4;
  c.train.max_steps = 4;
  c.train.lr = 1e-2;
  c.train.lr_scheduler = "constant";
  c.train.lora_rank = 4;
  ASSERT_EQ(run_dpo(c).steps, 4);
  const auto lines = metrics_of(c);
  ASSERT_EQ(lines.size(), 4u);
  // B = 0: the policy is its reference, every log-ratio is exactly 0.
  EXPECT_EQ(lines[0].loss, std::log(2.0));
  EXPECT_EQ(lines[0].preference->rewards_chosen, 0.0);
  EXPECT_EQ(lines[0].preference->accuracy, 0.0);
  EXPECT_EQ(lines[0].preference->pairs, 4);
  // Every step sees the same four pairs: the chosen answers become preferred.
  EXPECT_LT(lines[3].loss, lines[0].loss);
  EXPECT_GT(lines[3].preference->margins, 0.0);
  EXPECT_GT(lines[3].preference->accuracy, 0.5);
  // The log line carries TRL's names; an SFT line leaves them out.
  std::ifstream in(fs::path(c.train.output) / "metrics.jsonl");
  std::string first;
  std::getline(in, first);
  const nlohmann::json j = nlohmann::json::parse(first);
  for (const char* key : {"loss", "grad_norm", "lr", "tokens", "tokens_per_s", "rewards/chosen", "rewards/rejected",
                          "rewards/margins", "rewards/accuracies", "logps/chosen", "nll_loss", "pairs"})
    EXPECT_TRUE(j.contains(key)) << key;
  train::StepMetrics sft;
  EXPECT_EQ(train::metrics_to_json_line(sft).find("rewards"), std::string::npos);
  fs::remove_all(dir);
}

TEST(RunDpo, PrecomputedReferenceEqualsPerStepReference) {
  const fs::path dir = fresh_dir("precompute");
  const fs::path data = write_pairs(dir);
  auto run = [&](const std::string& name, bool precompute, bool full) {
    DpoConfig c = base_config(dir, data);
    c.train.output = (dir / name).string();
    c.train.no_packing = true;
    c.train.grad_accum = 2;
    c.train.max_steps = 2;
    c.train.lr = 1e-2;
    if (full) c.train.full = true;
    else c.train.adapter = kDir + "/adapter";  // trained: the reference (base) differs from the policy
    c.precompute_ref = precompute;
    run_dpo(c);
    return metrics_of(c);
  };
  const auto every_step = run("every-step", false, false);
  const auto cached = run("cached", true, false);
  ASSERT_EQ(every_step.size(), 2u);
  ASSERT_EQ(cached.size(), 2u);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_NEAR(cached[s].loss, every_step[s].loss, 1e-6 * every_step[s].loss) << "step " << s + 1;
    EXPECT_NEAR(cached[s].preference->margins, every_step[s].preference->margins, 1e-6) << "step " << s + 1;
  }
  EXPECT_NE(every_step[0].loss, std::log(2.0));
  // A full fine-tune's default reference is its initial model, precomputed: ln 2 at the first step.
  const auto full = run("full", false, true);
  ASSERT_EQ(full.size(), 2u);
  EXPECT_EQ(full[0].loss, std::log(2.0));
  EXPECT_NE(full[1].loss, std::log(2.0));
  fs::remove_all(dir);
}

// A run resumed from a mid-run checkpoint logs the same steps as the uninterrupted run, bit for
// bit: weights, AdamW state, data order and the reference log-probabilities all come back (a
// trained adapter, so the reference differs from the policy; a full fine-tune, whose reference is
// its initial model, precomputed before the first step and not in the checkpoint; and ORPO, which
// has no reference).
TEST(RunDpo, ResumedRunLogsTheSameSteps) {
  const fs::path dir = fresh_dir("resume");
  const fs::path data = write_pairs(dir);
  for (const std::string run : {"adapter", "full", "orpo"}) {
    SCOPED_TRACE(run);
    const bool full = run == "full";
    DpoConfig c = base_config(dir, data);
    if (run == "orpo") c.loss_type = "orpo";  // no reference; the chosen prompts supervised
    c.train.output = (dir / ("whole-" + run)).string();
    c.train.no_packing = true;  // a pair per row: two optimizer steps per pass over the four pairs
    c.train.grad_accum = 2;
    c.train.max_steps = 6;
    c.train.save_steps = 2;
    c.train.lr = 1e-2;
    c.train.lr_scheduler = "cosine";
    c.train.warmup_steps = 1;
    if (full) c.train.full = true;
    else c.train.adapter = kDir + "/adapter";
    ASSERT_EQ(run_dpo(c).steps, 6);
    const auto whole = metrics_of(c);
    ASSERT_EQ(whole.size(), 6u);

    // A second output folder holding what the first had after step 4: its checkpoint and log.
    DpoConfig r = c;
    r.train.output = (dir / ("resumed-" + run)).string();
    fs::create_directories(r.train.output);
    fs::copy(fs::path(c.train.output) / "checkpoint-4", fs::path(r.train.output) / "checkpoint-4",
             fs::copy_options::recursive);
    fs::copy_file(fs::path(c.train.output) / "metrics.jsonl", fs::path(r.train.output) / "metrics.jsonl");
    r.train.resume = true;
    ASSERT_EQ(run_dpo(r).steps, 6);
    const auto after = metrics_of(r);
    ASSERT_EQ(after.size(), 6u);  // steps 1-4 kept from the log, 5-6 computed again
    for (size_t i = 0; i < 6; ++i) {
      EXPECT_EQ(after[i].step, whole[i].step);
      EXPECT_EQ(after[i].loss, whole[i].loss) << "step " << i + 1;
      EXPECT_EQ(after[i].grad_norm, whole[i].grad_norm) << "step " << i + 1;
      EXPECT_EQ(after[i].lr, whole[i].lr) << "step " << i + 1;
      ASSERT_TRUE(after[i].preference && whole[i].preference);
      EXPECT_EQ(after[i].preference->margins, whole[i].preference->margins) << "step " << i + 1;
    }
  }
  fs::remove_all(dir);
}

// Scoring the training pairs as eval data after step k gives the loss and accuracy that step k + 1
// then logs for the same pairs under the same policy (every step sees all four pairs).
TEST(RunDpo, EvalScoresThePairsWithTheCurrentPolicy) {
  const fs::path dir = fresh_dir("eval");
  const fs::path data = write_pairs(dir);
  DpoConfig c = base_config(dir, data);
  c.train.no_packing = true;
  c.train.grad_accum = 4;
  c.train.max_steps = 4;
  c.train.lr = 1e-2;
  c.train.lr_scheduler = "constant";
  c.train.lora_rank = 4;
  c.train.eval_data = data.string();
  c.train.eval_steps = 1;
  ASSERT_EQ(run_dpo(c).steps, 4);
  const auto lines = metrics_of(c);
  ASSERT_EQ(lines.size(), 4u);
  for (size_t i = 0; i + 1 < lines.size(); ++i) {
    ASSERT_TRUE(lines[i].eval_loss && lines[i].eval_accuracy) << "step " << i + 1;
    EXPECT_NEAR(*lines[i].eval_loss, lines[i + 1].loss, 1e-9 * lines[i + 1].loss) << "step " << i + 1;
    EXPECT_EQ(*lines[i].eval_accuracy, lines[i + 1].preference->accuracy) << "step " << i + 1;
  }
  EXPECT_LT(*lines[3].eval_loss, lines[3].loss);  // the last update helped the pairs it trained on
  fs::remove_all(dir);
}

TEST(RunDpo, WrongDataOrOptionsFailBeforeTraining) {
  const fs::path dir = fresh_dir("errors");
  const fs::path docs = dir / "docs.bin";
  {
    PreparedDatasetWriter writer(docs, DatasetKind::kDocuments);
    Document d{{5, 6, 7, 8}, {5, 6, 7, 8}, {}};
    writer.add(view_of(d));
    writer.finish();
  }
  DpoConfig c = base_config(dir, docs);
  try {
    run_dpo(c);
    FAIL() << "documents accepted as preference pairs";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("not preference pairs"), std::string::npos) << e.what();
  }
  c = base_config(dir, write_pairs(dir));
  c.beta = 0;
  EXPECT_THROW(run_dpo(c), Error);
  c.beta = 0.1;
  c.ref_model = (dir / "nowhere").string();
  try {
    run_dpo(c);
    FAIL() << "missing --ref-model accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--ref-model"), std::string::npos) << e.what();
  }
  EXPECT_FALSE(fs::exists(fs::path(c.train.output) / "metrics.jsonl"));
  fs::remove_all(dir);
}

// --offload activations, as sft runs it: every step's line reports the offloaded host memory and the
// copies of that step alone (reset before each), and the losses and gradient norms are those of the
// same run without offload, bit for bit.
TEST(RunDpo, OffloadIsReportedPerStepAndChangesNoBit) {
  const fs::path dir = fresh_dir("offload");
  const fs::path data = write_pairs(dir);
  auto run = [&](const std::string& offload) {
    DpoConfig c = base_config(dir, data);
    c.train.output = (dir / offload).string();
    c.train.adapter = kDir + "/adapter";
    c.train.no_packing = true;  // a pair per row, the four pairs in every step
    c.train.grad_accum = 4;
    c.train.max_steps = 3;
    c.train.lr = 1e-2;
    c.train.recompute = "all";
    c.train.offload = offload;
    EXPECT_EQ(run_dpo(c).steps, 3);
    return metrics_of(c);
  };
  const auto kept = run("none");
  const auto offloaded = run("activations");
  ASSERT_EQ(kept.size(), 3u);
  ASSERT_EQ(offloaded.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    SCOPED_TRACE(fmt::format("step {}", i + 1));
    EXPECT_EQ(offloaded[i].loss, kept[i].loss);
    EXPECT_EQ(offloaded[i].grad_norm, kept[i].grad_norm);
    EXPECT_EQ(kept[i].offload_host_bytes, 0);
    EXPECT_GT(offloaded[i].offload_host_bytes, 0);
    EXPECT_GT(offloaded[i].offload_copy_bytes, 0);
    // This step's copies only: every step moves the same tensors (the same four rows).
    EXPECT_EQ(offloaded[i].offload_copy_bytes, offloaded[0].offload_copy_bytes);
  }
  std::ifstream in(dir / "activations" / "metrics.jsonl");
  std::string first;
  std::getline(in, first);
  const nlohmann::json j = nlohmann::json::parse(first);
  for (const char* key : {"offload_host_memory", "offload_copy_bytes", "offload_copy_s", "offload_wait_s"})
    EXPECT_TRUE(j.contains(key)) << key;
  fs::remove_all(dir);
}

// A MoE model whose config asks for the router load-balancing loss (output_router_logits) trains
// with it, as sft does: every line logs aux_loss, the loss is the preference loss alone (the first
// step's equals that of a run without the router loss), and the router loss's gradient changes
// the updates. --router-aux-loss-coef 0 turns it off.
TEST(RunDpo, MoeModelsTrainWithTheRouterLoss) {
  const fs::path dir = fresh_dir("router-loss");
  const fs::path data = write_pairs(dir);
  test::TinyModel tiny = test::tiny_qwen3_moe();
  tiny.vocab_size = 96;  // testdata/dpo's pairs
  tiny.extra["output_router_logits"] = true;
  tiny.extra["router_aux_loss_coef"] = 0.5;
  const fs::path model = dir / "moe";
  test::write_model_folder(model, tiny, 7, 10.0);
  auto run = [&](const std::string& name, double coefficient) {
    DpoConfig c = base_config(dir, data);
    c.train.model = model.string();
    c.train.output = (dir / name).string();
    c.train.no_packing = true;
    c.train.grad_accum = 2;
    c.train.max_steps = 3;
    c.train.lr = 1e-2;
    c.train.lora_rank = 4;
    c.train.router_aux_loss_coef = coefficient;
    EXPECT_EQ(run_dpo(c).steps, 3);
    return metrics_of(c);
  };
  const auto with_loss = run("config", -1);  // the config's: on, 0.5
  const auto without = run("off", 0);
  ASSERT_EQ(with_loss.size(), 3u);
  ASSERT_EQ(without.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    ASSERT_TRUE(with_loss[i].aux_loss.has_value()) << "step " << i + 1;
    EXPECT_GT(*with_loss[i].aux_loss, 0.0);
    EXPECT_FALSE(without[i].aux_loss.has_value());
  }
  EXPECT_EQ(with_loss[0].loss, std::log(2.0));  // new adapters: the policy is its reference
  EXPECT_EQ(with_loss[0].loss, without[0].loss);
  EXPECT_NE(with_loss[0].grad_norm, without[0].grad_norm);  // the router loss's gradient
  EXPECT_NE(with_loss[2].loss, without[2].loss);
  fs::remove_all(dir);
}

// CPO, SimPO, CPO-SimPO and ORPO through the whole loop: one step at lr 0 on the TRL reference of
// scripts/gpu/preference_reference.py (float64) reproduces its loss, metrics and gradient norm
// (ORPO's chosen prompts supervised by the loop's own layout), with no reference model.
TEST(RunDpo, ReferenceFreeLossesMatchTrlInTheLoop) {
  const std::string file = kDir + "/expected_reference_free.json";
  if (!fs::exists(file)) GTEST_SKIP() << "testdata/dpo/expected_reference_free.json missing";
  const nlohmann::json expected = nlohmann::json::parse(std::ifstream(file));
  const fs::path dir = fresh_dir("reference-free");
  const fs::path data = write_pairs(dir);
  for (const auto& [name, want] : expected["variants"].items()) {
    const nlohmann::json& o = want["options"];
    DpoConfig c = base_config(dir, data);
    c.train.output = (dir / name).string();
    c.train.adapter = kDir + "/adapter";
    c.train.lr = 0;
    // F64: ORPO's gradient is a difference of two terms whose F32 rounding alone is 1e-4 of the norm.
    c.train.dtype = "f64";
    c.loss_type = o["loss_type"] == "sigmoid" ? "cpo" : o["loss_type"].get<std::string>();
    c.beta = o["beta"];
    c.label_smoothing = o["label_smoothing"];
    if (c.loss_type != "orpo") c.cpo_alpha = o["cpo_alpha"];
    c.simpo_gamma = o["simpo_gamma"];
    ASSERT_EQ(run_dpo(c).steps, 1) << name;
    const auto lines = metrics_of(c);
    ASSERT_EQ(lines.size(), 1u);
    const train::StepMetrics& m = lines[0];
    ASSERT_TRUE(m.preference.has_value());
    const auto& p = *m.preference;
    EXPECT_EQ(p.pairs, 4);
    EXPECT_NEAR(m.loss, want["loss"].get<double>(), 1e-5 * want["loss"].get<double>()) << name;
    EXPECT_NEAR(p.nll_loss, want["nll_loss"].get<double>(), 1e-5) << name;
    EXPECT_NEAR(p.margins, want["margins"].get<double>(), 1e-5) << name;
    EXPECT_EQ(p.accuracy, want["accuracy"].get<double>()) << name;
    EXPECT_EQ(p.log_odds_ratio.has_value(), name == "orpo");
    if (p.log_odds_ratio) {
      EXPECT_NEAR(*p.log_odds_ratio, want["log_odds_ratio"].get<double>(), 1e-5);
    }
    double norm = 0;
    for (const auto& [tensor, g] : want["grad_norms"].items()) norm += g.get<double>() * g.get<double>();
    norm = std::sqrt(norm);
    EXPECT_NEAR(m.grad_norm, norm, 1e-4 * norm) << name;
    // Supervised targets: both responses', and ORPO's chosen prompts'.
    int64_t targets = 0;
    for (const char* side : {"tokens_chosen", "tokens_rejected"})
      for (const auto& n : want[side]) targets += n.get<int64_t>();
    int64_t chosen = 0;
    for (const auto& n : want["tokens_chosen"]) chosen += n.get<int64_t>();
    if (name == "orpo") targets += want["nll_tokens"].get<int64_t>() - chosen;
    EXPECT_EQ(m.num_items, targets) << name;
  }
  // No reference model for them: --ref-model and --precompute-ref are refused before any work.
  DpoConfig c = base_config(dir, data);
  c.loss_type = "orpo";
  c.precompute_ref = true;
  try {
    run_dpo(c);
    FAIL() << "--precompute-ref accepted with orpo";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--precompute-ref"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}
