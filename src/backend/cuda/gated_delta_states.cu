// The gated delta rule with entering and leaving states (gated_delta_states.h), token by token:
//   S_t = a_t·(S_{t−1} − β_t·k_t·u_tᵀ) + β_t·k_t·v_tᵀ,   u_t = S_{t−1}ᵀ·k_t,   a_t = exp(g_t),
//   out_t = scale·S_tᵀ·q_t,
// per value head h (key head h / (Hv/Hk)) and run n, S starting at initial[n, h] and left in
// finals[n, h]. This is the recurrence the chunked kernels (gated_delta.cu) reorganise into
// triangular solves; run token by token it is the same result up to F32 rounding (the CPU
// reference, which computes in chunks at double precision, checks it). Sequence parallelism over a
// ring passes the state of a document's piece from rank to rank through these, a few calls per
// DeltaNet layer and step, so they were written to be simple and exact first: one block per (value
// head, run), the state S [dk, dv] in F32 shared memory, three block barriers per token. A long run
// is a chain of dependent token steps (latency, about a microsecond each), not FLOPs; docs/perf.md
// has what it costs.
//
// Backward, per token in reverse, with dS = ∂L/∂S_t (starting from d_final[n, h]):
//   dS += scale·q_t·dout_tᵀ,  dq_t = scale·S_t·dout_t,  z = dSᵀ·k_t,  dv_t = β·z,
//   dk_t = β·(dS·v_t − a·(dS·u_t + S_{t−1}·z)),  dβ_t = ⟨z, v_t⟩ − a·⟨z, u_t⟩,
//   dg_t = a·(⟨dS, S_{t−1}⟩ − β·⟨z, u_t⟩),  then dS ← a·(dS − β·k_t·zᵀ) = ∂L/∂S_{t−1}.
// It needs S_{t−1} and S_t: a first pass saves the state entering every segment of kSegment tokens
// (device scratch, [Hv, segments, dk, dv]); each segment, last first, is recomputed from its saved
// state into a per-block buffer of kSegment + 1 states, then walked in reverse. dq and dk are formed
// per value head (F32) and summed over the value heads that share a key head afterwards, in head
// order. Every sum has a fixed order: the results are deterministic.
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/gated_delta_states.h"

namespace spindle::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSegment = 64;      // tokens between the states the backward saves
constexpr int kMaxRunBlocks = 4;  // blocks per value head, each taking every kMaxRunBlocks-th run

struct Geometry {
  int64_t tokens;
  int hk, hv, dk, dv, group;
  int64_t runs;
  int64_t segments_cap;  // per head: a bound on Σ_n ceil(len_n / kSegment)
};

// Run n covers tokens [begin[n], end[n]); its saved states start at segment seg_base[n].
struct RunTable {
  int64_t* begin;
  int64_t* end;
  int64_t* seg_base;
};

// One thread walks run_ids (a few microseconds per thousand tokens, far below the recurrence).
__global__ void run_table_kernel(const int32_t* run_ids, int64_t tokens, int64_t runs, RunTable table,
                                 DeviceError* err) {
  if (threadIdx.x != 0 || blockIdx.x != 0) return;
  int64_t n = 0, segments = 0;
  for (int64_t t = 0; t < tokens; ++t) {
    if (t > 0 && run_ids[t] == run_ids[t - 1]) continue;
    if (n < runs) {
      table.begin[n] = t;
      if (n > 0) table.end[n - 1] = t;
    }
    ++n;
  }
  if (n != runs) {
    if (atomicCAS(&err->code, 0, kErrRunCount) == 0) {
      err->index = 0;
      err->value = n;
      err->limit = runs;
      __threadfence_system();
    }
    for (int64_t m = 0; m < runs; ++m) table.begin[m] = table.end[m] = 0;  // every run empty: nothing is read
  } else if (runs > 0) {
    table.end[runs - 1] = tokens;
  }
  for (int64_t m = 0; m < runs; ++m) {
    table.seg_base[m] = segments;
    segments += (table.end[m] - table.begin[m] + kSegment - 1) / kSegment;
  }
}

// Shared memory of one block. A matrix row has dv + 1 floats (the column passes read across a
// row with consecutive threads; the row passes read along it).
struct Smem {
  float* q[2];  // [dk] token vectors, double-buffered by token parity so that the next token's
  float* k[2];  // loads do not wait for this token's last pass
  float* v[2];  // [dv]
  float* d[2];  // [dv] dout (backward)
  float* u;     // [dv] S_{t−1}ᵀ·k
  float* z;     // [dv] dSᵀ·k (backward)
  float* zv;    // [dv] z ∘ v (backward)
  float* zu;    // [dv] z ∘ u (backward)
  float* rows;  // [dk] per-row ⟨dS, S_{t−1}⟩ (backward)
  float* S;     // [dk, dv + 1] the running state (S_{t−1} in the backward's reverse walk)
  float* dS;    // [dk, dv + 1] backward only
};

size_t smem_bytes(int dk, int dv, bool backward) {
  const size_t vectors = 2 * (2 * static_cast<size_t>(dk) + 2 * dv) + 4 * static_cast<size_t>(dv) + dk;
  const size_t matrix = static_cast<size_t>(dk) * (dv + 1);
  return sizeof(float) * (vectors + (backward ? 2 : 1) * matrix);
}

__device__ Smem carve(float* base, int dk, int dv, bool backward) {
  Smem m;
  float* p = base;
  for (int i = 0; i < 2; ++i) {
    m.q[i] = p, p += dk;
    m.k[i] = p, p += dk;
    m.v[i] = p, p += dv;
    m.d[i] = p, p += dv;
  }
  m.u = p, p += dv;
  m.z = p, p += dv;
  m.zv = p, p += dv;
  m.zu = p, p += dv;
  m.rows = p, p += dk;
  m.S = p, p += static_cast<int64_t>(dk) * (dv + 1);
  m.dS = backward ? p : nullptr;
  return m;
}

// Token t's k, v (and q, dout when given) into buffer `b`, its a = exp(g) and β into gate[b].
// All threads; the caller synchronises.
template <typename T>
__device__ void load_token(const Geometry& ge, const Smem& m, int b, int64_t t, int h, const T* q, const T* k,
                           const T* v, const T* dout, const float* g, const T* beta, float (*gate)[2]) {
  const int kh = h / ge.group;
  const T* kr = k + (t * ge.hk + kh) * ge.dk;
  for (int x = threadIdx.x; x < ge.dk; x += blockDim.x) {
    m.k[b][x] = to_f32(kr[x]);
    if (q) m.q[b][x] = to_f32(q[(t * ge.hk + kh) * ge.dk + x]);
  }
  const int64_t row = (t * ge.hv + h) * ge.dv;
  for (int x = threadIdx.x; x < ge.dv; x += blockDim.x) {
    m.v[b][x] = to_f32(v[row + x]);
    if (dout) m.d[b][x] = to_f32(dout[row + x]);
  }
  if (threadIdx.x == 0) {
    gate[b][0] = expf(g[t * ge.hv + h]);
    gate[b][1] = to_f32(beta[t * ge.hv + h]);
  }
}

// One token of the recurrence on m.S, its vectors in buffer b (loaded and synchronised): u, then
// S ← a·(S − β·k·uᵀ) + β·k·vᵀ. Ends synchronised.
__device__ void advance(const Geometry& ge, const Smem& m, int b, float (*gate)[2]) {
  const int dk = ge.dk, dv = ge.dv, ld = dv + 1;
  const float* ks = m.k[b];
  for (int c = threadIdx.x; c < dv; c += blockDim.x) {
    float acc = 0.f;
    for (int r = 0; r < dk; ++r) acc = fmaf(ks[r], m.S[r * ld + c], acc);
    m.u[c] = acc;
  }
  __syncthreads();
  const float a = gate[b][0], beta = gate[b][1];
  const float* vs = m.v[b];
  for (int x = threadIdx.x; x < dk * dv; x += blockDim.x) {
    const int r = x / dv, c = x % dv;
    float& s = m.S[r * ld + c];
    s = a * (s - beta * ks[r] * m.u[c]) + beta * ks[r] * vs[c];
  }
  __syncthreads();
}

// dst [dk, dv] (dense, global) ← src [dk, dv + 1] (shared), or the other way. All threads.
__device__ void store_state(float* dst, const float* src, int dk, int dv) {
  for (int x = threadIdx.x; x < dk * dv; x += blockDim.x) dst[x] = src[(x / dv) * (dv + 1) + x % dv];
}
__device__ void load_state(float* dst, const float* src, int dk, int dv) {
  for (int x = threadIdx.x; x < dk * dv; x += blockDim.x) dst[(x / dv) * (dv + 1) + x % dv] = src[x];
}

// Block (h, p): value head h, runs p, p + gridDim.y, ...
template <typename T>
__global__ void __launch_bounds__(kThreads)
    states_forward_kernel(Geometry ge, const T* q, const T* k, const T* v, const float* g, const T* beta,
                          RunTable runs, float scale, const float* initial, T* out, float* finals) {
  extern __shared__ float smem[];
  __shared__ float gate[2][2];
  const Smem m = carve(smem, ge.dk, ge.dv, false);
  const int h = blockIdx.x, dk = ge.dk, dv = ge.dv, ld = dv + 1;
  const int64_t state = static_cast<int64_t>(dk) * dv;
  for (int64_t n = blockIdx.y; n < ge.runs; n += gridDim.y) {
    const int64_t at = (n * ge.hv + h) * state;
    load_state(m.S, initial + at, dk, dv);
    for (int64_t t = runs.begin[n]; t < runs.end[n]; ++t) {
      const int b = static_cast<int>(t & 1);
      load_token(ge, m, b, t, h, q, k, v, static_cast<const T*>(nullptr), g, beta, gate);
      __syncthreads();
      advance(ge, m, b, gate);
      const float* qs = m.q[b];
      for (int c = threadIdx.x; c < dv; c += blockDim.x) {
        float acc = 0.f;
        for (int r = 0; r < dk; ++r) acc = fmaf(qs[r], m.S[r * ld + c], acc);
        out[(t * ge.hv + h) * dv + c] = from_f32<T>(scale * acc);
      }
    }
    __syncthreads();  // the last output pass has read S
    store_state(finals + at, m.S, dk, dv);
    __syncthreads();  // before the next run loads S
  }
}

// Block (h, p) as the forward. ckpt: [Hv, segments_cap, dk, dv]; segbuf: per block
// [kSegment + 1, dk, dv]; dq_h, dk_h F32 [T, Hv, dk] (per value head).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    states_backward_kernel(Geometry ge, const T* q, const T* k, const T* v, const float* g, const T* beta,
                           RunTable runs, float scale, const float* initial, const T* dout, const float* d_final,
                           float* ckpt, float* segbuf, float* dq_h, float* dk_h, T* dv_out, float* dg, T* dbeta,
                           float* d_initial) {
  extern __shared__ float smem[];
  __shared__ float gate[2][2];
  const Smem m = carve(smem, ge.dk, ge.dv, true);
  const int h = blockIdx.x, dk = ge.dk, dv = ge.dv, ld = dv + 1;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t state = static_cast<int64_t>(dk) * dv;
  float* saved = ckpt + static_cast<int64_t>(h) * ge.segments_cap * state;
  float* seg = segbuf + (static_cast<int64_t>(blockIdx.y) * ge.hv + h) * (kSegment + 1) * state;
  const T* no_q = nullptr;
  for (int64_t n = blockIdx.y; n < ge.runs; n += gridDim.y) {
    const int64_t at = (n * ge.hv + h) * state, begin = runs.begin[n], end = runs.end[n];
    float* run_saved = saved + runs.seg_base[n] * state;
    // The state entering every segment of the run.
    load_state(m.S, initial + at, dk, dv);
    __syncthreads();
    for (int64_t t = begin; t < end; ++t) {
      if ((t - begin) % kSegment == 0) store_state(run_saved + ((t - begin) / kSegment) * state, m.S, dk, dv);
      const int b = static_cast<int>(t & 1);
      load_token(ge, m, b, t, h, no_q, k, v, no_q, g, beta, gate);
      __syncthreads();
      advance(ge, m, b, gate);
    }
    load_state(m.dS, d_final + at, dk, dv);
    const int64_t segments = (end - begin + kSegment - 1) / kSegment;
    for (int64_t sgi = segments - 1; sgi >= 0; --sgi) {
      const int64_t s0 = begin + sgi * kSegment, s1 = s0 + kSegment < end ? s0 + kSegment : end;
      // seg[i] = the state after token s0 − 1 + i (seg[0]: entering the segment).
      load_state(m.S, run_saved + sgi * state, dk, dv);
      store_state(seg, m.S, dk, dv);  // reads what this thread just wrote: no barrier needed between
      __syncthreads();
      for (int64_t t = s0; t < s1; ++t) {
        const int b = static_cast<int>(t & 1);
        load_token(ge, m, b, t, h, no_q, k, v, no_q, g, beta, gate);
        __syncthreads();
        advance(ge, m, b, gate);
        store_state(seg + (t - s0 + 1) * state, m.S, dk, dv);
      }
      __syncthreads();  // seg fully written before it is read across threads
      for (int64_t t = s1 - 1; t >= s0; --t) {
        const int b = static_cast<int>(t & 1);
        const float* after = seg + (t - s0 + 1) * state;  // S_t
        load_token(ge, m, b, t, h, q, k, v, dout, g, beta, gate);
        load_state(m.S, seg + (t - s0) * state, dk, dv);  // S_{t−1}
        __syncthreads();
        const float a = gate[b][0], bt = gate[b][1];
        const float *qs = m.q[b], *ks = m.k[b], *vs = m.v[b], *ds = m.d[b];
        for (int x = threadIdx.x; x < dk * dv; x += blockDim.x) {
          const int r = x / dv, c = x % dv;
          m.dS[r * ld + c] = fmaf(scale * qs[r], ds[c], m.dS[r * ld + c]);
        }
        __syncthreads();
        for (int c = threadIdx.x; c < dv; c += blockDim.x) {
          float zc = 0.f, uc = 0.f;
          for (int r = 0; r < dk; ++r) {
            zc = fmaf(ks[r], m.dS[r * ld + c], zc);
            uc = fmaf(ks[r], m.S[r * ld + c], uc);
          }
          m.z[c] = zc;
          m.u[c] = uc;
          m.zv[c] = zc * vs[c];
          m.zu[c] = zc * uc;
          dv_out[(t * ge.hv + h) * dv + c] = from_f32<T>(bt * zc);
        }
        __syncthreads();
        for (int r = warp; r < dk; r += kWarps) {
          float dq_acc = 0.f, dsv = 0.f, dsu = 0.f, sz = 0.f, dss = 0.f;
          for (int c = lane; c < dv; c += 32) {
            const float d_rc = m.dS[r * ld + c], s_rc = m.S[r * ld + c];
            dq_acc = fmaf(after[r * dv + c], ds[c], dq_acc);
            dsv = fmaf(d_rc, vs[c], dsv);
            dsu = fmaf(d_rc, m.u[c], dsu);
            sz = fmaf(s_rc, m.z[c], sz);
            dss = fmaf(d_rc, s_rc, dss);
          }
          dq_acc = warp_sum(dq_acc);
          dsv = warp_sum(dsv);
          dsu = warp_sum(dsu);
          sz = warp_sum(sz);
          dss = warp_sum(dss);
          if (lane == 0) {
            const int64_t i = (t * ge.hv + h) * dk + r;
            dq_h[i] = scale * dq_acc;
            dk_h[i] = bt * (dsv - a * (dsu + sz));
            m.rows[r] = dss;
          }
        }
        __syncthreads();
        if (warp == 0) {
          float e = 0.f, zv = 0.f, zu = 0.f;
          for (int r = lane; r < dk; r += 32) e += m.rows[r];
          for (int c = lane; c < dv; c += 32) {
            zv += m.zv[c];
            zu += m.zu[c];
          }
          e = warp_sum(e);
          zv = warp_sum(zv);
          zu = warp_sum(zu);
          if (lane == 0) {
            dbeta[t * ge.hv + h] = from_f32<T>(zv - a * zu);
            dg[t * ge.hv + h] = a * (e - bt * zu);
          }
        }
        for (int x = threadIdx.x; x < dk * dv; x += blockDim.x) {
          const int r = x / dv, c = x % dv;
          m.dS[r * ld + c] = a * (m.dS[r * ld + c] - bt * ks[r] * m.z[c]);
        }
        __syncthreads();
      }
    }
    store_state(d_initial + at, m.dS, dk, dv);
    __syncthreads();  // before the next run reloads S and dS
  }
}

// dq [T, Hk, dk] (io) = Σ over the group's value heads of dq_h [T, Hv, dk], in head order; dk alike.
template <typename T>
__global__ void sum_group_kernel(const float* dq_h, const float* dk_h, int64_t tokens, int hk, int group, int dk,
                                 T* dq, T* dk_out) {
  const int64_t n = tokens * hk * dk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i % dk, kh = (i / dk) % hk, t = i / (static_cast<int64_t>(dk) * hk);
    float sq = 0.f, sk = 0.f;
    for (int j = 0; j < group; ++j) {
      const int64_t src = (t * hk * group + kh * group + j) * dk + e;
      sq += dq_h[src];
      sk += dk_h[src];
    }
    dq[i] = from_f32<T>(sq);
    dk_out[i] = from_f32<T>(sk);
  }
}

Geometry geometry(const DeltaStatesShape& sh) {
  const int64_t segments_cap = (sh.tokens + kSegment - 1) / kSegment + sh.runs;
  return {sh.tokens, sh.key_heads, sh.value_heads, sh.dk, sh.dv, sh.value_heads / sh.key_heads, sh.runs, segments_cap};
}

void check_shape(const DeltaStatesShape& sh, const char* op) {
  if (sh.key_heads < 1 || sh.value_heads % sh.key_heads != 0)
    throw_message(op, "value heads not a multiple of key heads");
  if (sh.dk < 1 || sh.dv < 1 || sh.dk > 128 || sh.dv > 128) throw_message(op, "head dims must be 1 … 128");
}

// The run table in `scratch` (3·N int64), filled on the device.
RunTable make_run_table(cudaStream_t s, const int32_t* run_ids, const DeltaStatesShape& sh, int64_t* scratch,
                        DeviceError* err) {
  RunTable table{scratch, scratch + sh.runs, scratch + 2 * sh.runs};
  run_table_kernel<<<1, 32, 0, s>>>(run_ids, sh.tokens, sh.runs, table, err);
  CUDA_CHECK_LAUNCH();
  return table;
}

template <typename Kernel>
void allow_shared(Kernel kernel, size_t bytes) {
  CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes)));
}

dim3 grid_of(const DeltaStatesShape& sh) {
  return dim3(static_cast<unsigned>(sh.value_heads),
              static_cast<unsigned>(sh.runs < kMaxRunBlocks ? sh.runs : kMaxRunBlocks));
}

}  // namespace

void gated_delta_rule_forward_states(cudaStream_t s, const DeltaStatesShape& sh, DType io, const void* q,
                                     const void* k, const void* v, const float* g, const void* beta,
                                     const int32_t* run_ids, float scale, const float* initial, void* out,
                                     float* finals, DeviceError* err) {
  const char* op = "gated_delta_rule_forward_states";
  check_shape(sh, op);
  if (sh.runs == 0) return;  // no tokens
  Scratch table_bytes(s, 3 * static_cast<size_t>(sh.runs) * sizeof(int64_t));
  const RunTable runs = make_run_table(s, run_ids, sh, table_bytes.as<int64_t>(), err);
  const Geometry ge = geometry(sh);
  const size_t shared = smem_bytes(sh.dk, sh.dv, false);
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    allow_shared(states_forward_kernel<T>, shared);
    states_forward_kernel<T><<<grid_of(sh), kThreads, shared, s>>>(
        ge, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), g,
        static_cast<const T*>(beta), runs, scale, initial, static_cast<T*>(out), finals);
    CUDA_CHECK_LAUNCH();
  });
}

void gated_delta_rule_backward_states(cudaStream_t s, const DeltaStatesShape& sh, DType io, const void* q,
                                      const void* k, const void* v, const float* g, const void* beta,
                                      const int32_t* run_ids, float scale, const float* initial, const void* dout,
                                      const float* d_final, void* dq, void* dk, void* dv, float* dg, void* dbeta,
                                      float* d_initial, DeviceError* err) {
  const char* op = "gated_delta_rule_backward_states";
  check_shape(sh, op);
  if (sh.runs == 0) return;
  Scratch table_bytes(s, 3 * static_cast<size_t>(sh.runs) * sizeof(int64_t));
  const RunTable runs = make_run_table(s, run_ids, sh, table_bytes.as<int64_t>(), err);
  const Geometry ge = geometry(sh);
  const dim3 grid = grid_of(sh);
  const size_t state = static_cast<size_t>(sh.dk) * sh.dv * sizeof(float);
  // [Hv, segments, dk, dv] saved states; [blocks, kSegment + 1, dk, dv] recomputed segments;
  // dq, dk per value head [T, Hv, dk] each.
  Scratch saved(s, static_cast<size_t>(sh.value_heads) * static_cast<size_t>(ge.segments_cap) * state);
  Scratch segments(s, static_cast<size_t>(grid.x) * grid.y * (kSegment + 1) * state);
  const size_t per_head = static_cast<size_t>(sh.tokens) * sh.value_heads * sh.dk * sizeof(float);
  Scratch dq_h(s, per_head), dk_h(s, per_head);
  const size_t shared = smem_bytes(sh.dk, sh.dv, true);
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    allow_shared(states_backward_kernel<T>, shared);
    states_backward_kernel<T><<<grid, kThreads, shared, s>>>(
        ge, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), g,
        static_cast<const T*>(beta), runs, scale, initial, static_cast<const T*>(dout), d_final, saved.as<float>(),
        segments.as<float>(), dq_h.as<float>(), dk_h.as<float>(), static_cast<T*>(dv), dg, static_cast<T*>(dbeta),
        d_initial);
    CUDA_CHECK_LAUNCH();
    const int64_t n = sh.tokens * sh.key_heads * sh.dk;
    sum_group_kernel<T><<<grid_for(n, 256), 256, 0, s>>>(dq_h.as<float>(), dk_h.as<float>(), sh.tokens, sh.key_heads,
                                                         ge.group, sh.dk, static_cast<T*>(dq), static_cast<T*>(dk));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
