#include <gtest/gtest.h>

#include "core/error.h"
#include "core/tensor.h"

using namespace spindle;

TEST(Tensor, ViewsShareStorage) {
  auto storage = std::make_shared<Storage>();
  std::vector<float> host(12);
  storage->data = host.data();
  storage->bytes = host.size() * 4;
  Tensor t(storage, 0, Shape{4, 3}, DType::F32);
  Tensor r = t.rows(1, 3);
  EXPECT_EQ(r.shape(), (Shape{2, 3}));
  EXPECT_EQ(r.data_as<float>(), host.data() + 3);
  EXPECT_EQ(t.reshape(Shape{2, 6}).dim(1), 6);
  EXPECT_EQ(t.flat(5, 4).data_as<float>(), host.data() + 5);
  EXPECT_THROW(t.reshape(Shape{5}), Error);
  EXPECT_THROW(t.rows(2, 5), Error);
  EXPECT_EQ(t.describe(), "F32[4, 3] on cpu");
}
