#include "transport/rdma/wire.h"

#include <cstring>
#include <initializer_list>
#include <limits>

#include "absl/strings/str_cat.h"
#include "runtime/metadata.h"

namespace rdmarpc::rdma {
namespace {

// The width is a template argument so that the compiler merges the byte
// moves into one load or store: a loop over a width passed at run time
// cost about 70 instructions per round trip.
template <int kBytes>
void PutLe(uint8_t* p, uint64_t v) {
  for (int i = 0; i < kBytes; ++i) p[i] = static_cast<uint8_t>(v >> (8 * i));
}

template <int kBytes>
uint64_t GetLe(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < kBytes; ++i) {
    v |= static_cast<uint64_t>(static_cast<uint8_t>(p[i])) << (8 * i);
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

template <typename Head>
Status ParseHeadInto(const FrameView& frame, FrameType expected, Head* head) {
  if (frame.type != expected) {
    return Malformed(absl::StrCat("expected a ", TypeName(expected),
                                  " frame, got a ", TypeName(frame.type)));
  }
  if (!head->ParseFromArray(frame.head.data(),
                            static_cast<int>(frame.head.size()))) {
    return Malformed(
        absl::StrCat("the ", TypeName(expected), " head does not parse"));
  }
  return absl::OkStatus();
}

template <typename Head>
StatusOr<Head> ParseHead(const FrameView& frame, FrameType expected) {
  Head head;
  RDMARPC_RETURN_IF_ERROR(ParseHeadInto(frame, expected, &head));
  return head;
}

// Part 0 is the message; inline parts must account for every inline byte.
Status CheckParts(
    const google::protobuf::RepeatedPtrField<rdmarpc::rdma::Part>& parts,
    const FrameView& frame, const WireLimits& limits) {
  if (parts.empty()) return Malformed("no parts (the message part is missing)");
  if (static_cast<size_t>(parts.size()) > limits.max_parts) {
    return Malformed(absl::StrCat(parts.size(), " parts, more than the limit ",
                                  limits.max_parts));
  }
  uint64_t inline_total = 0;
  for (int i = 0; i < parts.size(); ++i) {
    const auto& part = parts[i];
    if (part.in_message()) {
      if (i == 0 || part.out_of_band()) {
        return Malformed(
            absl::StrCat("part ", i, " cannot lie inside the message"));
      }
      continue;
    }
    if (part.out_of_band()) {
      if (part.size() == 0) return Malformed("an out-of-band part of 0 bytes");
      continue;
    }
    if (part.size() > frame.inline_bytes.size() - inline_total) {
      return Malformed(absl::StrCat("inline parts exceed the ",
                                    frame.inline_bytes.size(),
                                    " inline bytes of the frame"));
    }
    inline_total += part.size();
  }
  if (inline_total != frame.inline_bytes.size()) {
    return Malformed(absl::StrCat("inline parts add up to ", inline_total,
                                  " bytes but the frame carries ",
                                  frame.inline_bytes.size()));
  }
  return absl::OkStatus();
}

}  // namespace

StatusOr<size_t> EncodeFrame(
    FrameType type, uint16_t credits, const google::protobuf::MessageLite* head,
    std::span<const std::span<const uint8_t>> inline_parts,
    std::span<uint8_t> out, MessagePart message) {
  return EncodeFrameSized(type, credits, head,
                          head == nullptr ? 0 : head->ByteSizeLong(), message,
                          inline_parts, out);
}

StatusOr<size_t> EncodeFrameSized(
    FrameType type, uint16_t credits, const google::protobuf::MessageLite* head,
    size_t head_bytes, MessagePart message,
    std::span<const std::span<const uint8_t>> inline_parts,
    std::span<uint8_t> out) {
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
  if (head != nullptr) {
    head->SerializeWithCachedSizesToArray(p);
    p += head_bytes;
  }
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
Status CheckMetadata(
    std::initializer_list<const google::protobuf::RepeatedPtrField<Metadata>*>
        sets,
    const WireLimits& limits) {
  size_t entries = 0;
  size_t bytes = 0;
  for (const auto* set : sets) {
    entries += set->size();
    if (entries > limits.max_metadata_entries) {
      return Malformed(absl::StrCat(entries,
                                    " metadata entries, more than the limit ",
                                    limits.max_metadata_entries));
    }
    for (const Metadata& m : *set) {
      bytes += m.key().size() + m.value().size();
      Status entry = internal::CheckMetadataEntry(m.key(), m.value());
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

}  // namespace

Status ParseRequest(const FrameView& frame, const WireLimits& limits,
                    RequestHead* out) {
  RDMARPC_RETURN_IF_ERROR(ParseHeadInto(frame, FrameType::kRequest, out));
  const RequestHead& head = *out;
  if (head.call_id() == 0) return Malformed("request without a call id");
  if (head.method().empty() || head.method().size() > limits.max_method_bytes) {
    return Malformed(absl::StrCat("method name of ", head.method().size(),
                                  " bytes (1 to ", limits.max_method_bytes,
                                  " allowed)"));
  }
  if (head.timeout_us() < 0) return Malformed("negative timeout");
  RDMARPC_RETURN_IF_ERROR(CheckMetadata({&head.metadata()}, limits));
  RDMARPC_RETURN_IF_ERROR(CheckParts(head.parts(), frame, limits));
  return absl::OkStatus();
}

Status ParseResponse(const FrameView& frame, const WireLimits& limits,
                     ResponseHead* out) {
  RDMARPC_RETURN_IF_ERROR(ParseHeadInto(frame, FrameType::kResponse, out));
  const ResponseHead& head = *out;
  if (head.call_id() == 0) return Malformed("response without a call id");
  if (head.code() < 0 || head.code() > 16) {
    return Malformed(absl::StrCat("status code ", head.code()));
  }
  if (head.message().size() > limits.max_status_message_bytes) {
    return Malformed(
        absl::StrCat("status message of ", head.message().size(), " bytes"));
  }
  RDMARPC_RETURN_IF_ERROR(CheckMetadata(
      {&head.initial_metadata(), &head.trailing_metadata()}, limits));
  if (head.code() != 0) {
    // An error carries no payload.
    if (!head.parts().empty() || !frame.inline_bytes.empty()) {
      return Malformed("an error response with a payload");
    }
    return absl::OkStatus();
  }
  RDMARPC_RETURN_IF_ERROR(CheckParts(head.parts(), frame, limits));
  return absl::OkStatus();
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
