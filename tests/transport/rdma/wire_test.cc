// RDMA frames (label unit): every frame type round-trips, and every way a
// peer can get a frame wrong is INVALID_ARGUMENT with a message naming it.
#include "transport/rdma/wire.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace rdmarpc::rdma {
namespace {

std::string Encode(FrameType type, uint16_t credits, const FrameHead& head,
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

Part MakePart(uint64_t size, bool out_of_band = false,
              bool in_message = false) {
  Part part;
  part.size = size;
  part.out_of_band = out_of_band;
  part.in_message = in_message;
  return part;
}

RequestHead Request(std::vector<std::pair<bool, uint64_t>> parts) {
  RequestHead head;
  head.call_id = 42;
  head.method = "/pkg.Svc/Run";
  head.timeout_us = 1500;
  head.metadata.push_back({"k", "v"});
  for (auto [oob, size] : parts) {
    head.parts.push_back(MakePart(size, oob));
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
  EXPECT_EQ(parsed.call_id, 42u);
  EXPECT_EQ(parsed.method, "/pkg.Svc/Run");
  EXPECT_EQ(parsed.timeout_us, 1500);
  ASSERT_EQ(parsed.parts.size(), 3u);
  EXPECT_EQ(parsed.parts[1].size, uint64_t{1} << 20);
  EXPECT_TRUE(parsed.parts[1].out_of_band);
  EXPECT_FALSE(parsed.parts[2].out_of_band);
  ASSERT_EQ(parsed.metadata.size(), 1u);
  EXPECT_EQ(parsed.metadata[0].key, "k");
  EXPECT_EQ(parsed.metadata[0].value, "v");
}

// The heads' layouts are a contract with peers of other builds: the bytes
// of one request and one response, field by field (docs/design.md, "Wire
// protocol").
TEST(WireTest, CallHeadsHaveTheDocumentedLayout) {
  RequestHead request;
  request.call_id = 0x0102030405060708;
  request.method = "/a.B/C";
  request.timeout_us = 1000;
  request.metadata.push_back({"k", "vv"});
  request.parts.push_back(MakePart(5));
  request.parts.push_back(MakePart(4096, true));
  request.parts.push_back(MakePart(3, false, true));
  std::string bytes = Encode(FrameType::kRequest, 0, &request, {"hello"});
  const std::string head =
      bytes.substr(kPreambleBytes, bytes.size() - kPreambleBytes - 5);
  const std::string expected_request = std::string(
      "\x08\x07\x06\x05\x04\x03\x02\x01"  // call id
      "\xe8\x03\0\0\0\0\0\0"              // timeout 1000 us
      "\x06\0\0\0"                        // method bytes
      "\x01\0\0\0"                        // metadata entries
      "\x03\0\0\0"                        // parts
      "\0\0\0\0"                          // reserved
      "\x05\0\0\0\0\0\0\0"                // part 0: 5 bytes inline
      "\0\x10\0\0\0\0\0\x80"              // part 1: out of band
      "\x03\0\0\0\0\0\0\x40"              // part 2: in the message
      "/a.B/C"
      "\x01\0\0\0\x02\0\0\0kvv",
      32 + 24 + 6 + 11);
  EXPECT_EQ(head, expected_request);

  ResponseHead response;
  response.call_id = 9;
  response.code = 5;
  response.message = "gone";
  response.not_executed = true;
  response.trailing_metadata.push_back({"t", ""});
  bytes = Encode(FrameType::kResponse, 0, &response);
  const std::string expected_response = std::string(
      "\x09\0\0\0\0\0\0\0"  // call id
      "\x05\x01\0\0"        // code, flags (not executed), reserved
      "\x04\0\0\0"          // message bytes
      "\0\0\0\0"            // parts
      "\0\0\0\0"            // initial metadata entries
      "\x01\0\0\0"          // trailing metadata entries
      "\0\0\0\0"            // reserved
      "gone"
      "\x01\0\0\0\0\0\0\0t",
      32 + 4 + 9);
  EXPECT_EQ(bytes.substr(kPreambleBytes), expected_response);
  ResponseHead parsed;
  ASSERT_TRUE(ParseResponse(*DecodeFrame(bytes), {}, &parsed).ok());
  EXPECT_EQ(parsed.code, 5);
  EXPECT_EQ(parsed.message, "gone");
  EXPECT_TRUE(parsed.not_executed);
  ASSERT_EQ(parsed.trailing_metadata.size(), 1u);
  EXPECT_EQ(parsed.trailing_metadata[0].key, "t");
  EXPECT_TRUE(parsed.initial_metadata.empty());
}

// A head parsed into one that held another frame's keeps nothing of it.
TEST(WireTest, ParsingReplacesWhatTheHeadHeld) {
  RequestHead first = Request({{false, 3}, {true, 9}});
  first.metadata.push_back({"k2", "v2"});
  std::string first_bytes = Encode(FrameType::kRequest, 0, &first, {"abc"});
  RequestHead second = Request({{false, 0}});
  second.metadata.clear();
  second.timeout_us = 0;
  std::string second_bytes = Encode(FrameType::kRequest, 0, &second);
  RequestHead head;
  ASSERT_TRUE(ParseRequest(*DecodeFrame(first_bytes), {}, &head).ok());
  EXPECT_EQ(head.metadata.size(), 2u);
  ASSERT_TRUE(ParseRequest(*DecodeFrame(second_bytes), {}, &head).ok());
  EXPECT_EQ(head.timeout_us, 0);
  EXPECT_TRUE(head.metadata.empty());
  ASSERT_EQ(head.parts.size(), 1u);
  EXPECT_EQ(head.parts[0].size, 0u);
}

TEST(WireTest, OtherFramesRoundTrip) {
  ResponseHead response;
  response.call_id = 9;
  response.parts.push_back(MakePart(2));
  response.initial_metadata.push_back({"i", "1"});
  std::string r_bytes = Encode(FrameType::kResponse, 0, &response, {"hi"});
  auto r = DecodeFrame(r_bytes);
  ASSERT_TRUE(r.ok()) << r.status();
  ResponseHead parsed_response;
  EXPECT_TRUE(ParseResponse(*r, {}, &parsed_response).ok());
  EXPECT_EQ(parsed_response.call_id, 9u);
  ASSERT_EQ(parsed_response.parts.size(), 1u);
  EXPECT_EQ(parsed_response.parts[0].size, 2u);
  ASSERT_EQ(parsed_response.initial_metadata.size(), 1u);
  EXPECT_EQ(parsed_response.initial_metadata[0].value, "1");

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

  std::string c_bytes = Encode(FrameType::kCredit, 31, {});
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
  EXPECT_EQ(*n, FrameBytes(FrameHead(&head).bytes(), serialized.size() + 3));
  auto frame = DecodeFrame(
      std::string_view(reinterpret_cast<const char*>(out.data()), *n));
  ASSERT_TRUE(frame.ok()) << frame.status();
  EXPECT_EQ(frame->inline_bytes, serialized + tensor);
  RequestHead parsed;
  EXPECT_TRUE(ParseRequest(*frame, WireLimits{}, &parsed).ok());

  // The message counts toward the room: too big, and nothing is written.
  std::vector<uint8_t> small(FrameBytes(FrameHead(&head).bytes(), 3));
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
  head = Request({{true, 4}, {false, 0}});
  head.parts[1].in_message = true;
  head.parts[1].out_of_band = true;
  ExpectMalformed(parse(head), "part 1 cannot lie inside the message");
  head = Request({{false, 0}});
  head.parts[0].in_message = true;
  ExpectMalformed(parse(head), "part 0 cannot lie inside the message");
  head = Request({{false, 0}});
  head.call_id = 0;
  ExpectMalformed(parse(head), "without a call id");
  const std::string long_method(2000, 'm');
  head = Request({{false, 0}});
  head.method = long_method;
  ExpectMalformed(parse(head), "method name of 2000 bytes");
  head = Request({{false, 0}});
  head.method = "";
  ExpectMalformed(parse(head), "method name of 0 bytes");
  head = Request({{false, 0}});
  head.timeout_us = -1;
  ExpectMalformed(parse(head), "negative timeout");
  const std::string long_value(20000, 'v');
  head = Request({{false, 0}});
  head.metadata[0].value = long_value;
  ExpectMalformed(parse(head), "bytes of metadata");
  head = Request({{false, 0}});
  head.metadata[0].key = "Upper";
  ExpectMalformed(parse(head), "'Upper' has a character");
  head = Request({{false, 0}});
  head.metadata.assign(65, {"k", "v"});
  ExpectMalformed(parse(head), "65 metadata entries");
  head = Request({});
  head.parts.assign(5000, {});
  ExpectMalformed(parse(head), "5000 parts");
  // A request frame parsed as something else.
  std::string bytes = Encode(FrameType::kRequest, 0, &head);
  ExpectMalformed(ParseGrant(*DecodeFrame(bytes), 0).status(),
                  "expected a grant frame, got a request");
}

// A head whose counts and lengths do not match its bytes, cut anywhere or
// with bytes to spare, is malformed; so are set reserved bytes.
TEST(WireTest, RequestHeadsThatDisagreeWithTheirBytes) {
  RequestHead head = Request({{false, 3}, {true, 9}});
  const std::string good = Encode(FrameType::kRequest, 0, &head, {"abc"});
  const size_t head_bytes = FrameHead(&head).bytes();
  // A frame whose head is `cut` bytes long: the preamble says so.
  auto with_head = [&](std::string h) {
    std::string frame = good.substr(0, kPreambleBytes) + h + "abc";
    frame[8] = static_cast<char>(h.size());
    frame[9] = static_cast<char>(h.size() >> 8);
    return frame;
  };
  const std::string whole = good.substr(kPreambleBytes, head_bytes);
  RequestHead parsed;
  ASSERT_TRUE(ParseRequest(*DecodeFrame(with_head(whole)), {}, &parsed).ok());
  for (size_t cut = 0; cut < whole.size(); ++cut) {
    std::string frame = with_head(whole.substr(0, cut));
    Status s = ParseRequest(*DecodeFrame(frame), {}, &parsed);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "cut " << cut;
  }
  ExpectMalformed(
      ParseRequest(*DecodeFrame(with_head(whole + "x")), {}, &parsed),
      "1 bytes beyond its fields");
  std::string bad = whole;
  bad[28] = 1;
  ExpectMalformed(ParseRequest(*DecodeFrame(with_head(bad)), {}, &parsed),
                  "reserved request head bytes");
  bad = whole;
  bad[16] = 100;  // method longer than the head
  ExpectMalformed(ParseRequest(*DecodeFrame(with_head(bad)), {}, &parsed),
                  "shorter than its fields");
  bad = whole;
  bad[24] = '\xff';  // 255 parts
  bad[25] = '\xff';  // 65535 parts: over the limit before any is read
  ExpectMalformed(ParseRequest(*DecodeFrame(with_head(bad)), {}, &parsed),
                  "65535 parts");
  bad = whole;
  for (int i = 20; i < 24; ++i) bad[i] = '\xff';  // metadata entries
  ExpectMalformed(ParseRequest(*DecodeFrame(with_head(bad)), {}, &parsed),
                  "4294967295 metadata entries");
}

// The same for a response: counts over the limits before their entries
// are read, initial and trailing summed without wrapping, reserved bytes.
TEST(WireTest, ResponseHeadsThatDisagreeWithTheirBytes) {
  ResponseHead head;
  head.call_id = 4;
  head.parts.push_back(MakePart(2));
  head.trailing_metadata.push_back({"t", "v"});
  const std::string good = Encode(FrameType::kResponse, 0, &head, {"ok"});
  ResponseHead parsed;
  ASSERT_TRUE(ParseResponse(*DecodeFrame(good), {}, &parsed).ok());
  auto with = [&](int offset, char byte) {
    std::string bytes = good;
    bytes[kPreambleBytes + offset] = byte;
    return bytes;
  };
  for (int reserved : {10, 11, 28, 29, 30, 31}) {
    ExpectMalformed(ParseResponse(*DecodeFrame(with(reserved, 1)), {}, &parsed),
                    "reserved response head bits");
  }
  std::string bytes = good;
  for (int i = 20; i < 24; ++i) bytes[kPreambleBytes + i] = '\xff';
  ExpectMalformed(ParseResponse(*DecodeFrame(bytes), {}, &parsed),
                  "4294967296 metadata entries");
  ExpectMalformed(ParseResponse(*DecodeFrame(with(16, 2)), {}, &parsed),
                  "shorter than its fields");
  for (size_t cut = kPreambleBytes; cut < good.size() - 2; ++cut) {
    // The head cut short: the preamble's head length follows it.
    std::string frame = good.substr(0, cut) + "ok";
    frame[8] = static_cast<char>(cut - kPreambleBytes);
    Status s = ParseResponse(*DecodeFrame(frame), {}, &parsed);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << "cut " << cut;
  }
}

TEST(WireTest, ResponseAndGrantErrors) {
  ResponseHead error;
  error.call_id = 3;
  error.code = 5;
  error.message = "not found";
  // FrameView points into the encoded bytes: keep them alive.
  std::string bytes = Encode(FrameType::kResponse, 0, &error);
  auto frame = DecodeFrame(bytes);
  ResponseHead parsed;
  EXPECT_TRUE(ParseResponse(*frame, {}, &parsed).ok());
  error.parts.push_back({});
  bytes = Encode(FrameType::kResponse, 0, &error);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseResponse(*frame, {}, &parsed),
                  "error response with a payload");
  ResponseHead bad_code;
  bad_code.call_id = 3;
  bad_code.code = 99;
  bytes = Encode(FrameType::kResponse, 0, &bad_code);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseResponse(*frame, {}, &parsed), "status code 99");
  bytes[kPreambleBytes + 9] = 2;  // a flag that does not exist
  ExpectMalformed(ParseResponse(*DecodeFrame(bytes), {}, &parsed),
                  "reserved response head bits");
  ResponseHead no_id;
  no_id.parts.push_back({});
  bytes = Encode(FrameType::kResponse, 0, &no_id);
  ExpectMalformed(ParseResponse(*DecodeFrame(bytes), {}, &parsed),
                  "without a call id");
  const std::string long_message(20 << 10, 'm');
  ResponseHead long_error;
  long_error.call_id = 3;
  long_error.code = 13;
  long_error.message = long_message;
  bytes = Encode(FrameType::kResponse, 0, &long_error);
  ExpectMalformed(ParseResponse(*DecodeFrame(bytes), {}, &parsed),
                  "status message of 20480 bytes");
  // Response metadata: initial and trailing count together, and each entry
  // follows the rules a handler's does.
  ResponseHead with_metadata;
  with_metadata.call_id = 3;
  with_metadata.code = 14;
  std::vector<std::string> keys;
  for (int i = 0; i < 40; ++i) keys.push_back("k" + std::to_string(i));
  for (int i = 0; i < 40; ++i) keys.push_back("t" + std::to_string(i));
  for (int i = 0; i < 40; ++i) {
    with_metadata.initial_metadata.push_back({keys[i], ""});
    with_metadata.trailing_metadata.push_back({keys[40 + i], ""});
  }
  bytes = Encode(FrameType::kResponse, 0, &with_metadata);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseResponse(*frame, {}, &parsed), "80 metadata entries");
  with_metadata.initial_metadata.clear();
  with_metadata.trailing_metadata[0].value = "line\nbreak";
  bytes = Encode(FrameType::kResponse, 0, &with_metadata);
  frame = DecodeFrame(bytes);
  ExpectMalformed(ParseResponse(*frame, {}, &parsed), "not printable ASCII");
  with_metadata.trailing_metadata[0].value = "fine";
  bytes = Encode(FrameType::kResponse, 0, &with_metadata);
  frame = DecodeFrame(bytes);
  EXPECT_TRUE(ParseResponse(*frame, {}, &parsed).ok());
  EXPECT_EQ(parsed.trailing_metadata.size(), 40u);

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
