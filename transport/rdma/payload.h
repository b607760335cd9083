// A call's payload on the RDMA transport: how a message and its tensors
// become frame parts and writes, and how received parts become a message
// with tensors bound to landing memory. Shared by client and server.
//
// Sending:
//   RDMARPC_ASSIGN_OR_RETURN(OutgoingPayload out,
//                            PlanPayload(msg, tensors, room, threshold));
//   head.parts = out.parts; frame carries out.inline_parts;
//   for each out.out_of_band[k]: write into the peer's region k.
// Receiving:
//   RDMARPC_ASSIGN_OR_RETURN(IncomingPayload in,
//                            ReceivePayload(parts, frame.inline_bytes, ...));
//   grant in.landing (if any), wait for the writes, then
//   RDMARPC_ASSIGN_OR_RETURN(auto result, FinishPayload(&in, msg, ...));
#ifndef RDMARPC_TRANSPORT_RDMA_PAYLOAD_H_
#define RDMARPC_TRANSPORT_RDMA_PAYLOAD_H_

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "google/protobuf/message.h"
#include "google/protobuf/repeated_ptr_field.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"
#include "rdmarpc/tensor.h"
#include "runtime/codec.h"
#include "transport/rdma/connection.h"
#include "transport/rdma/rdma_frame.pb.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

struct OutgoingPayload {
  // Part 0, the serialized message; on the heap so that the spans below
  // survive moving the payload.
  std::unique_ptr<std::string> message;
  std::vector<Part> parts;
  // Bytes of the parts that travel in the frame, in part order. They point
  // into `message`, into bound buffers or into `staged`.
  std::vector<std::span<const uint8_t>> inline_parts;
  // Parts that travel by RDMA WRITE, in part order.
  struct Source {
    const void* data = nullptr;
    uint64_t size = 0;
  };
  std::vector<Source> out_of_band;
  std::vector<TensorBuffer> keep;   // the bound buffers, alive until done
  std::vector<std::string> staged;  // device bytes copied for the frame
  uint64_t tensor_bytes = 0;
  uint64_t cpu_copied_bytes = 0;  // tensor bytes copied into the frame
};

// Serializes `msg` and decides how each part travels: in the frame while it
// is at most `inline_threshold` bytes (the message part: any size) and the
// frame stays within `frame_room` bytes of parts, else out of band.
// UNIMPLEMENTED when a part must be written from device memory (GPU
// registration is not in this build): the caller then uses gRPC.
[[nodiscard]] StatusOr<OutgoingPayload> PlanPayload(
    const google::protobuf::Message& msg, const CallTensors& tensors,
    size_t frame_room, uint64_t inline_threshold);

// The call id a grant frame names, to find its call before checking it.
[[nodiscard]] StatusOr<uint64_t> GrantCallId(const FrameView& frame);

// Checks that `frame` grants exactly the out-of-band parts of `out` (count
// and lengths: anything else is a protocol violation), then queues one
// write per part into its region, the last carrying the grant id as
// immediate. `sources[k]` registers part k; `done` runs once per queued
// write. Returns how many were queued (fewer if the connection closed).
[[nodiscard]] StatusOr<int> WriteGrantedParts(
    const FrameView& frame, const OutgoingPayload& out,
    std::span<const LocalMemory> sources, Connection* conn,
    const std::function<void(Status)>& done);

struct IncomingPayload {
  std::vector<Part> parts;
  std::string message;  // part 0 when it came in the frame
  // Inline tensor bytes by tensor index (empty when not inline).
  std::vector<std::string> inline_tensors;
  // Landing memory of the out-of-band parts, in part order, and the part
  // index of each.
  std::vector<TensorBuffer> landing;
  std::vector<size_t> landing_part;
  std::vector<MemoryRegion> landing_mrs;
};

// Copies the frame's inline bytes out (the receive buffer is re-posted),
// checks the announced sizes against `max_tensor_bytes` before allocating,
// and allocates landing memory for the out-of-band parts: supplied[k] for
// tensor k when given (host memory), else new host memory.
// RESOURCE_EXHAUSTED (budget, memory) and INVALID_ARGUMENT fail the call,
// not the connection.
[[nodiscard]] StatusOr<IncomingPayload> ReceivePayload(
    const google::protobuf::RepeatedPtrField<Part>& parts,
    std::string_view inline_bytes, uint64_t max_tensor_bytes,
    std::span<const TensorBuffer> supplied);

// Registers in.landing for remote write (the grant's lifetime).
[[nodiscard]] Status RegisterLandingMemory(IncomingPayload* in, ibv_pd* pd);

// Regions for a grant of `in.landing`.
void AddGrantRegions(const IncomingPayload& in, Grant* grant);

// Once every out-of-band part has landed: drops the landing registrations,
// parses the message and binds its tensors (internal::AcceptIncoming).
[[nodiscard]] StatusOr<internal::IncomingResult> FinishPayload(
    IncomingPayload* in, google::protobuf::Message* msg, Device placement,
    uint64_t max_tensor_bytes, std::shared_ptr<const void> owner,
    CallTensors* tensors);

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_PAYLOAD_H_
