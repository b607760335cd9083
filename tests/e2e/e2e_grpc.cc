// The end-to-end suite over the gRPC transport: forced, and chosen by the
// default 'auto' policy in a build without RDMA.
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
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

// The e2e service in a child process (tests/e2e/e2e_test_server.cc), which
// a test can freeze: a server that stops answering without closing its
// connections, as a frozen or unplugged host does.
class ChildServer {
 public:
  ChildServer() {
    char dir[] = "/tmp/rdmarpc-e2e-XXXXXX";
    if (mkdtemp(dir) != nullptr) port_file_ = std::string(dir) + "/port";
    std::string path = E2E_TEST_SERVER;
    char* argv[] = {path.data(), port_file_.data(), nullptr};
    if (posix_spawn(&pid_, path.c_str(), nullptr, nullptr, argv, environ) !=
        0) {
      pid_ = -1;
      return;
    }
    for (int i = 0; i < 3000 && port_ == 0; ++i) {
      std::ifstream(port_file_) >> port_;
      if (port_ == 0)
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  ~ChildServer() {
    if (pid_ > 0) {
      kill(pid_, SIGKILL);
      waitpid(pid_, nullptr, 0);
    }
    std::remove(port_file_.c_str());
    std::remove(port_file_.substr(0, port_file_.rfind('/')).c_str());
  }
  int port() const { return port_; }
  void Freeze() { kill(pid_, SIGSTOP); }

 private:
  std::string port_file_;
  pid_t pid_ = -1;
  int port_ = 0;
};

// With keepalive, a call to a server that froze mid-call fails UNAVAILABLE
// once a ping goes unanswered; without it, it would wait for its deadline.
TEST(Keepalive, CallToAFrozenServerFailsUnavailable) {
  ChildServer child;
  ASSERT_NE(child.port(), 0) << "the child server did not start";
  rdmarpc::ChannelOptions options;
  options.policy = rdmarpc::TransportPolicy::kGrpc;
  options.keepalive_time = std::chrono::milliseconds(200);
  options.keepalive_timeout = std::chrono::milliseconds(500);
  auto stub = E2E::NewStub(rdmarpc::CreateChannel(
      "127.0.0.1:" + std::to_string(child.port()), options));
  {
    rdmarpc::ClientContext ctx;
    EchoRequest req;
    EchoResponse resp;
    rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
  }
  rdmarpc::ClientContext ctx;
  // Far longer than keepalive needs: reaching it means keepalive did not
  // act.
  ctx.set_timeout(std::chrono::seconds(120));
  EchoRequest req;
  req.set_sleep_ms(600000);
  EchoResponse resp;
  std::future<rdmarpc::Status> done = stub->SlowFuture(&ctx, req, &resp);
  // Frozen before or after the request reached it, the call is in flight
  // on the client all the same.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  child.Freeze();
  rdmarpc::Status s = done.get();
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

}  // namespace
}  // namespace rdmarpc_test
