// FSDP (ZeRO-3): every parameter, its gradient and (through the optimizer) its AdamW state is
// sharded over all ranks of a group (the mesh's world, dp × sp), each rank keeping 1/world of
// each tensor. The Decoder's ParameterHooks materialise a unit's parameters (embedding, one layer,
// head) just for the span of its use, and hand its gradients back as shards right after its backward.
// docs/parallelism.md ("FSDP") gives the memory formula and the communication per step.
//
// Sharding of one parameter of n elements over W ranks: the flat tensor is padded with zeros to
// W·s elements, s = ceil(n / W); rank r keeps elements [r·s, (r+1)·s). The padding of a value stays
// zero, its gradient is always zero, and AdamW therefore never moves it.
//
// A frozen parameter of another dtype than the model's (a 4-bit weight's packed bytes and absmax,
// docs/qlora.md) is sharded the same way over its bytes, in a byte buffer of its bucket that moves
// in its own all-gather: packed weights travel as 4-bit bytes and are never converted, reduced or
// read as floats on the way.
//
// Intended use by the trainer (one optimizer step = micro-batches, reduce-scatter, sharded AdamW):
//
//   ModelWeights weights = ModelWeights::load(...);  weights.add_lora(...) / train_all(...);
//   parallel::Fsdp fsdp(*backend, weights, mesh.world());        // frees the full tensors
//   Decoder decoder(*backend, weights, options);  decoder.set_parameter_hooks(&fsdp);
//   std::vector<OptimizerSlot> slots;
//   for (auto& s : fsdp.trainable_shards()) slots.push_back({s.name, s.value, s.grad});
//   AdamWOptimizer optimizer(*backend, slots, adam, &mesh.world());  // global-norm clipping
//   fsdp.zero_grads();  for (row : my_rows) decoder.step(batch, 1.0 / global_items, loss, true);
//   optimizer.step(lr);                                           // identical norm on every rank
//   { auto full = fsdp.gather_full(is_lora, 0);  if (rank == 0) save_peft_adapter(..., weights, ...); }
//   auto state = fsdp.gather_state(optimizer.state_tensors(), 0);  // rank 0 writes optimizer.safetensors
//   // resume: fsdp.load_state(optimizer.state_tensors(), read_full_tensor_from_file);
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "backend/backend.h"
#include "comm/communicator.h"
#include "model/decoder.h"
#include "model/weights.h"

namespace spindle::parallel {

struct FsdpOptions {
  // Dtype of the gradient shards, where micro-batches accumulate. Default: F32 for BF16/F16
  // models (accumulating in BF16 would drop bits every micro-batch), the model dtype otherwise.
  std::optional<DType> grad_dtype = std::nullopt;
};

// What the optimizer updates: one trainable parameter's shards on this rank.
struct ParameterShard {
  std::string name;  // the parameter's name (Hugging Face / PEFT)
  Tensor value;      // [s] model dtype
  Tensor grad;       // [s] FsdpOptions::grad_dtype
};

class Fsdp final : public ParameterHooks {
 public:
  // Collective over `group`. `weights` must be fully loaded, identical on every rank, with its
  // trainable parameters chosen (LoRA added, or train_all). Afterwards every Parameter::value and
  // ::grad is undefined except inside a hook window or a gather_full scope. `weights`, `backend`
  // and `group` must outlive this object.
  Fsdp(Backend& backend, ModelWeights& weights, comm::Communicator& group, FsdpOptions options = {});
  ~Fsdp() override;
  Fsdp(const Fsdp&) = delete;
  Fsdp& operator=(const Fsdp&) = delete;

  // ParameterHooks: forward and backward windows all-gather the unit's values, one collective per
  // bucket (the embedding's backward window gathers none: it reads no value); a backward window
  // gives each trainable parameter a zeroed full gradient buffer, and at its end reduce-scatters
  // them (one collective per bucket) and adds the result to the gradient shards
  // (grad_shard += Σ_ranks full_grad, sliced), then frees them.
  void before_forward(const ParameterUnit& unit) override;
  void after_forward(const ParameterUnit& unit) override;
  void before_backward(const ParameterUnit& unit) override;
  void after_backward(const ParameterUnit& unit) override;

  void zero_grads();
  std::vector<ParameterShard> trainable_shards() const;
  int world() const { return group_.size(); }

  // ---- full tensors (exports, checkpoints: files identical to a single-process run) ----------
  // Collective. Keeps the full values of the parameters `select` picks (same choice on every rank)
  // in Parameter::value until the returned scope ends, on every rank (keep_on = -1) or only on
  // rank keep_on (the others gather one tensor at a time and drop it). No decoder step may run
  // inside the scope.
  class GatheredValues {
   public:
    GatheredValues(GatheredValues&& other) noexcept;
    GatheredValues& operator=(GatheredValues&&) = delete;
    ~GatheredValues();

   private:
    friend class Fsdp;
    GatheredValues(Fsdp* owner, std::vector<size_t> held) : owner_(owner), held_(std::move(held)) {}
    Fsdp* owner_;
    std::vector<size_t> held_;  // entries whose full value this scope materialised
  };
  GatheredValues gather_full(const std::function<bool(const Parameter&)>& select, int keep_on = -1);

  // Any tensor sharded like parameter `name` (its optimizer state): the full tensor, shaped like
  // the parameter, in the shard's dtype. Collective.
  Tensor gather_shard(const std::string& name, const Tensor& shard);
  // This rank's slice of `full` (shaped like parameter `name`, any float dtype) into `shard`
  // (converted to its dtype; padding zeroed). Local: every rank reads the same full tensor.
  void load_shard(const std::string& name, const Tensor& full, Tensor& shard);
  // Replaces parameter `name`'s value (an adapter loaded after sharding, ...). Local.
  void set_full_value(const std::string& name, const Tensor& full);
  const Shape& full_shape(const std::string& name) const;

  // Named state tensors "<kind>.<parameter>" (AdamWOptimizer::state_tensors of sharded slots)
  // as full tensors, on every rank (keep_on = -1) or only rank keep_on (empty elsewhere). Collective.
  std::vector<std::pair<std::string, Tensor>> gather_state(const std::vector<std::pair<std::string, Tensor>>& shards,
                                                           int keep_on = -1);
  // The inverse: read_full(name, full) fills a tensor of the parameter's shape (in the shard's
  // dtype) on every rank, and this rank's slice goes into the shard. Local.
  void load_state(const std::vector<std::pair<std::string, Tensor>>& shards,
                  const std::function<void(const std::string& name, Tensor& full)>& read_full);

  // ---- memory accounting ---------------------------------------------------------------------
  // Bytes this rank holds between windows: value shards of every parameter + gradient shards of
  // the trainable ones (optimizer state comes on top, sharded the same way).
  size_t shard_bytes() const;
  // The same quantity for one unsharded process (values + gradients of trainable parameters, in
  // the dtypes used here).
  size_t full_bytes() const;

 private:
  struct Entry {
    Parameter* param;
    Shape shape;
    int64_t numel = 0;
    int64_t shard_numel = 0;  // s; the padded length is s·world
    size_t bucket = 0;
    int64_t value_offset = 0;  // of this shard in its bucket's value shards
    int64_t grad_offset = -1;  // of this shard in its bucket's gradient shards; trainable only
    Tensor value_shard;        // [s] model dtype, a view into the bucket
    Tensor grad_shard;         // [s] grad dtype, a view into the bucket; trainable only
    Tensor full_value;         // [s·world] while gathered (U8 [s·world] for bytes)
    Tensor full_grad;          // [s·world] model dtype, while in a backward window
    // Sharded as bytes (frozen, not the model dtype): s counts bytes, value_offset is into the
    // bucket's byte buffer.
    bool bytes = false;
    int64_t byte_count = 0;  // numel · dtype size
    DType dtype = DType::F32;  // the parameter's own
  };
  // The parameters one collective moves: the embedding, one layer, or the head's own parameters.
  // Each parameter is sharded on its own; a bucket concatenates its parameters' shards, so one
  // all-gather (and one reduce-scatter) serves the whole bucket, and the gathered rows are copied
  // out into each parameter's contiguous full tensor.
  struct Bucket {
    std::vector<size_t> entries;  // parameter order
    int64_t value_numel = 0;      // Σ s over entries
    int64_t grad_numel = 0;       // Σ s over trainable entries
    Tensor values;                // [value_numel] model dtype
    Tensor grads;                 // [grad_numel] grad dtype
    int64_t byte_numel = 0;       // Σ s over byte entries
    Tensor byte_values;           // U8 [byte_numel]: the byte entries' shards
    Tensor byte_prefetched;       // U8 [world·byte_numel] being gathered on the comm stream, or undefined
    int value_users = 0;          // open windows using the gathered values
    int grad_users = 0;           // open backward windows writing full gradients
    Tensor prefetched;            // [world·value_numel] being gathered on the comm stream, or undefined
  };
  const std::vector<size_t>& unit_buckets(const ParameterUnit& unit) const;
  size_t entry_of(const std::string& name) const;
  Tensor gather_padded(const Tensor& shard);  // [s] -> [s·world]
  void acquire_values(Bucket& b);
  // Prefetch: while a unit computes, the all-gather of the unit the Decoder opens next (its
  // documented window order) runs on the backend's comm stream. next_unit_buckets names those
  // buckets (none after the last window that reads values); prefetch starts their gathers;
  // join_prefetches makes the compute stream wait for the comm stream and drops prefetches
  // that were not used (only before a collective of this group on the compute stream or outside
  // the decoder's windows: nothing is left pending across them).
  std::vector<size_t> next_unit_buckets(const ParameterUnit& unit, bool backward) const;
  void prefetch(const std::vector<size_t>& buckets);
  void join_prefetches(bool drop_unused);
  void drop_unused_prefetches(const std::vector<size_t>& used);
  void release_values(Bucket& b);
  void begin_gradients(Bucket& b);
  void finish_gradients(Bucket& b);  // reduce-scatter into the gradient shards
  void check_no_export(const char* hook) const;

  Backend& backend_;
  ModelWeights& weights_;
  comm::Communicator& group_;
  Stream stream_;
  Stream comm_stream_;
  bool comm_pending_ = false;  // work of this object on comm_stream_ the compute stream has not waited for
  DType grad_dtype_;
  std::vector<Entry> entries_;  // in weights.parameters() order
  std::unordered_map<std::string, size_t> by_name_;
  std::vector<Bucket> buckets_;  // embedding, layers 0 … L-1, head
  // Buckets of each unit: embedding {0}, layer l {1 + l}, head {L + 1} (+ {0} when tied).
  std::vector<size_t> embedding_unit_, head_unit_;
  std::vector<std::vector<size_t>> layer_units_;
  int open_exports_ = 0;  // live GatheredValues scopes
};

}  // namespace spindle::parallel
