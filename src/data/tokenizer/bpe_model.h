// The BPE model of tokenizer.json: vocab, merges by rank (both spellings), ignore_merges and a cache
// of pieces already encoded, in one of two modes:
//  * byte-level (after a ByteLevel pre-tokenizer: Qwen, Llama 3, Tekken, o200k): pieces arrive as
//    raw bytes; the stand-in alphabet of the file is translated once at load, so encoding never
//    builds stand-in strings;
//  * SentencePiece-style (Llama 2, Mistral, Phi-3, Gemma): the vocab holds text, each character of
//    a piece starts as its own token, a character the vocab lacks becomes its UTF-8 bytes as
//    <0xNN> tokens (byte_fallback) or the unk token (runs fused with fuse_unk) or is dropped.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace spindle::tokenizer {

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
template <typename Value>
using StringMap = std::unordered_map<std::string, Value, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  // From the "model" entry of tokenizer.json; `byte_level` when the pre-tokenizer has ByteLevel.
  static std::unique_ptr<BpeModel> from_json(const nlohmann::json& model, bool byte_level);

  // Appends the ids of one piece, given as raw bytes, to `ids`, and, when `lengths` is not null,
  // how many bytes of the piece each token covers. Thread-safe.
  void encode_piece(std::string_view bytes, std::vector<int32_t>& ids, std::vector<uint32_t>* lengths = nullptr) const;

  int32_t size() const { return static_cast<int32_t>(tokens_.size()); }
  bool has_id(int32_t id) const { return id >= 0 && id < size() && present_[id]; }
  const std::string& token(int32_t id) const { return tokens_[id]; }         // as written in the file
  // Byte-level: the bytes the token stands for; SentencePiece-style: the token as written.
  const std::string& token_bytes(int32_t id) const { return token_bytes_[id]; }
  std::optional<int32_t> id_of(std::string_view token) const;
  size_t merge_count() const { return merge_count_; }

 private:
  struct Merge {
    uint32_t rank;
    int32_t merged_id;
  };
  // Open addressing on (left id, right id): merge lookups are the inner loop of BPE.
  class MergeTable {
   public:
    void reserve(size_t count);
    void insert(int32_t left, int32_t right, Merge merge);
    const Merge* find(int32_t left, int32_t right) const;

   private:
    static uint64_t key(int32_t left, int32_t right) {
      return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
    }
    static size_t hash(uint64_t key) {
      key ^= key >> 33;
      key *= 0xff51afd7ed558ccdULL;
      key ^= key >> 33;
      return static_cast<size_t>(key);
    }
    std::vector<uint64_t> keys_;
    std::vector<Merge> values_;
    size_t mask_ = 0;
  };
  static constexpr uint64_t kEmptyKey = ~uint64_t{0};

  struct Symbol {
    int32_t id;
    int32_t previous;
    int32_t next;
    uint32_t length;  // bytes of the piece it covers
    bool alive;
  };
  // The initial symbols of a SentencePiece-style piece: characters, byte fallback, unk.
  void character_symbols(std::string_view text, std::vector<Symbol>& symbols) const;
  // Applies the merges to `symbols`; appends the surviving tokens.
  void merge_symbols(std::vector<Symbol>& symbols, std::vector<int32_t>& ids, std::vector<uint32_t>* lengths) const;
  int32_t character_id(std::string_view character) const;

  std::vector<std::string> tokens_;
  std::vector<std::string> token_bytes_;
  std::vector<bool> present_;
  StringMap<int32_t> id_by_token_;
  StringMap<int32_t> id_by_bytes_;
  bool byte_level_ = true;
  // Byte-level: the stand-in token of each byte. SentencePiece-style: the <0xNN> token of each
  // byte, -1 where the vocab has none.
  std::array<int32_t, 256> byte_ids_{};
  std::array<int32_t, 128> ascii_ids_{};  // SentencePiece-style: the token of each ASCII character, or -1
  MergeTable merges_;
  size_t merge_count_ = 0;
  bool ignore_merges_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  std::optional<std::string> unk_token_;
  std::optional<int32_t> unk_id_;

  // Words repeat (Zipf), so most pieces are cache hits. Bounded: once full, new pieces are encoded
  // without being stored.
  static constexpr size_t kCacheCapacity = 1 << 17;
  static constexpr size_t kCacheMaxPieceBytes = 128;
  struct CacheEntry {
    std::vector<int32_t> ids;
    std::vector<uint32_t> lengths;  // empty when each token covers token_bytes(id).size() bytes
  };
  mutable std::shared_mutex cache_mutex_;
  mutable StringMap<CacheEntry> cache_;
};

}  // namespace spindle::tokenizer
