#include "data/tokenizer/bpe_model.h"

#include <algorithm>
#include <mutex>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer/byte_level.h"

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

}  // namespace

std::unique_ptr<BpeModel> BpeModel::from_json(const nlohmann::json& model) {
  if (!model.is_object()) fail("tokenizer.json: \"model\" must be an object");
  const std::string type = model.value("type", std::string("BPE"));
  if (type != "BPE")
    fail("tokenizer.json: model type '{}' is not supported; spindle implements byte-level BPE (Qwen2/2.5/3, Llama 3)", type);
  require_unset(model, "dropout", "BPE dropout makes encoding random; remove it for training data");
  require_unset(model, "byte_fallback", "byte-level BPE covers every byte without it");
  require_unset(model, "continuing_subword_prefix", "byte-level BPE models do not use it");
  require_unset(model, "end_of_word_suffix", "byte-level BPE models do not use it");
  if (!model.contains("vocab") || !model["vocab"].is_object() || model["vocab"].empty())
    fail("tokenizer.json: model.vocab must be a non-empty object of token → id");

  auto bpe = std::unique_ptr<BpeModel>(new BpeModel());
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
  bpe->id_by_bytes_.reserve(model["vocab"].size());
  for (const auto& [token, id_json] : model["vocab"].items()) {
    const int32_t id = id_json.get<int32_t>();
    if (bpe->present_[id])
      fail("tokenizer.json: vocab id {} is used twice (\"{}\" and \"{}\")", id, bpe->tokens_[id], token);
    bpe->present_[id] = true;
    bpe->tokens_[id] = token;
    bpe->id_by_token_.emplace(token, id);
    // A token outside the byte alphabet can never come out of byte-level merges; it decodes to its
    // own text, as HF's ByteLevel decoder does.
    if (auto bytes = alphabet.decode(token)) {
      bpe->id_by_bytes_.emplace(*bytes, id);
      bpe->token_bytes_[id] = std::move(*bytes);
    } else {
      bpe->token_bytes_[id] = token;
    }
  }
  for (int byte = 0; byte < 256; ++byte) {
    auto found = bpe->id_by_bytes_.find(std::string_view(reinterpret_cast<const char*>(&byte), 1));
    if (found == bpe->id_by_bytes_.end())
      fail("tokenizer.json: the vocab has no token for byte 0x{:02X} (\"{}\"); byte-level BPE needs all 256", byte,
           alphabet.encode(std::string(1, static_cast<char>(byte))));
    bpe->byte_ids_[byte] = found->second;
  }

  if (!model.contains("merges") || !model["merges"].is_array())
    fail("tokenizer.json: model.merges is missing or not an array; a BPE tokenizer needs its merges");
  const auto& merges = model["merges"];
  if (merges.empty())
    fail("tokenizer.json: zero BPE merges loaded; without merges every byte becomes its own token. The file is "
         "broken or truncated — re-download tokenizer.json");
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
  bpe->ignore_merges_ = model.value("ignore_merges", false);
  return bpe;
}

std::optional<int32_t> BpeModel::id_of(std::string_view token) const {
  auto found = id_by_token_.find(token);
  if (found == id_by_token_.end()) return std::nullopt;
  return found->second;
}

void BpeModel::encode_piece(std::string_view bytes, std::vector<int32_t>& ids) const {
  if (bytes.empty()) return;
  if (bytes.size() == 1) {
    ids.push_back(byte_ids_[static_cast<unsigned char>(bytes[0])]);
    return;
  }
  const bool cacheable = bytes.size() <= kCacheMaxPieceBytes;
  if (cacheable) {
    std::shared_lock lock(cache_mutex_);
    auto found = cache_.find(bytes);
    if (found != cache_.end()) {
      ids.insert(ids.end(), found->second.begin(), found->second.end());
      return;
    }
  }
  const size_t first = ids.size();
  if (ignore_merges_) {
    // Llama 3: a piece that is itself a token is emitted whole, whatever the merges would give.
    auto found = id_by_bytes_.find(bytes);
    if (found != id_by_bytes_.end())
      ids.push_back(found->second);
    else
      merge_symbols(bytes, ids);
  } else {
    merge_symbols(bytes, ids);
  }
  if (cacheable) {
    // Never block an encode on the cache: skip the store if another thread holds the lock.
    std::unique_lock lock(cache_mutex_, std::try_to_lock);
    if (lock.owns_lock() && cache_.size() < kCacheCapacity)
      cache_.emplace(std::string(bytes), std::vector<int32_t>(ids.begin() + first, ids.end()));
  }
}

void BpeModel::merge_symbols(std::string_view bytes, std::vector<int32_t>& ids) const {
  struct Symbol {
    int32_t id;
    int32_t previous;
    int32_t next;
    bool alive;
  };
  struct Candidate {
    uint32_t rank;
    int32_t position;
    int32_t merged_id;
    // std::priority_queue is a max-heap: the lowest rank, then the leftmost position, on top.
    bool operator<(const Candidate& other) const {
      return rank != other.rank ? rank > other.rank : position > other.position;
    }
  };
  thread_local std::vector<Symbol> symbols;
  thread_local std::vector<Candidate> heap;
  const int32_t count = static_cast<int32_t>(bytes.size());
  symbols.resize(count);
  heap.clear();
  for (int32_t i = 0; i < count; ++i)
    symbols[i] = {byte_ids_[static_cast<unsigned char>(bytes[i])], i - 1, i + 1 < count ? i + 1 : -1, true};
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
  for (int32_t i = 0; i >= 0; i = symbols[i].next) ids.push_back(symbols[i].id);
}

}  // namespace spindle::tokenizer
