#include "data/tokenizer/normalizer.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include "core/error.h"
#include "data/tokenizer/regex.h"
#include "data/tokenizer/utf8.h"

namespace spindle::tokenizer {

namespace {

// Code points that a normalization form may change or combine with a neighbour. Every other code
// point is a starter that stays as it is and never combines with what precedes it, so text can be
// cut before it and each piece normalized on its own (UAX #15 normalization boundaries). Most
// text (ASCII, CJK ideographs, most letters) has none of them, which keeps normalization cheap.
class SensitiveCodePoints {
 public:
  static const SensitiveCodePoints& get() {
    static const SensitiveCodePoints table;
    return table;
  }
  bool contains(char32_t cp) const { return bits_[cp >> 6] >> (cp & 63) & 1; }

 private:
  SensitiveCodePoints() : bits_(0x110000 / 64, 0) {
    for (char32_t cp = 0x80; cp < 0x110000; ++cp) {
      const utf8proc_property_t* property = utf8proc_get_property(static_cast<utf8proc_int32_t>(cp));
      // utf8proc 2.8 marks the possible second code point of a composition with bit 15 of comb_index.
      const bool second_of_pair = property->comb_index != UINT16_MAX && (property->comb_index & 0x8000);
      const bool hangul = (cp >= 0x1100 && cp <= 0x11FF) || (cp >= 0xAC00 && cp <= 0xD7A3);
      if (property->combining_class != 0 || property->decomp_seqindex != UINT16_MAX || second_of_pair || hangul)
        bits_[cp >> 6] |= uint64_t{1} << (cp & 63);
    }
  }
  std::vector<uint64_t> bits_;
};

utf8proc_option_t options_of(Normalizer::Form form) {
  const int stable = UTF8PROC_STABLE;
  switch (form) {
    case Normalizer::Form::kNFC: return static_cast<utf8proc_option_t>(stable | UTF8PROC_COMPOSE);
    case Normalizer::Form::kNFD: return static_cast<utf8proc_option_t>(stable | UTF8PROC_DECOMPOSE);
    case Normalizer::Form::kNFKC: return static_cast<utf8proc_option_t>(stable | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
    case Normalizer::Form::kNFKD: return static_cast<utf8proc_option_t>(stable | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  }
  return UTF8PROC_STABLE;
}

}  // namespace

Normalizer Normalizer::from_json(const nlohmann::json& config) {
  Normalizer normalizer;
  normalizer.add_from_json(config);
  for (const Step& step : normalizer.steps_)
    if (step.kind == Step::Kind::kForms) SensitiveCodePoints::get();  // build the table at load, not mid-encode
  return normalizer;
}

void Normalizer::add_from_json(const nlohmann::json& config) {
  if (config.is_null()) return;
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string())
    fail("tokenizer.json: a normalizer must be an object with a string \"type\", got {}", config.dump());
  const std::string type = config["type"].get<std::string>();
  auto add_form = [&](Form form) {
    // Consecutive forms share one step: each changed stretch goes through all of them at once.
    if (steps_.empty() || steps_.back().kind != Step::Kind::kForms) steps_.push_back(Step{});
    steps_.back().forms.push_back(form);
  };
  if (type == "NFC") {
    add_form(Form::kNFC);
  } else if (type == "NFD") {
    add_form(Form::kNFD);
  } else if (type == "NFKC") {
    add_form(Form::kNFKC);
  } else if (type == "NFKD") {
    add_form(Form::kNFKD);
  } else if (type == "Sequence") {
    if (!config.contains("normalizers") || !config["normalizers"].is_array())
      fail("tokenizer.json: a Sequence normalizer needs a \"normalizers\" array");
    for (const auto& inner : config["normalizers"]) add_from_json(inner);
  } else if (type == "Replace") {
    if (!config.contains("pattern") || !config.contains("content") || !config["content"].is_string())
      fail("tokenizer.json: a Replace normalizer needs a \"pattern\" and a string \"content\", got {}", config.dump());
    Step step;
    step.kind = Step::Kind::kReplace;
    step.pattern = Regex::from_json(config["pattern"], "Replace normalizer");
    step.content = config["content"].get<std::string>();
    require_valid_utf8(step.content, "Replace normalizer content");
    steps_.push_back(std::move(step));
  } else if (type == "Prepend") {
    if (!config.contains("prepend") || !config["prepend"].is_string())
      fail("tokenizer.json: a Prepend normalizer needs a string \"prepend\", got {}", config.dump());
    Step step;
    step.kind = Step::Kind::kPrepend;
    step.content = config["prepend"].get<std::string>();
    require_valid_utf8(step.content, "Prepend normalizer text");
    steps_.push_back(std::move(step));
  } else {
    fail("tokenizer.json: normalizer type '{}' is not supported (spindle supports NFC, NFD, NFKC, NFKD, Replace, "
         "Prepend and Sequence of them); use a tokenizer without it or extend src/data/tokenizer/normalizer.cpp",
         type);
  }
}

bool Normalizer::apply_forms(const std::vector<Form>& forms, std::string_view text, std::string& out,
                             std::vector<NormalizedText::Chunk>& chunks) const {
  auto normalized_forms = [&](std::string_view segment) {
    std::string current(segment);
    for (Form form : forms) {
      utf8proc_uint8_t* result = nullptr;
      const utf8proc_ssize_t length =
          utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(current.data()),
                       static_cast<utf8proc_ssize_t>(current.size()), &result, options_of(form));
      std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(result, &std::free);
      if (length < 0) fail("Unicode normalization failed: {}", utf8proc_errmsg(length));
      current.assign(reinterpret_cast<const char*>(result), static_cast<size_t>(length));
    }
    return current;
  };
  const SensitiveCodePoints& sensitive = SensitiveCodePoints::get();
  bool changed = false;
  size_t copied_up_to = 0;    // text bytes before this are already in out
  size_t previous_start = 0;  // start of the code point before pos: the starter a mark may attach to
  size_t pos = 0;
  while (pos < text.size()) {
    if (static_cast<unsigned char>(text[pos]) < 0x80) {
      previous_start = pos++;
      continue;
    }
    const size_t start = pos;
    const char32_t cp = next_code_point(text, pos);
    if (!sensitive.contains(cp)) {
      previous_start = start;
      continue;
    }
    // A stretch that may change: the starter before it, then every sensitive code point after it.
    const size_t stretch_begin = std::max(copied_up_to, start > 0 ? previous_start : start);
    size_t stretch_end = pos;
    while (stretch_end < text.size() && static_cast<unsigned char>(text[stretch_end]) >= 0x80) {
      size_t next = stretch_end;
      if (!sensitive.contains(next_code_point(text, next))) break;
      stretch_end = next;
    }
    const std::string_view stretch = text.substr(stretch_begin, stretch_end - stretch_begin);
    std::string normalized = normalized_forms(stretch);
    if (normalized != stretch) {
      if (copied_up_to < stretch_begin) {
        const size_t at = out.size();
        out.append(text.substr(copied_up_to, stretch_begin - copied_up_to));
        chunks.push_back({at, out.size(), copied_up_to, stretch_begin, true});
      }
      const size_t at = out.size();
      out.append(normalized);
      chunks.push_back({at, out.size(), stretch_begin, stretch_end, false});
      copied_up_to = stretch_end;
      changed = true;
    }
    pos = stretch_end;
    previous_start = stretch_end;  // the next code point is a starter: nothing attaches across
  }
  if (changed && copied_up_to < text.size()) {
    const size_t at = out.size();
    out.append(text.substr(copied_up_to));
    chunks.push_back({at, out.size(), copied_up_to, text.size(), true});
  }
  return changed;
}

bool Normalizer::apply_replace(const Step& step, std::string_view text, std::string& out,
                               std::vector<NormalizedText::Chunk>& chunks) {
  thread_local std::vector<std::pair<uint32_t, uint32_t>> matches;
  matches.clear();
  if (const std::string* literal = step.pattern->literal()) {
    for (size_t at = text.find(*literal); at != std::string_view::npos; at = text.find(*literal, at + literal->size()))
      matches.emplace_back(static_cast<uint32_t>(at), static_cast<uint32_t>(at + literal->size()));
  } else {
    step.pattern->find_all(text, matches);
  }
  if (matches.empty()) return false;
  size_t copied_up_to = 0;
  for (const auto& [begin, end] : matches) {
    if (copied_up_to < begin) {
      const size_t at = out.size();
      out.append(text.substr(copied_up_to, begin - copied_up_to));
      chunks.push_back({at, out.size(), copied_up_to, begin, true});
    }
    // The replacement stands for the matched stretch (HF aligns each new character to it).
    if (!step.content.empty()) {
      const size_t at = out.size();
      out.append(step.content);
      chunks.push_back({at, out.size(), begin, end, false});
    }
    copied_up_to = end;
  }
  if (copied_up_to < text.size()) {
    const size_t at = out.size();
    out.append(text.substr(copied_up_to));
    chunks.push_back({at, out.size(), copied_up_to, text.size(), true});
  }
  return true;
}

bool Normalizer::apply_prepend(const Step& step, std::string_view text, std::string& out,
                               std::vector<NormalizedText::Chunk>& chunks) {
  // HF prepends to non-empty text only, and aligns the prefix with the first character.
  if (text.empty() || step.content.empty()) return false;
  size_t first_end = 0;
  next_code_point(text, first_end);
  out.append(step.content);
  chunks.push_back({0, out.size(), 0, first_end, false});
  out.append(text);
  chunks.push_back({step.content.size(), out.size(), 0, text.size(), true});
  return true;
}

std::string Normalizer::normalize(std::string_view text) const {
  NormalizedText normalized;
  normalize(text, 0, normalized);
  return std::string(normalized.text());
}

void Normalizer::normalize(std::string_view text, size_t origin, NormalizedText& out) const {
  out.original_ = text;
  out.origin_ = origin;
  out.changed_ = false;
  out.storage_.clear();
  out.chunks_.clear();
  thread_local std::string result;
  thread_local std::vector<NormalizedText::Chunk> chunks;
  for (const Step& step : steps_) {
    result.clear();
    chunks.clear();
    bool changed = false;
    switch (step.kind) {
      case Step::Kind::kForms: changed = apply_forms(step.forms, out.text(), result, chunks); break;
      case Step::Kind::kReplace: changed = apply_replace(step, out.text(), result, chunks); break;
      case Step::Kind::kPrepend: changed = apply_prepend(step, out.text(), result, chunks); break;
    }
    if (changed) out.compose(result, chunks);
  }
}

void NormalizedText::compose(std::string& text, const std::vector<Chunk>& chunks) {
  thread_local std::vector<Chunk> composed;
  composed.clear();
  for (const Chunk& local : chunks) {
    if (local.normalized_begin == local.normalized_end) continue;
    if (!changed_) {
      composed.push_back({local.normalized_begin, local.normalized_end, origin_ + local.original_begin,
                          origin_ + local.original_end, local.exact});
      continue;
    }
    if (!local.exact) {
      composed.push_back({local.normalized_begin, local.normalized_end, original_begin(local.original_begin),
                          original_end(local.original_end), false});
      continue;
    }
    // An unchanged stretch of the current text: it keeps the current mapping, chunk by chunk.
    auto chunk = std::upper_bound(chunks_.begin(), chunks_.end(), local.original_begin,
                                  [](size_t p, const Chunk& c) { return p < c.normalized_end; });
    for (; chunk != chunks_.end() && chunk->normalized_begin < local.original_end; ++chunk) {
      const size_t from = std::max(local.original_begin, chunk->normalized_begin);
      const size_t to = std::min(local.original_end, chunk->normalized_end);
      if (from >= to) continue;
      const size_t begin = local.normalized_begin + (from - local.original_begin);
      const size_t end = begin + (to - from);
      if (chunk->exact)
        composed.push_back({begin, end, chunk->original_begin + (from - chunk->normalized_begin),
                            chunk->original_begin + (to - chunk->normalized_begin), true});
      else
        composed.push_back({begin, end, chunk->original_begin, chunk->original_end, false});
    }
  }
  storage_.swap(text);
  chunks_.swap(composed);
  changed_ = true;
}

size_t NormalizedText::original_begin(size_t normalized_pos) const {
  if (!changed_) return origin_ + normalized_pos;
  auto chunk = std::upper_bound(chunks_.begin(), chunks_.end(), normalized_pos,
                                [](size_t p, const Chunk& c) { return p < c.normalized_end; });
  if (chunk == chunks_.end()) return origin_ + original_.size();
  return chunk->exact ? chunk->original_begin + (normalized_pos - chunk->normalized_begin) : chunk->original_begin;
}

size_t NormalizedText::original_end(size_t normalized_pos) const {
  if (!changed_) return origin_ + normalized_pos;
  auto chunk = std::lower_bound(chunks_.begin(), chunks_.end(), normalized_pos,
                                [](const Chunk& c, size_t p) { return c.normalized_end < p; });
  if (chunk == chunks_.end()) return origin_ + original_.size();
  if (normalized_pos <= chunk->normalized_begin) return chunk->original_begin;
  return chunk->exact ? chunk->original_begin + (normalized_pos - chunk->normalized_begin) : chunk->original_end;
}

}  // namespace spindle::tokenizer

