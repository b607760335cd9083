// The channel's fallback triggers that need a server to misbehave, driven by
// fault points (runtime/fault_injection.h) on real RDMA (label rdma): a
// server without RDMA, a refused handshake, a connect that times out or
// fails for a while, a server that stops answering on RDMA while its gRPC
// port answers, a response lost on the wire while the server answers, a
// handler that runs longer than the peer timeout (not a stall), a response
// whose send fails on a closing connection, and a shutdown with a re-send
// pending. Each checks the channel's state, its
// trigger text, that calls complete (the handler running once), and
// fail-back where RDMA can recover.
#include <gtest/gtest.h>

#include <cerrno>
#include <chrono>
#include <future>
#include <initializer_list>
#include <string>
#include <thread>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "e2e_fixture.h"
#include "runtime/fault_injection.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc_test {
namespace {

using namespace std::chrono_literals;
using rdmarpc::RdmaHealth;
namespace fault = rdmarpc::internal::fault;

class FallbackTest : public ::testing::Test {
 protected:
  void TearDown() override { fault::DisarmAll(); }

  void Start(bool rdma = true) {
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort("127.0.0.1:0", &port_)
                      .RegisterService(&service_)
                      .EnableRdma(rdma)
                      .BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = *std::move(server);
  }

  std::shared_ptr<rdmarpc::Channel> Channel(rdmarpc::ChannelOptions options) {
    options.rdma_probe_initial_backoff = 50ms;
    options.rdma_probe_max_backoff = 200ms;
    return rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                  options);
  }

  // An Echo of `size` bytes; returns the transport, or kNone on failure.
  // `landing`, if given, is where the response's tensor lands (at least
  // `size` bytes), instead of memory the transport picks.
  rdmarpc::TransportKind Echo(rdmarpc::Channel* channel, size_t size,
                              rdmarpc::Status* status = nullptr,
                              uint8_t* landing = nullptr) {
    std::vector<uint8_t> bytes = Pattern(size, static_cast<uint32_t>(size));
    rdmarpc::ClientContext ctx;
    if (landing != nullptr) {
      ctx.SetResponseTensorBuffer(0,
                                  rdmarpc::TensorBuffer::Borrow(landing, size));
    }
    EchoRequest req;
    EchoResponse resp;
    EXPECT_TRUE(ctx.tensors()
                    .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8,
                         {static_cast<int64_t>(size)},
                         rdmarpc::TensorBuffer::Borrow(bytes.data(), size))
                    .ok());
    rdmarpc::Status s =
        channel->Call("/rdmarpc_test.E2E/Echo", &ctx, req, &resp);
    if (status != nullptr) *status = s;
    if (!s.ok()) return rdmarpc::TransportKind::kNone;
    auto out = ctx.tensors().Get(resp.tensor());
    EXPECT_TRUE(out.ok() && out->size() == size &&
                std::memcmp(out->data(), bytes.data(), size) == 0);
    return ctx.stats().transport;
  }

  // Echoes of `size` bytes (landing in `landing`, if given) until one
  // was granted through a window, and for the landing arena through its
  // window alone: the connection registers the arena's segment aside after
  // its first landing there (meanwhile the block gets a registration and a
  // window of its own).
  void EchoUntilWindowsAreUsed(rdmarpc::Channel* channel, size_t size,
                               uint8_t* landing) {
    auto until = std::chrono::steady_clock::now() + 60s;
    bool granted = false;
    while (!granted && std::chrono::steady_clock::now() < until) {
      const auto before = channel->transport_stats();
      ASSERT_EQ(Echo(channel, size, nullptr, landing),
                rdmarpc::TransportKind::kRdma);
      const auto after = channel->transport_stats();
      granted = after.rdma_landing_windows > before.rdma_landing_windows &&
                (landing != nullptr || after.rdma_landing_registrations ==
                                           before.rdma_landing_registrations);
    }
    ASSERT_TRUE(granted) << channel->transport_stats().ToString();
  }

  // The fault closed `channel`'s connection (the call may finish before
  // the close reaches the channel) and no call was re-sent.
  void ExpectClosedByTheFaultWithoutAResend(rdmarpc::Channel* channel) {
    auto until = std::chrono::steady_clock::now() + 10s;
    while (channel->transport_stats().last_trigger.empty() &&
           std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(5ms);
    }
    rdmarpc::ChannelTransportStats stats = channel->transport_stats();
    EXPECT_EQ(stats.last_trigger, "fault") << stats.ToString();
    EXPECT_EQ(stats.calls_resent, 0u) << stats.ToString();
  }

  // Starts a Slow call of `sleep_ms` (the request and response must
  // outlive it) and returns once its handler runs.
  std::future<rdmarpc::Status> StartSlow(rdmarpc::Channel* channel,
                                         rdmarpc::ClientContext* ctx,
                                         EchoRequest* req, EchoResponse* resp,
                                         int sleep_ms) {
    int started = service_.slow_started.load();
    req->set_sleep_ms(sleep_ms);
    auto future =
        channel->CallFuture("/rdmarpc_test.E2E/Slow", ctx, *req, resp);
    while (service_.slow_started.load() == started) {
      std::this_thread::sleep_for(5ms);
    }
    return future;
  }

  static bool WaitFor(rdmarpc::Channel* channel, RdmaHealth health,
                      std::chrono::milliseconds limit) {
    auto until = std::chrono::steady_clock::now() + limit;
    while (channel->transport_stats().health != health) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(10ms);
    }
    return true;
  }

  // With each of `delays` (a fault point and its milliseconds) armed once
  // to delay a connect step, a connect timeout of `timeout` degrades the
  // channel, saying so (and naming `step`, when given), and a probe then
  // gets through.
  void ExpectConnectTimeoutDegradesOnce(
      std::chrono::milliseconds timeout,
      std::initializer_list<std::pair<const char*, int>> delays,
      const char* step) {
    for (const auto& [point, ms] : delays) fault::Arm(point, 1, ms);
    rdmarpc::ChannelOptions options;
    options.rdma_connect_timeout = timeout;
    auto channel = Channel(options);
    EXPECT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kGrpc);
    rdmarpc::ChannelTransportStats stats = channel->transport_stats();
    EXPECT_EQ(stats.last_trigger, "connect failed");
    EXPECT_NE(
        stats.last_error.find(absl::StrCat("within ", timeout.count(), " ms")),
        std::string::npos)
        << stats.last_error;
    if (step != nullptr) {
      EXPECT_NE(stats.last_error.find(step), std::string::npos)
          << stats.last_error;
    }
    ASSERT_TRUE(WaitFor(channel.get(), RdmaHealth::kReady, 10s))
        << channel->transport_stats().ToString();
    EXPECT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kRdma);
  }

  E2EService service_;
  int port_ = 0;
  std::unique_ptr<rdmarpc::Server> server_;
};

TEST_F(FallbackTest, ServerWithoutRdmaMeansGrpcOnly) {
  Start(/*rdma=*/false);
  auto channel = Channel({});
  EXPECT_EQ(Echo(channel.get(), 4096), rdmarpc::TransportKind::kGrpc);
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_EQ(stats.health, RdmaHealth::kGrpcOnly);
  EXPECT_NE(stats.rdma.find("RDMA disabled"), std::string::npos) << stats.rdma;
  EXPECT_EQ(stats.probes, 0u);

  rdmarpc::ChannelOptions required;
  required.policy = rdmarpc::TransportPolicy::kRdma;
  auto strict = Channel(required);
  rdmarpc::Status s;
  EXPECT_EQ(Echo(strict.get(), 64, &s), rdmarpc::TransportKind::kNone);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_NE(s.message().find("policy 'rdma'"), std::string::npos) << s;
}

TEST_F(FallbackTest, RefusedHandshakeDegradesThenFailsBack) {
  Start();
  fault::Arm("rdma.server.refuse_connect");
  auto channel = Channel({});
  EXPECT_EQ(Echo(channel.get(), 100000), rdmarpc::TransportKind::kGrpc);
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_EQ(stats.health, RdmaHealth::kDegraded);
  EXPECT_EQ(stats.last_trigger, "connect failed");
  EXPECT_NE(stats.last_error.find("REJECTED"), std::string::npos)
      << stats.last_error;
  fault::Disarm("rdma.server.refuse_connect");
  ASSERT_TRUE(WaitFor(channel.get(), RdmaHealth::kReady, 10s))
      << channel->transport_stats().ToString();
  EXPECT_EQ(Echo(channel.get(), 100000), rdmarpc::TransportKind::kRdma);
  EXPECT_GE(channel->transport_stats().probes, 1u);
  EXPECT_GE(server_->rdma_stats().connects_refused, 1u);
}

// The accept is late: the CM connect runs out (or, on a loaded machine,
// the handshake before it: the budget is one, and so is the error).
TEST_F(FallbackTest, ConnectTimeoutDegrades) {
  Start();
  ExpectConnectTimeoutDegradesOnce(
      500ms, {{"rdma.server.accept_delay_ms", 1500}}, nullptr);
}

// The connect timeout bounds the handshake over gRPC too, with the same
// error: a loaded server that answers the handshake late is a timeout, not
// a bare "Deadline Exceeded".
TEST_F(FallbackTest, ConnectTimeoutCoversTheHandshake) {
  Start();
  ExpectConnectTimeoutDegradesOnce(
      500ms, {{"rdma.server.hello_delay_ms", 1500}}, "handshake over gRPC");
}

// One budget for both steps: a handshake and an accept late by 1.2 s each
// (either alone fits in 2 s, with room for the soft-RoCE VM's own connect
// time) time the connect out in its second step.
TEST_F(FallbackTest, ConnectTimeoutIsOneBudgetForBothSteps) {
  Start();
  ExpectConnectTimeoutDegradesOnce(2000ms,
                                   {{"rdma.server.hello_delay_ms", 1200},
                                    {"rdma.server.accept_delay_ms", 1200}},
                                   nullptr);
}

TEST_F(FallbackTest, ServerSilentOnRdmaIsDetectedAndTheCallResentOnce) {
  Start();
  rdmarpc::ChannelOptions options;
  options.rdma_peer_timeout = 600ms;
  auto channel = Channel(options);
  ASSERT_EQ(Echo(channel.get(), 300000), rdmarpc::TransportKind::kRdma);
  int runs_before = service_.echo_calls.load();
  fault::Arm("rdma.server.ignore_frames");
  auto start = std::chrono::steady_clock::now();
  rdmarpc::Status s;
  // Written (300 KB): the request frame is dropped, so the handler cannot
  // have run; the re-send over gRPC runs it.
  EXPECT_EQ(Echo(channel.get(), 300000, &s), rdmarpc::TransportKind::kGrpc)
      << s;
  auto took = std::chrono::steady_clock::now() - start;
  EXPECT_LT(took, 5s) << "detection is bounded by rdma_peer_timeout";
  EXPECT_EQ(service_.echo_calls.load(), runs_before + 1);
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_EQ(stats.last_trigger, "server silent on RDMA") << stats.ToString();
  EXPECT_EQ(stats.calls_resent, 1u);
  // The channel left RDMA. Whether it is still degraded depends on timing:
  // the server's CM accepts a probe while it ignores frames (seen under
  // TSan: ready again by the time the re-sent call returned).
  EXPECT_GE(stats.switches, 1u) << stats.ToString();
  fault::Disarm("rdma.server.ignore_frames");
  ASSERT_TRUE(WaitFor(channel.get(), RdmaHealth::kReady, 10s))
      << channel->transport_stats().ToString();
}

TEST_F(FallbackTest, ResponseLostOnTheWireIsResentOnceAfterNoProgress) {
  Start();
  rdmarpc::ChannelOptions options;
  options.rdma_peer_timeout = 600ms;
  auto channel = Channel(options);
  ASSERT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kRdma);
  int runs_before = service_.echo_calls.load();
  // The handler runs, its response never arrives, and the server still
  // answers pings: the call makes no progress while the server answers,
  // as on a path that loses packets.
  fault::Arm("rdma.server.lose_response", /*times=*/1);
  rdmarpc::Status s;
  EXPECT_EQ(Echo(channel.get(), 64, &s), rdmarpc::TransportKind::kGrpc) << s;
  EXPECT_EQ(service_.echo_calls.load(), runs_before + 1)
      << "the re-send is answered from the kept response, not run again";
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_EQ(stats.last_trigger, "no progress on RDMA") << stats.ToString();
  EXPECT_NE(stats.last_error.find("losing packets"), std::string::npos)
      << stats.last_error;
  EXPECT_EQ(stats.calls_resent, 1u);
  ASSERT_TRUE(WaitFor(channel.get(), RdmaHealth::kReady, 10s))
      << channel->transport_stats().ToString();
  EXPECT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kRdma);
}

TEST_F(FallbackTest, HandlerRunningLongerThanThePeerTimeoutIsNotAStall) {
  Start();
  rdmarpc::ChannelOptions options;
  options.rdma_peer_timeout = 300ms;
  auto channel = Channel(options);
  ASSERT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kRdma);
  rdmarpc::ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  // Ten peer timeouts: the pongs name the running handler each time.
  auto slow = StartSlow(channel.get(), &ctx, &req, &resp, /*sleep_ms=*/3000);
  EXPECT_TRUE(slow.get().ok());
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_EQ(stats.health, RdmaHealth::kReady) << stats.ToString();
  EXPECT_EQ(stats.calls_resent, 0u);
}

// A large transfer slower than the watch allows for its bytes, but moving:
// written in 1 MiB pieces, each posted 100 ms late, both ways. Each piece
// the client writes moves the call, and the server's pongs name it while
// its response's pieces move, so the call stays on RDMA.
TEST_F(FallbackTest, SlowLargeTransferThatMovesIsNotAStall) {
  setenv("RDMARPC_RDMA_MAX_WRITE_BYTES", "1048576", 1);
  Start();
  rdmarpc::ChannelOptions options;
  options.rdma_peer_timeout = 300ms;
  auto channel = Channel(options);
  ASSERT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kRdma);
  unsetenv("RDMARPC_RDMA_MAX_WRITE_BYTES");
  // 16 MiB: the watch allows 250 ms for its bytes, and the pieces take
  // 1.6 s each way.
  fault::Arm("rdma.post_aside.delay_ms", -1, 100);
  EXPECT_EQ(Echo(channel.get(), size_t{16} << 20),
            rdmarpc::TransportKind::kRdma);
  fault::Disarm("rdma.post_aside.delay_ms");
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_EQ(stats.health, RdmaHealth::kReady) << stats.ToString();
  EXPECT_EQ(stats.calls_resent, 0u);
  EXPECT_GE(stats.rdma_writes_posted, 16u);
}

TEST_F(FallbackTest, HandlerRunningWhenTheConnectionDropsRunsOnce) {
  Start();
  auto channel = Channel({});
  ASSERT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kRdma);
  int started = service_.slow_started.load();
  // The Slow call is running on the server when the client's queue pair
  // breaks; the re-send over gRPC waits for that run and gets its outcome.
  rdmarpc::ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  auto future = StartSlow(channel.get(), &ctx, &req, &resp, 800);
  fault::Arm("rdma.client.qp_error", 1);
  rdmarpc::Status s = future.get();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.note(), "slept");
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kGrpc);
  EXPECT_EQ(service_.slow_started.load(), started + 1);
  EXPECT_EQ(channel->transport_stats().calls_resent, 1u);
  EXPECT_GE(server_->call_log_stats().repeats_answered, 1u);
}

TEST_F(FallbackTest, TransientConnectErrorDegradesAndProbesBack) {
  Start();
  // An address in use is a passing condition, not "no RDMA here".
  fault::Arm("rdma.client.resolve_errno", 1, EADDRINUSE);
  auto channel = Channel({});
  EXPECT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kGrpc);
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_NE(stats.health, RdmaHealth::kGrpcOnly) << stats.ToString();
  EXPECT_EQ(stats.last_trigger, "connect failed");
  EXPECT_NE(stats.last_error.find("rdma_resolve_addr"), std::string::npos)
      << stats.last_error;
  ASSERT_TRUE(WaitFor(channel.get(), RdmaHealth::kReady, 10s))
      << channel->transport_stats().ToString();
  EXPECT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kRdma);
}

TEST_F(FallbackTest, ResponseSendFailingOnAClosingConnectionIsKeptForResend) {
  Start();
  auto channel = Channel({});
  ASSERT_EQ(Echo(channel.get(), 300000), rdmarpc::TransportKind::kRdma);
  int runs_before = service_.echo_calls.load();
  // The handler runs; its response (written parts, no send callback) fails
  // to go out because the connection starts closing. The log must keep it
  // for the client's re-send over gRPC.
  fault::Arm("rdma.server.close_before_response", 1);
  rdmarpc::Status s;
  EXPECT_EQ(Echo(channel.get(), 300000, &s), rdmarpc::TransportKind::kGrpc)
      << s;
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(service_.echo_calls.load(), runs_before + 1);
  EXPECT_EQ(channel->transport_stats().calls_resent, 1u);
  EXPECT_GE(server_->call_log_stats().repeats_answered, 1u);
}

TEST_F(FallbackTest, GrantSendFailingOnAClosingConnectionResendsTheCall) {
  Start();
  auto channel = Channel({});
  ASSERT_EQ(Echo(channel.get(), 300000), rdmarpc::TransportKind::kRdma);
  int runs_before = service_.echo_calls.load();
  // The handler ran and its response asks for a grant; the client's grant
  // cannot go out because the connection starts closing. The call must be
  // re-sent (the server's log answers it), not failed with the send error.
  fault::Arm("rdma.client.close_before_grant", 1);
  rdmarpc::Status s;
  EXPECT_EQ(Echo(channel.get(), 300000, &s), rdmarpc::TransportKind::kGrpc)
      << s;
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(service_.echo_calls.load(), runs_before + 1);
  EXPECT_EQ(channel->transport_stats().calls_resent, 1u);
  EXPECT_GE(server_->call_log_stats().repeats_answered, 1u);
}

// The same when the window for the response's landing (the caller's own
// buffer, registered for the call) cannot be bound because the
// connection is closing: the call is re-sent, not failed.
TEST_F(FallbackTest, WindowBindFailingOnAClosingConnectionResendsTheCall) {
  Start();
  auto channel = Channel({});
  constexpr size_t kBytes = 300000;
  std::vector<uint8_t> landing(kBytes);
  ASSERT_NO_FATAL_FAILURE(
      EchoUntilWindowsAreUsed(channel.get(), kBytes, landing.data()));
  int runs_before = service_.echo_calls.load();
  fault::Arm("rdma.close_before_window_bind", 1);
  rdmarpc::Status s;
  EXPECT_EQ(Echo(channel.get(), kBytes, &s, landing.data()),
            rdmarpc::TransportKind::kGrpc)
      << s;
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_FALSE(fault::Take("rdma.close_before_window_bind").has_value());
  EXPECT_EQ(service_.echo_calls.load(), runs_before + 1);
  EXPECT_EQ(channel->transport_stats().calls_resent, 1u);
  EXPECT_GE(server_->call_log_stats().repeats_answered, 1u);
}

TEST_F(FallbackTest, ResponseLandedBeforeTheConnectionFailedIsTheAnswer) {
  // As on a device without memory windows (with them, the next tests), so
  // that the landing is registered for this call alone (for remote write,
  // which only a protection domain of the connection's own allows).
  rdmarpc::rdma::SetSharedDomainsForTesting(false);
  absl::Cleanup shared_again = [] {
    rdmarpc::rdma::SetSharedDomainsForTesting(true);
  };
  fault::Arm("rdma.no_landing_windows");
  Start();
  auto channel = Channel({});
  // Over 1 MiB: the landing memory is registered and deregistered aside,
  // and the connection fails while it is deregistered. The server
  // counts the response delivered (its writes completed), so a re-send
  // would be refused ("already ran and its response was delivered"): the
  // landed response must answer the call.
  constexpr size_t kBytes = 3 << 20;
  std::vector<uint8_t> landing(kBytes);
  ASSERT_EQ(Echo(channel.get(), kBytes, nullptr, landing.data()),
            rdmarpc::TransportKind::kRdma);
  int runs_before = service_.echo_calls.load();
  fault::Arm("rdma.client.close_while_landing", 1);
  rdmarpc::Status s;
  EXPECT_EQ(Echo(channel.get(), kBytes, &s, landing.data()),
            rdmarpc::TransportKind::kRdma)
      << s;
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(service_.echo_calls.load(), runs_before + 1);
  ExpectClosedByTheFaultWithoutAResend(channel.get());
}

// The same with the response granted through a window: the connection
// fails before the window's invalidation is posted. The window covers a
// block of the landing arena, or the caller's own buffer, registered for
// this call, which must still deregister once the connection's windows
// are gone (a region under a bound window cannot).
class WindowLandingTest : public FallbackTest,
                          public ::testing::WithParamInterface<bool> {};

TEST_P(WindowLandingTest,
       ResponseLandedThroughAWindowBeforeTheConnectionFailed) {
  const bool own_buffer = GetParam();
  const uint64_t failed_before = rdmarpc::rdma::FailedDeregistrations();
  Start();
  auto channel = Channel({});
  constexpr size_t kBytes = 3 << 20;
  std::vector<uint8_t> landing(kBytes);
  uint8_t* into = own_buffer ? landing.data() : nullptr;
  ASSERT_NO_FATAL_FAILURE(EchoUntilWindowsAreUsed(channel.get(), kBytes, into));
  int runs_before = service_.echo_calls.load();
  fault::Arm("rdma.client.close_before_window_ends", 1);
  rdmarpc::Status s;
  EXPECT_EQ(Echo(channel.get(), kBytes, &s, into),
            rdmarpc::TransportKind::kRdma)
      << s;
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(service_.echo_calls.load(), runs_before + 1);
  ExpectClosedByTheFaultWithoutAResend(channel.get());
  // The closed connection's regions deregister on the registration
  // thread, in order: a task queued after them runs once they did.
  std::promise<void> drained;
  rdmarpc::rdma::RunAside([&] { drained.set_value(); });
  drained.get_future().wait();
  EXPECT_EQ(rdmarpc::rdma::FailedDeregistrations(), failed_before);
}

INSTANTIATE_TEST_SUITE_P(Landing, WindowLandingTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "InTheCallersBuffer"
                                             : "InTheLandingArena";
                         });

TEST_F(FallbackTest, ShutdownWithAResendPendingEndsByItsDeadline) {
  Start();
  auto channel = Channel({});
  ASSERT_EQ(Echo(channel.get(), 64), rdmarpc::TransportKind::kRdma);
  int started = service_.slow_started.load();
  int saw_cancel = service_.slow_saw_cancel.load();
  rdmarpc::ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  auto future = StartSlow(channel.get(), &ctx, &req, &resp, 120000);
  // The connection breaks under the running handler: the re-send over
  // gRPC waits in the server's call log for that run.
  fault::Arm("rdma.client.qp_error", 1);
  while (channel->transport_stats().calls_resent == 0) {
    std::this_thread::sleep_for(5ms);
  }
  auto start = std::chrono::steady_clock::now();
  server_->Shutdown(std::chrono::system_clock::now() + 1s);
  auto took = std::chrono::steady_clock::now() - start;
  // Far below the handler's own 120 s: the deadline ended it.
  EXPECT_LT(took, 60s);
  rdmarpc::Status s = future.get();
  EXPECT_FALSE(s.ok());
  EXPECT_EQ(service_.slow_saw_cancel.load(), saw_cancel + 1)
      << "the detached handler is cancelled at the deadline";
  EXPECT_EQ(service_.slow_started.load(), started + 1);
}

}  // namespace
}  // namespace rdmarpc_test
