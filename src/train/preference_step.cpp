#include "train/preference_step.h"

#include <algorithm>
#include <functional>

#include "core/error.h"

namespace spindle {

namespace {

// Every Linear of the model, in layer and projection order (the order LoraDisabled saves).
template <typename F>
void for_each_linear(ModelWeights& weights, F&& f) {
  for (Linear* lin : weights.linears()) f(*lin);
}

// Host doubles ← stat-dtype tensor (F32 or F64).
std::vector<double> download_stat(Backend& backend, const Tensor& t) {
  std::vector<double> out(static_cast<size_t>(t.numel()));
  if (out.empty()) return out;
  if (t.dtype() == DType::F64) {
    backend.copy_to_host(backend.default_stream(), t, out.data());
  } else {
    SPINDLE_CHECK(t.dtype() == DType::F32, "statistics tensor {}", t.describe());
    std::vector<float> f(out.size());
    backend.copy_to_host(backend.default_stream(), t, f.data());
    std::copy(f.begin(), f.end(), out.begin());
  }
  return out;
}

Tensor upload_stat(Backend& backend, const std::vector<double>& values, DType dtype) {
  Tensor t = backend.empty(Shape{static_cast<int64_t>(values.size())}, dtype);
  if (values.empty()) return t;
  if (dtype == DType::F64) {
    backend.copy_from_host(backend.default_stream(), values.data(), t);
  } else {
    std::vector<float> f(values.begin(), values.end());
    backend.copy_from_host(backend.default_stream(), f.data(), t);
  }
  return t;
}

// values ← Σ_ranks values over `group` (a no-op without one), staged through a device F64 tensor
// because NCCL reduces device memory; the sum is in rank order, identical on every rank.
void all_reduce(Backend& backend, comm::Communicator* group, std::vector<double>& values) {
  if (!group || group->size() == 1 || values.empty()) return;
  Tensor staged = upload_stat(backend, values, DType::F64);
  group->all_reduce_sum(backend.default_stream(), staged);
  backend.copy_to_host(backend.default_stream(), staged, values.data());
}

void check_batches(std::span<const PreferenceBatch> batches, int64_t num_pairs) {
  for (size_t b = 0; b < batches.size(); ++b) {
    const PreferenceBatch& pb = batches[b];
    SPINDLE_CHECK(static_cast<int64_t>(pb.selected_sequence.size()) == pb.batch.num_selected,
                  "micro-batch {}: {} sequence ids for {} selected targets", b, pb.selected_sequence.size(),
                  pb.batch.num_selected);
    SPINDLE_CHECK(pb.selected_prompt.empty() || pb.selected_prompt.size() == pb.selected_sequence.size(),
                  "micro-batch {}: {} prompt flags for {} selected targets", b, pb.selected_prompt.size(),
                  pb.selected_sequence.size());
    for (int32_t s : pb.selected_sequence)
      if (s < 0 || s >= 2 * num_pairs)
        fail("micro-batch {} holds a target of preference sequence {}, outside the step's {} pairs (ids 0..{})", b,
             s, num_pairs, 2 * num_pairs - 1);
  }
}

bool is_prompt(const PreferenceBatch& pb, size_t j) { return !pb.selected_prompt.empty() && pb.selected_prompt[j]; }

// log_prob[s] += Σ log p over this rank's targets of response s (forward only); a chosen prompt's
// targets into prompt_log_prob[s] instead (null: the batches have none).
void accumulate_log_probs(Backend& backend, Decoder& model, std::span<const PreferenceBatch> batches,
                          std::vector<double>& log_prob, std::vector<double>* prompt_log_prob = nullptr) {
  const DType sd = stat_dtype(model.weights().dtype);
  Tensor loss = backend.zeros(Shape{1}, sd);  // Σ CE, unused: the sums below are per response
  for (const PreferenceBatch& pb : batches) {
    Tensor token_ce = backend.empty(Shape{pb.batch.num_selected}, sd);  // [num_selected]
    model.step(pb.batch, 1.0, loss, /*backward=*/false, &token_ce);
    const std::vector<double> ce = download_stat(backend, token_ce);
    for (size_t j = 0; j < ce.size(); ++j) {
      if (!is_prompt(pb, j)) log_prob[pb.selected_sequence[j]] -= ce[j];
      else if (prompt_log_prob) (*prompt_log_prob)[pb.selected_sequence[j]] -= ce[j];
    }
  }
}

// Targets per response (a chosen prompt's into prompt_tokens when given).
void count_tokens(std::span<const PreferenceBatch> batches, std::vector<double>& tokens,
                  std::vector<double>* prompt_tokens = nullptr) {
  for (const PreferenceBatch& pb : batches)
    for (size_t j = 0; j < pb.selected_sequence.size(); ++j) {
      if (!is_prompt(pb, j)) tokens[pb.selected_sequence[j]] += 1.0;
      else if (prompt_tokens) (*prompt_tokens)[pb.selected_sequence[j]] += 1.0;
    }
}

}  // namespace

std::vector<int32_t> selected_sequence_ids(Backend& backend, const MicroBatch& batch,
                                           std::span<const int32_t> token_sequence) {
  SPINDLE_CHECK(static_cast<int64_t>(token_sequence.size()) == batch.num_tokens,
                "{} sequence ids for a micro-batch of {} tokens", token_sequence.size(), batch.num_tokens);
  std::vector<int32_t> selected(static_cast<size_t>(batch.num_selected));
  if (!selected.empty()) backend.copy_to_host(backend.default_stream(), batch.selected, selected.data());
  std::vector<int32_t> ids(selected.size());
  for (size_t j = 0; j < selected.size(); ++j) {
    ids[j] = token_sequence[selected[j]];
    if (ids[j] < 0)
      fail("token {} of the micro-batch is a supervised target but belongs to no preference response", selected[j]);
  }
  return ids;
}

std::vector<uint8_t> supervise_chosen_prompts(PackedRow& row, const std::vector<int32_t>& doc_sequence) {
  std::vector<uint8_t> added(row.input_ids.size(), 0);
  for (size_t i = 0; i + 1 < row.input_ids.size(); ++i) {
    const int32_t doc = row.doc_ids[i];
    if (doc < 0 || row.doc_ids[i + 1] != doc || row.targets[i] != kIgnoreIndex) continue;
    if (doc >= static_cast<int32_t>(doc_sequence.size()) || doc_sequence[doc] % 2 != 0) continue;  // rejected
    row.targets[i] = row.input_ids[i + 1];
    row.weights[i] = 1.0f;
    added[i] = 1;
  }
  return added;
}

PreferenceBatch make_preference_batch(Backend& backend, const std::vector<PackedRow>& rows,
                                      const std::vector<std::vector<int32_t>>& row_sequences, DType model_dtype,
                                      const std::vector<std::vector<uint8_t>>* token_prompt) {
  if (row_sequences.size() != rows.size())
    fail("preference batch: {} rows but sequence ids for {}", rows.size(), row_sequences.size());
  if (token_prompt && token_prompt->size() != rows.size())
    fail("preference batch: {} rows but prompt flags for {}", rows.size(), token_prompt->size());
  std::vector<int32_t> token_sequence;  // [T] the response of each token of the concatenated rows
  std::vector<uint8_t> prompt_flags;    // [T] with token_prompt
  for (size_t r = 0; r < rows.size(); ++r) {
    if (token_prompt) {
      SPINDLE_CHECK((*token_prompt)[r].size() == rows[r].doc_ids.size(), "row {}: {} prompt flags for {} tokens", r,
                    (*token_prompt)[r].size(), rows[r].doc_ids.size());
      prompt_flags.insert(prompt_flags.end(), (*token_prompt)[r].begin(), (*token_prompt)[r].end());
    }
    for (int32_t doc : rows[r].doc_ids) {
      if (doc < 0) {
        token_sequence.push_back(-1);
        continue;
      }
      if (doc >= static_cast<int32_t>(row_sequences[r].size()))
        fail("preference batch: row {} has document {} but sequence ids for {} documents", r, doc,
             row_sequences[r].size());
      token_sequence.push_back(row_sequences[r][doc]);
    }
  }
  PreferenceBatch pb;
  pb.batch = make_micro_batch(backend, rows, model_dtype);
  pb.selected_sequence = selected_sequence_ids(backend, pb.batch, token_sequence);
  if (token_prompt) {
    std::vector<int32_t> selected(static_cast<size_t>(pb.batch.num_selected));
    if (!selected.empty()) backend.copy_to_host(backend.default_stream(), pb.batch.selected, selected.data());
    pb.selected_prompt.resize(selected.size());
    for (size_t j = 0; j < selected.size(); ++j) pb.selected_prompt[j] = prompt_flags[selected[j]];
  }
  return pb;
}

LoraDisabled::LoraDisabled(ModelWeights& weights) : weights_(weights) {
  bool any = false;
  for_each_linear(weights_, [&](Linear& lin) {
    saved_.push_back(lin.lora_scaling);
    any |= lin.lora_a != nullptr;
  });
  for (const ExpertLora* lora : weights_.expert_loras()) {  // the routed experts' fused tensors
    saved_.push_back(lora->scaling);
    any |= lora->adapted();
  }
  if (!any)
    fail("the reference 'policy with adapters disabled' needs LoRA adapters, and this model has none (full "
         "fine-tuning); use a separate reference model or precomputed reference log-probabilities");
  for_each_linear(weights_, [](Linear& lin) { lin.lora_scaling = 0.0; });
  for (ExpertLora* lora : weights_.expert_loras()) lora->scaling = 0.0;
}

LoraDisabled::~LoraDisabled() {
  size_t i = 0;
  for_each_linear(weights_, [&](Linear& lin) { lin.lora_scaling = saved_[i++]; });
  for (ExpertLora* lora : weights_.expert_loras()) lora->scaling = saved_[i++];
}

SequenceSums sequence_log_probs(Backend& backend, Decoder& model, std::span<const PreferenceBatch> batches,
                                int64_t num_pairs, comm::Communicator* group) {
  if (num_pairs <= 0) fail("a preference step needs at least one pair (got {})", num_pairs);
  check_batches(batches, num_pairs);
  const size_t n = static_cast<size_t>(2 * num_pairs);
  std::vector<double> both(2 * n, 0.0);  // [log_prob (2P), tokens (2P)]: one reduction
  std::vector<double> log_prob(n, 0.0), tokens(n, 0.0);
  accumulate_log_probs(backend, model, batches, log_prob);
  count_tokens(batches, tokens);
  std::copy(log_prob.begin(), log_prob.end(), both.begin());
  std::copy(tokens.begin(), tokens.end(), both.begin() + static_cast<std::ptrdiff_t>(n));
  all_reduce(backend, group, both);
  SequenceSums sums;
  sums.log_prob.assign(both.begin(), both.begin() + static_cast<std::ptrdiff_t>(n));
  sums.tokens.assign(both.begin() + static_cast<std::ptrdiff_t>(n), both.end());
  return sums;
}

PreferenceStepResult preference_step(Backend& backend, Decoder& policy, ModelWeights& policy_weights,
                                     std::span<const PreferenceBatch> batches, const ReferenceSource& reference,
                                     const PreferenceStepOptions& options) {
  options.loss.validate();
  const int64_t num_pairs = options.num_pairs;
  if (num_pairs <= 0) fail("a preference step needs at least one pair (got {})", num_pairs);
  SPINDLE_CHECK(&policy.weights() == &policy_weights, "preference_step: the policy Decoder computes with other weights");
  check_batches(batches, num_pairs);
  const size_t n = static_cast<size_t>(2 * num_pairs);

  // Local partial sums: [policy (2P), tokens (2P), reference (2P) when computed here, chosen
  // prompts' sums and targets (2P each) for orpo].
  const bool needs_reference = uses_reference(options.loss.type);
  const bool cached = reference.kind == ReferenceSource::Kind::kCache;
  const bool reference_pass = needs_reference && !cached;
  const bool prompts = options.loss.type == PreferenceLossType::kOrpo;
  std::vector<double> policy_sum(n, 0.0), tokens(n, 0.0), reference_sum(n, 0.0);
  std::vector<double> prompt_sum(prompts ? n : 0, 0.0), prompt_tokens(prompts ? n : 0, 0.0);
  if (needs_reference) switch (reference.kind) {
    case ReferenceSource::Kind::kAdapterDisabled: {
      LoraDisabled disabled(policy_weights);
      accumulate_log_probs(backend, policy, batches, reference_sum);
      break;
    }
    case ReferenceSource::Kind::kModel:
      SPINDLE_CHECK(reference.model != nullptr, "reference kind 'model' without a reference Decoder");
      accumulate_log_probs(backend, *reference.model, batches, reference_sum);
      break;
    case ReferenceSource::Kind::kCache:
      if (reference.cache.size() != n)
        fail("the reference cache holds {} log-probabilities but the step has {} pairs ({} responses); recompute "
             "the cache for this step's pairs",
             reference.cache.size(), num_pairs, n);
      break;
  }
  // The router loss's statistics: from the policy's forward over every micro-batch of the step.
  RouterAuxLoss* aux = options.backward ? options.router_aux : nullptr;
  if (aux) {
    std::function<void(Tensor&)> reduce;
    if ((options.sequence_group && options.sequence_group->size() > 1) ||
        (options.pair_group && options.pair_group->size() > 1))
      reduce = [&backend, &options](Tensor& t) {
        for (comm::Communicator* group : {options.sequence_group, options.pair_group})
          if (group && group->size() > 1) group->all_reduce_sum(backend.default_stream(), t);
      };
    aux->begin_step(options.step_tokens, std::move(reduce));
  }
  accumulate_log_probs(backend, policy, batches, policy_sum, prompts ? &prompt_sum : nullptr);
  if (aux) aux->finish_statistics();  // the same point on every rank: after the policy's forward pass
  count_tokens(batches, tokens, prompts ? &prompt_tokens : nullptr);

  std::vector<double> partial;  // one reduction over the sequence group
  partial.reserve(5 * n);
  partial.insert(partial.end(), policy_sum.begin(), policy_sum.end());
  partial.insert(partial.end(), tokens.begin(), tokens.end());
  if (reference_pass) partial.insert(partial.end(), reference_sum.begin(), reference_sum.end());
  const size_t prompt_at = partial.size();
  partial.insert(partial.end(), prompt_sum.begin(), prompt_sum.end());
  partial.insert(partial.end(), prompt_tokens.begin(), prompt_tokens.end());
  all_reduce(backend, options.sequence_group, partial);

  PreferenceStepResult result;
  result.pairs.resize(static_cast<size_t>(num_pairs));
  for (int64_t p = 0; p < num_pairs; ++p) {
    for (int side = 0; side < 2; ++side) {
      const size_t s = static_cast<size_t>(2 * p + side);
      SequenceLogProb& seq = side ? result.pairs[p].rejected : result.pairs[p].chosen;
      seq.policy = partial[s];
      seq.tokens = static_cast<int64_t>(partial[n + s]);
      seq.reference = !needs_reference ? 0.0 : cached ? reference.cache[s] : partial[2 * n + s];
      if (prompts) {
        seq.prompt_policy = partial[prompt_at + s];
        seq.prompt_tokens = static_cast<int64_t>(partial[prompt_at + n + s]);
      }
      if (seq.tokens == 0)
        fail("pair {} of the step has no supervised target in its {} response (the whole response was cut or "
             "masked); every pair needs both responses: raise --max-length or drop such pairs when preparing",
             p, side ? "rejected" : "chosen");
    }
  }

  PreferenceSums totals = sum_preference_pairs(result.pairs, options.loss);
  if (options.pair_group && options.pair_group->size() > 1) {
    const auto local = totals.to_array();
    std::vector<double> values(local.begin(), local.end());
    all_reduce(backend, options.pair_group, values);
    std::array<double, PreferenceSums::kCount> summed{};
    std::copy(values.begin(), values.end(), summed.begin());
    totals = PreferenceSums::from_array(summed);
  }
  result.metrics = preference_metrics(totals, options.loss);
  if (!options.backward) return result;

  // ∂L/∂π_s per response, then one backward with per-token weights −c_s (Σ w·CE = −Σ w·log p).
  std::vector<double> coefficient(n), prompt_coefficient(prompts ? n : 0, 0.0);
  for (int64_t p = 0; p < num_pairs; ++p) {
    const PairGradient g = preference_gradient(result.pairs[p], options.loss, totals);
    coefficient[2 * p] = g.d_chosen;
    coefficient[2 * p + 1] = g.d_rejected;
    if (prompts) prompt_coefficient[2 * p] = g.d_prompt;
  }
  const DType sd = stat_dtype(policy_weights.dtype);
  Tensor surrogate = backend.zeros(Shape{1}, sd);  // Σ −c·CE: not the loss, only its gradient matters
  for (const PreferenceBatch& pb : batches) {
    std::vector<double> weights(pb.selected_sequence.size());  // [num_selected]
    for (size_t j = 0; j < weights.size(); ++j)
      weights[j] = -(is_prompt(pb, j) ? prompt_coefficient : coefficient)[pb.selected_sequence[j]];
    MicroBatch weighted = pb.batch;
    weighted.weights = upload_stat(backend, weights, sd);
    policy.step(weighted, 1.0, surrogate, /*backward=*/true);
  }
  if (aux) {
    result.aux_loss = aux->value();
    aux->end_step();
  }
  return result;
}

}  // namespace spindle
