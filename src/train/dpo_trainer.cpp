#include "train/dpo_trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>

#include "core/error.h"
#include "io/checkpoint.h"
#include "model/router_aux_loss.h"
#include "parallel/fsdp.h"
#include "parallel/sequence_shard.h"
#include "parallel/sp_attention.h"
#include "train/data_loader.h"
#include "train/objective.h"
#include "train/run_assembly.h"
#include "train/preference_step.h"
#include "train/run_common.h"
#include "train/run_folder.h"
#include "train/setup.h"
#include "train/step_runner.h"
#include "train/trainable_state.h"

namespace spindle {

namespace fs = std::filesystem;
using train::StepMetrics;

PreferenceLossOptions DpoConfig::loss_options() const {
  PreferenceLossOptions o;
  o.type = parse_preference_loss_type(loss_type);
  o.beta = beta;
  o.label_smoothing = label_smoothing;
  o.rpo_alpha = rpo_alpha;
  o.cpo_alpha = cpo_alpha;
  o.simpo_gamma = simpo_gamma;
  return o;
}

void DpoConfig::validate() const {
  train.validate();
  validate_preference();
}

void DpoConfig::validate_preference() const {
  const PreferenceLossOptions loss = loss_options();
  loss.validate();
  if (!uses_reference(loss.type) && (!ref_model.empty() || precompute_ref))
    fail("--loss-type {} compares the policy with no reference model: drop {}", loss_type,
         ref_model.empty() ? "--precompute-ref" : "--ref-model");
  if (!ref_model.empty() && !fs::exists(fs::path(ref_model) / "config.json"))
    fail("--ref-model {}: no config.json there (a Hugging Face model folder)", ref_model);
}

nlohmann::json DpoConfig::fingerprint() const {
  nlohmann::json j = {{"loss_type", loss_type}, {"beta", beta}, {"label_smoothing", label_smoothing},
                      {"rpo_alpha", rpo_alpha}, {"ref_model", ref_model}};
  const PreferenceLossOptions loss = loss_options();
  if (!uses_reference(loss.type)) {  // the losses without a reference: their own options
    j["cpo_alpha"] = loss.nll_weight();
    j["simpo_gamma"] = simpo_gamma;
  }
  return j;
}

nlohmann::json DpoConfig::identity_options() const {
  nlohmann::json j = fingerprint();
  j["precompute_ref"] = precompute_ref;
  if (!ref_model.empty()) j["ref_model"] = {{"config", file_fingerprint(fs::path(ref_model) / "config.json")}};
  return j;
}

namespace {

// A pair of the data: which source, and its index in that dataset (documents 2·pair, 2·pair + 1).
struct PairKey {
  size_t source = 0;
  int64_t pair = 0;
};

// Items (rows of whole pairs) laid out for this rank: the step's pairs numbered 0..P−1 in order of
// appearance (identical on every rank, since every rank sees every item), and this rank's
// micro-batches: rows j ≡ dp rank (mod dp), each cut to its sequence shard, with the response id
// of every supervised target.
struct LaidOutPairs {
  std::vector<PairKey> pairs;            // [P]
  std::vector<PreferenceBatch> batches;  // this rank's micro-batches, the same count on every rank
  int64_t tokens = 0;                    // real tokens of every row
  int64_t targets = 0;                   // supervised targets of every row
  int64_t rows = 0;                      // rows of the step (every replica's)
  int64_t num_pairs() const { return static_cast<int64_t>(pairs.size()); }
};

// `prompt_targets` (orpo): the chosen responses' prompts supervised too (supervise_chosen_prompts),
// on the whole rows before they are sharded.
LaidOutPairs lay_out(Backend& backend, const std::vector<LoaderItem>& items, const RunTopology& run, DType dtype,
                     bool prompt_targets = false) {
  const parallel::MeshConfig& mesh = run.mesh_config;
  LaidOutPairs out;
  std::vector<const PackedRow*> rows;
  std::vector<std::vector<int32_t>> row_sequences;  // [row][document of the row] → response id
  std::map<std::pair<size_t, int64_t>, int64_t> step_pair;
  std::deque<PackedRow> supervised;                 // prompt_targets: the rows with their prompts' targets
  std::vector<std::vector<uint8_t>> row_prompts;    // prompt_targets: [row][token] 1 for a prompt's target
  for (const LoaderItem& item : items) {
    for (size_t r = 0; r < item.rows.size(); ++r) {
      std::vector<int32_t>& ids = row_sequences.emplace_back();
      for (int64_t document : item.documents[r]) {
        const auto key = std::make_pair(item.source, document / 2);
        auto [it, added] = step_pair.emplace(key, static_cast<int64_t>(out.pairs.size()));
        if (added) out.pairs.push_back({item.source, document / 2});
        ids.push_back(preference_sequence_id(it->second, document % 2 == 1));
      }
      rows.push_back(&item.rows[r]);
      if (prompt_targets) {
        PackedRow& row = supervised.emplace_back(item.rows[r]);
        row_prompts.push_back(supervise_chosen_prompts(row, ids));
        rows.back() = &row;
      }
      for (int32_t doc : rows.back()->doc_ids) out.tokens += doc >= 0;
      ++out.rows;
      out.targets += rows.back()->num_items();
    }
  }
  // Every replica runs the same number of micro-batches: attention and FSDP collectives need all ranks.
  const PackedRow padding = padding_row(parallel::sequence_multiple(mesh));
  while (rows.size() % mesh.dp) {
    rows.push_back(&padding);
    row_sequences.emplace_back();
    if (prompt_targets) row_prompts.emplace_back(padding.doc_ids.size(), 0);
  }
  const int dp_rank = run.mesh ? run.mesh->coordinates().dp : 0;
  for (size_t j = static_cast<size_t>(dp_rank); j < rows.size(); j += mesh.dp) {
    if (mesh.sp == 1) {
      std::vector<std::vector<uint8_t>> prompts;
      if (prompt_targets) prompts.push_back(row_prompts[j]);
      out.batches.push_back(
          make_preference_batch(backend, {*rows[j]}, {row_sequences[j]}, dtype, prompt_targets ? &prompts : nullptr));
    } else {
      // Shift before shard: targets were built on the full row; the shard keeps the row's document
      // index per token, so the response ids follow their tokens exactly like positions do.
      const parallel::ShardPlan plan = parallel::plan_shards(rows[j]->doc_ids, mesh);
      const int sp_rank = run.mesh->sp_rank();
      const PackedRow shard = parallel::take_shard(*rows[j], plan, sp_rank);
      std::vector<std::vector<uint8_t>> prompts;
      if (prompt_targets) {  // the flags follow their tokens into the shard
        std::vector<uint8_t>& flags = prompts.emplace_back();
        for (int64_t source : plan.source[static_cast<size_t>(sp_rank)])
          flags.push_back(source < 0 ? 0 : row_prompts[j][static_cast<size_t>(source)]);
      }
      out.batches.push_back(
          make_preference_batch(backend, {shard}, {row_sequences[j]}, dtype, prompt_targets ? &prompts : nullptr));
      out.batches.back().batch.document_runs = document_runs(shard, *rows[j]);  // the row's document lengths
    }
  }
  return out;
}

// Sums per response, [source][2·pair + side], identical on every rank; NaN where not computed.
using PairTable = std::vector<std::vector<double>>;

void store(PairTable& table, const LaidOutPairs& laid, const std::vector<double>& sums) {
  for (int64_t p = 0; p < laid.num_pairs(); ++p) {
    const PairKey& key = laid.pairs[p];
    if (table.size() <= key.source) table.resize(key.source + 1);
    std::vector<double>& row = table[key.source];
    const size_t at = static_cast<size_t>(2 * key.pair);
    if (row.size() < at + 2) row.resize(at + 2, std::numeric_limits<double>::quiet_NaN());
    row[at] = sums[2 * p];
    row[at + 1] = sums[2 * p + 1];
  }
}

std::vector<double> lookup(const PairTable& table, const LaidOutPairs& laid) {
  std::vector<double> out(static_cast<size_t>(2 * laid.num_pairs()));
  for (int64_t p = 0; p < laid.num_pairs(); ++p)
    for (int side = 0; side < 2; ++side) {
      const PairKey& key = laid.pairs[p];
      const double v = table.at(key.source).at(static_cast<size_t>(2 * key.pair + side));
      SPINDLE_CHECK(!std::isnan(v), "no cached reference log-probability for pair {} of source {}", key.pair, key.source);
      out[static_cast<size_t>(2 * p + side)] = v;
    }
  return out;
}

// Every item of `data`, in dataset order, `chunk` items at a time (the same chunks on every rank).
void for_each_chunk(const TrainDataLoader& data, int64_t chunk, const std::function<void(std::vector<LoaderItem>)>& f) {
  for (size_t source = 0; source < data.num_sources(); ++source)
    for (int64_t begin = 0; begin < data.items_in(source); begin += chunk) {
      std::vector<LoaderItem> items;
      for (int64_t i = begin; i < std::min(begin + chunk, data.items_in(source)); ++i) items.push_back(data.item(source, i));
      f(std::move(items));
    }
}

// The preference step on one assembled policy: the reference (a model of its own, the policy with
// its adapters disabled, or the initial policy precomputed), the pairs' layout on the mesh, and the
// step's loss, metrics and gradients (preference_step.h).
class PreferenceRunner final : public ObjectiveRunner {
 public:
  PreferenceRunner(const ObjectiveContext& c, const DpoConfig& dpo)
      : backend_(c.backend), run_(c.run), policy_(c.policy), loss_(dpo.loss_options()) {
    const TrainConfig& config = c.config;
    // Reference. A full fine-tune without --ref-model compares with its initial model: precomputed
    // from the policy itself before the first update (or from --model's weights when it resumed,
    // which the policy no longer holds).
    // Losses without a reference (cpo, simpo, orpo) need none of it.
    needs_reference_ = uses_reference(loss_.type);
    prompt_targets_ = loss_.type == PreferenceLossType::kOrpo;
    initial_policy_ = needs_reference_ && config.full && dpo.ref_model.empty();
    precompute_ = needs_reference_ && (dpo.precompute_ref || initial_policy_);
    if (!dpo.ref_model.empty() || (initial_policy_ && c.resumed)) {
      const fs::path folder = initial_policy_ ? fs::path(config.model) : fs::path(dpo.ref_model);
      const ModelConfig ref_config = initial_policy_ ? policy_.weights.config : ModelConfig::from_file(dpo.ref_model);
      reference_ = assemble_run(backend_, describe_reference(policy_.description(), ref_config, folder),
                                RunPlacement{run_.world.get(), run_.mesh.get()});
    }
    reference_name_ = !dpo.ref_model.empty() ? "--ref-model"
                      : initial_policy_      ? "the initial model"
                                             : "the base model (LoRA adapters disabled)";
  }

  void prepare(const ObjectiveData& data) override {
    items_per_step_ = data.items_per_step;
    if (!data.eval.empty())
      eval_data_.emplace(std::vector<DataSource>{{data.eval, 1.0, {}}}, data.pack, data.seed, DatasetKind::kPreferencePairs);
    if (!precompute_) {
      if (run_.is_main() && needs_reference_)
        std::fprintf(stderr, "reference: %s, computed every step\n", reference_name_);
      return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    for_each_chunk(data.train, items_per_step_, [&](std::vector<LoaderItem> items) {
      const LaidOutPairs laid = lay_out(backend_, items, run_, policy_.weights.dtype);
      store(train_cache_, laid, reference_sums(laid));
    });
    if (eval_data_)
      for_each_chunk(*eval_data_, items_per_step_, [&](std::vector<LoaderItem> items) {
        const LaidOutPairs laid = lay_out(backend_, items, run_, policy_.weights.dtype);
        store(eval_cache_, laid, reference_sums(laid));
      });
    if (run_.is_main())
      std::fprintf(stderr, "reference log-probabilities of every pair precomputed from %s in %.1f s\n", reference_name_,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    reference_.reset();  // no longer needed: training reads the cache
  }

  ObjectiveStep step(const std::vector<LoaderItem>& items, bool backward) override {
    // Every rank holds the same items; lay_out gives each its rows and shards.
    const LaidOutPairs laid = lay_out(backend_, items, run_, policy_.weights.dtype, prompt_targets_);
    std::vector<double> cached;
    PreferenceStepOptions options = step_options(laid, backward);
    if (backward && policy_.router_aux) {  // the router loss over every real token of the step
      options.router_aux = policy_.router_aux.get();
      options.step_tokens = laid.tokens;
    }
    const PreferenceStepResult result = preference_step(backend_, policy_.decoder(), policy_.weights, laid.batches,
                                                        reference_source(train_cache_, laid, cached), options);
    comm::Communicator* world = run_.world.get();
    if (backward && world && policy_.all_reduce_gradients())  // replicated weights: sum the ranks' shares
      for (Parameter& p : policy_.weights.parameters())
        if (p.trainable) world->all_reduce_sum(backend_.default_stream(), p.grad);
    const PreferenceMetrics& pm = result.metrics;
    ObjectiveStep s;
    s.loss = pm.loss;
    s.num_items = laid.targets;
    s.tokens = laid.tokens;
    s.rows = laid.rows;
    s.aux_loss = result.aux_loss;
    train::StepMetrics::Preference& p = s.preference.emplace();
    p.rewards_chosen = pm.rewards_chosen;
    p.rewards_rejected = pm.rewards_rejected;
    p.margins = pm.margins;
    p.accuracy = pm.accuracy;
    p.logps_chosen = pm.logps_chosen;
    p.logps_rejected = pm.logps_rejected;
    p.nll_loss = pm.nll_loss;
    p.pairs = pm.pairs;
    if (loss_.type == PreferenceLossType::kOrpo) {
      p.log_odds_ratio = pm.log_odds_ratio;
      p.log_odds_chosen = pm.log_odds_chosen;
    }
    return s;
  }

  // The preference loss over every pair of the eval data, without gradients.
  std::optional<ObjectiveStep> evaluate() override {
    if (!eval_data_) return std::nullopt;
    PreferenceSums totals;
    int64_t targets = 0;
    for_each_chunk(*eval_data_, items_per_step_, [&](std::vector<LoaderItem> items) {
      const LaidOutPairs laid = lay_out(backend_, items, run_, policy_.weights.dtype, prompt_targets_);
      std::vector<double> cached;
      const PreferenceStepResult r = preference_step(backend_, policy_.decoder(), policy_.weights, laid.batches,
                                                     reference_source(eval_cache_, laid, cached),
                                                     step_options(laid, /*backward=*/false));
      const auto add = sum_preference_pairs(r.pairs, loss_).to_array();
      auto sum = totals.to_array();
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += add[i];
      totals = PreferenceSums::from_array(sum);
      targets += laid.targets;
    });
    const PreferenceMetrics eval = preference_metrics(totals, loss_);
    ObjectiveStep s;
    s.loss = eval.loss;
    s.num_items = targets;
    s.accuracy = eval.accuracy;
    return s;
  }

 private:
  PreferenceStepOptions step_options(const LaidOutPairs& laid, bool backward) const {
    PreferenceStepOptions options;
    options.loss = loss_;
    options.num_pairs = laid.num_pairs();
    // Pairs are numbered over the whole step and each rank holds disjoint parts of their tokens:
    // one all-reduce over the world completes every response's sums (no separate pair group).
    options.sequence_group = run_.world.get();
    options.backward = backward;
    return options;
  }

  // Σ log p per response under the reference, computed now (the same calls on every rank).
  std::vector<double> reference_sums(const LaidOutPairs& laid) {
    comm::Communicator* world = run_.world.get();
    if (reference_)
      return sequence_log_probs(backend_, reference_->decoder(), laid.batches, laid.num_pairs(), world).log_prob;
    if (initial_policy_)
      return sequence_log_probs(backend_, policy_.decoder(), laid.batches, laid.num_pairs(), world).log_prob;
    LoraDisabled disabled(policy_.weights);
    return sequence_log_probs(backend_, policy_.decoder(), laid.batches, laid.num_pairs(), world).log_prob;
  }

  ReferenceSource reference_source(const PairTable& cache, const LaidOutPairs& laid, std::vector<double>& cached) {
    if (!needs_reference_) return ReferenceSource::adapter_disabled();  // not used (preference_step.h)
    if (precompute_) {
      cached = lookup(cache, laid);
      return ReferenceSource::cached(cached);
    }
    if (reference_) return ReferenceSource::separate(reference_->decoder());
    return ReferenceSource::adapter_disabled();
  }

  Backend& backend_;
  const RunTopology& run_;
  AssembledRun& policy_;
  PreferenceLossOptions loss_;
  bool needs_reference_ = true, prompt_targets_ = false, initial_policy_ = false, precompute_ = false;
  std::unique_ptr<AssembledRun> reference_;
  const char* reference_name_ = "";
  int64_t items_per_step_ = 1;
  std::optional<TrainDataLoader> eval_data_;
  PairTable train_cache_, eval_cache_;
};

}  // namespace

DpoObjective::DpoObjective(DpoConfig config) : config_(std::move(config)) {}

nlohmann::json DpoObjective::identity_options() const { return config_.identity_options(); }

void DpoObjective::add_fingerprint(nlohmann::json& fingerprint) const { fingerprint["dpo"] = config_.fingerprint(); }

void DpoObjective::check_models(const ModelConfig& model) const {
  if (config_.ref_model.empty()) return;
  const ModelConfig reference = ModelConfig::from_file(config_.ref_model);
  if (reference.vocab_size != model.vocab_size)
    fail("--ref-model {} has a vocabulary of {} tokens but --model {} has {}: the reference must share the "
         "policy's tokenizer",
         config_.ref_model, reference.vocab_size, config_.train.model, model.vocab_size);
}

void DpoObjective::check_mesh(const TrainConfig& config, const RunTopology& run) const {
  if (config_.ref_model.empty()) return;
  // The reference runs on the same mesh: its heads must suit it too.
  const ModelConfig reference = ModelConfig::from_file(config_.ref_model);
  parallel::resolve_mesh(config.mesh_flags(), run.world_size(), static_cast<int>(reference.num_heads),
                         static_cast<int>(reference.num_kv_heads));
}

void DpoObjective::describe_data(const TrainDataLoader& loader, const TrainConfig& config) const {
  std::fprintf(stderr, "%lld rows of whole preference pairs (up to %lld tokens) per epoch\n",
               static_cast<long long>(loader.rows_per_epoch()), static_cast<long long>(config.max_length));
  if (loader.pairs_dropped())
    std::fprintf(stderr, "%lld pairs left out: a side was dropped (over-long or without a supervised target)\n",
                 static_cast<long long>(loader.pairs_dropped()));
}

std::unique_ptr<ObjectiveRunner> DpoObjective::bind(const ObjectiveContext& context) const {
  return std::make_unique<PreferenceRunner>(context, config_);
}

TrainSummary run_dpo(const DpoConfig& dpo) {
  dpo.validate();
  return run_training(dpo.train, DpoObjective(dpo));
}

}  // namespace spindle
