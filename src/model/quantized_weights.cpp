#include "model/quantized_weights.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "backend/cpu/quant4_ops.h"
#include "core/error.h"
#include "io/checkpoint.h"
#include "io/load_tensor.h"

namespace spindle {

namespace fs = std::filesystem;

namespace {

constexpr const char* kQuantStateKey = ".weight.quant_state.bitsandbytes__";

WeightFormat format_of(Quant4Type t) { return t == Quant4Type::NF4 ? WeightFormat::NF4 : WeightFormat::FP4; }

Tensor upload(Backend& be, const void* data, Shape shape, DType dtype) {
  Tensor t = be.empty(shape, dtype);
  be.copy_from_host(be.default_stream(), data, t);
  return t;
}

// Quantises dense [n] (any float dtype on the backend) into the projection's parameters, as
// bitsandbytes' quantize_4bit (+ compress_statistics) does: `packed` (the dense weight's parameter)
// gets the bytes, `add` appends the absmax (and, with double quantisation, the nested absmax).
QuantizedWeight quantize_on_backend(Backend& be, const Tensor& dense, const QuantizeOptions& o, Parameter& packed,
                                    const std::string& prefix, const Tensor& dynamic_map,
                                    const std::function<Parameter&(const std::string&)>& add) {
  const Stream stream = be.default_stream();
  const int64_t n = dense.numel(), blocks = quant4::num_blocks(n, o.blocksize);
  QuantizedWeight qw;
  qw.blocksize = o.blocksize;
  qw.packed = &packed;
  packed.value = be.empty(Shape{(n + 1) / 2}, DType::U8);
  qw.absmax = &add(prefix + ".weight.absmax");
  if (!o.double_quant) {
    qw.absmax->value = be.empty(Shape{blocks}, DType::F32);
    be.quantize_4bit(stream, dense, o.blocksize, *o.type, packed.value, qw.absmax->value);
    return qw;
  }
  Tensor absmax = be.empty(Shape{blocks}, DType::F32);  // F32 [blocks], until its 8-bit codes exist
  be.quantize_4bit(stream, dense, o.blocksize, *o.type, packed.value, absmax);
  // The offset is one scalar whose last bit depends on the order of its sum: formed on the host, in
  // quant4::absmax_mean's order, from the absmax copied back (4 bytes per block: a few MB at most).
  std::vector<float> host_absmax(static_cast<size_t>(blocks));
  be.copy_to_host(stream, absmax, host_absmax.data());
  qw.offset = quant4::absmax_mean(host_absmax.data(), blocks);
  qw.absmax->value = be.empty(Shape{blocks}, DType::U8);
  qw.nested_absmax = &add(prefix + ".weight.nested_absmax");
  qw.nested_absmax->value = be.empty(Shape{quant4::num_blocks(blocks, quant4::kNestedBlocksize)}, DType::F32);
  be.quantize_absmax(stream, absmax, dynamic_map, qw.offset, quant4::kNestedBlocksize, qw.absmax->value,
                     qw.nested_absmax->value);
  qw.nested_blocksize = quant4::kNestedBlocksize;
  qw.nested_code = dynamic_map;
  return qw;
}

std::string read_text(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

template <typename T>
std::vector<T> record_values(const io::TensorRecord& rec) {
  std::vector<T> out(rec.bytes / sizeof(T));
  std::memcpy(out.data(), rec.data, out.size() * sizeof(T));
  return out;
}

}  // namespace

QuantizeOptions parse_quantize_options(const std::string& quantize, bool double_quant, int64_t blocksize) {
  QuantizeOptions o;
  o.double_quant = double_quant;
  o.blocksize = blocksize;
  if (quantize == "nf4") o.type = Quant4Type::NF4;
  else if (quantize == "fp4") o.type = Quant4Type::FP4;
  else if (!quantize.empty() && quantize != "none")
    fail("--quantize {}: spindle quantises to nf4 (or fp4), bitsandbytes' 4-bit formats", quantize);
  if (!o.active() && double_quant) fail("--double-quant quantises the absmax of 4-bit weights: add --quantize nf4");
  if (!o.active() && blocksize != 64) fail("--quant-block-size is the block of 4-bit weights: add --quantize nf4");
  if (!quant4::valid_blocksize(blocksize))
    fail("--quant-block-size {}: bitsandbytes' 4-bit blocks are 32, 64, 128, 256, 512, 1024, 2048 or 4096 weights",
         blocksize);
  return o;
}

std::string describe(const QuantizeOptions& o) {
  if (!o.active()) return "dense";
  return fmt::format("{}, blocksize {}{}", quant4::type_name(*o.type), o.blocksize,
                     o.double_quant ? ", double quantisation" : "");
}

std::optional<StoredQuantization> read_stored_quantization(const std::string& model_path) {
  const fs::path p(model_path);
  const fs::path config_path = fs::is_directory(p) ? p / "config.json" : p.parent_path() / "config.json";
  if (!fs::is_regular_file(config_path)) return std::nullopt;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_text(config_path));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: not valid JSON ({})", config_path.string(), e.what());
  }
  if (!j.is_object() || !j.contains("quantization_config") || j["quantization_config"].is_null()) return std::nullopt;
  const nlohmann::json& q = j["quantization_config"];
  const std::string src = config_path.string() + ": quantization_config";
  if (!q.is_object()) fail("{} must be an object", src);
  const std::string method = q.value("quant_method", std::string());
  // gpt-oss's MXFP4 experts are dequantised where their fused tensors are read (model/mxfp4.h); its
  // projections are dense.
  if (method == "mxfp4") return std::nullopt;
  if (method != "bitsandbytes")
    fail("{}: quant_method \"{}\" is not supported; spindle reads bitsandbytes' 4-bit checkpoints (and dense ones)",
         src, method);
  if (q.value("load_in_8bit", false) || q.value("_load_in_8bit", false))
    fail("{}: an 8-bit (LLM.int8) checkpoint; spindle reads bitsandbytes' 4-bit formats (nf4, fp4) only", src);
  if (!q.value("load_in_4bit", q.value("_load_in_4bit", false)))
    fail("{}: neither load_in_4bit nor load_in_8bit is set", src);
  StoredQuantization s;
  const std::string type = q.value("bnb_4bit_quant_type", std::string("fp4"));  // transformers' default
  if (type == "nf4") s.type = Quant4Type::NF4;
  else if (type == "fp4") s.type = Quant4Type::FP4;
  else fail("{}: bnb_4bit_quant_type \"{}\" is not nf4 or fp4", src, type);
  s.double_quant = q.value("bnb_4bit_use_double_quant", false);
  if (q.contains("bnb_4bit_quant_storage") && q["bnb_4bit_quant_storage"].is_string())
    s.storage = q["bnb_4bit_quant_storage"].get<std::string>();
  if (q.contains("llm_int8_skip_modules") && q["llm_int8_skip_modules"].is_array())
    for (const auto& m : q["llm_int8_skip_modules"]) s.skip_modules.push_back(m.get<std::string>());
  return s;
}

bool quantizable_projection(const std::string& module) {
  // The MoE router ("mlp.gate", [experts, hidden]) picks experts from small logit differences: it
  // stays dense, as the fine-tuning stacks keep it.
  return module != "gate";
}

QuantizedLoader::QuantizedLoader(Backend& backend, const io::Checkpoint& checkpoint, const std::string& model_path,
                                 const QuantizeOptions& options)
    : backend_(backend), checkpoint_(&checkpoint), source_(model_path), options_(options) {
  stored_ = read_stored_quantization(model_path);
  if (stored_ && options_.active())
    fail("{} is already quantised by bitsandbytes ({}{}); it loads as stored: drop --quantize", model_path,
         quant4::type_name(stored_->type), stored_->double_quant ? ", double quantisation" : "");
  if (!stored_)
    for (const std::string& name : checkpoint.names())
      if (name.find(kQuantStateKey) != std::string::npos)
        fail("{}: tensor {} is bitsandbytes 4-bit data, but config.json has no quantization_config describing it; "
             "restore the folder's config.json as it was saved with the weights",
             model_path, name);
}

QuantizedLoader::QuantizedLoader(Backend& backend, const QuantizeOptions& options, DenseWeightSource source)
    : backend_(backend), dense_source_(std::move(source)), source_("random weights"), options_(options) {}

void QuantizedLoader::on_linear(const LinearSpec& spec, Parameter& weight,
                                const std::function<Parameter&(const std::string&)>& add) {
  if (!active() || !quantizable_projection(spec.module)) return;
  if (stored_) {
    const bool in_file = checkpoint_->find(spec.prefix + kQuantStateKey + "nf4") ||
                         checkpoint_->find(spec.prefix + kQuantStateKey + "fp4");
    if (!in_file) return;  // kept dense in the file (llm_int8_skip_modules): loaded as it is
    quantized_[spec.prefix] = {format_of(stored_->type), read_stored(spec, weight, add)};
  } else {
    if (checkpoint_ && !checkpoint_->find(weight.name))
      fail("{}: {} is not a tensor of the checkpoint (a fused expert tensor?); --quantize reads each projection's "
           "own weight, so this checkpoint cannot be quantised at load yet",
           source_, weight.name);
    quantized_[spec.prefix] = {format_of(*options_.type), quantize_dense(spec, weight, add)};
  }
  backend_.synchronize(backend_.default_stream());
}

QuantizedWeight QuantizedLoader::quantize_dense(const LinearSpec& spec, Parameter& weight,
                                                const std::function<Parameter&(const std::string&)>& add) {
  const Shape shape{spec.out, spec.in};
  // The scratch: the dense [out, in] tensor of the model dtype allocated for this weight (the header
  // says why no other), freed when this returns.
  Tensor dense = weight.value;
  weight.value = Tensor();
  if (checkpoint_) {
    // The file's values exactly (F32, BF16 and F16 as stored; F64 rounded to F32 on the host), not
    // rounded to the model dtype: what the quantiser reads is what the checkpoint holds.
    const io::TensorRecord& record = checkpoint_->require(weight.name, shape);
    const DType dtype = record.dtype == DType::F64 || !is_float(record.dtype) ? DType::F32 : record.dtype;
    if (dtype != dense.dtype()) {
      dense = Tensor();  // freed before its replacement is allocated
      dense = backend_.empty(shape, dtype);
    }
    io::load_tensor_into(backend_, record, dense);
  } else {
    dense_source_(spec, weight, dense);
  }
  if (!dynamic_map_.defined() && options_.double_quant)
    dynamic_map_ = upload(backend_, quant4::dynamic_map(), Shape{256}, DType::F32);
  QuantizedWeight qw = quantize_on_backend(backend_, dense, options_, weight, spec.prefix, dynamic_map_, add);
  filled_.insert(qw.packed);
  filled_.insert(qw.absmax);
  if (qw.nested_absmax) filled_.insert(qw.nested_absmax);
  return qw;
}

QuantizedWeight QuantizedLoader::read_stored(const LinearSpec& spec, Parameter& weight,
                                             const std::function<Parameter&(const std::string&)>& add) {
  weight.value = Tensor();
  const std::string& pre = spec.prefix;
  const int64_t n = spec.out * spec.in;
  const std::string type = quant4::type_name(stored_->type);
  const std::string where = fmt::format("{}: {}.weight", source_, pre);
  const io::TensorRecord* state = checkpoint_->find(pre + kQuantStateKey + type);
  if (!state)
    fail("{} is stored as {} but config.json's quantization_config says {}", where,
         type == "nf4" ? "fp4" : "nf4", type);
  nlohmann::json qs;
  try {
    qs = nlohmann::json::parse(std::string(static_cast<const char*>(state->data), state->bytes));
  } catch (const nlohmann::json::exception& e) {
    fail("{}: its quant_state is not valid JSON ({}); the checkpoint is corrupt", where, e.what());
  }
  auto bad = [&](const std::string& what) -> void {
    fail("{}: corrupt or mismatched quant_state: {} (quant_state {})", where, what, qs.dump());
  };
  if (!qs.is_object()) bad("not a JSON object");
  if (qs.value("quant_type", std::string()) != type) bad("quant_type is not " + type);
  if (!qs.contains("blocksize") || !qs["blocksize"].is_number_integer()) bad("no integer blocksize");
  const int64_t blocksize = qs["blocksize"].get<int64_t>();
  if (!quant4::valid_blocksize(blocksize)) bad(fmt::format("blocksize {} is not 32 … 4096, a power of two", blocksize));
  const std::string dtype = qs.value("dtype", std::string());
  if (dtype != "float32" && dtype != "bfloat16" && dtype != "float16")
    bad(fmt::format("dtype \"{}\" is not float32, bfloat16 or float16", dtype));
  if (!qs.contains("shape") || qs["shape"] != nlohmann::json::array({spec.out, spec.in}))
    bad(fmt::format("its shape is not [{}, {}], the {} projection of this model", spec.out, spec.in, spec.module));
  const bool nested = qs.contains("nested_blocksize");
  if (nested != stored_->double_quant)
    bad(fmt::format("it {} double quantisation, config.json's bnb_4bit_use_double_quant is {}",
                    nested ? "uses" : "does not use", stored_->double_quant));

  QuantizedWeight qw;
  qw.blocksize = blocksize;
  const int64_t blocks = quant4::num_blocks(n, blocksize);
  const io::TensorRecord* packed_record = checkpoint_->find(weight.name);
  if (!packed_record) fail("{} is missing: its quant_state is there, its packed data are not", where);
  const io::TensorRecord& packed = *packed_record;
  // Any storage dtype (uint8, or bfloat16/float16/float32 for FSDP) holds the same bytes: never values.
  if (static_cast<int64_t>(packed.bytes) != (n + 1) / 2)
    fail("{}: {} bytes of packed 4-bit data ({} {}), {} weights need {}", where, packed.bytes,
         packed.stored_dtype, packed.shape.str(), n, (n + 1) / 2);
  qw.packed = &weight;
  weight.value = upload(backend_, packed.data, Shape{(n + 1) / 2}, DType::U8);

  auto tensor = [&](const std::string& suffix, DType dtype_, int64_t count) -> const io::TensorRecord& {
    const io::TensorRecord* r = checkpoint_->find(pre + ".weight." + suffix);
    if (!r) fail("{}: {}.weight.{} is missing (bitsandbytes writes it with every 4-bit weight)", where, pre, suffix);
    if (r->dtype != dtype_ || r->shape.numel() != count)
      fail("{}: {}.weight.{} is {} {}, expected {} with {} elements", where, pre, suffix, r->stored_dtype,
           r->shape.str(), dtype_name(dtype_), count);
    return *r;
  };
  const std::vector<float> table = record_values<float>(tensor("quant_map", DType::F32, 16));
  for (int i = 0; i < 16; ++i)
    if (table[i] != quant4::table(stored_->type)[i])
      fail("{}: quant_map entry {} is {}, bitsandbytes' {} table has {}; spindle decodes with the standard table",
           where, i, table[i], type, quant4::table(stored_->type)[i]);
  const io::TensorRecord& absmax = tensor("absmax", nested ? DType::U8 : DType::F32, blocks);
  qw.absmax = &add(pre + ".weight.absmax");
  qw.absmax->value = upload(backend_, absmax.data, Shape{blocks}, absmax.dtype);
  if (nested) {
    if (!qs["nested_blocksize"].is_number_integer() || qs["nested_blocksize"].get<int64_t>() <= 0)
      bad("nested_blocksize is not a positive integer");
    if (qs.value("nested_dtype", std::string()) != "float32") bad("nested_dtype is not float32");
    if (!qs.contains("nested_offset") || !qs["nested_offset"].is_number()) bad("nested_offset is not a number");
    qw.nested_blocksize = qs["nested_blocksize"].get<int64_t>();
    qw.offset = static_cast<float>(qs["nested_offset"].get<double>());
    const int64_t blocks2 = quant4::num_blocks(blocks, qw.nested_blocksize);
    const io::TensorRecord& absmax2 = tensor("nested_absmax", DType::F32, blocks2);
    const io::TensorRecord& map = tensor("nested_quant_map", DType::F32, 256);
    qw.nested_absmax = &add(pre + ".weight.nested_absmax");
    qw.nested_absmax->value = upload(backend_, absmax2.data, Shape{blocks2}, DType::F32);
    qw.nested_code = upload(backend_, map.data, Shape{256}, DType::F32);
  }
  filled_.insert(qw.packed);
  filled_.insert(qw.absmax);
  if (qw.nested_absmax) filled_.insert(qw.nested_absmax);
  return qw;
}

void QuantizedLoader::bind(const std::vector<Linear*>& linears) const {
  for (Linear* lin : linears) {
    auto it = quantized_.find(lin->prefix);
    if (it == quantized_.end()) continue;
    lin->format = it->second.first;
    lin->quant = it->second.second;
    lin->weight = nullptr;
  }
}

void QuantizedLoader::check_all_used() const {
  if (!checkpoint_) return;
  for (const std::string& name : checkpoint_->names()) {
    const size_t at = name.find(kQuantStateKey);
    if (at == std::string::npos) continue;
    const std::string prefix = name.substr(0, at);
    if (!quantized_.count(prefix))
      fail("{}: tensor {} quantises {}.weight, which this model does not hold as a quantisable projection "
           "(a router, the LM head or a tensor of another architecture); the checkpoint does not match config.json",
           source_, name, prefix);
  }
}

void quantize_projections(Backend& backend, const std::vector<Linear*>& linears, const QuantizeOptions& options,
                          const std::function<Parameter&(const std::string&)>& add) {
  if (!options.active()) return;
  Tensor dynamic_map;
  if (options.double_quant) dynamic_map = upload(backend, quant4::dynamic_map(), Shape{256}, DType::F32);
  for (Linear* lin : linears) {
    if (lin->quantized() || !quantizable_projection(lin->module)) continue;
    if (lin->weight->trainable)
      fail("{}: a trainable weight cannot be quantised (4-bit base weights are frozen; --quantize goes with LoRA)",
           lin->prefix);
    const Tensor dense = lin->weight->value;  // kept alive until its bytes exist
    lin->quant = quantize_on_backend(backend, dense, options, *lin->weight, lin->prefix, dynamic_map, add);
    lin->format = format_of(*options.type);
    lin->weight = nullptr;
    backend.synchronize(backend.default_stream());
  }
}

}  // namespace spindle
