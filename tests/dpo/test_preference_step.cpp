// One DPO step on a tiny random model (2 layers, hidden 16, vocab 32, LoRA rank 2), in F64:
//  - fresh adapters (B = 0) against the adapter-disabled reference: loss exactly ln 2;
//  - loss, metrics and per-response sums against an independent computation from full logits;
//  - gradients against central finite differences (sigmoid, label smoothing, IPO, RPO);
//  - packing layouts (one row, one document per micro-batch, mixed) give the same loss and grads;
//  - the three reference sources agree; bad inputs fail with a message;
//  - disabling the adapters also turns off LoRA on a MoE model's routed experts.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include <fmt/format.h>

#include "dpo/dpo_test_model.h"

using namespace spindle;
using namespace spindle::test;
using namespace spindle::dpo_test;

namespace {

constexpr int64_t kPairs = 3;

// Mixed layout: pair 0's chosen shares a row with pair 2's rejected and chosen; pair 0's rejected
// is in the third micro-batch, pair 1 in the second: pairs straddle rows and micro-batches.
const std::vector<std::vector<int64_t>> kMixed = {{0, 5, 2}, {3, 4}, {1}};

std::vector<PreferenceLossOptions> variants() {
  std::vector<PreferenceLossOptions> v(4);
  v[0].beta = 0.5;  // sigmoid
  v[1].beta = 0.8;
  v[1].label_smoothing = 0.15;
  v[2].type = PreferenceLossType::kIpo;
  v[2].beta = 0.3;
  v[3].beta = 0.4;
  v[3].rpo_alpha = 0.7;
  return v;
}

const char* variant_name(size_t i) {
  static const char* names[] = {"sigmoid", "label smoothing", "ipo", "rpo"};
  return names[i];
}

std::vector<std::vector<double>> gradients(Backend& be, ModelWeights& w) {
  std::vector<std::vector<double>> g;
  for (Parameter& p : w.parameters())
    if (p.trainable) g.push_back(to_host(be, p.grad));
  return g;
}

PreferenceStepResult run(Backend& be, Decoder& decoder, ModelWeights& w, const std::vector<PreferenceBatch>& batches,
                         const PreferenceLossOptions& loss, bool backward,
                         const ReferenceSource& reference = ReferenceSource::adapter_disabled()) {
  PreferenceStepOptions options;
  options.loss = loss;
  options.num_pairs = kPairs;
  options.backward = backward;
  if (backward) w.zero_grads(be);
  return preference_step(be, decoder, w, batches, reference, options);
}

// Σ log p over a document's supervised targets, from the model's full logits of that document
// alone (no packing, no token CE path), log-softmax in double here.
double document_log_prob(Backend& be, Decoder& decoder, const Document& doc) {
  PackOptions options;
  options.max_length = 64;
  PackStats stats;
  RowPlan plan{{{0, 0, static_cast<int64_t>(doc.input_ids.size())}}, static_cast<int64_t>(doc.input_ids.size())};
  PackedRow row = build_row(plan, [&](int64_t) { return view_of(doc); }, options, stats);
  MicroBatch batch = make_micro_batch(be, {row}, DType::F64);
  const int64_t t = batch.num_tokens, v = tiny_config().vocab_size;
  std::vector<double> index(t);
  for (int64_t i = 0; i < t; ++i) index[i] = static_cast<double>(i);
  Tensor rows = be.empty(Shape{t}, DType::I32);
  from_host(be, index, rows);
  Tensor logits = be.empty(Shape{t, v}, DType::F64);
  decoder.logits(batch, rows, logits);
  const std::vector<double> l = to_host(be, logits);
  double sum = 0;
  for (size_t i = 0; i + 1 < doc.input_ids.size(); ++i) {
    const int32_t target = doc.labels[i + 1];
    if (target == kIgnoreIndex) continue;
    double mx = -INFINITY, z = 0;
    for (int64_t j = 0; j < v; ++j) mx = std::max(mx, l[i * v + j]);
    for (int64_t j = 0; j < v; ++j) z += std::exp(l[i * v + j] - mx);
    sum += l[i * v + target] - mx - std::log(z);
  }
  return sum;
}

int64_t document_targets(const Document& doc) {
  int64_t n = 0;
  for (size_t i = 1; i < doc.labels.size(); ++i) n += doc.labels[i] != kIgnoreIndex;
  return n;
}

}  // namespace

TEST(PreferenceStep, FreshAdaptersGiveExactlyLn2) {
  for (DType dtype : {DType::F64, DType::F32}) {
    auto be = make_cpu_backend(1);
    ModelWeights w = base_model(*be, dtype);
    add_adapters(*be, w, /*fresh=*/true);
    Decoder decoder(*be, w);
    const auto docs = pair_documents();
    const auto batches = layout(*be, docs, kMixed, true, dtype);
    const PreferenceStepResult r = run(*be, decoder, w, batches, PreferenceLossOptions{}, true);
    // B = 0 adds exactly 0 to every projection: the sums are bit-identical, each pair's loss is
    // exactly ln 2, and their mean within rounding of the division by P.
    for (const PairLogProbs& p : r.pairs) {
      EXPECT_EQ(p.chosen.policy, p.chosen.reference);
      EXPECT_EQ(p.rejected.policy, p.rejected.reference);
      EXPECT_EQ(pair_preference_loss(p, PreferenceLossOptions{}).loss, std::log(2.0));
    }
    EXPECT_DOUBLE_EQ(r.metrics.loss, std::log(2.0)) << dtype_name(dtype);
    EXPECT_EQ(r.metrics.accuracy, 0.0);
    EXPECT_EQ(r.metrics.margins, 0.0);
    EXPECT_EQ(r.metrics.rewards_chosen, 0.0);
    EXPECT_EQ(r.metrics.rewards_rejected, 0.0);
    // The first step still moves B (A's gradient is B-weighted, so exactly 0).
    double b_norm = 0, a_norm = 0;
    for (Parameter& p : w.parameters()) {
      if (!p.trainable) continue;
      double& norm = p.name.find("lora_B") != std::string::npos ? b_norm : a_norm;
      for (double g : to_host(*be, p.grad)) norm += g * g;
    }
    EXPECT_GT(b_norm, 1e-8);
    EXPECT_EQ(a_norm, 0.0);
  }
}

TEST(PreferenceStep, MatchesAnIndependentComputationFromLogits) {
  auto be = make_cpu_backend(1);
  ModelWeights w = base_model(*be, DType::F64);
  add_adapters(*be, w, false);
  Decoder decoder(*be, w);
  ModelWeights base = base_model(*be, DType::F64);  // same seed: the policy's base weights, no adapters
  Decoder reference(*be, base);
  const auto docs = pair_documents();
  std::vector<double> policy(docs.size()), ref(docs.size());
  for (size_t k = 0; k < docs.size(); ++k) {
    policy[k] = document_log_prob(*be, decoder, docs[k]);
    ref[k] = document_log_prob(*be, reference, docs[k]);
  }
  const auto batches = layout(*be, docs, kMixed, true, DType::F64);
  const auto all = variants();
  for (size_t v = 0; v < all.size(); ++v) {
    const PreferenceLossOptions& o = all[v];
    const PreferenceStepResult r = run(*be, decoder, w, batches, o, false);
    double sum = 0, nll = 0, tokens = 0, rc_sum = 0, rr_sum = 0, correct = 0;
    for (int64_t p = 0; p < kPairs; ++p) {
      EXPECT_NEAR(r.pairs[p].chosen.policy, policy[2 * p], 1e-12);
      EXPECT_NEAR(r.pairs[p].rejected.policy, policy[2 * p + 1], 1e-12);
      EXPECT_NEAR(r.pairs[p].chosen.reference, ref[2 * p], 1e-12);
      EXPECT_NEAR(r.pairs[p].rejected.reference, ref[2 * p + 1], 1e-12);
      EXPECT_EQ(r.pairs[p].chosen.tokens, document_targets(docs[2 * p]));
      const double rc = policy[2 * p] - ref[2 * p], rr = policy[2 * p + 1] - ref[2 * p + 1];
      const double nc = document_targets(docs[2 * p]), nr = document_targets(docs[2 * p + 1]);
      if (o.type == PreferenceLossType::kIpo) {
        const double h = rc / nc - rr / nr - 1 / (2 * o.beta);
        sum += h * h;
      } else {
        sum += -(1 - o.label_smoothing) * std::log(1 / (1 + std::exp(-o.beta * (rc - rr)))) -
               o.label_smoothing * std::log(1 / (1 + std::exp(o.beta * (rc - rr))));
      }
      nll -= policy[2 * p];
      tokens += nc;
      rc_sum += o.beta * rc;
      rr_sum += o.beta * rr;
      correct += rc > rr;
    }
    const double expected = sum / kPairs + o.rpo_alpha * nll / tokens;
    EXPECT_NEAR(r.metrics.loss, expected, 1e-12) << variant_name(v);
    EXPECT_NEAR(r.metrics.rewards_chosen, rc_sum / kPairs, 1e-12);
    EXPECT_NEAR(r.metrics.rewards_rejected, rr_sum / kPairs, 1e-12);
    EXPECT_NEAR(r.metrics.margins, (rc_sum - rr_sum) / kPairs, 1e-12);
    EXPECT_DOUBLE_EQ(r.metrics.accuracy, correct / kPairs);
    EXPECT_NEAR(r.metrics.nll_loss, nll / tokens, 1e-12);
    EXPECT_GT(std::fabs(r.metrics.margins), 1e-3);  // the adapters really move the policy
  }
}

TEST(PreferenceStep, GradientsMatchFiniteDifferences) {
  auto be = make_cpu_backend(1);
  ModelWeights w = base_model(*be, DType::F64);
  add_adapters(*be, w, false);
  Decoder decoder(*be, w);
  const auto docs = pair_documents();
  const auto batches = layout(*be, docs, kMixed, true, DType::F64);
  const auto all = variants();
  std::mt19937_64 rng(17);
  for (size_t v = 0; v < all.size(); ++v) {
    run(*be, decoder, w, batches, all[v], true);
    auto objective = [&] { return run(*be, decoder, w, batches, all[v], false).metrics.loss; };
    double worst = 0, largest = 0;
    for (Parameter& p : w.parameters()) {
      if (!p.trainable) continue;
      std::vector<double> values = to_host(*be, p.value), grad = to_host(*be, p.grad);
      for (int probe = 0; probe < 2; ++probe) {
        const size_t i = rng() % values.size();
        const double h = 1e-5, keep = values[i];
        values[i] = keep + h;
        from_host(*be, values, p.value);
        const double up = objective();
        values[i] = keep - h;
        from_host(*be, values, p.value);
        const double down = objective();
        values[i] = keep;
        from_host(*be, values, p.value);
        const double numeric = (up - down) / (2 * h);
        EXPECT_NEAR(grad[i], numeric, 1e-8 + 1e-6 * std::fabs(numeric)) << variant_name(v) << " " << p.name << "[" << i << "]";
        worst = std::max(worst, std::fabs(grad[i] - numeric));
        largest = std::max(largest, std::fabs(numeric));
      }
    }
    RecordProperty(std::string("max_abs_error_") + variant_name(v), fmt::format("{:.3g} (largest |grad| {:.3g})", worst, largest));
  }
}

TEST(PreferenceStep, PackingLayoutsGiveTheSameLossAndGradients) {
  auto be = make_cpu_backend(1);
  ModelWeights w = base_model(*be, DType::F64);
  add_adapters(*be, w, false);
  Decoder decoder(*be, w);
  const auto docs = pair_documents();
  const auto one_row = layout(*be, docs, {{0, 1, 2, 3, 4, 5}}, true, DType::F64);
  // Each response its own micro-batch, rejected before chosen.
  const auto separate = layout(*be, docs, {{5}, {3}, {1}, {4}, {2}, {0}}, false, DType::F64);
  const auto mixed = layout(*be, docs, kMixed, true, DType::F64);
  for (const PreferenceLossOptions& o : variants()) {
    const double loss = run(*be, decoder, w, one_row, o, true).metrics.loss;
    const auto expected = gradients(*be, w);
    for (const auto* other : {&separate, &mixed}) {
      EXPECT_NEAR(run(*be, decoder, w, *other, o, true).metrics.loss, loss, 1e-13);
      const auto got = gradients(*be, w);
      for (size_t t = 0; t < got.size(); ++t)
        for (size_t i = 0; i < got[t].size(); ++i)
          ASSERT_NEAR(got[t][i], expected[t][i], 1e-12 + 1e-10 * std::fabs(expected[t][i])) << "tensor " << t;
    }
  }
}

TEST(PreferenceStep, ReferenceSourcesAgree) {
  auto be = make_cpu_backend(1);
  ModelWeights w = base_model(*be, DType::F64);
  add_adapters(*be, w, false);
  Decoder decoder(*be, w);
  ModelWeights base = base_model(*be, DType::F64);
  Decoder reference(*be, base);
  const auto docs = pair_documents();
  const auto batches = layout(*be, docs, kMixed, true, DType::F64);
  // The cache is computed once, over a different layout than the step's.
  const auto cache_batches = layout(*be, docs, {{0, 1, 2, 3, 4, 5}}, true, DType::F64);
  const SequenceSums cache = sequence_log_probs(*be, reference, cache_batches, kPairs);
  const PreferenceLossOptions o = variants()[1];
  const double disabled = run(*be, decoder, w, batches, o, true).metrics.loss;
  const auto g_disabled = gradients(*be, w);
  const double separate = run(*be, decoder, w, batches, o, true, ReferenceSource::separate(reference)).metrics.loss;
  const auto g_separate = gradients(*be, w);
  const double cached = run(*be, decoder, w, batches, o, true, ReferenceSource::cached(cache.log_prob)).metrics.loss;
  const auto g_cached = gradients(*be, w);
  EXPECT_NEAR(separate, disabled, 1e-13);
  EXPECT_NEAR(cached, disabled, 1e-13);
  for (size_t t = 0; t < g_disabled.size(); ++t)
    for (size_t i = 0; i < g_disabled[t].size(); ++i) {
      ASSERT_NEAR(g_separate[t][i], g_disabled[t][i], 1e-13);
      ASSERT_NEAR(g_cached[t][i], g_disabled[t][i], 1e-12);
    }
  // The adapter-disabled pass left the adapters on.
  for (DecoderLayer& layer : w.layers) EXPECT_EQ(layer.linear("q_proj")->lora_scaling, 2.0);
}

TEST(PreferenceStep, LoraDisabledRestoresScalingsOnException) {
  auto be = make_cpu_backend(1);
  ModelWeights w = base_model(*be, DType::F64);
  add_adapters(*be, w, false);
  try {
    LoraDisabled off(w);
    EXPECT_EQ(w.layers[1].linear("down_proj")->lora_scaling, 0.0);
    throw Error("interrupted");
  } catch (const Error&) {
  }
  EXPECT_EQ(w.layers[1].linear("down_proj")->lora_scaling, 2.0);
  ModelWeights full = base_model(*be, DType::F64);
  try {
    LoraDisabled off(full);
    ADD_FAILURE() << "no adapters, no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("reference model"), std::string::npos) << e.what();
  }
}

TEST(PreferenceStep, LoraDisabledTurnsOffTheRoutedExpertsAdaptersToo) {
  // A MoE model adapted on its routed experts' fused tensors only (PEFT's target_parameters): with
  // the adapters disabled it computes the base model's loss, and afterwards its own again.
  auto be = make_cpu_backend(1);
  const ModelConfig config = test::tiny_qwen3_moe().config();
  ModelWeights base = test::random_weights(*be, config, DType::F64, 3, 10.0);
  ModelWeights adapted = test::random_weights(*be, config, DType::F64, 3, 10.0);
  LoraConfig lora;
  lora.rank = 2;
  lora.alpha = 4;
  lora.targets = {"experts"};
  test::add_lora_with_random_b(*be, adapted, lora, 4, test::uniform_draw(1.0));
  PackedRow row;
  row.input_ids = {3, 7, 1, 9, 4, 2, 8, 5};
  row.positions = {0, 1, 2, 3, 4, 5, 6, 7};
  row.doc_ids.assign(8, 0);
  row.targets = {7, 1, 9, 4, 2, 8, 5, kIgnoreIndex};
  row.weights = {1, 1, 1, 1, 1, 1, 1, 0};
  auto loss_of = [&](ModelWeights& w) {
    Decoder decoder(*be, w);
    Tensor loss = be->zeros(Shape{1}, DType::F64);
    decoder.step(make_micro_batch(*be, {row}, DType::F64), 1.0, loss, false);
    return to_host(*be, loss)[0];
  };
  const double with_adapters = loss_of(adapted), without = loss_of(base);
  EXPECT_GT(std::fabs(with_adapters - without), 1e-6) << "the adapters must change the loss for the test to mean anything";
  {
    LoraDisabled off(adapted);
    EXPECT_EQ(loss_of(adapted), without);
  }
  EXPECT_EQ(loss_of(adapted), with_adapters);
}

TEST(PreferenceStep, BadInputsFailWithAMessage) {
  auto be = make_cpu_backend(1);
  ModelWeights w = base_model(*be, DType::F64);
  add_adapters(*be, w, false);
  Decoder decoder(*be, w);
  const auto docs = pair_documents();
  auto message = [&](const std::vector<PreferenceBatch>& batches, const ReferenceSource& ref) {
    try {
      run(*be, decoder, w, batches, PreferenceLossOptions{}, false, ref);
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  // Pair 2's rejected response is missing from the step.
  EXPECT_NE(message(layout(*be, docs, {{0, 1, 2, 3, 4}}, true, DType::F64), ReferenceSource::adapter_disabled())
                .find("pair 2 of the step has no supervised target in its rejected response"),
            std::string::npos);
  const std::vector<double> short_cache(4, 0.0);
  EXPECT_NE(message(layout(*be, docs, kMixed, true, DType::F64), ReferenceSource::cached(short_cache))
                .find("reference cache holds 4"),
            std::string::npos);
}

// A MoE model trained with the router load-balancing loss: the step's gradient is that of
// L_preference + coefficient·aux, aux over every real token of the step's micro-batches (the policy's
// forward pass collects its statistics), against central finite differences of that sum in F64.
TEST(PreferenceStep, RouterLossGradientsMatchFiniteDifferences) {
  auto be = make_cpu_backend(1);
  test::TinyModel tiny = test::tiny_qwen3_moe();
  tiny.vocab_size = 32;
  const ModelConfig config = tiny.config();
  ModelWeights w = test::random_weights(*be, config, DType::F64, 3, 10.0);
  add_lora_with_random_b(*be, w, lora_on_every_projection(2, 4), 5, uniform_draw(0.6));
  constexpr double kCoefficient = 0.3;
  RouterAuxLoss aux(*be, config, DType::F64, kCoefficient);
  Decoder decoder(*be, w);
  decoder.set_router_aux_loss(&aux);
  const auto docs = pair_documents();
  const auto batches = layout(*be, docs, kMixed, true, DType::F64);
  int64_t tokens = 0;  // the real tokens of every micro-batch
  for (const PreferenceBatch& pb : batches) {
    std::vector<int32_t> doc(static_cast<size_t>(pb.batch.num_tokens));
    be->copy_to_host(be->default_stream(), pb.batch.doc_ids, doc.data());
    for (int32_t d : doc) tokens += d >= 0;
  }
  PreferenceStepOptions options;
  options.loss = variants()[0];
  options.num_pairs = kPairs;
  options.router_aux = &aux;
  options.step_tokens = tokens;
  w.zero_grads(*be);
  const PreferenceStepResult trained = preference_step(*be, decoder, w, batches, ReferenceSource::adapter_disabled(), options);
  ASSERT_TRUE(trained.aux_loss.has_value());
  EXPECT_GT(*trained.aux_loss, 0.0);
  // L + c·aux without gradients: the aux statistics from a forward of every micro-batch.
  auto objective = [&] {
    PreferenceStepOptions forward = options;
    forward.backward = false;
    const double loss = preference_step(*be, decoder, w, batches, ReferenceSource::adapter_disabled(), forward).metrics.loss;
    aux.begin_step(tokens, nullptr);
    Tensor discard = be->zeros(Shape{1}, DType::F64);
    for (const PreferenceBatch& pb : batches) decoder.step(pb.batch, 1.0, discard, false);
    aux.finish_statistics();
    const double value = aux.value();
    aux.end_step();
    return loss + kCoefficient * value;
  };
  EXPECT_NEAR(objective(), trained.metrics.loss + kCoefficient * *trained.aux_loss, 1e-12);
  std::mt19937_64 rng(23);
  int probes = 0;
  for (Parameter& p : w.parameters()) {
    if (!p.trainable) continue;
    std::vector<double> values = to_host(*be, p.value), grad = to_host(*be, p.grad);
    for (int probe = 0; probe < 2; ++probe) {
      const size_t i = rng() % values.size();
      const double h = 1e-6, keep = values[i];
      values[i] = keep + h;
      from_host(*be, values, p.value);
      const double up = objective();
      values[i] = keep - h;
      from_host(*be, values, p.value);
      const double down = objective();
      values[i] = keep;
      from_host(*be, values, p.value);
      const double numeric = (up - down) / (2 * h);
      EXPECT_NEAR(grad[i], numeric, 1e-8 + 1e-6 * std::fabs(numeric)) << p.name << "[" << i << "]";
      ++probes;
    }
  }
  EXPECT_GT(probes, 20);
  // The router loss moves the gradient: without it the step's gradient differs.
  const auto with_aux = gradients(*be, w);
  PreferenceStepOptions plain = options;
  plain.router_aux = nullptr;
  decoder.set_router_aux_loss(nullptr);
  w.zero_grads(*be);
  const PreferenceStepResult without = preference_step(*be, decoder, w, batches, ReferenceSource::adapter_disabled(), plain);
  EXPECT_FALSE(without.aux_loss.has_value());
  EXPECT_EQ(without.metrics.loss, trained.metrics.loss);
  double moved = 0;
  const auto no_aux = gradients(*be, w);
  for (size_t t = 0; t < no_aux.size(); ++t)
    for (size_t i = 0; i < no_aux[t].size(); ++i) moved = std::max(moved, std::fabs(no_aux[t][i] - with_aux[t][i]));
  EXPECT_GT(moved, 1e-8);
}
