// LoRA on the routed experts' fused tensors, in the format PEFT gives it (LoraConfig.target_parameters,
// peft's tuners/lora ParamWrapper; docs/formats.md "LoRA on routed experts"). A fused tensor
// W [E, out, in] (mlp.experts.gate_up_proj [E, 2I, H], mlp.experts.down_proj [E, H, I]) gets one pair
// per expert, and expert e computes with W_e + s·B_e·A_e:
//
//   y_e = x_e·(W_e + s·B_e·A_e)ᵀ = x_e·W_eᵀ + s·(x_e·A_eᵀ)·B_eᵀ.
//
// PEFT adds the product to the weight before the expert's matmul; spindle runs the right-hand form,
// two more grouped GEMMs over the rows sorted by expert (A as E matrices [r, in], B as E matrices
// [out, r]), so it needs no backend op of its own. For gate_up_proj the rows 0 … I−1 of B_e adapt
// the gate projection and rows I … 2I−1 the up projection, sharing one A_e.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "model/linear.h"

namespace spindle {

struct ExpertLora {
  std::string module;  // the experts' module: "model.layers.0.mlp.experts"
  std::string tensor;  // the fused tensor on it: "gate_up_proj" or "down_proj"
  int64_t experts = 0, out = 0, in = 0;
  int64_t rank = 0;  // 0 until adapted
  double scaling = 0.0;
  // [E·r, in]: PEFT's lora_A.weight as stored; A_e is rows e·r … e·r + r − 1.
  Parameter* a = nullptr;
  // [E, out, r]: B_e contiguous, as the grouped GEMMs take it. PEFT stores lora_B.weight as
  // [out, r·E] with B_e[:, j] in column j·E + e: the file layout is converted when an adapter is
  // read or written (expert_lora_b_from_peft, expert_lora_b_to_peft).
  Parameter* b = nullptr;

  bool adapted() const { return a != nullptr; }
  // The parameter's full name, which LoraConfig::target_parameters entries match (equal, or a
  // dotted suffix: "mlp.experts.gate_up_proj" matches "model.layers.0.mlp.experts.gate_up_proj").
  std::string key() const { return module + "." + tensor; }
  bool matches(const std::string& target_parameter) const;
  std::vector<Parameter*> parameters() const;  // a, b once adapted

  // xs [N, r] (overwritten) = s·x_e·A_eᵀ on each expert's rows of x [N, in].
  void down_project(Backend& backend, Stream stream, const Tensor& x, const Tensor& offsets, Tensor& xs) const;
  // y [N, end − begin] += xs·B_e[begin:end]ᵀ: the output columns begin … end − 1 of the fused tensor.
  void up_project(Backend& backend, Stream stream, const Tensor& xs, const Tensor& offsets, int64_t begin,
                  int64_t end, Tensor& y) const;

  // The gradient of y = x·W_eᵀ + xs·B_eᵀ with respect to the pair and x, given the gradients of
  // some column ranges of y (gate_up: the gate's and the up projection's).
  struct OutputGrad {
    const Tensor* dy;    // [N, end − begin]
    int64_t begin, end;  // its columns of the fused tensor's output
  };
  // dB, dA accumulate when trainable; dx [N, in] += the LoRA path's input gradient when given.
  void backward(Backend& backend, Stream stream, const Tensor& x, const Tensor& xs, const Tensor& offsets,
                const std::vector<OutputGrad>& dys, Tensor* dx) const;
};

// The target_parameters entries a LoRA target of --lora-targets stands for: "experts" both fused
// tensors ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"), "experts.gate_up_proj" or
// "experts.down_proj" (or PEFT's own spelling of either) one; none for any other target.
std::vector<std::string> expert_target_parameters(const std::string& target);

// PEFT's lora_B.weight [out, r·E] to ExpertLora::b's [E, out, r], and back: host tensors (a CPU
// backend's), one dtype, any element size.
void expert_lora_b_from_peft(const Tensor& peft, Tensor& experts);
void expert_lora_b_to_peft(const Tensor& experts, Tensor& peft);

}  // namespace spindle
