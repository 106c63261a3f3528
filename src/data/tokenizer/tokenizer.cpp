#include "data/tokenizer/tokenizer.h"

#include <filesystem>
#include <fstream>
#include <sstream>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer/added_tokens.h"
#include "data/tokenizer/bpe_model.h"
#include "data/tokenizer/byte_level.h"
#include "data/tokenizer/decoder.h"
#include "data/tokenizer/normalizer.h"
#include "data/tokenizer/pre_tokenizer.h"
#include "data/tokenizer/utf8.h"

namespace spindle {

using namespace tokenizer;

struct Tokenizer::Impl {
  Normalizer normalizer;
  PreTokenizer pre_tokenizer;
  std::unique_ptr<BpeModel> model;
  PostProcessor post_processor;
  Decoder decoder;

  std::vector<AddedToken> added_tokens;
  std::unordered_map<int32_t, size_t> added_index_by_id;
  StringMap<int32_t> added_id_by_content;
  std::vector<std::string> added_token_bytes;  // what each added token decodes to (ByteLevel decoder)
  AddedTokenMatcher raw_matcher;         // normalized=false: matched on the caller's text
  AddedTokenMatcher normalized_matcher;  // normalized=true: matched after normalization
  int32_t vocab_size = 0;

  std::optional<std::string> bos_token, eos_token, pad_token;
  std::optional<int32_t> bos_id, eos_id, pad_id;

  void encode(std::string_view text, bool add_special_tokens, std::vector<int32_t>& ids,
              std::vector<ByteSpan>* offsets) const;
  void encode_model_text(std::string_view text, size_t base, bool at_input_start, const NormalizedText& normalized,
                         std::vector<int32_t>& ids, std::vector<ByteSpan>* offsets) const;
  std::string_view bytes_of(int32_t id) const {
    auto added = added_index_by_id.find(id);
    if (added != added_index_by_id.end()) return added_token_bytes[added->second];
    return model->token_bytes(id);
  }
};

namespace {

std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read {}: check that the path exists and is readable", path.string());
  std::ostringstream contents;
  contents << in.rdbuf();
  return contents.str();
}

nlohmann::json parse_json(std::string_view text, const std::string& origin) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::parse_error& e) {
    fail("{} is not valid JSON: {}", origin, e.what());
  }
}

bool flag(const nlohmann::json& entry, const char* name) {
  if (!entry.contains(name)) return false;
  if (!entry[name].is_boolean()) fail("tokenizer.json: added token field \"{}\" must be true or false", name);
  return entry[name].get<bool>();
}

// tokenizer_config.json writes a special token as a string, null, or an AddedToken object.
std::optional<std::string> config_token(const nlohmann::json& config, const char* name, const std::string& origin) {
  if (!config.contains(name) || config[name].is_null()) return std::nullopt;
  const auto& value = config[name];
  if (value.is_string()) return value.get<std::string>();
  if (value.is_object() && value.contains("content") && value["content"].is_string())
    return value["content"].get<std::string>();
  fail("{}: \"{}\" must be a string, null or an object with \"content\", got {}", origin, name, value.dump());
}

}  // namespace

Tokenizer Tokenizer::load(const std::string& dir) {
  const std::filesystem::path folder(dir);
  const auto tokenizer_path = folder / "tokenizer.json";
  if (!std::filesystem::exists(tokenizer_path))
    fail("{} has no tokenizer.json; pass the folder of a Hugging Face model or tokenizer (the one with "
         "tokenizer.json and tokenizer_config.json)",
         dir);
  const auto config_path = folder / "tokenizer_config.json";
  const std::string config = std::filesystem::exists(config_path) ? read_file(config_path) : std::string();
  return from_json(read_file(tokenizer_path), config, tokenizer_path.string());
}

Tokenizer Tokenizer::from_json(std::string_view tokenizer_json, std::string_view config_json,
                               const std::string& origin) {
  const nlohmann::json root = parse_json(tokenizer_json, origin);
  if (!root.is_object() || !root.contains("model"))
    fail("{} has no \"model\": it is not a Hugging Face tokenizer.json", origin);
  auto impl = std::make_shared<Impl>();
  try {
    impl->normalizer = Normalizer::from_json(root.value("normalizer", nlohmann::json()));
    impl->pre_tokenizer = PreTokenizer::from_json(root.value("pre_tokenizer", nlohmann::json()));
    impl->model = BpeModel::from_json(root["model"], impl->pre_tokenizer.has_byte_level());
    impl->post_processor = PostProcessor::from_json(root.value("post_processor", nlohmann::json()));
    impl->decoder = Decoder::from_json(root.value("decoder", nlohmann::json()));
  } catch (const Error& e) {
    if (origin == "tokenizer.json") throw;
    fail("{} (in {})", e.what(), origin);
  }

  std::vector<AddedToken> raw, normalized;
  std::vector<std::string> raw_patterns, normalized_patterns;
  impl->vocab_size = impl->model->size();
  if (root.contains("added_tokens") && !root["added_tokens"].is_null()) {
    if (!root["added_tokens"].is_array()) fail("{}: \"added_tokens\" must be an array", origin);
    for (const auto& entry : root["added_tokens"]) {
      if (!entry.is_object() || !entry.contains("id") || !entry["id"].is_number_integer() ||
          !entry.contains("content") || !entry["content"].is_string())
        fail("{}: added token {} needs an integer \"id\" and a string \"content\"", origin, entry.dump());
      AddedToken token;
      token.id = entry["id"].get<int32_t>();
      token.content = entry["content"].get<std::string>();
      require_valid_utf8(token.content, "added token content");
      token.single_word = flag(entry, "single_word");
      token.lstrip = flag(entry, "lstrip");
      token.rstrip = flag(entry, "rstrip");
      token.normalized = flag(entry, "normalized");
      token.special = flag(entry, "special");
      if (token.id < 0) fail("{}: added token \"{}\" has a negative id", origin, token.content);
      impl->added_index_by_id[token.id] = impl->added_tokens.size();
      impl->added_id_by_content[token.content] = token.id;
      const auto bytes = ByteLevelAlphabet::get().decode(token.content);
      impl->added_token_bytes.push_back(impl->decoder.is_byte_level() && bytes ? *bytes : token.content);
      impl->vocab_size = std::max(impl->vocab_size, token.id + 1);
      impl->added_tokens.push_back(token);
      if (token.normalized) {
        normalized_patterns.push_back(impl->normalizer.normalize(token.content));
        normalized.push_back(std::move(token));
      } else {
        raw_patterns.push_back(token.content);
        raw.push_back(std::move(token));
      }
    }
  }
  impl->raw_matcher = AddedTokenMatcher(std::move(raw), std::move(raw_patterns));
  impl->normalized_matcher = AddedTokenMatcher(std::move(normalized), std::move(normalized_patterns));

  Tokenizer tokenizer(impl);
  if (!config_json.empty()) {
    const std::string config_origin = "tokenizer_config.json";
    const nlohmann::json config = parse_json(config_json, config_origin);
    if (!config.is_object()) fail("{} must be a JSON object", config_origin);
    auto resolve = [&](const char* name, std::optional<std::string>& token, std::optional<int32_t>& id) {
      token = config_token(config, name, config_origin);
      if (!token) return;
      id = tokenizer.token_to_id(*token);
      if (!id)
        fail("{} names {} \"{}\", which is neither an added token nor in the vocab of tokenizer.json; fix the "
             "config or the tokenizer files so that they belong to the same model",
             config_origin, name, *token);
    };
    resolve("bos_token", impl->bos_token, impl->bos_id);
    resolve("eos_token", impl->eos_token, impl->eos_id);
    resolve("pad_token", impl->pad_token, impl->pad_id);
  }
  return tokenizer;
}

void Tokenizer::Impl::encode_model_text(std::string_view text, size_t base, bool at_input_start,
                                        const NormalizedText& normalized, std::vector<int32_t>& ids,
                                        std::vector<ByteSpan>* offsets) const {
  thread_local std::vector<Piece> pieces;
  thread_local std::string model_input;
  thread_local std::vector<uint32_t> lengths;
  // For each byte of model_input, the bytes of `text` it stands for.
  thread_local std::vector<ByteSpan> sources;
  pre_tokenizer.split(text, at_input_start, pieces);
  const std::string_view prefix = pre_tokenizer.prefix();
  const std::string_view space_replacement = pre_tokenizer.space_replacement();
  for (const Piece& piece : pieces) {
    std::string_view bytes = text.substr(piece.begin, piece.end - piece.begin);
    const bool replaces_spaces = !space_replacement.empty() && bytes.find(' ') != std::string_view::npos;
    if (piece.prefixed || replaces_spaces) {
      model_input.clear();
      if (piece.prefixed) model_input.append(prefix);
      if (replaces_spaces) {
        for (char c : bytes) c == ' ' ? model_input.append(space_replacement) : model_input.append(1, c);
      } else {
        model_input.append(bytes);
      }
      bytes = model_input;
    }
    const size_t first = ids.size();
    lengths.clear();
    model->encode_piece(bytes, ids, offsets ? &lengths : nullptr);
    if (!offsets) continue;
    const size_t piece_begin = base + piece.begin;
    if (!piece.prefixed && !replaces_spaces) {
      size_t at = piece_begin;
      for (size_t i = first; i < ids.size(); ++i) {
        const size_t length = lengths[i - first];
        offsets->push_back({normalized.original_begin(at), normalized.original_end(at + length)});
        at += length;
      }
      continue;
    }
    // As HF aligns them: a prefix stands for the piece's first character, a replaced space for
    // the space.
    sources.clear();
    const std::string_view original = text.substr(piece.begin, piece.end - piece.begin);
    if (piece.prefixed) {
      size_t first_end = 0;
      if (!original.empty()) next_code_point(original, first_end);
      sources.insert(sources.end(), prefix.size(), ByteSpan{piece_begin, piece_begin + first_end});
    }
    for (size_t i = 0; i < original.size(); ++i) {
      const ByteSpan source{piece_begin + i, piece_begin + i + 1};
      sources.insert(sources.end(), replaces_spaces && original[i] == ' ' ? space_replacement.size() : 1, source);
    }
    size_t at = 0;
    for (size_t i = first; i < ids.size(); ++i) {
      const size_t length = lengths[i - first];  // every token covers at least one byte
      offsets->push_back({normalized.original_begin(sources[at].begin),
                          normalized.original_end(sources[at + length - 1].end)});
      at += length;
    }
  }
}

void Tokenizer::Impl::encode(std::string_view text, bool add_special_tokens, std::vector<int32_t>& ids,
                             std::vector<ByteSpan>* offsets) const {
  require_valid_utf8(text, "text to tokenize");
  thread_local std::vector<AddedSplit> raw_splits, normalized_splits;
  thread_local NormalizedText normalized;
  raw_splits.clear();
  if (raw_matcher.empty())
    raw_splits.push_back({-1, 0, text.size()});
  else
    raw_matcher.split(text, 0, raw_splits);
  for (const AddedSplit& split : raw_splits) {
    if (split.id >= 0) {
      ids.push_back(split.id);
      if (offsets) offsets->push_back({split.begin, split.end});
      continue;
    }
    normalizer.normalize(text.substr(split.begin, split.end - split.begin), split.begin, normalized);
    const std::string_view normalized_text = normalized.text();
    normalized_splits.clear();
    if (normalized_matcher.empty())
      normalized_splits.push_back({-1, 0, normalized_text.size()});
    else
      normalized_matcher.split(normalized_text, 0, normalized_splits);
    for (const AddedSplit& inner : normalized_splits) {
      if (inner.id >= 0) {
        ids.push_back(inner.id);
        if (offsets) offsets->push_back({normalized.original_begin(inner.begin), normalized.original_end(inner.end)});
        continue;
      }
      const bool at_input_start = split.begin == 0 && inner.begin == 0;
      encode_model_text(normalized_text.substr(inner.begin, inner.end - inner.begin), inner.begin, at_input_start,
                        normalized, ids, offsets);
    }
  }
  post_processor.process(ids, offsets, add_special_tokens, [this](int32_t id) { return bytes_of(id); });
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  impl_->encode(text, add_special_tokens, ids, nullptr);
  return ids;
}

Encoding Tokenizer::encode_with_offsets(std::string_view text, bool add_special_tokens) const {
  Encoding encoding;
  impl_->encode(text, add_special_tokens, encoding.ids, &encoding.offsets);
  return encoding;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& impl = *impl_;
  auto is_added = [&](int32_t id, size_t position) -> std::optional<size_t> {
    auto added = impl.added_index_by_id.find(id);
    if (added != impl.added_index_by_id.end()) return added->second;
    if (!impl.model->has_id(id))
      fail("cannot decode id {} at position {}: it is not in the vocabulary (ids are 0..{}); the ids do not "
           "belong to this tokenizer",
           id, position, impl.vocab_size - 1);
    return std::nullopt;
  };
  if (impl.decoder.is_byte_level()) {
    // Every token stands for known bytes: concatenate them, then read the bytes as UTF-8.
    std::string bytes;
    for (size_t i = 0; i < ids.size(); ++i) {
      const auto added = is_added(ids[i], i);
      if (added && skip_special_tokens && impl.added_tokens[*added].special) continue;
      bytes += impl.bytes_of(ids[i]);
    }
    return utf8_lossy(bytes);
  }
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (size_t i = 0; i < ids.size(); ++i) {
    const auto added = is_added(ids[i], i);
    if (added && skip_special_tokens && impl.added_tokens[*added].special) continue;
    tokens.push_back(added ? impl.added_tokens[*added].content : impl.model->token(ids[i]));
  }
  return impl.decoder.decode(std::move(tokens));
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  auto added = impl_->added_id_by_content.find(token);
  if (added != impl_->added_id_by_content.end()) return added->second;
  return impl_->model->id_of(token);
}

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  auto added = impl_->added_index_by_id.find(id);
  if (added != impl_->added_index_by_id.end()) return impl_->added_tokens[added->second].content;
  if (impl_->model->has_id(id)) return impl_->model->token(id);
  return std::nullopt;
}

int32_t Tokenizer::vocab_size() const { return impl_->vocab_size; }

bool Tokenizer::is_special(int32_t id) const {
  auto added = impl_->added_index_by_id.find(id);
  return added != impl_->added_index_by_id.end() && impl_->added_tokens[added->second].special;
}

const std::optional<std::string>& Tokenizer::bos_token() const { return impl_->bos_token; }
const std::optional<std::string>& Tokenizer::eos_token() const { return impl_->eos_token; }
const std::optional<std::string>& Tokenizer::pad_token() const { return impl_->pad_token; }
std::optional<int32_t> Tokenizer::bos_token_id() const { return impl_->bos_id; }
std::optional<int32_t> Tokenizer::eos_token_id() const { return impl_->eos_id; }
std::optional<int32_t> Tokenizer::pad_token_id() const { return impl_->pad_id; }

}  // namespace spindle
