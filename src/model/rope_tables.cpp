#include "model/rope_tables.h"

#include "core/error.h"

namespace spindle {

namespace {
// Dynamic NTK makes a table per document length past max_position_embeddings: at most this many are
// kept between micro-batches (each is rotary_dim/2 floats).
constexpr size_t kMaxKeptTables = 64;
}  // namespace

RopeTables::RopeTables(Backend& backend, Stream stream, const RopeConfig& rope, int64_t rotary_dim)
    : backend_(backend), stream_(stream), rope_(rope), rotary_dim_(rotary_dim) {
  table(0, 0);
}

const Tensor& RopeTables::table(int64_t key, int64_t length) {
  if (auto it = tables_.find(key); it != tables_.end()) return it->second;
  if (tables_.size() >= kMaxKeptTables) std::erase_if(tables_, [](const auto& kv) { return kv.first != 0; });
  const std::vector<float> inv = rope_inverse_frequencies(rope_, rotary_dim_, length);
  Tensor t = backend_.empty(Shape{static_cast<int64_t>(inv.size())}, DType::F32);
  backend_.copy_from_host(stream_, inv.data(), t);
  return tables_.emplace(key, std::move(t)).first->second;
}

std::vector<RopeSpan> RopeTables::spans(const MicroBatch& batch) {
  const int64_t t = batch.num_tokens;
  if (!rope_.depends_on_length()) return {{0, t, table(0, 0)}};
  std::vector<RopeSpan> out;
  int64_t covered = 0, last_key = -1;
  for (const DocumentRun& run : batch.document_runs) {
    SPINDLE_CHECK(run.begin == covered && run.end > run.begin, "document runs [{}, {}) after token {}", run.begin,
                  run.end, covered);
    covered = run.end;
    // Padding (length 0) rotates with its neighbours' table: it is seen by no real token.
    const int64_t key = run.length == 0 && last_key >= 0 ? last_key : rope_.table_key(run.length);
    if (key == last_key) {
      out.back().end = run.end;
      continue;
    }
    out.push_back({run.begin, run.end, table(key, run.length)});
    last_key = key;
  }
  SPINDLE_CHECK(covered == t, "the micro-batch's document runs cover {} of its {} tokens (a length-dependent RoPE "
                "needs them: make_micro_batch sets them)", covered, t);
  return out;
}

}  // namespace spindle
