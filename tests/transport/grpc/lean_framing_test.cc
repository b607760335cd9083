// Malformed bytes on the lean framing: a raw gRPC client sends what a buggy
// or hostile peer would. Each gets INVALID_ARGUMENT (or RESOURCE_EXHAUSTED
// for an oversized announcement) with a clear message, and the server keeps
// serving well-formed calls.
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/support/client_callback.h>
#include <gtest/gtest.h>

#include <future>
#include <string>
#include <vector>

#include "e2e_test.rdmarpc.pb.h"
#include "rdmarpc/rdmarpc.h"
#include "transport/grpc/lean_frame.pb.h"

namespace {

using rdmarpc::grpc_transport::LeanHead;

constexpr char kEcho[] = "/rdmarpc_test.E2E/Echo";
// Spelled out as a peer would: a lean stream's head starts with byte 0.
constexpr char kLeanMarker = '\0';

class RawCall final
    : public grpc::ClientBidiReactor<grpc::ByteBuffer, grpc::ByteBuffer> {
 public:
  // `framing`, if not empty, goes as the metadata that named the framing up
  // to lean-2.
  RawCall(grpc::GenericStub* stub, std::vector<std::string> messages,
          std::string framing)
      : messages_(std::move(messages)) {
    if (!framing.empty()) ctx_.AddMetadata("rdmarpc-framing", framing);
    ctx_.set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(10));
    stub->PrepareBidiStreamingCall(&ctx_, kEcho, grpc::StubOptions(), this);
    StartRead(&in_);
    WriteNext();
    StartCall();
  }
  grpc::Status Wait() { return result_.get_future().get(); }

  std::vector<std::string> received;  // complete once Wait returned

  void OnWriteDone(bool ok) override {
    if (ok) WriteNext();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    std::vector<grpc::Slice> slices;
    std::string bytes;
    if (in_.Dump(&slices).ok()) {
      for (const grpc::Slice& s : slices) {
        bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
      }
    }
    received.push_back(std::move(bytes));
    StartRead(&in_);
  }
  void OnDone(const grpc::Status& s) override { result_.set_value(s); }

 private:
  void WriteNext() {
    if (next_ == messages_.size()) {
      StartWritesDone();
      return;
    }
    grpc::Slice slice(messages_[next_]);
    out_ = grpc::ByteBuffer(&slice, 1);
    ++next_;
    StartWrite(&out_);
  }

  std::vector<std::string> messages_;
  size_t next_ = 0;
  grpc::ClientContext ctx_;
  grpc::ByteBuffer out_, in_;
  std::promise<grpc::Status> result_;
};

class EchoImpl final : public rdmarpc_test::E2E::Service {
  rdmarpc::Status Echo(rdmarpc::ServerContext* ctx,
                       const rdmarpc_test::EchoRequest& req,
                       rdmarpc_test::EchoResponse* resp) override {
    ++calls;
    if (!req.has_tensor()) return absl::OkStatus();
    RDMARPC_ASSIGN_OR_RETURN(auto in, ctx->tensors().Get(req.tensor()));
    return ctx->tensors().Set(resp->mutable_tensor(), in);
  }

 public:
  std::atomic<int> calls{0};
};

class LeanFramingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int port = 0;
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort("127.0.0.1:0", &port)
                      .RegisterService(&impl_)
                      .BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    target_ = "127.0.0.1:" + std::to_string(port);
    raw_channel_ =
        grpc::CreateChannel(target_, grpc::InsecureChannelCredentials());
    raw_stub_ = std::make_unique<grpc::GenericStub>(raw_channel_);
  }

  grpc::Status Send(std::vector<std::string> messages, std::string framing = "",
                    std::vector<std::string>* received = nullptr) {
    RawCall call(raw_stub_.get(), std::move(messages), std::move(framing));
    grpc::Status s = call.Wait();
    if (received != nullptr) *received = std::move(call.received);
    return s;
  }

  // A head (with the lean marker) for an EchoRequest with one u8 tensor of
  // `dim` elements whose announced out-of-band size is `announced`.
  static std::string Head(int64_t dim, uint64_t announced, int parts = 1,
                          uint32_t version = 3, std::string first_chunk = "") {
    rdmarpc_test::EchoRequest req;
    req.mutable_tensor()->set_dtype(rdmarpc::DTYPE_U8);
    req.mutable_tensor()->add_shape(dim);
    LeanHead head;
    head.set_version(version);
    head.set_message(req.SerializeAsString());
    for (int i = 0; i < parts; ++i) {
      auto* p = head.add_tensors();
      p->set_out_of_band(true);
      p->set_size(announced);
    }
    head.set_first_chunk(std::move(first_chunk));
    return Marked(head);
  }
  static std::string Marked(const LeanHead& head) {
    return kLeanMarker + head.SerializeAsString();
  }

  void ExpectServerStillServes() {
    auto stub = rdmarpc_test::E2E::NewStub(rdmarpc::CreateChannel(target_));
    std::vector<uint8_t> bytes(1000, 7);
    rdmarpc::ClientContext ctx;
    rdmarpc_test::EchoRequest req;
    ASSERT_TRUE(ctx.tensors()
                    .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8, {1000},
                         rdmarpc::TensorBuffer::Borrow(bytes.data(), 1000))
                    .ok());
    rdmarpc_test::EchoResponse resp;
    rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(ctx.tensors().Get(resp.tensor())->size(), 1000u);
  }

  void ExpectRejected(const grpc::Status& s, grpc::StatusCode code,
                      const std::string& phrase) {
    EXPECT_EQ(s.error_code(), code) << s.error_message();
    EXPECT_NE(s.error_message().find(phrase), std::string::npos)
        << "message was: " << s.error_message();
    EXPECT_EQ(impl_.calls.load(), 0) << "a malformed call reached the handler";
    ExpectServerStillServes();
  }

  EchoImpl impl_;
  std::unique_ptr<rdmarpc::Server> server_;
  std::string target_;
  std::shared_ptr<grpc::Channel> raw_channel_;
  std::unique_ptr<grpc::GenericStub> raw_stub_;
};

// Well-formed: tensor bytes in the head, alone or followed by chunks. The
// echo comes back as one message, its bytes in the head too.
TEST_F(LeanFramingTest, BytesInTheHeadAreTheTensorsFirstBytes) {
  const std::string bytes = "0123456789";
  for (size_t in_head : {size_t{10}, size_t{4}}) {
    std::vector<std::string> messages = {
        Head(10, 10, 1, 3, bytes.substr(0, in_head))};
    if (in_head < bytes.size()) messages.push_back(bytes.substr(in_head));
    std::vector<std::string> received;
    grpc::Status s = Send(messages, "", &received);
    ASSERT_TRUE(s.ok()) << s.error_message();
    ASSERT_EQ(received.size(), 1u) << "a 10-byte echo takes one message";
    ASSERT_FALSE(received[0].empty());
    EXPECT_EQ(received[0][0], kLeanMarker);
    LeanHead head;
    ASSERT_TRUE(head.ParseFromString(received[0].substr(1)));
    EXPECT_EQ(head.first_chunk(), bytes);
  }
  EXPECT_EQ(impl_.calls.load(), 2);
}

TEST_F(LeanFramingTest, MoreBytesInTheHeadThanAnnounced) {
  ExpectRejected(Send({Head(10, 10, 1, 3, std::string(11, 'x'))}),
                 grpc::StatusCode::INVALID_ARGUMENT, "more tensor bytes");
}

TEST_F(LeanFramingTest, GarbageHead) {
  ExpectRejected(Send({std::string("\0\xff\xff\xff\xff\x0f", 6)}),
                 grpc::StatusCode::INVALID_ARGUMENT, "not a valid LeanHead");
}

TEST_F(LeanFramingTest, UnknownVersion) {
  ExpectRejected(Send({Head(4, 4, 1, 99)}), grpc::StatusCode::INVALID_ARGUMENT,
                 "unsupported version 99");
}

// A client of lean-1 or lean-2 named the framing in metadata: refused with
// the versions named, not taken for a plain client.
TEST_F(LeanFramingTest, FramingNamedInMetadata) {
  for (const char* framing : {"lean-1", "lean-2"}) {
    impl_.calls = 0;  // the last round's check made one
    LeanHead head;
    head.set_version(2);
    ExpectRejected(Send({head.SerializeAsString()}, framing),
                   grpc::StatusCode::INVALID_ARGUMENT,
                   std::string("unsupported rdmarpc framing '") + framing +
                       "' (this server speaks lean-3");
  }
}

TEST_F(LeanFramingTest, MessageThatDoesNotParse) {
  LeanHead head;
  head.set_version(3);
  head.set_message(std::string("\xff\xff\xff", 3));
  ExpectRejected(Send({Marked(head)}), grpc::StatusCode::INVALID_ARGUMENT,
                 "does not parse");
}

TEST_F(LeanFramingTest, FewerBytesThanAnnounced) {
  ExpectRejected(Send({Head(100, 100), std::string(50, 'x')}),
                 grpc::StatusCode::INVALID_ARGUMENT, "stopped before");
}

TEST_F(LeanFramingTest, MoreBytesThanAnnounced) {
  ExpectRejected(Send({Head(10, 10), std::string(11, 'x')}),
                 grpc::StatusCode::INVALID_ARGUMENT, "more tensor bytes");
}

TEST_F(LeanFramingTest, TensorCountMismatch) {
  ExpectRejected(Send({Head(10, 10, 2), std::string(20, 'x')}),
                 grpc::StatusCode::INVALID_ARGUMENT, "announced 2 tensors");
}

TEST_F(LeanFramingTest, SizeDisagreesWithShape) {
  ExpectRejected(Send({Head(10, 100), std::string(100, 'x')}),
                 grpc::StatusCode::INVALID_ARGUMENT, "announced 100 bytes");
}

TEST_F(LeanFramingTest, NegativeDimension) {
  ExpectRejected(Send({Head(-5, 0)}), grpc::StatusCode::INVALID_ARGUMENT,
                 "negative dimension");
}

TEST_F(LeanFramingTest, HugeAnnouncementIsRefusedWithoutAllocating) {
  const int64_t tib = int64_t{1} << 40;
  ExpectRejected(Send({Head(tib, static_cast<uint64_t>(tib))}),
                 grpc::StatusCode::RESOURCE_EXHAUSTED, "limit");
}

// The server's methods are registered with gRPC so that a call arrives
// with its first message: gRPC itself refuses a call that brings none.
TEST_F(LeanFramingTest, NoMessagesAtAll) {
  ExpectRejected(Send({}), grpc::StatusCode::INTERNAL,
                 "Unable to parse request");
}

}  // namespace
