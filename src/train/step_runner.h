// One optimizer step's forward/backward over the mesh: which rows this process takes (data
// parallel), which part of each row (sequence parallel), and the one global denominator
// (docs/design.md §2.2). The same code runs a single process (no mesh) and any dp × ulysses × ring mesh,
// so `spindle sft`, `spindle eval` and `spindle check` cannot drift apart.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "comm/process_group.h"
#include "data/document.h"
#include "model/decoder.h"
#include "model/router_aux_loss.h"
#include "parallel/mesh.h"

namespace spindle {

// How this process takes part in a run: its place in the job, the world group and the mesh built
// on it. A single process has neither group and a 1×1 mesh config.
struct RunTopology {
  ProcessGroupInfo process;
  parallel::MeshConfig mesh_config;
  std::unique_ptr<comm::Communicator> world;  // null for one process
  std::unique_ptr<parallel::Mesh> mesh;       // null for one process
  bool is_main() const { return process.rank == 0; }
  int world_size() const { return process.world_size; }
};

// Reads the job from the environment (launcher, torchrun, SLURM), resolves and validates the mesh
// against the world size and the model's heads — before anything is allocated, so a wrong
// combination is an error naming the flags — then connects the processes (Gloo on host tensors,
// or NCCL on CUDA device `cuda_device` when it is ≥ 0) and builds the groups.
RunTopology connect_run(const parallel::MeshFlags& flags, int num_q_heads, int num_kv_heads, int cuda_device = -1);

struct StepTotals {
  double loss = 0;        // Σ loss_scale·CE / N over the whole global batch (every rank gets it)
  int64_t num_items = 0;  // N: supervised targets of the global batch
  int64_t tokens = 0;     // real (unpadded) tokens of the global batch
  // The router load-balancing loss of the step (without its coefficient; the gradient is of
  // loss + coefficient·aux_loss), when the run has one (model/router_aux_loss.h).
  std::optional<double> aux_loss;
};

class StepRunner {
 public:
  // mesh == nullptr: one process. The decoder computes with `weights`, the strategy matching the
  // mesh's sp layout and `router_aux` (set on it by whoever built it: train/run_assembly.h).
  // all_reduce_gradients: sum every trainable gradient over the world after backward (replicated
  // parameters); FSDP instead reduce-scatters inside the decoder's hooks. router_aux: the router
  // load-balancing loss the training steps add (its statistics over the whole step: every
  // micro-batch, every rank), or null.
  StepRunner(Backend& backend, Decoder& decoder, ModelWeights& weights, const parallel::Mesh* mesh,
             bool all_reduce_gradients, RouterAuxLoss* router_aux = nullptr);

  // rows: every row of the step, identical on every rank (each rank draws the same sequence);
  // row j goes to data-parallel replica j mod dp, and each sp rank computes its shard of it.
  // Every rank must call with the same number of rows (a multiple of dp: pad with
  // padding_row() when the data runs short). With backward, trainable gradients hold
  // ∂loss/∂θ of the whole global batch afterwards (summed across ranks when replicated).
  StepTotals run(const std::vector<PackedRow>& rows, bool backward);

  // The rows this rank computes for `rows` (its dp share, each cut to its sp shard).
  std::vector<PackedRow> local_rows(const std::vector<PackedRow>& rows) const;

 private:
  double all_reduce(double value);
  // The step's router statistics before any backward: with one micro-batch per rank its own forward
  // collects them (the decoder finishes them before its backward); with several, a forward-only
  // pass over every micro-batch first (one more forward per step).
  void collect_router_statistics(const std::vector<PackedRow>& rows, const std::vector<PackedRow>& mine,
                                 int64_t tokens, double scale);
  MicroBatch micro_batch(const std::vector<PackedRow>& rows, const std::vector<PackedRow>& mine, size_t i) const;

  Backend& backend_;
  Decoder& decoder_;
  ModelWeights& weights_;
  const parallel::Mesh* mesh_;
  bool all_reduce_gradients_;
  RouterAuxLoss* router_aux_;
};

// A row of `length` padding tokens (no document, no target): keeps data-parallel replicas in step.
PackedRow padding_row(int64_t length);

}  // namespace spindle
