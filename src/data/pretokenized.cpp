#include "data/pretokenized.h"

#include <cctype>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>

namespace spindle {

namespace {

using json = nlohmann::json;

// The fields of a pre-tokenized sample, before validation. Both parsers (JSON tree and the fast
// line scanner) fill it, so every check and message lives in one place: validate().
struct RawPretokenized {
  std::vector<int64_t> input_ids;
  std::optional<std::vector<int64_t>> labels;
  std::optional<std::vector<int64_t>> loss_mask;  // bools as 0/1
  std::optional<std::vector<double>> loss_scale;
  std::optional<std::vector<int64_t>> attention_mask;  // bools as 0/1
};

void check_length(size_t size, const char* field, size_t expected) {
  if (size != expected)
    bad_sample("field '{}' has {} entries but 'input_ids' has {}; they must align token by token",
               field, size, expected);
}

Document validate(const RawPretokenized& raw, const ReadOptions& options) {
  const size_t n = raw.input_ids.size();
  if (n == 0) bad_sample("field 'input_ids' is empty; a sample needs at least one token");
  if (raw.labels && raw.loss_mask)
    bad_sample("give either 'labels' or 'loss_mask', not both (they would have to agree token by "
               "token); drop one of them");
  const int64_t id_limit = options.vocab_size > 0
                               ? options.vocab_size
                               : int64_t{std::numeric_limits<int32_t>::max()} + 1;
  Document doc;
  doc.input_ids.resize(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t id = raw.input_ids[i];
    if (id < 0 || id >= id_limit) {
      if (options.vocab_size > 0)
        bad_sample("input_ids[{}] = {} is outside the vocabulary [0, {}); was the data tokenized "
                   "with another tokenizer?",
                   i, id, options.vocab_size);
      bad_sample("input_ids[{}] = {} is not a valid token id (must be in [0, 2^31))", i, id);
    }
    doc.input_ids[i] = static_cast<int32_t>(id);
  }

  if (raw.labels) {
    check_length(raw.labels->size(), "labels", n);
    doc.labels.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t label = (*raw.labels)[i];
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
  } else if (raw.loss_mask) {
    check_length(raw.loss_mask->size(), "loss_mask", n);
    doc.labels.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const int64_t m = (*raw.loss_mask)[i];
      if (m != 0 && m != 1)
        bad_sample("loss_mask[{}] = {} must be 0 or 1 (use 'loss_scale' for weights)", i, m);
      doc.labels[i] = m ? doc.input_ids[i] : kIgnoreIndex;
    }
  } else {
    doc.labels = doc.input_ids;
  }

  if (raw.loss_scale) {
    check_length(raw.loss_scale->size(), "loss_scale", n);
    doc.loss_scale.resize(n);
    for (size_t i = 0; i < n; ++i) {
      const double value = (*raw.loss_scale)[i];
      if (!std::isfinite(value) || value < 0)
        bad_sample("loss_scale[{}] = {} must be finite and >= 0", i, value);
      doc.loss_scale[i] = static_cast<float>(value);
    }
  }

  if (raw.attention_mask) {
    check_length(raw.attention_mask->size(), "attention_mask", n);
    for (size_t i = 0; i < n; ++i)
      if ((*raw.attention_mask)[i] != 1)
        bad_sample("attention_mask[{}] = {}: padded samples are not accepted (padding would be "
                   "trained on as text); remove the padding tokens or the attention_mask field",
                   i, (*raw.attention_mask)[i]);
  }
  return doc;
}

// ---- from a JSON tree ----

const json& require_array(const json& sample, const char* field, const char* what) {
  const json& value = sample.at(field);
  if (!value.is_array())
    bad_sample("field '{}' must be an array of {}, found a JSON {}", field, what, value.type_name());
  return value;
}

bool present(const json& sample, const char* field) {
  auto it = sample.find(field);
  return it != sample.end() && !it->is_null();
}

std::vector<int64_t> integers(const json& sample, const char* field) {
  const json& array = require_array(sample, field, "integers");
  std::vector<int64_t> values(array.size());
  for (size_t i = 0; i < array.size(); ++i) {
    const json& value = array[i];
    if (value.is_number_unsigned()) {
      const uint64_t u = value.get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
        bad_sample("{}[{}] = {} is out of range", field, i, u);
      values[i] = static_cast<int64_t>(u);
    } else if (value.is_number_integer()) {
      values[i] = value.get<int64_t>();
    } else {
      bad_sample("{}[{}] must be an integer, found {} ({})", field, i, value.dump(), value.type_name());
    }
  }
  return values;
}

// 0/1 flags given as integers or booleans; validate() checks the integer values.
std::vector<int64_t> flags(const json& sample, const char* field, const char* hint) {
  const json& array = require_array(sample, field, "0/1");
  std::vector<int64_t> values(array.size());
  for (size_t i = 0; i < array.size(); ++i) {
    const json& m = array[i];
    if (m.is_boolean())
      values[i] = m.get<bool>() ? 1 : 0;
    else if (m.is_number_unsigned() &&
             m.get<uint64_t>() <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      values[i] = static_cast<int64_t>(m.get<uint64_t>());
    else if (m.is_number_integer() && !m.is_number_unsigned())
      values[i] = m.get<int64_t>();
    else
      bad_sample("{}[{}] = {} must be 0 or 1{}", field, i, m.dump(), hint);
  }
  return values;
}

// ---- fast line scanner ----

// Reads the common shape {"input_ids": [ints], "labels": [ints], ...} straight from the line,
// about ten times faster than building a JSON tree. It gives up (nullopt) on anything it does not
// fully understand — non-ASCII or control bytes in strings, numbers of the wrong kind, nulls,
// duplicate keys, fields of another format — and the caller then takes the JSON-tree path, which
// produces the exact error. So it never accepts a line the tree path would reject.
class FastScanner {
 public:
  explicit FastScanner(std::string_view line) : p_(line.data()), end_(line.data() + line.size()) {}

  std::optional<RawPretokenized> scan() {
    RawPretokenized raw;
    bool seen_ids = false;
    ws();
    if (!eat('{')) return std::nullopt;
    ws();
    if (eat('}')) return std::nullopt;  // no input_ids
    for (;;) {
      std::string_view key;
      if (!simple_string(key)) return std::nullopt;
      ws();
      if (!eat(':')) return std::nullopt;
      ws();
      if (key == "input_ids") {
        if (seen_ids || !int_array(raw.input_ids, false)) return std::nullopt;
        seen_ids = true;
      } else if (key == "labels") {
        if (!optional_int_array(raw.labels, false)) return std::nullopt;
      } else if (key == "loss_mask") {
        if (!optional_int_array(raw.loss_mask, true)) return std::nullopt;
      } else if (key == "attention_mask") {
        if (!optional_int_array(raw.attention_mask, true)) return std::nullopt;
      } else if (key == "loss_scale") {
        if (raw.loss_scale) return std::nullopt;
        raw.loss_scale.emplace();
        if (!double_array(*raw.loss_scale)) return std::nullopt;
      } else if (selects_another_format(key)) {
        return std::nullopt;
      } else if (!skip_value(0)) {
        return std::nullopt;
      }
      ws();
      if (eat(',')) {
        ws();
        continue;
      }
      if (!eat('}')) return std::nullopt;
      break;
    }
    ws();
    if (p_ != end_ || !seen_ids) return std::nullopt;
    return raw;
  }

 private:
  static bool selects_another_format(std::string_view key) {
    for (const char* name : {"messages", "conversations", "instruction", "prompt", "text", "chosen",
                             "rejected", "rejected_response"})
      if (key == name) return true;
    return false;
  }
  void ws() {
    while (p_ < end_ && (*p_ == ' ' || *p_ == '\t' || *p_ == '\n' || *p_ == '\r')) ++p_;
  }
  bool eat(char c) {
    if (p_ < end_ && *p_ == c) {
      ++p_;
      return true;
    }
    return false;
  }
  bool literal(std::string_view word) {
    if (static_cast<size_t>(end_ - p_) < word.size() || std::string_view(p_, word.size()) != word)
      return false;
    p_ += word.size();
    return true;
  }
  // A string of printable ASCII without escapes (every key spindle reads).
  bool simple_string(std::string_view& out) {
    if (!eat('"')) return false;
    const char* start = p_;
    while (p_ < end_ && *p_ != '"') {
      const auto c = static_cast<unsigned char>(*p_);
      if (c < 0x20 || c >= 0x80 || c == '\\') return false;
      ++p_;
    }
    if (p_ == end_) return false;
    out = std::string_view(start, p_ - start);
    ++p_;
    return true;
  }
  // Any string of ASCII with valid escapes; non-ASCII bytes are left to the UTF-8 check of the
  // tree parser.
  bool skip_string() {
    if (!eat('"')) return false;
    while (p_ < end_ && *p_ != '"') {
      const auto c = static_cast<unsigned char>(*p_);
      if (c < 0x20 || c >= 0x80) return false;
      if (c == '\\') {
        if (++p_ == end_) return false;
        if (*p_ == 'u') {
          // \uXXXX may encode a lone surrogate the tree parser rejects: leave those to it.
          if (end_ - p_ < 5) return false;
          for (int k = 1; k <= 4; ++k)
            if (!std::isxdigit(static_cast<unsigned char>(p_[k]))) return false;
          if (p_[1] == 'd' || p_[1] == 'D') return false;
          p_ += 4;
        } else if (std::string_view("\"\\/bfnrt").find(*p_) == std::string_view::npos) {
          return false;
        }
      }
      ++p_;
    }
    if (p_ == end_) return false;
    ++p_;
    return true;
  }
  // The JSON number grammar; `integer` is set when it has no fraction or exponent.
  bool number_span(std::string_view& out, bool& integer) {
    const char* start = p_;
    eat('-');
    if (p_ == end_ || !std::isdigit(static_cast<unsigned char>(*p_))) return false;
    if (*p_ == '0') {
      ++p_;
    } else {
      while (p_ < end_ && std::isdigit(static_cast<unsigned char>(*p_))) ++p_;
    }
    integer = true;
    if (p_ < end_ && *p_ == '.') {
      integer = false;
      ++p_;
      if (p_ == end_ || !std::isdigit(static_cast<unsigned char>(*p_))) return false;
      while (p_ < end_ && std::isdigit(static_cast<unsigned char>(*p_))) ++p_;
    }
    if (p_ < end_ && (*p_ == 'e' || *p_ == 'E')) {
      integer = false;
      ++p_;
      if (p_ < end_ && (*p_ == '+' || *p_ == '-')) ++p_;
      if (p_ == end_ || !std::isdigit(static_cast<unsigned char>(*p_))) return false;
      while (p_ < end_ && std::isdigit(static_cast<unsigned char>(*p_))) ++p_;
    }
    out = std::string_view(start, p_ - start);
    return true;
  }
  bool integer(int64_t& value) {
    std::string_view text;
    bool is_integer = false;
    if (!number_span(text, is_integer) || !is_integer) return false;
    auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
    return ec == std::errc() && ptr == text.data() + text.size();
  }
  bool int_array(std::vector<int64_t>& values, bool allow_bool) {
    if (!eat('[')) return false;
    ws();
    if (eat(']')) return true;
    for (;;) {
      int64_t value;
      if (allow_bool && literal("true")) {
        value = 1;
      } else if (allow_bool && literal("false")) {
        value = 0;
      } else if (!integer(value)) {
        return false;
      }
      values.push_back(value);
      ws();
      if (eat(']')) return true;
      if (!eat(',')) return false;
      ws();
    }
  }
  bool optional_int_array(std::optional<std::vector<int64_t>>& field, bool allow_bool) {
    if (field) return false;  // duplicate key
    field.emplace();
    return int_array(*field, allow_bool);
  }
  bool double_array(std::vector<double>& values) {
    if (!eat('[')) return false;
    ws();
    if (eat(']')) return true;
    for (;;) {
      std::string_view text;
      bool is_integer = false;
      if (!number_span(text, is_integer)) return false;
      double value;
      auto [ptr, ec] = std::from_chars(text.data(), text.data() + text.size(), value);
      if (ec != std::errc() || ptr != text.data() + text.size()) return false;
      values.push_back(value);
      ws();
      if (eat(']')) return true;
      if (!eat(',')) return false;
      ws();
    }
  }
  bool skip_value(int depth) {
    if (depth > 64 || p_ == end_) return false;
    switch (*p_) {
      case '"': return skip_string();
      case 't': return literal("true");
      case 'f': return literal("false");
      case 'n': return literal("null");
      case '[':
      case '{': {
        const bool object = *p_ == '{';
        ++p_;
        ws();
        if (eat(object ? '}' : ']')) return true;
        for (;;) {
          if (object) {
            if (!skip_string()) return false;
            ws();
            if (!eat(':')) return false;
            ws();
          }
          if (!skip_value(depth + 1)) return false;
          ws();
          if (eat(object ? '}' : ']')) return true;
          if (!eat(',')) return false;
          ws();
        }
      }
      default: {
        std::string_view text;
        bool is_integer = false;
        return number_span(text, is_integer);
      }
    }
  }

  const char* p_;
  const char* end_;
};

}  // namespace

bool is_pretokenized(const nlohmann::json& sample) { return sample.contains("input_ids"); }

Document parse_pretokenized(const nlohmann::json& sample, const ReadOptions& options) {
  if (!sample.is_object())
    bad_sample("expected a JSON object with 'input_ids', found a JSON {}", sample.type_name());
  if (!present(sample, "input_ids")) bad_sample("missing field 'input_ids'");
  RawPretokenized raw;
  raw.input_ids = integers(sample, "input_ids");
  if (present(sample, "labels")) raw.labels = integers(sample, "labels");
  if (present(sample, "loss_mask"))
    raw.loss_mask = flags(sample, "loss_mask", " (use 'loss_scale' for weights)");
  if (present(sample, "loss_scale")) {
    const json& scale = require_array(sample, "loss_scale", "numbers (one per token)");
    raw.loss_scale.emplace(scale.size());
    for (size_t i = 0; i < scale.size(); ++i) {
      if (!scale[i].is_number())
        bad_sample("loss_scale[{}] must be a number, found {} ({})", i, scale[i].dump(),
                   scale[i].type_name());
      (*raw.loss_scale)[i] = scale[i].get<double>();
    }
  }
  if (present(sample, "attention_mask"))
    raw.attention_mask = flags(sample, "attention_mask", ": padded samples are not accepted");
  return validate(raw, options);
}

std::optional<Document> parse_pretokenized_line(std::string_view line, const ReadOptions& options) {
  auto raw = FastScanner(line).scan();
  if (!raw) return std::nullopt;
  return validate(*raw, options);
}

std::vector<Document> read_pretokenized_jsonl(const std::filesystem::path& path,
                                              const ReadOptions& options, ReadStats* stats) {
  ReadStats local;
  ReadStats& counters = stats ? *stats : local;
  std::vector<Document> documents;
  for_each_jsonl_line(path, options, counters, [&](std::string_view line, int64_t) {
    if (auto doc = parse_pretokenized_line(line, options))
      documents.push_back(std::move(*doc));
    else
      documents.push_back(parse_pretokenized(parse_jsonl_line(line), options));
  });
  return documents;
}

}  // namespace spindle
