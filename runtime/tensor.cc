#include "rdmarpc/tensor.h"

#include "absl/strings/str_cat.h"

namespace rdmarpc {

size_t DTypeSize(DType dtype) {
  switch (dtype) {
    case DTYPE_F64:
    case DTYPE_I64:
      return 8;
    case DTYPE_F32:
    case DTYPE_I32:
      return 4;
    case DTYPE_F16:
    case DTYPE_BF16:
    case DTYPE_I16:
      return 2;
    case DTYPE_I8:
    case DTYPE_U8:
    case DTYPE_BOOL:
      return 1;
    default:
      return 0;
  }
}

const char* DTypeName(DType dtype) {
  switch (dtype) {
    case DTYPE_F32:
      return "f32";
    case DTYPE_F16:
      return "f16";
    case DTYPE_BF16:
      return "bf16";
    case DTYPE_F64:
      return "f64";
    case DTYPE_I8:
      return "i8";
    case DTYPE_U8:
      return "u8";
    case DTYPE_I16:
      return "i16";
    case DTYPE_I32:
      return "i32";
    case DTYPE_I64:
      return "i64";
    case DTYPE_BOOL:
      return "bool";
    case DTYPE_UNSPECIFIED:
      return "unspecified";
    default:
      return "unknown";
  }
}

StatusOr<uint64_t> TensorByteSize(DType dtype, std::span<const int64_t> shape) {
  uint64_t elem = DTypeSize(dtype);
  if (elem == 0) {
    return absl::InvalidArgumentError(absl::StrCat(
        "tensor dtype ", static_cast<int>(dtype), " (", DTypeName(dtype),
        ") has no element size; set one of the DTYPE_* values"));
  }
  uint64_t n = elem;
  for (int64_t d : shape) {
    if (d < 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("tensor shape has a negative dimension ", d));
    }
    if (d != 0 && n > UINT64_MAX / static_cast<uint64_t>(d)) {
      return absl::InvalidArgumentError(
          "tensor shape's byte size overflows 64 bits");
    }
    n *= static_cast<uint64_t>(d);
  }
  return n;
}

Status CallTensors::Set(Tensor* field, DType dtype,
                        std::span<const int64_t> shape, TensorBuffer buffer) {
  if (field == nullptr) {
    return absl::InvalidArgumentError("CallTensors::Set: field is null");
  }
  RDMARPC_ASSIGN_OR_RETURN(uint64_t expected, TensorByteSize(dtype, shape));
  if (expected != buffer.size()) {
    return absl::InvalidArgumentError(
        absl::StrCat("tensor of dtype ", DTypeName(dtype), " and ",
                     shape.size(), "-d shape needs ", expected,
                     " bytes but the buffer has ", buffer.size()));
  }
  field->set_dtype(dtype);
  field->mutable_shape()->Assign(shape.begin(), shape.end());
  field->set_device_type(buffer.device().type);
  field->set_device_index(buffer.device().index);
  field->set_byte_size(expected);
  field->clear_data();
  Bind(*field, std::move(buffer));
  return absl::OkStatus();
}

Status CallTensors::Set(Tensor* field, const TensorView& view) {
  return Set(field, view.dtype(), view.shape(), view.buffer());
}

StatusOr<TensorView> CallTensors::Get(const Tensor& field) const {
  std::vector<int64_t> shape(field.shape().begin(), field.shape().end());
  if (const TensorBuffer* b = Find(field)) {
    return TensorView(*b, field.dtype(), std::move(shape));
  }
  if (field.dtype() == DTYPE_UNSPECIFIED && field.data().empty()) {
    return absl::NotFoundError(
        "tensor field is missing: not set in the message (no dtype), not "
        "bound with CallTensors::Set(), and not received in this call");
  }
  // A message built the protobuf way: view its inline bytes.
  RDMARPC_ASSIGN_OR_RETURN(uint64_t expected,
                           TensorByteSize(field.dtype(), shape));
  if (field.data().size() != expected) {
    return absl::NotFoundError(absl::StrCat(
        "tensor field has no bytes: not bound with CallTensors::Set(), not "
        "received in this call, and its inline data holds ",
        field.data().size(), " bytes where dtype and shape need ", expected));
  }
  return TensorView(TensorBuffer::Borrow(field.data().data(), expected),
                    field.dtype(), std::move(shape));
}

const TensorBuffer* CallTensors::Find(const Tensor& field) const {
  for (const auto& [bound, buffer] : few_) {
    if (bound == &field) return &buffer;
  }
  if (many_.empty()) return nullptr;
  auto it = many_.find(&field);
  return it == many_.end() ? nullptr : &it->second;
}

void CallTensors::Bind(const Tensor& field, TensorBuffer buffer) {
  if (TensorBuffer* bound = const_cast<TensorBuffer*>(Find(field))) {
    *bound = std::move(buffer);
  } else if (few_.size() < kInlineBindings) {
    few_.emplace_back(&field, std::move(buffer));
  } else {
    many_[&field] = std::move(buffer);
  }
}

}  // namespace rdmarpc
