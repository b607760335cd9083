#include "rdmarpc/tensor.h"

#include <gtest/gtest.h>

namespace rdmarpc {
namespace {

TEST(DTypeTest, SizesAndNames) {
  EXPECT_EQ(DTypeSize(DTYPE_F32), 4u);
  EXPECT_EQ(DTypeSize(DTYPE_BF16), 2u);
  EXPECT_EQ(DTypeSize(DTYPE_F64), 8u);
  EXPECT_EQ(DTypeSize(DTYPE_BOOL), 1u);
  EXPECT_EQ(DTypeSize(DTYPE_UNSPECIFIED), 0u);
  EXPECT_EQ(DTypeSize(static_cast<DType>(77)), 0u);
  EXPECT_STREQ(DTypeName(DTYPE_I64), "i64");
}

TEST(TensorByteSizeTest, ChecksDTypeShapeAndOverflow) {
  std::vector<int64_t> shape = {2, 3};
  EXPECT_EQ(*TensorByteSize(DTYPE_F32, shape), 24u);
  EXPECT_EQ(*TensorByteSize(DTYPE_F32, {}), 4u);  // scalar
  std::vector<int64_t> zero = {0, 7};
  EXPECT_EQ(*TensorByteSize(DTYPE_F32, zero), 0u);
  EXPECT_EQ(TensorByteSize(DTYPE_UNSPECIFIED, shape).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int64_t> negative = {2, -1};
  EXPECT_EQ(TensorByteSize(DTYPE_U8, negative).status().code(),
            absl::StatusCode::kInvalidArgument);
  std::vector<int64_t> huge = {int64_t{1} << 40, int64_t{1} << 40};
  EXPECT_EQ(TensorByteSize(DTYPE_U8, huge).status().code(),
            absl::StatusCode::kInvalidArgument);
}

TEST(CallTensorsTest, SetDescribesFieldAndGetReturnsView) {
  CallTensors tensors;
  Tensor field;
  field.set_data("stale");
  float values[6] = {1, 2, 3, 4, 5, 6};
  ASSERT_TRUE(tensors
                  .Set(&field, DTYPE_F32, {2, 3},
                       TensorBuffer::Borrow(values, sizeof(values)))
                  .ok());
  EXPECT_EQ(field.byte_size(), 24u);
  EXPECT_TRUE(field.data().empty());
  EXPECT_EQ(field.shape_size(), 2);
  auto view = tensors.Get(field);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->data(), values);  // a view, not a copy
  EXPECT_EQ(view->host_data<float>()[5], 6.0f);
  // 24 bytes are no whole number of 16-byte elements.
  EXPECT_EQ(view->host_data<long double>(), nullptr);
}

TEST(CallTensorsTest, SizeMismatchIsRejected) {
  CallTensors tensors;
  Tensor field;
  char bytes[10];
  Status s = tensors.Set(&field, DTYPE_F32, {3},
                         TensorBuffer::Borrow(bytes, sizeof(bytes)));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("needs 12 bytes"), absl::string_view::npos) << s;
}

TEST(CallTensorsTest, GetOfUnboundFieldIsNotFoundUnlessInline) {
  CallTensors tensors;
  Tensor field;
  field.set_dtype(DTYPE_U8);
  field.add_shape(3);
  EXPECT_EQ(tensors.Get(field).status().code(), absl::StatusCode::kNotFound);
  field.set_data("abc");
  auto view = tensors.Get(field);
  ASSERT_TRUE(view.ok());
  EXPECT_EQ(view->size(), 3u);
}

// A field never set (tensor.h promises NOT_FOUND) says it is missing
// instead of blaming its dtype.
TEST(CallTensorsTest, GetOfAFieldNeverSetIsNotFoundAndSaysMissing) {
  CallTensors tensors;
  Tensor field;
  auto view = tensors.Get(field);
  EXPECT_EQ(view.status().code(), absl::StatusCode::kNotFound);
  EXPECT_NE(view.status().message().find("missing"), absl::string_view::npos)
      << view.status();
}

// The first bindings are kept inline and later ones hashed: every one is
// found, re-binding replaces, and Clear forgets both kinds.
TEST(CallTensorsTest, ManyBindingsAreEachFoundAndReplaced) {
  CallTensors tensors;
  constexpr int kFields = 9;
  Tensor fields[kFields];
  uint8_t bytes[kFields][4] = {};
  for (int i = 0; i < kFields; ++i) {
    ASSERT_TRUE(tensors
                    .Set(&fields[i], DTYPE_U8, {4},
                         TensorBuffer::Borrow(bytes[i], sizeof(bytes[i])))
                    .ok());
  }
  for (int i = 0; i < kFields; ++i) {
    auto view = tensors.Get(fields[i]);
    ASSERT_TRUE(view.ok()) << i;
    EXPECT_EQ(view->data(), bytes[i]) << i;
  }
  uint8_t other[2][4] = {};
  for (int k : {1, kFields - 1}) {
    uint8_t* replacement = other[k == 1 ? 0 : 1];
    ASSERT_TRUE(tensors
                    .Set(&fields[k], DTYPE_U8, {4},
                         TensorBuffer::Borrow(replacement, 4))
                    .ok());
    auto view = tensors.Get(fields[k]);
    ASSERT_TRUE(view.ok());
    EXPECT_EQ(view->data(), replacement) << k;
  }
  tensors.Clear();
  for (int i = 0; i < kFields; ++i) {
    EXPECT_EQ(tensors.Get(fields[i]).status().code(),
              absl::StatusCode::kNotFound)
        << i;
  }
}

}  // namespace
}  // namespace rdmarpc
