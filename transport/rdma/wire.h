// Frames of the RDMA transport: what one SEND carries (rdma_frame.proto).
//
// A frame is a 16-byte preamble, then a protobuf head, then the bytes of the
// parts sent inline, back to back in part order:
//
//   offset 0  u16 magic 0x5252 ("RR")     offset 6  u16 flags (kFlag*)
//          2  u8  version (kWireVersion)         8  u32 head bytes
//          3  u8  FrameType                     12  u32 inline bytes
//          4  u16 credits returned (see flow_control.h)
//
// Flags: kFlagWantsCredits, the sender is running low on the receiver's
// credits and may be granted more (CreditWindow::WantsCredits); the other
// bits are 0.
//
// All integers little-endian. Every field a peer sends is checked before
// use: a frame that a correct peer would not send is INVALID_ARGUMENT, and
// the caller fails the connection (or the call, where the frame names one).
//
//   std::vector<uint8_t> buf(4096);
//   RDMARPC_ASSIGN_OR_RETURN(size_t n, EncodeFrame(FrameType::kRequest, 3,
//                                                  &head, inline_parts, buf));
//   ...
//   RDMARPC_ASSIGN_OR_RETURN(FrameView frame, DecodeFrame(received));
//   ScratchHead<RequestHead> req;
//   RDMARPC_RETURN_IF_ERROR(ParseRequest(frame, limits, &*req));
//
// Ownership: FrameView points into the bytes given to DecodeFrame, which
// must stay valid while it is used (a receive buffer until it is re-posted).
#ifndef RDMARPC_TRANSPORT_RDMA_WIRE_H_
#define RDMARPC_TRANSPORT_RDMA_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "google/protobuf/message_lite.h"
#include "rdmarpc/status.h"
#include "runtime/metadata.h"
#include "runtime/scratch_message.h"
#include "transport/rdma/rdma_frame.pb.h"

namespace rdmarpc::rdma {

inline constexpr uint16_t kWireMagic = 0x5252;
// 2: credits granted beyond the first receives, the flags field.
inline constexpr uint8_t kWireVersion = 2;
inline constexpr size_t kPreambleBytes = 16;
// The preamble's flags (offset 6).
inline constexpr uint16_t kFlagWantsCredits = 1;

// The heads of frames are built and parsed in the thread's reusable message
// (runtime/scratch_message.h); what it holds stays bounded by the wire
// limits.
template <typename Head>
using ScratchHead = internal::ScratchMessage<Head>;

enum class FrameType : uint8_t {
  kRequest = 1,   // RequestHead
  kResponse = 2,  // ResponseHead
  kGrant = 3,     // Grant
  kCredit = 4,    // no head: only returns credits
  kCancel = 5,    // Cancel
  kPing = 6,      // Ping: client asks whether the server still answers
  kPong = 7,      // Ping: the server's answer, same sequence
};

struct FrameView {
  FrameType type;
  uint16_t credits;
  bool wants_credits;
  std::string_view head;
  std::string_view inline_bytes;
};

// What a receiver accepts from a peer.
struct WireLimits {
  size_t max_parts = 4096;
  size_t max_method_bytes = 1024;
  // Request metadata, or a response's initial and trailing together.
  size_t max_metadata_entries = internal::kMaxMetadataEntries;
  size_t max_metadata_bytes = internal::kMaxMetadataBytes;
  size_t max_status_message_bytes = 16 << 10;
};

// Bytes a frame with these sizes takes.
constexpr size_t FrameBytes(size_t head_bytes, size_t inline_bytes) {
  return kPreambleBytes + head_bytes + inline_bytes;
}

// A call's message serialized straight into its frame, as the first
// inline part: no copy of it on the heap first. `bytes` is what
// msg->ByteSizeLong() returned, and `msg` has not changed since, so its
// cached sizes hold. The message must outlive the SendFrame or
// EncodeFrame that takes it (they serialize before they return).
struct MessagePart {
  const google::protobuf::MessageLite* msg = nullptr;  // null: none
  size_t bytes = 0;
};

// Writes a frame into `out`: preamble, `head` (null for kCredit), then
// `message` (if any) and `inline_parts` in order. Returns the bytes
// written; RESOURCE_EXHAUSTED if it does not fit (the caller then sends
// parts out of band).
[[nodiscard]] StatusOr<size_t> EncodeFrame(
    FrameType type, uint16_t credits, const google::protobuf::MessageLite* head,
    std::span<const std::span<const uint8_t>> inline_parts,
    std::span<uint8_t> out, MessagePart message = {});
// The same with the head's size computed already (`head_bytes`, from its
// ByteSizeLong: the head is serialized with its cached sizes).
[[nodiscard]] StatusOr<size_t> EncodeFrameSized(
    FrameType type, uint16_t credits, const google::protobuf::MessageLite* head,
    size_t head_bytes, MessagePart message,
    std::span<const std::span<const uint8_t>> inline_parts,
    std::span<uint8_t> out);

// Checks the preamble against `bytes` (one received SEND): magic, version,
// type, reserved bits, and that the lengths add up exactly.
[[nodiscard]] StatusOr<FrameView> DecodeFrame(std::string_view bytes);

// Parse a head and check it against `limits`. For requests and responses:
// part 0 (the message) exists, and the inline parts' sizes add up to the
// frame's inline bytes.
// They parse into `head` (a ScratchHead's, on the datapath).
[[nodiscard]] Status ParseRequest(const FrameView& frame,
                                  const WireLimits& limits, RequestHead* head);
[[nodiscard]] Status ParseResponse(const FrameView& frame,
                                   const WireLimits& limits,
                                   ResponseHead* head);
// A grant must have `expected_regions` regions (the out-of-band parts the
// granter was told about) with non-zero lengths.
[[nodiscard]] StatusOr<Grant> ParseGrant(const FrameView& frame,
                                         size_t expected_regions);
[[nodiscard]] StatusOr<Cancel> ParseCancel(const FrameView& frame);
// Most call ids a pong lists (10 bytes each at worst: a pong fits any
// receive buffer).
inline constexpr int kMaxRunningInPong = 2048;

// A kPing or kPong frame's head; a ping lists no call ids, a pong at most
// kMaxRunningInPong.
[[nodiscard]] StatusOr<Ping> ParsePing(const FrameView& frame);

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_WIRE_H_
