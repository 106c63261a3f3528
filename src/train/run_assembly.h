// One run, put together in one place. A RunDescription says what a run builds: the model's weights
// (from a checkpoint, random, or shapes only; 4-bit or dense), what trains (LoRA, a PEFT adapter,
// every weight, or nothing: a frozen reference), whether parameters, gradients and optimizer state
// are FSDP-sharded over the processes, the optimizer, the decoder's memory options (recompute,
// offload, MLP tiles, sparse checkpoints) and the router load-balancing loss. assemble_run builds it
// on a backend and a mesh, with the sequence-parallel strategy of each mixer kind (attention, gated
// DeltaNet: parallel/sp_attention.h) the mesh needs.
//
// Every command that computes a training step builds its model here: sft and dpo (the policy, and
// dpo's frozen reference), check (the mesh, one process and its F64 twin), bench (on the timed
// backend) and plan (on the dry backend, whose allocations it labels by AssemblyStage). So what
// bench measures and plan predicts is what sft runs.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "model/attention_strategy.h"
#include "model/config.h"
#include "model/decoder.h"
#include "model/quantized_weights.h"
#include "model/router_aux_loss.h"
#include "model/weights.h"
#include "parallel/mesh.h"
#include "train/optimizer.h"
#include "train/trainable_state.h"

namespace spindle {

struct TrainConfig;

// Where the weights come from.
enum class WeightSource {
  kCheckpoint,  // RunDescription::checkpoint (safetensors, sharded or not; 4-bit as stored or as quantised)
  kRandom,      // drawn from RunDescription::weight_seed, as `spindle bench` draws them: no checkpoint is read
  kShapes,      // allocated, never written (`spindle plan`'s dry backend); 4-bit projections declared as such
};

// What trains.
struct AdapterDescription {
  enum class Kind {
    kFrozen,   // nothing: a reference model
    kFull,     // every weight
    kNewLora,  // new LoRA adapters, initialised from `seed` (identical on every rank)
    kPeft,     // the PEFT adapter in `folder`
  };
  Kind kind = Kind::kNewLora;
  LoraConfig lora;                  // kNewLora; targets empty: every projection the model has
  bool only_targets_present = false;  // kNewLora: leave out the targets the model lacks (sft's default list)
  uint64_t seed = 0;                // kNewLora
  std::filesystem::path folder;     // kPeft
};

struct RunDescription {
  ModelConfig model;
  WeightSource weights = WeightSource::kCheckpoint;
  std::filesystem::path checkpoint;  // kCheckpoint: a model folder (or a full fine-tune's checkpoint-N/model)
  uint64_t weight_seed = 0;          // kRandom
  DType dtype = DType::F32;          // compute dtype of the weights and activations
  QuantizeOptions quantize;          // 4-bit base projections (a checkpoint already 4-bit loads as stored)
  AdapterDescription adapter;
  // Several processes: parameters, gradients and optimizer state sharded over every rank (FSDP);
  // false: replicated, gradients all-reduced after backward.
  bool shard = true;
  std::optional<AdamWConfig> optimizer;  // none: no optimizer state (bench's step, a reference model)
  DecoderOptions decoder;                // recompute, offload, MLP tiles, checkpoint stride
  double router_aux_loss = 0;            // coefficient of the router load-balancing loss (0: off)
};

// The stages of assemble_run, in order; `spindle plan` labels each stage's allocations.
enum class AssemblyStage { kWeights, kTrainable, kShards, kOptimizer, kRouterAux };

// Where the run computes: its world group and the mesh over it (both null: one process).
struct RunPlacement {
  comm::Communicator* world = nullptr;
  const parallel::Mesh* mesh = nullptr;
  int rank() const { return world ? world->rank() : 0; }
  int sp() const { return mesh ? mesh->config().sp : 1; }
};

// A run built on a backend. Its decoder computes with the weights, the mesh's sequence-parallel
// strategy, FSDP's parameter hooks and the router loss; make_decoder builds more decoders the same
// way (bench: one per length and one on the timed backend; plan: one on the step-cost model).
class AssembledRun {
 public:
  AssembledRun(Backend& backend, const RunDescription& description) : backend_(backend), description_(description) {}
  AssembledRun(const AssembledRun&) = delete;
  AssembledRun& operator=(const AssembledRun&) = delete;

  ModelWeights weights;
  std::unique_ptr<TrainableState> state;               // FSDP shards (or not) and the optimizer
  std::unique_ptr<AttentionStrategy> sequence_mixer;   // sp > 1: every mixer kind's strategy; else null
  std::unique_ptr<RouterAuxLoss> router_aux;           // null when off
  // Counted before sharding: every weight (a 4-bit projection as its out × in weights) and the trainable ones.
  int64_t parameters = 0, trainable_parameters = 0;

  const RunDescription& description() const { return description_; }
  Backend& backend() const { return backend_; }
  // The run's decoder, with the description's memory options (built on first use: bench and plan
  // build their own with make_decoder, and allocate none of it).
  Decoder& decoder();
  // A decoder on `compute` (the run's backend, or one that decorates it) with these options,
  // attached as decoder() is.
  std::unique_ptr<Decoder> make_decoder(Backend& compute, const DecoderOptions& options) const;
  // Whether replicated gradients must be summed over the world after backward (no FSDP).
  bool all_reduce_gradients() const { return state->all_reduce_gradients(); }

 private:
  Backend& backend_;
  RunDescription description_;
  std::unique_ptr<Decoder> decoder_;  // last: it computes with everything above
};

// Builds `description` on `backend` at `placement`. Collective when sharded (every rank the same
// description). `on_stage` (optional) is called as each stage begins.
std::unique_ptr<AssembledRun> assemble_run(Backend& backend, const RunDescription& description,
                                           const RunPlacement& placement = {},
                                           const std::function<void(AssemblyStage)>& on_stage = {});

// The decoder's memory options from the values of --recompute, --recompute-layers, --offload,
// --offload-layers, --mlp-tile-tokens (parsed; auto runs untiled) and --checkpoint-stride.
DecoderOptions memory_options(RecomputeMode recompute, int64_t num_layers, int64_t recompute_layers, bool offload,
                              int64_t offload_layers, int64_t mlp_tile_tokens, int64_t checkpoint_stride);

// What sft, dpo and check build from their options: --model's weights (or, resuming, the
// checkpoint's: a full fine-tune's model/, a LoRA run's adapter/), --full, --adapter or new LoRA
// adapters from --seed, --quantize, FSDP unless --no-fsdp, AdamW, the memory options and the router
// loss. `resume_from`: the checkpoint being resumed, or empty.
RunDescription describe_training_run(const TrainConfig& config, const ModelConfig& model, DType dtype,
                                     const std::filesystem::path& resume_from = {});

// The frozen reference of a preference run: `folder`'s weights, quantised as the policy's, sharded as
// the policy is, computing with the policy's memory options.
RunDescription describe_reference(const RunDescription& policy, const ModelConfig& model,
                                  const std::filesystem::path& folder);

}  // namespace spindle
