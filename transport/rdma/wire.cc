#include "transport/rdma/wire.h"

#include <bit>
#include <cassert>
#include <cstring>
#include <initializer_list>
#include <limits>

#include "absl/strings/str_cat.h"
#include "runtime/metadata.h"

namespace rdmarpc::rdma {
namespace {

// Little-endian fields as one load or store: a loop of byte moves with
// shifts (what the compiler kept of the portable form) cost about 50
// instructions per 8-byte field.
template <int kBytes>
void PutLe(uint8_t* p, uint64_t v) {
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(p, &v, kBytes);
  } else {
    for (int i = 0; i < kBytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
  }
}

template <int kBytes>
uint64_t GetLe(const char* p) {
  uint64_t v = 0;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(&v, p, kBytes);
  } else {
    for (int i = 0; i < kBytes; ++i) {
      v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
    }
  }
  return v;
}

Status Malformed(absl::string_view what) {
  return absl::InvalidArgumentError(
      absl::StrCat("malformed RDMA frame: ", what));
}

const char* TypeName(FrameType t) {
  switch (t) {
    case FrameType::kRequest:
      return "request";
    case FrameType::kResponse:
      return "response";
    case FrameType::kGrant:
      return "grant";
    case FrameType::kCredit:
      return "credit";
    case FrameType::kCancel:
      return "cancel";
    case FrameType::kPing:
      return "ping";
    case FrameType::kPong:
      return "pong";
  }
  return "unknown";
}

Status ExpectType(const FrameView& frame, FrameType expected) {
  if (frame.type == expected) return absl::OkStatus();
  return Malformed(absl::StrCat("expected a ", TypeName(expected),
                                " frame, got a ", TypeName(frame.type)));
}

// A protobuf head (grant, cancel).
template <typename Head>
StatusOr<Head> ParseHead(const FrameView& frame, FrameType expected) {
  RDMARPC_RETURN_IF_ERROR(ExpectType(frame, expected));
  Head head;
  if (!head.ParseFromArray(frame.head.data(),
                           static_cast<int>(frame.head.size()))) {
    return Malformed(
        absl::StrCat("the ", TypeName(expected), " head does not parse"));
  }
  return head;
}

// Part 0 is the message; inline parts must account for every inline byte.
Status CheckParts(const Parts& parts, const FrameView& frame) {
  if (parts.empty()) return Malformed("no parts (the message part is missing)");
  uint64_t inline_total = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Part& part = parts[i];
    if (part.in_message) {
      if (i == 0 || part.out_of_band) {
        return Malformed(
            absl::StrCat("part ", i, " cannot lie inside the message"));
      }
      continue;
    }
    if (part.out_of_band) {
      if (part.size == 0) return Malformed("an out-of-band part of 0 bytes");
      continue;
    }
    if (part.size > frame.inline_bytes.size() - inline_total) {
      return Malformed(absl::StrCat("inline parts exceed the ",
                                    frame.inline_bytes.size(),
                                    " inline bytes of the frame"));
    }
    inline_total += part.size;
  }
  if (inline_total != frame.inline_bytes.size()) {
    return Malformed(absl::StrCat("inline parts add up to ", inline_total,
                                  " bytes but the frame carries ",
                                  frame.inline_bytes.size()));
  }
  return absl::OkStatus();
}

// The binary heads (docs/design.md, "Frames"). Each opens with a
// fixed block of kFixedHeadBytes; counts and lengths are u32.
constexpr size_t kFixedHeadBytes = 32;
constexpr uint64_t kPartOutOfBand = uint64_t{1} << 63;
constexpr uint64_t kPartInMessage = uint64_t{1} << 62;
constexpr uint64_t kPartSizeMask = kPartInMessage - 1;
constexpr uint8_t kResponseNotExecuted = 1;

size_t MetadataBytes(const MetadataViews& entries) {
  size_t bytes = 8 * entries.size();
  for (const MetadataView& m : entries) bytes += m.key.size() + m.value.size();
  return bytes;
}

size_t EncodedBytes(const RequestHead& h) {
  return kFixedHeadBytes + kPartBytes * h.parts.size() + h.method.size() +
         MetadataBytes(h.metadata);
}

size_t EncodedBytes(const ResponseHead& h) {
  return kFixedHeadBytes + kPartBytes * h.parts.size() + h.message.size() +
         MetadataBytes(h.initial_metadata) + MetadataBytes(h.trailing_metadata);
}

uint8_t* PutBytes(uint8_t* p, std::string_view bytes) {
  if (!bytes.empty()) std::memcpy(p, bytes.data(), bytes.size());
  return p + bytes.size();
}

uint8_t* PutParts(uint8_t* p, const Parts& parts) {
  for (const Part& part : parts) {
    PutLe<8>(p, (part.size & kPartSizeMask) |
                    (part.out_of_band ? kPartOutOfBand : 0) |
                    (part.in_message ? kPartInMessage : 0));
    p += kPartBytes;
  }
  return p;
}

uint8_t* PutMetadata(uint8_t* p, const MetadataViews& entries) {
  for (const MetadataView& m : entries) {
    PutLe<4>(p, m.key.size());
    PutLe<4>(p + 4, m.value.size());
    p = PutBytes(PutBytes(p + 8, m.key), m.value);
  }
  return p;
}

// Request: u64 call id, i64 timeout, u32 method bytes, u32 metadata
// entries, u32 parts, u32 0; then the parts, the method, the entries.
uint8_t* WriteHead(const RequestHead& h, uint8_t* p) {
  PutLe<8>(p, h.call_id);
  PutLe<8>(p + 8, static_cast<uint64_t>(h.timeout_us));
  PutLe<4>(p + 16, h.method.size());
  PutLe<4>(p + 20, h.metadata.size());
  PutLe<4>(p + 24, h.parts.size());
  PutLe<4>(p + 28, 0);
  p = PutParts(p + kFixedHeadBytes, h.parts);
  return PutMetadata(PutBytes(p, h.method), h.metadata);
}

// Response: u64 call id, u8 code, u8 flags, u16 0, u32 message bytes,
// u32 parts, u32 initial entries, u32 trailing entries, u32 0; then the
// parts, the message, the initial entries, the trailing entries.
uint8_t* WriteHead(const ResponseHead& h, uint8_t* p) {
  PutLe<8>(p, h.call_id);
  p[8] = static_cast<uint8_t>(h.code);
  p[9] = h.not_executed ? kResponseNotExecuted : 0;
  PutLe<2>(p + 10, 0);
  PutLe<4>(p + 12, h.message.size());
  PutLe<4>(p + 16, h.parts.size());
  PutLe<4>(p + 20, h.initial_metadata.size());
  PutLe<4>(p + 24, h.trailing_metadata.size());
  PutLe<4>(p + 28, 0);
  p = PutParts(p + kFixedHeadBytes, h.parts);
  return PutMetadata(PutMetadata(PutBytes(p, h.message), h.initial_metadata),
                     h.trailing_metadata);
}

// Reads a binary head front to back; every read is bounds-checked, and a
// failed one leaves the reader failed.
class HeadReader {
 public:
  HeadReader(std::string_view head, const char* what)
      : rest_(head), what_(what) {}

  uint64_t U64() { return Fixed<8>(); }
  uint32_t U32() { return static_cast<uint32_t>(Fixed<4>()); }
  uint16_t U16() { return static_cast<uint16_t>(Fixed<2>()); }
  uint8_t U8() { return static_cast<uint8_t>(Fixed<1>()); }

  std::string_view Bytes(uint64_t n) {
    if (!Take(n)) return {};
    std::string_view bytes = rest_.substr(0, n);
    rest_.remove_prefix(n);
    return bytes;
  }

  Status ReadParts(uint32_t count, const WireLimits& limits, Parts* parts) {
    if (count > limits.max_parts) {
      return Malformed(absl::StrCat(count, " parts, more than the limit ",
                                    limits.max_parts));
    }
    if (!Take(uint64_t{count} * kPartBytes)) return status();
    parts->resize(count);
    for (Part& part : *parts) {
      const uint64_t word = U64();
      part.size = word & kPartSizeMask;
      part.out_of_band = (word & kPartOutOfBand) != 0;
      part.in_message = (word & kPartInMessage) != 0;
    }
    return absl::OkStatus();
  }

  // `count` is checked against the limits by the caller; a short head
  // shows in Finish.
  void ReadMetadata(uint32_t count, MetadataViews* entries) {
    entries->resize(count);
    for (MetadataView& m : *entries) {
      const uint32_t key_bytes = U32();
      const uint32_t value_bytes = U32();
      m.key = Bytes(key_bytes);
      m.value = Bytes(value_bytes);
    }
  }

  // OK when every read fit and nothing is left over.
  Status Finish() {
    RDMARPC_RETURN_IF_ERROR(status());
    if (!rest_.empty()) {
      return Malformed(absl::StrCat("the ", what_, " head has ", rest_.size(),
                                    " bytes beyond its fields"));
    }
    return absl::OkStatus();
  }

  Status status() const {
    if (!short_) return absl::OkStatus();
    return Malformed(
        absl::StrCat("the ", what_, " head is shorter than its fields"));
  }

 private:
  bool Take(uint64_t n) {
    if (short_ || n > rest_.size()) {
      short_ = true;
      rest_ = {};
      return false;
    }
    return true;
  }

  template <int kBytes>
  uint64_t Fixed() {
    if (!Take(kBytes)) return 0;
    uint64_t v = GetLe<kBytes>(rest_.data());
    rest_.remove_prefix(kBytes);
    return v;
  }

  std::string_view rest_;
  const char* what_;
  bool short_ = false;
};

}  // namespace

FrameHead::FrameHead(const RequestHead* head)
    : head_(head), bytes_(EncodedBytes(*head)) {}
FrameHead::FrameHead(const ResponseHead* head)
    : head_(head), bytes_(EncodedBytes(*head)) {}
FrameHead::FrameHead(const google::protobuf::MessageLite* head)
    : head_(head), bytes_(head->ByteSizeLong()) {}

void FrameHead::WriteTo(uint8_t* out) const {
  uint8_t* end = out;
  switch (head_.index()) {
    case 1:
      end = WriteHead(*std::get<1>(head_), out);
      break;
    case 2:
      end = WriteHead(*std::get<2>(head_), out);
      break;
    case 3:
      // Serialized with the sizes the constructor's ByteSizeLong cached.
      end = std::get<3>(head_)->SerializeWithCachedSizesToArray(out);
      break;
  }
  // A head changed after this was made would write past its frame.
  assert(end == out + bytes_);
  (void)end;
}

StatusOr<size_t> EncodeFrame(
    FrameType type, uint16_t credits, const FrameHead& head,
    std::span<const std::span<const uint8_t>> inline_parts,
    std::span<uint8_t> out, MessagePart message) {
  const size_t head_bytes = head.bytes();
  size_t inline_bytes = message.msg == nullptr ? 0 : message.bytes;
  for (const auto& part : inline_parts) inline_bytes += part.size();
  size_t total = FrameBytes(head_bytes, inline_bytes);
  if (total > out.size() || head_bytes > std::numeric_limits<uint32_t>::max() ||
      inline_bytes > std::numeric_limits<uint32_t>::max()) {
    return absl::ResourceExhaustedError(absl::StrCat(
        "RDMA frame of ", total, " bytes does not fit in ", out.size()));
  }
  uint8_t* p = out.data();
  PutLe<2>(p, kWireMagic);
  p[2] = kWireVersion;
  p[3] = static_cast<uint8_t>(type);
  PutLe<2>(p + 4, credits);
  PutLe<2>(p + 6, 0);
  PutLe<4>(p + 8, head_bytes);
  PutLe<4>(p + 12, inline_bytes);
  p += kPreambleBytes;
  head.WriteTo(p);
  p += head_bytes;
  if (message.msg != nullptr) {
    message.msg->SerializeWithCachedSizesToArray(p);
    p += message.bytes;
  }
  for (const auto& part : inline_parts) {
    if (!part.empty()) std::memcpy(p, part.data(), part.size());
    p += part.size();
  }
  return total;
}

StatusOr<FrameView> DecodeFrame(std::string_view bytes) {
  if (bytes.size() < kPreambleBytes) {
    return Malformed(absl::StrCat(bytes.size(), " bytes, shorter than the ",
                                  kPreambleBytes, "-byte preamble"));
  }
  const char* p = bytes.data();
  if (GetLe<2>(p) != kWireMagic) return Malformed("bad magic");
  if (static_cast<uint8_t>(p[2]) != kWireVersion) {
    return Malformed(absl::StrCat("unsupported version ",
                                  static_cast<int>(static_cast<uint8_t>(p[2])),
                                  " (this side speaks ", kWireVersion, ")"));
  }
  uint8_t type = static_cast<uint8_t>(p[3]);
  if (type < static_cast<uint8_t>(FrameType::kRequest) ||
      type > static_cast<uint8_t>(FrameType::kPong)) {
    return Malformed(absl::StrCat("unknown frame type ", type));
  }
  const uint64_t flags = GetLe<2>(p + 6);
  if ((flags & ~uint64_t{kFlagWantsCredits}) != 0) {
    return Malformed("reserved bits set");
  }
  uint64_t head_bytes = GetLe<4>(p + 8);
  uint64_t inline_bytes = GetLe<4>(p + 12);
  if (kPreambleBytes + head_bytes + inline_bytes != bytes.size()) {
    return Malformed(absl::StrCat(
        "preamble announces ", head_bytes, " head and ", inline_bytes,
        " inline bytes but the frame has ", bytes.size() - kPreambleBytes));
  }
  FrameView view{static_cast<FrameType>(type),
                 static_cast<uint16_t>(GetLe<2>(p + 4)),
                 (flags & kFlagWantsCredits) != 0,
                 bytes.substr(kPreambleBytes, head_bytes),
                 bytes.substr(kPreambleBytes + head_bytes)};
  if (view.type == FrameType::kCredit &&
      (!view.head.empty() || !view.inline_bytes.empty())) {
    return Malformed("a credit frame with a payload");
  }
  if (view.type != FrameType::kRequest && view.type != FrameType::kResponse &&
      !view.inline_bytes.empty()) {
    return Malformed(
        absl::StrCat("a ", TypeName(view.type), " frame with inline bytes"));
  }
  return view;
}

namespace {

// The entries of `sets` together, against the limits; each entry as the
// runtime accepts it (runtime/metadata.h), so a peer cannot hand a user
// what a handler could not have sent.
Status CheckMetadata(std::initializer_list<const MetadataViews*> sets,
                     const WireLimits& limits) {
  size_t bytes = 0;
  for (const MetadataViews* set : sets) {
    for (const MetadataView& m : *set) {
      bytes += m.key.size() + m.value.size();
      Status entry = internal::CheckMetadataEntry(
          absl::string_view(m.key.data(), m.key.size()),
          absl::string_view(m.value.data(), m.value.size()));
      if (!entry.ok()) return Malformed(entry.message());
    }
  }
  if (bytes > limits.max_metadata_bytes) {
    return Malformed(absl::StrCat(bytes,
                                  " bytes of metadata, more than the limit ",
                                  limits.max_metadata_bytes));
  }
  return absl::OkStatus();
}

Status CheckEntryCount(uint64_t entries, const WireLimits& limits) {
  if (entries > limits.max_metadata_entries) {
    return Malformed(absl::StrCat(entries,
                                  " metadata entries, more than the limit ",
                                  limits.max_metadata_entries));
  }
  return absl::OkStatus();
}

}  // namespace

Status ParseRequest(const FrameView& frame, const WireLimits& limits,
                    RequestHead* out) {
  RDMARPC_RETURN_IF_ERROR(ExpectType(frame, FrameType::kRequest));
  RequestHead& head = *out;
  HeadReader in(frame.head, "request");
  head.call_id = in.U64();
  head.timeout_us = static_cast<int64_t>(in.U64());
  const uint32_t method_bytes = in.U32();
  const uint32_t entries = in.U32();
  const uint32_t parts = in.U32();
  const uint32_t reserved = in.U32();
  RDMARPC_RETURN_IF_ERROR(in.status());
  if (reserved != 0) return Malformed("reserved request head bytes set");
  if (head.call_id == 0) return Malformed("request without a call id");
  if (method_bytes == 0 || method_bytes > limits.max_method_bytes) {
    return Malformed(absl::StrCat("method name of ", method_bytes,
                                  " bytes (1 to ", limits.max_method_bytes,
                                  " allowed)"));
  }
  if (head.timeout_us < 0) return Malformed("negative timeout");
  RDMARPC_RETURN_IF_ERROR(CheckEntryCount(entries, limits));
  RDMARPC_RETURN_IF_ERROR(in.ReadParts(parts, limits, &head.parts));
  head.method = in.Bytes(method_bytes);
  in.ReadMetadata(entries, &head.metadata);
  RDMARPC_RETURN_IF_ERROR(in.Finish());
  RDMARPC_RETURN_IF_ERROR(CheckMetadata({&head.metadata}, limits));
  return CheckParts(head.parts, frame);
}

Status ParseResponse(const FrameView& frame, const WireLimits& limits,
                     ResponseHead* out) {
  RDMARPC_RETURN_IF_ERROR(ExpectType(frame, FrameType::kResponse));
  ResponseHead& head = *out;
  HeadReader in(frame.head, "response");
  head.call_id = in.U64();
  head.code = in.U8();
  const uint8_t flags = in.U8();
  const uint16_t reserved_short = in.U16();
  const uint32_t message_bytes = in.U32();
  const uint32_t parts = in.U32();
  const uint32_t initial = in.U32();
  const uint32_t trailing = in.U32();
  const uint32_t reserved = in.U32();
  RDMARPC_RETURN_IF_ERROR(in.status());
  if ((flags & ~kResponseNotExecuted) != 0 || reserved_short != 0 ||
      reserved != 0) {
    return Malformed("reserved response head bits set");
  }
  head.not_executed = (flags & kResponseNotExecuted) != 0;
  if (head.call_id == 0) return Malformed("response without a call id");
  if (head.code > 16) return Malformed(absl::StrCat("status code ", head.code));
  if (message_bytes > limits.max_status_message_bytes) {
    return Malformed(
        absl::StrCat("status message of ", message_bytes, " bytes"));
  }
  RDMARPC_RETURN_IF_ERROR(
      CheckEntryCount(uint64_t{initial} + trailing, limits));
  RDMARPC_RETURN_IF_ERROR(in.ReadParts(parts, limits, &head.parts));
  head.message = in.Bytes(message_bytes);
  in.ReadMetadata(initial, &head.initial_metadata);
  in.ReadMetadata(trailing, &head.trailing_metadata);
  RDMARPC_RETURN_IF_ERROR(in.Finish());
  RDMARPC_RETURN_IF_ERROR(
      CheckMetadata({&head.initial_metadata, &head.trailing_metadata}, limits));
  if (head.code != 0) {
    // An error carries no payload.
    if (!head.parts.empty() || !frame.inline_bytes.empty()) {
      return Malformed("an error response with a payload");
    }
    return absl::OkStatus();
  }
  return CheckParts(head.parts, frame);
}

StatusOr<Grant> ParseGrant(const FrameView& frame, size_t expected_regions) {
  RDMARPC_ASSIGN_OR_RETURN(Grant grant,
                           ParseHead<Grant>(frame, FrameType::kGrant));
  if (grant.call_id() == 0) return Malformed("grant without a call id");
  if (static_cast<size_t>(grant.regions_size()) != expected_regions) {
    return Malformed(absl::StrCat("grant of ", grant.regions_size(),
                                  " regions for ", expected_regions,
                                  " out-of-band parts"));
  }
  for (const auto& r : grant.regions()) {
    if (r.length() == 0) return Malformed("a granted region of 0 bytes");
    if (r.addr() + r.length() < r.addr()) {
      return Malformed("a granted region that wraps around");
    }
  }
  return grant;
}

StatusOr<Cancel> ParseCancel(const FrameView& frame) {
  RDMARPC_ASSIGN_OR_RETURN(Cancel cancel,
                           ParseHead<Cancel>(frame, FrameType::kCancel));
  if (cancel.call_id() == 0) return Malformed("cancel without a call id");
  return cancel;
}

StatusOr<Ping> ParsePing(const FrameView& frame) {
  if (frame.type != FrameType::kPing && frame.type != FrameType::kPong) {
    return Malformed(absl::StrCat("expected a ping or pong, got a ",
                                  TypeName(frame.type), " frame"));
  }
  Ping ping;
  if (!ping.ParseFromArray(frame.head.data(),
                           static_cast<int>(frame.head.size()))) {
    return Malformed("ping head does not parse");
  }
  if (frame.type == FrameType::kPing && ping.running_call_ids_size() > 0) {
    return Malformed("a ping lists call ids");
  }
  if (ping.running_call_ids_size() > kMaxRunningInPong) {
    return Malformed(absl::StrCat("a pong lists ", ping.running_call_ids_size(),
                                  " call ids, more than ", kMaxRunningInPong));
  }
  return ping;
}

}  // namespace rdmarpc::rdma
