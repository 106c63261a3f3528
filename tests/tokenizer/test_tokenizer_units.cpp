// Unit tests of the tokenizer pieces on small hand-made tokenizer.json files, plus load errors,
// invalid input, special-token lookup and concurrent use.
#include <gtest/gtest.h>

#include <fstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer/byte_level.h"
#include "data/tokenizer/normalizer.h"
#include "data/tokenizer/pre_tokenizer.h"
#include "data/tokenizer/tokenizer.h"
#include "data/tokenizer/utf8.h"
#include "tokenizer_test_util.h"

namespace spindle::test {
namespace {

using tokenizer::ByteLevelAlphabet;

// A byte-level BPE over the 256 byte tokens (ids 0..255 in byte order) with the given merges,
// each written as "a b" in stand-in characters; merged tokens get ids from 256 on.
nlohmann::json toy_tokenizer(const std::vector<std::pair<std::string, std::string>>& merges, bool pair_spelling,
                             bool ignore_merges = false, const std::vector<std::string>& extra_tokens = {}) {
  const auto& alphabet = ByteLevelAlphabet::get();
  nlohmann::json vocab = nlohmann::json::object();
  for (int byte = 0; byte < 256; ++byte) vocab[alphabet.encode(std::string(1, static_cast<char>(byte)))] = byte;
  int next_id = 256;
  nlohmann::json merge_list = nlohmann::json::array();
  for (const auto& [left, right] : merges) {
    const std::string l = alphabet.encode(left), r = alphabet.encode(right);
    if (!vocab.contains(l + r)) vocab[l + r] = next_id++;
    merge_list.push_back(pair_spelling ? nlohmann::json::array({l, r}) : nlohmann::json(l + " " + r));
  }
  for (const std::string& token : extra_tokens) vocab[alphabet.encode(token)] = next_id++;
  return {
      {"version", "1.0"},
      {"added_tokens", nlohmann::json::array({{{"id", 1000}, {"content", "<|s|>"}, {"single_word", false},
                                               {"lstrip", false}, {"rstrip", false}, {"normalized", false},
                                               {"special", true}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merge_list}, {"ignore_merges", ignore_merges}}},
  };
}

Tokenizer from(const nlohmann::json& json, const std::string& config = "") {
  return Tokenizer::from_json(json.dump(), config);
}

std::string error_of(const std::function<void()>& action) {
  try {
    action();
  } catch (const Error& e) {
    return e.what();
  }
  return "(no error)";
}

TEST(ByteLevelAlphabet, MapsSpaceAndNewlineAndRoundTripsAllBytes) {
  const auto& alphabet = ByteLevelAlphabet::get();
  EXPECT_EQ(alphabet.encode(" "), "\u0120");
  EXPECT_EQ(alphabet.encode("\n"), "\u010A");
  EXPECT_EQ(alphabet.encode("a"), "a");
  std::string all;
  for (int byte = 0; byte < 256; ++byte) all.push_back(static_cast<char>(byte));
  EXPECT_EQ(alphabet.decode(alphabet.encode(all)), all);
  EXPECT_FALSE(alphabet.decode("\u4E2D").has_value());  // not a stand-in
}

TEST(Utf8, FindsInvalidSequences) {
  EXPECT_EQ(tokenizer::find_invalid_utf8("plain ascii text, long enough for the fast path"), std::string_view::npos);
  EXPECT_EQ(tokenizer::find_invalid_utf8("h\u00e9llo \U0001F600"), std::string_view::npos);
  EXPECT_EQ(tokenizer::find_invalid_utf8("ab\xC0\x80"), 2u);          // overlong
  EXPECT_EQ(tokenizer::find_invalid_utf8("abcdefgh\xED\xA0\x80"), 8u);  // surrogate
  EXPECT_EQ(tokenizer::find_invalid_utf8("\xF5\x80\x80\x80"), 0u);    // above U+10FFFF
  EXPECT_EQ(tokenizer::find_invalid_utf8("x\xE4\xB8"), 1u);            // truncated
  EXPECT_EQ(tokenizer::find_invalid_utf8("x\x80"), 1u);                // lone continuation
}

TEST(Utf8, LossyReplacesMaximalSubpartsLikeRust) {
  EXPECT_EQ(tokenizer::utf8_lossy("a\xF0\x9F\x98"), "a\uFFFD");             // one truncated sequence
  EXPECT_EQ(tokenizer::utf8_lossy("\xC0\x80"), "\uFFFD\uFFFD");             // overlong: two
  EXPECT_EQ(tokenizer::utf8_lossy("\xED\xA0\x80"), "\uFFFD\uFFFD\uFFFD");   // surrogate: three
  EXPECT_EQ(tokenizer::utf8_lossy("ok \xE2\x82\xAC"), "ok \u20AC");
}

TEST(Normalizer, NfcComposesAndMapsOffsetsToTheOriginalStretch) {
  const auto nfc = tokenizer::Normalizer::from_json({{"type", "NFC"}});
  tokenizer::NormalizedText normalized;
  const std::string text = "xe\u0301y";  // x, e + combining acute, y
  nfc.normalize(text, 10, normalized);
  EXPECT_EQ(normalized.text(), "x\u00e9y");
  EXPECT_EQ(normalized.original_begin(0), 10u);
  EXPECT_EQ(normalized.original_begin(1), 11u);  // é starts where e did
  EXPECT_EQ(normalized.original_end(3), 14u);    // and ends after the combining mark
  EXPECT_EQ(normalized.original_begin(3), 14u);  // y
  EXPECT_EQ(normalized.original_end(4), 15u);
  nfc.normalize("already composed \u00e9 text", 0, normalized);
  EXPECT_EQ(normalized.text(), "already composed \u00e9 text");
}

TEST(Normalizer, SequenceAppliesInOrderAndUnknownTypesAreNamed) {
  const auto sequence =
      tokenizer::Normalizer::from_json({{"type", "Sequence"}, {"normalizers", {{{"type", "NFD"}}, {{"type", "NFKC"}}}}});
  EXPECT_EQ(sequence.normalize("\uFB01 \u212B"), "fi \u00C5");
  const std::string message = error_of([] { tokenizer::Normalizer::from_json({{"type", "Lowercase"}}); });
  EXPECT_NE(message.find("'Lowercase'"), std::string::npos) << message;
}

TEST(PreTokenizer, TranslatesOnigurumaOnlyConstructs) {
  EXPECT_EQ(tokenizer::translate_oniguruma_pattern(R"((?i:'s|'t)|\s+(?!\S)|[^\s\p{L}])"),
            R"((?:'[sS]|'[tT])|[\s\x{85}]+(?![^\s\x{85}])|[^\s\x{85}\p{L}])");
}

TEST(PreTokenizer, QwenPatternSplitsLikeHf) {
  const auto pre = tokenizer::PreTokenizer::from_json(
      {{"type", "Split"},
       {"pattern", {{"Regex", R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
       {"behavior", "Isolated"}});
  const std::string text = "HE'LL pay 42  now!\n";
  std::vector<tokenizer::Piece> pieces;
  pre.split(text, true, pieces);
  std::vector<std::string> words;
  for (const auto& piece : pieces) words.push_back(text.substr(piece.begin, piece.end - piece.begin));
  EXPECT_EQ(words, (std::vector<std::string>{"HE", "'LL", " pay", " ", "4", "2", " ", " now", "!\n"}));
}

TEST(Bpe, MergesByRankWithBothSpellings) {
  const std::vector<std::pair<std::string, std::string>> merges = {{"l", "o"}, {"lo", "w"}, {"e", "r"}, {"low", "er"}};
  const Tokenizer strings = from(toy_tokenizer(merges, false));
  const Tokenizer pairs = from(toy_tokenizer(merges, true));
  const auto ids = strings.encode("lower", false);
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_EQ(strings.id_to_token(ids[0]), "lower");
  EXPECT_EQ(pairs.encode("lower lowly", false), strings.encode("lower lowly", false));
  EXPECT_EQ(strings.decode(strings.encode("lower lowly", false)), "lower lowly");
}

TEST(Bpe, LowerRankWinsOverLeftPosition) {
  // "abc": (b,c) has the lower rank, so it merges first and (a,b) never applies.
  const Tokenizer tokenizer = from(toy_tokenizer({{"b", "c"}, {"a", "b"}}, true));
  const auto ids = tokenizer.encode("abc", false);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_EQ(tokenizer.id_to_token(ids[0]), "a");
  EXPECT_EQ(tokenizer.id_to_token(ids[1]), "bc");
}

TEST(Bpe, IgnoreMergesEmitsWholeVocabWords) {
  // "xyz" is in the vocab but no merge reaches it.
  const auto json = toy_tokenizer({{"x", "y"}}, true, false, {"xyz"});
  EXPECT_EQ(from(json).encode("xyz", false).size(), 2u);
  auto ignoring = json;
  ignoring["model"]["ignore_merges"] = true;
  const Tokenizer tokenizer = from(ignoring);
  const auto ids = tokenizer.encode("xyz", false);
  ASSERT_EQ(ids.size(), 1u);
  EXPECT_EQ(tokenizer.id_to_token(ids[0]), "xyz");
}

TEST(Bpe, ZeroMergesAndBadMergesAreErrors) {
  auto json = toy_tokenizer({{"a", "b"}}, true);
  json["model"]["merges"] = nlohmann::json::array();
  EXPECT_NE(error_of([&] { from(json); }).find("zero BPE merges"), std::string::npos);
  json["model"]["merges"] = nlohmann::json::array({"a b c"});
  EXPECT_NE(error_of([&] { from(json); }).find("merge #0"), std::string::npos);
  json["model"]["merges"] = nlohmann::json::array({nlohmann::json::array({"a", "\u4E2D"})});
  EXPECT_NE(error_of([&] { from(json); }).find("not in the vocab"), std::string::npos);
  json["model"].erase("merges");
  EXPECT_NE(error_of([&] { from(json); }).find("merges is missing"), std::string::npos);
}

TEST(Tokenizer, UnsupportedComponentsAreNamed) {
  auto json = toy_tokenizer({{"a", "b"}}, true);
  json["pre_tokenizer"] = {{"type", "WhitespaceSplit"}};
  EXPECT_NE(error_of([&] { from(json); }).find("'WhitespaceSplit'"), std::string::npos);
  json = toy_tokenizer({{"a", "b"}}, true);
  json["model"]["type"] = "WordPiece";
  EXPECT_NE(error_of([&] { from(json); }).find("'WordPiece'"), std::string::npos);
  EXPECT_NE(error_of([] { Tokenizer::from_json("{not json", ""); }).find("not valid JSON"), std::string::npos);
  EXPECT_NE(error_of([] { Tokenizer::load("/nonexistent/folder"); }).find("has no tokenizer.json"), std::string::npos);
}

TEST(Tokenizer, InvalidUtf8IsAnErrorWithItsOffset) {
  const Tokenizer tokenizer = from(toy_tokenizer({{"a", "b"}}, true));
  const std::string message = error_of([&] { tokenizer.encode("ab\xFF" "cd"); });
  EXPECT_NE(message.find("not valid UTF-8"), std::string::npos) << message;
  EXPECT_NE(message.find("0xFF at byte offset 2"), std::string::npos) << message;
}

TEST(Tokenizer, SpecialTokensAreMatchedFirstAndSkippedOnRequest) {
  const Tokenizer tokenizer = from(toy_tokenizer({{"a", "b"}}, true));
  const auto ids = tokenizer.encode("ab<|s|>ab", false);
  ASSERT_EQ(ids.size(), 3u);
  EXPECT_EQ(ids[1], 1000);
  EXPECT_TRUE(tokenizer.is_special(1000));
  EXPECT_EQ(tokenizer.decode(ids, false), "ab<|s|>ab");
  EXPECT_EQ(tokenizer.decode(ids, true), "abab");
  EXPECT_EQ(tokenizer.token_to_id("<|s|>"), 1000);
  EXPECT_EQ(tokenizer.vocab_size(), 1001);
  EXPECT_NE(error_of([&] { tokenizer.decode(std::vector<int32_t>{5000}); }).find("not in the vocabulary"),
            std::string::npos);
}

TEST(Tokenizer, ConfigSpecialTokensAsStringNullOrObject) {
  const auto json = toy_tokenizer({{"a", "b"}}, true);
  const Tokenizer tokenizer = from(
      json, R"({"bos_token": null, "eos_token": "<|s|>", "pad_token": {"__type": "AddedToken", "content": "ab"}})");
  EXPECT_FALSE(tokenizer.bos_token_id().has_value());
  EXPECT_EQ(tokenizer.eos_token_id(), 1000);
  EXPECT_EQ(tokenizer.eos_token(), "<|s|>");
  EXPECT_EQ(tokenizer.pad_token_id(), tokenizer.token_to_id("ab"));
  EXPECT_NE(error_of([&] { from(json, R"({"eos_token": "<|missing|>"})"); }).find("<|missing|>"), std::string::npos);
  EXPECT_NE(error_of([&] { from(json, R"({"eos_token": 7})"); }).find("eos_token"), std::string::npos);
}

TEST(Tokenizer, OffsetsCoverTheInputBytes) {
  const Tokenizer tokenizer = from(toy_tokenizer({{"a", "b"}, {"\xC3", "\xA9"}}, true));
  const std::string text = "ab \u00e9<|s|>\U0001F600";
  const Encoding encoding = tokenizer.encode_with_offsets(text, false);
  ASSERT_EQ(encoding.ids.size(), encoding.offsets.size());
  size_t expected_begin = 0;
  for (size_t i = 0; i < encoding.ids.size(); ++i) {
    EXPECT_EQ(encoding.offsets[i].begin, expected_begin) << "token " << i;
    expected_begin = encoding.offsets[i].end;
  }
  EXPECT_EQ(expected_begin, text.size());
}

TEST(Tokenizer, ConcurrentEncodesGiveTheSameIds) {
  const std::string dir = find_shipped("qwen3");
  if (dir.empty()) SPINDLE_SKIP_WITHOUT_REFERENCE(missing_shipped("qwen3"));
  const Tokenizer& tokenizer = cached_tokenizer(dir);
  std::vector<std::string> texts;
  std::ifstream in(std::string(SPINDLE_SOURCE_DIR) + "/tests/tokenizer/corpus.jsonl");
  for (std::string line; std::getline(in, line);) texts.push_back(nlohmann::json::parse(line)["text"]);
  std::vector<std::vector<int32_t>> expected;
  for (const auto& text : texts) expected.push_back(tokenizer.encode(text));
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int round = 0; round < 3; ++round)
        for (size_t i = t; i < texts.size() + t; ++i) {
          const size_t k = i % texts.size();
          mismatches[t] += tokenizer.encode(texts[k]) != expected[k];
        }
    });
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

}  // namespace
}  // namespace spindle::test
