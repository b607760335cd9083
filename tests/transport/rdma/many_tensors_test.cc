// Calls with many tensors over RDMA (label rdma): each written tensor
// needs a region in one grant frame, so a call can carry only so many.
// Past that, a request goes over gRPC instead and a response fails with
// RESOURCE_EXHAUSTED naming the limit; neither ever hangs. A response's
// landings in several kinds of memory each get a memory window.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <future>
#include <string>
#include <vector>

#include "many_tensors.rdmarpc.pb.h"
#include "rdmarpc/channel.h"
#include "rdmarpc/server.h"
#include "transport/rdma/landing_arena.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc_test {
namespace {

constexpr size_t kTensorBytes = 4096;  // written: past the inline room

class ManyService final : public Many::Service {
 public:
  rdmarpc::Status Echo(rdmarpc::ServerContext* ctx, const ManyTensors& req,
                       ManyTensors* resp) override {
    for (int i = 0; i < req.reply_parts() && req.parts_size() > 0; ++i) {
      RDMARPC_ASSIGN_OR_RETURN(
          rdmarpc::TensorView in,
          ctx->tensors().Get(req.parts(i % req.parts_size())));
      RDMARPC_RETURN_IF_ERROR(ctx->tensors().Set(resp->add_parts(), in));
    }
    return absl::OkStatus();
  }
};

class ManyTensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort("127.0.0.1:0", &port_)
                      .RegisterService(&service_)
                      .BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
    // These tests count tensors, not liveness: a sanitized build in the
    // emulated VM on a loaded machine once kept the 500-tensor call from
    // being heard for longer than the default 3 s, and the progress watch
    // moved it to gRPC.
    rdmarpc::ChannelOptions options;
    options.rdma_peer_timeout = std::chrono::seconds(20);
    channel_ =
        rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port_), options);
    stub_ = Many::NewStub(channel_);
  }

  // Sends `parts` tensors of kTensorBytes, asks `reply` back (part i is
  // request part i % parts), and checks every byte of what came back.
  rdmarpc::Status Call(int parts, int reply, rdmarpc::ClientContext* ctx) {
    bytes_.assign(size_t(parts) * kTensorBytes, 0);
    for (size_t i = 0; i < bytes_.size(); ++i) {
      bytes_[i] = static_cast<uint8_t>(i * 7 + i / kTensorBytes);
    }
    ManyTensors req;
    req.set_reply_parts(reply);
    for (int i = 0; i < parts; ++i) {
      rdmarpc::Status bound = ctx->tensors().Set(
          req.add_parts(), rdmarpc::DTYPE_U8,
          {static_cast<int64_t>(kTensorBytes)},
          rdmarpc::TensorBuffer::Borrow(bytes_.data() + i * kTensorBytes,
                                        kTensorBytes));
      if (!bound.ok()) return bound;
    }
    ManyTensors resp;
    rdmarpc::Status s = stub_->Echo(ctx, req, &resp);
    if (!s.ok()) return s;
    EXPECT_EQ(resp.parts_size(), reply);
    for (int i = 0; i < resp.parts_size(); ++i) {
      auto out = ctx->tensors().Get(resp.parts(i));
      const uint8_t* want = bytes_.data() + (i % parts) * kTensorBytes;
      EXPECT_TRUE(out.ok() && out->size() == kTensorBytes &&
                  std::memcmp(out->data(), want, kTensorBytes) == 0)
          << "part " << i;
    }
    return s;
  }

  ManyService service_;
  int port_ = 0;
  std::unique_ptr<rdmarpc::Server> server_;
  std::shared_ptr<rdmarpc::Channel> channel_;
  std::unique_ptr<Many::Stub> stub_;
  std::vector<uint8_t> bytes_;
};

// The connection's first call: its 500 landings on each side, far more
// than a connection has windows, share one block of the arena and one
// window over it, and none is registered for remote write (which a
// protection domain shared by several connections must not have). The
// block (2 MB) is granted aside, queued behind the registration of the
// arena's segment that the first look at it started on the new
// connection, so the window covers the segment's registration and the
// call registers nothing of its own.
TEST_F(ManyTensorsTest, HundredsOfWrittenTensorsGoOverRdma) {
  rdmarpc::ClientContext ctx;
  rdmarpc::Status s = Call(500, 500, &ctx);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma)
      << ctx.stats().ToString();
  const rdmarpc::ChannelTransportStats client = channel_->transport_stats();
  EXPECT_EQ(client.rdma_landing_windows, 1u) << client.ToString();
  EXPECT_EQ(client.rdma_landing_registrations, 0u);
  EXPECT_EQ(server_->rdma_stats().landing_windows, 1u);
  EXPECT_EQ(server_->rdma_stats().landing_registrations, 0u);
}

// With the landing arena full, a call's host landings share a block of
// its own: 40 of them each way (more than a connection has windows) still
// land over RDMA through one window over one registration a side, none
// registered for remote write.
TEST_F(ManyTensorsTest, ManyLandingsShareABlockOfTheirOwnWhenTheArenaIsFull) {
  rdmarpc::rdma::LandingArena* arena = rdmarpc::rdma::LandingArena::Get();
  // With the arena off every call's block is of its own; held full here.
  std::vector<rdmarpc::TensorBuffer> held;
  if (arena != nullptr) {
    // Blocks of earlier calls go back from the registration thread: once
    // a task queued after them ran, nothing comes back during the call.
    std::promise<void> drained;
    rdmarpc::rdma::RunAside([&] { drained.set_value(); });
    drained.get_future().wait();
    for (size_t size : {size_t{16} << 20, size_t{1} << 20, size_t{4096}}) {
      while (auto block = arena->Allocate(size)) held.push_back(*block);
    }
  }
  rdmarpc::ClientContext ctx;
  rdmarpc::Status s = Call(40, 40, &ctx);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma)
      << ctx.stats().ToString();
  const rdmarpc::ChannelTransportStats client = channel_->transport_stats();
  EXPECT_EQ(client.rdma_landing_windows, 1u) << client.ToString();
  EXPECT_EQ(client.rdma_landing_registrations, 1u);
  EXPECT_EQ(server_->rdma_stats().landing_windows, 1u);
  EXPECT_EQ(server_->rdma_stats().landing_registrations, 1u);
}

TEST_F(ManyTensorsTest, FiveThousandTensorsCompleteOverGrpcWithTheReason) {
  rdmarpc::ClientContext warm;
  ASSERT_TRUE(Call(1, 1, &warm).ok());
  rdmarpc::ClientContext ctx;
  rdmarpc::Status s = Call(5000, 3, &ctx);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kGrpc);
  EXPECT_NE(ctx.stats().transport_reason.find("can grant at most"),
            std::string::npos)
      << ctx.stats().transport_reason;
}

TEST_F(ManyTensorsTest, AResponseWithTooManyTensorsFailsNamingTheLimit) {
  rdmarpc::ClientContext warm;
  ASSERT_TRUE(Call(1, 1, &warm).ok());
  // 1000 go out over RDMA; 3000 back need a grant no receive buffer holds.
  rdmarpc::ClientContext ctx;
  rdmarpc::Status s = Call(1000, 0, &ctx);
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  rdmarpc::ClientContext big;
  s = Call(1000, 3000, &big);
  if (big.stats().transport == rdmarpc::TransportKind::kRdma) {
    EXPECT_EQ(s.code(), absl::StatusCode::kResourceExhausted) << s;
    EXPECT_NE(s.message().find("at most"), std::string::npos) << s;
  } else {
    ADD_FAILURE() << "expected RDMA: " << big.stats().ToString();
  }
  // The connection is fine afterwards.
  rdmarpc::ClientContext after;
  EXPECT_TRUE(Call(10, 10, &after).ok());
  EXPECT_EQ(after.stats().transport, rdmarpc::TransportKind::kRdma);
}

// A response whose parts land partly in the landing arena and partly in
// buffers the caller gave: one window grants the arena's block and one
// more each of the caller's buffers (registered for this call alone), and
// the call reads the bytes only once all of them ended; each of those
// registrations deregisters once its window is invalidated.
TEST_F(ManyTensorsTest, EachLandingOfAResponseIsGrantedThroughAWindow) {
  constexpr size_t kBytes = 64 << 10;  // written, not inline
  constexpr int kParts = 4;            // 1 and 3 land in the caller's buffers
  const uint64_t failed_before = rdmarpc::rdma::FailedDeregistrations();
  std::vector<uint8_t> sent(kParts * kBytes);
  std::vector<std::vector<uint8_t>> own(kParts, std::vector<uint8_t>(kBytes));
  // One call; how many windows the client's grants took for it.
  auto call = [&](uint32_t seed) -> uint64_t {
    for (size_t i = 0; i < sent.size(); ++i) {
      sent[i] = static_cast<uint8_t>(i * 13 + seed);
    }
    const uint64_t before = channel_->transport_stats().rdma_landing_windows;
    rdmarpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(60));
    ManyTensors req;
    req.set_reply_parts(kParts);
    for (int i = 0; i < kParts; ++i) {
      EXPECT_TRUE(ctx.tensors()
                      .Set(req.add_parts(), rdmarpc::DTYPE_U8,
                           {static_cast<int64_t>(kBytes)},
                           rdmarpc::TensorBuffer::Borrow(
                               sent.data() + i * kBytes, kBytes))
                      .ok());
    }
    for (int i = 1; i < kParts; i += 2) {
      std::memset(own[i].data(), 0, kBytes);
      ctx.SetResponseTensorBuffer(
          i, rdmarpc::TensorBuffer::Borrow(own[i].data(), kBytes));
    }
    ManyTensors resp;
    rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma)
        << ctx.stats().ToString();
    EXPECT_EQ(resp.parts_size(), kParts);
    for (int i = 0; i < resp.parts_size(); ++i) {
      auto out = ctx.tensors().Get(resp.parts(i));
      if (!out.ok() || out->size() != kBytes) {
        ADD_FAILURE() << "part " << i << ": " << out.status();
        continue;
      }
      EXPECT_EQ(0, std::memcmp(out->data(), sent.data() + i * kBytes, kBytes))
          << "part " << i;
      if (i % 2 == 1) {
        EXPECT_EQ(out->data(), own[i].data()) << "part " << i;
      }
    }
    return channel_->transport_stats().rdma_landing_windows - before;
  };
  // Every landing has a window from the first call on: one over the
  // arena's block (over a registration of the block for this call while
  // the connection has not registered that segment of the arena) and one
  // over each of the caller's buffers.
  for (uint32_t seed = 1; seed <= 9; ++seed) EXPECT_EQ(call(seed), 3u);
  stub_.reset();
  channel_.reset();
  // What the closed connections dropped aside deregisters on the
  // registration thread, in order: a task queued after it runs once it
  // did.
  std::promise<void> drained;
  rdmarpc::rdma::RunAside([&] { drained.set_value(); });
  drained.get_future().wait();
  EXPECT_EQ(rdmarpc::rdma::FailedDeregistrations(), failed_before);
}

}  // namespace
}  // namespace rdmarpc_test
