// Pre-tokenized samples: the user already has token ids.
//
//   {"input_ids": [...]}                                   every token supervised
//   {"input_ids": [...], "labels": [...]}                  HF alignment, -100 = not supervised
//   {"input_ids": [...], "loss_mask": [0, 0, 1, ...]}      1 = supervised (labels = input_ids)
//   any of these plus "loss_scale": [...]                  per-token weight of predicting labels[i]
//
// Labels are *not* shifted by the user: labels[i] is the token at position i, as HF models take
// them; spindle shifts them on the full packed row (docs/design.md §2.1). An `attention_mask` is accepted
// only when it is all ones (padding inside a sample would be trained on as text).
#pragma once

#include <filesystem>
#include <optional>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/document.h"
#include "data/jsonl_reader.h"

namespace spindle {

// True when the sample carries `input_ids` (the field that selects this format).
bool is_pretokenized(const nlohmann::json& sample);

// Validates and converts one sample. Throws BadSample naming the field and index at fault: a
// missing or empty `input_ids`, arrays of different lengths, non-integers, ids outside
// [0, vocab_size), labels other than -100 or the id at the same position, a loss_mask entry other
// than 0/1, a negative or non-finite loss_scale, both `labels` and `loss_mask`.
Document parse_pretokenized(const nlohmann::json& sample, const ReadOptions& options = {});

// The same from the text of one JSONL line, without building a JSON tree (about ten times faster).
// Returns nullopt when the line is not in the plain pre-tokenized shape it reads (other fields of
// unusual content, another format, malformed JSON): parse the line as JSON and call
// parse_pretokenized then. When it returns a document, it is the one parse_pretokenized gives; when
// it throws BadSample, parse_pretokenized throws the same.
std::optional<Document> parse_pretokenized_line(std::string_view line, const ReadOptions& options = {});

// Reads a whole pre-tokenized JSONL file into memory (use for_each_jsonl_sample to stream).
std::vector<Document> read_pretokenized_jsonl(const std::filesystem::path& path,
                                              const ReadOptions& options = {},
                                              ReadStats* stats = nullptr);

}  // namespace spindle
