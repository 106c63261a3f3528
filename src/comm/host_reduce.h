// Summing blocks of host memory in rank order, for the CPU communicator's reductions.
#pragma once

#include <cstddef>

#include "core/dtype.h"

namespace spindle::comm {

// out[i] = ((blocks[0][i] + blocks[1][i]) + …) + blocks[count-1][i], where block j starts at
// blocks + j·block_stride_bytes. BF16/F16 accumulate in F32 and round once. Throws for U8.
void sum_blocks_in_rank_order(DType dtype, const void* blocks, size_t block_stride_bytes, int count,
                              size_t elements, void* out);

}  // namespace spindle::comm
