// The preference step against PyTorch + PEFT: a tiny random Qwen2 with a LoRA adapter on every
// projection, four pairs, the published DPO losses (sigmoid, label smoothing, IPO, RPO) computed
// from full logits with the adapter disabled as the reference, by scripts/gpu/dpo_reference.py
// (fp32 model, double loss arithmetic); and the losses without a reference (CPO, SimPO, CPO-SimPO,
// ORPO) computed by TRL's own trainers' functions, by scripts/gpu/preference_reference.py. Skipped
// when testdata/dpo is missing.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dpo/dpo_test_model.h"
#include "io/checkpoint.h"
#include "io/load_tensor.h"

using namespace spindle;
using namespace spindle::test;

namespace {

const std::string kDir = std::string(SPINDLE_SOURCE_DIR) + "/testdata/dpo";

// Pair i -> documents 2i (prompt + chosen) and 2i+1 (prompt + rejected); only responses supervised.
std::vector<Document> read_pairs(const std::string& path) {
  std::ifstream in(path);
  std::vector<Document> docs;
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
      docs.push_back(std::move(d));
    }
  }
  return docs;
}

}  // namespace

TEST(HfDpo, LossRewardsAndGradientsMatchPyTorch) {
  if (!std::filesystem::exists(kDir)) GTEST_SKIP() << "missing " << kDir << " (make it: scripts/gpu/dpo_reference.py)";
  auto be = make_cpu_backend(1);
  // F64 here: the result is then the exact one, and the error below is the F32 reference's own rounding,
  // the same on every machine (in F32 it also depends on the BLAS kernels: AVX-512 ones moved the rpo
  // gradients from 0.9e-4 to 2.3e-4 relative).
  ModelWeights w = ModelWeights::load(*be, ModelConfig::from_file(kDir), io::Checkpoint(kDir), DType::F64);
  w.load_peft_adapter(*be, kDir + "/adapter");
  Decoder decoder(*be, w);
  const std::vector<Document> docs = read_pairs(kDir + "/pairs.jsonl");
  ASSERT_EQ(docs.size(), 8u);
  const int64_t pairs = 4;
  // Pairs split across two packed micro-batches (chosen and rejected of pairs 0 and 1 apart).
  const auto batches = dpo_test::layout(*be, docs, {{0, 3, 5, 6}, {1, 2, 4, 7}}, true, DType::F64);
  const nlohmann::json expected = nlohmann::json::parse(std::ifstream(kDir + "/expected.json"));

  for (const auto& [name, want] : expected["variants"].items()) {
    PreferenceStepOptions options;
    options.loss.type = parse_preference_loss_type(want["options"]["loss_type"].get<std::string>());
    options.loss.beta = want["options"]["beta"];
    options.loss.label_smoothing = want["options"]["label_smoothing"];
    options.loss.rpo_alpha = want["options"]["rpo_alpha"];
    options.num_pairs = pairs;
    w.zero_grads(*be);
    const PreferenceStepResult r =
        preference_step(*be, decoder, w, batches, ReferenceSource::adapter_disabled(), options);
    for (int64_t p = 0; p < pairs; ++p) {
      EXPECT_NEAR(r.pairs[p].chosen.policy, want["policy_chosen"][p].get<double>(), 2e-4) << name << " pair " << p;
      EXPECT_NEAR(r.pairs[p].rejected.policy, want["policy_rejected"][p].get<double>(), 2e-4) << name;
      EXPECT_NEAR(r.pairs[p].chosen.reference, want["reference_chosen"][p].get<double>(), 2e-4) << name;
      EXPECT_NEAR(r.pairs[p].rejected.reference, want["reference_rejected"][p].get<double>(), 2e-4) << name;
      EXPECT_EQ(r.pairs[p].chosen.tokens, want["tokens_chosen"][p].get<int64_t>());
      EXPECT_EQ(r.pairs[p].rejected.tokens, want["tokens_rejected"][p].get<int64_t>());
    }
    const double loss = want["loss"];
    EXPECT_NEAR(r.metrics.loss, loss, 1e-5 * std::max(1.0, std::fabs(loss))) << name;
    EXPECT_NEAR(r.metrics.nll_loss, want["nll_loss"].get<double>(), 1e-5) << name;
    EXPECT_NEAR(r.metrics.margins, want["margins"].get<double>(), 1e-5) << name;
    EXPECT_DOUBLE_EQ(r.metrics.accuracy, want["accuracy"].get<double>()) << name;
    double rewards_chosen = 0;
    for (const auto& v : want["rewards_chosen"]) rewards_chosen += v.get<double>();
    EXPECT_NEAR(r.metrics.rewards_chosen, rewards_chosen / pairs, 1e-5) << name;

    io::Checkpoint grads(kDir + "/expected_" + name + ".safetensors");
    int checked = 0;
    for (Parameter& p : w.parameters()) {
      if (!p.trainable) continue;
      const io::TensorRecord* rec = grads.find("grad." + p.name);
      ASSERT_NE(rec, nullptr) << "no reference gradient for " << p.name;
      Tensor g = io::load_tensor(*be, *rec, DType::F64);
      const double err = relative_error(to_host(*be, p.grad), to_host(*be, g));
      EXPECT_LE(err, 1e-4) << name << " " << p.name;
      ++checked;
    }
    EXPECT_EQ(checked, 2 * 7 * 2) << name;
  }
}

// CPO, SimPO, CPO-SimPO and ORPO as TRL's CPOTrainer and ORPOTrainer compute them: the loss, the NLL
// (over the chosen prompts' tokens too for ORPO), the scores the loss compares, rewards, margins,
// accuracy, ORPO's log odds, and every LoRA gradient within 1e-4 relative.
TEST(HfDpo, ReferenceFreeLossesMatchTrl) {
  const std::string file = kDir + "/expected_reference_free.json";
  if (!std::filesystem::exists(file)) GTEST_SKIP() << "missing " << file << " (make it: scripts/gpu/preference_reference.py)";
  auto be = make_cpu_backend(1);
  ModelWeights w = ModelWeights::load(*be, ModelConfig::from_file(kDir), io::Checkpoint(kDir), DType::F64);
  w.load_peft_adapter(*be, kDir + "/adapter");
  Decoder decoder(*be, w);
  const std::vector<Document> docs = read_pairs(kDir + "/pairs.jsonl");
  const int64_t pairs = 4;
  const nlohmann::json expected = nlohmann::json::parse(std::ifstream(file));
  ASSERT_EQ(expected["variants"].size(), 4u);
  for (const auto& [name, want] : expected["variants"].items()) {
    const nlohmann::json& o = want["options"];
    PreferenceStepOptions options;
    const std::string type = o["loss_type"];
    options.loss.type = parse_preference_loss_type(type == "sigmoid" ? "cpo" : type);
    options.loss.beta = o["beta"];
    options.loss.label_smoothing = o["label_smoothing"];
    if (options.loss.type != PreferenceLossType::kOrpo) options.loss.cpo_alpha = o["cpo_alpha"];
    options.loss.simpo_gamma = o["simpo_gamma"];
    options.num_pairs = pairs;
    // Pairs split across two packed micro-batches (chosen and rejected of pairs 0 and 1 apart).
    const bool orpo = options.loss.type == PreferenceLossType::kOrpo;
    const auto batches =
        dpo_test::layout(*be, docs, {{0, 3, 5, 6}, {1, 2, 4, 7}}, true, DType::F64, {}, /*prompt_targets=*/orpo);
    w.zero_grads(*be);
    // These losses run no reference pass: the source is not used.
    const PreferenceStepResult r = preference_step(*be, decoder, w, batches, ReferenceSource::adapter_disabled(), options);
    int64_t nll_tokens = 0;
    for (int64_t p = 0; p < pairs; ++p) {
      EXPECT_NEAR(r.pairs[p].chosen.policy, want["policy_chosen"][p].get<double>(), 2e-4) << name << " pair " << p;
      EXPECT_NEAR(r.pairs[p].rejected.policy, want["policy_rejected"][p].get<double>(), 2e-4) << name;
      EXPECT_EQ(r.pairs[p].chosen.reference, 0.0);
      EXPECT_EQ(r.pairs[p].chosen.tokens, want["tokens_chosen"][p].get<int64_t>());
      EXPECT_EQ(r.pairs[p].rejected.tokens, want["tokens_rejected"][p].get<int64_t>());
      nll_tokens += r.pairs[p].chosen.tokens + r.pairs[p].chosen.prompt_tokens;
    }
    EXPECT_EQ(nll_tokens, want["nll_tokens"].get<int64_t>()) << name;
    auto mean = [](const nlohmann::json& values) {
      double s = 0;
      for (const auto& v : values) s += v.get<double>();
      return s / static_cast<double>(values.size());
    };
    const double loss = want["loss"];
    EXPECT_NEAR(r.metrics.loss, loss, 1e-5 * std::max(1.0, std::fabs(loss))) << name;
    EXPECT_NEAR(r.metrics.nll_loss, want["nll_loss"].get<double>(), 1e-5) << name;
    EXPECT_NEAR(r.metrics.logps_chosen, mean(want["logps_chosen"]), 1e-5 * std::fabs(mean(want["logps_chosen"]))) << name;
    EXPECT_NEAR(r.metrics.logps_rejected, mean(want["logps_rejected"]), 1e-5 * std::fabs(mean(want["logps_rejected"])))
        << name;
    EXPECT_NEAR(r.metrics.rewards_chosen, mean(want["rewards_chosen"]), 1e-5) << name;
    EXPECT_NEAR(r.metrics.rewards_rejected, mean(want["rewards_rejected"]), 1e-5) << name;
    EXPECT_NEAR(r.metrics.margins, want["margins"].get<double>(), 1e-5) << name;
    EXPECT_DOUBLE_EQ(r.metrics.accuracy, want["accuracy"].get<double>()) << name;
    if (orpo) {
      EXPECT_NEAR(r.metrics.log_odds_ratio, want["log_odds_ratio"].get<double>(), 1e-5) << name;
      EXPECT_NEAR(r.metrics.log_odds_chosen, want["log_odds_chosen"].get<double>(), 1e-5) << name;
    }

    io::Checkpoint grads(kDir + "/expected_" + name + ".safetensors");
    int checked = 0;
    for (Parameter& p : w.parameters()) {
      if (!p.trainable) continue;
      const io::TensorRecord* rec = grads.find("grad." + p.name);
      ASSERT_NE(rec, nullptr) << "no reference gradient for " << p.name;
      Tensor g = io::load_tensor(*be, *rec, DType::F64);
      const double err = relative_error(to_host(*be, p.grad), to_host(*be, g));
      EXPECT_LE(err, 1e-4) << name << " " << p.name;
      ++checked;
    }
    EXPECT_EQ(checked, 2 * 7 * 2) << name;
  }
}
