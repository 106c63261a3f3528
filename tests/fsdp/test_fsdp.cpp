// FSDP on real CPU processes (Gloo) against the single-process run of the same global batch:
// each rank steps its own rows with loss_scale 1/N_global; the reduce-scattered gradient shards,
// gathered, must equal the one-process gradients of all rows, and three sharded AdamW steps (global
// clip) must land on the one-process parameters. Every rank computes the reference itself.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <random>

#include "backend/op_test_util.h"
#include "comm/cpu_communicator.h"
#include "comm/multiprocess.h"
#include "core/error.h"
#include "model/decoder.h"
#include "parallel/fsdp.h"
#include "support/tiny_model.h"
#include "train/optimizer.h"

namespace spindle::parallel {
namespace {

using spindle::testing::expect_all_succeeded;
using spindle::testing::require;
using spindle::testing::run_ranks;
using test::to_host;

ModelConfig tiny_gqa(bool tied) { return test::TinyModel{.tie_word_embeddings = tied}.config(); }

// Sizes no world divides: vocab 61, MLP 45, LoRA rank 3, q/k/v biases (qwen2) of 32 and 16.
ModelConfig odd_sizes() { return test::TinyModel{.model_type = "qwen2", .vocab_size = 61, .intermediate_size = 45}.config(); }

LoraConfig lora(int64_t rank) { return test::lora_on_every_projection(rank, 2.0 * static_cast<double>(rank)); }

// A row of `length` tokens: two documents (the first with a 2-token unsupervised prompt), weights
// 1 or 1.5 (loss_scale); `supervised` false leaves every target ignored.
PackedRow random_row(std::mt19937_64& rng, int64_t length, int64_t vocab, bool supervised = true) {
  PackedRow r;
  if (length == 0) return r;
  const int64_t split = std::max<int64_t>(1, length / 2 + static_cast<int64_t>(rng() % 3) - 1);
  for (int64_t i = 0; i < length; ++i) {
    const bool first = i < split;
    r.input_ids.push_back(static_cast<int32_t>(rng() % vocab));
    r.positions.push_back(static_cast<int32_t>(first ? i : i - split));
    r.doc_ids.push_back(first ? 0 : 1);
  }
  for (int64_t i = 0; i < length; ++i) {
    const bool last_of_doc = i + 1 == length || r.doc_ids[i + 1] != r.doc_ids[i];
    const bool prompt = r.doc_ids[i] == 0 && r.positions[i] < 2;
    if (!supervised || last_of_doc || prompt) {
      r.targets.push_back(kIgnoreIndex);
      r.weights.push_back(0.0f);
    } else {
      r.targets.push_back(r.input_ids[i + 1]);
      r.weights.push_back(rng() % 3 == 0 ? 1.5f : 1.0f);
    }
  }
  return r;
}

// Two micro-batches per rank; rank 0's second holds no supervised target and the last rank's
// second no token at all: both must still take part in every collective.
std::vector<std::vector<PackedRow>> rows_per_rank(int world, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<PackedRow>> out(world);
  for (int r = 0; r < world; ++r) {
    out[r].push_back(random_row(rng, 9 + static_cast<int64_t>(rng() % 6), vocab));
    if (r == 0) out[r].push_back(random_row(rng, 7, vocab, false));
    else if (r == world - 1) out[r].push_back(random_row(rng, 0, vocab));
    else out[r].push_back(random_row(rng, 8 + static_cast<int64_t>(rng() % 6), vocab));
  }
  return out;
}

double norm(const std::vector<double>& a) {
  double s = 0;
  for (double x : a) s += x * x;
  return std::sqrt(s);
}

// ‖a − b‖ / ‖b‖ (0 when both are zero).
double relative_error(const std::vector<double>& a, const std::vector<double>& b) {
  double d = 0;
  for (size_t i = 0; i < a.size(); ++i) d += (a[i] - b[i]) * (a[i] - b[i]);
  const double nb = norm(b);
  return nb == 0 ? std::sqrt(d) : std::sqrt(d) / nb;
}

ModelWeights make_weights(Backend& be, const ModelConfig& c, bool use_lora, int64_t lora_rank = 4) {
  ModelWeights w = ModelWeights::random(be, c, DType::F32, 1234);
  if (use_lora) w.add_lora(be, lora(lora_rank), 99);
  else w.train_all(be);
  return w;
}

std::vector<OptimizerSlot> shard_slots(const Fsdp& fsdp) {
  std::vector<OptimizerSlot> slots;
  for (const ParameterShard& s : fsdp.trainable_shards()) slots.push_back({s.name, s.value, s.grad});
  return slots;
}

void require_not_materialised(const ModelWeights& w, const char* when) {
  for (const Parameter& p : w.parameters())
    require(!p.value.defined() && !p.grad.defined(), "{}: {} is materialised outside a window", when, p.name);
}

struct Case {
  int world;
  bool tied, lora, recompute;
  int64_t checkpoint_stride = 1;  // with recompute: sparse checkpoints (forward windows inside backward)
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  const Case& c = info.param;
  return fmt::format("world{}_{}_{}_{}{}", c.world, c.tied ? "tied" : "untied", c.lora ? "lora" : "full",
                     c.recompute ? "recompute" : "keep",
                     c.checkpoint_stride > 1 ? fmt::format("_stride{}", c.checkpoint_stride) : "");
}

class FsdpMatchesOneProcess : public ::testing::TestWithParam<Case> {};

TEST_P(FsdpMatchesOneProcess, GradientsNormAndThreeAdamWSteps) {
  const Case c = GetParam();
  expect_all_succeeded(run_ranks(c.world, [c](const ProcessGroupInfo& info) {
    auto backend = make_cpu_backend(1);
    Backend& be = *backend;
    auto world = comm::connect_cpu_world(info);
    const int rank = world->rank();
    const ModelConfig config = tiny_gqa(c.tied);
    const auto rows = rows_per_rank(c.world, config.vocab_size, 5);
    int64_t global_items = 0;
    for (const auto& rank_rows : rows)
      for (const PackedRow& r : rank_rows) global_items += r.num_items();
    const double loss_scale = 1.0 / static_cast<double>(global_items);
    DecoderOptions options;
    if (c.recompute) options.recompute.assign(config.num_layers, true);
    options.checkpoint_stride = c.checkpoint_stride;
    AdamWConfig adam;
    adam.weight_decay = 0.01;
    adam.max_grad_norm = 0.05;  // below the gradient norm: the clip depends on the global norm
    const double lr = 1e-2;

    ModelWeights ref = make_weights(be, config, c.lora);
    Decoder ref_decoder(be, ref, options);
    AdamWOptimizer ref_optimizer(be, ref, adam);

    ModelWeights weights = make_weights(be, config, c.lora);
    Fsdp fsdp(be, weights, *world);
    require_not_materialised(weights, "after sharding");
    Decoder decoder(be, weights, options);
    decoder.set_parameter_hooks(&fsdp);
    AdamWOptimizer optimizer(be, shard_slots(fsdp), adam, world.get());

    // Memory: 1/world of values and gradients, plus at most world−1 padding elements per tensor.
    const double full = static_cast<double>(fsdp.full_bytes()), held = static_cast<double>(fsdp.shard_bytes());
    require(held >= full / c.world && held <= full / c.world * 1.02, "rank {} holds {} bytes of {} (world {})", rank,
            held, full, c.world);

    double worst_grad = 0, worst_norm = 0, worst_loss = 0;
    for (int step = 0; step < 3; ++step) {
      ref.zero_grads(be);
      Tensor ref_loss = be.zeros(Shape{1}, DType::F32);
      for (const auto& rank_rows : rows)
        for (const PackedRow& r : rank_rows)
          ref_decoder.step(make_micro_batch(be, {r}, DType::F32), loss_scale, ref_loss, true);

      fsdp.zero_grads();
      Tensor loss = be.zeros(Shape{1}, DType::F32);
      for (const PackedRow& r : rows[rank]) decoder.step(make_micro_batch(be, {r}, DType::F32), loss_scale, loss, true);
      require_not_materialised(weights, "after the micro-batches");
      world->all_reduce_sum(be.default_stream(), loss);
      const double l = to_host(be, loss)[0], rl = to_host(be, ref_loss)[0];
      worst_loss = std::max(worst_loss, std::fabs(l - rl) / rl);

      for (const ParameterShard& s : fsdp.trainable_shards()) {
        const std::vector<double> got = to_host(be, fsdp.gather_shard(s.name, s.grad));
        const std::vector<double> want = to_host(be, ref.find(s.name)->grad);
        worst_grad = std::max(worst_grad, relative_error(got, want));
      }
      const double ref_norm = ref_optimizer.step(lr);
      const double got_norm = optimizer.step(lr);
      worst_norm = std::max(worst_norm, std::fabs(got_norm - ref_norm) / ref_norm);
      require(ref_norm > adam.max_grad_norm, "step {}: norm {} does not clip", step, ref_norm);
    }

    double worst_value = 0;
    {
      auto gathered = fsdp.gather_full([](const Parameter&) { return true; });
      for (const Parameter& p : weights.parameters()) {
        const std::vector<double> got = to_host(be, p.value), want = to_host(be, ref.find(p.name)->value);
        const double err = relative_error(got, want);
        if (!p.trainable) require(err == 0, "frozen {} changed under FSDP (relative error {})", p.name, err);
        worst_value = std::max(worst_value, err);
      }
    }
    require_not_materialised(weights, "after gather_full");
    if (rank == 0)
      std::printf("world %d %s %s %s: relative errors loss %.2e grad %.2e norm %.2e params %.2e; %zu of %zu bytes\n",
                  c.world, c.tied ? "tied" : "untied", c.lora ? "lora" : "full", c.recompute ? "recompute" : "keep",
                  worst_loss, worst_grad, worst_norm, worst_value, fsdp.shard_bytes(), fsdp.full_bytes());
    require(worst_loss <= 1e-6, "loss relative error {}", worst_loss);
    require(worst_grad <= 1e-5, "gradient relative error {}", worst_grad);
    require(worst_norm <= 1e-5, "grad norm relative error {}", worst_norm);
    require(worst_value <= 1e-5, "parameter relative error after 3 steps {}", worst_value);
  }));
}

std::vector<Case> all_cases() {
  std::vector<Case> out;
  for (int world : {2, 4})
    for (bool tied : {false, true})
      for (bool use_lora : {true, false})
        for (bool recompute : {false, true}) out.push_back({world, tied, use_lora, recompute});
  // Sparse checkpoints: the regenerating forward windows come inside the backward, and the last
  // rank's empty micro-batch must make the same hook calls (collectives) as its peers.
  for (int world : {2, 3}) out.push_back({world, false, true, true, 2});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Meshes, FsdpMatchesOneProcess, ::testing::ValuesIn(all_cases()), case_name);

// Sizes no world divides (padding), on 3 ranks: gathering gives the exact loaded tensors back;
// optimizer state gathered from the shards is the one-process state under the same names
// (a checkpoint written by either run is the same file), and state loaded from a one-process run
// resumes on 3 ranks exactly where the one process continues.
TEST(Fsdp, PaddingGatherAndMeshIndependentState) {
  expect_all_succeeded(run_ranks(3, [](const ProcessGroupInfo& info) {
    auto backend = make_cpu_backend(1);
    Backend& be = *backend;
    auto world = comm::connect_cpu_world(info);
    const int rank = world->rank(), size = world->size();
    const ModelConfig config = odd_sizes();
    const auto rows = rows_per_rank(size, config.vocab_size, 17);
    int64_t global_items = 0;
    for (const auto& rank_rows : rows)
      for (const PackedRow& r : rank_rows) global_items += r.num_items();
    const double loss_scale = 1.0 / static_cast<double>(global_items);
    AdamWConfig adam;
    adam.weight_decay = 0.01;

    ModelWeights ref = make_weights(be, config, false);
    ref.add_lora(be, lora(3), 7);  // adapters of rank 3 on top of full training: [3, 32] and [out, 3]
    Decoder ref_decoder(be, ref, {});
    AdamWOptimizer ref_optimizer(be, ref, adam);
    auto ref_step = [&] {
      ref.zero_grads(be);
      Tensor loss = be.zeros(Shape{1}, DType::F32);
      for (const auto& rank_rows : rows)
        for (const PackedRow& r : rank_rows) ref_decoder.step(make_micro_batch(be, {r}, DType::F32), loss_scale, loss, true);
      return ref_optimizer.step(1e-2);
    };

    auto sharded_step = [&](Fsdp& fsdp, Decoder& decoder, AdamWOptimizer& optimizer) {
      fsdp.zero_grads();
      Tensor loss = be.zeros(Shape{1}, DType::F32);
      for (const PackedRow& r : rows[rank]) decoder.step(make_micro_batch(be, {r}, DType::F32), loss_scale, loss, true);
      return optimizer.step(1e-2);
    };

    ModelWeights weights = make_weights(be, config, false);
    weights.add_lora(be, lora(3), 7);
    std::map<std::string, std::vector<double>> initial;
    for (const Parameter& p : weights.parameters()) initial[p.name] = to_host(be, p.value);
    Fsdp fsdp(be, weights, *world);
    bool padded = false;
    for (const ParameterShard& s : fsdp.trainable_shards())
      padded |= s.value.numel() * size != Shape(fsdp.full_shape(s.name)).numel();
    require(padded, "no parameter needs padding: the test does not test it");

    {  // every rank keeps the full values: exactly the loaded tensors
      auto full = fsdp.gather_full([](const Parameter&) { return true; });
      for (const Parameter& p : weights.parameters())
        require(to_host(be, p.value) == initial[p.name], "gathered {} differs from the loaded tensor", p.name);
      bool refused = false;
      try {
        Tensor loss = be.zeros(Shape{1}, DType::F32);
        Decoder inside(be, weights, {});
        inside.set_parameter_hooks(&fsdp);
        inside.step(make_micro_batch(be, {rows[rank][0]}, DType::F32), 1.0, loss, false);
      } catch (const Error& e) {
        refused = std::string(e.what()).find("gather_full scope is alive") != std::string::npos;
      }
      require(refused, "a decoder step inside a gather_full scope must be refused");
    }
    {  // only rank 1 keeps them (the others take part and drop each tensor)
      auto full = fsdp.gather_full([](const Parameter& p) { return p.name.find("lora_") != std::string::npos; }, 1);
      for (const Parameter& p : weights.parameters()) {
        const bool expect = rank == 1 && p.name.find("lora_") != std::string::npos;
        require(p.value.defined() == expect, "rank {}: {} materialised = {}", rank, p.name, p.value.defined());
        if (expect) require(to_host(be, p.value) == initial[p.name], "gathered {} differs", p.name);
      }
    }
    require_not_materialised(weights, "after the export scopes");

    Decoder decoder(be, weights, {});
    decoder.set_parameter_hooks(&fsdp);
    AdamWOptimizer optimizer(be, shard_slots(fsdp), adam, world.get());
    const double ref_norm = ref_step();
    const double norm = sharded_step(fsdp, decoder, optimizer);
    require(std::fabs(norm - ref_norm) <= 1e-5 * ref_norm, "norm {} vs one process {}", norm, ref_norm);

    // Sharded state, gathered to rank 0, is the one-process state: same names, order, shapes.
    auto ref_state = ref_optimizer.state_tensors();
    auto gathered = fsdp.gather_state(optimizer.state_tensors(), 0);
    require(rank == 0 ? gathered.size() == ref_state.size() : gathered.empty(), "rank {} got {} state tensors", rank,
            gathered.size());
    for (size_t i = 0; i < gathered.size(); ++i) {
      require(gathered[i].first == ref_state[i].first, "state {} is {}, one process has {}", i, gathered[i].first,
              ref_state[i].first);
      require(gathered[i].second.shape() == ref_state[i].second.shape(), "state {} shape {} vs {}", gathered[i].first,
              gathered[i].second.shape().str(), ref_state[i].second.shape().str());
      const double err = relative_error(to_host(be, gathered[i].second), to_host(be, ref_state[i].second));
      require(err <= 1e-5, "state {} relative error {}", gathered[i].first, err);
    }

    // Resume on 3 ranks from the one-process checkpoint (values and optimizer state).
    ModelWeights resumed = make_weights(be, config, false);
    resumed.add_lora(be, lora(3), 7);
    Fsdp resumed_fsdp(be, resumed, *world);
    for (Parameter& p : ref.parameters()) resumed_fsdp.set_full_value(p.name, p.value);
    Decoder resumed_decoder(be, resumed, {});
    resumed_decoder.set_parameter_hooks(&resumed_fsdp);
    AdamWOptimizer resumed_optimizer(be, shard_slots(resumed_fsdp), adam, world.get());
    std::map<std::string, Tensor> file(ref_state.begin(), ref_state.end());
    resumed_fsdp.load_state(resumed_optimizer.state_tensors(), [&](const std::string& name, Tensor& full) {
      require(file.count(name) == 1, "state {} missing from the one-process checkpoint", name);
      be.copy(be.default_stream(), file.at(name), full);
    });
    resumed_optimizer.set_steps_taken(ref_optimizer.steps_taken());
    for (const auto& [name, full] : resumed_fsdp.gather_state(resumed_optimizer.state_tensors()))
      require(to_host(be, full) == to_host(be, file.at(name)), "state {} did not survive load + gather", name);

    const double ref_norm2 = ref_step();
    const double norm2 = sharded_step(resumed_fsdp, resumed_decoder, resumed_optimizer);
    require(std::fabs(norm2 - ref_norm2) <= 1e-5 * ref_norm2, "resumed norm {} vs one process {}", norm2, ref_norm2);
    auto full = resumed_fsdp.gather_full([](const Parameter&) { return true; });
    for (const Parameter& p : resumed.parameters()) {
      const double err = relative_error(to_host(be, p.value), to_host(be, ref.find(p.name)->value));
      require(err <= 1e-5, "resumed {} relative error {}", p.name, err);
    }
  }));
}

// A BF16 model (the CUDA setup) shards and gathers bit-exactly, with F32 gradient shards, and its
// shards train through the optimizer's master copies.
TEST(Fsdp, Bf16ShardsWithF32GradientsAndMasterCopies) {
  expect_all_succeeded(run_ranks(2, [](const ProcessGroupInfo& info) {
    auto backend = make_cpu_backend(1);
    Backend& be = *backend;
    auto world = comm::connect_cpu_world(info);
    ModelWeights weights = ModelWeights::random(be, odd_sizes(), DType::BF16, 3);
    weights.train_all(be);
    std::map<std::string, std::vector<double>> initial;
    for (const Parameter& p : weights.parameters()) initial[p.name] = to_host(be, p.value);
    Fsdp fsdp(be, weights, *world);
    for (const ParameterShard& s : fsdp.trainable_shards())
      require(s.value.dtype() == DType::BF16 && s.grad.dtype() == DType::F32, "{}: value {} grad {}", s.name,
              s.value.describe(), s.grad.describe());
    AdamWOptimizer optimizer(be, shard_slots(fsdp), AdamWConfig{}, world.get());
    size_t masters = 0;
    for (const auto& [name, t] : optimizer.state_tensors()) masters += name.rfind("master.", 0) == 0;
    require(masters == fsdp.trainable_shards().size(), "{} master copies for {} shards", masters,
            fsdp.trainable_shards().size());
    // Masters gathered are the loaded values, exactly (BF16 -> F32 is exact).
    for (const auto& [name, full] : fsdp.gather_state(optimizer.state_tensors()))
      if (name.rfind("master.", 0) == 0)
        require(to_host(be, full) == initial[name.substr(7)], "{} differs from the loaded value", name);
    auto full = fsdp.gather_full([](const Parameter&) { return true; });
    for (const Parameter& p : weights.parameters())
      require(to_host(be, p.value) == initial[p.name], "gathered {} differs from the loaded tensor", p.name);
  }));
}


// The hooks gather the next unit on the comm stream while the current one computes (prefetch).
// Whatever order the windows come in, each must see exactly its unit's loaded values: in the
// Decoder's order (every prefetch used), and out of it (a prefetch of a unit that does not come
// next is dropped, the unit that does come is gathered then). Tied embeddings: the head's unit
// holds the embedding's bucket too.
TEST(Fsdp, WindowsSeeTheirValuesWithPrefetchInAnyOrder) {
  expect_all_succeeded(run_ranks(2, [](const ProcessGroupInfo& info) {
    auto backend = make_cpu_backend(1);
    Backend& be = *backend;
    auto world = comm::connect_cpu_world(info);
    ModelWeights weights = make_weights(be, tiny_gqa(true), true);
    std::map<std::string, std::vector<double>> initial;
    for (const Parameter& p : weights.parameters()) initial[p.name] = to_host(be, p.value);
    Fsdp fsdp(be, weights, *world);
    const std::vector<Parameter*> embed_params{weights.embed};
    auto layer_params = [&](int64_t l) { return weights.layers[l].parameters(); };
    const std::vector<Parameter*> head_params{weights.final_norm, weights.lm_head, weights.embed};
    int windows = 0;
    // Opens the window, checks every parameter of the unit (and that no other layer's is
    // materialised), closes it.
    auto window = [&](const ParameterUnit& unit, bool backward, const std::vector<Parameter*>& expected) {
      backward ? fsdp.before_backward(unit) : fsdp.before_forward(unit);
      for (Parameter* p : expected) {
        require(p->value.defined(), "window {}: {} has no value", windows, p->name);
        require(to_host(be, p->value) == initial[p->name], "window {}: {} differs from the loaded tensor", windows,
                p->name);
      }
      backward ? fsdp.after_backward(unit) : fsdp.after_forward(unit);
      for (Parameter* p : expected)
        require(!p->value.defined(), "window {}: {} still gathered after its window", windows, p->name);
      ++windows;
    };
    using U = ParameterUnit;
    // The Decoder's training order: embedding, layers up, head (backward window), layers down.
    window(U::embedding(), false, embed_params);
    window(U::layer_unit(0), false, layer_params(0));
    window(U::layer_unit(1), false, layer_params(1));
    window(U::head(), true, head_params);
    window(U::layer_unit(1), true, layer_params(1));
    window(U::layer_unit(0), true, layer_params(0));
    // Out of order: each of these windows had the wrong unit prefetched before it.
    window(U::embedding(), false, embed_params);  // prefetched layer 0
    window(U::head(), false, head_params);
    window(U::layer_unit(1), true, layer_params(1));  // prefetched layer 0 (backward from 1)
    window(U::layer_unit(1), false, layer_params(1));  // prefetched layer 0 again
    window(U::layer_unit(0), false, layer_params(0));  // prefetched the head
    // An export in between drops what is pending and gathers everything itself.
    window(U::embedding(), false, embed_params);  // prefetched layer 0
    {
      auto full = fsdp.gather_full([](const Parameter&) { return true; });
      for (const Parameter& p : weights.parameters())
        require(to_host(be, p.value) == initial[p.name], "gathered {} differs from the loaded tensor", p.name);
    }
    window(U::layer_unit(0), false, layer_params(0));
  }));
}
}  // namespace
}  // namespace spindle::parallel
