// Tensor maps for the bulk tensor copy engine (TMA), built on the host per kernel launch.
#pragma once

#include <cuda.h>

#include <cstdint>

namespace spindle::cuda {

// A bf16 matrix [rows, cols] (row-major, row stride `cols`) read in boxes of box_rows × 64
// columns (128 bytes) with the 128-byte swizzle; boxes past the last row read as zeros.
// `cols` must be a multiple of 8 and `base` 16-byte aligned (TMA's rules); throws otherwise.
CUtensorMap bf16_tile_map(const void* base, int64_t rows, int64_t cols, int box_rows);
// The same for an f32 matrix, in boxes of box_rows × 32 columns (128 bytes, 128-byte swizzle).
CUtensorMap f32_tile_map(const void* base, int64_t rows, int64_t cols, int box_rows);

}  // namespace spindle::cuda
