// The kinds of blocks a decoder layer is composed of. A family's config decides each layer's kinds
// (model/family.h); model/layer.cpp builds the block of each kind.
#pragma once

namespace spindle {

// What mixes information across positions.
enum class MixerKind {
  SelfAttention,  // softmax attention with RoPE (model/blocks/self_attention.h)
  GatedDeltaNet,  // linear attention by the gated delta rule (model/blocks/gated_deltanet.h)
};

// What transforms each position on its own.
enum class FeedForwardKind {
  SwiGLU,  // dense gate/up/down MLP (model/blocks/swiglu_mlp.h)
  MixtureOfExperts,  // router + top-k routed SwiGLU experts (model/blocks/moe.h)
};

struct LayerKind {
  MixerKind mixer = MixerKind::SelfAttention;
  FeedForwardKind feed_forward = FeedForwardKind::SwiGLU;
  bool operator==(const LayerKind&) const = default;
};

const char* mixer_kind_name(MixerKind kind);
const char* feed_forward_kind_name(FeedForwardKind kind);

}  // namespace spindle
