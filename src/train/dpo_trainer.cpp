#include "train/dpo_trainer.h"

#include <chrono>
#include <cmath>
#include <cstdio>
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
  return o;
}

void DpoConfig::validate() const {
  train.validate();
  loss_options().validate();
  if (!ref_model.empty() && !fs::exists(fs::path(ref_model) / "config.json"))
    fail("--ref-model {}: no config.json there (a Hugging Face model folder)", ref_model);
}

nlohmann::json DpoConfig::fingerprint() const {
  return {{"loss_type", loss_type}, {"beta", beta}, {"label_smoothing", label_smoothing}, {"rpo_alpha", rpo_alpha},
          {"ref_model", ref_model}};
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
  int64_t num_pairs() const { return static_cast<int64_t>(pairs.size()); }
};

LaidOutPairs lay_out(Backend& backend, const std::vector<LoaderItem>& items, const RunTopology& run, DType dtype) {
  const parallel::MeshConfig& mesh = run.mesh_config;
  LaidOutPairs out;
  std::vector<const PackedRow*> rows;
  std::vector<std::vector<int32_t>> row_sequences;  // [row][document of the row] → response id
  std::map<std::pair<size_t, int64_t>, int64_t> step_pair;
  for (const LoaderItem& item : items) {
    for (size_t r = 0; r < item.rows.size(); ++r) {
      rows.push_back(&item.rows[r]);
      std::vector<int32_t>& ids = row_sequences.emplace_back();
      for (int64_t document : item.documents[r]) {
        const auto key = std::make_pair(item.source, document / 2);
        auto [it, added] = step_pair.emplace(key, static_cast<int64_t>(out.pairs.size()));
        if (added) out.pairs.push_back({item.source, document / 2});
        ids.push_back(preference_sequence_id(it->second, document % 2 == 1));
      }
      for (int32_t doc : item.rows[r].doc_ids) out.tokens += doc >= 0;
      out.targets += item.rows[r].num_items();
    }
  }
  // Every replica runs the same number of micro-batches: attention and FSDP collectives need all ranks.
  const PackedRow padding = padding_row(parallel::sequence_multiple(mesh));
  while (rows.size() % mesh.dp) {
    rows.push_back(&padding);
    row_sequences.emplace_back();
  }
  const int dp_rank = run.mesh ? run.mesh->coordinates().dp : 0;
  for (size_t j = static_cast<size_t>(dp_rank); j < rows.size(); j += mesh.dp) {
    if (mesh.sp == 1) {
      out.batches.push_back(make_preference_batch(backend, {*rows[j]}, {row_sequences[j]}, dtype));
    } else {
      // Shift before shard: targets were built on the full row; the shard keeps the row's document
      // index per token, so the response ids follow their tokens exactly like positions do.
      const parallel::ShardPlan plan = parallel::plan_shards(rows[j]->doc_ids, mesh);
      const PackedRow shard = parallel::take_shard(*rows[j], plan, run.mesh->sp_rank());
      out.batches.push_back(make_preference_batch(backend, {shard}, {row_sequences[j]}, dtype));
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

// A frozen reference model: replicated, or FSDP-sharded over the world like the policy.
struct ReferenceModel {
  ModelWeights weights;
  std::unique_ptr<Decoder> decoder;
  std::unique_ptr<AttentionStrategy> attention;
  std::unique_ptr<parallel::Fsdp> fsdp;
};

std::unique_ptr<ReferenceModel> load_reference(Backend& backend, const fs::path& folder, const ModelConfig& config,
                                               const RunTopology& run, bool shard, DType dtype,
                                               const DecoderOptions& options, const QuantizeOptions& quantize) {
  auto ref = std::make_unique<ReferenceModel>();
  ref->weights = ModelWeights::load(backend, config, io::Checkpoint(folder.string()), dtype, quantize);
  if (shard && run.world) ref->fsdp = std::make_unique<parallel::Fsdp>(backend, ref->weights, *run.world);
  ref->decoder = std::make_unique<Decoder>(backend, ref->weights, options);
  if (ref->fsdp) ref->decoder->set_parameter_hooks(ref->fsdp.get());
  if (run.mesh && run.mesh_config.sp > 1) {
    ref->attention = parallel::make_sequence_parallel_attention(*run.mesh, config);
    ref->decoder->set_attention(ref->attention.get());
  }
  return ref;
}

}  // namespace

TrainSummary run_dpo(const DpoConfig& dpo) {
  dpo.validate();
  const TrainConfig& config = dpo.train;
  const PreferenceLossOptions loss = dpo.loss_options();
  const auto start = std::chrono::steady_clock::now();
  const ModelConfig model_config = ModelConfig::from_file(config.model);
  if (router_aux_loss_coefficient(model_config, config.router_aux_loss_coef) > 0)
    fail("{}: spindle dpo does not add the MoE router load-balancing loss yet (this config asks for it: "
         "output_router_logits is true); pass --router-aux-loss-coef 0 to train without it",
         config.model);
  std::optional<ModelConfig> ref_config;
  if (!dpo.ref_model.empty()) {
    ref_config = ModelConfig::from_file(dpo.ref_model);
    if (ref_config->vocab_size != model_config.vocab_size)
      fail("--ref-model {} has a vocabulary of {} tokens but --model {} has {}: the reference must share the "
           "policy's tokenizer",
           dpo.ref_model, ref_config->vocab_size, config.model, model_config.vocab_size);
  }
  // The mesh is checked against the job and the model(s) before any data or weight is touched.
  const ComputeDevice device = choose_device(config, process_group_from_environment());
  RunTopology run = connect_training_run(config, model_config, device);
  if (ref_config)  // the reference runs on the same mesh: its heads must suit it too
    parallel::resolve_mesh(config.mesh_flags(), run.world_size(), static_cast<int>(ref_config->num_heads),
                           static_cast<int>(ref_config->num_kv_heads));
  const parallel::MeshConfig& mesh = run.mesh_config;
  const bool main_rank = run.is_main();
  comm::Communicator* world = run.world.get();  // null for one process
  const int cpu_threads = effective_cpu_threads(threads_per_process(config, run));
  auto backend = make_backend(device, threads_per_process(config, run));
  nlohmann::json fingerprint = config.fingerprint();
  fingerprint["dpo"] = dpo.fingerprint();
  if (mesh.dp > 1) fingerprint["data_parallel"] = mesh.dp;  // items per step = grad_accum · dp
  // The output folder, the resume point and the data, checked and prepared by the main rank first.
  RunStart run_start = start_run(config, "dpo", dpo.identity_options(), fingerprint, run, *backend);
  const ResumePoint& resume = run_start.resume;
  const TrainingData& data = run_start.data;

  // Data: rows of whole pairs ("items"); a step takes grad_accum items per data-parallel replica.
  const PackOptions pack = pack_options(config);
  TrainDataLoader loader(data.sources, pack, config.seed, DatasetKind::kPreferencePairs);
  std::optional<TrainDataLoader> eval_data;
  if (!data.eval.empty()) eval_data.emplace(std::vector<DataSource>{{data.eval, 1.0}}, pack, config.seed,
                                            DatasetKind::kPreferencePairs);
  if (main_rank) {
    std::fprintf(stderr, "%lld rows of whole preference pairs (up to %lld tokens) per epoch\n",
                 static_cast<long long>(loader.rows_per_epoch()), static_cast<long long>(config.max_length));
    if (loader.pairs_dropped())
      std::fprintf(stderr, "%lld pairs left out: a side was dropped (over-long or without a supervised target)\n",
                   static_cast<long long>(loader.pairs_dropped()));
    if (run.world)
      std::fprintf(stderr, "%d processes: dp %d x sp %d (ulysses %d x ring %d)\n", run.world_size(), mesh.dp, mesh.sp,
                   mesh.ulysses, mesh.ring);
  }

  // Policy.
  const DType dtype = device.dtype;
  const DType source_dtype = export_dtype(config);
  ModelWeights weights = load_training_weights(*backend, config, model_config, resume.dir, dtype);
  const DecoderOptions options = decoder_options(config, model_config);
  Decoder decoder(*backend, weights, options);
  std::unique_ptr<AttentionStrategy> sequence_attention;
  if (run.mesh && mesh.sp > 1) {
    sequence_attention = parallel::make_sequence_parallel_attention(*run.mesh, model_config);
    decoder.set_attention(sequence_attention.get());
  }
  TrainableState state(*backend, weights, decoder, run, !config.no_fsdp,
                       {config.adam_beta1, config.adam_beta2, config.adam_eps, config.weight_decay, config.max_grad_norm});
  AdamWOptimizer& optimizer = state.optimizer();
  if (main_rank && run.world) std::fprintf(stderr, "%s\n", state.describe().c_str());

  // Reference. A full fine-tune without --ref-model compares with its initial model: precomputed
  // from the policy itself before the first update (or from --model's weights when resuming).
  const bool initial_policy = config.full && dpo.ref_model.empty();
  const bool precompute = dpo.precompute_ref || initial_policy;
  std::unique_ptr<ReferenceModel> reference_model;
  if (!dpo.ref_model.empty() || (initial_policy && !resume.empty()))
    reference_model = load_reference(*backend, initial_policy ? fs::path(config.model) : fs::path(dpo.ref_model),
                                     initial_policy ? model_config : *ref_config, run, !config.no_fsdp, dtype, options,
                                     parse_quantize_options(config.quantize, config.double_quant,
                                                            config.quant_block_size));
  const char* reference_name = !dpo.ref_model.empty() ? "--ref-model"
                               : initial_policy       ? "the initial model"
                                                      : "the base model (LoRA adapters disabled)";
  // Σ log p per response under the reference, computed now (the same calls on every rank).
  auto reference_sums = [&](const LaidOutPairs& laid) {
    if (reference_model)
      return sequence_log_probs(*backend, *reference_model->decoder, laid.batches, laid.num_pairs(), world).log_prob;
    if (initial_policy) return sequence_log_probs(*backend, decoder, laid.batches, laid.num_pairs(), world).log_prob;
    LoraDisabled disabled(weights);
    return sequence_log_probs(*backend, decoder, laid.batches, laid.num_pairs(), world).log_prob;
  };
  const int64_t items_per_step = config.grad_accum * mesh.dp;
  PairTable train_cache, eval_cache;
  if (precompute) {
    const auto t0 = std::chrono::steady_clock::now();
    for_each_chunk(loader, items_per_step, [&](std::vector<LoaderItem> items) {
      const LaidOutPairs laid = lay_out(*backend, items, run, dtype);
      store(train_cache, laid, reference_sums(laid));
    });
    if (eval_data)
      for_each_chunk(*eval_data, items_per_step, [&](std::vector<LoaderItem> items) {
        const LaidOutPairs laid = lay_out(*backend, items, run, dtype);
        store(eval_cache, laid, reference_sums(laid));
      });
    if (main_rank)
      std::fprintf(stderr, "reference log-probabilities of every pair precomputed from %s in %.1f s\n", reference_name,
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    reference_model.reset();  // no longer needed: training reads the cache
  } else if (main_rank) {
    std::fprintf(stderr, "reference: %s, computed every step\n", reference_name);
  }
  auto reference_source = [&](const PairTable& cache, const LaidOutPairs& laid, std::vector<double>& cached) {
    if (precompute) {
      cached = lookup(cache, laid);
      return ReferenceSource::cached(cached);
    }
    if (reference_model) return ReferenceSource::separate(*reference_model->decoder);
    return ReferenceSource::adapter_disabled();
  };

  // The preference loss over every pair of the eval data, without gradients.
  auto evaluate_pairs = [&]() {
    PreferenceSums totals;
    int64_t targets = 0;
    for_each_chunk(*eval_data, items_per_step, [&](std::vector<LoaderItem> items) {
      const LaidOutPairs laid = lay_out(*backend, items, run, dtype);
      std::vector<double> cached;
      PreferenceStepOptions step_options;
      step_options.loss = loss;
      step_options.num_pairs = laid.num_pairs();
      step_options.sequence_group = world;
      step_options.backward = false;
      const PreferenceStepResult r = preference_step(*backend, decoder, weights, laid.batches,
                                                     reference_source(eval_cache, laid, cached), step_options);
      const auto add = sum_preference_pairs(r.pairs, loss).to_array();
      auto sum = totals.to_array();
      for (size_t i = 0; i < sum.size(); ++i) sum[i] += add[i];
      totals = PreferenceSums::from_array(sum);
      targets += laid.targets;
    });
    return std::make_pair(preference_metrics(totals, loss), targets);
  };

  const RunSchedule plan = plan_schedule(config, loader.rows_per_epoch(), items_per_step);
  const int64_t total_steps = plan.total_steps;
  int64_t step = resume.step();
  restore_run_state(resume, loader, state);
  if (main_rank && !resume.empty())
    std::fprintf(stderr, "resuming from %s at step %lld\n", resume.dir.string().c_str(), static_cast<long long>(step));
  note_thread_change(resume, *backend, cpu_threads, main_rank);
  RunReporter reporter(config, main_rank, total_steps, resume);
  for (const fs::path& file : reporter.created_files()) run_start.claim.created(file);
  RunCheckpointer checkpointer{config, *backend, weights, state, fingerprint, run_start.identity, cpu_threads, main_rank};

  TrainSummary summary;
  summary.output = config.output;
  run_start.claim.keep();  // training starts: what the run wrote stays
  StepBoundary boundary(config, *backend, run, checkpointer, reporter);
  try {
    while (step < total_steps) {
      const auto step_start = std::chrono::steady_clock::now();
      // Every rank draws the same items; lay_out gives each its rows and shards.
      std::vector<LoaderItem> items;
      for (int64_t i = 0; i < items_per_step; ++i) items.push_back(loader.next_item());
      const LaidOutPairs laid = lay_out(*backend, items, run, dtype);
      std::vector<double> cached;
      PreferenceStepOptions step_options;
      step_options.loss = loss;
      step_options.num_pairs = laid.num_pairs();
      // Pairs are numbered over the whole step and each rank holds disjoint parts of their tokens:
      // one all-reduce over the world completes every response's sums (no separate pair group).
      step_options.sequence_group = world;
      state.zero_grads();
      const PreferenceStepResult result = preference_step(*backend, decoder, weights, laid.batches,
                                                          reference_source(train_cache, laid, cached), step_options);
      if (world && state.all_reduce_gradients())  // replicated weights: sum the ranks' shares
        for (Parameter& p : weights.parameters())
          if (p.trainable) world->all_reduce_sum(backend->default_stream(), p.grad);
      const double lr = learning_rate(plan.lr, step);
      const double grad_norm = optimizer.step(lr);
      ++step;

      const PreferenceMetrics& pm = result.metrics;
      StepMetrics m;
      m.step = step;
      m.loss = pm.loss;
      m.grad_norm = grad_norm;
      m.lr = lr;
      m.num_items = laid.targets;
      m.tokens = laid.tokens;
      m.preference = StepMetrics::Preference{pm.rewards_chosen, pm.rewards_rejected, pm.margins,  pm.accuracy,
                                             pm.logps_chosen,   pm.logps_rejected,   pm.nll_loss, pm.pairs};
      m.step_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count();
      m.tokens_per_s = m.step_seconds > 0 ? static_cast<double>(m.tokens) / m.step_seconds : 0;
      m.peak_memory_bytes = backend->memory_stats().peak_allocated_bytes;  // live tensors: the GPU pool on CUDA, tensor bytes on the CPU
      m.elapsed_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      m.epoch = loader.epochs_done();
      if (config.eval_steps > 0 && (step % config.eval_steps == 0 || step == total_steps) && eval_data) {
        const auto [eval, eval_targets] = evaluate_pairs();
        m.eval_loss = eval.loss;
        m.eval_num_items = eval_targets;
        m.eval_accuracy = eval.accuracy;
      }
      reporter.record(m);
      summary.final_loss = m.loss;
      summary.steps = step;
      if (boundary.after_step(step, total_steps, loader.state(), summary)) return summary;
    }
  } catch (...) {
    reporter.finish_failed(config, total_steps);  // the steps logged so far: their plot and summary
    throw;
  }
  summary.steps = step;

  const fs::path final_dir = export_trained(config, *backend, weights, state, source_dtype, main_rank);
  reporter.finish(config, total_steps, final_dir);
  return summary;
}

}  // namespace spindle
