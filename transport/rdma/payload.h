// A call's payload on the RDMA transport: how a message and its tensors
// become frame parts and writes, and how received parts become a message
// with tensors bound to landing memory. Shared by client and server.
//
// Sending:
//   RDMARPC_ASSIGN_OR_RETURN(OutgoingPayload out,
//                            PlanPayload(msg, tensors, room, threshold, gpu,
//                                        stream, &head.parts));
//   the frame carries out.inline_parts;
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

#include "absl/container/inlined_vector.h"
#include "absl/functional/function_ref.h"
#include "google/protobuf/message.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"
#include "rdmarpc/tensor.h"
#include "runtime/codec.h"
#include "runtime/cuda_support.h"
#include "transport/rdma/connection.h"
#include "transport/rdma/payload_mover.h"
#include "transport/rdma/rdma_frame.pb.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

struct OutgoingPayload {
  // Part 0, the message, when it travels in the frame: serialized straight
  // into it by SendFrame (pass it along with inline_parts). The message
  // given to PlanPayload must then stay unchanged until that send.
  MessagePart message_part;
  // Part 0 serialized, when it travels out of band; on the heap so that
  // the write's source survives moving the payload.
  std::unique_ptr<std::string> message;
  // Bytes of the other parts that travel in the frame, in part order. They
  // point into bound buffers or into `staged`.
  absl::InlinedVector<std::span<const uint8_t>, 4> inline_parts;
  // Parts that travel by RDMA WRITE, in part order.
  std::vector<PartSource> out_of_band;
  KeptBuffers keep;                 // the bound buffers, alive until done
  std::vector<std::string> staged;  // device bytes copied for the frame
  uint64_t tensor_bytes = 0;
  uint64_t cpu_copied_bytes = 0;  // tensor bytes copied into the frame
  // Set when a part is read from GPU memory: the producer's work, which the
  // writes wait for, on the copy stream of `fence_gpu`.
  std::shared_ptr<internal::CudaFence> fence;
  int fence_gpu = -1;
  std::string gpu_mode;  // for CallStats: how GPU parts travel, and why
  std::string gpu_reason;
};

// Serializes `msg` and decides how each part travels: in the frame while it
// is at most `inline_threshold` bytes (the message part: any size) and the
// frame stays within `frame_room` bytes of parts, else out of band. A part
// in GPU memory is read where it is (dma-buf, peer-memory) or copied to a
// pinned staging buffer once the grant is in (staging), always after the
// work queued on `cuda_stream` (a cudaStream_t) so far. The parts are
// described in `parts` (the head's), in order.
[[nodiscard]] StatusOr<OutgoingPayload> PlanPayload(
    const google::protobuf::Message& msg, const CallTensors& tensors,
    size_t frame_room, uint64_t inline_threshold, const GpuAccess& gpu,
    void* cuda_stream, Parts* parts);

// Registrations for the out-of-band parts of `out`, in order, each by its
// mover: host memory through `cache`, GPU memory in its direct mode (for
// this use only).
[[nodiscard]] StatusOr<std::vector<LocalMemory>> RegisterSources(
    const OutgoingPayload& out, RegistrationCache* cache, ibv_pd* pd);

// The call id a grant frame names, to find its call before checking it.
[[nodiscard]] StatusOr<uint64_t> GrantCallId(const FrameView& frame);

// Checks that `frame` grants exactly the out-of-band parts of `out` (count
// and lengths: anything else is a protocol violation), then queues one
// write per part into its region, the last carrying the grant id as
// immediate. `sources[k]` registers part k; `done` runs once per write
// counted. Returns how many writes were counted (fewer if the connection
// closed). With GPU parts (`out.fence` set) the writes are posted from
// CUDA's host-function thread once the producer's work and each staging
// chunk's copy are done, so copies and writes overlap; `done` then runs on
// a runtime thread for a write that could not be posted. `out` and the
// memory it names must stay valid until every `done` has run. `moved` runs
// whenever a piece of a split write completes (Connection::WriteRequest).
[[nodiscard]] StatusOr<int> WriteGrantedParts(
    const FrameView& frame, const OutgoingPayload& out,
    std::span<const LocalMemory> sources,
    const std::shared_ptr<Connection>& conn,
    const std::function<void(Status)>& done,
    const std::function<void()>& moved);

struct IncomingPayload {
  // Inline room for a message part and a tensor: a small call's payload
  // costs no allocation for its bookkeeping.
  Parts parts;
  // Part 0 when it came in the frame: copied out when another part is
  // out of band (the call then finishes after the buffer is re-posted),
  // else viewed in the frame, which the caller finishes before the
  // receive buffer is re-posted.
  std::string message;
  std::string_view message_in_frame;
  // Inline tensor bytes by tensor index (empty when not inline).
  absl::InlinedVector<std::string, 1> inline_tensors;
  // Landing memory of the out-of-band parts, in part order, and the part
  // index of each.
  std::vector<TensorBuffer> landing;
  std::vector<size_t> landing_part;
  // Per landing: its registration for remote write, or null where a
  // window grants it; and the key the grant names.
  std::vector<MemoryRegion> landing_mrs;
  absl::InlinedVector<uint32_t, 2> landing_rkeys;
  // The block the call's host landings share: of the landing arena, or
  // of the call's own when the arena is off or full.
  TensorBuffer landing_block;
  // The windows that grant landings, reserved (ReserveLandingWindows)
  // and then bound (RegisterLandingMemory): one over the landing block, one
  // over each other landing whose memory is registered for this grant
  // (the window owns that registration). The endpoint ends them
  // (EndLandingWindows) before FinishPayload reads the bytes.
  Connection::WindowGrants windows;
  // Landings registered for this grant alone (for stats).
  uint32_t registrations = 0;
  // Per landing: how its bytes move (payload_mover.h).
  std::vector<const PayloadMover*> landing_movers;
  // Per landing: for a pinned staging buffer, the GPU buffer the bytes go
  // to once they landed (empty: allocate one on `staged_device`).
  std::vector<TensorBuffer> staged_to;
  std::vector<Device> staged_device;
  std::string gpu_mode;  // for CallStats
  std::string gpu_reason;
};

// Copies the frame's inline bytes out (the receive buffer is re-posted;
// the message part only when another part is out of band: otherwise
// FinishPayload must run before `inline_bytes` goes back), checks the announced
// sizes against `max_tensor_bytes` before allocating, and allocates landing
// memory for the out-of-band parts: supplied[k] for tensor k when given, else
// memory where `placement` puts the tensor (per field when the message came in
// the frame and `prototype` is given): host landings share one block
// (in.landing_block), of the landing arena or, when that is off or full,
// of the call's own. For a GPU, in a direct mode the landing
// memory is the GPU's; in staging it is a pinned host buffer that FinishPayload
// copies to the GPU. RESOURCE_EXHAUSTED (budget, memory) and INVALID_ARGUMENT
// fail the call, not the connection. Fills `in`, which must be empty: in place,
// since the payload is large to move.
[[nodiscard]] Status ReceivePayload(const Parts& parts,
                                    std::string_view inline_bytes,
                                    uint64_t max_tensor_bytes,
                                    std::span<const TensorBuffer> supplied,
                                    const internal::TensorPlacement& placement,
                                    const google::protobuf::Message* prototype,
                                    const GpuAccess& gpu, IncomingPayload* in);

// Reserves the windows that will grant in.landing (Connection::
// ReserveWindows): one over the landing block and one per other landing
// whose mover lands through windows. True when they are in in.windows
// now (or none can be had); false when the grant waits for them: `wait`
// makes the continuation that gets them.
[[nodiscard]] bool ReserveLandingWindows(
    IncomingPayload* in, Connection* conn,
    absl::FunctionRef<Connection::WindowsReady()> wait);

// Grants in.landing remote write for the grant's lifetime through the
// windows in.windows holds (ReserveLandingWindows): the landing block
// through the first (unless GrantThroughWindow bound it already), over
// the arena's registration on `conn` where it has one, else over one made
// for this grant; each other landing through one over its own
// registration (LandingAccess::kWindow, no remote access of its own).
// Landings left without a window are registered for remote write where
// the connection has a protection domain of its own, and fail the grant
// (RESOURCE_EXHAUSTED) where it shares one. Landings of 1 MiB or more
// are registered aside (the caller runs this there).
[[nodiscard]] Status RegisterLandingMemory(IncomingPayload* in,
                                           Connection* conn);

// Grants the whole landing through the first reserved window when every
// part lands in the landing block, in the arena, and its segment is
// registered on `conn`: true if so, and then RegisterLandingMemory has nothing
// left to register, so the poller can grant a landing of any size without
// pinning a page. False leaves `in` as it was.
bool GrantThroughWindow(IncomingPayload* in, Connection* conn);

// Ends every window of in.windows (and empties it). True: `done` runs
// once, on the polling thread, when the last of them ended (as
// Connection::WindowGrant::End says); false: none was left open (there
// were none, or the connection is closed) and `done` never runs.
bool EndLandingWindows(IncomingPayload* in, std::function<void(Status)> done);

// Whether `in` holds registrations for remote write (dropped aside for a
// landing registered aside, once written).
bool HoldsLandingRegions(const IncomingPayload& in);

// Regions for a grant of `in.landing`.
void AddGrantRegions(const IncomingPayload& in, Grant* grant);

// OK when a grant of `regions` regions fits a `receive_bytes` receive
// buffer (whatever the addresses and keys); else RESOURCE_EXHAUSTED naming
// the limit, for `what` ("the request", "the response").
[[nodiscard]] Status CheckGrantFits(size_t regions, size_t receive_bytes,
                                    const char* what);

// Once every out-of-band part has landed: drops the landing registrations,
// copies staged parts to their GPU (ordered before `consumer`'s later work
// when given, else complete on return), parses the message and binds its
// tensors (internal::AcceptIncoming).
[[nodiscard]] StatusOr<internal::IncomingResult> FinishPayload(
    IncomingPayload* in, google::protobuf::Message* msg,
    const internal::TensorPlacement& placement, uint64_t max_tensor_bytes,
    std::shared_ptr<const void> owner, CallTensors* tensors,
    const internal::ConsumerStream* consumer);

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_PAYLOAD_H_
