// The local half of a rank-order reduction on the GPU (nccl_communicator.h, SumOrder::RankOrder).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace spindle::comm {

// out[i] = blocks[0][i] + blocks[1][i] + … + blocks[count−1][i], added in that order; blocks is
// [count, elements] contiguous. F32/F64/I32/I64 add in their own type; BF16/F16 add in F32 and
// round once, exactly as sum_blocks_in_rank_order (host_reduce.h) does on the host. out may not
// overlap blocks. Enqueued on `stream`.
void sum_blocks_in_rank_order_on_device(cudaStream_t stream, DType dtype, const void* blocks, int count,
                                        int64_t elements, void* out);

}  // namespace spindle::comm
