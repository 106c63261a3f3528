// What a training run leaves for the Python stack: a PEFT adapter folder (LoRA) that
// PeftModel.from_pretrained loads, or a Hugging Face model folder (full fine-tune, or LoRA merged into
// the base) that AutoModelForCausalLM.from_pretrained loads.
//
// Each folder is built as `<dir>.tmp.<pid>` and swapped in only once complete, so a crash or an
// error midway leaves the previous export untouched; no reader ever sees half of one.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string>

#include "backend/backend.h"
#include "model/weights.h"

namespace spindle {

// adapter_model.safetensors (the LoRA A/B tensors under PEFT's names) + adapter_config.json.
// `dtype`: PEFT keeps adapters in F32 even over a bf16 base, so F32 is the default; the model dtype
// (e.g. BF16) halves the file. `base_model_name_or_path` is recorded for PeftModel / AutoPeftModel.
void save_peft_adapter(Backend& backend, const ModelWeights& weights, const std::filesystem::path& dir,
                       const std::string& base_model_name_or_path, DType dtype = DType::F32);

struct HfModelExportOptions {
  size_t max_shard_bytes = 5'000'000'000;  // transformers' default max_shard_size "5GB"
  DType dtype = DType::BF16;               // BF16, F16 or F32; config.json's "dtype" says which
  // W += scaling·B·A for every LoRA pair before saving (in F32), for users who want one standalone
  // model. Without it the base weights are saved and the adapters are left out (save them with
  // save_peft_adapter).
  bool merge_lora = false;
};

// A HF model folder: model.safetensors or shards + model.safetensors.index.json (lm_head.weight
// left out when tied, as transformers saves it), config.json copied from `source_model_dir` with its
// dtype updated, and the tokenizer and generation files of `source_model_dir` that exist. Tensors of
// the source checkpoint outside the decoder that the family carries (qwen3_5: model.visual.*, mtp.*)
// are copied over unchanged.
void save_hf_model(Backend& backend, const ModelWeights& weights, const std::filesystem::path& source_model_dir,
                   const std::filesystem::path& out_dir, const HfModelExportOptions& options = {});

// The adapter_config.json text save_peft_adapter writes (exposed for tests and for callers that
// want to show it). For the text model of a multimodal checkpoint (`multimodal_architecture`, e.g.
// Qwen3_5MoeForConditionalGeneration) it is what PEFT writes for such a base: no task type, and an
// auto_mapping naming the class, so AutoPeftModel loads the multimodal base the adapter's names belong to.
std::string peft_adapter_config_json(const LoraConfig& lora, const std::string& base_model_name_or_path,
                                     const std::string& model_type = "", const std::string& multimodal_architecture = "");

}  // namespace spindle
