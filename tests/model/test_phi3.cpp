// phi3 and the RoPE scalings that depend on the sequence length, on the CPU: the config as transformers
// 5.17's Phi3Config reads it (both spellings, its top-level original_max_position_embeddings, "su" and
// "yarn" as longrope, refusals), longrope and dynamic NTK tables against transformers' values, each
// document of a packed row (and of a sequence-parallel shard) rotated with the table of its own length,
// the fused qkv_proj and gate_up_proj giving what split projections give, the whole decoder's backward
// against finite differences in F64 (LongRoPE on both sides of the window with partial rotary and its
// attention factor, a window, LoRA with nonzero B on the fused projections), and LoRA targets named as
// PEFT names phi3's modules.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "backend/op_test_util.h"
#include "core/error.h"
#include "model/decoder.h"
#include "model/rope_tables.h"
#include "support/tiny_model.h"

using namespace spindle;
using namespace spindle::test;

namespace {

std::string error_of(const nlohmann::json& j) {
  try {
    ModelConfig::from_json(j, "config.json");
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// A packed row of documents with these lengths (then `padding` padding tokens); targets on every token
// but each document's last, loss_scale varied.
PackedRow row_of(const std::vector<int>& lengths, int padding, int64_t vocab, uint64_t seed) {
  std::mt19937_64 rng(seed);
  PackedRow r;
  for (size_t d = 0; d < lengths.size(); ++d)
    for (int i = 0; i < lengths[d]; ++i) {
      r.input_ids.push_back(static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab)));
      r.positions.push_back(i);
      r.doc_ids.push_back(static_cast<int32_t>(d));
    }
  for (int i = 0; i < padding; ++i) {
    r.input_ids.push_back(0);
    r.positions.push_back(i);
    r.doc_ids.push_back(-1);
  }
  const size_t n = r.input_ids.size();
  r.targets.assign(n, kIgnoreIndex);
  r.weights.assign(n, 0.0f);
  for (size_t i = 0; i + 1 < n; ++i)
    if (r.doc_ids[i] >= 0 && r.doc_ids[i + 1] == r.doc_ids[i]) {
      r.targets[i] = r.input_ids[i + 1];
      r.weights[i] = 0.5f + static_cast<float>(i % 3) * 0.5f;
    }
  return r;
}

// The loss of one step over `rows` (one micro-batch), normalised by `items`; gradients accumulate.
double step_loss(Backend& be, ModelWeights& w, const std::vector<PackedRow>& rows, double items, bool backward) {
  Decoder decoder(be, w, DecoderOptions{});
  Tensor loss = be.zeros(Shape{1}, DType::F64);
  decoder.step(make_micro_batch(be, rows, DType::F64), 1.0 / items, loss, backward);
  return to_host(be, loss)[0];
}

LoraConfig phi3_lora(int64_t rank) {
  LoraConfig lora;
  lora.rank = rank;
  lora.alpha = 2.0 * static_cast<double>(rank);
  lora.targets = {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"};
  return lora;
}

// A llama config.json with these RoPE settings (v5 spelling), for the scalings any family may use.
nlohmann::json llama_with(const nlohmann::json& rope_parameters, int64_t max_positions) {
  TinyModel m;
  nlohmann::json j = m.config_json();
  j.erase("rope_theta");
  j["rope_parameters"] = rope_parameters;
  j["max_position_embeddings"] = max_positions;
  return j;
}

}  // namespace

TEST(Phi3Config, FusedProjectionsWindowAndLongRope) {
  const ModelConfig c = tiny_phi3().config();
  EXPECT_TRUE(c.fused_qkv && c.fused_gate_up);
  EXPECT_FALSE(c.qkv_bias || c.o_bias || c.tie_word_embeddings);
  ASSERT_EQ(c.attention_specs.size(), 2u);
  EXPECT_EQ(c.attention_spec(0).window, 6);
  EXPECT_EQ(c.attention_spec(1).window, 6);
  EXPECT_EQ(c.rotary_dim(), 6);
  EXPECT_EQ(c.rope.type, "longrope");
  EXPECT_EQ(c.rope.original_max_position_embeddings, 12);
  EXPECT_EQ(c.rope.short_factor, (std::vector<double>{1.05, 1.1, 1.2}));
  EXPECT_EQ(c.rope.long_factor, (std::vector<double>{1.5, 4.0, 9.0}));
  // transformers: factor = max_position_embeddings / original, attention factor √(1 + ln factor / ln original).
  EXPECT_DOUBLE_EQ(c.rope.factor, 256.0 / 12.0);
  EXPECT_DOUBLE_EQ(c.rope.attention_factor, std::sqrt(1 + std::log(256.0 / 12.0) / std::log(12.0)));

  // No sliding_window (or null): no window, as Phi3Config's default.
  nlohmann::json j = tiny_phi3().config_json();
  j.erase("sliding_window");
  EXPECT_TRUE(ModelConfig::from_json(j, "no window").attention_specs.empty());
  j["sliding_window"] = nullptr;
  EXPECT_TRUE(ModelConfig::from_json(j, "null window").attention_specs.empty());
}

TEST(Phi3Config, TensorsAsTransformersNamesThem) {
  auto be = make_cpu_backend();
  const ModelConfig c = tiny_phi3().config();
  ModelWeights w = ModelWeights::uninitialized(*be, c, DType::F32);
  auto shape_of = [&](const std::string& name) {
    const Parameter* p = w.find(name);
    EXPECT_NE(p, nullptr) << name;
    return p ? p->value.shape() : Shape{};
  };
  // qkv_proj: Hq·D + 2·Hkv·D rows; gate_up_proj: 2F rows.
  EXPECT_EQ(shape_of("model.layers.0.self_attn.qkv_proj.weight"), (Shape{4 * 8 + 2 * 2 * 8, 32}));
  EXPECT_EQ(shape_of("model.layers.1.self_attn.o_proj.weight"), (Shape{32, 32}));
  EXPECT_EQ(shape_of("model.layers.0.mlp.gate_up_proj.weight"), (Shape{2 * 48, 32}));
  EXPECT_EQ(shape_of("model.layers.1.mlp.down_proj.weight"), (Shape{32, 48}));
  for (const char* split : {"model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.gate_proj.weight"})
    EXPECT_EQ(w.find(split), nullptr) << split;
  EXPECT_EQ(w.projection_names(), (std::vector<std::string>{"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}));
  // Every tensor once: embeddings, head, final norm; per layer two norms and four projections.
  EXPECT_EQ(w.parameters().size(), 3u + 2u * 6u);
  EXPECT_EQ(c.parameter_count(), 2 * 64 * 32 + 32 + 2 * (2 * 32 + 64 * 32 + 32 * 32 + 96 * 32 + 32 * 48));
}

// transformers' Phi3Config: the top-level original_max_position_embeddings (4096 when absent) is
// longrope's window over the one in the settings; "yarn" and "su" are longrope; only default and
// longrope load.
TEST(Phi3Config, ReadsItsRopeAsTransformersDoes) {
  const nlohmann::json v4 = tiny_phi3().config_json();
  nlohmann::json v5 = v4;
  v5.erase("rope_scaling");
  v5.erase("rope_theta");
  v5.erase("partial_rotary_factor");
  v5["rope_parameters"] = {{"rope_type", "longrope"},  {"rope_theta", 10000.0},
                           {"partial_rotary_factor", 0.75}, {"original_max_position_embeddings", 12},
                           {"short_factor", {1.05, 1.1, 1.2}}, {"long_factor", {1.5, 4.0, 9.0}}};
  const RopeConfig a = ModelConfig::from_json(v4, "v4").rope, b = ModelConfig::from_json(v5, "v5").rope;
  EXPECT_EQ(a.type, b.type);
  EXPECT_EQ(a.original_max_position_embeddings, b.original_max_position_embeddings);
  EXPECT_EQ(a.short_factor, b.short_factor);
  EXPECT_EQ(a.long_factor, b.long_factor);
  EXPECT_EQ(a.attention_factor, b.attention_factor);
  EXPECT_EQ(a.partial_rotary_factor, b.partial_rotary_factor);

  nlohmann::json j = v4;
  j["rope_scaling"]["original_max_position_embeddings"] = 100;  // the top-level 12 wins
  EXPECT_EQ(ModelConfig::from_json(j, "inner").rope.original_max_position_embeddings, 12);
  j.erase("original_max_position_embeddings");  // Phi3Config's default, over the settings' 100
  EXPECT_EQ(ModelConfig::from_json(j, "default").rope.original_max_position_embeddings, 4096);
  j = v4;
  j["rope_scaling"]["type"] = "yarn";  // Phi-3's configs once wrote longrope so
  EXPECT_EQ(ModelConfig::from_json(j, "yarn").rope.type, "longrope");
  j["rope_scaling"]["type"] = "su";  // transformers 5.17 reads it only with its own original window
  EXPECT_NE(error_of(j).find("\"su\" (Phi-3's older name of longrope)"), std::string::npos) << error_of(j);
  j["rope_scaling"]["original_max_position_embeddings"] = 20;
  const RopeConfig su = ModelConfig::from_json(j, "su").rope;
  EXPECT_EQ(su.type, "longrope");
  EXPECT_EQ(su.original_max_position_embeddings, 20);  // its own, not the top-level 12
  j = v4;
  j["rope_scaling"] = {{"type", "linear"}, {"factor", 2.0}};
  EXPECT_NE(error_of(j).find("RoPE scaling \"linear\" is not one of phi3's"), std::string::npos) << error_of(j);
  j = v4;
  j.erase("rope_scaling");  // plain RoPE
  EXPECT_EQ(ModelConfig::from_json(j, "plain").rope.type, "default");
}

TEST(RopeConfig, LongRopeSettingsAndTheirErrors) {
  const nlohmann::json lists = {{"short_factor", {1.0, 1.0, 1.1, 1.2}}, {"long_factor", {1.0, 2.0, 4.0, 8.0}}};
  nlohmann::json p = lists;
  p["rope_type"] = "longrope";
  // Any family: the window defaults to max_position_embeddings (factor 1, no attention factor).
  RopeConfig r = ModelConfig::from_json(llama_with(p, 512), "llama").rope;
  EXPECT_EQ(r.original_max_position_embeddings, 512);
  EXPECT_EQ(r.attention_factor, 1.0);
  p["original_max_position_embeddings"] = 64;
  r = ModelConfig::from_json(llama_with(p, 512), "llama").rope;
  EXPECT_DOUBLE_EQ(r.attention_factor, std::sqrt(1 + std::log(8.0) / std::log(64.0)));
  p["factor"] = 4.0;  // the explicit factor wins over max / original
  r = ModelConfig::from_json(llama_with(p, 512), "llama").rope;
  EXPECT_DOUBLE_EQ(r.attention_factor, std::sqrt(1 + std::log(4.0) / std::log(64.0)));
  p["attention_factor"] = 1.25;  // and an explicit attention factor wins over both
  EXPECT_EQ(ModelConfig::from_json(llama_with(p, 512), "llama").rope.attention_factor, 1.25);

  nlohmann::json bad = p;
  bad["short_factor"] = {1.0, 1.0, 1.0};
  EXPECT_NE(error_of(llama_with(bad, 512)).find("longrope's \"short_factor\" has 3 entries; RoPE rotates 8 of each "
                                                "head's 8 dims (partial_rotary_factor 1), so it needs 4, one per pair"),
            std::string::npos)
      << error_of(llama_with(bad, 512));
  bad = p;
  bad.erase("long_factor");
  EXPECT_NE(error_of(llama_with(bad, 512)).find("needs \"long_factor\""), std::string::npos);
  bad = p;
  bad["long_factor"] = {1.0, "two", 4.0, 8.0};
  EXPECT_NE(error_of(llama_with(bad, 512)).find("must be a list of positive numbers"), std::string::npos);
  bad = p;
  bad["long_factor"] = 2.0;
  EXPECT_NE(error_of(llama_with(bad, 512)).find("must be a list of numbers"), std::string::npos);
  bad = p;
  bad["original_max_position_embeddings"] = 1;
  EXPECT_NE(error_of(llama_with(bad, 512)).find("above 1"), std::string::npos);
  // With partial rotary the lists have one factor per rotated pair.
  nlohmann::json partial = llama_with(lists, 512);
  partial["rope_parameters"]["rope_type"] = "longrope";
  partial["rope_parameters"]["partial_rotary_factor"] = 0.5;
  EXPECT_NE(error_of(partial).find("so it needs 2"), std::string::npos) << error_of(partial);
}

TEST(RopeConfig, DynamicSettingsAndTheirErrors) {
  const RopeConfig r = ModelConfig::from_json(llama_with({{"rope_type", "dynamic"}, {"factor", 2.0}}, 8), "d").rope;
  EXPECT_EQ(r.type, "dynamic");
  EXPECT_EQ(r.factor, 2.0);
  EXPECT_EQ(r.original_max_position_embeddings, 8);
  EXPECT_EQ(r.attention_factor, 1.0);
  nlohmann::json j = llama_with({{"type", "dynamic"}}, 8);
  EXPECT_NE(error_of(j).find("RoPE scaling \"dynamic\" needs a positive \"factor\""), std::string::npos);
  j = llama_with({{"type", "dynamic"}, {"factor", 2.0}}, 8);
  j.erase("max_position_embeddings");
  EXPECT_NE(error_of(j).find("needs max_position_embeddings"), std::string::npos);
  j = llama_with({{"rope_type", "proportional"}, {"factor", 2.0}}, 8);
  EXPECT_NE(error_of(j).find("RoPE scaling \"proportional\" is not supported; spindle supports default, linear, "
                             "llama3, yarn, longrope and dynamic"),
            std::string::npos);
}

// Tables against transformers 5.17's (torch 2.15, CPU): _compute_longrope_parameters and
// _compute_dynamic_ntk_parameters printed for these settings. torch's fp32 pow may differ from the C
// library's in the last bit, so the comparison allows 2 ulp.
TEST(RopeConfig, TablesMatchTransformers) {
  auto expect_table = [](const std::vector<float>& got, const std::vector<double>& want, const char* what) {
    ASSERT_EQ(got.size(), want.size()) << what;
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], want[i], 2.5e-7 * want[i]) << what << " " << i;
  };
  RopeConfig dynamic;
  dynamic.type = "dynamic";
  dynamic.factor = 2.0;
  dynamic.original_max_position_embeddings = 8;
  // Up to max_position_embeddings the plain table; past it θ grows with the length.
  EXPECT_EQ(rope_inverse_frequencies(dynamic, 16, 8), rope_inverse_frequencies(RopeConfig{}, 16));
  expect_table(rope_inverse_frequencies(dynamic, 16, 17),
               {1.0, 2.6722300e-01, 7.1408123e-02, 1.9081892e-02, 5.0991201e-03, 1.3626020e-03, 3.6411858e-04,
                9.7300850e-05},
               "dynamic 17");
  EXPECT_EQ(dynamic.table_key(8), 0);
  EXPECT_EQ(dynamic.table_key(17), 17);

  RopeConfig longrope;
  longrope.type = "longrope";
  longrope.original_max_position_embeddings = 8;
  longrope.short_factor = {1.0, 1.1, 1.2, 1.3};
  longrope.long_factor = {1.0, 2.0, 4.0, 8.0};
  const std::vector<float> plain = rope_inverse_frequencies(RopeConfig{}, 8);
  const std::vector<float> short_table = rope_inverse_frequencies(longrope, 8, 8),
                           long_table = rope_inverse_frequencies(longrope, 8, 9);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_FLOAT_EQ(short_table[i], plain[i] / static_cast<float>(longrope.short_factor[i])) << i;
    EXPECT_FLOAT_EQ(long_table[i], plain[i] / static_cast<float>(longrope.long_factor[i])) << i;
  }
  EXPECT_EQ(rope_inverse_frequencies(longrope, 8, 0), short_table);  // the short table unless told a length
  EXPECT_EQ(longrope.table_key(8), 0);
  EXPECT_EQ(longrope.table_key(9), 1);
  EXPECT_EQ(longrope.table_key(100000), 1);
}

// A document's length is its largest position + 1 in the whole row, on every shard of it.
TEST(RopeTables, EachDocumentRotatesWithItsOwnLengthsTable) {
  const PackedRow whole = row_of({14, 5, 20}, 3, 64, 1);  // original window 12: long, short, long
  std::vector<DocumentRun> runs = document_runs(whole, whole);
  ASSERT_EQ(runs.size(), 4u);
  EXPECT_EQ(runs[0].length, 14);
  EXPECT_EQ(runs[1].begin, 14);
  EXPECT_EQ(runs[1].length, 5);
  EXPECT_EQ(runs[2].length, 20);
  EXPECT_EQ(runs[3].length, 0);  // padding

  // A shard holding the first 3 tokens of the 14-token document and the last 4 of the 20-token one
  // (as a zigzag layout cuts them) still sees lengths 14 and 20.
  PackedRow shard;
  for (int i : {0, 1, 2, 35, 36, 37, 38}) {
    shard.input_ids.push_back(whole.input_ids[i]);
    shard.positions.push_back(whole.positions[i]);
    shard.doc_ids.push_back(whole.doc_ids[i]);
    shard.targets.push_back(whole.targets[i]);
    shard.weights.push_back(whole.weights[i]);
  }
  runs = document_runs(shard, whole);
  ASSERT_EQ(runs.size(), 2u);
  EXPECT_EQ(runs[0].length, 14);
  EXPECT_EQ(runs[1].length, 20);
  EXPECT_EQ(document_runs(shard, shard)[0].length, 3);  // what the shard alone would wrongly say

  auto be = make_cpu_backend();
  const ModelConfig c = tiny_phi3().config();
  RopeTables tables(*be, be->default_stream(), c.rope, c.rotary_dim());
  const MicroBatch batch = make_micro_batch(*be, {whole}, DType::F32);
  const std::vector<RopeSpan> spans = tables.spans(batch);
  ASSERT_EQ(spans.size(), 3u);  // long | short | long with the padding after it
  EXPECT_EQ(spans[0].end, 14);
  EXPECT_EQ(spans[1].end, 19);
  EXPECT_EQ(spans[2].end, 42);
  EXPECT_EQ(to_host(*be, spans[0].inv_freq), to_host(*be, spans[2].inv_freq));
  const std::vector<float> long_table = rope_inverse_frequencies(c.rope, 6, 13),
                           short_table = rope_inverse_frequencies(c.rope, 6, 12);
  EXPECT_EQ(to_host(*be, spans[0].inv_freq), std::vector<double>(long_table.begin(), long_table.end()));
  EXPECT_EQ(to_host(*be, spans[1].inv_freq), std::vector<double>(short_table.begin(), short_table.end()));
  // A RoPE that does not depend on the length: one span over every token.
  TinyModel llama;
  const ModelConfig plain = llama.config();
  RopeTables one(*be, be->default_stream(), plain.rope, plain.rotary_dim());
  ASSERT_EQ(one.spans(batch).size(), 1u);
  EXPECT_EQ(one.spans(batch)[0].end, 42);
}

// Packing never changes a document's loss: with LongRoPE (the long and the short document side by
// side) and with dynamic NTK, the packed row's loss is the sum of its documents' losses alone.
TEST(Phi3Model, PackedDocumentsGiveWhatEachGivesAlone) {
  auto be = make_cpu_backend();
  nlohmann::json dynamic = llama_with({{"rope_type", "dynamic"}, {"factor", 3.0}, {"rope_theta", 100.0}}, 10);
  for (const nlohmann::json& config : {tiny_phi3().config_json(), dynamic}) {
    const ModelConfig c = ModelConfig::from_json(config, "config.json");
    ModelWeights w = random_weights(*be, c, DType::F64, 3, 10.0);
    const PackedRow packed = row_of({16, 7, 13}, 2, c.vocab_size, 5);
    const double items = static_cast<double>(packed.num_items());
    const double together = step_loss(*be, w, {packed}, items, false);
    double alone = 0;
    int64_t begin = 0;
    for (int length : {16, 7, 13}) {
      PackedRow doc;
      for (int64_t i = begin; i < begin + length; ++i) {
        doc.input_ids.push_back(packed.input_ids[i]);
        doc.positions.push_back(packed.positions[i]);
        doc.doc_ids.push_back(0);
        doc.targets.push_back(packed.targets[i]);
        doc.weights.push_back(packed.weights[i]);
      }
      alone += step_loss(*be, w, {doc}, items, false);
      begin += length;
    }
    EXPECT_NEAR(together, alone, 1e-12 * std::fabs(alone)) << c.model_type << " " << c.rope.type;
    // The long document's table matters: rotated with the short factors it gives another loss.
    ModelConfig short_only = c;
    short_only.rope.type = "default";
    ModelWeights same = random_weights(*be, short_only, DType::F64, 3, 10.0);
    EXPECT_GT(std::fabs(step_loss(*be, same, {packed}, items, false) - together), 1e-6) << c.rope.type;
  }
}

// The fused projections compute what q/k/v and gate/up projections holding their rows compute: a
// phi3 model against a llama one with the same weights split and the same RoPE.
TEST(Phi3Model, FusedProjectionsEqualSplitOnes) {
  auto be = make_cpu_backend();
  const nlohmann::json phi3_json = tiny_phi3().config_json();
  nlohmann::json llama_json = phi3_json;
  llama_json["model_type"] = "llama";
  llama_json["architectures"] = {"LlamaForCausalLM"};
  // llama reads the window from nowhere; the comparison is of the projections, so drop it from both.
  llama_json.erase("sliding_window");
  nlohmann::json phi3_no_window = phi3_json;
  phi3_no_window.erase("sliding_window");
  // llama's longrope window is the settings' own.
  llama_json["rope_scaling"]["original_max_position_embeddings"] = 12;
  const ModelConfig pc = ModelConfig::from_json(phi3_no_window, "phi3"), lc = ModelConfig::from_json(llama_json, "llama");
  ASSERT_EQ(pc.rope.attention_factor, lc.rope.attention_factor);
  ModelWeights phi3 = random_weights(*be, pc, DType::F64, 9, 10.0);
  ModelWeights llama = random_weights(*be, lc, DType::F64, 1, 1.0);
  for (Parameter& p : llama.parameters()) {
    std::string name = p.name;
    int64_t row_offset = 0;
    bool renamed = false;
    auto fused = [&](const std::string& part, const std::string& whole, int64_t offset) {
      if (renamed) return;
      if (const size_t at = name.find("." + part + "."); at != std::string::npos) {
        name.replace(at + 1, part.size(), whole);
        row_offset = offset;
        renamed = true;
      }
    };
    const int64_t q = pc.q_dim(), kv = pc.kv_dim(), f = pc.intermediate_size;
    fused("q_proj", "qkv_proj", 0);
    fused("k_proj", "qkv_proj", q);
    fused("v_proj", "qkv_proj", q + kv);
    fused("gate_proj", "gate_up_proj", 0);
    fused("up_proj", "gate_up_proj", f);
    const Parameter* source = phi3.find(name);
    ASSERT_NE(source, nullptr) << name;
    const std::vector<double> all = to_host(*be, source->value);
    const int64_t cols = p.value.rank() == 2 ? p.value.dim(1) : 1;
    from_host(*be, std::vector<double>(all.begin() + row_offset * cols, all.begin() + row_offset * cols + p.value.numel()),
              p.value);
  }
  phi3.train_all(*be);
  llama.train_all(*be);
  const PackedRow row = row_of({16, 7, 13}, 2, pc.vocab_size, 6);
  const double items = static_cast<double>(row.num_items());
  const double a = step_loss(*be, phi3, {row}, items, true), b = step_loss(*be, llama, {row}, items, true);
  EXPECT_NEAR(a, b, 1e-13 * std::fabs(b));
  const std::vector<double> dqkv = to_host(*be, phi3.find("model.layers.1.self_attn.qkv_proj.weight")->grad);
  const std::vector<double> dv = to_host(*be, llama.find("model.layers.1.self_attn.v_proj.weight")->grad);
  const int64_t v_begin = (pc.q_dim() + pc.kv_dim()) * pc.hidden_size;
  EXPECT_LE(relative_error(std::vector<double>(dqkv.begin() + v_begin, dqkv.end()), dv), 1e-12);
  const std::vector<double> dgu = to_host(*be, phi3.find("model.layers.0.mlp.gate_up_proj.weight")->grad);
  const std::vector<double> dup = to_host(*be, llama.find("model.layers.0.mlp.up_proj.weight")->grad);
  EXPECT_LE(relative_error(std::vector<double>(dgu.begin() + pc.intermediate_size * pc.hidden_size, dgu.end()), dup),
            1e-12);
}

// The whole decoder against central differences in F64: LongRoPE's long and short tables side by side
// on 0.75 of each head with its attention factor, the window, the fused projections; full fine-tune
// and LoRA with nonzero B on the fused projections; and a dynamic-NTK llama.
TEST(Phi3Model, GradientsMatchFiniteDifferences) {
  auto be = make_cpu_backend();
  TinyModel m = tiny_phi3();
  m.vocab_size = 11;
  m.hidden_size = 8;
  m.head_dim = 8;
  m.num_heads = 2;
  m.num_kv_heads = 1;
  m.intermediate_size = 6;
  m.extra["partial_rotary_factor"] = 0.5;  // 4 of 8 dims: 2 factors per list
  m.extra["rope_scaling"]["short_factor"] = {1.3, 1.1};
  m.extra["rope_scaling"]["long_factor"] = {2.0, 7.0};
  m.extra["original_max_position_embeddings"] = 5;
  m.extra["sliding_window"] = 4;
  const nlohmann::json dynamic = llama_with({{"rope_type", "dynamic"}, {"factor", 3.0}, {"rope_theta", 100.0}}, 5);
  for (int variant = 0; variant < 3; ++variant) {
    nlohmann::json config = variant == 2 ? dynamic : m.config_json();
    if (variant == 2) {
      config["vocab_size"] = 11;
      config["hidden_size"] = 8;
      config["head_dim"] = 8;
      config["num_attention_heads"] = 2;
      config["num_key_value_heads"] = 1;
      config["intermediate_size"] = 6;
    }
    const ModelConfig c = ModelConfig::from_json(config, "gradcheck");
    ModelWeights w = random_weights(*be, c, DType::F64, 11 + variant, 10.0);
    if (variant == 1) add_lora_with_random_b(*be, w, phi3_lora(2), 5, normal_draw(0.5));
    else w.train_all(*be);
    const PackedRow row = row_of({7, 4}, 1, c.vocab_size, 2);  // 7 past the window of 5, 4 within it
    const double items = static_cast<double>(row.num_items());
    Decoder decoder(*be, w, DecoderOptions{});
    const MicroBatch batch = make_micro_batch(*be, {row}, DType::F64);
    auto run = [&](bool backward) {
      Tensor loss = be->zeros(Shape{1}, DType::F64);
      decoder.step(batch, 1.0 / items, loss, backward);
      return to_host(*be, loss)[0];
    };
    w.zero_grads(*be);
    run(true);
    std::mt19937_64 rng(7);
    int checked = 0;
    for (Parameter& p : w.parameters()) {
      if (!p.trainable) continue;
      std::vector<double> values = to_host(*be, p.value), grad = to_host(*be, p.grad);
      for (int probe = 0; probe < 6; ++probe) {
        const size_t i = rng() % values.size();
        const double h = 1e-6, keep = values[i];
        values[i] = keep + h;
        from_host(*be, values, p.value);
        const double up = run(false);
        values[i] = keep - h;
        from_host(*be, values, p.value);
        const double down = run(false);
        values[i] = keep;
        from_host(*be, values, p.value);
        const double numeric = (up - down) / (2 * h);
        EXPECT_NEAR(grad[i], numeric, 1e-7 + 1e-6 * std::fabs(numeric)) << variant << " " << p.name << "[" << i << "]";
      }
      ++checked;
    }
    EXPECT_GT(checked, 0);
  }
}

// LoRA names: PEFT adapts qkv_proj and gate_up_proj as one module each; the default targets (q_proj …
// down_proj) mean the fused ones here; naming a part of a fused projection is an error that says so.
TEST(Phi3Model, LoraTargetsAreThePeftModuleNames) {
  auto be = make_cpu_backend();
  ModelWeights w = random_weights(*be, tiny_phi3().config(), DType::F32, 1);
  const std::vector<std::string> defaults = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};
  EXPECT_EQ(w.present_lora_targets(defaults),
            (std::vector<std::string>{"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}));
  EXPECT_EQ(w.present_lora_targets({"v_proj", "down_proj"}), (std::vector<std::string>{"qkv_proj", "down_proj"}));
  LoraConfig wrong = phi3_lora(2);
  wrong.targets = {"q_proj", "v_proj"};
  try {
    w.add_lora(*be, wrong, 1);
    ADD_FAILURE() << "q_proj accepted on phi3";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("this phi3 model holds q_proj, k_proj and v_proj in one projection, qkv_proj, "
                                         "which PEFT adapts as one module: one A and one B over its whole output; name "
                                         "qkv_proj"),
              std::string::npos)
        << e.what();
  }
  w.add_lora(*be, phi3_lora(2), 1);
  // One A [r, H] and one B [Hq·D + 2·Hkv·D, r] on qkv_proj, as PEFT's adapter holds them.
  EXPECT_EQ(w.find("base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight")->value.shape(), (Shape{2, 32}));
  EXPECT_EQ(w.find("base_model.model.model.layers.0.self_attn.qkv_proj.lora_B.weight")->value.shape(), (Shape{64, 2}));
  EXPECT_EQ(w.find("base_model.model.model.layers.1.mlp.gate_up_proj.lora_B.weight")->value.shape(), (Shape{96, 2}));
  // A llama keeps its own names.
  ModelWeights llama = random_weights(*be, TinyModel{}.config(), DType::F32, 1);
  EXPECT_EQ(llama.present_lora_targets(defaults), defaults);
}
