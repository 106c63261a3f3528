// The engine's gated delta rule on inputs from a file, for an external oracle to compare against
// (scripts/gpu/check_fla_oracle.py runs flash-linear-attention on the same inputs; docs/perf.md
// records what they gave). Not a test: the script judges the results.
//
// usage: gated_delta_io [--device cuda|cpu] [--dtype bf16|f32|f64] [--chunk N] IN OUT [IN OUT ...]
//
// IN, a .safetensors file (T tokens, Hk key heads of dk, Hv value heads of dv, N documents):
//   q, k [T, Hk, dk]   as the op takes them: already L2-normalised (the model's l2norm runs before
//                      the op), not yet scaled (the op multiplies q by `scale`)
//   v [T, Hv, dv]; beta [T, Hv]; g [T, Hv] the log decay (≤ 0; the state is multiplied by exp(g))
//   do [T, Hv, dv]     ∂L/∂o
//   cu_seqlens I32 or I64 [N + 1] (optional; one document when absent): document n is tokens
//                      cu_seqlens[n] … cu_seqlens[n+1] − 1 (flash-attention's packing)
//   h0, dht [N, Hv, dk, dv] (optional, zero when absent): each document's entering state and
//                      ∂L/∂(its final state)
//   metadata "scale" (optional, default dk^-½)
// Value head h reads key head h / (Hv/Hk).
//
// OUT gets, computed on the chosen backend in the compute dtype (states and g's gradient in its
// statistics dtype):
//   chunk.o, chunk.dq, chunk.dk, chunk.dv, chunk.dg, chunk.dbeta
//       Backend::gated_delta_rule_forward / _backward: the chunked kernels a training step runs;
//       every document starts from a zero state and nothing flows back from the final states
//       (h0 and dht are not read).
//   states.o, states.final_state, states.dq, states.dk, states.dv, states.dg, states.dbeta, states.dh0
//       Backend::gated_delta_rule_forward_states / _backward_states with h0 and dht: the
//       state-passing op of sequence parallelism, the only one that reads and writes states.
//   metadata: device, dtype, the kernels the chunked op ran, milliseconds of each call.
// Several IN OUT pairs share one process (one CUDA context, one start-up).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "backend/backend.h"
#include "backend/cuda/cuda_backend.h"
#include "backend/cuda/gated_delta.h"
#include "core/dtype.h"
#include "core/error.h"
#include "io/load_tensor.h"
#include "io/safetensors_file.h"
#include "io/write_safetensors.h"

using namespace spindle;

namespace {

struct Options {
  std::string device = "cuda";
  std::string dtype;  // empty: the file's q dtype on CUDA, F64 on the CPU
  int64_t chunk = 64;
  std::vector<std::pair<std::string, std::string>> files;  // (IN, OUT)
};

[[noreturn]] void usage_error(const std::string& why) {
  fail("{}\nusage: gated_delta_io [--device cuda|cpu] [--dtype bf16|f32|f64] [--chunk N] IN OUT [IN OUT ...]", why);
}

Options parse(int argc, char** argv) {
  Options o;
  std::vector<std::string> positional;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) usage_error(a + " needs a value");
      return argv[++i];
    };
    if (a == "--device") o.device = value();
    else if (a == "--dtype") o.dtype = value();
    else if (a == "--chunk") o.chunk = std::stoll(value());
    else if (a.rfind("--", 0) == 0) usage_error("unknown option " + a);
    else positional.push_back(a);
  }
  if (positional.empty() || positional.size() % 2 != 0) usage_error("give input and output files in pairs");
  for (size_t i = 0; i < positional.size(); i += 2) o.files.emplace_back(positional[i], positional[i + 1]);
  if (o.device != "cuda" && o.device != "cpu") usage_error("--device is cuda or cpu, not " + o.device);
  return o;
}

DType dtype_option(const std::string& s) {
  if (s == "bf16" || s == "BF16") return DType::BF16;
  if (s == "f32" || s == "F32") return DType::F32;
  if (s == "f64" || s == "F64") return DType::F64;
  usage_error("--dtype is bf16, f32 or f64, not " + s);
}

const io::TensorRecord& require(const io::SafetensorsFile& f, const std::string& name) {
  const io::TensorRecord* r = f.find(name);
  if (!r) fail("{}: has no tensor '{}' (gated_delta_io's header comment lists what an input holds)", f.path(), name);
  return *r;
}

void expect_shape(const io::SafetensorsFile& f, const io::TensorRecord& r, const Shape& want) {
  if (!(r.shape == want))
    fail("{}: '{}' is {}, expected {} (from q [T, Hk, dk] and v [T, Hv, dv])", f.path(), r.name, r.shape.str(),
         want.str());
}

// Document boundaries from cu_seqlens (I32 or I64 [N + 1]), or one document of T tokens.
std::vector<int64_t> read_cu_seqlens(const io::SafetensorsFile& f, int64_t tokens) {
  const io::TensorRecord* r = f.find("cu_seqlens");
  if (!r) return {0, tokens};
  if (r->shape.rank() != 1 || r->shape[0] < 2 || (r->dtype != DType::I32 && r->dtype != DType::I64))
    fail("{}: cu_seqlens must be I32 or I64 [N + 1] with N ≥ 1, not {} {}", f.path(), dtype_name(r->dtype),
         r->shape.str());
  std::vector<int64_t> cu(static_cast<size_t>(r->shape[0]));
  for (size_t i = 0; i < cu.size(); ++i) {
    if (r->dtype == DType::I64) {
      int64_t x;
      std::memcpy(&x, static_cast<const char*>(r->data) + 8 * i, 8);  // the mapping may be unaligned
      cu[i] = x;
    } else {
      int32_t x;
      std::memcpy(&x, static_cast<const char*>(r->data) + 4 * i, 4);
      cu[i] = x;
    }
  }
  if (cu.front() != 0 || cu.back() != tokens)
    fail("{}: cu_seqlens must start at 0 and end at T = {}, got {} … {}", f.path(), tokens, cu.front(), cu.back());
  for (size_t i = 1; i < cu.size(); ++i)
    if (cu[i] <= cu[i - 1])
      fail("{}: document {} of cu_seqlens is empty or negative ({} … {}); the engine's runs hold at least one token",
           f.path(), i - 1, cu[i - 1], cu[i]);
  return cu;
}

double now_ms() {
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void run_one(Backend& be, const Options& opt, const std::string& in_path, const std::string& out_path) {
  io::SafetensorsFile f(in_path);
  const io::TensorRecord& rq = require(f, "q");
  if (rq.shape.rank() != 3) fail("{}: q must be [T, Hk, dk], is {}", in_path, rq.shape.str());
  const io::TensorRecord& rv = require(f, "v");
  if (rv.shape.rank() != 3) fail("{}: v must be [T, Hv, dv], is {}", in_path, rv.shape.str());
  const int64_t t = rq.shape[0], hk = rq.shape[1], dk = rq.shape[2], hv = rv.shape[1], dv = rv.shape[2];
  if (rv.shape[0] != t) fail("{}: q has {} tokens, v {}", in_path, t, rv.shape[0]);
  if (hv % hk != 0) fail("{}: {} value heads are not a multiple of {} key heads", in_path, hv, hk);
  const std::vector<int64_t> cu = read_cu_seqlens(f, t);
  const int64_t docs = static_cast<int64_t>(cu.size()) - 1;
  const Shape qs{t, hk, dk}, vs{t, hv, dv}, hs{t, hv}, ss{docs, hv, dk, dv};
  expect_shape(f, require(f, "k"), qs);
  expect_shape(f, require(f, "do"), vs);
  expect_shape(f, require(f, "g"), hs);
  expect_shape(f, require(f, "beta"), hs);

  const bool on_cpu = be.device().kind == DeviceKind::CPU;
  const DType io = !opt.dtype.empty() ? dtype_option(opt.dtype) : on_cpu ? DType::F64 : rq.dtype;
  if (on_cpu && io == DType::BF16) fail("the CPU backend computes in f32 or f64, not bf16");
  if (!on_cpu && io != DType::BF16 && io != DType::F32)
    fail("{}: the CUDA backend computes in bf16 or f32; q is {} (convert it, or pass --dtype)", in_path,
         dtype_name(io));
  // The statistics dtype: g, its gradient and the states (F32 beside BF16/F32, F64 beside F64).
  const DType stat = io == DType::F64 ? DType::F64 : DType::F32;

  Stream st = be.default_stream();
  auto load = [&](const std::string& name, DType dt) { return io::load_tensor(be, require(f, name), dt); };
  Tensor q = load("q", io), k = load("k", io), v = load("v", io), beta = load("beta", io), dout = load("do", io);
  Tensor g = load("g", stat);
  auto optional_state = [&](const char* name) {
    if (!f.contains(name)) return be.zeros(ss, stat);
    expect_shape(f, require(f, name), ss);
    return load(name, stat);
  };
  Tensor h0 = optional_state("h0"), dht = optional_state("dht");
  std::vector<int32_t> ids(static_cast<size_t>(t));
  for (int64_t n = 0; n < docs; ++n)
    for (int64_t i = cu[n]; i < cu[n + 1]; ++i) ids[static_cast<size_t>(i)] = static_cast<int32_t>(n);
  Tensor doc_ids = be.empty(Shape{t}, DType::I32);
  be.copy_from_host(st, ids.data(), doc_ids);

  double scale = 1.0 / std::sqrt(static_cast<double>(dk));
  if (auto it = f.metadata().find("scale"); it != f.metadata().end()) scale = std::stod(it->second);

  // NaN first, so an element a kernel forgets to write cannot pass for a result.
  auto output = [&](const Shape& s, DType dt) {
    Tensor x = be.empty(s, dt);
    be.fill(st, x, std::nan(""));
    return x;
  };
  std::map<std::string, std::string> meta{{"device", be.device().str()},
                                          {"dtype", std::string(dtype_name(io))},
                                          {"scale", fmt::format("{:.17g}", scale)}};
  auto timed = [&](const char* what, const std::function<void()>& op) {
    be.synchronize(st);
    const double start = now_ms();
    op();
    be.synchronize(st);
    meta[std::string("ms.") + what] = fmt::format("{:.3f}", now_ms() - start);
  };

  Tensor o = output(vs, io), dq = output(qs, io), dk_ = output(qs, io), dv_ = output(vs, io), dg = output(hs, stat),
         dbeta = output(hs, io);
  timed("chunk_forward",
        [&] { be.gated_delta_rule_forward(st, q, k, v, g, beta, doc_ids, scale, opt.chunk, o); });
  timed("chunk_backward", [&] {
    be.gated_delta_rule_backward(st, q, k, v, g, beta, doc_ids, scale, opt.chunk, dout, dq, dk_, dv_, dg, dbeta);
  });
  if (on_cpu) {
    meta["chunk_kernels"] = "cpu reference";
  } else {
    const cuda::DeltaRuleShape sh{t, static_cast<int>(hk), static_cast<int>(hv), static_cast<int>(dk),
                                  static_cast<int>(dv), static_cast<int>(opt.chunk)};
    const bool mma = cuda::gated_delta_rule_mma_supported(sh, io, {q.data(), k.data(), v.data(), dout.data(),
                                                                   dq.data(), dk_.data(), dv_.data()});
    meta["chunk_kernels"] = mma ? "tensor-core (gated_delta_mma.cu)" : "F32 FMA (gated_delta.cu)";
  }

  Tensor so = output(vs, io), final_state = output(ss, stat), sdq = output(qs, io), sdk = output(qs, io),
         sdv = output(vs, io), sdg = output(hs, stat), sdbeta = output(hs, io), dh0 = output(ss, stat);
  timed("states_forward", [&] {
    be.gated_delta_rule_forward_states(st, q, k, v, g, beta, doc_ids, scale, opt.chunk, h0, so, final_state);
  });
  timed("states_backward", [&] {
    be.gated_delta_rule_backward_states(st, q, k, v, g, beta, doc_ids, scale, opt.chunk, h0, dout, dht, sdq, sdk,
                                        sdv, sdg, sdbeta, dh0);
  });

  io::write_safetensors(out_path,
                        {{"chunk.o", o},
                         {"chunk.dq", dq},
                         {"chunk.dk", dk_},
                         {"chunk.dv", dv_},
                         {"chunk.dg", dg},
                         {"chunk.dbeta", dbeta},
                         {"states.o", so},
                         {"states.final_state", final_state},
                         {"states.dq", sdq},
                         {"states.dk", sdk},
                         {"states.dv", sdv},
                         {"states.dg", sdg},
                         {"states.dbeta", sdbeta},
                         {"states.dh0", dh0}},
                        be, meta);
  std::printf("%s: T %lld, %lld documents, Hk %lld Hv %lld dk %lld dv %lld, %s on %s (%s): chunk %s + %s ms, "
              "states %s + %s ms -> %s\n",
              in_path.c_str(), static_cast<long long>(t), static_cast<long long>(docs), static_cast<long long>(hk),
              static_cast<long long>(hv), static_cast<long long>(dk), static_cast<long long>(dv),
              std::string(dtype_name(io)).c_str(), be.device().str().c_str(), meta["chunk_kernels"].c_str(),
              meta["ms.chunk_forward"].c_str(), meta["ms.chunk_backward"].c_str(), meta["ms.states_forward"].c_str(),
              meta["ms.states_backward"].c_str(), out_path.c_str());
  std::fflush(stdout);  // one line per case as it is done, also into a pipe
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const Options opt = parse(argc, argv);
    std::unique_ptr<Backend> be;
    if (opt.device == "cuda") {
      if (cuda_device_count() == 0) fail("no CUDA device here; --device cpu runs the CPU reference backend");
      be = make_cuda_backend(0);
    } else {
      be = make_cpu_backend();
    }
    for (const auto& [in, out] : opt.files) run_one(*be, opt, in, out);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "gated_delta_io: %s\n", e.what());
    return 1;
  }
  return 0;
}
