#include "data/tokenizer/normalizer.h"

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include <nlohmann/json.hpp>
#include <utf8proc.h>

#include "core/error.h"
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

void collect_forms(const nlohmann::json& config, std::vector<Normalizer::Form>& forms) {
  if (config.is_null()) return;
  if (!config.is_object() || !config.contains("type") || !config["type"].is_string())
    fail("tokenizer.json: a normalizer must be an object with a string \"type\", got {}", config.dump());
  const std::string type = config["type"].get<std::string>();
  if (type == "NFC") {
    forms.push_back(Normalizer::Form::kNFC);
  } else if (type == "NFD") {
    forms.push_back(Normalizer::Form::kNFD);
  } else if (type == "NFKC") {
    forms.push_back(Normalizer::Form::kNFKC);
  } else if (type == "NFKD") {
    forms.push_back(Normalizer::Form::kNFKD);
  } else if (type == "Sequence") {
    if (!config.contains("normalizers") || !config["normalizers"].is_array())
      fail("tokenizer.json: a Sequence normalizer needs a \"normalizers\" array");
    for (const auto& inner : config["normalizers"]) collect_forms(inner, forms);
  } else {
    fail("tokenizer.json: normalizer type '{}' is not supported (spindle supports NFC, NFD, NFKC, NFKD "
         "and Sequence of them, as byte-level BPE models use); use a tokenizer without it or extend "
         "src/data/tokenizer/normalizer.cpp",
         type);
  }
}

}  // namespace

Normalizer Normalizer::from_json(const nlohmann::json& config) {
  Normalizer normalizer;
  collect_forms(config, normalizer.forms_);
  if (!normalizer.forms_.empty()) SensitiveCodePoints::get();  // build the table at load, not mid-encode
  return normalizer;
}

std::string Normalizer::apply_forms(std::string_view segment) const {
  std::string current(segment);
  for (Form form : forms_) {
    utf8proc_uint8_t* result = nullptr;
    const utf8proc_ssize_t length =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(current.data()),
                     static_cast<utf8proc_ssize_t>(current.size()), &result, options_of(form));
    std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(result, &std::free);
    if (length < 0) fail("Unicode normalization failed: {}", utf8proc_errmsg(length));
    current.assign(reinterpret_cast<const char*>(result), static_cast<size_t>(length));
  }
  return current;
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
  if (forms_.empty()) return;
  const SensitiveCodePoints& sensitive = SensitiveCodePoints::get();

  size_t copied_up_to = 0;  // original bytes before this are already in storage_
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
    std::string normalized = apply_forms(stretch);
    if (normalized != stretch) {
      if (copied_up_to < stretch_begin) {
        const size_t at = out.storage_.size();
        out.storage_.append(text.substr(copied_up_to, stretch_begin - copied_up_to));
        out.chunks_.push_back({at, out.storage_.size(), origin + copied_up_to, origin + stretch_begin, true});
      }
      const size_t at = out.storage_.size();
      out.storage_.append(normalized);
      out.chunks_.push_back({at, out.storage_.size(), origin + stretch_begin, origin + stretch_end, false});
      copied_up_to = stretch_end;
      out.changed_ = true;
    }
    pos = stretch_end;
    previous_start = stretch_end;  // the next code point is a starter: nothing attaches across
  }
  if (out.changed_ && copied_up_to < text.size()) {
    const size_t at = out.storage_.size();
    out.storage_.append(text.substr(copied_up_to));
    out.chunks_.push_back({at, out.storage_.size(), origin + copied_up_to, origin + text.size(), true});
  }
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

