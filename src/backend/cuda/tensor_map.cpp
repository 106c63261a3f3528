#include "backend/cuda/tensor_map.h"

#include <cuda_runtime.h>
#include <cudaTypedefs.h>

#include "backend/cuda/cuda_check.h"
#include "core/error.h"

namespace spindle::cuda {
namespace {

// The driver's encoder, found through the runtime (the backend links no libcuda directly).
PFN_cuTensorMapEncodeTiled_v12000 encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult found{};
    CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &found));
    if (found != cudaDriverEntryPointSuccess || !p)
      fail("cuTensorMapEncodeTiled is missing from the CUDA driver: the Hopper attention kernels need driver >= 525");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(p);
  }();
  return fn;
}

CUtensorMap tile_map(CUtensorMapDataType type, int element_bytes, const void* base, int64_t rows, int64_t cols,
                     int box_rows) {
  if (reinterpret_cast<uintptr_t>(base) % 16 != 0 || (cols * element_bytes) % 16 != 0 || rows <= 0)
    fail("tensor map: base {} / {} columns / {} rows do not meet TMA's alignment rules", base, cols, rows);
  CUtensorMap map{};
  const cuuint64_t dims[2] = {static_cast<cuuint64_t>(cols), static_cast<cuuint64_t>(rows)};
  const cuuint64_t strides[1] = {static_cast<cuuint64_t>(cols) * element_bytes};  // bytes between rows
  const cuuint32_t box[2] = {static_cast<cuuint32_t>(128 / element_bytes), static_cast<cuuint32_t>(box_rows)};
  const cuuint32_t element_strides[2] = {1, 1};
  const CUresult r = encoder()(&map, type, 2, const_cast<void*>(base), dims, strides, box,
                               element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                               CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    fail("cuTensorMapEncodeTiled failed with CUresult {} ({} x {} of {}-byte elements, box {} rows)",
         static_cast<int>(r), rows, cols, element_bytes, box_rows);
  return map;
}

}  // namespace

CUtensorMap bf16_tile_map(const void* base, int64_t rows, int64_t cols, int box_rows) {
  return tile_map(CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 2, base, rows, cols, box_rows);
}

CUtensorMap f32_tile_map(const void* base, int64_t rows, int64_t cols, int box_rows) {
  return tile_map(CU_TENSOR_MAP_DATA_TYPE_FLOAT32, 4, base, rows, cols, box_rows);
}

}  // namespace spindle::cuda
