// The end-to-end suite over the gRPC transport: forced, and chosen by the
// default 'auto' policy in a build without RDMA.
#include <future>
#include <string>

#include "e2e_fixture.h"

namespace rdmarpc_test {

INSTANTIATE_TEST_SUITE_P(
    Grpc, E2ETest,
    ::testing::Values(TransportCase{"grpc", rdmarpc::TransportPolicy::kGrpc,
                                    rdmarpc::TransportKind::kGrpc},
                      TransportCase{"auto", rdmarpc::TransportPolicy::kAuto,
                                    rdmarpc::TransportKind::kGrpc}),
    CaseName);

namespace {

// A call made while no server listens fails UNAVAILABLE at once, unless it
// waits for ready: then it goes through once a server comes up.
TEST(WaitForReady, CallWaitsForAServerThatComesUp) {
  for (auto policy :
       {rdmarpc::TransportPolicy::kAuto, rdmarpc::TransportPolicy::kGrpc}) {
    E2EService service;
    int port = 0;
    // A port that was free a moment ago, with nothing on it now.
    {
      auto probe = StartE2EServer(&service, &port);
      ASSERT_TRUE(probe.ok()) << probe.status();
      (*probe)->Shutdown();
    }
    const std::string target = "127.0.0.1:" + std::to_string(port);
    rdmarpc::ChannelOptions options;
    options.policy = policy;

    auto impatient = E2E::NewStub(rdmarpc::CreateChannel(target, options));
    rdmarpc::ClientContext fails;
    fails.set_timeout(std::chrono::seconds(30));
    EchoRequest req;
    req.set_note("w");
    EchoResponse lost;
    rdmarpc::Status s = impatient->Echo(&fails, req, &lost);
    EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;

    auto patient = E2E::NewStub(rdmarpc::CreateChannel(target, options));
    rdmarpc::ClientContext waits;
    waits.set_timeout(std::chrono::seconds(60));
    waits.set_wait_for_ready(true);
    EchoResponse resp;
    std::future<rdmarpc::Status> done = patient->EchoFuture(&waits, req, &resp);
    EXPECT_EQ(done.wait_for(std::chrono::milliseconds(300)),
              std::future_status::timeout)
        << "the call ended while no server listened: " << done.get();
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort(target)
                      .RegisterService(&service)
                      .BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    s = done.get();
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.note(), "w");
    (*server)->Shutdown();
  }
}

}  // namespace
}  // namespace rdmarpc_test
