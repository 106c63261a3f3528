// The CPU reference backend: F32 or F64 compute, OpenBLAS GEMMs, OpenMP threads.
// Clarity beats speed here, except where CI time would suffer (GEMM, attention rows in parallel).
// Reductions accumulate in double so the reference is more precise than what it checks.
#include <cblas.h>
#include <unistd.h>
#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#include "backend/backend.h"
#include "backend/cpu/quant4_ops.h"
#include "backend/cpu/gated_delta_ops.h"
#include "backend/cpu/deltanet_conv_ops.h"
#include "backend/cpu/host_memory.h"
#include "backend/cpu/gated_delta_state_ops.h"
#include "backend/cpu/moe_grouped_gemm.h"
#include "backend/cpu/moe_ops.h"
#include "backend/cpu/random_ops.h"
#include "backend/cpu/shared_expert_ops.h"
#include "core/error.h"

namespace spindle {
namespace {

constexpr double kNegInf = -std::numeric_limits<double>::infinity();

void require_cpu(const Tensor& t, const char* what) {
  SPINDLE_CHECK(t.defined(), "{}: tensor not allocated", what);
  SPINDLE_CHECK(t.device().kind == DeviceKind::CPU, "{}: tensor {} is not on the CPU", what, t.describe());
}

int64_t resident_bytes() {
  long total = 0, resident = 0;
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  if (!f) return 0;
  if (std::fscanf(f, "%ld %ld", &total, &resident) != 2) resident = 0;
  std::fclose(f);
  return static_cast<int64_t>(resident) * ::sysconf(_SC_PAGESIZE);
}

int64_t peak_resident_bytes() {  // VmHWM, in kB in /proc/self/status
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  long kb = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "VmHWM: %ld kB", &kb) == 1) break;
  std::fclose(f);
  return static_cast<int64_t>(kb) * 1024;
}

void require_compute(const Tensor& t, const char* what) {
  require_cpu(t, what);
  if (t.dtype() != DType::F32 && t.dtype() != DType::F64)
    fail("{}: the CPU backend computes in F32 or F64, got {}; convert with copy() first", what, t.describe());
}

void require_same(const Tensor& a, const Tensor& b, const char* what) {
  SPINDLE_CHECK(a.dtype() == b.dtype(), "{}: dtype mismatch {} vs {}", what, a.describe(), b.describe());
}

void require_i32(const Tensor& t, const char* what) {
  require_cpu(t, what);
  SPINDLE_CHECK(t.dtype() == DType::I32, "{}: index tensor must be I32, got {}", what, t.describe());
}

// Calls f(T{}) with T = float or double for the compute dtype of t.
template <typename F>
void dispatch(const Tensor& t, F&& f) {
  if (t.dtype() == DType::F32) f(float{});
  else if (t.dtype() == DType::F64) f(double{});
  else fail("CPU backend: unsupported compute dtype {}", dtype_name(t.dtype()));
}

// Statistics tensors (rstd, lse, loss) may be F32 or F64 independent of the compute dtype.
double read_stat(const Tensor& t, int64_t i) {
  return t.dtype() == DType::F64 ? t.data_as<double>()[i] : t.data_as<float>()[i];
}
void write_stat(Tensor& t, int64_t i, double v) {
  if (t.dtype() == DType::F64) t.data_as<double>()[i] = v;
  else t.data_as<float>()[i] = static_cast<float>(v);
}

double load_any(const Tensor& t, int64_t i) {
  switch (t.dtype()) {
    case DType::F32: return t.data_as<float>()[i];
    case DType::F64: return t.data_as<double>()[i];
    case DType::BF16: return bf16_to_f32(t.data_as<uint16_t>()[i]);
    case DType::F16: return f16_to_f32(t.data_as<uint16_t>()[i]);
    case DType::I32: return t.data_as<int32_t>()[i];
    case DType::I64: return static_cast<double>(t.data_as<int64_t>()[i]);
    case DType::U8: return t.data_as<uint8_t>()[i];
  }
  return 0;
}

void store_any(Tensor& t, int64_t i, double v) {
  switch (t.dtype()) {
    case DType::F32: t.data_as<float>()[i] = static_cast<float>(v); break;
    case DType::F64: t.data_as<double>()[i] = v; break;
    case DType::BF16: t.data_as<uint16_t>()[i] = f32_to_bf16(static_cast<float>(v)); break;
    case DType::F16: t.data_as<uint16_t>()[i] = f32_to_f16(static_cast<float>(v)); break;
    case DType::I32: t.data_as<int32_t>()[i] = static_cast<int32_t>(v); break;
    case DType::I64: t.data_as<int64_t>()[i] = static_cast<int64_t>(v); break;
    case DType::U8: t.data_as<uint8_t>()[i] = static_cast<uint8_t>(v); break;
  }
}

// Bytes in live tensors of every CPU backend of the process (padded as allocated), and their
// high-water mark: what `spindle plan --device cpu` predicts.
std::atomic<int64_t> g_tensor_bytes{0}, g_peak_tensor_bytes{0};

void release_aligned(void* data, void* padded_bytes) {
  std::free(data);
  g_tensor_bytes -= static_cast<int64_t>(reinterpret_cast<uintptr_t>(padded_bytes));
}

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads) {
    if (threads > 0) {
      omp_set_num_threads(threads);
      openblas_set_num_threads(threads);
    }
  }

  std::string name() const override { return "cpu"; }
  Device device() const override { return Device{DeviceKind::CPU, 0}; }
  Stream default_stream() override { return Stream{}; }
  void synchronize(Stream) override {}
  // Ops run inside their calls, in program order: one queue, whatever the handle says.
  Stream comm_stream() override { return Stream{}; }
  void stream_wait(Stream, Stream) override {}

  Tensor empty(Shape shape, DType dtype) override {
    auto storage = std::make_shared<Storage>();
    size_t bytes = static_cast<size_t>(shape.numel()) * dtype_size(dtype);
    size_t padded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
    storage->data = std::aligned_alloc(64, padded);
    if (!storage->data) fail("out of host memory allocating {} bytes for {}", bytes, shape.str());
    storage->bytes = bytes;
    storage->device = device();
    storage->release = release_aligned;
    storage->release_context = reinterpret_cast<void*>(static_cast<uintptr_t>(padded));
    const int64_t live = g_tensor_bytes += static_cast<int64_t>(padded);
    for (int64_t peak = g_peak_tensor_bytes; live > peak && !g_peak_tensor_bytes.compare_exchange_weak(peak, live);) {
    }
    return Tensor(std::move(storage), 0, shape, dtype);
  }

  void copy_from_host(Stream, const void* src, Tensor& dst) override {
    require_cpu(dst, "copy_from_host");
    std::memcpy(dst.data(), src, dst.bytes());
  }
  void copy_to_host(Stream, const Tensor& src, void* dst) override {
    require_cpu(src, "copy_to_host");
    std::memcpy(dst, src.data(), src.bytes());
  }

  void copy(Stream, const Tensor& src, Tensor& dst) override {
    require_cpu(src, "copy");
    require_cpu(dst, "copy");
    SPINDLE_CHECK(src.numel() == dst.numel(), "copy {} -> {}", src.describe(), dst.describe());
    if (src.dtype() == dst.dtype()) {
      std::memmove(dst.data(), src.data(), src.bytes());
      return;
    }
    const int64_t n = src.numel();
#pragma omp parallel for if (n > 65536)
    for (int64_t i = 0; i < n; ++i) store_any(dst, i, load_any(src, i));
  }

  // Activation offload: the host copy is a second allocation (backend/cpu/host_memory.h).
  Tensor empty_host(Shape shape, DType dtype) override { return cpu::empty_host_tensor(shape, dtype); }
  void copy_host_device(Stream, const Tensor& src, Tensor& dst) override { offload_copies_.copy(src, dst); }
  void wait_for_copies(Stream) override {}  // the copies ran inside their calls
  OffloadStats offload_stats() override { return offload_copies_.stats(); }
  void reset_offload_stats() override { offload_copies_.reset(); }

  void fill(Stream, Tensor& t, double value) override {
    require_cpu(t, "fill");
    const int64_t n = t.numel();
    if (value == 0.0) {
      std::memset(t.data(), 0, t.bytes());
      return;
    }
    for (int64_t i = 0; i < n; ++i) store_any(t, i, value);
  }

  // backend/cpu/random_ops.cpp
  void fill_random_uniform(Stream, Tensor& t, uint64_t seed, uint64_t sequence, double half_width) override {
    cpu::fill_random_uniform(t, seed, sequence, half_width);
  }

  // Allocated: bytes in live tensors (as on CUDA, and as `spindle plan` predicts them). Reserved:
  // the process's resident set (what the kernel counts against the machine: tensors, the program,
  // its libraries and the allocator's free lists) and its high-water mark.
  MemoryStats memory_stats() override {
    MemoryStats m;
    m.allocated_bytes = g_tensor_bytes;
    m.peak_allocated_bytes = std::max(m.allocated_bytes, g_peak_tensor_bytes.load());
    m.reserved_bytes = resident_bytes();
    m.peak_reserved_bytes = std::max(m.reserved_bytes, peak_resident_bytes());
    m.host_allocated_bytes = cpu::host_tensor_bytes();
    m.peak_host_allocated_bytes = cpu::peak_host_tensor_bytes();
    return m;
  }

  void reset_peak_memory() override {
    g_peak_tensor_bytes = g_tensor_bytes.load();
    cpu::reset_peak_host_tensor_bytes();
    // Writing 5 to clear_refs resets VmHWM to the current RSS (Linux 4.0+); elsewhere the peak
    // simply keeps counting from the start.
    if (std::FILE* f = std::fopen("/proc/self/clear_refs", "w")) {
      std::fputs("5", f);
      std::fclose(f);
    }
  }

  void scale(Stream, Tensor& x, double alpha) override {
    require_compute(x, "scale");
    dispatch(x, [&](auto z) {
      using T = decltype(z);
      T* p = x.data_as<T>();
      const int64_t n = x.numel();
      for (int64_t i = 0; i < n; ++i) p[i] = static_cast<T>(p[i] * alpha);
    });
  }

  void axpy(Stream, double alpha, const Tensor& x, Tensor& y) override {
    require_compute(x, "axpy");
    require_compute(y, "axpy");
    require_same(x, y, "axpy");
    SPINDLE_CHECK(x.numel() == y.numel(), "axpy {} vs {}", x.describe(), y.describe());
    dispatch(x, [&](auto z) {
      using T = decltype(z);
      const T* a = x.data_as<T>();
      T* b = y.data_as<T>();
      const int64_t n = x.numel();
      for (int64_t i = 0; i < n; ++i) b[i] = static_cast<T>(b[i] + alpha * a[i]);
    });
  }

  void sum_squares(Stream, const Tensor& x, Tensor& out) override {
    require_compute(x, "sum_squares");
    require_cpu(out, "sum_squares");
    double acc = 0;
    dispatch(x, [&](auto z) {
      using T = decltype(z);
      const T* p = x.data_as<T>();
      const int64_t n = x.numel();
      for (int64_t i = 0; i < n; ++i) acc += static_cast<double>(p[i]) * p[i];
    });
    write_stat(out, 0, read_stat(out, 0) + acc);
  }

  void gemm(Stream, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, Tensor& c, double alpha,
            double beta) override {
    require_compute(a, "gemm");
    require_compute(b, "gemm");
    require_compute(c, "gemm");
    require_same(a, b, "gemm");
    require_same(a, c, "gemm");
    const auto [m, n, k] = gemm_shape(a, trans_a, b, trans_b, c);
    if (m == 0 || n == 0) return;
    if (k == 0) {
      scale(Stream{}, c, beta);
      return;
    }
    const auto ta = trans_a ? CblasTrans : CblasNoTrans, tb = trans_b ? CblasTrans : CblasNoTrans;
    if (a.dtype() == DType::F32)
      cblas_sgemm(CblasRowMajor, ta, tb, m, n, k, static_cast<float>(alpha), a.data_as<float>(), a.dim(1),
                  b.data_as<float>(), b.dim(1), static_cast<float>(beta), c.data_as<float>(), n);
    else
      cblas_dgemm(CblasRowMajor, ta, tb, m, n, k, alpha, a.data_as<double>(), a.dim(1), b.data_as<double>(),
                  b.dim(1), beta, c.data_as<double>(), n);
  }

  void add_bias(Stream, Tensor& y, const Tensor& bias) override {
    require_compute(y, "add_bias");
    require_same(y, bias, "add_bias");
    const int64_t n = bias.numel(), rows = n ? y.numel() / n : 0;
    SPINDLE_CHECK(rows * n == y.numel(), "add_bias {} + {}", y.describe(), bias.describe());
    dispatch(y, [&](auto z) {
      using T = decltype(z);
      T* p = y.data_as<T>();
      const T* bp = bias.data_as<T>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < n; ++j) p[r * n + j] += bp[j];
    });
  }

  void bias_backward(Stream, const Tensor& dy, Tensor& dbias) override {
    require_compute(dy, "bias_backward");
    require_same(dy, dbias, "bias_backward");
    const int64_t n = dbias.numel(), rows = n ? dy.numel() / n : 0;
    dispatch(dy, [&](auto z) {
      using T = decltype(z);
      const T* p = dy.data_as<T>();
      T* out = dbias.data_as<T>();
      for (int64_t j = 0; j < n; ++j) {
        double acc = 0;
        for (int64_t r = 0; r < rows; ++r) acc += p[r * n + j];
        out[j] = static_cast<T>(out[j] + acc);
      }
    });
  }

  void embedding_forward(Stream, const Tensor& ids, const Tensor& table, Tensor& out) override {
    require_i32(ids, "embedding_forward");
    require_compute(table, "embedding_forward");
    require_same(table, out, "embedding_forward");
    const int64_t t_count = ids.numel(), hidden = table.dim(1), vocab = table.dim(0);
    const int32_t* id = ids.data_as<int32_t>();
    const size_t row_bytes = static_cast<size_t>(hidden) * dtype_size(table.dtype());
    for (int64_t t = 0; t < t_count; ++t) {
      if (id[t] < 0 || id[t] >= vocab) fail("token id {} at position {} is outside the vocabulary [0, {})", id[t], t, vocab);
      std::memcpy(static_cast<char*>(out.data()) + t * row_bytes, static_cast<char*>(table.data()) + id[t] * row_bytes,
                  row_bytes);
    }
  }

  void embedding_backward(Stream, const Tensor& ids, const Tensor& dout, Tensor& dtable, int64_t padding_id) override {
    require_i32(ids, "embedding_backward");
    require_same(dout, dtable, "embedding_backward");
    const int64_t t_count = ids.numel(), hidden = dtable.dim(1);
    const int32_t* id = ids.data_as<int32_t>();
    dispatch(dout, [&](auto z) {
      using T = decltype(z);
      const T* g = dout.data_as<T>();
      T* d = dtable.data_as<T>();
      for (int64_t t = 0; t < t_count; ++t) {
        if (id[t] == padding_id) continue;
        for (int64_t j = 0; j < hidden; ++j) d[id[t] * hidden + j] += g[t * hidden + j];
      }
    });
  }

  void rmsnorm_forward(Stream, const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) override {
    require_compute(x, "rmsnorm_forward");
    require_same(x, w, "rmsnorm_forward");
    require_same(x, y, "rmsnorm_forward");
    const int64_t c = w.numel(), rows = c ? x.numel() / c : 0;
    SPINDLE_CHECK(rows * c == x.numel() && rstd.numel() == rows, "rmsnorm_forward {} {} {}", x.describe(),
                  w.describe(), rstd.describe());
    dispatch(x, [&](auto z) {
      using T = decltype(z);
      const T* xp = x.data_as<T>();
      const T* wp = w.data_as<T>();
      T* yp = y.data_as<T>();
#pragma omp parallel for if (rows > 256)
      for (int64_t r = 0; r < rows; ++r) {
        double ss = 0;
        for (int64_t j = 0; j < c; ++j) ss += static_cast<double>(xp[r * c + j]) * xp[r * c + j];
        // The statistic is stored (and used) at its own precision, exactly as saved for backward.
        write_stat(rstd, r, 1.0 / std::sqrt(ss / c + eps));
        const double rs = read_stat(rstd, r);
        for (int64_t j = 0; j < c; ++j) yp[r * c + j] = static_cast<T>(xp[r * c + j] * rs * wp[j]);
      }
    });
  }

  void rmsnorm_backward(Stream, const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& dy, Tensor& dx,
                        Tensor* dw, bool accumulate_dx) override {
    require_compute(x, "rmsnorm_backward");
    require_same(x, dy, "rmsnorm_backward");
    require_same(x, dx, "rmsnorm_backward");
    if (dw) require_same(x, *dw, "rmsnorm_backward");
    const int64_t c = w.numel(), rows = c ? x.numel() / c : 0;
    dispatch(x, [&](auto z) {
      using T = decltype(z);
      const T* xp = x.data_as<T>();
      const T* wp = w.data_as<T>();
      const T* gp = dy.data_as<T>();
      T* dxp = dx.data_as<T>();
      std::vector<double> dw_acc(c, 0.0);
      // y = x·r·w, r = (mean x² + eps)^-½ ; dx = r·(g∘w) − x·r³·mean(x∘g∘w)
      for (int64_t r = 0; r < rows; ++r) {
        const double rs = read_stat(rstd, r);
        double dot = 0;
        for (int64_t j = 0; j < c; ++j) {
          dot += static_cast<double>(gp[r * c + j]) * wp[j] * xp[r * c + j];
          dw_acc[j] += static_cast<double>(gp[r * c + j]) * xp[r * c + j] * rs;
        }
        const double coef = dot * rs * rs * rs / c;
        for (int64_t j = 0; j < c; ++j) {
          const double v = rs * gp[r * c + j] * wp[j] - xp[r * c + j] * coef;
          dxp[r * c + j] = static_cast<T>(accumulate_dx ? dxp[r * c + j] + v : v);
        }
      }
      if (!dw) return;
      T* dwp = dw->data_as<T>();
      for (int64_t j = 0; j < c; ++j) dwp[j] = static_cast<T>(dwp[j] + dw_acc[j]);
    });
  }

  void rope(Stream, Tensor& x, const Tensor& positions, const Tensor& inv_freq, double attention_scale,
            int sign) override {
    require_compute(x, "rope");
    require_i32(positions, "rope");
    SPINDLE_CHECK(inv_freq.dtype() == DType::F32, "rope: inv_freq must be F32");
    SPINDLE_CHECK(x.rank() == 3, "rope wants x [T, heads, D], got {}", x.describe());
    const int64_t t_count = x.dim(0), heads = x.dim(1), d = x.dim(2), half = d / 2;
    SPINDLE_CHECK(inv_freq.numel() == half && positions.numel() == t_count, "rope: {} {} {}", x.describe(),
                  positions.describe(), inv_freq.describe());
    const int32_t* pos = positions.data_as<int32_t>();
    const float* freq = inv_freq.data_as<float>();
    dispatch(x, [&](auto z) {
      using T = decltype(z);
      T* p = x.data_as<T>();
#pragma omp parallel for if (t_count > 64)
      for (int64_t t = 0; t < t_count; ++t) {
        for (int64_t i = 0; i < half; ++i) {
          // The angle is rounded to F32 exactly as transformers computes it (fp32 product).
          const float angle = static_cast<float>(pos[t]) * freq[i];
          const double cs = std::cos(static_cast<double>(angle)) * attention_scale;
          const double sn = std::sin(static_cast<double>(angle)) * attention_scale * sign;
          for (int64_t h = 0; h < heads; ++h) {
            T* row = p + (t * heads + h) * d;
            const double a = row[i], b = row[i + half];
            row[i] = static_cast<T>(a * cs - b * sn);
            row[i + half] = static_cast<T>(b * cs + a * sn);
          }
        }
      }
    });
  }

  struct AttnShape {
    int64_t tq, tk, hq, hkv, d, group;
  };
  static AttnShape attn_shape(const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask) {
    SPINDLE_CHECK(q.rank() == 3 && k.rank() == 3 && v.rank() == 3, "attention wants [T, heads, D]: {} {} {}",
                  q.describe(), k.describe(), v.describe());
    AttnShape s{q.dim(0), k.dim(0), q.dim(1), k.dim(1), q.dim(2), 0};
    SPINDLE_CHECK(s.hkv > 0 && s.hq % s.hkv == 0, "attention: {} query heads not a multiple of {} kv heads", s.hq,
                  s.hkv);
    SPINDLE_CHECK(k.dim(2) == s.d && v.shape() == k.shape(), "attention: k {} v {} vs q {}", k.describe(),
                  v.describe(), q.describe());
    SPINDLE_CHECK(mask.q_doc.numel() == s.tq && mask.q_pos.numel() == s.tq && mask.k_doc.numel() == s.tk &&
                      mask.k_pos.numel() == s.tk,
                  "attention mask lengths do not match q/k");
    s.group = s.hq / s.hkv;
    return s;
  }

  void attention_forward(Stream, const Tensor& q, const Tensor& k, const Tensor& v, const AttentionMask& mask,
                         const AttentionLogits& logits, Tensor& out, Tensor& lse) override {
    require_compute(q, "attention_forward");
    require_same(q, k, "attention_forward");
    require_same(q, v, "attention_forward");
    require_same(q, out, "attention_forward");
    const AttnShape s = attn_shape(q, k, v, mask);
    SPINDLE_CHECK(lse.numel() == s.hq * s.tq, "attention_forward: lse {}", lse.describe());
    const int32_t *qd = mask.q_doc.data_as<int32_t>(), *qp = mask.q_pos.data_as<int32_t>();
    const int32_t *kd = mask.k_doc.data_as<int32_t>(), *kp = mask.k_pos.data_as<int32_t>();
    const double scale = logits.scale, cap = logits.softcap;
    const int window = static_cast<int>(logits.window);
    dispatch(q, [&](auto z) {
      using T = decltype(z);
      const T *Q = q.data_as<T>(), *K = k.data_as<T>(), *V = v.data_as<T>();
      T* O = out.data_as<T>();
#pragma omp parallel
      {
        std::vector<double> score(s.tk), acc(s.d);
#pragma omp for collapse(2) schedule(dynamic, 16)
        for (int64_t h = 0; h < s.hq; ++h)
          for (int64_t i = 0; i < s.tq; ++i) {
            const int64_t hk = h / s.group;
            const T* qi = Q + (i * s.hq + h) * s.d;
            double mx = kNegInf;
            for (int64_t j = 0; j < s.tk; ++j) {
              if (!key_visible(qd[i], qp[i], kd[j], kp[j], window)) {
                score[j] = kNegInf;
                continue;
              }
              const T* kj = K + (j * s.hkv + hk) * s.d;
              double dot = 0;
              for (int64_t e = 0; e < s.d; ++e) dot += static_cast<double>(qi[e]) * kj[e];
              score[j] = dot * scale;
              if (cap > 0) score[j] = cap * std::tanh(score[j] / cap);
              mx = std::max(mx, score[j]);
            }
            T* oi = O + (i * s.hq + h) * s.d;
            if (mx == kNegInf) {
              for (int64_t e = 0; e < s.d; ++e) oi[e] = 0;
              write_stat(lse, h * s.tq + i, kNegInf);
              continue;
            }
            std::fill(acc.begin(), acc.end(), 0.0);
            double sum = 0;
            for (int64_t j = 0; j < s.tk; ++j) {
              if (score[j] == kNegInf) continue;
              const double p = std::exp(score[j] - mx);
              sum += p;
              const T* vj = V + (j * s.hkv + hk) * s.d;
              for (int64_t e = 0; e < s.d; ++e) acc[e] += p * vj[e];
            }
            for (int64_t e = 0; e < s.d; ++e) oi[e] = static_cast<T>(acc[e] / sum);
            write_stat(lse, h * s.tq + i, mx + std::log(sum));
          }
      }
    });
  }

  void attention_backward(Stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                          const Tensor& dout, const Tensor& lse, const AttentionMask& mask,
                          const AttentionLogits& logits, Tensor& dq, Tensor& dk, Tensor& dv, bool accumulate) override {
    require_compute(q, "attention_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v, &out, &dout, &dq, &dk, &dv}) require_same(q, *t, "attention_backward");
    const AttnShape s = attn_shape(q, k, v, mask);
    const int32_t *qd = mask.q_doc.data_as<int32_t>(), *qp = mask.q_pos.data_as<int32_t>();
    const int32_t *kd = mask.k_doc.data_as<int32_t>(), *kp = mask.k_pos.data_as<int32_t>();
    const double scale = logits.scale, cap = logits.softcap;
    const int window = static_cast<int>(logits.window);
    dispatch(q, [&](auto z) {
      using T = decltype(z);
      const T *Q = q.data_as<T>(), *K = k.data_as<T>(), *V = v.data_as<T>(), *O = out.data_as<T>(),
              *dO = dout.data_as<T>();
      T *dQ = dq.data_as<T>(), *dK = dk.data_as<T>(), *dV = dv.data_as<T>();
      // Each kv head (and its query group) is independent: parallel over kv heads, no write races.
#pragma omp parallel for schedule(dynamic, 1)
      for (int64_t hk = 0; hk < s.hkv; ++hk) {
        std::vector<double> dk_acc(s.tk * s.d, 0.0), dv_acc(s.tk * s.d, 0.0), dq_acc(s.d);
        for (int64_t h = hk * s.group; h < (hk + 1) * s.group; ++h)
          for (int64_t i = 0; i < s.tq; ++i) {
            const double l = read_stat(lse, h * s.tq + i);
            const T* qi = Q + (i * s.hq + h) * s.d;
            const T* doi = dO + (i * s.hq + h) * s.d;
            const T* oi = O + (i * s.hq + h) * s.d;
            std::fill(dq_acc.begin(), dq_acc.end(), 0.0);
            if (l != kNegInf) {
              double delta = 0;  // D_i = Σ dO·O over the final output
              for (int64_t e = 0; e < s.d; ++e) delta += static_cast<double>(doi[e]) * oi[e];
              for (int64_t j = 0; j < s.tk; ++j) {
                if (!key_visible(qd[i], qp[i], kd[j], kp[j], window)) continue;
                const T* kj = K + (j * s.hkv + hk) * s.d;
                const T* vj = V + (j * s.hkv + hk) * s.d;
                double dot = 0, dp = 0;
                for (int64_t e = 0; e < s.d; ++e) {
                  dot += static_cast<double>(qi[e]) * kj[e];
                  dp += static_cast<double>(doi[e]) * vj[e];
                }
                double ds;
                if (cap > 0) {
                  // logit = cap·tanh(scale·dot / cap): ∂logit/∂dot = scale·(1 − tanh²)
                  const double t = std::tanh(dot * scale / cap);
                  const double p = std::exp(cap * t - l);
                  ds = p * (dp - delta) * (1 - t * t) * scale;
                  for (int64_t e = 0; e < s.d; ++e) dv_acc[j * s.d + e] += p * doi[e];
                } else {
                  const double p = std::exp(dot * scale - l);
                  ds = p * (dp - delta) * scale;
                  for (int64_t e = 0; e < s.d; ++e) dv_acc[j * s.d + e] += p * doi[e];
                }
                for (int64_t e = 0; e < s.d; ++e) {
                  dk_acc[j * s.d + e] += ds * qi[e];
                  dq_acc[e] += ds * kj[e];
                }
              }
            }
            T* dqi = dQ + (i * s.hq + h) * s.d;
            for (int64_t e = 0; e < s.d; ++e) dqi[e] = static_cast<T>(accumulate ? dqi[e] + dq_acc[e] : dq_acc[e]);
          }
        for (int64_t j = 0; j < s.tk; ++j)
          for (int64_t e = 0; e < s.d; ++e) {
            T& a = dK[(j * s.hkv + hk) * s.d + e];
            T& b = dV[(j * s.hkv + hk) * s.d + e];
            a = static_cast<T>(accumulate ? a + dk_acc[j * s.d + e] : dk_acc[j * s.d + e]);
            b = static_cast<T>(accumulate ? b + dv_acc[j * s.d + e] : dv_acc[j * s.d + e]);
          }
      }
    });
  }

  void attention_merge(Stream, Tensor& out, Tensor& lse, const Tensor& out_b, const Tensor& lse_b) override {
    require_compute(out, "attention_merge");
    SPINDLE_CHECK(out.rank() == 3 && out_b.numel() == out.numel() && lse.numel() == lse_b.numel() &&
                      lse.numel() == out.dim(0) * out.dim(1),
                  "attention_merge: out {} lse {} out_b {} lse_b {}", out.describe(), lse.describe(), out_b.describe(),
                  lse_b.describe());
    const int64_t tq = out.dim(0), hq = out.dim(1), d = out.dim(2);
    for (int64_t h = 0; h < hq; ++h)
      for (int64_t i = 0; i < tq; ++i) {
        const double lb = read_stat(lse_b, h * tq + i);
        if (lb == kNegInf) continue;  // the block saw no key: nothing to merge
        const double la = read_stat(lse, h * tq + i);
        const int64_t base = (i * hq + h) * d;
        if (la == kNegInf) {
          for (int64_t e = 0; e < d; ++e) store_any(out, base + e, load_any(out_b, base + e));
          write_stat(lse, h * tq + i, lb);
          continue;
        }
        const double sig = 1.0 / (1.0 + std::exp(-(lb - la)));  // σ(lse_b − lse)
        for (int64_t e = 0; e < d; ++e) {
          const double o = load_any(out, base + e);
          store_any(out, base + e, o - sig * (o - load_any(out_b, base + e)));
        }
        // lse − log σ(lse − lse_b) = max + log1p(exp(−|lse − lse_b|))
        write_stat(lse, h * tq + i, std::max(la, lb) + std::log1p(std::exp(-std::fabs(la - lb))));
      }
  }

  void attention_sink_forward(Stream, Tensor& out, Tensor& lse, const Tensor& sinks) override {
    require_compute(out, "attention_sink_forward");
    SPINDLE_CHECK(out.rank() == 3 && sinks.numel() == out.dim(1) && lse.numel() == out.dim(0) * out.dim(1),
                  "attention_sink_forward: out {} lse {} sinks {}", out.describe(), lse.describe(), sinks.describe());
    const int64_t tq = out.dim(0), hq = out.dim(1), d = out.dim(2);
    for (int64_t h = 0; h < hq; ++h) {
      const double sink = load_any(sinks, h);
      for (int64_t i = 0; i < tq; ++i) {
        const double l = read_stat(lse, h * tq + i);
        if (l == kNegInf) {  // no visible key: the sink takes the whole row, out stays 0
          write_stat(lse, h * tq + i, sink);
          continue;
        }
        const double merged = std::max(l, sink) + std::log1p(std::exp(-std::fabs(l - sink)));
        const double keep = std::exp(l - merged);  // σ(lse − sink)
        const int64_t base = (i * hq + h) * d;
        for (int64_t e = 0; e < d; ++e) store_any(out, base + e, load_any(out, base + e) * keep);
        write_stat(lse, h * tq + i, merged);
      }
    }
  }

  void attention_sink_backward(Stream, const Tensor& out, const Tensor& dout, const Tensor& lse, const Tensor& sinks,
                               Tensor& dsinks) override {
    require_compute(out, "attention_sink_backward");
    SPINDLE_CHECK(out.rank() == 3 && dout.shape() == out.shape() && sinks.numel() == out.dim(1) &&
                      dsinks.numel() == sinks.numel() && lse.numel() == out.dim(0) * out.dim(1),
                  "attention_sink_backward: out {} dout {} lse {} sinks {} dsinks {}", out.describe(), dout.describe(),
                  lse.describe(), sinks.describe(), dsinks.describe());
    const int64_t tq = out.dim(0), hq = out.dim(1), d = out.dim(2);
    for (int64_t h = 0; h < hq; ++h) {
      const double sink = load_any(sinks, h);
      double grad = 0;
      for (int64_t i = 0; i < tq; ++i) {
        const double l = read_stat(lse, h * tq + i);
        if (l == kNegInf) continue;
        const int64_t base = (i * hq + h) * d;
        double delta = 0;  // D_i = Σ dout·out over the final output
        for (int64_t e = 0; e < d; ++e) delta += load_any(dout, base + e) * load_any(out, base + e);
        grad -= std::exp(sink - l) * delta;
      }
      store_any(dsinks, h, load_any(dsinks, h) + grad);
    }
  }

  void swiglu_forward(Stream, const Tensor& gate, const Tensor& up, Tensor& out) override {
    require_compute(gate, "swiglu_forward");
    require_same(gate, up, "swiglu_forward");
    require_same(gate, out, "swiglu_forward");
    dispatch(gate, [&](auto z) {
      using T = decltype(z);
      const T *g = gate.data_as<T>(), *u = up.data_as<T>();
      T* o = out.data_as<T>();
      const int64_t n = gate.numel();
      for (int64_t i = 0; i < n; ++i) {
        const double x = g[i];
        o[i] = static_cast<T>(x / (1.0 + std::exp(-x)) * u[i]);
      }
    });
  }

  void swiglu_backward(Stream, const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                       Tensor& dup) override {
    require_compute(gate, "swiglu_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&up, &dout, &dgate, &dup}) require_same(gate, *t, "swiglu_backward");
    dispatch(gate, [&](auto z) {
      using T = decltype(z);
      const T *g = gate.data_as<T>(), *u = up.data_as<T>(), *go = dout.data_as<T>();
      T *dg = dgate.data_as<T>(), *du = dup.data_as<T>();
      const int64_t n = gate.numel();
      for (int64_t i = 0; i < n; ++i) {
        const double x = g[i], sig = 1.0 / (1.0 + std::exp(-x));
        du[i] = static_cast<T>(go[i] * x * sig);
        dg[i] = static_cast<T>(go[i] * u[i] * sig * (1.0 + x * (1.0 - sig)));
      }
    });
  }

  // gelu_tanh(x) and its derivative, in double.
  static double gelu_tanh(double x, double* derivative) {
    constexpr double kC = 0.7978845608028654;  // √(2/π)
    const double inner = kC * (x + 0.044715 * x * x * x), t = std::tanh(inner);
    if (derivative) *derivative = 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * kC * (1 + 3 * 0.044715 * x * x);
    return 0.5 * x * (1 + t);
  }

  void geglu_tanh_forward(Stream, const Tensor& gate, const Tensor& up, Tensor& out) override {
    require_compute(gate, "geglu_tanh_forward");
    require_same(gate, up, "geglu_tanh_forward");
    require_same(gate, out, "geglu_tanh_forward");
    dispatch(gate, [&](auto z) {
      using T = decltype(z);
      const T *g = gate.data_as<T>(), *u = up.data_as<T>();
      T* o = out.data_as<T>();
      for (int64_t i = 0; i < gate.numel(); ++i) o[i] = static_cast<T>(gelu_tanh(g[i], nullptr) * u[i]);
    });
  }

  void geglu_tanh_backward(Stream, const Tensor& gate, const Tensor& up, const Tensor& dout, Tensor& dgate,
                           Tensor& dup) override {
    require_compute(gate, "geglu_tanh_backward");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&up, &dout, &dgate, &dup})
      require_same(gate, *t, "geglu_tanh_backward");
    dispatch(gate, [&](auto z) {
      using T = decltype(z);
      const T *g = gate.data_as<T>(), *u = up.data_as<T>(), *go = dout.data_as<T>();
      T *dg = dgate.data_as<T>(), *du = dup.data_as<T>();
      for (int64_t i = 0; i < gate.numel(); ++i) {
        double slope;
        const double act = gelu_tanh(g[i], &slope);
        du[i] = static_cast<T>(go[i] * act);
        dg[i] = static_cast<T>(go[i] * u[i] * slope);
      }
    });
  }

  void softcap_forward(Stream, const Tensor& x, double cap, Tensor& y) override {
    require_compute(x, "softcap_forward");
    require_same(x, y, "softcap_forward");
    SPINDLE_CHECK(cap > 0 && x.numel() == y.numel(), "softcap_forward: cap {} x {} y {}", cap, x.describe(), y.describe());
    dispatch(x, [&](auto z) {
      using T = decltype(z);
      const T* in = x.data_as<T>();
      T* out = y.data_as<T>();
      for (int64_t i = 0; i < x.numel(); ++i) out[i] = static_cast<T>(cap * std::tanh(in[i] / cap));
    });
  }

  void softcap_backward(Stream, const Tensor& y, double cap, Tensor& d) override {
    require_compute(y, "softcap_backward");
    require_same(y, d, "softcap_backward");
    SPINDLE_CHECK(cap > 0 && y.numel() == d.numel(), "softcap_backward: cap {} y {} d {}", cap, y.describe(), d.describe());
    dispatch(y, [&](auto z) {
      using T = decltype(z);
      const T* capped = y.data_as<T>();
      T* grad = d.data_as<T>();
      for (int64_t i = 0; i < y.numel(); ++i) {
        const double t = capped[i] / cap;
        grad[i] = static_cast<T>(grad[i] * (1 - t * t));
      }
    });
  }

  void gather_rows(Stream, const Tensor& src, const Tensor& idx, Tensor& dst) override {
    require_i32(idx, "gather_rows");
    require_cpu(src, "gather_rows");
    SPINDLE_CHECK(src.dtype() == dst.dtype(), "gather_rows dtype");
    const int64_t n = idx.numel(), rows = src.dim(0), row_elems = rows ? src.numel() / rows : 0;
    SPINDLE_CHECK(dst.numel() == n * row_elems, "gather_rows: dst {} for {} rows of {}", dst.describe(), n,
                  src.describe());
    const size_t row_bytes = row_elems * dtype_size(src.dtype());
    const int32_t* ip = idx.data_as<int32_t>();
    for (int64_t r = 0; r < n; ++r) {
      SPINDLE_CHECK(ip[r] >= 0 && ip[r] < rows, "gather_rows index {} of {}", ip[r], rows);
      std::memcpy(static_cast<char*>(dst.data()) + r * row_bytes, static_cast<char*>(src.data()) + ip[r] * row_bytes,
                  row_bytes);
    }
  }

  void scatter_add_rows(Stream, const Tensor& src, const Tensor& idx, Tensor& dst) override {
    require_i32(idx, "scatter_add_rows");
    require_compute(src, "scatter_add_rows");
    require_same(src, dst, "scatter_add_rows");
    const int64_t n = idx.numel(), rows = dst.dim(0), row_elems = rows ? dst.numel() / rows : 0;
    SPINDLE_CHECK(src.numel() == n * row_elems, "scatter_add_rows shapes");
    const int32_t* ip = idx.data_as<int32_t>();
    dispatch(src, [&](auto z) {
      using T = decltype(z);
      const T* s = src.data_as<T>();
      T* d = dst.data_as<T>();
      for (int64_t r = 0; r < n; ++r) {
        SPINDLE_CHECK(ip[r] >= 0 && ip[r] < rows, "scatter_add_rows index {} of {}", ip[r], rows);
        for (int64_t e = 0; e < row_elems; ++e) d[ip[r] * row_elems + e] += s[r * row_elems + e];
      }
    });
  }

  // ---- gated attention and gated DeltaNet: backend/cpu/gated_delta_ops.cpp ----------------------
  void copy_columns(Stream, const Tensor& src, int64_t src_col, Tensor& dst, int64_t dst_col, int64_t width) override {
    cpu::copy_columns(src, src_col, dst, dst_col, width);
  }
  void rope_partial(Stream, Tensor& x, const Tensor& positions, const Tensor& inv_freq, int64_t rotary_dim,
                    double attention_scale, int sign) override {
    cpu::rope_partial(x, positions, inv_freq, rotary_dim, attention_scale, sign);
  }
  void sigmoid_gate_forward(Stream, const Tensor& x, const Tensor& gate, Tensor& out) override {
    cpu::sigmoid_gate_forward(x, gate, out);
  }
  void sigmoid_gate_backward(Stream, const Tensor& x, const Tensor& gate, const Tensor& dout, Tensor& dx,
                             Tensor& dgate) override {
    cpu::sigmoid_gate_backward(x, gate, dout, dx, dgate);
  }
  void causal_conv1d_silu_forward(Stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids, Tensor& y) override {
    cpu::causal_conv1d_silu_forward(x, w, doc_ids, y);
  }
  void causal_conv1d_silu_backward(Stream, const Tensor& x, const Tensor& w, const Tensor& doc_ids, const Tensor& dy,
                                   Tensor& dx, Tensor* dw) override {
    cpu::causal_conv1d_silu_backward(x, w, doc_ids, dy, dx, dw);
  }
  void l2norm_forward(Stream, const Tensor& x, double eps, Tensor& y, Tensor& rstd) override {
    cpu::l2norm_forward(x, eps, y, rstd);
  }
  void l2norm_backward(Stream, const Tensor& y, const Tensor& rstd, const Tensor& dy, Tensor& dx) override {
    cpu::l2norm_backward(y, rstd, dy, dx);
  }
  void deltanet_conv_split_forward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                   double eps, Tensor& q, Tensor& k, Tensor& v, Tensor& q_rstd,
                                   Tensor& k_rstd) override {
    deltanet_conv_split_forward_by_parts(*this, stream, qkv, w, doc_ids, eps, q, k, v, q_rstd, k_rstd);
  }
  void deltanet_conv_split_backward(Stream stream, const Tensor& qkv, const Tensor& w, const Tensor& doc_ids,
                                    const Tensor& q, const Tensor& k, const Tensor& q_rstd, const Tensor& k_rstd,
                                    const Tensor& dq, const Tensor& dk, const Tensor& dv, Tensor& d_qkv,
                                    Tensor* dw) override {
    deltanet_conv_split_backward_by_parts(*this, stream, qkv, w, doc_ids, q, k, q_rstd, k_rstd, dq, dk, dv, d_qkv, dw);
  }
  void gated_delta_gates_forward(Stream, const Tensor& a, const Tensor& b, const Tensor& a_log, const Tensor& dt_bias,
                                 Tensor& g, Tensor& beta) override {
    cpu::gated_delta_gates_forward(a, b, a_log, dt_bias, g, beta);
  }
  void gated_delta_gates_backward(Stream, const Tensor& a, const Tensor& beta, const Tensor& a_log,
                                  const Tensor& dt_bias, const Tensor& g, const Tensor& dg, const Tensor& dbeta,
                                  Tensor& da, Tensor& db, Tensor* da_log, Tensor* ddt_bias) override {
    cpu::gated_delta_gates_backward(a, beta, a_log, dt_bias, g, dg, dbeta, da, db, da_log, ddt_bias);
  }
  void gated_delta_rule_forward(Stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                const Tensor& beta, const Tensor& doc_ids, double scale, int64_t chunk_size,
                                Tensor& out) override {
    cpu::gated_delta_rule_forward(q, k, v, g, beta, doc_ids, scale, chunk_size, out);
  }
  void gated_delta_rule_backward(Stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                 const Tensor& beta, const Tensor& doc_ids, double scale, int64_t chunk_size,
                                 const Tensor& dout, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dg,
                                 Tensor& dbeta) override {
    cpu::gated_delta_rule_backward(q, k, v, g, beta, doc_ids, scale, chunk_size, dout, dq, dk, dv, dg, dbeta);
  }
  void gated_delta_rule_forward_states(Stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                       const Tensor& beta, const Tensor& run_ids, double scale, int64_t chunk_size,
                                       const Tensor& initial_states, Tensor& out, Tensor& final_states) override {
    cpu::gated_delta_rule_forward_states(q, k, v, g, beta, run_ids, scale, chunk_size, initial_states, out,
                                         final_states);
  }
  void gated_delta_rule_backward_states(Stream, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& g,
                                        const Tensor& beta, const Tensor& run_ids, double scale, int64_t chunk_size,
                                        const Tensor& initial_states, const Tensor& dout,
                                        const Tensor& d_final_states, Tensor& dq, Tensor& dk, Tensor& dv, Tensor& dg,
                                        Tensor& dbeta, Tensor& d_initial_states) override {
    cpu::gated_delta_rule_backward_states(q, k, v, g, beta, run_ids, scale, chunk_size, initial_states, dout,
                                          d_final_states, dq, dk, dv, dg, dbeta, d_initial_states);
  }
  void gated_rmsnorm_forward(Stream, const Tensor& x, const Tensor& z, const Tensor& w, double eps, Tensor& y,
                             Tensor& rstd) override {
    cpu::gated_rmsnorm_forward(x, z, w, eps, y, rstd);
  }
  void gated_rmsnorm_backward(Stream, const Tensor& x, const Tensor& z, const Tensor& w, const Tensor& rstd,
                              const Tensor& dy, Tensor& dx, Tensor& dz, Tensor* dw) override {
    cpu::gated_rmsnorm_backward(x, z, w, rstd, dy, dx, dz, dw);
  }

  // ---- mixture of experts: backend/cpu/moe_ops.cpp ---------------------------------------------
  void moe_router_forward(Stream, const Tensor& logits, int64_t top_k, bool normalize, Tensor& probs,
                          Tensor& topk_index, Tensor& topk_weight) override {
    cpu::moe_router_forward(logits, top_k, normalize, probs, topk_index, topk_weight);
  }
  void moe_router_backward(Stream, const Tensor& probs, const Tensor& topk_index, const Tensor& d_topk_weight,
                           bool normalize, const Tensor& aux_grad, const Tensor& token_doc, Tensor& dlogits) override {
    cpu::moe_router_backward(probs, topk_index, d_topk_weight, normalize, aux_grad, token_doc, dlogits);
  }
  void moe_router_statistics(Stream, const Tensor& probs, const Tensor& topk_index, const Tensor& token_doc,
                             Tensor& counts, Tensor& prob_sums) override {
    cpu::moe_router_statistics(probs, topk_index, token_doc, counts, prob_sums);
  }
  void moe_sigmoid_router_forward(Stream, const Tensor& logits, const Tensor& correction_bias,
                                  const SigmoidRouting& routing, Tensor& scores, Tensor& topk_index,
                                  Tensor& topk_weight) override {
    cpu::moe_sigmoid_router_forward(logits, correction_bias, routing, scores, topk_index, topk_weight);
  }
  void moe_sigmoid_router_backward(Stream, const Tensor& scores, const Tensor& topk_index, const Tensor& d_topk_weight,
                                   const SigmoidRouting& routing, Tensor& dlogits) override {
    cpu::moe_sigmoid_router_backward(scores, topk_index, d_topk_weight, routing, dlogits);
  }
  void moe_permute(Stream, const Tensor& topk_index, int64_t num_experts, Tensor& rows_token, Tensor& row_of_slot,
                   Tensor& offsets) override {
    cpu::moe_permute(topk_index, num_experts, rows_token, row_of_slot, offsets);
  }
  void moe_grouped_gemm(Stream, const Tensor& x, const std::vector<Tensor>& weights, bool transpose_weight,
                        const Tensor& offsets, Tensor& y, bool accumulate) override {
    cpu::moe_grouped_gemm(*this, x, weights, transpose_weight, offsets, y, accumulate);
  }
  void moe_grouped_gemm_weight_grad(Stream, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                                    std::vector<Tensor>& weight_grads) override {
    cpu::moe_grouped_gemm_weight_grad(*this, dy, x, offsets, weight_grads);
  }
  void moe_combine(Stream, const Tensor& y, const Tensor& row_of_slot, const Tensor& topk_index,
                   const Tensor& topk_weight, Tensor& out) override {
    cpu::moe_combine(y, row_of_slot, topk_index, topk_weight, out);
  }
  void moe_combine_backward(Stream, const Tensor& dout, const Tensor& y, const Tensor& row_of_slot,
                            const Tensor& topk_weight, Tensor& dy, Tensor& d_topk_weight) override {
    cpu::moe_combine_backward(dout, y, row_of_slot, topk_weight, dy, d_topk_weight);
  }
  void clamped_swiglu_forward(Stream, const Tensor& gate_up, double alpha, double limit, Tensor& out) override {
    cpu::clamped_swiglu_forward(gate_up, alpha, limit, out);
  }
  void clamped_swiglu_backward(Stream, const Tensor& gate_up, const Tensor& dout, double alpha, double limit,
                               Tensor& d_gate_up) override {
    cpu::clamped_swiglu_backward(gate_up, dout, alpha, limit, d_gate_up);
  }
  // A shared expert's sigmoid gate: backend/cpu/shared_expert_ops.cpp
  void shared_expert_gate_forward(Stream, const Tensor& shared, const Tensor& gate, Tensor& out) override {
    cpu::shared_expert_gate_forward(shared, gate, out);
  }
  void shared_expert_gate_backward(Stream, const Tensor& shared, const Tensor& gate, const Tensor& dout,
                                   Tensor& d_shared, Tensor& d_gate) override {
    cpu::shared_expert_gate_backward(shared, gate, dout, d_shared, d_gate);
  }

  void cross_entropy(Stream, Tensor& logits, const Tensor& targets, const Tensor& weights, double loss_scale,
                     double grad_scale, Tensor& loss_sum, Tensor& token_ce) override {
    require_compute(logits, "cross_entropy");
    require_i32(targets, "cross_entropy");
    require_cpu(weights, "cross_entropy");
    SPINDLE_CHECK(logits.rank() == 2 && targets.numel() == logits.dim(0) && weights.numel() == logits.dim(0),
                  "cross_entropy: logits {} targets {} weights {}", logits.describe(), targets.describe(),
                  weights.describe());
    const int64_t n = logits.dim(0), vocab = logits.dim(1);
    const int32_t* tgt = targets.data_as<int32_t>();
    double total = 0;
    dispatch(logits, [&](auto z) {
      using T = decltype(z);
      T* lg = logits.data_as<T>();
#pragma omp parallel for reduction(+ : total) if (n > 8)
      for (int64_t r = 0; r < n; ++r) {
        T* row = lg + r * vocab;
        const int32_t t = tgt[r];
        SPINDLE_CHECK(t >= 0 && t < vocab, "cross_entropy target {} outside vocab {}", t, vocab);
        double mx = -std::numeric_limits<double>::infinity();
        for (int64_t j = 0; j < vocab; ++j) mx = std::max(mx, static_cast<double>(row[j]));
        double sum = 0;
        for (int64_t j = 0; j < vocab; ++j) sum += std::exp(row[j] - mx);
        const double lse_r = mx + std::log(sum);
        const double ce = lse_r - row[t];
        const double w = load_any(weights, r);
        total += w * ce;
        if (token_ce.defined()) write_stat(token_ce, r, ce);
        const double g = grad_scale * w;
        for (int64_t j = 0; j < vocab; ++j) row[j] = static_cast<T>(g * std::exp(row[j] - lse_r));
        row[t] = static_cast<T>(row[t] - g);
      }
    });
    write_stat(loss_sum, 0, read_stat(loss_sum, 0) + total * loss_scale);
  }

  // ---- 4-bit weights: backend/cpu/quant4_ops.cpp ---------------------------------------------------
  void dequantize_4bit(Stream, const Tensor& packed, const Tensor& absmax, int64_t blocksize, Quant4Type type,
                       Tensor& w) override {
    cpu::dequantize_4bit(packed, absmax, blocksize, type, w);
  }
  void dequantize_absmax(Stream, const Tensor& codes, const Tensor& code_map, const Tensor& absmax2,
                         int64_t blocksize2, double offset, Tensor& absmax) override {
    cpu::dequantize_absmax(codes, code_map, absmax2, blocksize2, offset, absmax);
  }
  void quantize_4bit(Stream, const Tensor& w, int64_t blocksize, Quant4Type type, Tensor& packed,
                     Tensor& absmax) override {
    cpu::quantize_4bit(w, blocksize, type, packed, absmax);
  }
  void quantize_absmax(Stream, const Tensor& absmax, const Tensor& code_map, double offset, int64_t blocksize2,
                       Tensor& codes, Tensor& absmax2) override {
    cpu::quantize_absmax(absmax, code_map, offset, blocksize2, codes, absmax2);
  }

  void adamw_step(Stream, Tensor& param, const Tensor& grad, Tensor& m, Tensor& v, const AdamW& hp) override {
    require_compute(param, "adamw_step");
    for (const Tensor* t : std::initializer_list<const Tensor*>{&grad, &m, &v}) require_same(param, *t, "adamw_step");
    const double bc1 = 1.0 - std::pow(hp.beta1, static_cast<double>(hp.step));
    const double bc2 = 1.0 - std::pow(hp.beta2, static_cast<double>(hp.step));
    dispatch(param, [&](auto z) {
      using T = decltype(z);
      T *p = param.data_as<T>(), *mp = m.data_as<T>(), *vp = v.data_as<T>();
      const T* g = grad.data_as<T>();
      const int64_t n = param.numel();
      for (int64_t i = 0; i < n; ++i) {
        const double gi = g[i] * hp.grad_scale;
        double pi = p[i] * (1.0 - hp.lr * hp.weight_decay);
        const double mi = hp.beta1 * mp[i] + (1.0 - hp.beta1) * gi;
        const double vi = hp.beta2 * vp[i] + (1.0 - hp.beta2) * gi * gi;
        pi -= (hp.lr / bc1) * mi / (std::sqrt(vi) / std::sqrt(bc2) + hp.eps);
        p[i] = static_cast<T>(pi);
        mp[i] = static_cast<T>(mi);
        vp[i] = static_cast<T>(vi);
      }
    });
  }

 private:
  cpu::OffloadCopies offload_copies_;  // activation offload's copy time (backend/cpu/host_memory.h)
};

}  // namespace

GemmShape gemm_shape(const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, const Tensor& c) {
  SPINDLE_CHECK(a.rank() == 2 && b.rank() == 2 && c.rank() == 2, "gemm wants 2-D tensors: {} {} {}", a.describe(),
                b.describe(), c.describe());
  const int64_t m = trans_a ? a.dim(1) : a.dim(0), k = trans_a ? a.dim(0) : a.dim(1);
  const int64_t kb = trans_b ? b.dim(1) : b.dim(0), n = trans_b ? b.dim(0) : b.dim(1);
  SPINDLE_CHECK(k == kb && c.dim(0) == m && c.dim(1) == n, "gemm shapes: op(A) {}x{}, op(B) {}x{}, C {}", m, k, kb,
                n, c.shape().str());
  return {m, n, k};
}

std::unique_ptr<Backend> make_cpu_backend(int threads) { return std::make_unique<CpuBackend>(threads); }

}  // namespace spindle
