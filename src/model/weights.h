// The model's parameters, named as Hugging Face names them, and the LoRA adapters attached to them.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/config.h"

namespace spindle {

namespace io {
class Checkpoint;
}

struct Parameter {
  std::string name;  // the Hugging Face / PEFT tensor name
  Tensor value;      // model dtype
  Tensor grad;       // same shape and dtype; allocated only when trainable
  bool trainable = false;
};

// W·x (+ b) (+ scaling·B·A·x): one projection with its optional bias and LoRA pair.
struct Linear {
  Parameter* weight = nullptr;  // [out, in]
  Parameter* bias = nullptr;    // [out]
  Parameter* lora_a = nullptr;  // [r, in]
  Parameter* lora_b = nullptr;  // [out, r]
  double lora_scaling = 0.0;
  int64_t out_features() const { return weight->value.dim(0); }
  int64_t in_features() const { return weight->value.dim(1); }
  int64_t lora_rank() const { return lora_a ? lora_a->value.dim(0) : 0; }
};

struct LayerWeights {
  Parameter* input_norm = nullptr;  // [H]
  Parameter* post_norm = nullptr;   // [H]
  Parameter* q_norm = nullptr;      // [D] (qwen3)
  Parameter* k_norm = nullptr;      // [D] (qwen3)
  Linear q, k, v, o, gate, up, down;
  // The projections LoRA may target, by their PEFT module names.
  Linear* by_name(const std::string& module);
};

struct LoraConfig {
  int64_t rank = 0;
  double alpha = 0;
  bool rslora = false;
  std::vector<std::string> targets;  // q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
  double scaling() const;            // alpha / r, or alpha / sqrt(r) with rsLoRA
};

class ModelWeights {
 public:
  ModelConfig config;
  DType dtype = DType::F32;
  Parameter* embed = nullptr;       // [V, H]
  Parameter* final_norm = nullptr;  // [H]
  Parameter* lm_head = nullptr;     // [V, H]; == embed when tied
  std::vector<LayerWeights> layers;
  LoraConfig lora;                  // rank 0 when no adapter

  // Loads every tensor of the model from a checkpoint, converting to `dtype`.
  static ModelWeights load(Backend& backend, const ModelConfig& config, const io::Checkpoint& checkpoint, DType dtype);
  // Random weights (uniform with standard deviation 0.02; norms 1), deterministic in `seed`, for
  // tests and benchmarks on synthetic models.
  static ModelWeights random(Backend& backend, const ModelConfig& config, DType dtype, uint64_t seed);

  // LoRA: a PEFT adapter folder (adapter_config.json + adapter_model.safetensors), or new
  // adapters initialised as PEFT does (A Kaiming-uniform, B zero). Adapters become the only
  // trainable parameters.
  void load_peft_adapter(Backend& backend, const std::string& dir);
  void add_lora(Backend& backend, const LoraConfig& lora, uint64_t seed);

  // Full fine-tuning: every base parameter trainable.
  void train_all(Backend& backend);
  void zero_grads(Backend& backend);

  std::deque<Parameter>& parameters() { return params_; }
  const std::deque<Parameter>& parameters() const { return params_; }
  Parameter* find(const std::string& name);

 private:
  Parameter& add(Backend& backend, const std::string& name, Shape shape);
  void wire(Backend& backend);
  void make_trainable(Backend& backend, Parameter& p);
  std::deque<Parameter> params_;  // deque: stable addresses for the pointers above
};

}  // namespace spindle
