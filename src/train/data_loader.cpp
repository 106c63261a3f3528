#include "train/data_loader.h"

#include <algorithm>
#include <numeric>
#include <random>

#include "core/error.h"

namespace spindle {

namespace {
// splitmix64: a counter-based generator, so a draw depends only on its position.
uint64_t mix(uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}
}  // namespace

DataSource parse_data_spec(const std::string& spec) {
  const size_t colon = spec.rfind(':');
  if (colon != std::string::npos && colon + 1 < spec.size()) {
    const std::string tail = spec.substr(colon + 1);
    char* end = nullptr;
    const double weight = std::strtod(tail.c_str(), &end);
    if (end && *end == '\0') return {spec.substr(0, colon), weight, spec.substr(0, colon)};
  }
  return {spec, 1.0, spec};
}

nlohmann::json LoaderState::to_json() const {
  return {{"rows_drawn", rows_drawn}, {"epoch", epoch}, {"cursor", cursor}};
}

LoaderState LoaderState::from_json(const nlohmann::json& j) {
  LoaderState s;
  s.rows_drawn = j.at("rows_drawn").get<int64_t>();
  s.epoch = j.at("epoch").get<std::vector<int64_t>>();
  s.cursor = j.at("cursor").get<std::vector<int64_t>>();
  return s;
}

TrainDataLoader::TrainDataLoader(const std::vector<DataSource>& sources, const PackOptions& pack, uint64_t seed,
                                 DatasetKind kind)
    : pack_(pack), seed_(seed) {
  if (sources.empty()) fail("no training data: pass --data FILE");
  for (const DataSource& src : sources) {
    if (!(src.weight > 0)) fail("data weight of {} must be positive, got {}", src.name(), src.weight);
    PreparedDataset dataset = PreparedDataset::open(src.path);
    if (dataset.kind() != kind) {
      if (kind == DatasetKind::kDocuments)
        fail("{} holds preference pairs; spindle sft trains on documents (use spindle dpo)", src.name());
      fail("{} holds documents, not preference pairs; spindle dpo needs chosen/rejected pairs (docs/formats.md) "
           "(use spindle sft for documents)", src.name());
    }
    PackStats stats;
    std::vector<RowPlan> rows;
    std::vector<int64_t> item_start{0};
    if (kind == DatasetKind::kDocuments) {
      rows = plan_prepared_rows(dataset, pack_, stats);
      for (size_t i = 1; i <= rows.size(); ++i) item_start.push_back(static_cast<int64_t>(i));
    } else {
      for (std::vector<RowPlan>& group : plan_prepared_pairs(dataset, pack_, stats, pairs_dropped_)) {
        for (RowPlan& row : group) rows.push_back(std::move(row));
        item_start.push_back(static_cast<int64_t>(rows.size()));
      }
    }
    stats_.add(stats);
    if (rows.empty()) fail("{} yields no training row (every document was dropped: {})", src.name(), stats.summary());
    sources_.push_back({std::move(dataset), std::move(rows), std::move(item_start), {}, src.weight});
  }
  state_.epoch.assign(sources_.size(), 0);
  state_.cursor.assign(sources_.size(), 0);
  for (size_t i = 0; i < sources_.size(); ++i) shuffle(i);
}

void TrainDataLoader::shuffle(size_t i) {
  Source& s = sources_[i];
  s.order.resize(s.item_start.size() - 1);
  std::iota(s.order.begin(), s.order.end(), 0);
  std::mt19937_64 rng(mix(seed_ ^ mix(i * 1000003ULL + static_cast<uint64_t>(state_.epoch[i]))));
  // Fisher–Yates with our own index draws: std::shuffle's use of the engine is not specified.
  for (size_t k = s.order.size(); k > 1; --k) std::swap(s.order[k - 1], s.order[rng() % k]);
}

size_t TrainDataLoader::pick_source() const {
  if (sources_.size() == 1) return 0;
  double total = 0;
  for (const Source& s : sources_) total += s.weight;
  const double u = static_cast<double>(mix(seed_ ^ mix(static_cast<uint64_t>(state_.rows_drawn)) ^ 0x5eedULL) >> 11) *
                   0x1.0p-53 * total;
  double acc = 0;
  for (size_t i = 0; i < sources_.size(); ++i) {
    acc += sources_[i].weight;
    if (u < acc) return i;
  }
  return sources_.size() - 1;
}

LoaderItem TrainDataLoader::item(size_t source, int64_t index) const {
  const Source& s = sources_.at(source);
  LoaderItem item;
  item.source = source;
  PackStats ignored;
  for (int64_t r = s.item_start.at(index); r < s.item_start.at(index + 1); ++r) {
    const RowPlan& plan = s.rows[r];
    item.rows.push_back(build_row(plan, [&](int64_t d) { return s.dataset.document(d); }, pack_, ignored));
    std::vector<int64_t>& documents = item.documents.emplace_back();
    for (const DocumentSlice& slice : plan.slices) documents.push_back(slice.document);
  }
  return item;
}

LoaderItem TrainDataLoader::next_item() {
  const size_t i = pick_source();
  Source& s = sources_[i];
  if (state_.cursor[i] >= static_cast<int64_t>(s.order.size())) {
    ++state_.epoch[i];
    state_.cursor[i] = 0;
    shuffle(i);
  }
  const int64_t index = s.order[state_.cursor[i]++];
  ++state_.rows_drawn;
  return item(i, index);
}

PackedRow TrainDataLoader::next() {
  LoaderItem drawn = next_item();
  SPINDLE_CHECK(drawn.rows.size() == 1, "TrainDataLoader::next on preference data: use next_item");
  return std::move(drawn.rows.front());
}

int64_t TrainDataLoader::items_in(size_t source) const {
  return static_cast<int64_t>(sources_.at(source).item_start.size()) - 1;
}

int64_t TrainDataLoader::rows_per_epoch() const {
  int64_t n = 0;
  for (size_t i = 0; i < sources_.size(); ++i) n += items_in(i);
  return n;
}

double TrainDataLoader::epochs_done() const {
  return static_cast<double>(state_.rows_drawn) / static_cast<double>(std::max<int64_t>(1, rows_per_epoch()));
}

void TrainDataLoader::restore(const LoaderState& state) {
  if (state.epoch.size() != sources_.size() || state.cursor.size() != sources_.size())
    fail("the checkpoint was written with {} data sources but this run has {}: resume with the same --data",
         state.epoch.size(), sources_.size());
  state_ = state;
  for (size_t i = 0; i < sources_.size(); ++i) {
    if (state_.cursor[i] > items_in(i))
      fail("the checkpoint's data position is past the end of {}: resume with the same --data and --max-length",
           sources_[i].dataset.path().string());
    shuffle(i);
  }
}

}  // namespace spindle
