// Training rows from one or more prepared datasets: packed once, shuffled per epoch, mixed by
// weight. The order is a pure function of (seed, position), so a resumed run continues exactly:
// the state is only the cursors.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/packing.h"
#include "data/prepared_dataset.h"

namespace spindle {

struct DataSource {
  std::filesystem::path path;  // a prepared dataset (dataset.bin or its folder)
  double weight = 1.0;         // share of rows drawn from this source
};

struct LoaderState {
  int64_t rows_drawn = 0;              // rows handed out, all sources together
  std::vector<int64_t> epoch, cursor;  // per source: epoch and position in its shuffled order
  nlohmann::json to_json() const;
  static LoaderState from_json(const nlohmann::json& j);
};

class TrainDataLoader {
 public:
  TrainDataLoader(const std::vector<DataSource>& sources, const PackOptions& pack, uint64_t seed);

  PackedRow next();
  // Rows in one pass over every source (an "epoch" of the mixture).
  int64_t rows_per_epoch() const;
  // Fractional epochs consumed (rows drawn / rows per epoch).
  double epochs_done() const;
  const LoaderState& state() const { return state_; }
  void restore(const LoaderState& state);
  const PackStats& pack_stats() const { return stats_; }

 private:
  struct Source {
    PreparedDataset dataset;
    std::vector<RowPlan> rows;
    std::vector<int64_t> order;  // this epoch's permutation of rows
    double weight;
  };
  void shuffle(size_t source);
  size_t pick_source() const;

  std::vector<Source> sources_;
  PackOptions pack_;
  PackStats stats_;
  uint64_t seed_;
  LoaderState state_;
};

}  // namespace spindle
