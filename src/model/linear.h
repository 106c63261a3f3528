// One projection y = x·Wᵀ (+ b) (+ s·(x·Aᵀ)·Bᵀ): the frozen or trainable base weight, its optional
// bias and the LoRA pair attached to it. Every matrix product of a layer goes through a Linear, so
// LoRA targeting, FSDP, export and FLOP counts see the same list of projections, and a base weight
// stored in another format (dense, or bitsandbytes' 4-bit blocks) changes this file, not the model code.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "backend/backend.h"

namespace spindle {

struct Parameter {
  std::string name;  // the Hugging Face / PEFT tensor name
  Tensor value;      // model dtype; a 4-bit weight's packed bytes and absmax keep their own (U8, F32)
  Tensor grad;       // same shape and dtype; allocated only when trainable
  bool trainable = false;
  // A checkpoint buffer (glm4_moe's e_score_correction_bias): read and saved with the model, in the
  // stat dtype (F32; F64 for F64 models), never trained (ModelWeights::train_all leaves it frozen).
  bool buffer = false;
};

// How a base weight is stored. Dense: Parameter::value is the [out, in] matrix in the model dtype.
// NF4, FP4: bitsandbytes' 4-bit blocks (Linear::quant, docs/qlora.md), always frozen; every use
// dequantises them into a dense matrix of the compute dtype (Linear::dense_weight).
enum class WeightFormat { Dense, NF4, FP4 };

// A base weight of n = out·in elements in bitsandbytes' 4-bit format, as its checkpoints name it.
// The per-element data are Parameters, so FSDP shards them as bytes with the layer's other
// parameters; the scalars and the 256-entry map are small and stay on every rank.
struct QuantizedWeight {
  Parameter* packed = nullptr;         // U8 [(n+1)/2] "<prefix>.weight": element 2k in the high nibble of byte k
  Parameter* absmax = nullptr;         // "<prefix>.weight.absmax": F32 [blocks], or U8 codes [blocks] when nested
  Parameter* nested_absmax = nullptr;  // F32 [ceil(blocks/nested_blocksize)] "<prefix>.weight.nested_absmax"
  int64_t blocksize = 64;              // elements per absmax: 32 … 4096
  int64_t nested_blocksize = 256;      // codes per nested absmax
  float offset = 0;                    // nested only: the mean the codes are centred on
  Tensor nested_code;                  // F32 [256] nested only: the codes' values (nested_quant_map)
  bool nested() const { return nested_absmax != nullptr; }
  int64_t blocks(int64_t n) const { return (n + blocksize - 1) / blocksize; }
};

// What a module declares about one of its projections before anything is allocated.
struct LinearSpec {
  std::string module;  // PEFT module name: "q_proj"
  std::string prefix;  // HF tensor prefix: "model.layers.3.self_attn.q_proj" (+ ".weight", ".bias")
  int64_t out = 0, in = 0;
  bool bias = false;
  // Whether LoRA may adapt it under `module` (routed experts and the router are not LoRA targets).
  bool lora_target = true;
  // Share of the tokens that pass through it: 1, or k/E for a routed expert (FLOP counts).
  double token_share = 1.0;
};

// The saved state of one projection between forward and backward: its input is shared with
// sibling projections (q, k and v read the same normed x) and kept by the module; what the Linear
// alone needs is the LoRA intermediate.
struct LinearActivations {
  Tensor xa;  // [T, r] x·Aᵀ, only with LoRA
};

struct Linear {
  std::string module;  // PEFT module name
  std::string prefix;  // HF tensor prefix
  bool lora_target = true;  // see LinearSpec
  WeightFormat format = WeightFormat::Dense;
  Parameter* weight = nullptr;  // [out, in]; null when quantised (the data are in quant)
  QuantizedWeight quant;        // NF4 / FP4 only
  Parameter* bias = nullptr;    // [out]
  Parameter* lora_a = nullptr;  // [r, in]
  Parameter* lora_b = nullptr;  // [out, r]
  double lora_scaling = 0.0;
  // Kept beside the parameters: under FSDP their values exist only while the layer runs.
  int64_t out = 0, in = 0, rank = 0;  // rank: of the LoRA pair, 0 without one
  int64_t out_features() const { return out; }
  int64_t in_features() const { return in; }
  int64_t lora_rank() const { return rank; }

  // The base weight as a dense [out, in] matrix of `dtype` (the compute dtype), for the GEMMs:
  // the parameter itself when dense; a quantised weight is dequantised into a new tensor for each
  // use (backends hand back freed memory, so this is one reused scratch of the largest matrix).
  Tensor dense_weight(Backend& backend, Stream stream, DType dtype) const;
  bool quantized() const { return format != WeightFormat::Dense; }
  // weight (or the quantised weight's packed, absmax, nested_absmax), bias, lora_a, lora_b: those
  // that exist, in that order.
  std::vector<Parameter*> parameters() const;

  // Allocates what forward saves for `tokens` rows (nothing without LoRA).
  void allocate(Backend& backend, LinearActivations& a, int64_t tokens, DType dtype) const;
  // y [T, out] = x [T, in]·Wᵀ (+ b) (+ s·(x·Aᵀ)·Bᵀ); a.xa filled for backward.
  void forward(Backend& backend, Stream stream, const Tensor& x, Tensor& y, LinearActivations& a) const;
  // Only what forward saves for backward (a.xa = x·Aᵀ, the forward's product on the same input;
  // nothing without LoRA), for a caller that recomputes a projection's record but not its output.
  void save_for_backward(Backend& backend, Stream stream, const Tensor& x, LinearActivations& a) const;
  // Parameter gradients accumulate when trainable; dx = dy·W (+ LoRA term), or += when
  // accumulate_dx; no input gradient when dx is null.
  void backward(Backend& backend, Stream stream, const Tensor& x, const Tensor& dy, const LinearActivations& a,
                Tensor* dx, bool accumulate_dx) const;
};

// Where a parameter's gradient goes: its grad when trainable, nowhere (null) when frozen.
inline Tensor* trainable_grad(Parameter& p) { return p.trainable ? &p.grad : nullptr; }

}  // namespace spindle
