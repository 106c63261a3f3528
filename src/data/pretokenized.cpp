#include "data/pretokenized.h"

#include <cmath>
#include <limits>

namespace spindle {

namespace {

using json = nlohmann::json;

const json& require_array(const json& sample, const char* field) {
  const json& value = sample.at(field);
  if (!value.is_array())
    bad_sample("field '{}' must be an array of integers, found a JSON {}", field, value.type_name());
  return value;
}

int64_t integer_at(const json& array, const char* field, size_t index) {
  const json& value = array[index];
  if (value.is_number_integer()) {
    if (value.is_number_unsigned()) {
      uint64_t u = value.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        bad_sample("{}[{}] = {} is out of range", field, index, u);
      return static_cast<int64_t>(u);
    }
    return value.get<int64_t>();
  }
  bad_sample("{}[{}] must be an integer, found {} ({})", field, index, value.dump(),
             value.type_name());
}

void check_length(const json& array, const char* field, size_t expected) {
  if (array.size() != expected)
    bad_sample("field '{}' has {} entries but 'input_ids' has {}; they must align token by token",
               field, array.size(), expected);
}

}  // namespace

bool is_pretokenized(const nlohmann::json& sample) { return sample.contains("input_ids"); }

Document parse_pretokenized(const nlohmann::json& sample, const ReadOptions& options) {
  if (!sample.is_object())
    bad_sample("expected a JSON object with 'input_ids', found a JSON {}", sample.type_name());
  if (!sample.contains("input_ids")) bad_sample("missing field 'input_ids'");
  const json& ids = require_array(sample, "input_ids");
  const size_t n = ids.size();
  if (n == 0) bad_sample("field 'input_ids' is empty; a sample needs at least one token");

  const int64_t id_limit =
      options.vocab_size > 0 ? options.vocab_size : int64_t{std::numeric_limits<int32_t>::max()} + 1;
  Document doc;
  doc.input_ids.resize(n);
  for (size_t i = 0; i < n; ++i) {
    int64_t id = integer_at(ids, "input_ids", i);
    if (id < 0 || id >= id_limit) {
      if (options.vocab_size > 0)
        bad_sample("input_ids[{}] = {} is outside the vocabulary [0, {}); was the data tokenized "
                   "with another tokenizer?",
                   i, id, options.vocab_size);
      bad_sample("input_ids[{}] = {} is not a valid token id (must be in [0, 2^31))", i, id);
    }
    doc.input_ids[i] = static_cast<int32_t>(id);
  }

  const bool has_labels = sample.contains("labels") && !sample["labels"].is_null();
  const bool has_mask = sample.contains("loss_mask") && !sample["loss_mask"].is_null();
  if (has_labels && has_mask)
    bad_sample("give either 'labels' or 'loss_mask', not both (they would have to agree token by "
               "token); drop one of them");

  doc.labels.resize(n);
  if (has_labels) {
    const json& labels = require_array(sample, "labels");
    check_length(labels, "labels", n);
    for (size_t i = 0; i < n; ++i) {
      int64_t label = integer_at(labels, "labels", i);
      if (label == kIgnoreIndex) {
        doc.labels[i] = kIgnoreIndex;
        continue;
      }
      if (label < 0 || label >= id_limit)
        bad_sample("labels[{}] = {} is neither -100 (not supervised) nor a valid token id", i, label);
      if (options.require_labels_match_input_ids && label != doc.input_ids[i])
        bad_sample("labels[{}] = {} differs from input_ids[{}] = {}; labels must be a copy of "
                   "input_ids with -100 where not supervised (Hugging Face alignment). Do not "
                   "shift them: spindle shifts labels itself",
                   i, label, i, doc.input_ids[i]);
      doc.labels[i] = static_cast<int32_t>(label);
    }
  } else if (has_mask) {
    const json& mask = sample.at("loss_mask");
    if (!mask.is_array())
      bad_sample("field 'loss_mask' must be an array of 0/1, found a JSON {}", mask.type_name());
    check_length(mask, "loss_mask", n);
    for (size_t i = 0; i < n; ++i) {
      const json& m = mask[i];
      bool supervised;
      if (m.is_boolean()) {
        supervised = m.get<bool>();
      } else if (m.is_number_integer() && (m.get<int64_t>() == 0 || m.get<int64_t>() == 1)) {
        supervised = m.get<int64_t>() == 1;
      } else {
        bad_sample("loss_mask[{}] = {} must be 0 or 1 (use 'loss_scale' for weights)", i, m.dump());
      }
      doc.labels[i] = supervised ? doc.input_ids[i] : kIgnoreIndex;
    }
  } else {
    doc.labels = doc.input_ids;
  }

  if (sample.contains("loss_scale") && !sample["loss_scale"].is_null()) {
    const json& scale = sample.at("loss_scale");
    if (!scale.is_array())
      bad_sample("field 'loss_scale' must be an array of numbers (one per token), found a JSON {}",
                 scale.type_name());
    check_length(scale, "loss_scale", n);
    doc.loss_scale.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const json& s = scale[i];
      if (!s.is_number())
        bad_sample("loss_scale[{}] must be a number, found {} ({})", i, s.dump(), s.type_name());
      double value = s.get<double>();
      if (!std::isfinite(value) || value < 0)
        bad_sample("loss_scale[{}] = {} must be finite and >= 0", i, value);
      doc.loss_scale[i] = static_cast<float>(value);
    }
  }

  if (sample.contains("attention_mask") && !sample["attention_mask"].is_null()) {
    const json& attention = sample.at("attention_mask");
    if (!attention.is_array())
      bad_sample("field 'attention_mask' must be an array, found a JSON {}", attention.type_name());
    check_length(attention, "attention_mask", n);
    for (size_t i = 0; i < n; ++i)
      if (attention[i] != 1 && attention[i] != true)
        bad_sample("attention_mask[{}] = {}: padded samples are not accepted (padding would be "
                   "trained on as text); remove the padding tokens or the attention_mask field",
                   i, attention[i].dump());
  }
  return doc;
}

std::vector<Document> read_pretokenized_jsonl(const std::filesystem::path& path,
                                              const ReadOptions& options, ReadStats* stats) {
  ReadStats local;
  ReadStats& counters = stats ? *stats : local;
  std::vector<Document> documents;
  for_each_jsonl_sample(path, options, counters, [&](const nlohmann::json& sample, int64_t) {
    documents.push_back(parse_pretokenized(sample, options));
  });
  return documents;
}

}  // namespace spindle
