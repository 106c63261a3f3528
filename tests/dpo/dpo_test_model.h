// A tiny random model with LoRA and three preference pairs, shared by the DPO tests.
#pragma once

#include <functional>
#include <random>
#include <vector>

#include "backend/op_test_util.h"
#include "data/packing.h"
#include "model/decoder.h"
#include "support/tiny_model.h"
#include "train/preference_step.h"

namespace spindle::dpo_test {

inline ModelConfig tiny_config() {
  return test::TinyModel{.model_type = "qwen2",  // q/k/v bias too
                         .vocab_size = 32,
                         .hidden_size = 16,
                         .intermediate_size = 24,
                         .head_dim = 4,
                         .rms_norm_eps = 1e-6,
                         .rope_theta = 1000.0}
      .config();
}

// Base weights scaled up from the 0.02 init so log-probabilities differ visibly between tokens.
inline ModelWeights base_model(Backend& be, DType dtype, uint64_t seed = 11) {
  return test::random_weights(be, tiny_config(), dtype, seed, 15.0);
}

// LoRA rank 2 on every projection; B random unless fresh (PEFT's init: B = 0).
inline void add_adapters(Backend& be, ModelWeights& w, bool fresh, uint64_t seed = 5) {
  const LoraConfig lora = test::lora_on_every_projection(2, 4);
  if (fresh) w.add_lora(be, lora, seed);
  else test::add_lora_with_random_b(be, w, lora, seed, test::uniform_draw(0.6));
}

// Pair i is documents 2i (chosen) and 2i+1 (rejected), as in a prepared preference dataset:
// a shared prompt (labels ignored) followed by the response (supervised).
inline std::vector<Document> pair_documents() {
  const int prompt[3] = {3, 2, 4}, chosen[3] = {4, 6, 3}, rejected[3] = {5, 3, 4};
  std::mt19937_64 rng(99);
  std::vector<Document> docs;
  for (int p = 0; p < 3; ++p) {
    std::vector<int32_t> prompt_ids(prompt[p]);
    for (auto& t : prompt_ids) t = static_cast<int32_t>(rng() % 32);
    for (int side = 0; side < 2; ++side) {
      Document d;
      d.input_ids = prompt_ids;
      d.labels.assign(prompt_ids.size(), kIgnoreIndex);
      for (int i = 0; i < (side ? rejected[p] : chosen[p]); ++i) {
        const auto t = static_cast<int32_t>(rng() % 32);
        d.input_ids.push_back(t);
        d.labels.push_back(t);
      }
      docs.push_back(std::move(d));
    }
  }
  return docs;
}

// Micro-batches from lists of document indices: each list one packed row (packed) or one row per
// document. Sequence id of document k is k (= preference_sequence_id(k / 2, k odd)). edit_row may
// change a built row (drop targets) before it becomes a micro-batch.
// prompt_targets: the chosen documents' prompts supervised too, as orpo's step needs them
// (supervise_chosen_prompts).
inline std::vector<PreferenceBatch> layout(Backend& be, const std::vector<Document>& docs,
                                           const std::vector<std::vector<int64_t>>& micro_batches, bool packed,
                                           DType dtype, const std::function<void(PackedRow&)>& edit_row = {},
                                           bool prompt_targets = false) {
  PackOptions options;
  options.max_length = 64;
  options.pad_to_multiple = 4;  // some padding in every row
  PackStats stats;
  auto lookup = [&](int64_t i) { return view_of(docs[i]); };
  std::vector<PreferenceBatch> out;
  for (const auto& list : micro_batches) {
    std::vector<PackedRow> rows;
    std::vector<std::vector<int32_t>> sequences;
    std::vector<std::vector<uint8_t>> prompts;
    auto add_row = [&](const std::vector<int64_t>& members) {
      RowPlan plan;
      for (int64_t k : members) {
        plan.slices.push_back({k, 0, static_cast<int64_t>(docs[k].input_ids.size())});
        plan.tokens += plan.slices.back().length;
      }
      rows.push_back(build_row(plan, lookup, options, stats));
      if (edit_row) edit_row(rows.back());
      sequences.emplace_back(members.begin(), members.end());
      if (prompt_targets) prompts.push_back(supervise_chosen_prompts(rows.back(), sequences.back()));
    };
    if (packed) {
      add_row(list);
    } else {
      for (int64_t k : list) add_row({k});
    }
    out.push_back(make_preference_batch(be, rows, sequences, dtype, prompt_targets ? &prompts : nullptr));
  }
  return out;
}

}  // namespace spindle::dpo_test
