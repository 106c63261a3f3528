#include "model/config.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "model/config_fields.h"
#include "model/family.h"
#include "model/layer.h"

namespace spindle {
namespace {

using nlohmann::json;

int64_t require_int(const json& j, const char* key, const std::string& source) {
  if (!j.contains(key) || j[key].is_null()) fail("{}: missing \"{}\"; is this a Hugging Face config.json?", source, key);
  if (!j[key].is_number_integer() || j[key].get<int64_t>() <= 0)
    fail("{}: \"{}\" must be a positive integer, got {}", source, key, j[key].dump());
  return j[key].get<int64_t>();
}

// The YaRN attention factor as transformers computes it: an explicit attention_factor, else from
// mscale and mscale_all_dim when both are set, else 0.1·ln(factor) + 1 (1 for factor ≤ 1).
double yarn_attention_factor(const json& params, double factor, const std::string& source) {
  if (params.contains("attention_factor") && !params["attention_factor"].is_null())
    return number_or(params, "attention_factor", 1.0, source);
  auto mscale_of = [&](double mscale) { return factor <= 1 ? 1.0 : 0.1 * mscale * std::log(factor) + 1.0; };
  const double mscale = number_or(params, "mscale", 0.0, source), all_dim = number_or(params, "mscale_all_dim", 0.0, source);
  if (mscale != 0 && all_dim != 0) return mscale_of(mscale) / mscale_of(all_dim);
  return mscale_of(1.0);
}

// A list of numbers of the RoPE settings (longrope's short_factor, long_factor). Its length is
// checked once the rotary dims are known (ModelConfig::from_json).
std::vector<double> factor_list(const json& params, const char* key, const std::string& source) {
  if (!params.contains(key) || params[key].is_null())
    fail("{}: RoPE scaling \"longrope\" needs \"{}\", a list of one factor per rotated pair of dims", source, key);
  const json& list = params[key];
  if (!list.is_array()) fail("{}: longrope's \"{}\" must be a list of numbers, got {}", source, key, list.dump());
  std::vector<double> out;
  for (const json& x : list) {
    if (!x.is_number() || !(x.get<double>() > 0))
      fail("{}: longrope's \"{}\" must be a list of positive numbers, got {}", source, key, x.dump());
    out.push_back(x.get<double>());
  }
  return out;
}

// LongRoPE (transformers' _compute_longrope_parameters): the factor lists, the window past which the
// long ones rotate (original_max_position_embeddings, else max_position_embeddings), the factor
// (explicit, else max_position_embeddings / original) and from it the attention factor, which
// transformers computes once and applies to both lists' tables.
void read_longrope(const json& j, const json& params, RopeConfig& rope, const std::string& source) {
  const double max_positions = number_or(j, "max_position_embeddings", 0.0, source);
  const double original = number_or(params, "original_max_position_embeddings", max_positions, source);
  if (!(original > 1))
    fail("{}: RoPE scaling \"longrope\" needs original_max_position_embeddings (or max_position_embeddings) above "
         "1: the length past which it rotates with its long factors, got {}",
         source, original);
  rope.original_max_position_embeddings = static_cast<int64_t>(original);
  rope.short_factor = factor_list(params, "short_factor", source);
  rope.long_factor = factor_list(params, "long_factor", source);
  if (params.contains("factor") && !params["factor"].is_null()) {
    rope.factor = number_or(params, "factor", 1.0, source);
    if (!(rope.factor > 0)) fail("{}: longrope's \"factor\" must be positive, got {}", source, rope.factor);
  } else {
    if (!(max_positions > 0))
      fail("{}: RoPE scaling \"longrope\" needs \"factor\" or max_position_embeddings (its attention factor comes "
           "from max_position_embeddings / original_max_position_embeddings)",
           source);
    rope.factor = max_positions / original;
  }
  if (params.contains("attention_factor") && !params["attention_factor"].is_null())
    rope.attention_factor = number_or(params, "attention_factor", 1.0, source);
  else
    rope.attention_factor = rope.factor <= 1 ? 1.0 : std::sqrt(1 + std::log(rope.factor) / std::log(original));
  if (!(rope.attention_factor > 0))
    fail("{}: longrope's \"attention_factor\" must be positive, got {}", source, rope.attention_factor);
}

// One layer type's RoPE settings (`params`: rope_parameters, rope_scaling, or one layer type's
// entry of them), over the top-level fields of `j`.
RopeConfig parse_rope_params(const json& j, const json& params, const std::string& source) {
  RopeConfig rope;
  rope.theta = number_or(j, "rope_theta", 10000.0, source);
  rope.theta = number_or(params, "rope_theta", rope.theta, source);
  std::string type = "default";
  if (params.contains("rope_type") && params["rope_type"].is_string()) type = params["rope_type"];
  else if (params.contains("type") && params["type"].is_string()) type = params["type"];
  // Multimodal RoPE over text alone: every section sees the token's one position, so it is 1-D RoPE.
  if (type == "mrope") type = "default";
  if (type != "default" && type != "linear" && type != "llama3" && type != "yarn" && type != "longrope" &&
      type != "dynamic")
    fail("{}: RoPE scaling \"{}\" is not supported; spindle supports default, linear, llama3, yarn, longrope and "
         "dynamic",
         source, type);
  rope.type = type;
  if (type == "yarn") {
    // transformers 5: original_max_position_embeddings defaults to max_position_embeddings, a missing
    // factor to their ratio; an explicit factor wins over the ratio.
    const double max_positions = number_or(j, "max_position_embeddings", 0.0, source);
    const double original = number_or(params, "original_max_position_embeddings", max_positions, source);
    if (!(original > 0))
      fail("{}: yarn RoPE scaling needs original_max_position_embeddings (or max_position_embeddings)", source);
    rope.original_max_position_embeddings = static_cast<int64_t>(original);
    rope.factor = number_or(params, "factor", max_positions / original, source);
    if (!(rope.factor > 0)) fail("{}: RoPE scaling \"yarn\" needs a positive \"factor\"", source);
    // An explicit 0 (or null) takes the default, as transformers' `or` does.
    rope.beta_fast = number_or(params, "beta_fast", 0.0, source);
    if (rope.beta_fast == 0) rope.beta_fast = 32;
    rope.beta_slow = number_or(params, "beta_slow", 0.0, source);
    if (rope.beta_slow == 0) rope.beta_slow = 1;
    rope.truncate = bool_or(params, "truncate", true, source);
    rope.attention_factor = yarn_attention_factor(params, rope.factor, source);
  } else if (type == "longrope") {
    read_longrope(j, params, rope, source);
  } else if (type != "default") {
    rope.factor = number_or(params, "factor", 0.0, source);
    if (!(rope.factor > 0)) fail("{}: RoPE scaling \"{}\" needs a positive \"factor\"", source, type);
  }
  if (type == "dynamic") {
    // transformers' _compute_dynamic_ntk_parameters grows the base for sequences longer than the
    // config's max_position_embeddings.
    const int64_t max_positions = positive_int_or(j, "max_position_embeddings", 0, source);
    if (max_positions <= 0)
      fail("{}: RoPE scaling \"dynamic\" needs max_position_embeddings: its base grows for sequences longer than that",
           source);
    rope.original_max_position_embeddings = max_positions;
  }
  if (type == "llama3") {
    rope.low_freq_factor = number_or(params, "low_freq_factor", 0.0, source);
    rope.high_freq_factor = number_or(params, "high_freq_factor", 0.0, source);
    rope.original_max_position_embeddings =
        static_cast<int64_t>(number_or(params, "original_max_position_embeddings", 0.0, source));
    if (!(rope.low_freq_factor > 0) || !(rope.high_freq_factor > rope.low_freq_factor) ||
        rope.original_max_position_embeddings <= 0)
      fail("{}: llama3 RoPE scaling needs low_freq_factor > 0, high_freq_factor > low_freq_factor and "
           "original_max_position_embeddings > 0",
           source);
  }
  if (!(rope.theta > 0)) fail("{}: rope_theta must be positive", source);
  rope.partial_rotary_factor = number_or(params, "partial_rotary_factor", number_or(j, "partial_rotary_factor", 1.0, source), source);
  if (!(rope.partial_rotary_factor > 0 && rope.partial_rotary_factor <= 1))
    fail("{}: partial_rotary_factor {} must be in (0, 1]", source, rope.partial_rotary_factor);
  return rope;
}

// longrope's factor lists hold one factor per rotated pair of dims.
void check_longrope_lengths(const RopeConfig& rope, const ModelConfig& c, const std::string& source) {
  if (rope.type != "longrope") return;
  const size_t pairs = static_cast<size_t>(c.rotary_dim() / 2);
  for (const auto& [name, list] : {std::pair<const char*, const std::vector<double>*>{"short_factor", &rope.short_factor},
                                   {"long_factor", &rope.long_factor}})
    if (list->size() != pairs)
      fail("{}: longrope's \"{}\" has {} entries; RoPE rotates {} of each head's {} dims (partial_rotary_factor {}), "
           "so it needs {}, one per pair",
           source, name, list->size(), c.rotary_dim(), c.head_dim, c.rope.partial_rotary_factor, pairs);
}

}  // namespace

// transformers 4 writes rope_theta at the top and rope_scaling (with "type" or "rope_type");
// transformers 5 writes rope_parameters holding rope_theta, possibly one entry per layer type
// ("full_attention", "sliding_attention").
std::pair<RopeConfig, std::optional<RopeConfig>> read_rope(const json& j, const std::string& source) {
  json params = json::object();
  if (j.contains("rope_parameters") && !j["rope_parameters"].is_null()) params = j["rope_parameters"];
  else if (j.contains("rope_scaling") && !j["rope_scaling"].is_null()) params = j["rope_scaling"];
  if (!params.is_object()) fail("{}: rope settings must be an object, got {}", source, params.dump());
  if (!(params.contains("full_attention") && params["full_attention"].is_object()))
    return {parse_rope_params(j, params, source), std::nullopt};
  std::optional<RopeConfig> sliding;
  for (auto& [layer_type, value] : params.items()) {
    if (layer_type == "full_attention" || value == params["full_attention"]) continue;
    if (layer_type != "sliding_attention")
      fail("{}: RoPE settings for layer type \"{}\" differ from full_attention's; spindle supports separate "
           "settings for sliding_attention layers only",
           source, layer_type);
    if (!value.is_object()) fail("{}: rope settings of {} must be an object, got {}", source, layer_type, value.dump());
    sliding = parse_rope_params(j, value, source);
  }
  return {parse_rope_params(j, params["full_attention"], source), sliding};
}

ModelConfig ModelConfig::from_json(const json& file, const std::string& source) {
  if (!file.is_object()) fail("{}: expected a JSON object", source);
  ModelConfig c;
  if (!file.contains("model_type") || !file["model_type"].is_string())
    fail("{}: missing \"model_type\"; spindle supports {}", source, supported_model_types());
  c.model_type = file["model_type"];
  const ModelFamily& family = model_family(c.model_type, source);
  c.weight_prefix = family.weight_prefix;
  // The decoder's fields: the whole file, or the section a multimodal checkpoint nests them in.
  const std::string section(family.config_section);
  if (!section.empty() && !(file.contains(section) && file[section].is_object()))
    fail("{}: model_type \"{}\" keeps the text model's settings under \"{}\", which is missing", source,
         c.model_type, section);
  const json& j = section.empty() ? file : file[section];
  if (!section.empty() && file.contains("architectures") && file["architectures"].is_array() &&
      !file["architectures"].empty() && file["architectures"][0].is_string())
    c.multimodal_architecture = file["architectures"][0];
  c.vocab_size = require_int(j, "vocab_size", source);
  if (j.contains("pad_token_id") && !j["pad_token_id"].is_null()) {
    if (!j["pad_token_id"].is_number_integer())
      fail("{}: \"pad_token_id\" must be an integer or null, got {}", source, j["pad_token_id"].dump());
    const int64_t pad = j["pad_token_id"].get<int64_t>();
    // transformers refuses a padding_idx outside the table; a checkpoint with one trains as if unset.
    if (pad >= 0 && pad < c.vocab_size) c.pad_token_id = pad;
  }
  c.hidden_size = require_int(j, "hidden_size", source);
  // Families whose every MLP is a mixture of experts (qwen3_5_moe) have no intermediate_size: it is
  // required below only when a layer has a dense MLP.
  if (j.contains("intermediate_size") && !j["intermediate_size"].is_null())
    c.intermediate_size = require_int(j, "intermediate_size", source);
  c.num_layers = require_int(j, "num_hidden_layers", source);
  c.num_heads = require_int(j, "num_attention_heads", source);
  c.num_kv_heads = j.contains("num_key_value_heads") && !j["num_key_value_heads"].is_null()
                       ? require_int(j, "num_key_value_heads", source)
                       : c.num_heads;
  if (j.contains("head_dim") && !j["head_dim"].is_null()) c.head_dim = require_int(j, "head_dim", source);
  else {
    if (c.hidden_size % c.num_heads) fail("{}: hidden_size {} is not divisible by num_attention_heads {}; set head_dim", source, c.hidden_size, c.num_heads);
    c.head_dim = c.hidden_size / c.num_heads;
  }
  if (c.head_dim % 2) fail("{}: head_dim {} must be even for RoPE", source, c.head_dim);
  if (c.num_heads % c.num_kv_heads)
    fail("{}: num_attention_heads {} is not a multiple of num_key_value_heads {}", source, c.num_heads, c.num_kv_heads);
  c.max_position_embeddings = j.contains("max_position_embeddings") && j["max_position_embeddings"].is_number_integer()
                                  ? j["max_position_embeddings"].get<int64_t>()
                                  : 0;
  c.rms_norm_eps = number_or(j, "rms_norm_eps", 1e-6, source);
  // The default of every config class; a multimodal checkpoint's top-level value rules (transformers ties
  // through the outer model's config).
  c.tie_word_embeddings = bool_or(file, "tie_word_embeddings", bool_or(j, "tie_word_embeddings", false, source), source);
  if (j.contains("hidden_act") && !j["hidden_act"].is_null()) {
    if (j["hidden_act"] == "gelu_pytorch_tanh") c.mlp_activation = MlpActivation::GeluTanh;
    else if (j["hidden_act"] != "silu")
      fail("{}: hidden_act {} is not supported; spindle implements silu (SwiGLU) and gelu_pytorch_tanh (GeGLU)",
           source, j["hidden_act"].dump());
  }
  if (bool_or(j, "mlp_bias", false, source)) fail("{}: mlp_bias = true is not supported", source);
  if (bool_or(j, "use_sliding_window", false, source))
    fail("{}: use_sliding_window = true is not supported; spindle trains with full attention", source);
  if (j.contains("pretraining_tp") && j["pretraining_tp"].is_number_integer() && j["pretraining_tp"].get<int>() != 1)
    fail("{}: pretraining_tp {} is not supported (set it to 1)", source, j["pretraining_tp"].get<int>());
  std::tie(c.rope, c.sliding_rope) = family.read_rope ? family.read_rope(j, source) : read_rope(j, source);
  family.read_config(j, c, source);
  if (c.sliding_rope && c.sliding_rope->partial_rotary_factor != c.rope.partial_rotary_factor)
    fail("{}: the sliding layers' RoPE rotates another share of the head ({} against {}); spindle supports one",
         source, c.sliding_rope->partial_rotary_factor, c.rope.partial_rotary_factor);
  if (c.rotary_dim() < 2 || c.rotary_dim() % 2)
    fail("{}: RoPE would rotate {} of the {} head dims (partial_rotary_factor {}); it needs an even number", source,
         c.rotary_dim(), c.head_dim, c.rope.partial_rotary_factor);
  check_longrope_lengths(c.rope, c, source);
  if (c.sliding_rope) check_longrope_lengths(*c.sliding_rope, c, source);
  SPINDLE_CHECK(static_cast<int64_t>(c.layer_kinds.size()) == c.num_layers, "{}: family {} gave {} layer kinds for {} layers",
                source, c.model_type, c.layer_kinds.size(), c.num_layers);
  SPINDLE_CHECK(c.attention_specs.empty() || static_cast<int64_t>(c.attention_specs.size()) == c.num_layers,
                "{}: family {} gave {} attention specs for {} layers", source, c.model_type, c.attention_specs.size(),
                c.num_layers);
  for (const AttentionSpec& spec : c.attention_specs)
    SPINDLE_CHECK(!spec.sliding_rope || c.sliding_rope, "{}: a layer uses the sliding layers' RoPE, which {} did not set",
                  source, c.model_type);
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.layer_kind(l).feed_forward == FeedForwardKind::MixtureOfExperts && c.mlp_activation != MlpActivation::SiLU)
      fail("{}: routed experts with hidden_act gelu_pytorch_tanh are not supported; spindle's experts use silu", source);
  for (int64_t l = 0; l < c.num_layers; ++l)
    if (c.layer_kind(l).feed_forward == FeedForwardKind::SwiGLU && c.intermediate_size <= 0)
      fail("{}: missing \"intermediate_size\"; is this a Hugging Face config.json? (layer {} has a dense MLP)",
           source, l);
  return c;
}

ModelConfig ModelConfig::from_file(const std::string& path) {
  std::filesystem::path p(path);
  if (std::filesystem::is_directory(p)) p /= "config.json";
  std::ifstream in(p);
  if (!in) fail("cannot open {}: pass --model a Hugging Face model folder holding config.json", p.string());
  json j;
  try {
    in >> j;
  } catch (const json::exception& e) {
    fail("{}: not valid JSON ({})", p.string(), e.what());
  }
  return from_json(j, p.string());
}

LayerKind ModelConfig::layer_kind(int64_t layer) const {
  SPINDLE_CHECK(layer >= 0 && layer < num_layers, "layer {} of a {}-layer model", layer, num_layers);
  if (layer_kinds.empty()) return LayerKind{};
  SPINDLE_CHECK(static_cast<int64_t>(layer_kinds.size()) == num_layers, "{} layer kinds for {} layers",
                layer_kinds.size(), num_layers);
  return layer_kinds[static_cast<size_t>(layer)];
}

int64_t ModelConfig::parameter_count() const { return count_parameters(*this).total; }

AttentionSpec ModelConfig::attention_spec(int64_t layer) const {
  SPINDLE_CHECK(layer >= 0 && layer < num_layers, "layer {} of a {}-layer model", layer, num_layers);
  AttentionSpec spec = attention_specs.empty() ? AttentionSpec{} : attention_specs.at(static_cast<size_t>(layer));
  if (spec.scale == 0) spec.scale = 1.0 / std::sqrt(static_cast<double>(head_dim));
  return spec;
}

std::vector<float> rope_inverse_frequencies(const ModelConfig& config) {
  return rope_inverse_frequencies(config.rope, config.rotary_dim());  // transformers: int(head_dim · partial_rotary_factor)
}

int64_t RopeConfig::table_key(int64_t length) const {
  if (type == "longrope") return length > original_max_position_embeddings ? 1 : 0;
  if (type == "dynamic") return length > original_max_position_embeddings ? length : 0;
  return 0;
}

std::vector<float> rope_inverse_frequencies(const RopeConfig& rope, int64_t dim, int64_t length) {
  std::vector<float> inv(dim / 2);
  float base = static_cast<float>(rope.theta);
  if (rope.type == "dynamic" && rope.table_key(length) != 0) {
    // transformers' _compute_dynamic_ntk_parameters on a sequence longer than max_position_embeddings
    // M, in its fp32 tensor steps: θ' = θ·(factor·L/M − (factor − 1))^(d/(d−2)), the power taken in
    // double (torch's pow of an fp32 tensor by a Python float) and rounded to fp32.
    const float grown = static_cast<float>(rope.factor) * static_cast<float>(length) /
                            static_cast<float>(rope.original_max_position_embeddings) -
                        static_cast<float>(rope.factor - 1.0);
    const double exponent = static_cast<double>(dim) / static_cast<double>(dim - 2);
    base = base * static_cast<float>(std::pow(static_cast<double>(grown), exponent));
  }
  for (int64_t i = 0; i < dim / 2; ++i) {
    const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
    inv[i] = 1.0f / std::pow(base, exponent);
  }
  if (rope.type == "longrope") {
    // transformers' _compute_longrope_parameters: 1 / (ext_i · θ^(2i/d)), ext the long factors for a
    // sequence longer than original_max_position_embeddings, the short ones otherwise.
    const std::vector<double>& ext = rope.table_key(length) ? rope.long_factor : rope.short_factor;
    SPINDLE_CHECK(static_cast<int64_t>(ext.size()) == dim / 2, "longrope: {} factors for {} rotated dims", ext.size(),
                  dim);
    for (int64_t i = 0; i < dim / 2; ++i) {
      const float exponent = static_cast<float>(2 * i) / static_cast<float>(dim);
      inv[i] = 1.0f / (static_cast<float>(ext[i]) * std::pow(base, exponent));
    }
  } else if (rope.type == "yarn") {
    // transformers' _compute_yarn_parameters, in its fp32 steps: dims below `low` keep their frequency
    // (extrapolation), dims above `high` are divided by the factor (interpolation), a linear ramp
    // between; low and high are where a wavelength makes beta_fast and beta_slow turns in the
    // original context.
    const double d = static_cast<double>(dim), base_d = rope.theta,
                 original = static_cast<double>(rope.original_max_position_embeddings);
    auto correction_dim = [&](double rotations) {
      return d * std::log(original / (rotations * 2 * M_PI)) / (2 * std::log(base_d));
    };
    double low = correction_dim(rope.beta_fast), high = correction_dim(rope.beta_slow);
    if (rope.truncate) {
      low = std::floor(low);
      high = std::ceil(high);
    }
    low = std::max(low, 0.0);
    high = std::min(high, d - 1);
    if (low == high) high += 0.001;
    const float factor = static_cast<float>(rope.factor);
    for (int64_t i = 0; i < dim / 2; ++i) {
      const float pos_freq = std::pow(static_cast<float>(rope.theta), static_cast<float>(2 * i) / static_cast<float>(dim));
      const float extrapolation = 1.0f / pos_freq, interpolation = 1.0f / (factor * pos_freq);
      const float ramp = std::clamp((static_cast<float>(i) - static_cast<float>(low)) / static_cast<float>(high - low),
                                    0.0f, 1.0f);
      const float keep = 1.0f - ramp;  // the share of the original frequency
      inv[i] = interpolation * (1.0f - keep) + extrapolation * keep;
    }
  } else if (rope.type == "linear") {
    for (float& f : inv) f = f / static_cast<float>(rope.factor);
  } else if (rope.type == "llama3") {
    // Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    const double old_len = static_cast<double>(rope.original_max_position_embeddings);
    const double low_wavelen = old_len / rope.low_freq_factor, high_wavelen = old_len / rope.high_freq_factor;
    const float factor = static_cast<float>(rope.factor);
    for (float& f : inv) {
      const float wavelen = 2.0f * static_cast<float>(M_PI) / f;
      const float scaled = wavelen > low_wavelen ? f / factor : f;
      if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
        const float smooth = (static_cast<float>(old_len) / wavelen - static_cast<float>(rope.low_freq_factor)) /
                             static_cast<float>(rope.high_freq_factor - rope.low_freq_factor);
        f = (1.0f - smooth) * scaled / factor + smooth * scaled;
      } else {
        f = scaled;
      }
    }
  }
  return inv;
}

}  // namespace spindle
