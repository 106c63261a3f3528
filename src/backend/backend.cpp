#include "backend/backend.h"

namespace spindle {

Tensor Backend::zeros(Shape shape, DType dtype) {
  Tensor t = empty(shape, dtype);
  Stream s = default_stream();
  fill(s, t, 0.0);
  return t;
}

}  // namespace spindle
