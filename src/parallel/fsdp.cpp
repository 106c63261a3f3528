#include "parallel/fsdp.h"

#include <algorithm>
#include <deque>

#include "core/error.h"

namespace spindle::parallel {

namespace {

DType default_grad_dtype(DType model_dtype) {
  return model_dtype == DType::BF16 || model_dtype == DType::F16 ? DType::F32 : model_dtype;
}

}  // namespace

Fsdp::Fsdp(Backend& backend, ModelWeights& weights, comm::Communicator& group, FsdpOptions options)
    : backend_(backend),
      weights_(weights),
      group_(group),
      stream_(backend.default_stream()),
      comm_stream_(backend.comm_stream()),
      grad_dtype_(options.grad_dtype.value_or(default_grad_dtype(weights.dtype))) {
  const int64_t world = group_.size(), rank = group_.rank();
  const size_t layers = weights_.layers.size();
  std::deque<Parameter>& params = weights_.parameters();
  for (Parameter& p : params) {
    if (!p.value.defined())
      fail("FSDP: parameter {} has no value; shard a fully loaded model (or one sharded model per Fsdp)", p.name);
    const bool bytes = p.value.dtype() != weights_.dtype;
    if (bytes && p.trainable)
      fail("FSDP: trainable parameter {} is {} in a {} model; every trainable parameter must share the model dtype",
           p.name, dtype_name(p.value.dtype()), dtype_name(weights_.dtype));
    Entry e;
    e.param = &p;
    e.shape = p.value.shape();
    e.numel = p.value.numel();
    e.dtype = p.value.dtype();
    e.bytes = bytes;
    e.byte_count = static_cast<int64_t>(p.value.bytes());
    e.shard_numel = ((bytes ? e.byte_count : e.numel) + world - 1) / world;
    by_name_.emplace(p.name, entries_.size());
    entries_.push_back(std::move(e));
  }

  // Buckets: each parameter in the one unit that owns it (a tied lm_head is owned by the embedding).
  buckets_.resize(layers + 2);
  const size_t head_bucket = layers + 1;
  std::vector<bool> placed(entries_.size(), false);
  auto place = [&](size_t bucket, const Parameter* p) {
    if (!p) return;
    for (size_t i = 0; i < entries_.size(); ++i)
      if (entries_[i].param == p) {
        if (placed[i]) return;  // the tied lm_head, already in the embedding bucket
        placed[i] = true;
        entries_[i].bucket = bucket;
        buckets_[bucket].entries.push_back(i);
        return;
      }
    fail("FSDP: a model pointer does not name one of its parameters");
  };
  place(0, weights_.embed);
  for (size_t l = 0; l < layers; ++l)
    for (const Parameter* p : weights_.layers[l].parameters()) place(1 + l, p);
  place(head_bucket, weights_.final_norm);
  place(head_bucket, weights_.lm_head);
  for (size_t i = 0; i < entries_.size(); ++i)
    if (!placed[i]) fail("FSDP: parameter {} is used by no unit of the decoder", entries_[i].param->name);

  // Shards: this rank's slice [rank·s, rank·s + s) of each zero-padded flat parameter, laid end to
  // end in its bucket (parameter order, so every rank lays out the same).
  for (Bucket& b : buckets_) {
    std::sort(b.entries.begin(), b.entries.end());
    for (size_t i : b.entries) {
      Entry& e = entries_[i];
      if (e.bytes) {
        e.value_offset = b.byte_numel;
        b.byte_numel += e.shard_numel;
        continue;
      }
      e.value_offset = b.value_numel;
      b.value_numel += e.shard_numel;
      if (e.param->trainable) {
        e.grad_offset = b.grad_numel;
        b.grad_numel += e.shard_numel;
      }
    }
    b.values = backend_.zeros(Shape{b.value_numel}, weights_.dtype);
    b.grads = backend_.zeros(Shape{b.grad_numel}, grad_dtype_);
    if (b.byte_numel) b.byte_values = backend_.zeros(Shape{b.byte_numel}, DType::U8);
    for (size_t i : b.entries) {
      Entry& e = entries_[i];
      if (e.bytes) {  // this rank's bytes [rank·s, rank·s + s) of the zero-padded bytes
        e.value_shard = b.byte_values.flat(e.value_offset, e.shard_numel);
        const int64_t begin = std::min(rank * e.shard_numel, e.byte_count);
        const int64_t count = std::min(e.shard_numel, e.byte_count - begin);
        if (count > 0) {
          Tensor dst = e.value_shard.flat(0, count);
          backend_.copy(stream_, e.param->value.view_bytes_as(DType::U8, Shape{e.byte_count}).flat(begin, count), dst);
        }
        continue;
      }
      e.value_shard = b.values.flat(e.value_offset, e.shard_numel);
      if (e.param->trainable) e.grad_shard = b.grads.flat(e.grad_offset, e.shard_numel);
      const int64_t begin = std::min(rank * e.shard_numel, e.numel);
      const int64_t count = std::min(e.shard_numel, e.numel - begin);
      if (count > 0) {
        Tensor dst = e.value_shard.flat(0, count);
        backend_.copy(stream_, e.param->value.flat(begin, count), dst);
      }
    }
  }
  backend_.synchronize(stream_);
  // Only now drop the full tensors: from here on they exist only inside windows.
  for (Entry& e : entries_) {
    e.param->value = Tensor();
    e.param->grad = Tensor();
  }

  embedding_unit_ = {0};
  layer_units_.resize(layers);
  for (size_t l = 0; l < layers; ++l) layer_units_[l] = {1 + l};
  head_unit_ = {head_bucket};
  if (entries_[entry_of(weights_.lm_head->name)].bucket == 0) head_unit_.push_back(0);
}

Fsdp::~Fsdp() {
  // A prefetch still in flight (a step that threw midway) must finish before its buffer is freed on
  // the compute stream. Destructors cannot throw: a CUDA failure here shows at the next call.
  if (comm_pending_) {
    try {
      backend_.stream_wait(stream_, comm_stream_);
    } catch (...) {
    }
  }
}

const std::vector<size_t>& Fsdp::unit_buckets(const ParameterUnit& unit) const {
  switch (unit.kind) {
    case ParameterUnit::Kind::Embedding: return embedding_unit_;
    case ParameterUnit::Kind::Head: return head_unit_;
    case ParameterUnit::Kind::Layer:
      SPINDLE_CHECK(unit.layer >= 0 && unit.layer < static_cast<int64_t>(layer_units_.size()),
                    "FSDP: layer {} out of range", unit.layer);
      return layer_units_[unit.layer];
  }
  fail("FSDP: unknown unit");
}

size_t Fsdp::entry_of(const std::string& name) const {
  auto it = by_name_.find(name);
  if (it == by_name_.end()) fail("FSDP: no parameter named \"{}\"", name);
  return it->second;
}

const Shape& Fsdp::full_shape(const std::string& name) const { return entries_[entry_of(name)].shape; }

Tensor Fsdp::gather_padded(const Tensor& shard) {
  Tensor full = backend_.empty(Shape{shard.numel() * group_.size()}, shard.dtype());
  group_.all_gather(stream_, shard, full);
  return full;
}

std::vector<size_t> Fsdp::next_unit_buckets(const ParameterUnit& unit, bool backward) const {
  const int64_t layers = static_cast<int64_t>(layer_units_.size());
  switch (unit.kind) {
    case ParameterUnit::Kind::Embedding:
      if (backward) return {};  // the last window of a step
      return layers ? layer_units_[0] : head_unit_;
    case ParameterUnit::Kind::Layer:
      if (!backward) return unit.layer + 1 < layers ? layer_units_[unit.layer + 1] : head_unit_;
      // Below layer 0 comes the embedding's backward window, which reads no value.
      return unit.layer > 0 ? layer_units_[unit.layer - 1] : std::vector<size_t>{};
    case ParameterUnit::Kind::Head:
      // Training: the head's (backward) window is followed by the layers' backward windows, from
      // the top. Evaluation: the head's forward window is the last.
      return backward && layers ? layer_units_[layers - 1] : std::vector<size_t>{};
  }
  return {};
}

void Fsdp::prefetch(const std::vector<size_t>& buckets) {
  std::vector<size_t> started;
  for (size_t i : buckets) {
    Bucket& b = buckets_[i];
    if (b.value_users > 0 || b.prefetched.defined()) continue;
    // Allocated here, on the compute stream, before the comm stream's wait below: see backend.h.
    b.prefetched = backend_.empty(Shape{b.value_numel * group_.size()}, b.values.dtype());
    if (b.byte_numel) b.byte_prefetched = backend_.empty(Shape{b.byte_numel * group_.size()}, DType::U8);
    started.push_back(i);
  }
  if (started.empty()) return;
  backend_.stream_wait(comm_stream_, stream_);  // the buffers, and the shards as the optimizer left them
  for (size_t i : started) {
    group_.all_gather(comm_stream_, buckets_[i].values, buckets_[i].prefetched);
    if (buckets_[i].byte_numel)
      group_.all_gather(comm_stream_, buckets_[i].byte_values, buckets_[i].byte_prefetched);
  }
  comm_pending_ = true;
}

void Fsdp::join_prefetches(bool drop_unused) {
  if (comm_pending_) {
    backend_.stream_wait(stream_, comm_stream_);
    comm_pending_ = false;
  }
  if (drop_unused)  // freed on the compute stream, now ordered after the gathers that wrote them
    for (Bucket& b : buckets_) {
      b.prefetched = Tensor();
      b.byte_prefetched = Tensor();
    }
}

void Fsdp::acquire_values(Bucket& b) {
  if (b.value_users++ > 0) return;
  const int64_t world = group_.size();
  // gathered [world, value_numel]: row r is rank r's shards of every parameter of the bucket.
  Tensor gathered, gathered_bytes;  // gathered_bytes [world, byte_numel]: the byte entries' rows
  if (b.prefetched.defined()) {
    join_prefetches(false);  // the gather ran on the comm stream
    gathered = std::move(b.prefetched);
    gathered_bytes = std::move(b.byte_prefetched);
    b.prefetched = Tensor();
    b.byte_prefetched = Tensor();
  } else {
    // A collective of this group on the compute stream: ordered after any still on the comm
    // stream explicitly, rather than relying on NCCL to order one communicator's two streams.
    join_prefetches(false);
    gathered = gather_padded(b.values);
    if (b.byte_numel) gathered_bytes = gather_padded(b.byte_values);
  }
  for (size_t i : b.entries) {
    Entry& e = entries_[i];
    if (e.bytes) {  // its rows laid end to end: the padded bytes, read back as the parameter's dtype
      e.full_value = backend_.empty(Shape{e.shard_numel * world}, DType::U8);
      for (int64_t r = 0; r < world; ++r) {
        Tensor dst = e.full_value.flat(r * e.shard_numel, e.shard_numel);
        backend_.copy(stream_, gathered_bytes.flat(r * b.byte_numel + e.value_offset, e.shard_numel), dst);
      }
      e.param->value = e.full_value.flat(0, e.byte_count).view_bytes_as(e.dtype, e.shape);
      continue;
    }
    if (b.entries.size() == 1) {
      e.full_value = gathered;  // one parameter: the rows already are its padded tensor
    } else {
      e.full_value = backend_.empty(Shape{e.shard_numel * world}, gathered.dtype());
      for (int64_t r = 0; r < world; ++r) {
        Tensor dst = e.full_value.flat(r * e.shard_numel, e.shard_numel);
        backend_.copy(stream_, gathered.flat(r * b.value_numel + e.value_offset, e.shard_numel), dst);
      }
    }
    e.param->value = e.full_value.flat(0, e.numel).reshape(e.shape);
  }
}

void Fsdp::release_values(Bucket& b) {
  SPINDLE_CHECK(b.value_users > 0, "FSDP: a bucket released more often than gathered");
  if (--b.value_users > 0) return;
  for (size_t i : b.entries) {
    entries_[i].param->value = Tensor();
    entries_[i].full_value = Tensor();
  }
}

void Fsdp::begin_gradients(Bucket& b) {
  if (b.grad_users++ > 0) return;
  for (size_t i : b.entries) {
    Entry& e = entries_[i];
    if (!e.param->trainable) continue;
    // Zeroed, padding included: the padding's reduced gradient is then exactly zero.
    e.full_grad = backend_.zeros(Shape{e.shard_numel * group_.size()}, weights_.dtype);
    e.param->grad = e.full_grad.flat(0, e.numel).reshape(e.shape);
  }
}

void Fsdp::finish_gradients(Bucket& b) {
  SPINDLE_CHECK(b.grad_users > 0, "FSDP: after_backward without before_backward");
  if (--b.grad_users > 0 || b.grad_numel == 0) return;
  const int64_t world = group_.size();
  // send [world, grad_numel]: chunk r holds slice r of every trainable gradient, for rank r.
  Tensor send;
  std::vector<size_t> trainable;
  for (size_t i : b.entries)
    if (entries_[i].param->trainable) trainable.push_back(i);
  if (trainable.size() == 1) {
    send = entries_[trainable[0]].full_grad;
  } else {
    send = backend_.empty(Shape{b.grad_numel * world}, weights_.dtype);
    for (size_t i : trainable) {
      const Entry& e = entries_[i];
      for (int64_t r = 0; r < world; ++r) {
        Tensor dst = send.flat(r * b.grad_numel + e.grad_offset, e.shard_numel);
        backend_.copy(stream_, e.full_grad.flat(r * e.shard_numel, e.shard_numel), dst);
      }
    }
  }
  Tensor reduced = backend_.empty(Shape{b.grad_numel}, weights_.dtype);
  join_prefetches(false);  // a collective of this group on the compute stream (see acquire_values)
  group_.reduce_scatter_sum(stream_, send, reduced);
  if (reduced.dtype() != b.grads.dtype()) {
    Tensor converted = backend_.empty(reduced.shape(), b.grads.dtype());
    backend_.copy(stream_, reduced, converted);
    reduced = converted;
  }
  backend_.axpy(stream_, 1.0, reduced, b.grads);  // micro-batches accumulate
  for (size_t i : trainable) {
    entries_[i].param->grad = Tensor();
    entries_[i].full_grad = Tensor();
  }
}

void Fsdp::check_no_export(const char* hook) const {
  if (open_exports_ > 0)
    fail("FSDP: {} called while a gather_full scope is alive; end the export before the next decoder step", hook);
}

// A prefetch the coming window does not use (only if the Decoder left its documented order) is
// dropped, then the window's values are taken (from the prefetch when there is one) and the next
// unit's gather starts on the comm stream, to run while this unit computes.
void Fsdp::drop_unused_prefetches(const std::vector<size_t>& used) {
  for (size_t i = 0; i < buckets_.size(); ++i)
    if (buckets_[i].prefetched.defined() && std::find(used.begin(), used.end(), i) == used.end()) {
      join_prefetches(false);
      buckets_[i].prefetched = Tensor();
      buckets_[i].byte_prefetched = Tensor();
    }
}

void Fsdp::before_forward(const ParameterUnit& unit) {
  check_no_export("before_forward");
  drop_unused_prefetches(unit_buckets(unit));
  for (size_t b : unit_buckets(unit)) acquire_values(buckets_[b]);
  prefetch(next_unit_buckets(unit, false));
}

void Fsdp::after_forward(const ParameterUnit& unit) {
  for (size_t b : unit_buckets(unit)) release_values(buckets_[b]);
}

void Fsdp::before_backward(const ParameterUnit& unit) {
  check_no_export("before_backward");
  // The embedding's backward scatters dout into rows of the gradient and reads no value.
  const bool reads_values = unit.kind != ParameterUnit::Kind::Embedding;
  drop_unused_prefetches(reads_values ? unit_buckets(unit) : std::vector<size_t>{});
  for (size_t b : unit_buckets(unit)) {
    if (reads_values) acquire_values(buckets_[b]);
    begin_gradients(buckets_[b]);
  }
  prefetch(next_unit_buckets(unit, true));
}

void Fsdp::after_backward(const ParameterUnit& unit) {
  const bool reads_values = unit.kind != ParameterUnit::Kind::Embedding;
  for (size_t b : unit_buckets(unit)) {
    finish_gradients(buckets_[b]);
    if (reads_values) release_values(buckets_[b]);
  }
}

void Fsdp::zero_grads() {
  for (Bucket& b : buckets_)
    if (b.grad_numel) backend_.fill(stream_, b.grads, 0.0);
}

std::vector<ParameterShard> Fsdp::trainable_shards() const {
  std::vector<ParameterShard> out;
  for (const Entry& e : entries_)
    if (e.param->trainable) out.push_back({e.param->name, e.value_shard, e.grad_shard});
  return out;
}

Fsdp::GatheredValues::GatheredValues(GatheredValues&& other) noexcept
    : owner_(other.owner_), held_(std::move(other.held_)) {
  other.owner_ = nullptr;
}

Fsdp::GatheredValues::~GatheredValues() {
  if (!owner_) return;
  for (size_t i : held_) {
    owner_->entries_[i].param->value = Tensor();
    owner_->entries_[i].full_value = Tensor();
  }
  --owner_->open_exports_;
}

Fsdp::GatheredValues Fsdp::gather_full(const std::function<bool(const Parameter&)>& select, int keep_on) {
  SPINDLE_CHECK(keep_on >= -1 && keep_on < group_.size(), "gather_full: keep_on {} is not a rank of {} ranks",
                keep_on, group_.size());
  for (const Bucket& b : buckets_)
    if (b.value_users > 0 || b.grad_users > 0) fail("FSDP: gather_full called inside a decoder window");
  if (open_exports_ > 0) fail("FSDP: gather_full called while another gather_full scope is alive");
  join_prefetches(true);
  const bool keep = keep_on < 0 || keep_on == group_.rank();
  std::vector<size_t> held;
  for (size_t i = 0; i < entries_.size(); ++i) {
    Entry& e = entries_[i];
    if (!select(*e.param)) continue;
    Tensor full = gather_padded(e.value_shard);  // every rank takes part; others drop it at once
    if (!keep) continue;
    e.full_value = full;
    e.param->value = e.bytes ? full.flat(0, e.byte_count).view_bytes_as(e.dtype, e.shape)
                             : full.flat(0, e.numel).reshape(e.shape);
    held.push_back(i);
  }
  ++open_exports_;
  return GatheredValues(this, std::move(held));
}

Tensor Fsdp::gather_shard(const std::string& name, const Tensor& shard) {
  const Entry& e = entries_[entry_of(name)];
  SPINDLE_CHECK(!e.bytes, "gather_shard: {} is sharded as bytes (a frozen quantised weight)", name);
  SPINDLE_CHECK(shard.numel() == e.shard_numel, "gather_shard: {} has {} elements, a shard of {} has {}",
                shard.describe(), shard.numel(), name, e.shard_numel);
  join_prefetches(true);
  return gather_padded(shard.reshape(Shape{e.shard_numel})).flat(0, e.numel).reshape(e.shape);
}

void Fsdp::load_shard(const std::string& name, const Tensor& full, Tensor& shard) {
  const Entry& e = entries_[entry_of(name)];
  if (e.bytes) fail("FSDP: {} is a frozen quantised weight, sharded as bytes; it cannot be replaced", name);
  if (full.numel() != e.numel)
    fail("FSDP: a full tensor for {} must have {} elements ({}), got {}", name, e.numel, e.shape.str(),
         full.describe());
  SPINDLE_CHECK(shard.numel() == e.shard_numel, "load_shard: {} is not a shard of {} ({} elements)",
                shard.describe(), name, e.shard_numel);
  const int64_t begin = std::min(group_.rank() * e.shard_numel, e.numel);
  const int64_t count = std::min(e.shard_numel, e.numel - begin);
  join_prefetches(true);  // no gather may still be reading (or have read) the shard being replaced
  backend_.fill(stream_, shard, 0.0);
  if (count > 0) {
    Tensor dst = shard.flat(0, count);
    backend_.copy(stream_, full.flat(begin, count), dst);
  }
}

void Fsdp::set_full_value(const std::string& name, const Tensor& full) {
  Entry& e = entries_[entry_of(name)];
  if (buckets_[e.bucket].value_users > 0 || e.full_value.defined())
    fail("FSDP: set_full_value({}) while its value is gathered", name);
  Tensor shard = e.value_shard;
  load_shard(name, full, shard);
}

std::vector<std::pair<std::string, Tensor>> Fsdp::gather_state(
    const std::vector<std::pair<std::string, Tensor>>& shards, int keep_on) {
  SPINDLE_CHECK(keep_on >= -1 && keep_on < group_.size(), "gather_state: keep_on {} is not a rank of {} ranks",
                keep_on, group_.size());
  const bool keep = keep_on < 0 || keep_on == group_.rank();
  std::vector<std::pair<std::string, Tensor>> out;
  for (const auto& [name, shard] : shards) {
    const size_t dot = name.find('.');
    if (dot == std::string::npos) fail("FSDP: state tensor \"{}\" is not named <kind>.<parameter>", name);
    Tensor full = gather_shard(name.substr(dot + 1), shard);
    if (keep) out.emplace_back(name, full);
  }
  return out;
}

void Fsdp::load_state(const std::vector<std::pair<std::string, Tensor>>& shards,
                      const std::function<void(const std::string& name, Tensor& full)>& read_full) {
  for (const auto& [name, shard] : shards) {
    const size_t dot = name.find('.');
    if (dot == std::string::npos) fail("FSDP: state tensor \"{}\" is not named <kind>.<parameter>", name);
    const std::string param = name.substr(dot + 1);
    Tensor full = backend_.empty(full_shape(param), shard.dtype());
    read_full(name, full);
    Tensor target = shard;
    load_shard(param, full, target);
  }
}

size_t Fsdp::shard_bytes() const {
  size_t bytes = 0;
  for (const Bucket& b : buckets_) bytes += b.values.bytes() + b.grads.bytes() + b.byte_numel;
  return bytes;
}

size_t Fsdp::full_bytes() const {
  size_t bytes = 0;
  for (const Entry& e : entries_) {
    bytes += e.bytes ? static_cast<size_t>(e.byte_count) : static_cast<size_t>(e.numel) * dtype_size(e.value_shard.dtype());
    if (e.param->trainable) bytes += static_cast<size_t>(e.numel) * dtype_size(grad_dtype_);
  }
  return bytes;
}

}  // namespace spindle::parallel
