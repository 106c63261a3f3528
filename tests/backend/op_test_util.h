// Helpers shared by op tests of every backend: random tensors, host round trips, comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "backend/backend.h"
#include "core/error.h"

namespace spindle::test {

// Host copy of any float or int tensor as doubles (goes through a CPU conversion when needed).
inline std::vector<double> to_host(Backend& be, const Tensor& t) {
  std::vector<double> out(t.numel());
  if (t.dtype() == DType::F64) {
    be.copy_to_host(be.default_stream(), t, out.data());
    return out;
  }
  std::vector<unsigned char> raw(t.bytes());
  be.copy_to_host(be.default_stream(), t, raw.data());
  for (int64_t i = 0; i < t.numel(); ++i) {
    switch (t.dtype()) {
      case DType::F32: out[i] = reinterpret_cast<float*>(raw.data())[i]; break;
      case DType::BF16: out[i] = bf16_to_f32(reinterpret_cast<uint16_t*>(raw.data())[i]); break;
      case DType::F16: out[i] = f16_to_f32(reinterpret_cast<uint16_t*>(raw.data())[i]); break;
      case DType::I32: out[i] = reinterpret_cast<int32_t*>(raw.data())[i]; break;
      case DType::I64: out[i] = static_cast<double>(reinterpret_cast<int64_t*>(raw.data())[i]); break;
      default: ADD_FAILURE() << "to_host: unsupported dtype";
    }
  }
  return out;
}

// Writes host doubles into t, converting to t's dtype.
inline void from_host(Backend& be, const std::vector<double>& values, Tensor& t) {
  SPINDLE_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "from_host size");
  std::vector<unsigned char> raw(t.bytes());
  for (size_t i = 0; i < values.size(); ++i) {
    switch (t.dtype()) {
      case DType::F64: reinterpret_cast<double*>(raw.data())[i] = values[i]; break;
      case DType::F32: reinterpret_cast<float*>(raw.data())[i] = static_cast<float>(values[i]); break;
      case DType::BF16: reinterpret_cast<uint16_t*>(raw.data())[i] = f32_to_bf16(static_cast<float>(values[i])); break;
      case DType::F16: reinterpret_cast<uint16_t*>(raw.data())[i] = f32_to_f16(static_cast<float>(values[i])); break;
      case DType::I32: reinterpret_cast<int32_t*>(raw.data())[i] = static_cast<int32_t>(values[i]); break;
      default: ADD_FAILURE() << "from_host: unsupported dtype";
    }
  }
  be.copy_from_host(be.default_stream(), raw.data(), t);
}

// Uniform in [-scale, scale): never zeros, so unwritten outputs and bad indexing show.
inline Tensor random_tensor(Backend& be, Shape shape, DType dtype, std::mt19937_64& rng, double scale = 1.0) {
  std::uniform_real_distribution<double> dist(-scale, scale);
  std::vector<double> v(shape.numel());
  for (double& x : v) x = dist(rng);
  Tensor t = be.empty(shape, dtype);
  from_host(be, v, t);
  return t;
}

inline Tensor int_tensor(Backend& be, const std::vector<int>& values) {
  Tensor t = be.empty(Shape{static_cast<int64_t>(values.size())}, DType::I32);
  std::vector<int32_t> v(values.begin(), values.end());
  be.copy_from_host(be.default_stream(), v.data(), t);
  return t;
}

// ‖got − want‖ / ‖want‖ (absolute when want is zero).
inline double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (got[i] - want[i]) * (got[i] - want[i]);
    den += want[i] * want[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

inline void expect_close(const std::vector<double>& got, const std::vector<double>& want, double tol,
                         const char* what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (double g : got) ASSERT_FALSE(std::isnan(g)) << what << ": NaN";
  EXPECT_LE(relative_error(got, want), tol) << what;
}

}  // namespace spindle::test
