// The end-to-end suite over the RDMA transport: forced, and chosen by the
// default 'auto' policy. Needs an RDMA device (label rdma: the soft-RoCE VM
// harness provides one).
#include <chrono>
#include <future>
#include <string>
#include <thread>

#include "e2e_fixture.h"

namespace rdmarpc_test {

INSTANTIATE_TEST_SUITE_P(
    Rdma, E2ETest,
    ::testing::Values(TransportCase{"rdma", rdmarpc::TransportPolicy::kRdma,
                                    rdmarpc::TransportKind::kRdma},
                      TransportCase{"auto", rdmarpc::TransportPolicy::kAuto,
                                    rdmarpc::TransportKind::kRdma}),
    CaseName);

namespace {

// Under policy 'rdma' a call that waits for ready outlasts a server that is
// not up yet: the channel's probe finds it, and the call goes over RDMA.
TEST(WaitForReady, UnderPolicyRdmaACallWaitsForTheRdmaPath) {
  E2EService service;
  const std::string target = VacatedTarget();
  ASSERT_FALSE(target.empty());
  rdmarpc::ChannelOptions options;
  options.policy = rdmarpc::TransportPolicy::kRdma;
  auto channel = rdmarpc::CreateChannel(target, options);
  auto stub = E2E::NewStub(channel);
  rdmarpc::ClientContext waits;
  waits.set_timeout(std::chrono::seconds(60));
  waits.set_wait_for_ready(true);
  EchoRequest req;
  req.set_note("w");
  EchoResponse resp;
  std::future<rdmarpc::Status> done = stub->EchoFuture(&waits, req, &resp);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (channel->transport_stats().health != rdmarpc::RdmaHealth::kDegraded &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  ASSERT_EQ(channel->transport_stats().health, rdmarpc::RdmaHealth::kDegraded);
  ASSERT_EQ(done.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the call ended while no server listened: " << done.get();
  // Without wait-for-ready a call fails at once, saying why.
  rdmarpc::ClientContext fails;
  EchoResponse lost;
  rdmarpc::Status s = stub->Echo(&fails, req, &lost);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;

  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort(target)
                    .RegisterService(&service)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  s = done.get();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.note(), "w");
  EXPECT_EQ(waits.stats().transport, rdmarpc::TransportKind::kRdma)
      << waits.stats().transport_reason;
  (*server)->Shutdown();
}

// A server holding SetMaxRdmaConnections connections tells the next client
// in the handshake: under 'auto' it is served over gRPC with that reason,
// under 'rdma' its call fails with it.
TEST(RdmaConnectionLimit, AClientOverTheLimitIsToldWhy) {
  E2EService service;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .SetMaxRdmaConnections(1)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string target = "127.0.0.1:" + std::to_string(port);
  EchoRequest req;
  EchoResponse resp;

  auto first = E2E::NewStub(rdmarpc::CreateChannel(
      target, PatientChannelOptions(rdmarpc::TransportPolicy::kAuto)));
  rdmarpc::ClientContext c1;
  ASSERT_TRUE(first->Echo(&c1, req, &resp).ok());
  EXPECT_EQ(c1.stats().transport, rdmarpc::TransportKind::kRdma)
      << c1.stats().transport_reason;

  auto second = E2E::NewStub(rdmarpc::CreateChannel(target));
  rdmarpc::ClientContext c2;
  ASSERT_TRUE(second->Echo(&c2, req, &resp).ok());
  EXPECT_EQ(c2.stats().transport, rdmarpc::TransportKind::kGrpc);
  EXPECT_NE(c2.stats().transport_reason.find(
                "limit of 1 RDMA connections (ServerBuilder::"
                "SetMaxRdmaConnections)"),
            std::string::npos)
      << c2.stats().transport_reason;

  rdmarpc::ChannelOptions rdma_only;
  rdma_only.policy = rdmarpc::TransportPolicy::kRdma;
  auto third = E2E::NewStub(rdmarpc::CreateChannel(target, rdma_only));
  rdmarpc::ClientContext c3;
  rdmarpc::Status refused = third->Echo(&c3, req, &resp);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
  EXPECT_NE(refused.message().find("SetMaxRdmaConnections"),
            std::string_view::npos)
      << refused;
}

}  // namespace
}  // namespace rdmarpc_test
