#include "transport/grpc/lean_codec.h"

#include <grpcpp/support/proto_buffer_reader.h>
#include <grpcpp/support/slice.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "runtime/scratch_message.h"
#include "runtime/tensor_walk.h"

namespace rdmarpc::grpc_transport {

std::optional<ResendMetadata> ParseResendMetadata(std::string_view value) {
  std::vector<absl::string_view> fields =
      absl::StrSplit(absl::string_view(value.data(), value.size()), '.');
  ResendMetadata r;
  if (fields.size() != 3 || !absl::SimpleAtoi(fields[0], &r.client_id) ||
      !absl::SimpleAtoi(fields[1], &r.server_instance) ||
      !absl::SimpleAtoi(fields[2], &r.age_ms) || r.client_id == 0 ||
      r.age_ms > kMaxResendAgeMs) {
    return std::nullopt;
  }
  return r;
}

namespace {

// Parses the `size` bytes left in `reader`. Bounded by them, protobuf sizes
// a string field by the bytes there are: from an unbounded stream it
// reserves what the field's length claims, up to 50 MB per field, whatever
// the message's real size.
bool ParseBounded(grpc::ProtoBufferReader* reader, size_t size,
                  google::protobuf::MessageLite* msg) {
  return size <= static_cast<size_t>(std::numeric_limits<int>::max()) &&
         msg->ParseFromBoundedZeroCopyStream(reader, static_cast<int>(size));
}

}  // namespace

Status AcceptPlainRequest(grpc::ByteBuffer* bytes,
                          google::protobuf::Message* msg,
                          const internal::TensorPlacement& placement,
                          uint64_t max_bytes, std::shared_ptr<const void> owner,
                          CallTensors* tensors) {
  grpc::ProtoBufferReader reader(bytes);
  if (!ParseBounded(&reader, bytes->Length(), msg)) {
    return absl::InvalidArgumentError(
        absl::StrCat("request does not parse as ", msg->GetTypeName()));
  }
  // A plain peer sends every tensor inline; AcceptIncoming checks each
  // against its dtype and shape.
  internal::WalkedTensors walked;
  RDMARPC_RETURN_IF_ERROR(internal::WalkForPlacement(msg, placement, &walked));
  std::vector<internal::IncomingPart> parts;
  parts.reserve(walked.fields.size());
  for (const Tensor* t : walked.fields) {
    parts.push_back({false, t->data().size(), {}});
  }
  return internal::AcceptIncoming(msg, walked, parts, placement, max_bytes,
                                  std::move(owner), tensors)
      .status();
}
namespace {

// What a no-copy slice keeps alive until gRPC drops it.
struct SliceRef {
  TensorBuffer bytes;
  std::shared_ptr<const void> keep;
};

void ReleaseSlice(void* p) { delete static_cast<SliceRef*>(p); }

grpc::Slice ReferenceSlice(TensorBuffer bytes,
                           std::shared_ptr<const void> keep) {
  void* data = bytes.data();
  size_t size = bytes.size();
  auto* ref = new SliceRef{std::move(bytes), std::move(keep)};
  return grpc::Slice(data, size, &ReleaseSlice, ref);
}

// The thread's reusable LeanHead (runtime/scratch_message.h). A head may be
// large (its message is bounded by gRPC's limit only, a peer's first chunk
// too): the thread keeps at most kKeptBytes of strings and kKeptParts
// parts once it is done with one.
class ScratchLeanHead {
 public:
  ScratchLeanHead() = default;
  ScratchLeanHead(const ScratchLeanHead&) = delete;
  ScratchLeanHead& operator=(const ScratchLeanHead&) = delete;
  ~ScratchLeanHead() {
    if (head_->message().capacity() > kKeptBytes ||
        head_->first_chunk().capacity() > kKeptBytes ||
        head_->tensors_size() > kKeptParts) {
      LeanHead released;
      head_->Swap(&released);
    }
  }

  LeanHead& operator*() const { return *head_; }
  LeanHead* operator->() const { return &*head_; }

 private:
  static constexpr size_t kKeptBytes = 64 << 10;
  static constexpr int kKeptParts = 256;
  internal::ScratchMessage<LeanHead> head_;
};

}  // namespace

StatusOr<internal::IncomingResult> AcceptHead(
    const LeanHead& head, google::protobuf::Message* msg,
    const internal::TensorPlacement& placement, uint64_t max_bytes,
    std::shared_ptr<const void> owner, CallTensors* tensors,
    std::span<const TensorBuffer> supplied) {
  if (!msg->ParseFromString(head.message())) {
    return absl::InvalidArgumentError(
        absl::StrCat("message does not parse as ", msg->GetTypeName()));
  }
  std::vector<internal::IncomingPart> parts;
  parts.reserve(head.tensors_size());
  for (const TensorPart& p : head.tensors()) {
    TensorBuffer landing;
    if (parts.size() < supplied.size()) landing = supplied[parts.size()];
    parts.push_back({p.out_of_band(), p.size(), std::move(landing)});
  }
  return internal::AcceptIncoming(msg, parts, placement, max_bytes,
                                  std::move(owner), tensors);
}

StatusOr<LeanSender> LeanSender::Create(
    const google::protobuf::MessageLite& message,
    const internal::OutgoingPlan& plan, uint64_t call_id, size_t chunk_bytes,
    std::shared_ptr<const void> keep) {
  ScratchLeanHead head;
  head->set_version(kLeanVersion);
  if (!message.SerializeToString(head->mutable_message())) {
    return absl::InvalidArgumentError(
        "the message cannot be serialized (over protobuf's 2 GiB limit "
        "without its tensors?)");
  }
  head->set_call_id(call_id);
  uint64_t out_of_band_bytes = 0;
  for (const internal::OutgoingTensor& t : plan.tensors) {
    TensorPart* part = head->add_tensors();
    part->set_out_of_band(t.out_of_band);
    part->set_size(t.size);
    if (t.out_of_band) out_of_band_bytes += t.size;
  }
  LeanSender sender(std::max<size_t>(chunk_bytes, 4096), std::move(keep));
  if (out_of_band_bytes > kLeanHeadChunkBytes) {
    for (const internal::OutgoingTensor& t : plan.tensors) {
      if (t.out_of_band) sender.out_of_band_.push_back(t.buffer);
    }
    sender.SkipEmpty();
  } else if (out_of_band_bytes > 0) {
    std::string* chunk = head->mutable_first_chunk();
    chunk->resize(out_of_band_bytes);
    char* dst = chunk->data();
    for (const internal::OutgoingTensor& t : plan.tensors) {
      if (!t.out_of_band) continue;
      RDMARPC_RETURN_IF_ERROR(CopyBytes(dst, Device::Host(), t.buffer.data(),
                                        t.buffer.device(), t.size));
      dst += t.size;
    }
    sender.copied_ = out_of_band_bytes;
  }
  size_t bytes = head->ByteSizeLong();
  if (bytes > static_cast<size_t>(std::numeric_limits<int>::max())) {
    return absl::InvalidArgumentError(
        "message is too large to serialize (protobuf's 2 GiB limit applies "
        "to the non-tensor fields)");
  }
  // Serialized straight into the slice gRPC sends (a small one is inline).
  sender.head_ = grpc::Slice(bytes + 1);
  auto* out = const_cast<uint8_t*>(sender.head_.begin());
  out[0] = kLeanMarker;
  head->SerializeWithCachedSizesToArray(out + 1);
  return sender;
}

void LeanSender::SkipEmpty() {
  while (tensor_ < out_of_band_.size() &&
         offset_ >= out_of_band_[tensor_].size()) {
    ++tensor_;
    offset_ = 0;
  }
}

bool LeanSender::Done() const {
  return head_.size() == 0 && tensor_ >= out_of_band_.size();
}

StatusOr<bool> LeanSender::Next(grpc::ByteBuffer* out, bool* last) {
  if (Done()) return false;
  if (head_.size() > 0) {
    grpc::ByteBuffer(&head_, 1).Swap(out);
    head_ = grpc::Slice();
    *last = Done();
    return true;
  }
  const TensorBuffer& t = out_of_band_[tensor_];
  size_t n =
      static_cast<size_t>(std::min<uint64_t>(chunk_bytes_, t.size() - offset_));
  TensorBuffer chunk = t.Slice(offset_, n);
  if (!chunk.device().is_host()) {
    // Stage device memory through host memory.
    RDMARPC_ASSIGN_OR_RETURN(TensorBuffer staged, TensorBuffer::Allocate(n));
    RDMARPC_RETURN_IF_ERROR(CopyBytes(staged.data(), Device::Host(),
                                      chunk.data(), chunk.device(), n));
    copied_ += n;
    chunk = std::move(staged);
  }
  grpc::Slice slice = ReferenceSlice(std::move(chunk), keep_);
  grpc::ByteBuffer(&slice, 1).Swap(out);
  offset_ += n;
  SkipEmpty();
  *last = Done();
  return true;
}

namespace {

// Reads the first byte: true, past it, when it is kLeanMarker.
bool SkipLeanMarker(grpc::ProtoBufferReader* reader) {
  const void* data = nullptr;
  int size = 0;
  while (reader->Next(&data, &size)) {
    if (size == 0) continue;
    reader->BackUp(size - 1);
    return *static_cast<const char*>(data) == kLeanMarker;
  }
  return false;
}

}  // namespace

bool StartsLeanStream(grpc::ByteBuffer* message) {
  grpc::ProtoBufferReader reader(message);
  return SkipLeanMarker(&reader);
}

Status LeanReceiver::OnMessage(grpc::ByteBuffer* message) {
  return head_seen_ ? OnChunk(*message) : OnHead(message);
}

Status LeanReceiver::OnHead(grpc::ByteBuffer* message) {
  head_seen_ = true;
  ScratchLeanHead head;
  size_t length = message->Length();
  grpc::ProtoBufferReader reader(message);
  if (!SkipLeanMarker(&reader)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lean framing: the first message (", length,
                     " bytes) does not start with the lean marker byte 0"));
  }
  if (!ParseBounded(&reader, length - 1, &*head)) {
    return absl::InvalidArgumentError(
        absl::StrCat("lean framing: the first message (", length,
                     " bytes) is not a valid LeanHead"));
  }
  if (head->version() != kLeanVersion) {
    return absl::InvalidArgumentError(
        absl::StrCat("lean framing: unsupported version ", head->version(),
                     " (this side speaks ", kLeanVersion, ")"));
  }
  RDMARPC_ASSIGN_OR_RETURN(landing_, on_head_(*head));
  while (tensor_ < landing_.size() && landing_[tensor_].empty()) ++tensor_;
  return Land(head->first_chunk().data(), head->first_chunk().size());
}

Status LeanReceiver::OnChunk(const grpc::ByteBuffer& message) {
  std::vector<grpc::Slice> slices;
  if (!message.Dump(&slices).ok()) {
    return absl::InvalidArgumentError("lean framing: unreadable chunk");
  }
  for (const grpc::Slice& s : slices) {
    RDMARPC_RETURN_IF_ERROR(
        Land(reinterpret_cast<const char*>(s.begin()), s.size()));
  }
  return absl::OkStatus();
}

Status LeanReceiver::Land(const char* src, size_t size) {
  while (size > 0) {
    if (tensor_ >= landing_.size()) {
      return absl::InvalidArgumentError(
          "lean framing: peer sent more tensor bytes than its head "
          "announced");
    }
    TensorBuffer& dst = landing_[tensor_];
    size_t n =
        static_cast<size_t>(std::min<uint64_t>(size, dst.size() - offset_));
    RDMARPC_RETURN_IF_ERROR(CopyBytes(static_cast<char*>(dst.data()) + offset_,
                                      dst.device(), src, Device::Host(), n));
    copied_ += n;
    src += n;
    size -= n;
    offset_ += n;
    while (tensor_ < landing_.size() && offset_ >= landing_[tensor_].size()) {
      ++tensor_;
      offset_ = 0;
    }
  }
  return absl::OkStatus();
}

Status LeanReceiver::OnEnd() const {
  if (!head_seen_) {
    return absl::InvalidArgumentError("lean framing: peer sent no head");
  }
  if (tensor_ < landing_.size()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "lean framing: peer stopped before sending all tensor bytes (tensor ",
        tensor_, " of ", landing_.size(), " out-of-band, at byte ", offset_,
        ")"));
  }
  return absl::OkStatus();
}

}  // namespace rdmarpc::grpc_transport
