// The gated delta rule with entering and leaving states (gated_delta_states.h), token by token:
//   S_t = a_t·(S_{t−1} − β_t·k_t·u_tᵀ) + β_t·k_t·v_tᵀ,   u_t = S_{t−1}ᵀ·k_t,   a_t = exp(g_t),
//   out_t = scale·S_tᵀ·q_t,
// per value head h (key head h / (Hv/Hk)) and run n, S starting at initial[n, h] and left in
// finals[n, h]. This is the recurrence the chunked kernels (gated_delta.cu) reorganise into
// triangular solves; run token by token it is the same result up to F32 rounding (the CPU
// reference, which computes in chunks at double precision, checks it). Sequence parallelism over a
// ring passes the state of a document's piece from rank to rank through these, a few calls per
// DeltaNet layer and step.
//
// Every column of S evolves on its own given k, v and the gates (u_t and out_t are per column), so
// a block owns one value head, 32 columns of its state (a slice) and a run: grid (Hv, ⌈dv/32⌉,
// blocks over runs). Its 256 threads hold the slice in registers: lane l owns column c0 + l, warp w
// rows w, w + 8, ... The column sums over rows (u, out, and the backward's z) go through shared
// memory across the 8 warps; the backward's row sums over columns (dq, dk) are warp sums, partial per
// slice. Token vectors are staged kTile tokens at a time, so a token step costs two block barriers
// and no global-memory wait. A long run is still a chain of dependent token steps (latency, not
// FLOPs); docs/perf.md has what it costs.
//
// Backward, per token in reverse, with dS = ∂L/∂S_t (starting from d_final[n, h]):
//   dS += scale·q_t·dout_tᵀ,  dq_t = scale·S_t·dout_t,  z = dSᵀ·k_t,  dv_t = β·z,
//   dk_t = β·(dS·v_t − a·(dS·u_t + S_{t−1}·z)),  dβ_t = ⟨z, v_t⟩ − a·⟨z, u_t⟩,
//   dg_t = a·(⟨dS, S_{t−1}⟩ − β·⟨z, u_t⟩),  then dS ← a·(dS − β·k_t·zᵀ) = ∂L/∂S_{t−1}.
// It needs S_{t−1} and S_t: a first pass saves the state entering every segment of kSegment tokens
// (device scratch, [Hv, segments, dk, dv] in slices); each segment, last first, is recomputed from
// its saved state into a per-block buffer of kSegment + 1 slice states (each thread reads back only
// what it wrote), then walked in reverse. dq and dk are summed over the slices and over the value
// heads that share a key head afterwards, dβ and dg over the slices, always in the same order: the
// results are deterministic.
#include "backend/cuda/device_util.cuh"
#include "backend/cuda/gated_delta_states.h"

namespace spindle::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kSlice = 32;                 // state columns per block: one per lane
constexpr int kMaxRows = 128 / kWarps;     // state rows per thread (dk ≤ 128)
constexpr int kTile = 32;                  // tokens staged in shared memory at a time
constexpr int kSegment = 64;               // tokens between the states the backward saves (a multiple of kTile)
constexpr int kMaxRunBlocks = 4;           // blocks per (head, slice), each taking every 4th run
constexpr int kGateParts = 3;              // per slice: ⟨z, v⟩, ⟨z, u⟩, ⟨dS, S_{t−1}⟩

struct Geometry {
  int64_t tokens;
  int hk, hv, dk, dv, group, slices;
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

// Shared memory of a block: kTile tokens' vectors and the reduction buffers.
struct Tile {
  float* q;     // [kTile, dk]
  float* k;     // [kTile, dk]
  float* v;     // [kTile, kSlice] this slice's columns (0 past dv)
  float* d;     // [kTile, kSlice] dout's (backward)
  float* a;     // [kTile] exp(g)
  float* beta;  // [kTile]
  float* red;   // [2, kWarps, kSlice] per-warp column partials
  float* part;  // [kWarps] per-warp scalar partials
};

size_t tile_bytes(int dk) {
  return sizeof(float) * (static_cast<size_t>(kTile) * (2 * dk + 2 * kSlice + 2) + 2 * kWarps * kSlice + kWarps);
}

__device__ Tile carve(float* p, int dk) {
  Tile s;
  s.q = p, p += kTile * dk;
  s.k = p, p += kTile * dk;
  s.v = p, p += kTile * kSlice;
  s.d = p, p += kTile * kSlice;
  s.a = p, p += kTile;
  s.beta = p, p += kTile;
  s.red = p, p += 2 * kWarps * kSlice;
  s.part = p;
  return s;
}

// Tokens [t0, t0 + n) into the tile (q and dout when given). All threads; the caller synchronises
// before (the previous tile is read) and after.
template <typename T>
__device__ void load_tile(const Geometry& ge, const Tile& s, int64_t t0, int n, int h, int c0, const T* q,
                          const T* k, const T* v, const T* dout, const float* g, const T* beta) {
  const int kh = h / ge.group, dk = ge.dk;
  for (int x = threadIdx.x; x < n * dk; x += blockDim.x) {
    const int i = x / dk, r = x % dk;
    const int64_t at = ((t0 + i) * ge.hk + kh) * dk + r;
    s.k[i * dk + r] = to_f32(k[at]);
    if (q) s.q[i * dk + r] = to_f32(q[at]);
  }
  for (int x = threadIdx.x; x < n * kSlice; x += blockDim.x) {
    const int i = x / kSlice, l = x % kSlice, c = c0 + l;
    const int64_t at = ((t0 + i) * ge.hv + h) * ge.dv + c;
    s.v[x] = c < ge.dv ? to_f32(v[at]) : 0.f;
    if (dout) s.d[x] = c < ge.dv ? to_f32(dout[at]) : 0.f;
  }
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    s.a[i] = expf(g[(t0 + i) * ge.hv + h]);
    s.beta[i] = to_f32(beta[(t0 + i) * ge.hv + h]);
  }
}

// The thread's place in the slice: lane → column c0 + lane, warp → rows warp + kWarps·i.
struct Place {
  int warp, lane, c0, col, rows;
  bool col_ok;
};

__device__ Place place(const Geometry& ge) {
  Place p;
  p.warp = threadIdx.x >> 5;
  p.lane = threadIdx.x & 31;
  p.c0 = blockIdx.y * kSlice;
  p.col = p.c0 + p.lane;
  p.col_ok = p.col < ge.dv;
  p.rows = p.warp < ge.dk ? (ge.dk - p.warp + kWarps - 1) / kWarps : 0;
  return p;
}

// Σ over the block's warps of one value per (warp, lane): every thread gets its lane's sum. `buf`
// one of the two [kWarps, kSlice] buffers. Contains one barrier.
__device__ float column_sum(float* buf, const Place& p, float mine) {
  buf[p.warp * kSlice + p.lane] = mine;
  __syncthreads();
  float total = 0.f;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) total += buf[w * kSlice + p.lane];
  return total;
}

// One token of the recurrence on the registers S: S ← a·(S − β·k·uᵀ) + β·k·vᵀ, u = Sᵀ·k.
__device__ void advance(float (&S)[kMaxRows], const Tile& s, const Place& p, int i, int dk) {
  const float* k = s.k + i * dk;
  float partial = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j)
    if (j < p.rows) partial = fmaf(k[p.warp + kWarps * j], S[j], partial);
  const float u = column_sum(s.red, p, partial);
  const float a = s.a[i], beta = s.beta[i], v = s.v[i * kSlice + p.lane];
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j)
    if (j < p.rows) {
      const float kr = k[p.warp + kWarps * j];
      S[j] = a * (S[j] - beta * kr * u) + beta * kr * v;
    }
}

__device__ void load_slice(float (&S)[kMaxRows], const float* src, const Place& p, int dv) {
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j)
    S[j] = j < p.rows && p.col_ok ? src[static_cast<int64_t>(p.warp + kWarps * j) * dv + p.col] : 0.f;
}
__device__ void store_slice(float* dst, const float (&S)[kMaxRows], const Place& p, int dv) {
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j)
    if (j < p.rows && p.col_ok) dst[static_cast<int64_t>(p.warp + kWarps * j) * dv + p.col] = S[j];
}

// A slice's private buffer: [rows, kSlice] dense (the scratch of the backward's segment states).
__device__ void load_private(float (&S)[kMaxRows], const float* src, const Place& p) {
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j) S[j] = j < p.rows ? src[(p.warp + kWarps * j) * kSlice + p.lane] : 0.f;
}
__device__ void store_private(float* dst, const float (&S)[kMaxRows], const Place& p) {
#pragma unroll
  for (int j = 0; j < kMaxRows; ++j)
    if (j < p.rows) dst[(p.warp + kWarps * j) * kSlice + p.lane] = S[j];
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    states_forward_kernel(Geometry ge, const T* q, const T* k, const T* v, const float* g, const T* beta,
                          RunTable runs, float scale, const float* initial, T* out, float* finals) {
  extern __shared__ float smem[];
  const Tile s = carve(smem, ge.dk);
  const Place p = place(ge);
  const int h = blockIdx.x, dk = ge.dk, dv = ge.dv;
  const int64_t state = static_cast<int64_t>(dk) * dv;
  const T* no_t = nullptr;
  float S[kMaxRows];
  for (int64_t n = blockIdx.z; n < ge.runs; n += gridDim.z) {
    const int64_t at = (n * ge.hv + h) * state, begin = runs.begin[n], end = runs.end[n];
    load_slice(S, initial + at, p, dv);
    for (int64_t t0 = begin; t0 < end; t0 += kTile) {
      const int count = static_cast<int>(end - t0 < kTile ? end - t0 : kTile);
      __syncthreads();  // the previous tile is read
      load_tile(ge, s, t0, count, h, p.c0, q, k, v, no_t, g, beta);
      __syncthreads();
      for (int i = 0; i < count; ++i) {
        advance(S, s, p, i, dk);
        const float* qi = s.q + i * dk;
        float partial = 0.f;
#pragma unroll
        for (int j = 0; j < kMaxRows; ++j)
          if (j < p.rows) partial = fmaf(qi[p.warp + kWarps * j], S[j], partial);
        const float o = column_sum(s.red + kWarps * kSlice, p, partial);
        if (p.warp == 0 && p.col_ok) out[((t0 + i) * ge.hv + h) * dv + p.col] = from_f32<T>(scale * o);
      }
    }
    store_slice(finals + at, S, p, dv);
  }
}

// ckpt: [Hv, segments_cap, dk, dv]; segbuf: per block [kSegment + 1, kMaxRows·kWarps, kSlice];
// dq_part, dk_part F32 [slices, T, Hv, dk]; gate_part F32 [slices, T, Hv, kGateParts].
template <typename T>
__global__ void __launch_bounds__(kThreads)
    states_backward_kernel(Geometry ge, const T* q, const T* k, const T* v, const float* g, const T* beta,
                           RunTable runs, float scale, const float* initial, const T* dout, const float* d_final,
                           float* ckpt, float* segbuf, float* dq_part, float* dk_part, float* gate_part, T* dv_out,
                           float* d_initial) {
  extern __shared__ float smem[];
  const Tile s = carve(smem, ge.dk);
  const Place p = place(ge);
  const int h = blockIdx.x, slice = blockIdx.y, dk = ge.dk, dv = ge.dv;
  const int64_t state = static_cast<int64_t>(dk) * dv, slice_state = static_cast<int64_t>(kMaxRows) * kWarps * kSlice;
  float* saved = ckpt + static_cast<int64_t>(h) * ge.segments_cap * state;
  float* seg = segbuf + ((static_cast<int64_t>(blockIdx.z) * ge.slices + slice) * ge.hv + h) * (kSegment + 1) *
                            slice_state;
  const int64_t part_base = static_cast<int64_t>(slice) * ge.tokens * ge.hv;
  const T* no_t = nullptr;
  float S[kMaxRows], dS[kMaxRows];
  for (int64_t n = blockIdx.z; n < ge.runs; n += gridDim.z) {
    const int64_t at = (n * ge.hv + h) * state, begin = runs.begin[n], end = runs.end[n];
    float* run_saved = saved + runs.seg_base[n] * state;
    // The state entering every segment of the run.
    load_slice(S, initial + at, p, dv);
    for (int64_t t0 = begin; t0 < end; t0 += kTile) {
      const int count = static_cast<int>(end - t0 < kTile ? end - t0 : kTile);
      if ((t0 - begin) % kSegment == 0) store_slice(run_saved + ((t0 - begin) / kSegment) * state, S, p, dv);
      __syncthreads();
      load_tile(ge, s, t0, count, h, p.c0, no_t, k, v, no_t, g, beta);
      __syncthreads();
      for (int i = 0; i < count; ++i) advance(S, s, p, i, dk);
    }
    load_slice(dS, d_final + at, p, dv);
    const int64_t segments = (end - begin + kSegment - 1) / kSegment;
    for (int64_t sgi = segments - 1; sgi >= 0; --sgi) {
      const int64_t s0 = begin + sgi * kSegment, s1 = s0 + kSegment < end ? s0 + kSegment : end;
      // seg[i] = the slice after token s0 − 1 + i (seg[0]: entering the segment); the saved state
      // was written by this same thread, like everything read back from seg.
      load_slice(S, run_saved + sgi * state, p, dv);
      store_private(seg, S, p);
      for (int64_t t0 = s0; t0 < s1; t0 += kTile) {
        const int count = static_cast<int>(s1 - t0 < kTile ? s1 - t0 : kTile);
        __syncthreads();
        load_tile(ge, s, t0, count, h, p.c0, no_t, k, v, no_t, g, beta);
        __syncthreads();
        for (int i = 0; i < count; ++i) {
          advance(S, s, p, i, dk);
          store_private(seg + (t0 - s0 + i + 1) * slice_state, S, p);
        }
      }
      // The segment's tiles, last first, each walked in reverse.
      for (int64_t t0 = s0 + ((s1 - s0 - 1) / kTile) * kTile; t0 >= s0; t0 -= kTile) {
        const int count = static_cast<int>(s1 - t0 < kTile ? s1 - t0 : kTile);
        __syncthreads();
        load_tile(ge, s, t0, count, h, p.c0, q, k, v, dout, g, beta);
        __syncthreads();
        for (int i = count - 1; i >= 0; --i) {
          const int64_t t = t0 + i;
          load_private(S, seg + (t - s0) * slice_state, p);  // S_{t−1}
          const float* after = seg + (t - s0 + 1) * slice_state;  // S_t, read row by row below
          const float* qi = s.q + i * dk;
          const float* ki = s.k + i * dk;
          const float a = s.a[i], bt = s.beta[i], vc = s.v[i * kSlice + p.lane], dc = s.d[i * kSlice + p.lane];
          float z_part = 0.f, u_part = 0.f;
#pragma unroll
          for (int j = 0; j < kMaxRows; ++j)
            if (j < p.rows) {
              const int r = p.warp + kWarps * j;
              dS[j] = fmaf(scale * qi[r], dc, dS[j]);
              z_part = fmaf(ki[r], dS[j], z_part);
              u_part = fmaf(ki[r], S[j], u_part);
            }
          s.red[kWarps * kSlice + p.warp * kSlice + p.lane] = u_part;
          const float z = column_sum(s.red, p, z_part);  // its barrier also publishes u's partials
          float u = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) u += s.red[kWarps * kSlice + w * kSlice + p.lane];
          if (p.warp == 0 && p.col_ok) dv_out[(t * ge.hv + h) * dv + p.col] = from_f32<T>(bt * z);
          // Row sums over this slice's columns (the warp's lanes), partial per slice.
          float e = 0.f;
#pragma unroll
          for (int j = 0; j < kMaxRows; ++j)
            if (j < p.rows) {
              const int r = p.warp + kWarps * j;
              e = fmaf(dS[j], S[j], e);
              const float dq_r = warp_sum(after[r * kSlice + p.lane] * dc);
              const float dk_r = warp_sum(bt * (dS[j] * vc - a * (dS[j] * u + S[j] * z)));
              if (p.lane == 0) {
                const int64_t i_part = ((part_base + t * ge.hv + h) * dk) + r;
                dq_part[i_part] = scale * dq_r;
                dk_part[i_part] = dk_r;
              }
            }
          e = warp_sum(e);
          const float zv = warp_sum(z * vc), zu = warp_sum(z * u);  // every warp holds the same z, u, v
          if (p.lane == 0) s.part[p.warp] = e;
          __syncthreads();
          if (threadIdx.x == 0) {
            float total = 0.f;
            for (int w = 0; w < kWarps; ++w) total += s.part[w];
            float* gp = gate_part + (part_base + t * ge.hv + h) * kGateParts;
            gp[0] = zv;
            gp[1] = zu;
            gp[2] = total;
          }
#pragma unroll
          for (int j = 0; j < kMaxRows; ++j)
            if (j < p.rows) dS[j] = a * (dS[j] - bt * ki[p.warp + kWarps * j] * z);
        }
      }
    }
    store_slice(d_initial + at, dS, p, dv);
  }
}

// dq [T, Hk, dk] (io) = Σ over the group's value heads and the slices of dq_part, in that order;
// dk alike.
template <typename T>
__global__ void sum_parts_kernel(const float* dq_part, const float* dk_part, int64_t tokens, int hk, int group,
                                 int dk, int slices, T* dq, T* dk_out) {
  const int64_t n = tokens * hk * dk, per_slice = tokens * hk * group * dk;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t e = i % dk, kh = (i / dk) % hk, t = i / (static_cast<int64_t>(dk) * hk);
    float sq = 0.f, sk = 0.f;
    for (int j = 0; j < group; ++j)
      for (int sl = 0; sl < slices; ++sl) {
        const int64_t src = sl * per_slice + (t * hk * group + kh * group + j) * dk + e;
        sq += dq_part[src];
        sk += dk_part[src];
      }
    dq[i] = from_f32<T>(sq);
    dk_out[i] = from_f32<T>(sk);
  }
}

// dβ = ⟨z, v⟩ − a·⟨z, u⟩ and dg = a·(⟨dS, S_{t−1}⟩ − β·⟨z, u⟩) from the slices' partial sums.
template <typename T>
__global__ void gate_grads_kernel(const float* gate_part, const float* g, const T* beta, int64_t rows, int slices,
                                  float* dg, T* dbeta) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < rows;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float zv = 0.f, zu = 0.f, e = 0.f;
    for (int sl = 0; sl < slices; ++sl) {
      const float* gp = gate_part + (sl * rows + i) * kGateParts;
      zv += gp[0];
      zu += gp[1];
      e += gp[2];
    }
    const float a = expf(g[i]), b = to_f32(beta[i]);
    dbeta[i] = from_f32<T>(zv - a * zu);
    dg[i] = a * (e - b * zu);
  }
}

Geometry geometry(const DeltaStatesShape& sh) {
  const int64_t segments_cap = (sh.tokens + kSegment - 1) / kSegment + sh.runs;
  const int slices = (sh.dv + kSlice - 1) / kSlice;
  return {sh.tokens, sh.key_heads, sh.value_heads, sh.dk, sh.dv, sh.value_heads / sh.key_heads, slices, sh.runs,
          segments_cap};
}

void check_shape(const DeltaStatesShape& sh, const char* op) {
  if (sh.key_heads < 1 || sh.value_heads % sh.key_heads != 0)
    throw_message(op, "value heads not a multiple of key heads");
  if (sh.dk < 1 || sh.dv < 1 || sh.dk > kMaxRows * kWarps || sh.dv > 128) throw_message(op, "head dims must be 1 … 128");
  if (sh.value_heads > 0x7fffffff) throw_message(op, "too many value heads");
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

dim3 grid_of(const Geometry& ge) {
  return dim3(static_cast<unsigned>(ge.hv), static_cast<unsigned>(ge.slices),
              static_cast<unsigned>(ge.runs < kMaxRunBlocks ? ge.runs : kMaxRunBlocks));
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
  const size_t shared = tile_bytes(sh.dk);
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    allow_shared(states_forward_kernel<T>, shared);
    states_forward_kernel<T><<<grid_of(ge), kThreads, shared, s>>>(
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
  const dim3 grid = grid_of(ge);
  const size_t f32 = sizeof(float), state = static_cast<size_t>(sh.dk) * sh.dv * f32;
  const size_t slice_state = static_cast<size_t>(kMaxRows) * kWarps * kSlice * f32;
  const size_t rows = static_cast<size_t>(sh.tokens) * sh.value_heads;
  // [Hv, segments, dk, dv] saved states; [blocks, kSegment + 1, slice] recomputed segments; the
  // per-slice partials of dq, dk [slices, T, Hv, dk] and of the gates' gradients [slices, T, Hv, 3].
  Scratch saved(s, static_cast<size_t>(sh.value_heads) * static_cast<size_t>(ge.segments_cap) * state);
  Scratch segments(s, static_cast<size_t>(grid.x) * grid.y * grid.z * (kSegment + 1) * slice_state);
  Scratch dq_part(s, ge.slices * rows * sh.dk * f32), dk_part(s, ge.slices * rows * sh.dk * f32);
  Scratch gate_part(s, ge.slices * rows * kGateParts * f32);
  const size_t shared = tile_bytes(sh.dk);
  dispatch_compute(io, op, [&](auto z) {
    using T = decltype(z);
    allow_shared(states_backward_kernel<T>, shared);
    states_backward_kernel<T><<<grid, kThreads, shared, s>>>(
        ge, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), g,
        static_cast<const T*>(beta), runs, scale, initial, static_cast<const T*>(dout), d_final, saved.as<float>(),
        segments.as<float>(), dq_part.as<float>(), dk_part.as<float>(), gate_part.as<float>(), static_cast<T*>(dv),
        d_initial);
    CUDA_CHECK_LAUNCH();
    const int64_t n = sh.tokens * sh.key_heads * sh.dk;
    sum_parts_kernel<T><<<grid_for(n, 256), 256, 0, s>>>(dq_part.as<float>(), dk_part.as<float>(), sh.tokens,
                                                         sh.key_heads, ge.group, sh.dk, ge.slices,
                                                         static_cast<T*>(dq), static_cast<T*>(dk));
    CUDA_CHECK_LAUNCH();
    const int64_t r = static_cast<int64_t>(rows);
    gate_grads_kernel<T><<<grid_for(r, 256), 256, 0, s>>>(gate_part.as<float>(), g, static_cast<const T*>(beta), r,
                                                          ge.slices, dg, static_cast<T*>(dbeta));
    CUDA_CHECK_LAUNCH();
  });
}

}  // namespace spindle::cuda
