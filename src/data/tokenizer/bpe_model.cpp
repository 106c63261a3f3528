#include "data/tokenizer/bpe_model.h"

#include <algorithm>
#include <mutex>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer/byte_level.h"
#include "data/tokenizer/utf8.h"

namespace spindle::tokenizer {

void BpeModel::MergeTable::reserve(size_t count) {
  size_t capacity = 16;
  while (capacity < count * 2) capacity *= 2;
  keys_.assign(capacity, kEmptyKey);
  values_.assign(capacity, Merge{0, 0});
  mask_ = capacity - 1;
}

void BpeModel::MergeTable::insert(int32_t left, int32_t right, Merge merge) {
  const uint64_t k = key(left, right);
  for (size_t slot = hash(k) & mask_;; slot = (slot + 1) & mask_) {
    if (keys_[slot] == kEmptyKey || keys_[slot] == k) {
      // A repeated pair keeps its last rank, as HF's HashMap collect does.
      keys_[slot] = k;
      values_[slot] = merge;
      return;
    }
  }
}

const BpeModel::Merge* BpeModel::MergeTable::find(int32_t left, int32_t right) const {
  const uint64_t k = key(left, right);
  for (size_t slot = hash(k) & mask_;; slot = (slot + 1) & mask_) {
    if (keys_[slot] == k) return &values_[slot];
    if (keys_[slot] == kEmptyKey) return nullptr;
  }
}

namespace {

std::pair<std::string, std::string> parse_merge(const nlohmann::json& entry, size_t index) {
  if (entry.is_string()) {
    // Before tokenizers 0.20 a merge is one string "left right"; stand-ins never contain a space.
    const std::string text = entry.get<std::string>();
    const size_t space = text.find(' ');
    if (space == std::string::npos || text.find(' ', space + 1) != std::string::npos)
      fail("tokenizer.json: merge #{} \"{}\" must be two tokens separated by one space", index, text);
    return {text.substr(0, space), text.substr(space + 1)};
  }
  if (entry.is_array() && entry.size() == 2 && entry[0].is_string() && entry[1].is_string())
    return {entry[0].get<std::string>(), entry[1].get<std::string>()};
  fail("tokenizer.json: merge #{} must be \"a b\" or [\"a\", \"b\"], got {}", index, entry.dump());
}

void require_unset(const nlohmann::json& model, const char* field, const char* why) {
  if (!model.contains(field) || model[field].is_null()) return;
  const auto& value = model[field];
  if ((value.is_string() && value.get<std::string>().empty()) || (value.is_boolean() && !value.get<bool>())) return;
  fail("tokenizer.json: model.{} = {} is not supported: {}", field, value.dump(), why);
}

bool model_flag(const nlohmann::json& model, const char* field) {
  if (!model.contains(field) || model[field].is_null()) return false;
  if (!model[field].is_boolean()) fail("tokenizer.json: model.{} must be true or false, got {}", field, model[field].dump());
  return model[field].get<bool>();
}

// HF's spelling of a byte-fallback token: "<0x" + two upper-case hex digits + ">".
std::string byte_token(unsigned char byte) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  return std::string("<0x") + kHex[byte >> 4] + kHex[byte & 15] + ">";
}

}  // namespace

std::unique_ptr<BpeModel> BpeModel::from_json(const nlohmann::json& model, bool byte_level) {
  if (!model.is_object()) fail("tokenizer.json: \"model\" must be an object");
  const std::string type = model.value("type", std::string("BPE"));
  if (type != "BPE")
    fail("tokenizer.json: model type '{}' is not supported; spindle implements BPE (byte-level as Qwen, Llama 3, "
         "Mistral Tekken and gpt-oss use it; SentencePiece-style as Llama 2, Mistral, Phi-3 and Gemma use it)",
         type);
  // HF encodes without dropout when it is null or 0.
  if (model.contains("dropout") && !model["dropout"].is_null() &&
      !(model["dropout"].is_number() && model["dropout"].get<double>() == 0.0))
    fail("tokenizer.json: model.dropout = {} is not supported: BPE dropout makes encoding random; set it to null for "
         "training data",
         model["dropout"].dump());
  require_unset(model, "continuing_subword_prefix", "BPE models of decoder LLMs do not use it");
  require_unset(model, "end_of_word_suffix", "BPE models of decoder LLMs do not use it");
  if (!model.contains("vocab") || !model["vocab"].is_object() || model["vocab"].empty())
    fail("tokenizer.json: model.vocab must be a non-empty object of token → id");

  auto bpe = std::unique_ptr<BpeModel>(new BpeModel());
  bpe->byte_level_ = byte_level;
  bpe->byte_fallback_ = model_flag(model, "byte_fallback");
  bpe->fuse_unk_ = model_flag(model, "fuse_unk");
  if (model.contains("unk_token") && !model["unk_token"].is_null()) {
    if (!model["unk_token"].is_string())
      fail("tokenizer.json: model.unk_token must be a string or null, got {}", model["unk_token"].dump());
    bpe->unk_token_ = model["unk_token"].get<std::string>();
  }
  const ByteLevelAlphabet& alphabet = ByteLevelAlphabet::get();
  int32_t max_id = -1;
  for (const auto& [token, id] : model["vocab"].items()) {
    if (!id.is_number_integer() || id.get<int64_t>() < 0 || id.get<int64_t>() > INT32_MAX)
      fail("tokenizer.json: vocab entry \"{}\" has id {}, expected an integer in [0, 2^31)", token, id.dump());
    max_id = std::max(max_id, id.get<int32_t>());
  }
  bpe->tokens_.resize(max_id + 1);
  bpe->token_bytes_.resize(max_id + 1);
  bpe->present_.assign(max_id + 1, false);
  bpe->id_by_token_.reserve(model["vocab"].size());
  if (byte_level) bpe->id_by_bytes_.reserve(model["vocab"].size());
  for (const auto& [token, id_json] : model["vocab"].items()) {
    const int32_t id = id_json.get<int32_t>();
    if (bpe->present_[id])
      fail("tokenizer.json: vocab id {} is used twice (\"{}\" and \"{}\")", id, bpe->tokens_[id], token);
    require_valid_utf8(token, "vocab token");
    bpe->present_[id] = true;
    bpe->tokens_[id] = token;
    bpe->id_by_token_.emplace(token, id);
    // A token outside the byte alphabet can never come out of byte-level merges; it decodes to its
    // own text, as HF's ByteLevel decoder does.
    std::optional<std::string> bytes = byte_level ? alphabet.decode(token) : std::nullopt;
    if (bytes) {
      bpe->id_by_bytes_.emplace(*bytes, id);
      bpe->token_bytes_[id] = std::move(*bytes);
    } else {
      bpe->token_bytes_[id] = token;
    }
  }
  if (byte_level) {
    for (int byte = 0; byte < 256; ++byte) {
      auto found = bpe->id_by_bytes_.find(std::string_view(reinterpret_cast<const char*>(&byte), 1));
      if (found == bpe->id_by_bytes_.end())
        fail("tokenizer.json: the vocab has no token for byte 0x{:02X} (\"{}\"); byte-level BPE needs all 256", byte,
             alphabet.encode(std::string(1, static_cast<char>(byte))));
      bpe->byte_ids_[byte] = found->second;
    }
  } else {
    for (int byte = 0; byte < 256; ++byte) {
      const auto found = bpe->id_by_token_.find(byte_token(static_cast<unsigned char>(byte)));
      bpe->byte_ids_[byte] = found == bpe->id_by_token_.end() ? -1 : found->second;
    }
    for (int character = 0; character < 128; ++character) {
      const auto found = bpe->id_by_token_.find(std::string(1, static_cast<char>(character)));
      bpe->ascii_ids_[character] = found == bpe->id_by_token_.end() ? -1 : found->second;
    }
    if (bpe->unk_token_) bpe->unk_id_ = bpe->id_of(*bpe->unk_token_);
  }

  if (!model.contains("merges") || !model["merges"].is_array())
    fail("tokenizer.json: model.merges is missing or not an array; a BPE tokenizer needs its merges");
  const auto& merges = model["merges"];
  if (merges.empty())
    fail("tokenizer.json: zero BPE merges loaded; without merges every {} becomes its own token. The file is "
         "broken or truncated — re-download tokenizer.json",
         byte_level ? "byte" : "character");
  bpe->merges_.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto [left, right] = parse_merge(merges[rank], rank);
    auto id_of = [&](const std::string& token) {
      auto found = bpe->id_by_token_.find(token);
      if (found == bpe->id_by_token_.end())
        fail("tokenizer.json: merge #{} \"{} {}\" uses \"{}\", which is not in the vocab", rank, left, right, token);
      return found->second;
    };
    bpe->merges_.insert(id_of(left), id_of(right), Merge{static_cast<uint32_t>(rank), id_of(left + right)});
  }
  bpe->merge_count_ = merges.size();
  bpe->ignore_merges_ = model_flag(model, "ignore_merges");
  return bpe;
}

std::optional<int32_t> BpeModel::id_of(std::string_view token) const {
  auto found = id_by_token_.find(token);
  if (found == id_by_token_.end()) return std::nullopt;
  return found->second;
}

int32_t BpeModel::character_id(std::string_view character) const {
  if (character.size() == 1) return ascii_ids_[static_cast<unsigned char>(character[0])];
  auto found = id_by_token_.find(character);
  return found == id_by_token_.end() ? -1 : found->second;
}

void BpeModel::character_symbols(std::string_view text, std::vector<Symbol>& symbols) const {
  auto add = [&](int32_t id, uint32_t length) {
    const auto index = static_cast<int32_t>(symbols.size());
    symbols.push_back({id, index - 1, -1, length, true});
    if (index > 0) symbols[index - 1].next = index;
  };
  // HF's order: a pending unk is added when a known character (or another unk, unfused) follows,
  // so byte-fallback tokens that come between go before it.
  uint32_t pending_unk = 0;  // bytes the pending unk covers; 0 when none is pending
  auto unk_id = [&]() {
    if (!unk_id_)
      fail("tokenizer.json: model.unk_token \"{}\" is not in the vocab, and the text has a character the vocab lacks",
           *unk_token_);
    return *unk_id_;
  };
  for (size_t pos = 0; pos < text.size();) {
    const size_t begin = pos;
    next_code_point(text, pos);
    const std::string_view character = text.substr(begin, pos - begin);
    const auto length = static_cast<uint32_t>(character.size());
    if (const int32_t id = character_id(character); id >= 0) {
      if (pending_unk > 0) add(unk_id(), pending_unk);
      pending_unk = 0;
      add(id, length);
      continue;
    }
    if (byte_fallback_ && std::all_of(character.begin(), character.end(),
                                      [&](char byte) { return byte_ids_[static_cast<unsigned char>(byte)] >= 0; })) {
      for (char byte : character) add(byte_ids_[static_cast<unsigned char>(byte)], 1);
      continue;
    }
    if (!unk_token_) continue;  // HF drops a character it cannot represent when there is no unk token
    if (pending_unk > 0 && fuse_unk_) {
      pending_unk += length;
    } else {
      if (pending_unk > 0) add(unk_id(), pending_unk);
      unk_id();
      pending_unk = length;
    }
  }
  if (pending_unk > 0) add(unk_id(), pending_unk);
}

void BpeModel::encode_piece(std::string_view bytes, std::vector<int32_t>& ids, std::vector<uint32_t>* lengths) const {
  if (bytes.empty()) return;
  if (byte_level_ && bytes.size() == 1) {
    ids.push_back(byte_ids_[static_cast<unsigned char>(bytes[0])]);
    if (lengths) lengths->push_back(1);
    return;
  }
  // Each token covers token_bytes(id).size() bytes, except byte-fallback and unk tokens.
  auto add_lengths = [&](const CacheEntry& entry) {
    if (!lengths) return;
    if (!entry.lengths.empty()) {
      lengths->insert(lengths->end(), entry.lengths.begin(), entry.lengths.end());
      return;
    }
    for (int32_t id : entry.ids) lengths->push_back(static_cast<uint32_t>(token_bytes_[id].size()));
  };
  const bool cacheable = bytes.size() <= kCacheMaxPieceBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    auto found = cache_.find(bytes);
    if (found != cache_.end()) {
      ids.insert(ids.end(), found->second.ids.begin(), found->second.ids.end());
      add_lengths(found->second);
      return;
    }
  }
  thread_local CacheEntry entry;
  thread_local std::vector<Symbol> symbols;
  entry.ids.clear();
  entry.lengths.clear();
  // Llama 3, Tekken: a piece that is itself a token is emitted whole, whatever the merges would give.
  std::optional<int32_t> whole;
  if (ignore_merges_) {
    if (byte_level_) {
      if (auto found = id_by_bytes_.find(bytes); found != id_by_bytes_.end()) whole = found->second;
    } else {
      whole = id_of(bytes);
    }
  }
  if (whole) {
    entry.ids.push_back(*whole);
  } else {
    symbols.clear();
    if (byte_level_) {
      for (size_t i = 0; i < bytes.size(); ++i)
        symbols.push_back({byte_ids_[static_cast<unsigned char>(bytes[i])], static_cast<int32_t>(i) - 1,
                           i + 1 < bytes.size() ? static_cast<int32_t>(i) + 1 : -1, 1, true});
    } else {
      character_symbols(bytes, symbols);
    }
    merge_symbols(symbols, entry.ids, byte_level_ ? nullptr : &entry.lengths);
    if (!byte_level_) {
      const bool derivable = std::equal(entry.ids.begin(), entry.ids.end(), entry.lengths.begin(),
                                        [&](int32_t id, uint32_t length) { return token_bytes_[id].size() == length; });
      if (derivable) entry.lengths.clear();
    }
  }
  ids.insert(ids.end(), entry.ids.begin(), entry.ids.end());
  add_lengths(entry);
  if (cacheable) {
    // Never block an encode on the cache: skip the store if another thread holds the lock.
    std::unique_lock lock(cache_mutex_, std::try_to_lock);
    if (lock.owns_lock() && cache_.size() < kCacheCapacity) cache_.emplace(std::string(bytes), entry);
  }
}

void BpeModel::merge_symbols(std::vector<Symbol>& symbols, std::vector<int32_t>& ids,
                             std::vector<uint32_t>* lengths) const {
  struct Candidate {
    uint32_t rank;
    int32_t position;
    int32_t merged_id;
    // std::priority_queue is a max-heap: the lowest rank, then the leftmost position, on top.
    bool operator<(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  if (symbols.empty()) return;
  thread_local std::vector<Candidate> heap;
  const auto count = static_cast<int32_t>(symbols.size());
  heap.clear();
  for (int32_t i = 0; i + 1 < count; ++i)
    if (const Merge* merge = merges_.find(symbols[i].id, symbols[i + 1].id))
      heap.push_back({merge->rank, i, merge->merged_id});
  std::make_heap(heap.begin(), heap.end());
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end());
    const Candidate top = heap.back();
    heap.pop_back();
    Symbol& left = symbols[top.position];
    if (!left.alive || left.next < 0) continue;
    Symbol& right = symbols[left.next];
    // Stale candidate: one of its symbols has merged with something else since it was queued.
    const Merge* merge = merges_.find(left.id, right.id);
    if (!merge || merge->merged_id != top.merged_id) continue;
    left.id = top.merged_id;
    left.length += right.length;
    right.alive = false;
    left.next = right.next;
    if (left.next >= 0) symbols[left.next].previous = top.position;
    if (left.previous >= 0)
      if (const Merge* before = merges_.find(symbols[left.previous].id, left.id)) {
        heap.push_back({before->rank, left.previous, before->merged_id});
        std::push_heap(heap.begin(), heap.end());
      }
    if (left.next >= 0)
      if (const Merge* after = merges_.find(left.id, symbols[left.next].id)) {
        heap.push_back({after->rank, top.position, after->merged_id});
        std::push_heap(heap.begin(), heap.end());
      }
  }
  for (int32_t i = 0; i >= 0; i = symbols[i].next) {
    ids.push_back(symbols[i].id);
    if (lengths) lengths->push_back(symbols[i].length);
  }
}

}  // namespace spindle::tokenizer
