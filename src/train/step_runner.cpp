#include "train/step_runner.h"

#include <algorithm>

#include "comm/cpu_communicator.h"
#include "comm/nccl_communicator.h"
#include "core/error.h"
#include "model/batch.h"
#include "parallel/sequence_shard.h"

namespace spindle {

RunTopology connect_run(const parallel::MeshFlags& flags, int num_q_heads, int num_kv_heads, int cuda_device) {
  RunTopology run;
  run.process = process_group_from_environment();
  run.mesh_config = parallel::resolve_mesh(flags, run.process.world_size, num_q_heads, num_kv_heads);
  if (!run.process.distributed()) return run;
  run.world = cuda_device >= 0 ? comm::connect_nccl_world(run.process, cuda_device) : comm::connect_cpu_world(run.process);
  run.mesh = std::make_unique<parallel::Mesh>(run.mesh_config, *run.world);
  return run;
}

PackedRow padding_row(int64_t length) {
  PackedRow row;
  row.input_ids.assign(length, 0);
  row.positions.resize(length);
  for (int64_t i = 0; i < length; ++i) row.positions[i] = static_cast<int32_t>(i);
  row.doc_ids.assign(length, -1);
  row.targets.assign(length, kIgnoreIndex);
  row.weights.assign(length, 0.0f);
  return row;
}

StepRunner::StepRunner(Backend& backend, Decoder& decoder, ModelWeights& weights, const parallel::Mesh* mesh,
                       bool all_reduce_gradients, RouterAuxLoss* router_aux)
    : backend_(backend),
      decoder_(decoder),
      weights_(weights),
      mesh_(mesh),
      all_reduce_gradients_(all_reduce_gradients),
      router_aux_(router_aux) {}

std::vector<PackedRow> StepRunner::local_rows(const std::vector<PackedRow>& rows) const {
  if (!mesh_) return rows;
  const parallel::MeshConfig& config = mesh_->config();
  if (rows.size() % config.dp != 0)
    fail("a step of {} rows cannot be split over {} data-parallel replicas (pad with padding rows)", rows.size(),
         config.dp);
  std::vector<PackedRow> mine;
  for (size_t j = mesh_->coordinates().dp; j < rows.size(); j += config.dp) {
    if (config.sp == 1) {
      mine.push_back(rows[j]);
    } else {
      std::vector<PackedRow> shards = parallel::shard_row(rows[j], config);
      mine.push_back(std::move(shards[mesh_->sp_rank()]));
    }
  }
  return mine;
}

double StepRunner::all_reduce(double value) {
  if (!mesh_) return value;
  Tensor t = backend_.empty(Shape{1}, DType::F64);
  const Stream st = backend_.default_stream();
  backend_.copy_from_host(st, &value, t);
  mesh_->world().all_reduce_sum(st, t);
  backend_.copy_to_host(st, t, &value);
  return value;
}

MicroBatch StepRunner::micro_batch(const std::vector<PackedRow>& rows, const std::vector<PackedRow>& mine,
                                   size_t i) const {
  MicroBatch batch = make_micro_batch(backend_, {mine[i]}, weights_.dtype);
  // Under pure Ulysses (contiguous layout) the strategy gathers each shard back into its whole row,
  // so whether that row is one causal document is known here, where the whole rows are.
  const bool contiguous = !mesh_ || mesh_->config().ring == 1;
  const PackedRow& whole = mesh_ ? rows[mesh_->coordinates().dp + i * mesh_->config().dp] : rows[i];
  // (and no padding: the slices add up to the row exactly)
  const int64_t sp = mesh_ ? mesh_->config().sp : 1;
  batch.row_one_causal_document = contiguous && is_one_causal_document(whole) &&
                                  static_cast<int64_t>(mine[i].doc_ids.size()) * sp ==
                                      static_cast<int64_t>(whole.doc_ids.size());
  // A shard's documents have the lengths of the whole row's (a length-dependent RoPE reads them).
  if (sp > 1) batch.document_runs = document_runs(mine[i], whole);
  return batch;
}

void StepRunner::collect_router_statistics(const std::vector<PackedRow>& rows, const std::vector<PackedRow>& mine,
                                           int64_t tokens, double scale) {
  std::function<void(Tensor&)> reduce;
  if (mesh_) reduce = [this](Tensor& t) { mesh_->world().all_reduce_sum(backend_.default_stream(), t); };
  router_aux_->begin_step(tokens, std::move(reduce));
  if (mine.size() <= 1) return;
  Tensor discard = backend_.zeros(Shape{1}, stat_dtype(weights_.dtype));
  for (size_t i = 0; i < mine.size(); ++i) decoder_.step(micro_batch(rows, mine, i), scale, discard, false);
  router_aux_->finish_statistics();
}

StepTotals StepRunner::run(const std::vector<PackedRow>& rows, bool backward) {
  StepTotals totals;
  for (const PackedRow& row : rows)
    for (int32_t doc : row.doc_ids) totals.tokens += doc >= 0;
  const std::vector<PackedRow> mine = local_rows(rows);
  // The one denominator: supervised targets of every shard of every row on every rank, counted once.
  int64_t local_items = 0;
  for (const PackedRow& row : mine) local_items += row.num_items();
  totals.num_items = static_cast<int64_t>(all_reduce(static_cast<double>(local_items)));
  if (totals.num_items == 0) return totals;  // same decision on every rank: nothing to learn from

  const Stream st = backend_.default_stream();
  Tensor loss = backend_.zeros(Shape{1}, stat_dtype(weights_.dtype));
  const double scale = 1.0 / static_cast<double>(totals.num_items);
  // Every rank runs every micro-batch, supervised tokens or not: attention and FSDP collectives
  // need all members of their groups.
  const bool aux = backward && router_aux_;
  if (aux) collect_router_statistics(rows, mine, totals.tokens, scale);
  for (size_t i = 0; i < mine.size(); ++i) decoder_.step(micro_batch(rows, mine, i), scale, loss, backward);
  if (aux) {
    totals.aux_loss = router_aux_->value();
    router_aux_->end_step();
  }

  if (mesh_) {
    mesh_->world().all_reduce_sum(st, loss);
    if (backward && all_reduce_gradients_)
      for (Parameter& p : weights_.parameters())
        if (p.trainable) mesh_->world().all_reduce_sum(st, p.grad);
  }
  if (loss.dtype() == DType::F64) {
    backend_.copy_to_host(st, loss, &totals.loss);
  } else {
    float v = 0;
    backend_.copy_to_host(st, loss, &v);
    totals.loss = v;
  }
  return totals;
}

}  // namespace spindle
