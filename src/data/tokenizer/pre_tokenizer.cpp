#include "data/tokenizer/pre_tokenizer.h"


#include <algorithm>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer/utf8.h"

namespace spindle::tokenizer {

namespace {

// GPT-2's pattern, which ByteLevel(use_regex=true) applies.
constexpr const char* kByteLevelPattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

SplitBehavior behavior_from_json(const nlohmann::json& value) {
  const std::string name = value.is_string() ? value.get<std::string>() : value.dump();
  if (name == "Removed") return SplitBehavior::kRemoved;
  if (name == "Isolated") return SplitBehavior::kIsolated;
  if (name == "MergedWithPrevious") return SplitBehavior::kMergedWithPrevious;
  if (name == "MergedWithNext") return SplitBehavior::kMergedWithNext;
  if (name == "Contiguous") return SplitBehavior::kContiguous;
  fail("tokenizer.json: Split behavior '{}' is unknown (expected Removed, Isolated, MergedWithPrevious, "
       "MergedWithNext or Contiguous)",
       name);
}

bool bool_field(const nlohmann::json& config, const char* name, bool fallback) {
  if (!config.contains(name) || config[name].is_null()) return fallback;
  if (!config[name].is_boolean()) fail("tokenizer.json: field \"{}\" must be true or false, got {}", name, config[name].dump());
  return config[name].get<bool>();
}

struct Segment {
  uint32_t begin, end;
  bool is_match;
};

// HF tokenizers' SplitDelimiterBehavior, on the segments (matches and the gaps between them).
void apply_behavior(std::vector<Segment>& segments, SplitBehavior behavior) {
  std::vector<Segment> out;
  out.reserve(segments.size());
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      return;
    case SplitBehavior::kRemoved:
      for (const Segment& s : segments)
        if (!s.is_match) out.push_back(s);
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (const Segment& s : segments) {
        if (s.is_match && !previous_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        previous_match = s.is_match;
      }
      break;
    case SplitBehavior::kMergedWithNext:
      for (auto it = segments.rbegin(); it != segments.rend(); ++it) {
        if (it->is_match && !previous_match && !out.empty())
          out.back().begin = it->begin;
        else
          out.push_back(*it);
        previous_match = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      break;
    case SplitBehavior::kContiguous:
      for (const Segment& s : segments) {
        if (s.is_match == previous_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        previous_match = s.is_match;
      }
      break;
  }
  segments.swap(out);
}

}  // namespace

PreTokenizer PreTokenizer::from_json(const nlohmann::json& config) {
  PreTokenizer pre_tokenizer;
  pre_tokenizer.add_from_json(config);
  return pre_tokenizer;
}

void PreTokenizer::add_from_json(const nlohmann::json& config) {
  if (config.is_null()) return;
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string())
    fail("tokenizer.json: a pre_tokenizer must be an object with a string \"type\", got {}", config.dump().substr(0, 200));
  const std::string type = config["type"].get<std::string>();
  if (has_byte_level_)
    fail("tokenizer.json: pre-tokenizer '{}' comes after ByteLevel; spindle supports ByteLevel only as the last "
         "pre-tokenizer (as Qwen and Llama 3 use it)",
         type);
  if (metaspace_)
    fail("tokenizer.json: pre-tokenizer '{}' comes after Metaspace; spindle supports Metaspace only as the only "
         "pre-tokenizer (as the Llama, Mistral and Phi SentencePiece conversions write it)",
         type);
  if (type == "Sequence") {
    if (!config.contains("pretokenizers") || !config["pretokenizers"].is_array())
      fail("tokenizer.json: a Sequence pre_tokenizer needs a \"pretokenizers\" array");
    for (const auto& inner : config["pretokenizers"]) add_from_json(inner);
  } else if (type == "Split") {
    if (!config.contains("pattern"))
      fail("tokenizer.json: a Split pre_tokenizer needs a \"pattern\" ({{\"Regex\": ...}} or {{\"String\": ...}})");
    Step step;
    step.kind = Step::Kind::kSplit;
    step.regex = Regex::from_json(config["pattern"], "Split pre_tokenizer");
    step.behavior = behavior_from_json(config.value("behavior", nlohmann::json("Isolated")));
    step.invert = bool_field(config, "invert", false);
    steps_.push_back(std::move(step));
  } else if (type == "ByteLevel") {
    has_byte_level_ = true;
    if (bool_field(config, "add_prefix_space", true)) {
      Step step;
      step.kind = Step::Kind::kPrefixSpace;
      steps_.push_back(std::move(step));
    }
    if (bool_field(config, "use_regex", true)) {
      Step step;
      step.kind = Step::Kind::kSplit;
      step.regex = std::make_shared<Regex>(kByteLevelPattern, false);
      steps_.push_back(std::move(step));
    }
  } else if (type == "Metaspace") {
    if (!steps_.empty())
      fail("tokenizer.json: a Metaspace pre-tokenizer after other pre-tokenizers is not supported; spindle supports "
           "Metaspace as the only pre-tokenizer (as the Llama, Mistral and Phi SentencePiece conversions write it)");
    Metaspace metaspace;
    if (!config.contains("replacement") || !config["replacement"].is_string())
      fail("tokenizer.json: a Metaspace pre_tokenizer needs a one-character string \"replacement\"");
    metaspace.replacement = config["replacement"].get<std::string>();
    size_t length = 0;
    if (!metaspace.replacement.empty() && find_invalid_utf8(metaspace.replacement) == std::string::npos)
      next_code_point(metaspace.replacement, length);
    if (metaspace.replacement.empty() || length != metaspace.replacement.size())
      fail("tokenizer.json: Metaspace \"replacement\" must be one character, got \"{}\"", metaspace.replacement);
    const std::string scheme =
        config.contains("prepend_scheme") && config["prepend_scheme"].is_string() ? config["prepend_scheme"].get<std::string>() : "always";
    if (scheme == "always")
      metaspace.scheme = PrependScheme::kAlways;
    else if (scheme == "first")
      metaspace.scheme = PrependScheme::kFirst;
    else if (scheme == "never")
      metaspace.scheme = PrependScheme::kNever;
    else
      fail("tokenizer.json: Metaspace prepend_scheme '{}' is unknown (expected always, first or never)", scheme);
    // Files written before prepend_scheme existed say add_prefix_space; HF accepts false only
    // together with the scheme "never".
    if (config.contains("add_prefix_space") && config["add_prefix_space"].is_boolean() &&
        !config["add_prefix_space"].get<bool>()) {
      if (metaspace.scheme != PrependScheme::kNever)
        fail("tokenizer.json: Metaspace add_prefix_space=false does not match prepend_scheme '{}' (HF refuses this "
             "file too)",
             scheme);
    }
    metaspace.split = bool_field(config, "split", true);
    metaspace_ = std::move(metaspace);
  } else {
    fail("tokenizer.json: pre_tokenizer type '{}' is not supported (spindle supports Split, ByteLevel, Metaspace and "
         "Sequence)",
         type);
  }
}

void PreTokenizer::metaspace_split(std::string_view text, bool at_input_start, std::vector<Piece>& pieces) const {
  const Metaspace& metaspace = *metaspace_;
  const std::string_view marker = metaspace.replacement;
  const bool starts_with_marker = text[0] == ' ' || text.starts_with(marker);
  bool prefixed = false;
  if (metaspace.scheme == PrependScheme::kAlways) prefixed = !starts_with_marker;
  if (metaspace.scheme == PrependScheme::kFirst) prefixed = !starts_with_marker && at_input_start;
  if (!metaspace.split) {
    pieces.push_back({0, static_cast<uint32_t>(text.size()), prefixed});
    return;
  }
  // Each space (a marker once replaced) and each marker starts a piece (HF: split on the
  // replacement, MergedWithNext); the prefix is a marker that starts the first piece.
  uint32_t begin = 0;
  for (size_t at = 0; at < text.size();) {
    const size_t length = text[at] == ' ' ? 1 : text.substr(at).starts_with(marker) ? marker.size() : 0;
    if (length == 0) {
      ++at;
      continue;
    }
    if (at > begin) {
      pieces.push_back({begin, static_cast<uint32_t>(at), prefixed});
      prefixed = false;
      begin = static_cast<uint32_t>(at);
    }
    at += length;
  }
  pieces.push_back({begin, static_cast<uint32_t>(text.size()), prefixed});
}

void PreTokenizer::split(std::string_view text, bool at_input_start, std::vector<Piece>& pieces) const {
  pieces.clear();
  if (text.empty()) return;
  if (metaspace_) {
    metaspace_split(text, at_input_start, pieces);
    return;
  }
  pieces.push_back({0, static_cast<uint32_t>(text.size()), false});
  thread_local std::vector<Piece> next;
  thread_local std::vector<std::pair<uint32_t, uint32_t>> matches;
  thread_local std::vector<Segment> segments;
  thread_local std::string with_prefix;
  for (const Step& step : steps_) {
    if (step.kind == Step::Kind::kPrefixSpace) {
      for (Piece& piece : pieces)
        if (!piece.prefixed && piece.begin < piece.end && text[piece.begin] != ' ') piece.prefixed = true;
      continue;
    }
    next.clear();
    for (const Piece& piece : pieces) {
      std::string_view subject = text.substr(piece.begin, piece.end - piece.begin);
      if (piece.prefixed) {
        with_prefix.assign(1, ' ');
        with_prefix.append(subject);
        subject = with_prefix;
      }
      matches.clear();
      step.regex->find_all(subject, matches);
      segments.clear();
      uint32_t previous = 0;
      for (const auto& [begin, end] : matches) {
        if (previous != begin) segments.push_back({previous, begin, step.invert});
        segments.push_back({begin, end, !step.invert});
        previous = end;
      }
      if (previous != subject.size()) segments.push_back({previous, static_cast<uint32_t>(subject.size()), step.invert});
      apply_behavior(segments, step.behavior);
      // Back to offsets in `text`; the virtual space, if any, is byte 0 of the subject.
      const uint32_t shift = piece.prefixed ? 1 : 0;
      for (const Segment& s : segments) {
        if (s.end == s.begin) continue;
        if (shift && s.begin == 0)
          next.push_back({piece.begin, piece.begin + s.end - 1, true});
        else
          next.push_back({piece.begin + s.begin - shift, piece.begin + s.end - shift, false});
      }
    }
    pieces.swap(next);
  }
}

}  // namespace spindle::tokenizer
