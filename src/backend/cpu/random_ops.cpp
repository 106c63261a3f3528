#include "backend/cpu/random_ops.h"


#include "core/error.h"
#include "core/random_hash.h"

namespace spindle::cpu {

namespace {

// out[i] = store(v_i) over the backend's OpenMP threads (every value depends only on i).
template <typename T, typename Store>
void fill_values(T* out, int64_t n, uint64_t key, double half_width, Store store) {
#pragma omp parallel for schedule(static) if (n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = store(random_hash::uniform(key, static_cast<uint64_t>(i), half_width));
}

}  // namespace

void fill_random_uniform(Tensor& t, uint64_t seed, uint64_t sequence, double half_width) {
  SPINDLE_CHECK(t.defined() && t.device().kind == DeviceKind::CPU, "fill_random_uniform: {} is not a CPU tensor",
                t.defined() ? t.describe() : std::string("an undefined tensor"));
  const uint64_t key = random_hash::stream_key(seed, sequence);
  const int64_t n = t.numel();
  switch (t.dtype()) {
    case DType::F64: return fill_values(t.data_as<double>(), n, key, half_width, [](double v) { return v; });
    case DType::F32:
      return fill_values(t.data_as<float>(), n, key, half_width, [](double v) { return static_cast<float>(v); });
    case DType::BF16:
      return fill_values(t.data_as<uint16_t>(), n, key, half_width,
                         [](double v) { return f32_to_bf16(static_cast<float>(v)); });
    case DType::F16:
      return fill_values(t.data_as<uint16_t>(), n, key, half_width,
                         [](double v) { return f32_to_f16(static_cast<float>(v)); });
    default: fail("fill_random_uniform: {} is not a float tensor (F32, F64, BF16 or F16)", t.describe());
  }
}

}  // namespace spindle::cpu
