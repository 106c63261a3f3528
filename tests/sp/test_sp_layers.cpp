// Which layers a sequence split can run: models with gated DeltaNet layers (qwen3_5) are refused for
// sp > 1, with a message that says what to do, rather than trained on each rank's shard alone.
#include <gtest/gtest.h>

#include "core/error.h"
#include "parallel/sp_attention.h"
#include "support/tiny_model.h"

using namespace spindle;

TEST(SequenceParallelLayers, GatedDeltaNetModelsNeedSpOne) {
  const ModelConfig hybrid = test::tiny_qwen3_5().config();
  EXPECT_NO_THROW(parallel::check_sequence_parallel_layers({.dp = 4, .sp = 1}, hybrid));
  for (parallel::MeshConfig mesh : {parallel::MeshConfig{.sp = 2, .ulysses = 2, .ring = 1},
                                    parallel::MeshConfig{.sp = 2, .ulysses = 1, .ring = 2},
                                    parallel::MeshConfig{.sp = 4, .ulysses = 2, .ring = 2}}) {
    try {
      parallel::check_sequence_parallel_layers(mesh, hybrid);
      ADD_FAILURE() << "--sp " << mesh.sp << " accepted for a model with gated DeltaNet layers";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("gated DeltaNet"), std::string::npos) << message;
      EXPECT_NE(message.find("--sp 1"), std::string::npos) << message;
    }
  }
  // Attention-only models split as before.
  EXPECT_NO_THROW(parallel::check_sequence_parallel_layers({.sp = 2, .ulysses = 1, .ring = 2}, test::TinyModel{}.config()));
}
