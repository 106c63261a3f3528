// Warp-level tensor-core primitives for the attention kernels (sm_80+ instructions, which the H100
// runs at about half its wgmma rate): mma.sync m16n8k16 bf16 -> f32, ldmatrix, cp.async.
//
// Fragment layouts (PTX ISA, "Matrix Fragments for mma.m16n8k16"), with g = lane / 4, t = lane % 4:
//   C/D (16x8 f32): c0,c1 = row g, cols 2t, 2t+1; c2,c3 = row g+8, same cols.
//   A (16x16 bf16, 4 regs of 2): a0 = (g, 2t..), a1 = (g+8, 2t..), a2 = (g, 2t+8..), a3 = (g+8, 2t+8..).
//   B (16x8 bf16, 2 regs): b0 = (k 2t..2t+1, n g), b1 = (k 2t+8.., n g).
// So two neighbouring C tiles (n 0-7, 8-15) repacked to bf16 are exactly one A fragment (k 0-15):
// the softmax probabilities go from one MMA's output to the next MMA's input without shared memory.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace spindle::cuda::mma {

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// d += a·b (16x8x16, bf16 inputs, f32 accumulators).
__device__ __forceinline__ void mma_bf16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 -> one register of two bf16; `lo` is the element with the smaller column index.
__device__ __forceinline__ uint32_t pack_bf16(float lo, float hi) {
  __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}

// 16-byte global -> shared copy that bypasses L1; `valid == false` writes 16 zero bytes instead
// (the source address must still be a mapped address: pass the tensor base).
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Shared-memory address of the A fragment (16x16) at (row0, col0) of a row-major bf16 tile.
__device__ __forceinline__ uint32_t a_frag_addr(const __nv_bfloat16* base, int stride, int row0, int col0, int lane) {
  return smem_addr(base + (row0 + (lane & 15)) * stride + col0 + (lane >> 4) * 8);
}
// B fragments for n-blocks n0 and n0+8 at k0, from a tile stored [n][k] (ldmatrix_x4):
// regs {r0, r1} are block n0, {r2, r3} block n0+8.
__device__ __forceinline__ uint32_t b_frag_addr_nk(const __nv_bfloat16* base, int stride, int n0, int k0, int lane) {
  return smem_addr(base + (n0 + (lane & 7) + ((lane >> 4) << 3)) * stride + k0 + ((lane >> 3) & 1) * 8);
}
// B fragments for n-blocks n0 and n0+8 at k0, from a tile stored [k][n] (ldmatrix_x4_trans).
__device__ __forceinline__ uint32_t b_frag_addr_kn(const __nv_bfloat16* base, int stride, int k0, int n0, int lane) {
  return smem_addr(base + (k0 + (lane & 7) + (((lane >> 3) & 1) << 3)) * stride + n0 + (lane >> 4) * 8);
}

// A fragment (16x16 of a row-major A) at (row0 = m, col0 = k) read from the TRANSPOSED tile
// stored [k][m] (ldmatrix_x4_trans): the same lane addresses as b_frag_addr_nk with rows = k.
__device__ __forceinline__ uint32_t a_frag_addr_trans(const __nv_bfloat16* base, int stride, int k0, int m0,
                                                      int lane) {
  return smem_addr(base + (k0 + (lane & 7) + ((lane >> 4) << 3)) * stride + m0 + ((lane >> 3) & 1) * 8);
}

}  // namespace spindle::cuda::mma
