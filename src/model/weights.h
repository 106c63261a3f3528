// The model's parameters, named as Hugging Face names them, the layers (blocks bound to them) and
// the LoRA adapters attached to their projections.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"
#include "model/expert_lora.h"
#include "model/layer.h"
#include "model/linear.h"
#include "model/quantized_weights.h"

namespace spindle {

namespace io {
class Checkpoint;
}

struct LoraConfig {
  int64_t rank = 0;
  double alpha = 0;
  bool rslora = false;
  std::vector<std::string> targets;  // PEFT module names of projections (q_proj … down_proj)
  // PEFT's target_parameters: the routed experts' fused tensors ("mlp.experts.gate_up_proj",
  // "mlp.experts.down_proj"; an entry matches a tensor's full name or a dotted suffix of it).
  // add_lora also takes the experts in `targets`, spelled as --lora-targets does ("experts",
  // "experts.gate_up_proj", "experts.down_proj"), and moves them here.
  std::vector<std::string> target_parameters{};
  double scaling() const;            // alpha / r, or alpha / sqrt(r) with rsLoRA
};

// matrix [rows, cols] = the transpose of `stored` (its elements as [cols, rows]), both of one dtype:
// a PackedTensor's transposed part (gpt_oss's [E, in, out] experts), read or written once per model.
void copy_transposed(Backend& backend, const Tensor& stored, Tensor& matrix);

class ModelWeights {
 public:
  ModelConfig config;
  DType dtype = DType::F32;
  Parameter* embed = nullptr;       // [V, H]
  Parameter* final_norm = nullptr;  // [H]
  Parameter* lm_head = nullptr;     // [V, H]; == embed when tied
  std::vector<DecoderLayer> layers;
  LoraConfig lora;                  // rank 0 when no adapter

  // Loads every tensor of the model from a checkpoint, converting to `dtype`. Projections become 4-bit
  // (model/quantized_weights.h) when `quantize` asks for it or the checkpoint is 4-bit already.
  static ModelWeights load(Backend& backend, const ModelConfig& config, const io::Checkpoint& checkpoint, DType dtype,
                           const QuantizeOptions& quantize = {});
  // Random weights (uniform with standard deviation 0.02; norms 1), deterministic in `seed`, for
  // tests and benchmarks on synthetic models. With `quantize`, each projection is drawn and
  // quantised as it is declared (the bytes quantize_projections would make from the same dense
  // weights), so the dense model never exists on the backend: a 72B model initialises on one GPU.
  static ModelWeights random(Backend& backend, const ModelConfig& config, DType dtype, uint64_t seed,
                             const QuantizeOptions& quantize = {});
  // Parameters allocated but never written: for `spindle plan`, whose backend holds no memory.
  static ModelWeights uninitialized(Backend& backend, const ModelConfig& config, DType dtype);

  // LoRA: a PEFT adapter folder (adapter_config.json + adapter_model.safetensors), or new
  // adapters initialised as PEFT does (A Kaiming-uniform, B zero). Adapters become the only
  // trainable parameters.
  void load_peft_adapter(Backend& backend, const std::string& dir);
  void add_lora(Backend& backend, const LoraConfig& lora, uint64_t seed);

  // The PEFT module names of the model's projections, in layer order: what LoRA may target
  // ("all-linear" means all of them).
  std::vector<std::string> projection_names() const;
  // `targets` (PEFT module names) narrowed to the projections this model has, a fused projection
  // standing for the parts it holds (phi3: qkv_proj for q_proj, k_proj and v_proj; gate_up_proj for
  // gate_proj and up_proj): what the default --lora-targets adapt on it.
  std::vector<std::string> present_lora_targets(const std::vector<std::string>& targets) const;
  // Every projection of every layer, in layer order.
  std::vector<Linear*> linears();
  std::vector<const Linear*> linears() const;
  // The routed experts' fused tensors of every layer, adapted or not (model/expert_lora.h).
  std::vector<ExpertLora*> expert_loras();
  std::vector<const ExpertLora*> expert_loras() const;
  // The expert LoRA whose B is `p` (stored as [E, out, r], not PEFT's [out, r·E]), or null.
  const ExpertLora* expert_lora_of_b(const Parameter& p) const;

  // Full fine-tuning: every base parameter trainable (buffers stay frozen: Parameter::buffer).
  void train_all(Backend& backend);
  // Quantises the dense projections in memory to 4 bits (tests; needs the dense model in memory
  // first, which random(..., quantize) avoids).
  void quantize_projections(Backend& backend, const QuantizeOptions& options);
  bool has_quantized_projections() const;
  void zero_grads(Backend& backend);

  std::deque<Parameter>& parameters() { return params_; }
  const std::deque<Parameter>& parameters() const { return params_; }
  Parameter* find(const std::string& name);
  // The alternative checkpoint layouts the blocks declared (model/block.h); `read` marks those the
  // loaded checkpoint used, which exports write the same way.
  const std::vector<PackedTensor>& packed_tensors() const { return packed_; }

 private:
  class Allocator;
  std::string lora_target_hint(const std::string& target) const;
  // `lora` with the experts named in its targets moved to target_parameters, every entry checked.
  LoraConfig resolve_expert_targets(const LoraConfig& lora) const;
  void add_expert_lora(Backend& backend, DecoderLayer& layer, std::mt19937_64& rng);
  Parameter& add(Backend& backend, const std::string& name, Shape shape);
  void wire(Backend& backend, QuantizedLoader* loader = nullptr);
  void make_trainable(Backend& backend, Parameter& p);
  std::deque<Parameter> params_;  // deque: stable addresses for the pointers above
  std::vector<PackedTensor> packed_;
};

}  // namespace spindle
