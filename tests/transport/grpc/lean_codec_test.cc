// LeanSender and LeanReceiver against each other: how many gRPC messages a
// call's tensors take, and that every byte lands where it belongs.
#include "transport/grpc/lean_codec.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <new>
#include <numeric>
#include <string>
#include <vector>

namespace rdmarpc::grpc_transport {
namespace {

// The largest single allocation made while watched (operator new below).
std::atomic<bool> watch_allocations{false};
std::atomic<size_t> largest_allocation{0};

struct RoundTrip {
  int messages = 0;  // head included
  uint64_t sender_copied = 0;
  std::vector<TensorBuffer> landed;
};

// Sends tensors of `sizes` (all out of band, bytes 0, 1, 2, ... per tensor)
// with 1 MiB chunks and feeds every message to a receiver.
RoundTrip Send(const std::vector<uint64_t>& sizes) {
  internal::OutgoingPlan plan;
  for (uint64_t size : sizes) {
    auto buffer = TensorBuffer::Allocate(size);
    EXPECT_TRUE(buffer.ok()) << buffer.status();
    auto* bytes = static_cast<uint8_t*>(buffer->data());
    for (uint64_t i = 0; i < size; ++i) bytes[i] = static_cast<uint8_t>(i);
    plan.tensors.push_back({true, size, *buffer});
    plan.total_bytes += size;
  }
  RoundTrip out;
  // Any message will do as the call's own: here one of the framing's.
  TensorPart call_message;
  call_message.set_size(12345);
  auto sender =
      LeanSender::Create(call_message, plan, 7, size_t{1} << 20, nullptr);
  EXPECT_TRUE(sender.ok()) << sender.status();
  LeanReceiver receiver(
      [&](const LeanHead& head) -> StatusOr<std::vector<TensorBuffer>> {
        EXPECT_EQ(head.message(), call_message.SerializeAsString());
        EXPECT_EQ(head.call_id(), 7u);
        std::vector<TensorBuffer> landing;
        for (const TensorPart& part : head.tensors()) {
          RDMARPC_ASSIGN_OR_RETURN(TensorBuffer b,
                                   TensorBuffer::Allocate(part.size()));
          landing.push_back(b);
        }
        out.landed = landing;
        return landing;
      });
  grpc::ByteBuffer message;
  bool last = false;
  while (!last) {
    auto more = sender->Next(&message, &last);
    EXPECT_TRUE(more.ok() && *more) << "the sender stopped before its last";
    if (!more.ok() || !*more) break;
    ++out.messages;
    Status s = receiver.OnMessage(&message);
    EXPECT_TRUE(s.ok()) << s;
  }
  EXPECT_TRUE(receiver.complete());
  EXPECT_TRUE(receiver.OnEnd().ok());
  out.sender_copied = sender->cpu_copied_bytes();
  return out;
}

void ExpectLanded(const RoundTrip& trip, const std::vector<uint64_t>& sizes) {
  ASSERT_EQ(trip.landed.size(), sizes.size());
  for (size_t t = 0; t < sizes.size(); ++t) {
    ASSERT_EQ(trip.landed[t].size(), sizes[t]);
    const auto* bytes = static_cast<const uint8_t*>(trip.landed[t].data());
    for (uint64_t i = 0; i < sizes[t]; ++i) {
      ASSERT_EQ(bytes[i], static_cast<uint8_t>(i))
          << "tensor " << t << " byte " << i;
    }
  }
}

TEST(LeanCodecTest, SmallTensorsTravelInTheHead) {
  std::vector<uint64_t> sizes = {64, 0, kLeanHeadChunkBytes - 64};
  RoundTrip trip = Send(sizes);
  EXPECT_EQ(trip.messages, 1);
  EXPECT_EQ(trip.sender_copied, kLeanHeadChunkBytes);
  ExpectLanded(trip, sizes);
}

TEST(LeanCodecTest, OneByteOverTheHeadLimitGoesInChunks) {
  std::vector<uint64_t> sizes = {64, kLeanHeadChunkBytes - 63};
  RoundTrip trip = Send(sizes);
  EXPECT_EQ(trip.messages, 3);  // the head, then one chunk per tensor
  EXPECT_EQ(trip.sender_copied, 0u) << "host chunks are referenced, not copied";
  ExpectLanded(trip, sizes);
}

TEST(LeanCodecTest, LargeTensorsAreSplitIntoChunks) {
  std::vector<uint64_t> sizes = {(uint64_t{5} << 20) / 2};  // 2.5 MiB
  RoundTrip trip = Send(sizes);
  EXPECT_EQ(trip.messages, 4);  // the head and 3 chunks of at most 1 MiB
  ExpectLanded(trip, sizes);
}

TEST(LeanCodecTest, NoTensorsIsTheHeadAlone) {
  RoundTrip trip = Send({});
  EXPECT_EQ(trip.messages, 1);
}

grpc::ByteBuffer Buffer(const std::string& bytes) {
  grpc::Slice slice(bytes);
  return grpc::ByteBuffer(&slice, 1);
}

// The server tells the framings apart by the first byte: a plain request
// never starts with the marker, since protobuf refuses a message that does
// (a tag of field number 0), whatever its type and whatever follows.
TEST(LeanCodecTest, NoProtobufMessageStartsWithTheLeanMarker) {
  TensorPart part;
  part.set_size(5);
  LeanHead head;
  head.set_message("bytes");
  for (const std::string& rest :
       {std::string(), part.SerializeAsString(), head.SerializeAsString()}) {
    const std::string marked = kLeanMarker + rest;
    EXPECT_FALSE(TensorPart().ParseFromString(marked));
    EXPECT_FALSE(LeanHead().ParseFromString(marked));
    grpc::ByteBuffer buffer = Buffer(marked);
    EXPECT_TRUE(StartsLeanStream(&buffer));
    grpc::ByteBuffer plain = Buffer(rest);
    EXPECT_FALSE(StartsLeanStream(&plain));
  }
}

TEST(LeanCodecTest, AHeadWithoutTheMarkerIsRefused) {
  TensorPart call_message;
  auto sender = LeanSender::Create(call_message, {}, 1, 4096, nullptr);
  ASSERT_TRUE(sender.ok()) << sender.status();
  grpc::ByteBuffer message;
  bool last = false;
  ASSERT_TRUE(*sender->Next(&message, &last));
  std::vector<grpc::Slice> slices;
  ASSERT_TRUE(message.Dump(&slices).ok());
  std::string bytes;
  for (const grpc::Slice& s : slices) {
    bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  }
  ASSERT_EQ(bytes[0], kLeanMarker);
  grpc::ByteBuffer unmarked = Buffer(bytes.substr(1));
  LeanReceiver receiver(
      [](const LeanHead&) -> StatusOr<std::vector<TensorBuffer>> {
        return std::vector<TensorBuffer>{};
      });
  Status s = receiver.OnMessage(&unmarked);
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("lean marker"), std::string::npos) << s;
}

// A peer's head that claims a 40 MB field in a few bytes is refused without
// reserving what it claims (protobuf, reading an unbounded stream, reserves
// a string field's claimed length up to 50 MB).
TEST(LeanCodecTest, AClaimedLengthIsNotReservedBeyondTheMessage) {
#ifdef RDMARPC_SANITIZED
  GTEST_SKIP() << "counts allocations through its own operator new, which "
                  "the sanitizers' would clash with";
#endif
  std::string bytes(1, kLeanMarker);
  bytes += '\x12';  // LeanHead.message, length-delimited
  for (uint32_t n = 40'000'000;; n >>= 7) {
    if (n < 0x80) {
      bytes += static_cast<char>(n);
      break;
    }
    bytes += static_cast<char>(n | 0x80);
  }
  bytes += "and then only these bytes";
  grpc::ByteBuffer message = Buffer(bytes);
  LeanReceiver receiver(
      [](const LeanHead&) -> StatusOr<std::vector<TensorBuffer>> {
        return std::vector<TensorBuffer>{};
      });
  largest_allocation = 0;
  watch_allocations = true;
  Status s = receiver.OnMessage(&message);
  watch_allocations = false;
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument) << s;
  EXPECT_LT(largest_allocation.load(), size_t{1} << 20);
}

// A re-send's metadata: an age past kMaxResendAgeMs (which time arithmetic
// on it could overflow) is malformed, as is client id 0.
TEST(ResendMetadata, AnAgePastTheBoundIsMalformed) {
  auto ok = ParseResendMetadata("5.7.1000");
  ASSERT_TRUE(ok.has_value());
  EXPECT_EQ(ok->client_id, 5u);
  EXPECT_EQ(ok->server_instance, 7u);
  EXPECT_EQ(ok->age_ms, 1000u);
  EXPECT_TRUE(ParseResendMetadata("5.7." + std::to_string(kMaxResendAgeMs))
                  .has_value());
  EXPECT_FALSE(ParseResendMetadata("5.7." + std::to_string(kMaxResendAgeMs + 1))
                   .has_value());
  EXPECT_FALSE(ParseResendMetadata("5.7.18446744073709551615").has_value());
  EXPECT_FALSE(ParseResendMetadata("0.7.10").has_value());
}

}  // namespace
}  // namespace rdmarpc::grpc_transport

#ifndef RDMARPC_SANITIZED
// Every allocation of the test goes through this, so that a test can see
// the largest one (the default operator delete frees what malloc gave).
// The sanitizers bring their own.
void* operator new(size_t size) {
  using rdmarpc::grpc_transport::largest_allocation;
  if (rdmarpc::grpc_transport::watch_allocations.load()) {
    size_t seen = largest_allocation.load();
    while (size > seen &&
           !largest_allocation.compare_exchange_weak(seen, size)) {
    }
  }
  if (void* p = std::malloc(size == 0 ? 1 : size)) return p;
  throw std::bad_alloc();
}
#endif
