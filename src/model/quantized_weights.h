// 4-bit base weights in bitsandbytes' format (docs/qlora.md): quantising a dense checkpoint's
// projections as they load (--quantize nf4 [--double-quant] [--quant-block-size 64]), and reading a
// folder bitsandbytes already quantised (config.json's quantization_config), exactly as stored.
//
// Which projections: every Linear of the decoder layers except MoE routers, as transformers'
// bitsandbytes integration converts every nn.Linear but the LM head; embeddings, norms and the LM
// head stay dense. A quantised projection's base weight is frozen (Linear::quant).
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "model/linear.h"

namespace spindle {

namespace io {
class Checkpoint;
}

// What the user asked for on the command line (or in the YAML config).
struct QuantizeOptions {
  std::optional<Quant4Type> type;  // --quantize nf4|fp4; none: dense, unless the checkpoint is 4-bit already
  bool double_quant = false;       // --double-quant: absmax in 8 bits (bitsandbytes' compress_statistics)
  int64_t blocksize = 64;          // --quant-block-size
  bool active() const { return type.has_value(); }
};
// From the flags' spellings; checks the combination (blocksize 32 … 4096, a power of two; the
// other two flags only with --quantize).
QuantizeOptions parse_quantize_options(const std::string& quantize, bool double_quant, int64_t blocksize);
// "nf4, blocksize 64, double quantisation" (for logs and errors).
std::string describe(const QuantizeOptions& options);

// config.json's quantization_config, when bitsandbytes wrote the folder's weights in 4 bits.
struct StoredQuantization {
  Quant4Type type = Quant4Type::NF4;
  bool double_quant = false;
  std::string storage = "uint8";              // bnb_4bit_quant_storage: the dtype the packed bytes are typed as
  std::vector<std::string> skip_modules;      // llm_int8_skip_modules: kept dense
};
// Reads the config.json of a model folder (or beside a weights file); nothing when it has no
// quantization_config. A quantization_config spindle cannot load (8-bit, another method) is an error.
std::optional<StoredQuantization> read_stored_quantization(const std::string& model_path);

// Whether a projection is one bitsandbytes would quantise (every decoder projection but a router).
bool quantizable_projection(const std::string& module);

// Writes a projection's dense weight into `dense` [out, in], the backend tensor of the model dtype
// that was allocated for it (`weight` names the parameter and no longer holds that tensor).
using DenseWeightSource = std::function<void(const LinearSpec& spec, Parameter& weight, Tensor& dense)>;

// Builds the quantised projections while ModelWeights::load (or ::random) creates the layers: each
// projection's dense weight parameter is replaced, right after it is declared, by the packed bytes
// and absmax read from a 4-bit checkpoint or quantised from the dense one on the backend
// (Backend::quantize_4bit), so no more than one dense matrix exists at a time and the device never
// holds the dense model.
//
// The device scratch of quantising at load is the projection's own dense tensor, which the model
// allocated when the projection was declared: the values are drawn (random weights) or uploaded
// (a checkpoint, in the file's dtype) into it, quantised there and freed, and the stream-ordered
// pool hands the same memory to the next projection. At most one dense matrix at a time: the
// largest projection's, e.g. Qwen2.5-72B's MLP, 29568 × 8192 BF16 = 484 MB (968 MB for an F32
// checkpoint quantised for a BF16 model), plus the F32 absmax of double quantisation (1/16 of it).
// A separate scratch kept across projections would hold a second dense matrix beside the one the
// model allocates.
class QuantizedLoader {
 public:
  QuantizedLoader(Backend& backend, const io::Checkpoint& checkpoint, const std::string& model_path,
                  const QuantizeOptions& options);
  // Weights that come from no checkpoint (spindle bench's random ones): `source` makes each
  // quantisable projection's dense values when it is declared.
  QuantizedLoader(Backend& backend, const QuantizeOptions& options, DenseWeightSource source);
  bool active() const { return options_.active() || stored_.has_value(); }

  // `weight` is the projection's dense weight parameter, just added; `add` appends a parameter.
  void on_linear(const LinearSpec& spec, Parameter& weight, const std::function<Parameter&(const std::string&)>& add);
  // Points each quantised projection's Linear at its parameters (after the layers exist).
  void bind(const std::vector<Linear*>& linears) const;
  // Parameters this loader filled (the load loop reads every other one by name).
  bool filled(const Parameter& p) const { return filled_.count(&p) != 0; }
  // Checks, once every projection is declared, that every 4-bit tensor of the checkpoint belongs
  // to a projection this model quantises.
  void check_all_used() const;

 private:
  QuantizedWeight quantize_dense(const LinearSpec& spec, Parameter& weight,
                                 const std::function<Parameter&(const std::string&)>& add);
  QuantizedWeight read_stored(const LinearSpec& spec, Parameter& weight,
                              const std::function<Parameter&(const std::string&)>& add);

  Backend& backend_;
  const io::Checkpoint* checkpoint_ = nullptr;  // null: the values come from dense_source_
  DenseWeightSource dense_source_;
  std::string source_;  // for errors
  QuantizeOptions options_;
  std::optional<StoredQuantization> stored_;
  std::map<std::string, std::pair<WeightFormat, QuantizedWeight>> quantized_;  // by projection prefix
  std::set<const Parameter*> filled_;
  Tensor dynamic_map_;  // F32 [256] on the backend, shared by every double-quantised projection
};

// Quantises the dense, quantisable projections of layers already in memory (tests), one matrix at
// a time on the backend. `add` appends a parameter.
void quantize_projections(Backend& backend, const std::vector<Linear*>& linears, const QuantizeOptions& options,
                          const std::function<Parameter&(const std::string&)>& add);

}  // namespace spindle
