// Frames of the RDMA transport: what one SEND carries.
//
// A frame is a 16-byte preamble, then a head, then the bytes of the parts
// sent inline, back to back in part order:
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
// The heads of requests and responses, which every call sends, are binary
// (RequestHead, ResponseHead below; layouts in docs/design.md,
// "Frames"): parsed in place, no allocation for a call with up to two
// parts and two metadata entries. Grants, cancels and pings carry a
// protobuf head (rdma_frame.proto).
//
// All integers little-endian. Every field a peer sends is checked before
// use: a frame that a correct peer would not send is INVALID_ARGUMENT, and
// the caller fails the connection (or the call, where the frame names one).
//
//   RequestHead head{.call_id = 3, .method = "/pkg.Svc/Run"};
//   head.parts.push_back({.size = message_bytes});
//   std::vector<uint8_t> buf(4096);
//   RDMARPC_ASSIGN_OR_RETURN(size_t n, EncodeFrame(FrameType::kRequest, 0,
//                                                  &head, inline_parts, buf));
//   ...
//   RDMARPC_ASSIGN_OR_RETURN(FrameView frame, DecodeFrame(received));
//   RequestHead req;
//   RDMARPC_RETURN_IF_ERROR(ParseRequest(frame, limits, &req));
//
// Ownership: FrameView, and a head parsed from it, point into the bytes
// given to DecodeFrame, which must stay valid while they are used (a
// receive buffer until it is re-posted). A head being encoded points into
// its caller's strings, which must stay valid until EncodeFrame or
// SendFrame returns.
#ifndef RDMARPC_TRANSPORT_RDMA_WIRE_H_
#define RDMARPC_TRANSPORT_RDMA_WIRE_H_

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <variant>

#include "absl/container/inlined_vector.h"
#include "google/protobuf/message_lite.h"
#include "rdmarpc/status.h"
#include "runtime/metadata.h"
#include "transport/rdma/rdma_frame.pb.h"

namespace rdmarpc::rdma {

inline constexpr uint16_t kWireMagic = 0x5252;
// 2: credits granted beyond the first receives, the flags field.
// 3: binary request and response heads.
inline constexpr uint8_t kWireVersion = 3;
inline constexpr size_t kPreambleBytes = 16;
// The preamble's flags (offset 6).
inline constexpr uint16_t kFlagWantsCredits = 1;

enum class FrameType : uint8_t {
  kRequest = 1,   // RequestHead (binary)
  kResponse = 2,  // ResponseHead (binary)
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

// One part of a call's payload. Part 0 is the serialized protobuf message
// (tensor bytes excluded); then one per rdmarpc.Tensor, in walk order. On
// the wire: a u64, the size in bits 0-61, out_of_band bit 63, in_message
// bit 62 (sizes of memory always fit in 62 bits).
struct Part {
  uint64_t size = 0;
  // Arrives by RDMA WRITE into memory the receiver grants.
  bool out_of_band = false;
  // A tensor whose bytes are inside the message part itself (its `data`
  // field was set the protobuf way): not in the frame, not written.
  bool in_message = false;
};
inline constexpr size_t kPartBytes = 8;
using Parts = absl::InlinedVector<Part, 2>;

struct MetadataView {
  std::string_view key;
  std::string_view value;
};
using MetadataViews = absl::InlinedVector<MetadataView, 2>;

// Client -> server: one call. Views as the file comment says.
struct RequestHead {
  uint64_t call_id = 0;
  std::string_view method;
  int64_t timeout_us = 0;  // 0: no deadline
  MetadataViews metadata;
  Parts parts;
};

// Server -> client: a call's outcome.
struct ResponseHead {
  uint64_t call_id = 0;
  int code = 0;  // absl::StatusCode
  std::string_view message;
  // With an error: the handler never ran and nothing of the request was
  // kept, so the client may send the call again over gRPC.
  bool not_executed = false;
  // What the handler sent back (ServerContext::AddInitialMetadata and
  // AddTrailingMetadata), with an error too; both together within the
  // request's metadata limits.
  MetadataViews initial_metadata;
  MetadataViews trailing_metadata;
  Parts parts;
};

// A frame's head as EncodeFrame and SendFrame take it: a call's binary
// head, a protobuf head, or none (kCredit). It points at the head, which
// must not change while this lives; its size is computed once, here.
class FrameHead {
 public:
  FrameHead() = default;
  // Implicit, so that callers pass `&head` of any kind.
  FrameHead(const RequestHead* head);                    // NOLINT
  FrameHead(const ResponseHead* head);                   // NOLINT
  FrameHead(const google::protobuf::MessageLite* head);  // NOLINT

  size_t bytes() const { return bytes_; }
  // Writes bytes() bytes at `out`.
  void WriteTo(uint8_t* out) const;

 private:
  std::variant<std::monostate, const RequestHead*, const ResponseHead*,
               const google::protobuf::MessageLite*>
      head_;
  size_t bytes_ = 0;
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

// Writes a frame into `out`: preamble, `head` (none for kCredit), then
// `message` (if any) and `inline_parts` in order. Returns the bytes
// written; RESOURCE_EXHAUSTED if it does not fit (the caller then sends
// parts out of band).
[[nodiscard]] StatusOr<size_t> EncodeFrame(
    FrameType type, uint16_t credits, const FrameHead& head,
    std::span<const std::span<const uint8_t>> inline_parts,
    std::span<uint8_t> out, MessagePart message = {});

// Checks the preamble against `bytes` (one received SEND): magic, version,
// type, reserved bits, and that the lengths add up exactly.
[[nodiscard]] StatusOr<FrameView> DecodeFrame(std::string_view bytes);

// Parse a head and check it against `limits`. For requests and responses:
// part 0 (the message) exists, and the inline parts' sizes add up to the
// frame's inline bytes. The head's views point into `frame`; what it held
// before is replaced.
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
