// TransportRouter against fake transports: routing by policy and health,
// degrading on a failed connect or a lost connection, probing back,
// re-sending the calls in flight exactly once, and running every callback
// exactly once. No network: the fakes complete calls when told to.
#include "runtime/transport_router.h"

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "rdmarpc/client_context.h"

namespace rdmarpc::internal {
namespace {

using namespace std::chrono_literals;

// Holds the calls started on it until the test completes them.
class HeldCalls {
 public:
  void Hold(ClientCall call) {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.push_back(std::move(call));
  }
  size_t size() {
    std::lock_guard<std::mutex> lock(mu_);
    return calls_.size();
  }
  std::vector<ClientCall> TakeAll() {
    std::lock_guard<std::mutex> lock(mu_);
    std::vector<ClientCall> out(std::make_move_iterator(calls_.begin()),
                                std::make_move_iterator(calls_.end()));
    calls_.clear();
    return out;
  }

 private:
  std::mutex mu_;
  std::deque<ClientCall> calls_;
};

// The fallback: completes every call at once with OK, and remembers it.
class FakeFallback final : public ClientTransport {
 public:
  void Start(ClientCall call) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      started_.push_back({call.call_id, call.resend.has_value()});
    }
    call.done(absl::OkStatus());
  }
  // (call id, was a re-send) per call started.
  std::vector<std::pair<uint64_t, bool>> started() {
    std::lock_guard<std::mutex> lock(mu_);
    return started_;
  }

 private:
  std::mutex mu_;
  std::vector<std::pair<uint64_t, bool>> started_;
};

// A fast transport that holds its calls; Lose() breaks it the way the RDMA
// transport does: `lost`, then every held call back with `resend` set.
class FakeFast final : public FastTransport {
 public:
  explicit FakeFast(FastPathHooks hooks) : hooks_(std::move(hooks)) {}
  // Like the RDMA transport's, waits until a loss has handed every call on.
  ~FakeFast() override {
    std::lock_guard<std::mutex> losing(lose_mu_);
    for (ClientCall& c : held_.TakeAll()) {
      c.done(absl::UnavailableError("the channel was destroyed"));
    }
  }
  // A call started once the connection is lost goes over the fallback, as
  // the RDMA transport sends it (a first send: it never left): none waits
  // on a dead path.
  void Start(ClientCall call) override {
    std::lock_guard<std::mutex> losing(lose_mu_);
    if (!health().ok()) {
      hooks_.reroute(std::move(call), "fake connection broke");
      return;
    }
    held_.Hold(std::move(call));
  }
  Status health() const override {
    std::lock_guard<std::mutex> lock(mu_);
    return health_;
  }
  const std::string& description() const override { return description_; }
  FastPathCounters counters() const override { return {}; }

  void Lose(const std::string& trigger) {
    std::lock_guard<std::mutex> losing(lose_mu_);
    {
      std::lock_guard<std::mutex> lock(mu_);
      health_ = absl::UnavailableError("fake connection broke");
    }
    hooks_.lost(health_, trigger);
    for (ClientCall& c : held_.TakeAll()) {
      c.resend = ClientCall::Resend{hooks_.client_id, 1, {}};
      hooks_.reroute(std::move(c), "fake connection broke");
    }
  }
  void CompleteAll() {
    for (ClientCall& c : held_.TakeAll()) c.done(absl::OkStatus());
  }
  HeldCalls& held() { return held_; }

 private:
  FastPathHooks hooks_;
  std::mutex lose_mu_;
  mutable std::mutex mu_;
  Status health_;
  HeldCalls held_;
  std::string description_ = "fake fast path";
};

// Connect outcomes the test scripts, one per attempt; the last repeats.
class ScriptedConnector {
 public:
  // kConnectThenLose: connected, and lost at once on another thread (an
  // RDMA connection's engine may close it as the connect returns).
  // kLostAsItReturns: connected, and lost before the connect returns (its
  // `lost` hook runs before the router could know the transport).
  enum class Outcome {
    kConnect,
    kConnectThenLose,
    kLostAsItReturns,
    kFail,
    kNoFastPath
  };
  ~ScriptedConnector() { JoinLosers(); }
  explicit ScriptedConnector(std::vector<Outcome> script)
      : script_(std::move(script)) {}

  FastConnectResult operator()(FastPathHooks hooks) {
    std::lock_guard<std::mutex> lock(mu_);
    Outcome o = script_[std::min(attempts_, script_.size() - 1)];
    ++attempts_;
    switch (o) {
      case Outcome::kConnect:
      case Outcome::kConnectThenLose:
      case Outcome::kLostAsItReturns: {
        auto fast = std::make_unique<FakeFast>(std::move(hooks));
        last_ = fast.get();
        if (o == Outcome::kConnectThenLose) {
          losers_.emplace_back([fast = fast.get()] { fast->Lose("at once"); });
        }
        if (o == Outcome::kLostAsItReturns) fast->Lose("before the return");
        return {std::move(fast), absl::OkStatus()};
      }
      case Outcome::kFail:
        return {nullptr, absl::UnavailableError("fake connect refused")};
      case Outcome::kNoFastPath:
        return {nullptr, absl::FailedPreconditionError("fake: no device"),
                /*no_fast_path=*/true};
    }
    return {};
  }
  FakeFast* last() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_;
  }
  // Every attempt from now on comes to `o`.
  void ThenAlways(Outcome o) {
    std::lock_guard<std::mutex> lock(mu_);
    script_ = {o};
  }
  size_t attempts() {
    std::lock_guard<std::mutex> lock(mu_);
    return attempts_;
  }
  // Waits for the threads of kConnectThenLose; before the router goes (a
  // lost transport outlives its Lose: its destructor waits for it).
  void JoinLosers() {
    std::vector<std::thread> losers;
    {
      std::lock_guard<std::mutex> lock(mu_);
      losers.swap(losers_);
    }
    for (std::thread& t : losers) t.join();
  }

 private:
  std::mutex mu_;
  std::vector<Outcome> script_;
  size_t attempts_ = 0;
  FakeFast* last_ = nullptr;
  std::vector<std::thread> losers_;
};
using Outcome = ScriptedConnector::Outcome;

// One call's completions.
struct Done {
  std::atomic<int> runs{0};
  std::optional<Status> status;
};

class TransportRouterTest : public ::testing::Test {
 protected:
  ChannelOptions Options(TransportPolicy policy = TransportPolicy::kAuto) {
    ChannelOptions o;
    o.policy = policy;
    o.rdma_probe_initial_backoff = 1ms;
    o.rdma_probe_max_backoff = 4ms;
    return o;
  }

  std::unique_ptr<TransportRouter> Router(ChannelOptions options,
                                          std::vector<Outcome> script) {
    connector_ = std::make_shared<ScriptedConnector>(std::move(script));
    return std::make_unique<TransportRouter>(
        options, /*client_id=*/42, &fallback_,
        [c = connector_](FastPathHooks hooks) { return (*c)(hooks); });
  }

  // Routes call `id`; its completion lands in dones_[id]. Returns the
  // transport that took it.
  TransportKind Route(TransportRouter& router, uint64_t id,
                      bool wait_for_ready = false,
                      std::optional<std::chrono::milliseconds> timeout = {}) {
    contexts_.push_back(std::make_unique<ClientContext>());
    contexts_.back()->set_wait_for_ready(wait_for_ready);
    if (timeout) contexts_.back()->set_timeout(*timeout);
    ClientCall call;
    call.method = "/test.Svc/Run";
    call.ctx = contexts_.back().get();
    call.call_id = id;
    Done* done = &dones_[id];
    call.done = [done](Status s) {
      done->status = s;
      ++done->runs;
    };
    return router.Route(std::move(call));
  }

  // Waits (10 s at most) until `done` ran.
  static bool WaitForRun(const Done& done) {
    auto until = std::chrono::steady_clock::now() + 10s;
    while (done.runs.load() == 0) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  }

  // Waits until the connector was tried `n` times.
  bool WaitForAttempts(size_t n) {
    auto until = std::chrono::steady_clock::now() + 10s;
    while (connector_->attempts() < n) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  }

  static bool WaitFor(TransportRouter& router, RdmaHealth health) {
    auto until = std::chrono::steady_clock::now() + 10s;
    while (router.stats().health != health) {
      if (std::chrono::steady_clock::now() > until) return false;
      std::this_thread::sleep_for(1ms);
    }
    return true;
  }

  FakeFallback fallback_;
  std::shared_ptr<ScriptedConnector> connector_;
  std::vector<std::unique_ptr<ClientContext>> contexts_;
  Done dones_[16];
};

TEST_F(TransportRouterTest, ConnectedFastPathCarriesCalls) {
  auto router = Router(Options(), {Outcome::kConnect});
  EXPECT_EQ(Route(*router, 1), TransportKind::kNone);  // waits for connect
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  // The first call waited for the connect, then went fast.
  auto until = std::chrono::steady_clock::now() + 10s;
  while (connector_->last()->held().size() < 1 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  EXPECT_EQ(Route(*router, 2), TransportKind::kRdma);
  EXPECT_EQ(connector_->last()->held().size(), 2u);
  connector_->last()->CompleteAll();
  EXPECT_EQ(dones_[1].runs.load(), 1);
  EXPECT_EQ(dones_[2].runs.load(), 1);
  EXPECT_TRUE(fallback_.started().empty());
  ChannelTransportStats stats = router->stats();
  EXPECT_EQ(stats.calls_rdma, 2u);
  EXPECT_EQ(stats.rdma, "ready: fake fast path");
}

TEST_F(TransportRouterTest, NoFastPathMeansFallbackForGoodWithoutProbes) {
  auto router = Router(Options(), {Outcome::kNoFastPath, Outcome::kConnect});
  Route(*router, 1);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kGrpcOnly));
  EXPECT_EQ(Route(*router, 2), TransportKind::kGrpc);
  std::this_thread::sleep_for(20ms);  // a probe, were there one, would run
  EXPECT_EQ(connector_->attempts(), 1u);
  EXPECT_EQ(dones_[1].runs.load(), 1);
  EXPECT_EQ(dones_[2].runs.load(), 1);
  EXPECT_EQ(fallback_.started().size(), 2u);
  EXPECT_EQ(router->stats().probes, 0u);
  EXPECT_EQ(router->stats().rdma, "fake: no device");
}

TEST_F(TransportRouterTest, FailedConnectDegradesThenProbesBack) {
  auto router =
      Router(Options(), {Outcome::kFail, Outcome::kFail, Outcome::kConnect});
  Route(*router, 1);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  EXPECT_EQ(dones_[1].runs.load(), 1);
  ASSERT_EQ(fallback_.started().size(), 1u);  // call 1, during degraded
  ChannelTransportStats stats = router->stats();
  EXPECT_EQ(stats.last_trigger, "connect failed");
  EXPECT_EQ(stats.probes, 2u);  // one failed, one connected
  EXPECT_EQ(stats.last_probe_error, "fake connect refused");
  EXPECT_EQ(stats.switches, 1u);
  Route(*router, 2);
  EXPECT_EQ(connector_->last()->held().size(), 1u);
}

TEST_F(TransportRouterTest, LostConnectionResendsEachCallInFlightOnce) {
  auto router = Router(Options(), {Outcome::kConnect, Outcome::kFail});
  Route(*router, 1);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  Route(*router, 2);
  Route(*router, 3);
  FakeFast* fast = connector_->last();
  auto until = std::chrono::steady_clock::now() + 10s;
  while (fast->held().size() < 3 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ(fast->held().size(), 3u);
  fast->Lose("work-completion error");
  for (uint64_t id = 1; id <= 3; ++id) {
    EXPECT_EQ(dones_[id].runs.load(), 1) << id;
    EXPECT_TRUE(dones_[id].status->ok()) << id;
  }
  std::vector<std::pair<uint64_t, bool>> started = fallback_.started();
  ASSERT_EQ(started.size(), 3u);
  for (const auto& [id, resent] : started) EXPECT_TRUE(resent) << id;
  ChannelTransportStats stats = router->stats();
  EXPECT_EQ(stats.health, RdmaHealth::kDegraded);
  EXPECT_EQ(stats.last_trigger, "work-completion error");
  EXPECT_EQ(stats.calls_resent, 3u);
  EXPECT_EQ(stats.switches, 1u);
  // New calls go to the fallback while degraded, as first sends.
  Route(*router, 4);
  EXPECT_EQ(dones_[4].runs.load(), 1);
  EXPECT_FALSE(fallback_.started().back().second);
  EXPECT_NE(contexts_.back()->stats().transport_reason.find("being probed"),
            std::string::npos);
}

// A connection lost on its engine's thread as the connect returns, before
// or after the router names the transport it made (naming it raced with
// the loss: TSan), still ends the call that waited for the connect once,
// over the fallback, and the channel degrades.
TEST_F(TransportRouterTest, AConnectionLostAsItConnectsEndsItsCallOnce) {
  auto router = Router(Options(), {Outcome::kConnectThenLose, Outcome::kFail});
  Route(*router, 1);
  const bool ran = WaitForRun(dones_[1]);
  // Before any return: the router may destroy the lost transport.
  connector_->JoinLosers();
  ASSERT_TRUE(ran);
  EXPECT_EQ(dones_[1].runs.load(), 1);
  EXPECT_TRUE(dones_[1].status->ok());
  EXPECT_EQ(fallback_.started().size(), 1u);
  EXPECT_TRUE(WaitFor(*router, RdmaHealth::kDegraded));
}

// A probe's connection lost before the probe returned (its `lost` hook
// could name no transport) is not taken for a ready fast path: that one
// would stay "ready", and unprobed, until a call came. It counts as a
// failed probe, and the next probe connects.
TEST_F(TransportRouterTest, AProbeLostBeforeItReturnsCountsAsFailed) {
  auto router = Router(Options(), {Outcome::kConnect, Outcome::kLostAsItReturns,
                                   Outcome::kConnect});
  Route(*router, 1);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  connector_->last()->Lose("work-completion error");
  ASSERT_TRUE(WaitForAttempts(3));
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  ChannelTransportStats stats = router->stats();
  EXPECT_EQ(stats.probes, 2u);
  EXPECT_EQ(stats.switches, 2u);  // lost, then back on the third connect
  EXPECT_EQ(stats.last_probe_error,
            "connection lost as it connected (fake connection broke)");
  EXPECT_EQ(Route(*router, 2), TransportKind::kRdma);
  EXPECT_EQ(connector_->last()->held().size(), 1u);
  connector_->last()->CompleteAll();
  EXPECT_EQ(dones_[1].runs.load(), 1);  // re-sent over the fallback
  EXPECT_EQ(dones_[2].runs.load(), 1);
}

// The first connect's connection lost before it returned: the channel
// degrades and says why, and the call that waited for it goes over the
// fallback as a first send.
TEST_F(TransportRouterTest, AFirstConnectLostBeforeItReturnsDegrades) {
  auto router = Router(Options(), {Outcome::kLostAsItReturns, Outcome::kFail});
  Route(*router, 1);
  ASSERT_TRUE(WaitForRun(dones_[1]));
  EXPECT_TRUE(dones_[1].status->ok());
  ASSERT_EQ(fallback_.started().size(), 1u);
  EXPECT_FALSE(fallback_.started()[0].second);
  ChannelTransportStats stats = router->stats();
  EXPECT_EQ(stats.health, RdmaHealth::kDegraded);
  EXPECT_EQ(stats.last_trigger, "connection lost");
  EXPECT_EQ(stats.rdma,
            "RDMA connection lost as it connected (fake connection broke)");
  EXPECT_EQ(stats.switches, 0u);
}

// A path that keeps breaking right after each probe gets through (a lossy
// link) must not pull the channel back at the initial backoff every time.
TEST_F(TransportRouterTest, ConnectionsLostSoonAfterConnectingKeepBackingOff) {
  ChannelOptions options = Options();
  options.rdma_probe_max_backoff = 6ms;
  auto router = Router(options, {Outcome::kConnect});
  Route(*router, 1);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  for (int64_t expected_ms : {2, 4, 6, 6}) {
    connector_->last()->Lose("server silent on RDMA");
    EXPECT_EQ(router->stats().probe_backoff.count(), expected_ms);
    ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  }
  EXPECT_EQ(dones_[1].runs.load(), 1);
}

TEST_F(TransportRouterTest, PolicyRdmaFailsInsteadOfFallingBack) {
  auto router = Router(Options(TransportPolicy::kRdma), {Outcome::kConnect});
  Route(*router, 1);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  FakeFast* fast = connector_->last();
  auto until = std::chrono::steady_clock::now() + 10s;
  while (fast->held().size() < 1 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  fast->Lose("port error");
  ASSERT_EQ(dones_[1].runs.load(), 1);
  EXPECT_EQ(dones_[1].status->code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(dones_[1].status->message().find("may have run"), std::string::npos)
      << *dones_[1].status;
  EXPECT_TRUE(fallback_.started().empty());
}

// gRPC's wait-for-ready under policy 'rdma': the call waits out a down
// fast path instead of failing, and goes over RDMA once a probe is through.
TEST_F(TransportRouterTest, PolicyRdmaWaitForReadyWaitsForTheFastPath) {
  auto router = Router(Options(TransportPolicy::kRdma), {Outcome::kFail});
  EXPECT_EQ(Route(*router, 1, /*wait_for_ready=*/true), TransportKind::kNone);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kDegraded));
  ASSERT_TRUE(WaitForAttempts(4));  // three probes failed meanwhile
  EXPECT_EQ(dones_[1].runs.load(), 0);
  // Without wait-for-ready a call fails at once, saying why.
  Route(*router, 2);
  ASSERT_EQ(dones_[2].runs.load(), 1);
  EXPECT_EQ(dones_[2].status->code(), absl::StatusCode::kUnavailable);
  connector_->ThenAlways(Outcome::kConnect);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  auto until = std::chrono::steady_clock::now() + 10s;
  while (connector_->last()->held().size() < 1 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(1ms);
  }
  ASSERT_EQ(connector_->last()->held().size(), 1u);
  EXPECT_EQ(dones_[1].runs.load(), 0);
  connector_->last()->CompleteAll();
  EXPECT_EQ(dones_[1].runs.load(), 1);
  EXPECT_TRUE(dones_[1].status->ok()) << *dones_[1].status;
  EXPECT_EQ(contexts_[0]->stats().transport, TransportKind::kRdma);
  EXPECT_TRUE(fallback_.started().empty());
}

TEST_F(TransportRouterTest, AWaitingCallEndsAtItsDeadlineOrOnCancelOnce) {
  auto router = Router(Options(TransportPolicy::kRdma), {Outcome::kFail});
  Route(*router, 1, /*wait_for_ready=*/true, 50ms);
  Route(*router, 2, /*wait_for_ready=*/true);
  ASSERT_TRUE(WaitForRun(dones_[1]));
  EXPECT_EQ(dones_[1].status->code(), absl::StatusCode::kDeadlineExceeded)
      << *dones_[1].status;
  EXPECT_NE(dones_[1].status->message().find("fake connect refused"),
            std::string::npos)
      << *dones_[1].status;
  EXPECT_EQ(dones_[2].runs.load(), 0);  // no deadline: still waiting
  contexts_[1]->TryCancel();
  ASSERT_EQ(dones_[2].runs.load(), 1);
  EXPECT_EQ(dones_[2].status->code(), absl::StatusCode::kCancelled);
  // Neither runs again when the fast path comes back.
  connector_->ThenAlways(Outcome::kConnect);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  EXPECT_EQ(connector_->last()->held().size(), 0u);
  EXPECT_EQ(dones_[1].runs.load(), 1);
  EXPECT_EQ(dones_[2].runs.load(), 1);
}

TEST_F(TransportRouterTest, DestroyingTheRouterEndsWaitingCallsOnce) {
  auto router = Router(Options(TransportPolicy::kRdma), {Outcome::kFail});
  Route(*router, 1, /*wait_for_ready=*/true);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kDegraded));
  router.reset();
  ASSERT_EQ(dones_[1].runs.load(), 1);
  EXPECT_EQ(dones_[1].status->code(), absl::StatusCode::kUnavailable);
  contexts_[0]->TryCancel();  // after the router: nothing to reach
  EXPECT_EQ(dones_[1].runs.load(), 1);
}

TEST_F(TransportRouterTest, PolicyGrpcNeverConnects) {
  auto router = Router(Options(TransportPolicy::kGrpc), {Outcome::kConnect});
  Route(*router, 1);
  EXPECT_EQ(dones_[1].runs.load(), 1);
  EXPECT_EQ(connector_->attempts(), 0u);
  EXPECT_EQ(router->stats().health, RdmaHealth::kGrpcOnly);
}

TEST_F(TransportRouterTest, DestroyingTheRouterCompletesHeldCallsOnce) {
  auto router = Router(Options(), {Outcome::kConnect});
  Route(*router, 1);
  ASSERT_TRUE(WaitFor(*router, RdmaHealth::kReady));
  Route(*router, 2);
  router.reset();
  for (uint64_t id = 1; id <= 2; ++id) {
    EXPECT_EQ(dones_[id].runs.load(), 1) << id;
    EXPECT_EQ(dones_[id].status->code(), absl::StatusCode::kUnavailable);
  }
}

}  // namespace
}  // namespace rdmarpc::internal
