// Transport-independent handling of a call's tensors: which travel out of
// band, and the checks every received message passes before its tensors are
// used. Every transport calls these, so a peer meets the same rules on each.
#ifndef RDMARPC_RUNTIME_CODEC_H_
#define RDMARPC_RUNTIME_CODEC_H_

#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <vector>

#include "absl/container/inlined_vector.h"
#include "google/protobuf/message.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"
#include "rdmarpc/tensor.h"
#include "runtime/tensor_walk.h"

namespace rdmarpc::internal {

// How one tensor of an outgoing message travels, in walk order.
struct OutgoingTensor {
  bool out_of_band = false;  // bytes in `buffer`, else inline in data()
  uint64_t size = 0;
  TensorBuffer buffer;
};

struct OutgoingPlan {
  // Inline room for a call's few tensors: no allocation to plan them.
  absl::InlinedVector<OutgoingTensor, 2> tensors;
  uint64_t total_bytes = 0;  // inline and out of band
};

// Tensors bound in `tensors` go out of band; the others inline. Fails if a
// bound field also has inline data or a description that does not match
// its buffer (the message was changed after Set()).
StatusOr<OutgoingPlan> PlanOutgoing(const google::protobuf::Message& msg,
                                    const CallTensors& tensors);

// Where a receiver wants the tensors of a message: one device, or per
// top-level field of the message.
struct TensorPlacement {
  TensorPlacement(Device d = Device::Host()) : device(d) {}  // NOLINT
  Device device;
  std::map<int, Device> by_field;  // top-level field number -> device

  // The device of each tensor of `msg`, in walk order.
  StatusOr<std::vector<Device>> Resolve(
      const google::protobuf::Message& msg) const;
  // The device of tensors under top-level field `top_field`.
  Device For(int top_field) const;
  // Every device named.
  std::vector<Device> Devices() const;
};

// What the peer says about one tensor of a message it sent.
struct IncomingPart {
  bool out_of_band = false;
  uint64_t size = 0;
  // Where the bytes land instead of a fresh allocation: memory the
  // transport already filled (RDMA), or a buffer the user supplied for a
  // response tensor. Must hold at least `size` bytes.
  TensorBuffer landing;
};

struct IncomingResult {
  // Landing memory of each out-of-band tensor, in walk order; the transport
  // fills it with the bytes that follow.
  std::vector<TensorBuffer> landing;
  uint64_t out_of_band_bytes = 0;
  uint64_t total_bytes = 0;
  uint64_t cpu_copied_bytes = 0;  // inline bytes copied to `placement`
};

// Checks the tensors of `msg` (just parsed from peer bytes) against `parts`:
// count, dtype, shape, sizes, and the `max_bytes` budget, all before
// allocating anything. Then allocates landing memory where `placement`
// puts each out-of-band tensor (or uses part.landing, copying it there when
// it lies elsewhere), and binds every tensor in `tensors`: inline ones as
// views of their data (kept alive by `owner`, which must own `msg`) or as
// copies when `placement` is a device. Marks each tensor's device fields
// with where its bytes are. Errors are INVALID_ARGUMENT (a bad peer) or
// RESOURCE_EXHAUSTED (budget or memory).
StatusOr<IncomingResult> AcceptIncoming(google::protobuf::Message* msg,
                                        std::span<const IncomingPart> parts,
                                        const TensorPlacement& placement,
                                        uint64_t max_bytes,
                                        std::shared_ptr<const void> owner,
                                        CallTensors* tensors);
// A received message's tensors, walked once for the receiver: `top` holds
// each tensor's top-level field only when the placement puts some fields
// apart (nothing else needs it).
struct WalkedTensors {
  MutableTensorList fields;
  TopFieldList top;
};
Status WalkForPlacement(google::protobuf::Message* msg,
                        const TensorPlacement& placement, WalkedTensors* out);
// AcceptIncoming for a caller that already walked `msg` with `placement`.
StatusOr<IncomingResult> AcceptIncoming(google::protobuf::Message* msg,
                                        const WalkedTensors& walked,
                                        std::span<const IncomingPart> parts,
                                        const TensorPlacement& placement,
                                        uint64_t max_bytes,
                                        std::shared_ptr<const void> owner,
                                        CallTensors* tensors);

// Blocks until the work queued so far on `cuda_stream` (a cudaStream_t;
// nullptr is the legacy default stream of each GPU concerned) is done, when
// `plan` has a tensor in GPU memory. For transports that copy those bytes
// out synchronously right after: the stream's producer must finish first.
[[nodiscard]] Status WaitForGpuProducer(const OutgoingPlan& plan,
                                        void* cuda_stream);

// A copy of `msg` with every bound tensor's bytes inline in data(), for a
// plain gRPC peer, read after the work queued on `cuda_stream` (as in
// WaitForGpuProducer). Adds the bytes copied to *copied.
StatusOr<std::unique_ptr<google::protobuf::Message>> InlineTensors(
    const google::protobuf::Message& msg, const CallTensors& tensors,
    void* cuda_stream, uint64_t* copied);

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_CODEC_H_
