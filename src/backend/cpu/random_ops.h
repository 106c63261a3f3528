// The CPU backend's counter-based random fill (backend/backend.h, fill_random_uniform): the
// reference the CUDA kernel is checked against, bit for bit.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace spindle::cpu {

// t [n] (F32, F64, BF16 or F16) = random_hash::uniform(stream_key(seed, sequence), i, half_width),
// stored as a double is stored (F32 rounded to nearest even; BF16/F16 through that F32).
void fill_random_uniform(Tensor& t, uint64_t seed, uint64_t sequence, double half_width);

}  // namespace spindle::cpu
