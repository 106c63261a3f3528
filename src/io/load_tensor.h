// Moving file tensors onto a backend. Dtype conversion happens on the host, chunk by chunk, so a
// bf16 checkpoint can fill f32 CPU tensors (or f32 files bf16 CUDA tensors) with bounded host memory.
#pragma once

#include "backend/backend.h"
#include "io/safetensors_file.h"

namespace spindle::io {

// A new tensor of rec's shape in `target` dtype. Float dtypes (F32, F64, BF16, F16) convert into each
// other (round to nearest even); integer dtypes load only as themselves.
Tensor load_tensor(Backend& backend, const TensorRecord& rec, DType target);
// Same into an existing tensor (e.g. a preallocated parameter); element counts must match.
void load_tensor_into(Backend& backend, const TensorRecord& rec, Tensor& destination);

}  // namespace spindle::io
