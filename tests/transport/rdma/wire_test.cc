// RDMA frames (label unit): every frame type round-trips, and every way a
// peer can get a frame wrong is INVALID_ARGUMENT with a message naming it.
#include "transport/rdma/wire.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace rdmarpc::rdma {
namespace {

std::string Encode(FrameType type, uint16_t credits,
                   const google::protobuf::MessageLite* head,
                   std::vector<std::string> inline_parts = {}) {
  std::vector<std::span<const uint8_t>> spans;
  for (const std::string& p : inline_parts) {
    spans.emplace_back(reinterpret_cast<const uint8_t*>(p.data()), p.size());
  }
  std::vector<uint8_t> out(1 << 16);
  auto n = EncodeFrame(type, credits, head, spans, out);
  EXPECT_TRUE(n.ok()) << n.status();
  return std::string(out.begin(), out.begin() + (n.ok() ? *n : 0));
}

RequestHead Request(std::vector<std::pair<bool, uint64_t>> parts) {
  RequestHead head;
  head.set_call_id(42);
  head.set_method("/pkg.Svc/Run");
  head.set_timeout_us(1500);
  auto* m = head.add_metadata();
  m->set_key("k");
  m->set_value("v");
  for (auto [oob, size] : parts) {
    auto* p = head.add_parts();
    p->set_out_of_band(oob);
    p->set_size(size);
  }
  return head;
}

void ExpectMalformed(const Status& s, const std::string& phrase) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  EXPECT_NE(s.message().find(phrase), std::string::npos)
      << "message was: " << s.message();
}

TEST(WireTest, RequestRoundTripsWithInlineParts) {
  RequestHead head = Request({{false, 3}, {true, 1 << 20}, {false, 5}});
  std::string bytes = Encode(FrameType::kRequest, 7, &head, {"msg", "abcde"});
  auto frame = DecodeFrame(bytes);
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->type, FrameType::kRequest);
  EXPECT_EQ(frame->credits, 7);
  EXPECT_EQ(frame->inline_bytes, "msgabcde");
  RequestHead parsed;
  Status s = ParseRequest(*frame, {}, &parsed);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(parsed.call_id(), 42u);
  EXPECT_EQ(parsed.method(), "/pkg.Svc/Run");
  EXPECT_EQ(parsed.parts_size(), 3);
  EXPECT_EQ(parsed.metadata(0).value(), "v");
}

// The datapath parses into one message per thread: a parse must leave
// nothing of the previous head behind, and a nested use gets its own.
TEST(WireTest, ScratchHeadsStartEmptyAndNestedOnesAreSeparate) {
  RequestHead first = Request({{false, 3}});
  first.set_timeout_us(500);
  std::string bytes = Encode(FrameType::kRequest, 0, &first, {"abc"});
  RequestHead* reused = nullptr;
  {
    ScratchHead<RequestHead> head;
    ASSERT_TRUE(ParseRequest(*DecodeFrame(bytes), {}, &*head).ok());
    EXPECT_EQ(head->timeout_us(), 500);
    reused = &*head;
    ScratchHead<RequestHead> nested;
    EXPECT_NE(&*nested, reused);
    EXPECT_EQ(nested->call_id(), 0u);
  }
  RequestHead second = Request({{false, 0}});
  second.clear_metadata();
  second.set_timeout_us(0);
  bytes = Encode(FrameType::kRequest, 0, &second);
  ScratchHead<RequestHead> head;
  EXPECT_EQ(&*head, reused);
  EXPECT_EQ(head->parts_size(), 0);  // cleared on the way in
  ASSERT_TRUE(ParseRequest(*DecodeFrame(bytes), {}, &*head).ok());
  EXPECT_EQ(head->timeout_us(), 0);
  EXPECT_EQ(head->metadata_size(), 0);
  EXPECT_EQ(head->parts_size(), 1);
}

TEST(WireTest, OtherFramesRoundTrip) {
  ResponseHead response;
  response.set_call_id(9);
  response.add_parts()->set_size(2);
  std::string r_bytes = Encode(FrameType::kResponse, 0, &response, {"hi"});
  auto r = DecodeFrame(r_bytes);
  ASSERT_TRUE(r.ok()) << r.status();
  ResponseHead parsed_response;
  EXPECT_TRUE(ParseResponse(*r, {}, &parsed_response).ok());
  EXPECT_EQ(parsed_response.call_id(), 9u);

  Grant grant;
  grant.set_call_id(9);
  grant.set_grant_id(3);
  auto* region = grant.add_regions();
  region->set_addr(0x1000);
  region->set_rkey(77);
  region->set_length(4096);
  std::string g_bytes = Encode(FrameType::kGrant, 1, &grant);
  auto g = DecodeFrame(g_bytes);
  ASSERT_TRUE(g.ok()) << g.status();
  auto parsed = ParseGrant(*g, 1);
  ASSERT_TRUE(parsed.ok()) << parsed.status();
  EXPECT_EQ(parsed->regions(0).rkey(), 77u);

  std::string c_bytes = Encode(FrameType::kCredit, 31, nullptr);
  auto c = DecodeFrame(c_bytes);
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->credits, 31);

  Cancel cancel;
  cancel.set_call_id(5);
  std::string x_bytes = Encode(FrameType::kCancel, 0, &cancel);
  auto x = DecodeFrame(x_bytes);
  ASSERT_TRUE(x.ok()) << x.status();
  EXPECT_EQ(ParseCancel(*x)->call_id(), 5u);

  Ping ping;
  ping.set_sequence(12);
  for (FrameType type : {FrameType::kPing, FrameType::kPong}) {
    std::string p_bytes = Encode(type, 0, &ping);
    auto p = DecodeFrame(p_bytes);
    ASSERT_TRUE(p.ok()) << p.status();
    EXPECT_EQ(ParsePing(*p)->sequence(), 12u);
  }
  // A ping with inline bytes, or read as a ping when it is not one.
  ExpectMalformed(
      DecodeFrame(Encode(FrameType::kPing, 0, &ping, {"zz"})).status(),
      "a ping frame with inline bytes");
  ExpectMalformed(ParsePing(*x).status(), "expected a ping or pong");
}

TEST(WireTest, MessagePartIsSerializedIntoTheFrameBeforeTheOtherParts) {
  // Any message will do as the call's: a grant stands in for it.
  Grant message;
  message.set_call_id(7);
  message.set_grant_id(9);
  const std::string serialized = message.SerializeAsString();
  RequestHead head = Request({{false, serialized.size()}, {false, 3}});
  const std::string tensor = "abc";
  std::span<const uint8_t> span(reinterpret_cast<const uint8_t*>(tensor.data()),
                                tensor.size());
  std::vector<uint8_t> out(1 << 12);
  auto n = EncodeFrame(FrameType::kRequest, 5, &head, {&span, 1}, out,
                       {&message, message.ByteSizeLong()});
  ASSERT_TRUE(n.ok()) << n.status();
  EXPECT_EQ(*n, FrameBytes(head.ByteSizeLong(), serialized.size() + 3));
  auto frame = DecodeFrame(
      std::string_view(reinterpret_cast<const char*>(out.data()), *n));
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->inline_bytes, serialized + tensor);
  ScratchHead<RequestHead> parsed;
  EXPECT_TRUE(ParseRequest(*frame, WireLimits{}, &*parsed).ok());

  // The message counts toward the room: too big, and nothing is written.
  std::vector<uint8_t> small(FrameBytes(head.ByteSizeLong(), 3));
  auto full = EncodeFrame(FrameType::kRequest, 0, &head, {&span, 1}, small,
                          {&message, message.ByteSizeLong()});
  EXPECT_EQ(full.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(WireTest, FrameThatDoesNotFitIsResourceExhausted) {
  RequestHead head = Request({{false, 100}});
  std::string part(100, 'x');
  std::span<const uint8_t> span(reinterpret_cast<const uint8_t*>(part.data()),
                                part.size());
  std::vector<uint8_t> out(64);
  auto n = EncodeFrame(FrameType::kRequest, 0, &head, {&span, 1}, out);
  EXPECT_EQ(n.status().code(), absl::StatusCode::kResourceExhausted);
}

TEST(WireTest, TheWantsCreditsFlagIsRead) {
  RequestHead head = Request({{false, 0}});
  std::string frame = Encode(FrameType::kRequest, 0, &head);
  auto plain = DecodeFrame(frame);
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_FALSE(plain->wants_credits);
  frame[6] = static_cast<char>(kFlagWantsCredits);
  auto wanting = DecodeFrame(frame);
  ASSERT_TRUE(wanting.ok()) << wanting.status();
  EXPECT_TRUE(wanting->wants_credits);
}

TEST(WireTest, PreambleErrors) {
  RequestHead head = Request({{false, 0}});
  std::string good = Encode(FrameType::kRequest, 0, &head);
  ExpectMalformed(DecodeFrame(good.substr(0, 10)).status(), "shorter than");
  std::string bad = good;
  bad[0] = 'x';
  ExpectMalformed(DecodeFrame(bad).status(), "bad magic");
  bad = good;
  bad[2] = 9;
  ExpectMalformed(DecodeFrame(bad).status(), "unsupported version 9");
  bad = good;
  bad[3] = 0;
  ExpectMalformed(DecodeFrame(bad).status(), "unknown frame type 0");
  bad = good;
  bad[3] = 8;
  ExpectMalformed(DecodeFrame(bad).status(), "unknown frame type 8");
  bad = good;
  bad[7] = 1;
  ExpectMalformed(DecodeFrame(bad).status(), "reserved bits");
  bad = good;
  bad[6] = 2;
  ExpectMalformed(DecodeFrame(bad).status(), "reserved bits");
  ExpectMalformed(DecodeFrame(good + "x").status(), "preamble announces");
  ExpectMalformed(DecodeFrame(good.substr(0, good.size() - 1)).status(),
                  "preamble announces");
  bad = good;
  bad[11] = 0x7f;  // head length near 2 GiB
  ExpectMalformed(DecodeFrame(bad).status(), "preamble announces");
}

TEST(WireTest, CreditGrantAndCancelCarryNoInlineBytes) {
  Cancel cancel;
  cancel.set_call_id(1);
  std::string bytes = Encode(FrameType::kCancel, 0, &cancel);
  bytes[3] = static_cast<char>(FrameType::kCredit);
  ExpectMalformed(DecodeFrame(bytes).status(), "credit frame with a payload");
  bytes = Encode(FrameType::kCancel, 0, &cancel, {"zz"});
  ExpectMalformed(DecodeFrame(bytes).status(), "cancel frame with inline");
}

TEST(WireTest, RequestHeadErrors) {
  auto parse = [](const RequestHead& head, std::vector<std::string> inl = {}) {
    std::string bytes = Encode(FrameType::kRequest, 0, &head, inl);
    auto frame = DecodeFrame(bytes);
    EXPECT_TRUE(frame.ok());
    RequestHead parsed;
    return ParseRequest(*frame, {}, &parsed);
  };
  RequestHead head = Request({});
  ExpectMalformed(parse(head), "message part is missing");
  head = Request({{false, 4}});
  ExpectMalformed(parse(head, {"abc"}), "exceed the 3 inline bytes");
  ExpectMalformed(parse(head, {"abcdef"}), "add up to 4 bytes");
  head = Request({{true, 0}});
  ExpectMalformed(parse(head), "out-of-band part of 0 bytes");
  head = Request({{false, 0}});
  head.set_call_id(0);
  ExpectMalformed(parse(head), "without a call id");
  head = Request({{false, 0}});
  head.set_method(std::string(2000, 'm'));
  ExpectMalformed(parse(head), "method name of 2000 bytes");
  head = Request({{false, 0}});
  head.set_timeout_us(-1);
  ExpectMalformed(parse(head), "negative timeout");
  head = Request({{false, 0}});
  head.mutable_metadata(0)->set_value(std::string(20000, 'v'));
  ExpectMalformed(parse(head), "bytes of metadata");
  head = Request({{false, 0}});
  head.mutable_metadata(0)->set_key("Upper");
  ExpectMalformed(parse(head), "'Upper' has a character");
  head = Request({});
  for (int i = 0; i < 5000; ++i) head.add_parts()->set_size(0);
  ExpectMalformed(parse(head), "5000 parts");
  // A request frame parsed as something else.
  std::string bytes = Encode(FrameType::kRequest, 0, &head);
  ExpectMalformed(ParseGrant(*DecodeFrame(bytes), 0).status(),
                  "expected a grant frame, got a request");
  bytes[16] = '\xff';  // the head no longer parses
  RequestHead parsed;
  ExpectMalformed(ParseRequest(*DecodeFrame(bytes), {}, &parsed),
                  "does not parse");
}

TEST(WireTest, ResponseAndGrantErrors) {
  ResponseHead error;
  error.set_call_id(3);
  error.set_code(5);
  error.set_message("not found");
  // FrameView points into the encoded bytes: keep them alive.
  std::string bytes = Encode(FrameType::kResponse, 0, &error);
  auto frame = DecodeFrame(bytes);
  ResponseHead parsed;
  EXPECT_TRUE(ParseResponse(*frame, {}, &parsed).ok());
  error.add_parts()->set_size(0);
  bytes = Encode(FrameType::kResponse, 0, &error);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseResponse(*frame, {}, &parsed),
                  "error response with a payload");
  ResponseHead bad_code;
  bad_code.set_call_id(3);
  bad_code.set_code(99);
  bytes = Encode(FrameType::kResponse, 0, &bad_code);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseResponse(*frame, {}, &parsed), "status code 99");
  // Response metadata: initial and trailing count together, and each entry
  // follows the rules a handler's does.
  ResponseHead with_metadata;
  with_metadata.set_call_id(3);
  with_metadata.set_code(14);
  for (int i = 0; i < 40; ++i) {
    auto* m = with_metadata.add_initial_metadata();
    m->set_key("k" + std::to_string(i));
    auto* t = with_metadata.add_trailing_metadata();
    t->set_key("t" + std::to_string(i));
  }
  bytes = Encode(FrameType::kResponse, 0, &with_metadata);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseResponse(*frame, {}, &parsed), "80 metadata entries");
  with_metadata.clear_initial_metadata();
  with_metadata.mutable_trailing_metadata(0)->set_value("line\nbreak");
  bytes = Encode(FrameType::kResponse, 0, &with_metadata);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseResponse(*frame, {}, &parsed), "not printable ASCII");
  with_metadata.mutable_trailing_metadata(0)->set_value("fine");
  bytes = Encode(FrameType::kResponse, 0, &with_metadata);
  frame = DecodeFrame(bytes);
  EXPECT_TRUE(ParseResponse(*frame, {}, &parsed).ok());
  EXPECT_EQ(parsed.trailing_metadata_size(), 40);

  Grant grant;
  grant.set_call_id(1);
  auto* r = grant.add_regions();
  r->set_addr(~uint64_t{0} - 10);
  r->set_length(100);
  bytes = Encode(FrameType::kGrant, 0, &grant);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseGrant(*frame, 2).status(), "1 regions for 2");
  ExpectMalformed(ParseGrant(*frame, 1).status(), "wraps around");
  r->set_addr(0);
  r->set_length(0);
  bytes = Encode(FrameType::kGrant, 0, &grant);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseGrant(*frame, 1).status(), "region of 0 bytes");
}

}  // namespace
}  // namespace rdmarpc::rdma
