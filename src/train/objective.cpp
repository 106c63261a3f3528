#include "train/objective.h"

#include <cstdio>

#include "parallel/mesh.h"
#include "train/setup.h"

namespace spindle {

void Objective::describe_data(const TrainDataLoader& loader, const TrainConfig& config) const {
  std::fprintf(stderr, "%lld rows of up to %lld tokens per epoch\n", static_cast<long long>(loader.rows_per_epoch()),
               static_cast<long long>(config.max_length));
}

namespace {

class SftRunner final : public ObjectiveRunner {
 public:
  explicit SftRunner(const ObjectiveContext& c)
      : context_(c),
        runner_(c.backend, c.policy.decoder(), c.policy.weights, c.run.mesh.get(), c.policy.all_reduce_gradients(),
                c.policy.router_aux.get()) {}

  void prepare(const ObjectiveData& data) override {
    if (data.eval.empty()) return;
    eval_rows_ = load_rows(data.eval, data.pack);
    // Every data-parallel replica scores the same number of rows (collectives inside each step).
    const parallel::MeshConfig& mesh = context_.run.mesh_config;
    while (eval_rows_.size() % mesh.dp) eval_rows_.push_back(padding_row(parallel::sequence_multiple(mesh)));
  }

  ObjectiveStep step(const std::vector<LoaderItem>& items, bool backward) override {
    // Every rank holds all rows of the global batch (the same ones) and takes its share.
    std::vector<PackedRow> rows;
    for (const LoaderItem& item : items)
      for (const PackedRow& row : item.rows) rows.push_back(row);
    return outcome(runner_.run(rows, backward), static_cast<int64_t>(rows.size()));
  }

  std::optional<ObjectiveStep> evaluate() override {
    if (eval_rows_.empty()) return std::nullopt;
    return outcome(runner_.run(eval_rows_, /*backward=*/false), static_cast<int64_t>(eval_rows_.size()));
  }

 private:
  static ObjectiveStep outcome(const StepTotals& totals, int64_t rows) {
    ObjectiveStep s;
    s.loss = totals.loss;
    s.num_items = totals.num_items;
    s.tokens = totals.tokens;
    s.rows = rows;
    s.aux_loss = totals.aux_loss;
    return s;
  }

  ObjectiveContext context_;
  StepRunner runner_;
  std::vector<PackedRow> eval_rows_;
};

}  // namespace

std::unique_ptr<ObjectiveRunner> SftObjective::bind(const ObjectiveContext& context) const {
  return std::make_unique<SftRunner>(context);
}

}  // namespace spindle
