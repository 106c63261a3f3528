// The GPU process group: NCCL on device tensors, one process per GPU. Every call is enqueued on
// the caller's stream and returns without waiting (barrier excepted), like the backend's ops.
//
// Sum order (communicator.h asks for rank order, identical on every rank, BF16/F16 in F32):
//  - SumOrder::RankOrder (default) keeps that contract exactly: reductions run as an all-to-all
//    of chunks, a local kernel that adds the chunks x₀ + x₁ + … in rank order (F32 accumulation
//    for BF16/F16, rounded once), then an all-gather. Results are bit-identical to the CPU
//    communicator's and do not depend on NCCL's algorithm, channel count or topology. Same bytes
//    on the wire as NCCL's ring; one extra buffer the size of the input.
//  - SumOrder::Nccl calls ncclAllReduce / ncclReduceScatter directly. Every rank still gets the
//    same bits (NCCL reduces each element once and broadcasts it), but the order of the sum is
//    NCCL's (ring: starting at a rank that depends on the chunk; tree: a tree order; both depend on
//    the algorithm, protocol and channel count NCCL picks for the size and topology), and BF16/F16
//    are summed in their own type, rounding after every addition. So a result can differ in the
//    last bits between world sizes or machines, and from the CPU communicator; F32 gradients
//    differ by rounding (≈1e-7 relative), BF16 by up to (size−1) BF16 roundings.
//
// Failures: a watchdog thread per communicator follows every enqueued call with CUDA events.
// When a call started on the GPU and did not finish within CommOptions::timeout, or NCCL reports
// an asynchronous error (a peer's connection broke), it aborts the NCCL communicator — kernels
// waiting for a dead peer then exit, so a stream synchronize returns instead of hanging — and
// the next call on this group (or barrier()) throws spindle::Error naming the call, the group and
// the probable cause. Data moved by the failed call is garbage.
//
// split()/new_group() exchange (color, key) through the job's TCP store and connect each new group
// with its own NCCL unique id, exactly as the world connects (not ncclCommSplit, whose nonblocking
// form hung in our 2-GPU test on NCCL 2.28.3).
#pragma once

#include <memory>

#include "comm/communicator.h"
#include "comm/process_group.h"

namespace spindle::comm {

enum class SumOrder { RankOrder, Nccl };

struct NcclOptions {
  CommOptions comm;
  SumOrder sum_order = SumOrder::RankOrder;
};

// False when spindle was built without NCCL (or without CUDA); connect_nccl_world then throws.
bool nccl_communicator_available();

// Collective over all processes of the job: rank 0 creates the NCCL unique id and publishes it in
// spindle's TCP store (info.master_addr:info.store_port); every rank waits for all others to
// arrive there (so a rank that never started is an error within the timeout, not a hang), then
// joins the NCCL communicator on CUDA device `device` (usually info.local_rank).
std::unique_ptr<Communicator> connect_nccl_world(const ProcessGroupInfo& info, int device,
                                                 const NcclOptions& options = {});

}  // namespace spindle::comm
