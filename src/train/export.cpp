#include "train/export.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "core/error.h"
#include "io/checkpoint.h"
#include "io/write_safetensors.h"
#include "model/family.h"

namespace spindle {

namespace fs = std::filesystem;

namespace {

const char* const kPeftPrefix = "base_model.model.";

// Files of a HF model folder that describe the tokenizer and generation defaults. Copied as they
// are: spindle trains on them and changes none of them.
const char* const kTokenizerAndGenerationFiles[] = {
    "tokenizer.json",       "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "chat_template.jinja",  "chat_template.json",    "generation_config.json",  "vocab.json",
    "merges.txt",           "tokenizer.model",       "vocab.txt",
};

std::string errno_text() { return std::strerror(errno); }

// The spelling of config.json's "dtype" (torch's names).
const char* torch_dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "float32";
    case DType::BF16: return "bfloat16";
    case DType::F16: return "float16";
    case DType::F64: return "float64";  // a --dtype f64 run's checkpoints keep its exact weights
    default: return nullptr;
  }
}

void require_export_dtype(DType dtype, const char* what) {
  if (!torch_dtype_name(dtype))
    fail("cannot save {} as {}: choose bf16, f16, f32 or f64", what, dtype_name(dtype));
}

void fsync_path(const fs::path& path, bool directory) {
  int fd = ::open(path.c_str(), (directory ? O_RDONLY | O_DIRECTORY : O_RDONLY) | O_CLOEXEC);
  if (fd < 0) fail("cannot open {} to flush it to disk: {}", path.string(), errno_text());
  const int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) fail("flushing {} to disk failed: {}", path.string(), errno_text());
}

// Files inside a staging folder need no temp name of their own (the folder is swapped in whole),
// but they must be on disk before the swap.
void write_file_synced(const fs::path& path, const std::string& bytes) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) fail("cannot create {}: {}", path.string(), errno_text());
  const char* p = bytes.data();
  size_t left = bytes.size();
  while (left > 0) {
    ssize_t n = ::write(fd, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const std::string why = n < 0 ? errno_text() : "no progress";
      ::close(fd);
      fail("writing {} failed: {} (is the disk full?)", path.string(), why);
    }
    p += n;
    left -= static_cast<size_t>(n);
  }
  const bool synced = ::fsync(fd) == 0;
  const std::string why = synced ? "" : errno_text();
  if (::close(fd) != 0 || !synced) fail("flushing {} to disk failed: {}", path.string(), synced ? errno_text() : why);
}

std::string read_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) fail("cannot read {}", path.string());
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) fail("reading {} failed", path.string());
  return bytes;
}

// "out/", "./out/." and "out" all name the folder "out"; the swap renames that name.
fs::path folder_name(const fs::path& dir) {
  fs::path p = fs::absolute(dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  return p;
}

// An export folder assembled under `<target>.tmp.<pid>` and swapped in by commit(). Until then the
// earlier export at `target` (if any) is untouched; if the export fails, the staging folder is
// removed and `target` is as it was.
class StagedFolder {
 public:
  explicit StagedFolder(const fs::path& target) : target_(folder_name(target)) {
    staging_ = target_;
    staging_ += ".tmp." + std::to_string(::getpid());
    std::error_code ec;
    const fs::file_status status = fs::status(target_, ec);
    if (fs::exists(status)) {
      if (!fs::is_directory(status))
        fail("cannot save to {}: it exists and is not a folder; choose a new output folder", target_.string());
      // The whole folder is replaced, so it must be one an export wrote: never a home or project folder.
      const bool empty = fs::is_empty(target_, ec);
      const bool model_folder = fs::exists(target_ / "config.json") || fs::exists(target_ / "adapter_config.json");
      if (!empty && !model_folder)
        fail("cannot save to {}: it holds files but no config.json or adapter_config.json, so it is not an earlier "
             "export and replacing it would delete them; choose a new or empty output folder",
             target_.string());
    }
    fs::create_directories(target_.parent_path(), ec);
    if (ec) fail("cannot create {}: {}", target_.parent_path().string(), ec.message());
    fs::remove_all(staging_, ec);  // left by an earlier run that had this pid and crashed
    fs::create_directory(staging_, ec);
    if (ec) fail("cannot create {}: {}; check that the folder is writable", staging_.string(), ec.message());
  }
  StagedFolder(const StagedFolder&) = delete;
  StagedFolder& operator=(const StagedFolder&) = delete;
  ~StagedFolder() {
    std::error_code ec;
    if (!committed_) fs::remove_all(staging_, ec);
  }

  const fs::path& path() const { return staging_; }

  void commit() {
    fsync_path(staging_, true);
    std::error_code ec;
    if (!fs::exists(target_, ec)) {
      if (::rename(staging_.c_str(), target_.c_str()) != 0)
        fail("cannot move {} to {}: {}", staging_.string(), target_.string(), errno_text());
    } else if (::renameat2(AT_FDCWD, staging_.c_str(), AT_FDCWD, target_.c_str(), RENAME_EXCHANGE) != 0) {
      // Filesystems without an atomic exchange: move the old folder aside first. A crash between the
      // two renames leaves the old export complete under `<target>.old.<pid>`.
      if (errno != EINVAL && errno != ENOSYS)
        fail("cannot swap {} into {}: {}", staging_.string(), target_.string(), errno_text());
      fs::path aside = target_;
      aside += ".old." + std::to_string(::getpid());
      fs::remove_all(aside, ec);
      if (::rename(target_.c_str(), aside.c_str()) != 0)
        fail("cannot move the earlier export {} aside: {}", target_.string(), errno_text());
      if (::rename(staging_.c_str(), target_.c_str()) != 0) {
        const std::string why = errno_text();
        ::rename(aside.c_str(), target_.c_str());
        fail("cannot move {} to {}: {}", staging_.string(), target_.string(), why);
      }
      staging_ = aside;  // now holds the old export, removed below
    }
    committed_ = true;
    fsync_path(target_.parent_path(), true);
    fs::remove_all(staging_, ec);  // after an exchange: the earlier export
  }

 private:
  fs::path target_, staging_;
  bool committed_ = false;
};

// `tensor` in `dtype` on the host, owned by `host` (a CPU backend). Conversions run on the tensor's
// own backend, so a device tensor crosses to the host once, already in the export dtype.
Tensor host_copy(Backend& backend, Backend& host, const Tensor& tensor, DType dtype) {
  Stream stream = backend.default_stream();
  Tensor out = host.empty(tensor.shape(), dtype);
  if (backend.device().kind == DeviceKind::CPU) {
    backend.copy(stream, tensor, out);
  } else if (tensor.dtype() == dtype) {
    backend.copy_to_host(stream, tensor, out.data());
  } else {
    Tensor converted = backend.empty(tensor.shape(), dtype);
    backend.copy(stream, tensor, converted);
    backend.copy_to_host(stream, converted, out.data());
  }
  return out;
}

// W + scaling·B·A, accumulated in F32 (F64 for F64 models) on the model's backend. A 4-bit W is its
// dequantised value, the weight the adapter was trained against.
Tensor merged_weight(Backend& backend, const Linear& linear, DType model_dtype) {
  const DType compute = model_dtype == DType::F64 ? DType::F64 : DType::F32;
  Stream stream = backend.default_stream();
  auto in_compute = [&](const Tensor& t) {
    Tensor out = backend.empty(t.shape(), compute);
    backend.copy(stream, t, out);
    return out;
  };
  Tensor w = linear.quantized() ? linear.dense_weight(backend, stream, compute) : in_compute(linear.weight->value);
  if (!linear.lora_a) return w;
  const Tensor a = in_compute(linear.lora_a->value), b = in_compute(linear.lora_b->value);
  backend.gemm(stream, b, false, a, false, w, linear.lora_scaling, 1.0);
  return w;
}

bool is_lora_parameter(const Parameter& p) { return p.name.rfind(kPeftPrefix, 0) == 0; }

// One part of a fused expert tensor that carries LoRA (a packed tensor's part, model/block.h): rows
// begin … end − 1 of expert e's matrix W_e, which merges as W_e[begin:end] + s·B_e[begin:end]·A_e.
struct AdaptedExpertRows {
  const ExpertLora* lora = nullptr;
  int64_t expert = 0, begin = 0, end = 0;
};

// The parts of the model's fused expert tensors that an expert LoRA adapts, by parameter.
std::unordered_map<const Parameter*, AdaptedExpertRows> adapted_expert_rows(const ModelWeights& weights) {
  std::unordered_map<const Parameter*, AdaptedExpertRows> out;
  for (const ExpertLora* lora : weights.expert_loras()) {
    if (!lora->adapted()) continue;
    for (const PackedTensor& packed : weights.packed_tensors()) {
      if (packed.name != lora->key()) continue;
      int64_t offset = 0;  // elements into [E, out, in]
      for (const Parameter* part : packed.parts) {
        const int64_t matrix = lora->out * lora->in, rows = part->value.numel() / lora->in;
        const int64_t begin = (offset % matrix) / lora->in;
        out[part] = {lora, offset / matrix, begin, begin + rows};
        offset += part->value.numel();
      }
    }
  }
  return out;
}

// W_e[begin:end] + s·B_e[begin:end]·A_e for one part of a fused expert tensor, accumulated in F32
// (F64 for F64 models), as merged_weight.
Tensor merged_expert_rows(Backend& backend, const Parameter& part, const AdaptedExpertRows& rows, DType model_dtype) {
  const DType compute = model_dtype == DType::F64 ? DType::F64 : DType::F32;
  Stream stream = backend.default_stream();
  auto in_compute = [&](const Tensor& t) {
    Tensor out = backend.empty(t.shape(), compute);
    backend.copy(stream, t, out);
    return out;
  };
  const ExpertLora& lora = *rows.lora;
  Tensor w = in_compute(part.value);
  const Tensor a = in_compute(lora.a->value.rows(rows.expert * lora.rank, (rows.expert + 1) * lora.rank));  // [r, in]
  const Tensor b = in_compute(lora.b->value.flat((rows.expert * lora.out + rows.begin) * lora.rank,
                                                 (rows.end - rows.begin) * lora.rank)
                                  .reshape(Shape{rows.end - rows.begin, lora.rank}));  // [end − begin, r]
  backend.gemm(stream, b, false, a, false, w, lora.scaling, 1.0);
  return w;
}

// The source checkpoint's tensors that the model does not hold but its family carries over (a
// multimodal checkpoint's vision tower, the multi-token-prediction heads: model/family.h), exactly
// as stored (dtype and bytes), on `target` for the writer. Nothing when the source folder has no
// weights.
void append_carried_tensors(const ModelWeights& weights, const fs::path& source_model_dir, Backend& target,
                            io::NamedTensors& tensors) {
  const ModelFamily& family = model_family(weights.config.model_type, weights.config.model_type);
  if (family.carried_prefixes.empty() && !family.carries_layers_past_last) return;
  std::error_code ec;
  if (!fs::exists(source_model_dir / "model.safetensors", ec) &&
      !fs::exists(source_model_dir / "model.safetensors.index.json", ec))
    return;
  const io::Checkpoint checkpoint(source_model_dir.string());
  for (const std::string& name : checkpoint.names()) {
    if (!carried_tensor(weights.config, name)) continue;
    const io::TensorRecord& record = *checkpoint.find(name);
    Tensor copy = target.empty(record.shape, record.dtype);
    if (record.bytes) target.copy_from_host(target.default_stream(), record.data, copy);
    tensors.emplace_back(name, std::move(copy));
  }
}

}  // namespace

std::string peft_adapter_config_json(const LoraConfig& lora, const std::string& base_model_name_or_path,
                                     const std::string& model_type, const std::string& multimodal_architecture) {
  // The fields PEFT's LoraConfig.save_pretrained writes that describe plain LoRA; the newer optional
  // features (DoRA, rank/alpha patterns, ...) are written with their "off" values so PEFT reads the
  // same adapter spindle trained. nlohmann::json keeps keys sorted, as PEFT's json.dumps(sort_keys=True).
  nlohmann::json j;
  j["alpha_pattern"] = nlohmann::json::object();
  j["auto_mapping"] = nullptr;
  if (!multimodal_architecture.empty())
    j["auto_mapping"] = {{"base_model_class", multimodal_architecture},
                         {"parent_library", fmt::format("transformers.models.{0}.modeling_{0}", model_type)}};
  j["base_model_name_or_path"] = base_model_name_or_path;
  j["bias"] = "none";
  j["exclude_modules"] = nullptr;
  j["fan_in_fan_out"] = false;
  j["inference_mode"] = true;
  j["init_lora_weights"] = true;
  j["layer_replication"] = nullptr;
  j["layers_pattern"] = nullptr;
  j["layers_to_transform"] = nullptr;
  j["loftq_config"] = nlohmann::json::object();
  if (lora.alpha == static_cast<double>(static_cast<int64_t>(lora.alpha)))
    j["lora_alpha"] = static_cast<int64_t>(lora.alpha);  // PEFT configs usually hold an int
  else
    j["lora_alpha"] = lora.alpha;
  j["lora_bias"] = false;
  j["lora_dropout"] = 0.0;
  j["megatron_config"] = nullptr;
  j["megatron_core"] = "megatron.core";
  j["modules_to_save"] = nullptr;
  j["peft_type"] = "LORA";
  j["r"] = lora.rank;
  j["rank_pattern"] = nlohmann::json::object();
  j["revision"] = nullptr;
  j["target_modules"] = lora.targets;
  // LoRA on the routed experts' fused tensors; null otherwise, as PEFT writes it.
  j["target_parameters"] = nullptr;
  if (!lora.target_parameters.empty()) j["target_parameters"] = lora.target_parameters;
  // PeftModelForCausalLM for a causal LM; PEFT leaves a multimodal base's task type unset (AutoPeftModel
  // refuses a task type, and AutoPeftModelForCausalLM would build the text-only class, whose tensor
  // names the adapter's do not match).
  if (multimodal_architecture.empty())
    j["task_type"] = "CAUSAL_LM";
  else
    j["task_type"] = nullptr;
  j["use_dora"] = false;
  j["use_rslora"] = lora.rslora;
  return j.dump(2) + "\n";
}

void save_peft_adapter(Backend& backend, const ModelWeights& weights, const fs::path& dir,
                       const std::string& base_model_name_or_path, DType dtype) {
  if (weights.lora.rank == 0)
    fail("cannot save a PEFT adapter to {}: the model has no LoRA adapters (a full fine-tune is saved with "
         "save_hf_model)",
         dir.string());
  require_export_dtype(dtype, "a LoRA adapter");
  StagedFolder folder(dir);
  // 0 threads: a CPU backend given a count sets it for the whole process (OpenMP, OpenBLAS), and a
  // checkpoint written mid-run would then change how the training steps after it round.
  auto host = make_cpu_backend(0);
  io::NamedTensors tensors;
  for (const Parameter& p : weights.parameters()) {
    if (!is_lora_parameter(p)) continue;
    Tensor value = host_copy(backend, *host, p.value, dtype);
    if (const ExpertLora* expert = weights.expert_lora_of_b(p)) {  // [E, out, r] -> PEFT's [out, r·E]
      Tensor stored = host->empty(Shape{expert->out, expert->rank * expert->experts}, dtype);
      expert_lora_b_to_peft(value, stored);
      value = stored;
    }
    tensors.emplace_back(p.name, value);
  }
  if (tensors.empty()) fail("cannot save a PEFT adapter to {}: LoRA rank is set but no adapter tensors exist", dir.string());
  io::write_safetensors((folder.path() / "adapter_model.safetensors").string(), tensors, *host, {{"format", "pt"}});
  write_file_synced(folder.path() / "adapter_config.json",
                    peft_adapter_config_json(weights.lora, base_model_name_or_path, weights.config.model_type,
                                             weights.config.multimodal_architecture));
  folder.commit();
}

void save_hf_model(Backend& backend, const ModelWeights& weights, const fs::path& source_model_dir,
                   const fs::path& out_dir, const HfModelExportOptions& options) {
  require_export_dtype(options.dtype, "a model");
  if (options.merge_lora && weights.lora.rank == 0)
    fail("cannot merge LoRA into the model saved to {}: the model has no LoRA adapters", out_dir.string());
  std::error_code ec;
  if (fs::exists(out_dir, ec) && fs::equivalent(out_dir, source_model_dir, ec))
    fail("cannot save the model to {}: it is the source model folder; choose another output folder",
         out_dir.string());

  const fs::path source_config = source_model_dir / "config.json";
  if (!fs::is_regular_file(source_config))
    fail("cannot save the model to {}: {} is missing; pass the folder the model was loaded from",
         out_dir.string(), source_config.string());
  nlohmann::ordered_json config;
  try {
    config = nlohmann::ordered_json::parse(read_file(source_config));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", source_config.string(), e.what());
  }
  if (!config.is_object()) fail("{}: expected a JSON object", source_config.string());
  // transformers 5 reads "dtype"; older versions read "torch_dtype", kept in step when present.
  config["dtype"] = torch_dtype_name(options.dtype);
  if (config.contains("torch_dtype")) config["torch_dtype"] = torch_dtype_name(options.dtype);
  // 4-bit projections are written dense (dequantised, with LoRA merged when asked): the folder is an
  // ordinary model, so the source's bitsandbytes quantization_config does not carry over.
  config.erase("quantization_config");

  std::unordered_map<const Parameter*, const Linear*> adapted;  // base weight -> its projection
  std::unordered_map<const Parameter*, bool> quant_state;          // a 4-bit weight's absmax: not exported
  for (const Linear* linear : weights.linears()) {
    if (linear->quantized()) {
      adapted[linear->quant.packed] = linear;  // written as its dense (merged) weight
      quant_state[linear->quant.absmax] = true;
      if (linear->quant.nested_absmax) quant_state[linear->quant.nested_absmax] = true;
    } else if (options.merge_lora && linear->lora_a) {
      adapted[linear->weight] = linear;
    }
  }
  const bool merge = options.merge_lora;
  // Routed experts' weights with LoRA on their fused tensor, merged per expert when asked.
  std::unordered_map<const Parameter*, AdaptedExpertRows> expert_rows;
  if (merge) expert_rows = adapted_expert_rows(weights);
  if (!expert_rows.empty() && weights.has_quantized_projections())
    fail("cannot merge the routed experts' LoRA into the model saved to {}: its experts are 4-bit, and spindle merges "
         "expert adapters into dense experts only; save the adapter (without merging) instead",
         out_dir.string());
  // A 4-bit weight without merging is its dequantised value (merged_weight of a Linear with no
  // adapter, or merge off).
  auto dense_of = [&](const Linear& linear) {
    if (merge || !linear.lora_a) return merged_weight(backend, linear, weights.dtype);
    return linear.dense_weight(backend, backend.default_stream(), weights.dtype == DType::F64 ? DType::F64 : DType::F32);
  };

  // Tensors in the model dtype go straight from the backend to the file; anything converted or
  // merged is staged on the host in the export dtype (the whole model, once).
  bool any_packed = false;
  for (const PackedTensor& packed : weights.packed_tensors()) any_packed |= packed.read;
  const bool direct = !options.merge_lora && options.dtype == weights.dtype && quant_state.empty() && !any_packed;
  StagedFolder folder(out_dir);
  auto host = make_cpu_backend(0);  // the process's thread count stays as training set it (save_peft_adapter)
  io::NamedTensors tensors;
  // Parameters the checkpoint held packed (fused experts) are written packed again, where their
  // first part would be (staged on the host, so such a model is not written directly).
  std::unordered_map<const Parameter*, const PackedTensor*> packed_first;
  std::unordered_map<const Parameter*, bool> in_packed;
  for (const PackedTensor& packed : weights.packed_tensors()) {
    if (!packed.read) continue;
    packed_first[packed.parts.front()] = &packed;
    for (const Parameter* part : packed.parts) in_packed[part] = true;
  }
  auto export_value = [&](const Parameter& p) {
    if (auto it = adapted.find(&p); it != adapted.end())
      return host_copy(backend, *host, dense_of(*it->second), options.dtype);
    if (auto it = expert_rows.find(&p); it != expert_rows.end())
      return host_copy(backend, *host, merged_expert_rows(backend, p, it->second, weights.dtype), options.dtype);
    // A buffer keeps F32 at least, as transformers keeps e_score_correction_bias (_keep_in_fp32_modules_strict).
    const DType buffer_dtype = options.dtype == DType::F64 ? DType::F64 : DType::F32;
    return host_copy(backend, *host, p.value, p.buffer ? buffer_dtype : options.dtype);
  };
  for (const Parameter& p : weights.parameters()) {
    if (is_lora_parameter(p)) continue;  // adapters belong in save_peft_adapter's folder
    if (quant_state.count(&p)) continue;  // folded into its weight's dense values
    if (in_packed.count(&p)) {
      auto first = packed_first.find(&p);
      if (first == packed_first.end()) continue;
      const PackedTensor& packed = *first->second;
      Tensor whole = host->empty(packed.shape, options.dtype);
      int64_t offset = 0;
      for (const Parameter* part : packed.parts) {
        Tensor slot = whole.flat(offset, part->value.numel());
        if (packed.transposed_parts) {  // the part [out, in] stored as [in, out]
          const Shape& matrix = part->value.shape();
          Tensor stored = slot.reshape(Shape{matrix[1], matrix[0]});
          copy_transposed(*host, export_value(*part), stored);
        } else {
          host->copy(host->default_stream(), export_value(*part), slot);
        }
        offset += part->value.numel();
      }
      SPINDLE_CHECK(offset == packed.shape.numel(), "{}: parts of {} elements for {}", packed.name, offset,
                    packed.shape.str());
      tensors.emplace_back(packed.name, whole);
      continue;
    }
    if (direct) {
      tensors.emplace_back(p.name, p.value);
    } else {
      tensors.emplace_back(p.name, export_value(p));
    }
  }

  append_carried_tensors(weights, source_model_dir, direct ? backend : *host, tensors);
  io::write_sharded_safetensors(folder.path().string(), tensors, direct ? backend : *host, options.max_shard_bytes);
  write_file_synced(folder.path() / "config.json", config.dump(2) + "\n");
  for (const char* name : kTokenizerAndGenerationFiles) {
    const fs::path source = source_model_dir / name;
    if (!fs::exists(source, ec)) continue;
    if (!fs::is_regular_file(source, ec))
      fail("cannot copy {} into the exported model: it is not a regular file", source.string());
    write_file_synced(folder.path() / name, read_file(source));
  }
  folder.commit();
}

}  // namespace spindle
