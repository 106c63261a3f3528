// cuDNN SDPA through the cuDNN 9 backend graph API (see attention_cudnn.h). A small graph builder
// over cudnnBackend* descriptors builds the op graphs that cuDNN's fused flash-attention engines
// recognise (the same pattern cudnn-frontend's composite SDPA nodes emit), asks the heuristics for
// engine configs, keeps the first that finalizes, and caches the plan per shape.
//
// Layouts: our q [T, H, D] is cuDNN's [b=1, h, s, d] with strides [T·H·D, D, H·D, 1]; k enters the
// first matmul as Kᵀ [1, Hkv, D, Tk] (strides [.., D, 1, Hkv·D]), and the engines broadcast a kv
// head over Hq/Hkv consecutive query heads (q head h uses kv head h / (Hq/Hkv), as our kernels).
// Stats (our lse) is [1, Hq, Tq, 1] F32, strides [Hq·Tq, Tq, 1, 1]: exactly lse [Hq, Tq].
#include "backend/cuda/attention_cudnn.h"

#include <fmt/format.h>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

#if SPINDLE_HAVE_CUDNN
#include <cudnn.h>

#include <algorithm>
#include <array>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <source_location>
#include <tuple>
#include <utility>
#include <vector>
#endif

namespace spindle::cuda {

namespace {
const char* mask_name(CudnnMask m) {
  switch (m) {
    case CudnnMask::None: return "no mask";
    case CudnnMask::Causal: return "causal";
    default: return "unsupported mask";
  }
}
}  // namespace

bool attention_cudnn_supports(const AttentionShape& sh, DType io, DType outs, CudnnMask mask, std::string* why) {
  std::string reason;
  if (!attention_cudnn_built())
    reason = "this build has no cuDNN (cudnn.h / libcudnn were not found when configuring)";
  else if (io != DType::BF16 || outs != DType::BF16)
    reason = fmt::format("needs BF16 inputs and outputs (got {} -> {}; F32 ring partials are not supported)",
                         dtype_name(io), dtype_name(outs));
  else if (sh.d != 64 && sh.d != 128 && sh.d != 256)
    reason = fmt::format("needs head dim 64, 128 or 256, got {}", sh.d);
  else if (sh.hkv <= 0 || sh.hq % sh.hkv != 0)
    reason = fmt::format("query heads {} not a multiple of kv heads {}", sh.hq, sh.hkv);
  else if (mask == CudnnMask::Unsupported)
    reason = "the mask is neither one causal document (q and k the same tokens) nor fully visible "
             "(packed documents and partial ring blocks need the engine's own kernels)";
  else if (mask == CudnnMask::Causal && sh.tq != sh.tk)
    reason = fmt::format("causal needs q and k the same tokens, got tq {} tk {}", sh.tq, sh.tk);
  else if (sh.tq <= 0 || sh.tk <= 0)
    reason = "empty attention";
  if (why) *why = reason;
  return reason.empty();
}

#if !SPINDLE_HAVE_CUDNN

bool attention_cudnn_built() { return false; }
void throw_cudnn(int status, const char* call, const char* file, int line) {
  fail("cuDNN error {} in {} at {}:{} (this build has no cuDNN)", status, call, file, line);
}
int64_t attention_cudnn_workspace_bytes(const AttentionShape&, CudnnMask, bool) {
  fail("cuDNN attention's workspace: this build has no cuDNN");
}
void attention_forward_cudnn(cudaStream_t, const AttentionShape&, CudnnMask, const void*, const void*, const void*,
                             float, void*, float*) {
  fail("attention_forward: cuDNN attention, but this build has no cuDNN (install cuDNN 9 and re-run cmake, "
       "or choose --attention auto or own)");
}
void attention_backward_cudnn(cudaStream_t, const AttentionShape&, CudnnMask, const void*, const void*, const void*,
                              const void*, const void*, const float*, float, void*, void*, void*, bool) {
  fail("attention_backward: cuDNN attention, but this build has no cuDNN (install cuDNN 9 and re-run cmake, "
       "or choose --attention auto or own)");
}

#else  // SPINDLE_HAVE_CUDNN

bool attention_cudnn_built() { return true; }

void throw_cudnn(int status, const char* call, const char* file, int line) {
  char last[1024] = {0};
  cudnnGetLastErrorString(last, sizeof(last));
  fail("cuDNN error {} ({}) in {} at {}:{}{}{} (CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=stderr shows more)",
       cudnnGetErrorString(static_cast<cudnnStatus_t>(status)), status, call, file, line, last[0] ? ": " : "",
       last);
}

namespace {

using Loc = std::source_location;

void check(cudnnStatus_t st, const char* what, const Loc& loc) {
  if (st != CUDNN_STATUS_SUCCESS) throw_cudnn(static_cast<int>(st), what, loc.file_name(), static_cast<int>(loc.line()));
}

// One backend descriptor, destroyed with its owner.
class Desc {
 public:
  explicit Desc(cudnnBackendDescriptorType_t type, const Loc& loc = Loc::current()) {
    check(cudnnBackendCreateDescriptor(type, &d_), "cudnnBackendCreateDescriptor", loc);
  }
  ~Desc() {
    if (d_) cudnnBackendDestroyDescriptor(d_);
  }
  Desc(const Desc&) = delete;
  Desc& operator=(const Desc&) = delete;
  cudnnBackendDescriptor_t get() const { return d_; }

  void set(cudnnBackendAttributeName_t a, cudnnBackendAttributeType_t t, int64_t n, const void* p,
           const Loc& loc = Loc::current()) {
    check(cudnnBackendSetAttribute(d_, a, t, n, p), "cudnnBackendSetAttribute", loc);
  }
  void set_i64(cudnnBackendAttributeName_t a, int64_t v, const Loc& loc = Loc::current()) {
    set(a, CUDNN_TYPE_INT64, 1, &v, loc);
  }
  void set_dtype(cudnnBackendAttributeName_t a, cudnnDataType_t v, const Loc& loc = Loc::current()) {
    set(a, CUDNN_TYPE_DATA_TYPE, 1, &v, loc);
  }
  void set_desc(cudnnBackendAttributeName_t a, cudnnBackendDescriptor_t v, const Loc& loc = Loc::current()) {
    set(a, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &v, loc);
  }
  void finalize(const Loc& loc = Loc::current()) { check(cudnnBackendFinalize(d_), "cudnnBackendFinalize", loc); }

 private:
  cudnnBackendDescriptor_t d_ = nullptr;
};

using Dims = std::array<int64_t, 4>;

// Fixed uids of the tensors the caller binds; virtual tensors get 1000, 1001, ...
enum Uid : int64_t {
  kQ = 1, kK = 2, kV = 3, kO = 4, kStats = 5, kScale = 6, kNegInf = 7, kDO = 8, kDQ = 9, kDK = 10, kDV = 11,
  kOne = 12, kSoftmaxSum = 13, kDQAccum = 14,
};

// An op graph under construction: owns every descriptor it made.
class GraphBuilder {
 public:
  // A tensor. Virtual tensors live only inside the fused kernel; by-value ones are host scalars.
  cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t dt, Dims dims, Dims strides, bool is_virtual,
                                  bool by_value = false) {
    auto& t = keep(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
    t.set_dtype(CUDNN_ATTR_TENSOR_DATA_TYPE, dt);
    t.set(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, 4, dims.data());
    t.set(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, 4, strides.data());
    t.set_i64(CUDNN_ATTR_TENSOR_UNIQUE_ID, uid);
    t.set_i64(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, 16);
    const bool v = is_virtual, bv = by_value;
    t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, 1, &v);
    if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, 1, &bv);
    t.finalize();
    return t.get();
  }
  cudnnBackendDescriptor_t vtensor(cudnnDataType_t dt, Dims dims, Dims strides) {
    return tensor(next_uid_++, dt, dims, strides, true);
  }
  cudnnBackendDescriptor_t scalar(int64_t uid) {
    return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true);
  }

  void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
    auto& mm = keep(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
    mm.set_dtype(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_DATA_FLOAT);
    mm.finalize();
    auto& op = keep(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR, true);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_ADESC, a);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_BDESC, b);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_CDESC, c);
    op.set_desc(CUDNN_ATTR_OPERATION_MATMUL_DESC, mm.get());
    op.finalize();
  }

  // y = mode(x[, b][, t]); axis only for GEN_INDEX.
  void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y,
                 cudnnBackendDescriptor_t b = nullptr, cudnnBackendDescriptor_t t = nullptr,
                 cudnnDataType_t math = CUDNN_DATA_FLOAT, int64_t axis = -1) {
    auto& pw = keep(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
    pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, 1, &mode);
    pw.set_dtype(CUDNN_ATTR_POINTWISE_MATH_PREC, math);
    if (axis >= 0) pw.set_i64(CUDNN_ATTR_POINTWISE_AXIS, axis);
    pw.finalize();
    auto& op = keep(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR, true);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, pw.get());
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, x);
    if (b) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, b);
    if (t) op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, t);
    op.set_desc(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, y);
    op.finalize();
  }

  void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    auto& rd = keep(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
    rd.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, 1, &mode);
    rd.set_dtype(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_DATA_FLOAT);
    rd.finalize();
    auto& op = keep(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR, true);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, y);
    op.set_desc(CUDNN_ATTR_OPERATION_REDUCTION_DESC, rd.get());
    op.finalize();
  }

  // A transpose as a view: y has x's elements under other dims/strides.
  void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
    auto& op = keep(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR, true);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, x);
    op.set_desc(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, y);
    op.finalize();
  }

  // Finalizes the op graph, asks the heuristics (mode A, then the fallback list) and returns the
  // first execution plan that finalizes, with its workspace size. Throws with every reason if none.
  struct Built {
    std::unique_ptr<Desc> plan;
    int64_t workspace = 0;
  };
  Built plan(cudnnHandle_t handle, const std::string& what) {
    Desc graph(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, static_cast<int64_t>(ops_.size()),
              ops_.data());
    graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
    graph.finalize();
    std::string tried;
    for (cudnnBackendHeurMode_t mode : {CUDNN_HEUR_MODE_A, CUDNN_HEUR_MODE_FALLBACK}) {
      Desc heur(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
      const cudnnBackendDescriptor_t g = graph.get();
      heur.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, 1, &g);
      heur.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, 1, &mode);
      if (cudnnBackendFinalize(heur.get()) != CUDNN_STATUS_SUCCESS) {
        tried += fmt::format(" heuristics mode {} rejected the graph;", static_cast<int>(mode));
        continue;
      }
      int64_t count = 0;
      CUDNN_CHECK(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR,
                                           0, &count, nullptr));
      std::vector<std::unique_ptr<Desc>> cfgs;
      std::vector<cudnnBackendDescriptor_t> raw;
      for (int64_t i = 0; i < count; ++i) {
        cfgs.push_back(std::make_unique<Desc>(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR));
        raw.push_back(cfgs.back()->get());
      }
      int64_t got = 0;
      if (count > 0)
        CUDNN_CHECK(cudnnBackendGetAttribute(heur.get(), CUDNN_ATTR_ENGINEHEUR_RESULTS,
                                             CUDNN_TYPE_BACKEND_DESCRIPTOR, count, &got, raw.data()));
      tried += fmt::format(" heuristics mode {}: {} configs", static_cast<int>(mode), got);
      for (int64_t i = 0; i < got; ++i) {
        Built b;
        b.plan = std::make_unique<Desc>(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
        b.plan->set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, 1, &handle);
        b.plan->set_desc(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, raw[i]);
        const cudnnStatus_t st = cudnnBackendFinalize(b.plan->get());
        if (st != CUDNN_STATUS_SUCCESS) {
          tried += fmt::format(" [{}: {}]", i, cudnnGetErrorString(st));
          continue;
        }
        int64_t n = 0;
        CUDNN_CHECK(cudnnBackendGetAttribute(b.plan->get(), CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE,
                                             CUDNN_TYPE_INT64, 1, &n, &b.workspace));
        return b;
      }
      tried += ";";
    }
    char last[1024] = {0};
    cudnnGetLastErrorString(last, sizeof(last));
    fail("cuDNN has no engine for the {} graph ({}); {} (cuDNN {}: CUDNN_LOGLEVEL_DBG=3 CUDNN_LOGDEST_DBG=stderr "
         "shows why)",
         what, tried, last, cudnnGetVersion());
  }

 private:
  Desc& keep(cudnnBackendDescriptorType_t type, bool is_op = false) {
    descs_.push_back(std::make_unique<Desc>(type));
    if (is_op) ops_.push_back(descs_.back()->get());
    return *descs_.back();
  }
  std::vector<std::unique_ptr<Desc>> descs_;
  std::vector<cudnnBackendDescriptor_t> ops_;  // in creation (topological) order
  int64_t next_uid_ = 1000;
};

struct Key {
  int device;
  int64_t tq, tk;
  int hq, hkv, d;
  CudnnMask mask;
  bool backward;
  auto tie() const { return std::tie(device, tq, tk, hq, hkv, d, mask, backward); }
  bool operator<(const Key& o) const { return tie() < o.tie(); }
};

struct Plan {
  std::unique_ptr<Desc> plan;
  int64_t workspace = 0;      // the engine's own workspace
  int64_t softmax_sum = 0;    // backward: F32 [hq, tq] row sums Σ dout·out, after the workspace
  int64_t dq_accum = 0;       // backward: F32 [hq, tq, d] dq accumulator, after softmax_sum
  int64_t total() const { return workspace + softmax_sum + dq_accum; }
};

constexpr int64_t align256(int64_t n) { return (n + 255) / 256 * 256; }

Plan to_plan(GraphBuilder::Built b) {
  Plan p;
  p.plan = std::move(b.plan);
  p.workspace = b.workspace;
  return p;
}

// The score-path mask for `Causal`: keep s[i][j] where row i >= column j (top-left diagonal),
// else -inf. Returns the masked scores.
cudnnBackendDescriptor_t causal_mask(GraphBuilder& g, cudnnBackendDescriptor_t s, Dims dims, Dims strides) {
  auto row = g.vtensor(CUDNN_DATA_INT32, dims, strides);
  auto col = g.vtensor(CUDNN_DATA_INT32, dims, strides);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, row, nullptr, nullptr, CUDNN_DATA_FLOAT, 2);
  g.pointwise(CUDNN_POINTWISE_GEN_INDEX, s, col, nullptr, nullptr, CUDNN_DATA_FLOAT, 3);
  auto keep = g.vtensor(CUDNN_DATA_BOOLEAN, dims, strides);
  g.pointwise(CUDNN_POINTWISE_CMP_GE, row, keep, col, nullptr, CUDNN_DATA_BOOLEAN);
  auto masked = g.vtensor(CUDNN_DATA_FLOAT, dims, strides);
  g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, s, masked, g.scalar(kNegInf), keep);
  return masked;
}

// Tensors of the layouts above.
struct Layout {
  int64_t tq, tk, hq, hkv, d;
  Dims q_dims() const { return {1, hq, tq, d}; }
  Dims q_strides() const { return {tq * hq * d, d, hq * d, 1}; }
  Dims kv_dims() const { return {1, hkv, tk, d}; }
  Dims kv_strides() const { return {tk * hkv * d, d, hkv * d, 1}; }
  Dims kvt_dims() const { return {1, hkv, d, tk}; }  // Kᵀ / Vᵀ views of the same memory
  Dims kvt_strides() const { return {tk * hkv * d, d, 1, hkv * d}; }
  Dims s_dims() const { return {1, hq, tq, tk}; }
  Dims s_strides() const { return {hq * tq * tk, tq * tk, tk, 1}; }
  Dims st_dims() const { return {1, hq, tk, tq}; }  // Sᵀ views
  Dims st_strides() const { return {hq * tq * tk, tq * tk, 1, tk}; }
  Dims row_dims() const { return {1, hq, tq, 1}; }
  Dims row_strides() const { return {hq * tq, tq, 1, 1}; }
};

// Forward (training): O = softmax(scale·Q·Kᵀ [masked]) · V, Stats = max + log Σ exp(· − max).
Plan build_forward(cudnnHandle_t h, const Layout& L, CudnnMask mask) {
  GraphBuilder g;
  const auto F = CUDNN_DATA_FLOAT, B = CUDNN_DATA_BFLOAT16;
  auto q = g.tensor(kQ, B, L.q_dims(), L.q_strides(), false);
  auto kt = g.tensor(kK, B, L.kvt_dims(), L.kvt_strides(), false);
  auto v = g.tensor(kV, B, L.kv_dims(), L.kv_strides(), false);
  auto o = g.tensor(kO, B, L.q_dims(), L.q_strides(), false);
  auto stats = g.tensor(kStats, F, L.row_dims(), L.row_strides(), false);

  auto s = g.vtensor(F, L.s_dims(), L.s_strides());
  g.matmul(q, kt, s);
  auto s_scaled = g.vtensor(F, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, s, s_scaled, g.scalar(kScale));
  if (mask == CudnnMask::Causal) s_scaled = causal_mask(g, s_scaled, L.s_dims(), L.s_strides());
  auto mx = g.vtensor(F, L.row_dims(), L.row_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_MAX, s_scaled, mx);
  auto centered = g.vtensor(F, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_SUB, s_scaled, centered, mx);
  auto e = g.vtensor(F, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_EXP, centered, e);
  auto sum = g.vtensor(F, L.row_dims(), L.row_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
  auto log_sum = g.vtensor(F, L.row_dims(), L.row_strides());
  g.pointwise(CUDNN_POINTWISE_LOG, sum, log_sum);
  g.pointwise(CUDNN_POINTWISE_ADD, log_sum, stats, mx);
  // P in BF16: the fused engines want both operands of P·V in the I/O type.
  auto p = g.vtensor(B, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_DIV, e, p, sum);
  g.matmul(p, v, o);

  return to_plan(g.plan(h, fmt::format("attention forward ({})", mask_name(mask))));
}

// Backward: the recompute-P graph of cuDNN's fused flash-attention backward.
Plan build_backward(cudnnHandle_t h, const Layout& L, CudnnMask mask) {
  GraphBuilder g;
  const auto F = CUDNN_DATA_FLOAT, B = CUDNN_DATA_BFLOAT16;
  const bool gqa = L.hq != L.hkv;
  auto q = g.tensor(kQ, B, L.q_dims(), L.q_strides(), false);
  auto kt = g.tensor(kK, B, L.kvt_dims(), L.kvt_strides(), false);
  auto vt = g.tensor(kV, B, L.kvt_dims(), L.kvt_strides(), false);
  auto o = g.tensor(kO, B, L.q_dims(), L.q_strides(), false);
  auto d_o = g.tensor(kDO, B, L.q_dims(), L.q_strides(), false);
  auto stats = g.tensor(kStats, F, L.row_dims(), L.row_strides(), false);
  auto dq = g.tensor(kDQ, B, L.q_dims(), L.q_strides(), false);
  auto dk = g.tensor(kDK, B, L.kv_dims(), L.kv_strides(), false);
  auto dv = g.tensor(kDV, B, L.kv_dims(), L.kv_strides(), false);
  auto scale = g.scalar(kScale);

  // softmax_sum = Σ_d dO·O per row (non-virtual: lives in our workspace)
  auto dodo = g.vtensor(F, L.q_dims(), L.q_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, d_o, dodo, o);
  auto rsum = g.vtensor(F, L.row_dims(), L.row_strides());
  g.reduction(CUDNN_REDUCE_TENSOR_ADD, dodo, rsum);
  auto softmax_sum = g.tensor(kSoftmaxSum, F, L.row_dims(), L.row_strides(), false);
  g.pointwise(CUDNN_POINTWISE_MUL, rsum, softmax_sum, g.scalar(kOne));

  // P = exp(scale·Q·Kᵀ [masked] − Stats)
  auto s = g.vtensor(F, L.s_dims(), L.s_strides());
  g.matmul(q, kt, s);
  auto s_scaled = g.vtensor(F, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, s, s_scaled, scale);
  // The backward engines match the mask after the Stats subtraction (cudnn-frontend's order).
  auto centered = g.vtensor(F, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_SUB, s_scaled, centered, stats);
  if (mask == CudnnMask::Causal) centered = causal_mask(g, centered, L.s_dims(), L.s_strides());
  auto p = g.vtensor(F, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_EXP, centered, p);

  // grad = a·b for a kv-head gradient: under GQA a per-query-head product summed over each group.
  auto kv_grad = [&](cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t grad) {
    if (!gqa) return g.matmul(a, b, grad);
    auto full = g.vtensor(B, {1, L.hq, L.tk, L.d}, {L.hq * L.tk * L.d, L.tk * L.d, L.d, 1});
    g.matmul(a, b, full);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, full, grad);
  };

  // dV = Pᵀ·dO
  auto pt = g.vtensor(B, L.st_dims(), L.st_strides());
  g.reshape(p, pt);
  kv_grad(pt, d_o, dv);

  // dS = scale · P ∘ (dO·Vᵀ − softmax_sum)
  auto dp = g.vtensor(F, L.s_dims(), L.s_strides());
  g.matmul(d_o, vt, dp);
  auto dp_centered = g.vtensor(F, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_SUB, dp, dp_centered, softmax_sum);
  auto ds_unscaled = g.vtensor(F, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, dp_centered, ds_unscaled, p);
  auto ds = g.vtensor(F, L.s_dims(), L.s_strides());
  g.pointwise(CUDNN_POINTWISE_MUL, ds_unscaled, ds, scale);

  // dK = dSᵀ·Q
  auto dst = g.vtensor(B, L.st_dims(), L.st_strides());
  g.reshape(ds, dst);
  kv_grad(dst, q, dk);

  // dQ = dS·K through an F32 accumulator (non-virtual: in our workspace), then cast
  // K re-viewed untransposed, typed F32 like dS (the engines want equal operand types here too).
  auto k = g.vtensor(F, L.kv_dims(), L.kv_strides());
  g.reshape(kt, k);
  const Dims acc_strides{L.hq * L.tq * L.d, L.tq * L.d, L.d, 1};
  auto dq_accum = g.tensor(kDQAccum, F, L.q_dims(), acc_strides, false);
  g.matmul(ds, k, dq_accum);
  g.pointwise(CUDNN_POINTWISE_IDENTITY, dq_accum, dq);

  Plan plan = to_plan(g.plan(h, fmt::format("attention backward ({})", mask_name(mask))));
  plan.workspace = align256(plan.workspace);
  plan.softmax_sum = align256(L.hq * L.tq * int64_t(sizeof(float)));
  plan.dq_accum = L.hq * L.tq * L.d * int64_t(sizeof(float));
  return plan;
}

// One cuDNN handle per device and the plans built on it. Rows of varying length bring new shapes,
// so at most kMaxPlans are kept, the oldest dropped first. Calls from several threads are
// serialised.
constexpr size_t kMaxPlans = 64;
struct Cache {
  std::mutex mu;
  std::map<int, cudnnHandle_t> handles;  // never destroyed: the driver may be gone at exit
  std::map<Key, Plan> plans;
  std::deque<Key> built;  // plans' keys, oldest first
};
Cache& cache() {
  static Cache* c = new Cache;
  return *c;
}

// The cached plan for (sh, mask, backward) on the current device, built first if needed, and the
// device's handle. Call with the cache's mutex held.
const Plan& cached_plan(Cache& c, const AttentionShape& sh, CudnnMask mask, bool backward, cudnnHandle_t* handle) {
  int device = 0;
  CUDA_CHECK(cudaGetDevice(&device));
  auto [hit, fresh] = c.handles.try_emplace(device, nullptr);
  if (fresh) {
    cudnnHandle_t h = nullptr;
    const cudnnStatus_t st = cudnnCreate(&h);
    if (st != CUDNN_STATUS_SUCCESS) {
      c.handles.erase(hit);
      fail("cudnnCreate failed: {} (cuDNN {} loaded; is libcudnn.so.9 matching the headers and the driver?)",
           cudnnGetErrorString(st), cudnnGetVersion());
    }
    hit->second = h;
  }
  *handle = hit->second;
  const Key key{device, sh.tq, sh.tk, sh.hq, sh.hkv, sh.d, mask, backward};
  auto it = c.plans.find(key);
  if (it == c.plans.end()) {
    auto oldest = std::find_if(c.built.begin(), c.built.end(), [&](const Key& k) { return k.device == device; });
    if (c.plans.size() >= kMaxPlans && oldest != c.built.end()) {
      // A dropped plan may still have work queued on some stream: let this device finish it first
      // (rare: only once more than kMaxPlans shapes have been seen).
      CUDA_CHECK(cudaDeviceSynchronize());
      c.plans.erase(*oldest);
      c.built.erase(oldest);
    }
    const Layout L{sh.tq, sh.tk, sh.hq, sh.hkv, sh.d};
    Plan built = backward ? build_backward(*handle, L, mask) : build_forward(*handle, L, mask);
    it = c.plans.emplace(key, std::move(built)).first;
    c.built.push_back(key);
  }
  return it->second;
}

// Runs the plan for (sh, mask, backward) on stream s, binding uids to pointers; builds it first
// if needed. `ws_user` gets the workspace pointer (backward binds its F32 buffers in it).
template <typename Bind>
void run(cudaStream_t s, const AttentionShape& sh, CudnnMask mask, bool backward, Bind&& bind) {
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  cudnnHandle_t h = nullptr;
  const Plan& plan = cached_plan(c, sh, mask, backward, &h);
  CUDNN_CHECK(cudnnSetStream(h, s));
  Scratch ws(s, static_cast<size_t>(plan.total()));
  std::vector<int64_t> uids;
  std::vector<void*> ptrs;
  bind(uids, ptrs, plan, ws.as<char>());
  Desc pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
  pack.set(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, static_cast<int64_t>(uids.size()), uids.data());
  pack.set(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, static_cast<int64_t>(ptrs.size()), ptrs.data());
  void* wsp = ws.as<void>();
  pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, 1, &wsp);
  pack.finalize();
  CUDNN_CHECK(cudnnBackendExecute(h, plan.plan->get(), pack.get()));
}

void require(const AttentionShape& sh, CudnnMask mask, const char* op) {
  std::string why;
  if (!attention_cudnn_supports(sh, DType::BF16, DType::BF16, mask, &why))
    fail("{}: cuDNN attention cannot take this call: {} (choose --attention auto or own for this workload)", op,
         why);
}

}  // namespace

int64_t attention_cudnn_workspace_bytes(const AttentionShape& sh, CudnnMask mask, bool backward) {
  require(sh, mask, backward ? "attention_backward" : "attention_forward");
  Cache& c = cache();
  std::lock_guard<std::mutex> lock(c.mu);
  cudnnHandle_t h = nullptr;
  return cached_plan(c, sh, mask, backward, &h).workspace;
}

void attention_forward_cudnn(cudaStream_t s, const AttentionShape& sh, CudnnMask mask, const void* q, const void* k,
                             const void* v, float scale, void* out, float* lse) {
  require(sh, mask, "attention_forward");
  float scale_v = scale, neg_inf = -std::numeric_limits<float>::infinity();
  run(s, sh, mask, false, [&](std::vector<int64_t>& uids, std::vector<void*>& ptrs, const Plan&, char*) {
    uids = {kQ, kK, kV, kO, kStats, kScale};
    ptrs = {const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), out, lse, &scale_v};
    if (mask == CudnnMask::Causal) {
      uids.push_back(kNegInf);
      ptrs.push_back(&neg_inf);
    }
  });
}

void attention_backward_cudnn(cudaStream_t s, const AttentionShape& sh, CudnnMask mask, const void* q, const void* k,
                              const void* v, const void* out, const void* dout, const float* lse, float scale,
                              void* dq, void* dk, void* dv, bool accumulate) {
  require(sh, mask, "attention_backward");
  const int64_t nq = sh.tq * sh.hq * sh.d, nk = sh.tk * sh.hkv * sh.d;
  // `accumulate`: cuDNN writes fresh gradients into scratch, added afterwards.
  const size_t bf = 2;
  Scratch extra(s, accumulate ? static_cast<size_t>(nq + 2 * nk) * bf : 0);
  void* wq = accumulate ? extra.as<char>() : dq;
  void* wk = accumulate ? extra.as<char>() + nq * bf : dk;
  void* wv = accumulate ? extra.as<char>() + (nq + nk) * bf : dv;
  float scale_v = scale, neg_inf = -std::numeric_limits<float>::infinity(), one = 1.0f;
  run(s, sh, mask, true, [&](std::vector<int64_t>& uids, std::vector<void*>& ptrs, const Plan& plan, char* ws) {
    char* softmax_sum = ws + plan.workspace;
    char* dq_accum = softmax_sum + plan.softmax_sum;
    // Before cuDNN 9.6 the dq accumulator had to arrive zeroed (cudnn-frontend memsets it there).
    if (cudnnGetVersion() < 90600) CUDA_CHECK(cudaMemsetAsync(dq_accum, 0, static_cast<size_t>(plan.dq_accum), s));
    uids = {kQ, kK, kV, kO, kDO, kStats, kDQ, kDK, kDV, kScale, kOne, kSoftmaxSum, kDQAccum};
    ptrs = {const_cast<void*>(q), const_cast<void*>(k), const_cast<void*>(v), const_cast<void*>(out),
            const_cast<void*>(dout), const_cast<float*>(lse), wq, wk, wv, &scale_v, &one, softmax_sum, dq_accum};
    if (mask == CudnnMask::Causal) {
      uids.push_back(kNegInf);
      ptrs.push_back(&neg_inf);
    }
  });
  if (accumulate) {
    axpy(s, 1.0, wq, dq, DType::BF16, nq);
    axpy(s, 1.0, wk, dk, DType::BF16, nk);
    axpy(s, 1.0, wv, dv, DType::BF16, nk);
  }
}

#endif  // SPINDLE_HAVE_CUDNN

}  // namespace spindle::cuda
