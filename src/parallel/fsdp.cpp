#include "parallel/fsdp.h"

#include <algorithm>

#include "core/error.h"

namespace spindle::parallel {

namespace {

std::string unit_name(const ParameterUnit& unit) {
  switch (unit.kind) {
    case ParameterUnit::Kind::Embedding: return "embedding";
    case ParameterUnit::Kind::Head: return "head";
    case ParameterUnit::Kind::Layer: return fmt::format("layer {}", unit.layer);
  }
  return "?";
}

DType default_grad_dtype(DType model_dtype) {
  return model_dtype == DType::BF16 || model_dtype == DType::F16 ? DType::F32 : model_dtype;
}

}  // namespace

Fsdp::Fsdp(Backend& backend, ModelWeights& weights, comm::Communicator& group, FsdpOptions options)
    : backend_(backend),
      weights_(weights),
      group_(group),
      stream_(backend.default_stream()),
      grad_dtype_(options.grad_dtype.value_or(default_grad_dtype(weights.dtype))) {
  const int64_t world = group_.size(), rank = group_.rank();
  std::deque<Parameter>& params = weights_.parameters();
  entries_.reserve(params.size());
  for (Parameter& p : params) {
    if (!p.value.defined())
      fail("FSDP: parameter {} has no value; shard a fully loaded model (or one sharded model per Fsdp)", p.name);
    Entry e;
    e.param = &p;
    e.shape = p.value.shape();
    e.numel = p.value.numel();
    e.shard_numel = (e.numel + world - 1) / world;
    // This rank's slice [rank·s, rank·s + s) of the zero-padded flat tensor.
    e.value_shard = backend_.zeros(Shape{e.shard_numel}, p.value.dtype());
    const int64_t begin = std::min(rank * e.shard_numel, e.numel);
    const int64_t count = std::min(e.shard_numel, e.numel - begin);
    if (count > 0) {
      Tensor dst = e.value_shard.flat(0, count);
      backend_.copy(stream_, p.value.flat(begin, count), dst);
    }
    if (p.trainable) e.grad_shard = backend_.zeros(Shape{e.shard_numel}, grad_dtype_);
    by_name_.emplace(p.name, entries_.size());
    entries_.push_back(std::move(e));
  }
  backend_.synchronize(stream_);
  // Only now drop the full tensors: from here on they exist only inside windows.
  for (Entry& e : entries_) {
    e.param->value = Tensor();
    e.param->grad = Tensor();
  }

  auto index_of = [&](const Parameter* p) {
    for (size_t i = 0; i < entries_.size(); ++i)
      if (entries_[i].param == p) return i;
    fail("FSDP: a model pointer does not name one of its parameters");
  };
  std::vector<bool> covered(entries_.size(), false);
  auto add = [&](std::vector<size_t>& unit, const Parameter* p) {
    if (!p) return;
    const size_t i = index_of(p);
    if (std::find(unit.begin(), unit.end(), i) != unit.end()) return;
    unit.push_back(i);
    covered[i] = true;
  };
  add(embedding_unit_, weights_.embed);
  layer_units_.resize(weights_.layers.size());
  for (size_t l = 0; l < weights_.layers.size(); ++l) {
    LayerWeights& w = weights_.layers[l];
    std::vector<size_t>& unit = layer_units_[l];
    add(unit, w.input_norm);
    add(unit, w.post_norm);
    add(unit, w.q_norm);
    add(unit, w.k_norm);
    for (Linear* lin : {&w.q, &w.k, &w.v, &w.o, &w.gate, &w.up, &w.down}) {
      add(unit, lin->weight);
      add(unit, lin->bias);
      add(unit, lin->lora_a);
      add(unit, lin->lora_b);
    }
  }
  add(head_unit_, weights_.final_norm);
  add(head_unit_, weights_.lm_head);  // the embed entry again when tied
  // Collectives run in entry order inside a unit, identical on every rank.
  for (std::vector<size_t>* unit : {&embedding_unit_, &head_unit_}) std::sort(unit->begin(), unit->end());
  for (std::vector<size_t>& unit : layer_units_) std::sort(unit.begin(), unit.end());
  for (size_t i = 0; i < entries_.size(); ++i)
    if (!covered[i]) fail("FSDP: parameter {} is used by no unit of the decoder", entries_[i].param->name);
}

Fsdp::~Fsdp() = default;

const std::vector<size_t>& Fsdp::unit_entries(const ParameterUnit& unit) const {
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

void Fsdp::acquire_value(Entry& e) {
  if (e.value_users++ > 0) return;
  e.full_value = gather_padded(e.value_shard);
  e.param->value = e.full_value.flat(0, e.numel).reshape(e.shape);
}

void Fsdp::release_value(Entry& e) {
  SPINDLE_CHECK(e.value_users > 0, "FSDP: {} released more often than gathered", e.param->name);
  if (--e.value_users > 0) return;
  e.param->value = Tensor();
  e.full_value = Tensor();
}

void Fsdp::check_no_export(const char* hook) const {
  if (open_exports_ > 0)
    fail("FSDP: {} called while a gather_full scope is alive; end the export before the next decoder step", hook);
}

void Fsdp::before_forward(const ParameterUnit& unit) {
  check_no_export("before_forward");
  for (size_t i : unit_entries(unit)) acquire_value(entries_[i]);
}

void Fsdp::after_forward(const ParameterUnit& unit) {
  for (size_t i : unit_entries(unit)) release_value(entries_[i]);
}

void Fsdp::before_backward(const ParameterUnit& unit) {
  check_no_export("before_backward");
  // The embedding's backward scatters dout into rows of the gradient and reads no value.
  const bool reads_values = unit.kind != ParameterUnit::Kind::Embedding;
  for (size_t i : unit_entries(unit)) {
    Entry& e = entries_[i];
    if (reads_values) acquire_value(e);
    if (!e.param->trainable || e.grad_users++ > 0) continue;
    // Zeroed, padding included: the padding's reduced gradient is then exactly zero.
    e.full_grad = backend_.zeros(Shape{e.shard_numel * group_.size()}, e.value_shard.dtype());
    e.param->grad = e.full_grad.flat(0, e.numel).reshape(e.shape);
  }
}

void Fsdp::after_backward(const ParameterUnit& unit) {
  const bool reads_values = unit.kind != ParameterUnit::Kind::Embedding;
  for (size_t i : unit_entries(unit)) {
    Entry& e = entries_[i];
    if (e.param->trainable) {
      SPINDLE_CHECK(e.grad_users > 0, "FSDP: after_backward of {} without before_backward", unit_name(unit));
      if (--e.grad_users == 0) {
        Tensor reduced = backend_.empty(Shape{e.shard_numel}, e.full_grad.dtype());
        group_.reduce_scatter_sum(stream_, e.full_grad, reduced);
        if (reduced.dtype() != e.grad_shard.dtype()) {
          Tensor converted = backend_.empty(reduced.shape(), e.grad_shard.dtype());
          backend_.copy(stream_, reduced, converted);
          reduced = converted;
        }
        backend_.axpy(stream_, 1.0, reduced, e.grad_shard);  // micro-batches accumulate
        e.param->grad = Tensor();
        e.full_grad = Tensor();
      }
    }
    if (reads_values) release_value(e);
  }
}

void Fsdp::zero_grads() {
  for (Entry& e : entries_)
    if (e.grad_shard.defined()) backend_.fill(stream_, e.grad_shard, 0.0);
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
  for (size_t i : held_) owner_->release_value(owner_->entries_[i]);
  --owner_->open_exports_;
}

Fsdp::GatheredValues Fsdp::gather_full(const std::function<bool(const Parameter&)>& select, int keep_on) {
  SPINDLE_CHECK(keep_on >= -1 && keep_on < group_.size(), "gather_full: keep_on {} is not a rank of {} ranks",
                keep_on, group_.size());
  for (const Entry& e : entries_)
    if (e.value_users > 0 || e.grad_users > 0)
      fail("FSDP: gather_full called inside a decoder window ({} is in use)", e.param->name);
  const bool keep = keep_on < 0 || keep_on == group_.rank();
  std::vector<size_t> held;
  for (size_t i = 0; i < entries_.size(); ++i) {
    Entry& e = entries_[i];
    if (!select(*e.param)) continue;
    if (keep) {
      acquire_value(e);
      held.push_back(i);
    } else {
      gather_padded(e.value_shard);  // takes part in the collective; the result is dropped at once
    }
  }
  ++open_exports_;
  return GatheredValues(this, std::move(held));
}

Tensor Fsdp::gather_shard(const std::string& name, const Tensor& shard) {
  const Entry& e = entries_[entry_of(name)];
  SPINDLE_CHECK(shard.numel() == e.shard_numel, "gather_shard: {} has {} elements, a shard of {} has {}",
                shard.describe(), shard.numel(), name, e.shard_numel);
  return gather_padded(shard.reshape(Shape{e.shard_numel})).flat(0, e.numel).reshape(e.shape);
}

void Fsdp::load_shard(const std::string& name, const Tensor& full, Tensor& shard) {
  const Entry& e = entries_[entry_of(name)];
  if (full.numel() != e.numel)
    fail("FSDP: a full tensor for {} must have {} elements ({}), got {}", name, e.numel, e.shape.str(),
         full.describe());
  SPINDLE_CHECK(shard.numel() == e.shard_numel, "load_shard: {} is not a shard of {} ({} elements)",
                shard.describe(), name, e.shard_numel);
  const int64_t begin = std::min(group_.rank() * e.shard_numel, e.numel);
  const int64_t count = std::min(e.shard_numel, e.numel - begin);
  backend_.fill(stream_, shard, 0.0);
  if (count > 0) {
    Tensor dst = shard.flat(0, count);
    backend_.copy(stream_, full.flat(begin, count), dst);
  }
}

void Fsdp::set_full_value(const std::string& name, const Tensor& full) {
  Entry& e = entries_[entry_of(name)];
  if (e.value_users > 0) fail("FSDP: set_full_value({}) while its value is gathered", name);
  load_shard(name, full, e.value_shard);
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
  for (const Entry& e : entries_) bytes += e.value_shard.bytes() + (e.grad_shard.defined() ? e.grad_shard.bytes() : 0);
  return bytes;
}

size_t Fsdp::full_bytes() const {
  size_t bytes = 0;
  for (const Entry& e : entries_) {
    bytes += static_cast<size_t>(e.numel) * dtype_size(e.value_shard.dtype());
    if (e.param->trainable) bytes += static_cast<size_t>(e.numel) * dtype_size(grad_dtype_);
  }
  return bytes;
}

}  // namespace spindle::parallel
