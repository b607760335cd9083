// Encoding and decoding of the lean framing (see lean_frame.proto) as
// sequences of gRPC messages. Shared by the gRPC client and server.
//
// Ownership: LeanSender's messages reference the tensor bytes without a copy
// (host memory) through slices that keep a TensorBuffer copy and a `keep`
// reference alive until gRPC releases them, so a call can delay its
// completion until the bytes of a borrowed buffer are no longer read.
#ifndef RDMARPC_TRANSPORT_GRPC_LEAN_CODEC_H_
#define RDMARPC_TRANSPORT_GRPC_LEAN_CODEC_H_

#include <grpcpp/support/byte_buffer.h>
#include <grpcpp/support/slice.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "google/protobuf/message_lite.h"
#include "rdmarpc/memory.h"
#include "rdmarpc/status.h"
#include "runtime/codec.h"
#include "transport/grpc/lean_frame.pb.h"

namespace rdmarpc::grpc_transport {

inline constexpr uint32_t kLeanVersion = 3;
// A lean stream's head is this byte, then the serialized LeanHead. No
// protobuf message starts with it (it would be a tag of field number 0), so
// the server tells the framings apart by a call's first message, with no
// metadata to send and parse on every call.
inline constexpr char kLeanMarker = '\0';
// The metadata that named the framing up to lean-2; a server refuses a
// client that still sends it.
inline constexpr char kFramingKey[] = "rdmarpc-framing";
// Out-of-band bytes up to this total travel inside the head (copied), not as
// chunk messages: below it a gRPC message costs more than the copy (see
// docs/design.md, "gRPC transport").
inline constexpr uint64_t kLeanHeadChunkBytes = 16 << 10;
// On a call re-sent after its RDMA connection failed:
// "<client id>.<server instance>.<ms since first sent>" (see call_log.h).
inline constexpr char kResendKey[] = "rdmarpc-resend";

// Parses head.message() into `msg` and checks and binds its tensors as the
// head describes them (see internal::AcceptIncoming for the arguments).
// `supplied[k]`, when not empty, is where tensor k lands.
StatusOr<internal::IncomingResult> AcceptHead(
    const LeanHead& head, google::protobuf::Message* msg,
    const internal::TensorPlacement& placement, uint64_t max_bytes,
    std::shared_ptr<const void> owner, CallTensors* tensors,
    std::span<const TensorBuffer> supplied = {});

// The `kResendKey` metadata value: client id (non-zero), the server
// instance the call was first sent to, and its age (at most
// kMaxResendAgeMs, about 35 years, so that time arithmetic on it cannot
// overflow). Nullopt if malformed.
inline constexpr uint64_t kMaxResendAgeMs = uint64_t{1} << 40;
struct ResendMetadata {
  uint64_t client_id = 0;
  uint64_t server_instance = 0;
  uint64_t age_ms = 0;
};
std::optional<ResendMetadata> ParseResendMetadata(std::string_view value);

// A plain gRPC request (every tensor's bytes inline in its data field):
// parses `bytes` into `msg` and checks and binds each tensor against its
// dtype and shape (see internal::AcceptIncoming).
Status AcceptPlainRequest(grpc::ByteBuffer* bytes,
                          google::protobuf::Message* msg,
                          const internal::TensorPlacement& placement,
                          uint64_t max_bytes, std::shared_ptr<const void> owner,
                          CallTensors* tensors);

// Whether `message`, a stream's first message, starts a lean stream (its
// first byte is kLeanMarker); else it is a plain request.
bool StartsLeanStream(grpc::ByteBuffer* message);

class LeanSender {
 public:
  // The messages for `message` (without the tensor bytes of `plan`) and
  // the tensors of `plan`: the head, then chunks of at most `chunk_bytes`,
  // or the head alone when the out-of-band bytes fit kLeanHeadChunkBytes.
  // The head is serialized now, in the thread's reusable LeanHead, so
  // `message` is not used after. `keep` is held by every slice that
  // references tensor memory. INVALID_ARGUMENT if the message or the head
  // cannot be serialized; fails if device memory cannot be copied.
  static StatusOr<LeanSender> Create(
      const google::protobuf::MessageLite& message,
      const internal::OutgoingPlan& plan, uint64_t call_id, size_t chunk_bytes,
      std::shared_ptr<const void> keep);

  // Fills `out` with the next message; false when nothing is left. `*last`
  // tells whether `out` is the final message.
  StatusOr<bool> Next(grpc::ByteBuffer* out, bool* last);

  uint64_t cpu_copied_bytes() const { return copied_; }

 private:
  LeanSender(size_t chunk_bytes, std::shared_ptr<const void> keep)
      : chunk_bytes_(chunk_bytes), keep_(std::move(keep)) {}
  bool Done() const;
  void SkipEmpty();

  // The serialized head (never empty: it starts with kLeanMarker), until
  // it is sent.
  grpc::Slice head_;
  std::vector<TensorBuffer> out_of_band_;
  size_t chunk_bytes_;
  std::shared_ptr<const void> keep_;
  size_t tensor_ = 0;
  uint64_t offset_ = 0;
  uint64_t copied_ = 0;
};

class LeanReceiver {
 public:
  // Called with the head; returns the landing buffers of the out-of-band
  // tensors in order (see internal::AcceptIncoming).
  using HeadHandler =
      std::function<StatusOr<std::vector<TensorBuffer>>(const LeanHead&)>;

  explicit LeanReceiver(HeadHandler on_head) : on_head_(std::move(on_head)) {}

  // Feeds one received message, which it may consume (the head is parsed
  // out of it). INVALID_ARGUMENT for a malformed head or more bytes than
  // announced; errors from the head handler pass through.
  Status OnMessage(grpc::ByteBuffer* message);
  // The peer finished sending: INVALID_ARGUMENT unless the head and every
  // announced byte arrived.
  Status OnEnd() const;
  // Whether the head and every byte it announced arrived: the receiving
  // side acts then, without waiting for the peer's end of stream.
  bool complete() const { return head_seen_ && tensor_ >= landing_.size(); }

  uint64_t cpu_copied_bytes() const { return copied_; }

 private:
  Status OnHead(grpc::ByteBuffer* message);
  Status OnChunk(const grpc::ByteBuffer& message);
  // Copies tensor bytes into the landing buffers where the last ones ended.
  Status Land(const char* src, size_t size);

  HeadHandler on_head_;
  bool head_seen_ = false;
  std::vector<TensorBuffer> landing_;
  size_t tensor_ = 0;
  uint64_t offset_ = 0;
  uint64_t copied_ = 0;
};

}  // namespace rdmarpc::grpc_transport

#endif  // RDMARPC_TRANSPORT_GRPC_LEAN_CODEC_H_
