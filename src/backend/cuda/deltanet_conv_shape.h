// Which causal conv1d shapes the CUDA backend's register-window kernels take (deltanet_conv.cu) and
// the device scratch the conv's backward holds for the length of a call (the weight gradient's
// partial sums). Plain C++, no CUDA headers: the launchers choose their kernels with these, and
// `spindle plan` (plan/dry_backend.cpp) counts the same memory when it plans for the CUDA backend.
#pragma once

#include <cstddef>
#include <cstdint>

namespace spindle::cuda {

// Each thread of the register-window kernels holds 4 adjacent channels and a window of 4 taps.
constexpr int64_t kConvWindowChannels = 4;
constexpr int64_t kConvWindowMaxWidth = 4;
// Tokens one block of the window kernels' backward covers: the rows of one dw partial sum.
constexpr int64_t kConvWindowBackwardRows = 256;
// The row-wise kernels (any width up to 16, any channel count): rows per dw partial sum.
constexpr int64_t kConvRowwiseBackwardRows = 64;

// Whether the register-window kernels take `channels` channels of a `width`-tap conv (the tensors'
// alignment to 4 elements is checked by the launcher as well).
inline bool conv_window_shape(int64_t channels, int64_t width) {
  return width >= 1 && width <= kConvWindowMaxWidth && channels > 0 && channels % kConvWindowChannels == 0;
}

// Whether the fused conv-and-split kernels (deltanet_conv_split_*) take key heads of head_dim:
// a head is head_dim / 4 lanes of one warp, a power of two up to 32 (head_dim 4, 8, ..., 128).
inline bool conv_split_fused_shape(int64_t channels, int64_t width, int64_t head_dim) {
  if (!conv_window_shape(channels, width) || head_dim <= 0 || head_dim % kConvWindowChannels != 0) return false;
  const int64_t lanes = head_dim / kConvWindowChannels;
  return lanes <= 32 && (lanes & (lanes - 1)) == 0;
}

// F32 partial sums of dw the conv's backward holds: [row blocks, channels, width].
inline size_t conv_backward_scratch_bytes(int64_t tokens, int64_t channels, int64_t width) {
  const int64_t rows = conv_window_shape(channels, width) ? kConvWindowBackwardRows : kConvRowwiseBackwardRows;
  return sizeof(float) * static_cast<size_t>((tokens + rows - 1) / rows) * static_cast<size_t>(channels * width);
}

}  // namespace spindle::cuda
