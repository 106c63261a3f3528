// Single-thread tokenizer throughput: encode each document of a JSONL ({"text": ...}) once, as
// scripts/tokenizer/bench_hf.py does with HF tokenizers. Not a test; numbers go to docs/perf.md.
//   bench_tokenizer TOKENIZER_DIR TEXTS.jsonl
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/tokenizer/tokenizer.h"

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s TOKENIZER_DIR TEXTS.jsonl\n", argv[0]);
    return 2;
  }
  try {
    const auto load_start = std::chrono::steady_clock::now();
    const spindle::Tokenizer tokenizer = spindle::Tokenizer::load(argv[1]);
    const double load_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - load_start).count();
    std::ifstream in(argv[2], std::ios::binary);
    std::vector<std::string> docs;
    size_t bytes = 0;
    for (std::string line; std::getline(in, line);) {
      docs.push_back(nlohmann::json::parse(line)["text"].get<std::string>());
      bytes += docs.back().size();
    }
    const auto start = std::chrono::steady_clock::now();
    size_t tokens = 0;
    for (const std::string& doc : docs) tokens += tokenizer.encode(doc).size();
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("spindle: %zu docs, %.1f MB, %zu tokens, %.2f s, %.2f M tokens/s, %.1f MB/s (load %.2f s)\n",
                docs.size(), bytes / 1e6, tokens, seconds, tokens / seconds / 1e6, bytes / seconds / 1e6, load_seconds);
  } catch (const spindle::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
