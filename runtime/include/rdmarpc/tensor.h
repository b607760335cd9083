// rdmarpc/tensor.h: binding tensor fields to memory, and reading them.
//
// A message field of type rdmarpc.Tensor carries its bytes out of band. The
// sender binds a buffer to the field through the call's CallTensors; the
// receiver gets a view of memory that already holds the bytes where it wants
// them (host, or a CUDA device), not a copy.
//
//   // Client: send `input`, read `output`.
//   rdmarpc::ClientContext ctx;
//   demo::Req req;
//   std::vector<float> x(1024, 1.0f);
//   RDMARPC_RETURN_IF_ERROR(ctx.tensors().Set(
//       req.mutable_input(), rdmarpc::DTYPE_F32, {1024},
//       rdmarpc::TensorBuffer::Borrow(x.data(), x.size() * sizeof(float))));
//   demo::Resp resp;
//   RDMARPC_RETURN_IF_ERROR(stub->Run(&ctx, req, &resp));
//   RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorView out,
//                            ctx.tensors().Get(resp.output()));
//   // out.data() stays valid while `ctx` lives, or while a copy of
//   // out.buffer() is kept.
//
// Keys are the addresses of the Tensor sub-messages, so do not move or
// re-create a message (or resize a repeated field holding it) between Set()
// and the call, or between the call and Get().
#ifndef RDMARPC_TENSOR_H_
#define RDMARPC_TENSOR_H_

#include <cstdint>
#include <initializer_list>
#include <span>
#include <utility>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/container/inlined_vector.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"
#include "rdmarpc/tensor.pb.h"

namespace rdmarpc {

namespace internal {
class CallTensorsAccess;
}  // namespace internal

// Bytes per element of `dtype`; 0 for DTYPE_UNSPECIFIED or unknown values.
size_t DTypeSize(DType dtype);

// "f32", "bf16", ...; "unspecified" or "dtype(N)" otherwise.
const char* DTypeName(DType dtype);

// numel(shape) * DTypeSize(dtype), or INVALID_ARGUMENT for an unknown dtype,
// a negative dimension or a size that overflows 64 bits.
StatusOr<uint64_t> TensorByteSize(DType dtype, std::span<const int64_t> shape);

// A tensor's bytes plus its description. Cheap to copy; keeps the bytes
// alive through buffer().
class TensorView {
 public:
  TensorView() = default;
  TensorView(TensorBuffer buffer, DType dtype, std::vector<int64_t> shape)
      : buffer_(std::move(buffer)), dtype_(dtype), shape_(std::move(shape)) {}

  const void* data() const { return buffer_.data(); }
  void* mutable_data() const { return buffer_.data(); }
  size_t size() const { return buffer_.size(); }
  Device device() const { return buffer_.device(); }
  DType dtype() const { return dtype_; }
  const std::vector<int64_t>& shape() const { return shape_; }
  const TensorBuffer& buffer() const { return buffer_; }

  // Typed host access; nullptr for device memory, or when the byte size is
  // not a whole number of T.
  template <typename T>
  const T* host_data() const {
    if (!device().is_host() || size() % sizeof(T) != 0) return nullptr;
    return static_cast<const T*>(data());
  }

 private:
  TensorBuffer buffer_;
  DType dtype_ = DTYPE_UNSPECIFIED;
  std::vector<int64_t> shape_;
};

// The tensor bytes of one call: what the local side sends (bound with Set)
// and what it received (read with Get). Owned by the ClientContext or
// ServerContext of the call.
class CallTensors {
 public:
  CallTensors() = default;
  CallTensors(const CallTensors&) = delete;
  CallTensors& operator=(const CallTensors&) = delete;

  // Describes `field` (dtype, shape, device, byte_size; clears `data`) and
  // binds `buffer` as its bytes. INVALID_ARGUMENT if buffer.size() is not
  // numel(shape) * DTypeSize(dtype). Ownership: see TensorBuffer (a borrowed
  // buffer must stay valid until the call completes).
  Status Set(Tensor* field, DType dtype, std::span<const int64_t> shape,
             TensorBuffer buffer);
  Status Set(Tensor* field, DType dtype, std::initializer_list<int64_t> shape,
             TensorBuffer buffer) {
    return Set(field, dtype,
               std::span<const int64_t>(shape.begin(), shape.size()),
               std::move(buffer));
  }
  // Binds the bytes and description of a view (for example a received
  // tensor, to send it on without a copy).
  Status Set(Tensor* field, const TensorView& view);

  // The bytes of `field`: a received tensor, a tensor bound with Set(), or
  // (for a message built the protobuf way) a view of field.data(), which is
  // valid while the message is unchanged. NOT_FOUND if the field has no
  // bytes bound and is not part of a message this call received.
  StatusOr<TensorView> Get(const Tensor& field) const;

  // Forgets every binding.
  void Clear() {
    few_.clear();
    many_.clear();
  }

 private:
  friend class internal::CallTensorsAccess;
  const TensorBuffer* Find(const Tensor& field) const;
  void Bind(const Tensor& field, TensorBuffer buffer);

  // A call binds a few tensors as a rule: those stay inline (no heap
  // allocation per call), the rest go in the map.
  static constexpr size_t kInlineBindings = 4;
  absl::InlinedVector<std::pair<const Tensor*, TensorBuffer>, kInlineBindings>
      few_;
  absl::flat_hash_map<const Tensor*, TensorBuffer> many_;
};

}  // namespace rdmarpc

#endif  // RDMARPC_TENSOR_H_
