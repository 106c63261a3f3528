// Training rows from one or more prepared datasets: packed once, shuffled per epoch, mixed by
// weight. The order is a pure function of (seed, position), so a resumed run continues exactly:
// the state is only the cursors. The loader hands out items: one packed row of documents (SFT),
// or, for preference datasets (DPO), the rows of whole pairs (plan_prepared_pairs: usually one
// row, two when a pair's sides do not fit in one row together) with the dataset index of each
// row's documents, so a pair's responses are always drawn together.
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
  std::string given;           // the --data path the user gave, which messages name (empty: `path`)
  std::string name() const { return given.empty() ? path.string() : given; }
};

// "PATH" or "PATH:WEIGHT" (the weight only when what follows the last ':' is a number).
DataSource parse_data_spec(const std::string& spec);

// What the loader hands out at a time.
struct LoaderItem {
  std::vector<PackedRow> rows;  // one row of documents; preference data: the rows of whole pairs
  // documents[r][d]: dataset index of document d of rows[r] (its doc_ids refer to d)
  std::vector<std::vector<int64_t>> documents;
  size_t source = 0;  // which DataSource the rows come from
};

struct LoaderState {
  int64_t rows_drawn = 0;              // items handed out, all sources together
  std::vector<int64_t> epoch, cursor;  // per source: epoch and position in its shuffled order
  nlohmann::json to_json() const;
  static LoaderState from_json(const nlohmann::json& j);
};

class TrainDataLoader {
 public:
  // kind: the datasets it must hold (documents for SFT, preference pairs for DPO).
  TrainDataLoader(const std::vector<DataSource>& sources, const PackOptions& pack, uint64_t seed,
                  DatasetKind kind = DatasetKind::kDocuments);

  PackedRow next();       // documents: the next row
  LoaderItem next_item();  // either kind: the next item
  // Items (rows of documents) in one pass over every source (an "epoch" of the mixture).
  int64_t rows_per_epoch() const;
  // Every item of a source in dataset order (not shuffled): for passes over all the data.
  size_t num_sources() const { return sources_.size(); }
  int64_t items_in(size_t source) const;
  LoaderItem item(size_t source, int64_t index) const;
  int64_t pairs_dropped() const { return pairs_dropped_; }  // preference data: pairs left out
  // Fractional epochs consumed (rows drawn / rows per epoch).
  double epochs_done() const;
  const LoaderState& state() const { return state_; }
  void restore(const LoaderState& state);
  const PackStats& pack_stats() const { return stats_; }

 private:
  struct Source {
    PreparedDataset dataset;
    std::vector<RowPlan> rows;
    std::vector<int64_t> item_start;  // [items + 1] item i = rows[item_start[i] .. item_start[i+1])
    std::vector<int64_t> order;  // this epoch's permutation of items
    double weight;
  };
  void shuffle(size_t source);
  size_t pick_source() const;

  std::vector<Source> sources_;
  PackOptions pack_;
  PackStats stats_;
  uint64_t seed_;
  int64_t pairs_dropped_ = 0;
  LoaderState state_;
};

}  // namespace spindle
