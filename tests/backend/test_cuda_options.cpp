// The CUDA backend's options are parsed and checked in every build (this one runs on the CPU): the
// values a user may give `--attention`, and the error for any other naming the valid ones.
#include <gtest/gtest.h>

#include <string>

#include "backend/cuda/cuda_options.h"

namespace spindle {
namespace {

TEST(CudaOptions, AttentionValuesOfTheCommandLineParse) {
  EXPECT_EQ(parse_cuda_attention("auto"), CudaAttention::Auto);
  EXPECT_EQ(parse_cuda_attention("own"), CudaAttention::Own);
  EXPECT_EQ(parse_cuda_attention("cudnn"), CudaAttention::Cudnn);
  for (CudaAttention a : {CudaAttention::Auto, CudaAttention::Own, CudaAttention::Cudnn})
    EXPECT_EQ(parse_cuda_attention(cuda_attention_name(a)), a);
  EXPECT_EQ(CudaBackendOptions{}.attention, CudaAttention::Auto);
}

TEST(CudaOptions, OtherAttentionValuesAreErrorsNamingTheValidOnes) {
  // The forced kernels are for tests and benchmarks through the API, not the command line; nor are
  // the environment-variable spellings of earlier versions, or a different case.
  for (const char* bad : {"", "fast", "Auto", "CUDNN", "wgmma", "mma", "simple", "1", "auto "}) {
    try {
      parse_cuda_attention(bad);
      ADD_FAILURE() << "\"" << bad << "\" was accepted";
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find("--attention must be auto, own or cudnn"), std::string::npos) << m;
      EXPECT_NE(m.find(std::string("got \"") + bad + "\""), std::string::npos) << m;
    }
  }
}

}  // namespace
}  // namespace spindle
