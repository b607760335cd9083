// The RDMA transport under load and under attack: many calls in flight,
// many connections, credits running out, a 1 GiB tensor, split writes,
// zero-copy accounting, and peers that break the rules. Needs an RDMA
// device (label rdma: run through tests/rdma_vm/run.sh).
#include <gtest/gtest.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <future>
#include <iostream>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/cleanup/cleanup.h"
#include "e2e_fixture.h"
#include "runtime/fault_injection.h"
#include "runtime/spin.h"
#include "transport/grpc/grpc_client.h"
#include "transport/rdma/arena_regions.h"
#include "transport/rdma/completion_group.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/engine.h"
#include "transport/rdma/landing_arena.h"
#include "transport/rdma/rdma_client.h"
#include "transport/rdma/send_pool.h"
#include "transport/rdma/verbs.h"
#include "transport/rdma/wire.h"

namespace rdmarpc_test {
namespace {

using rdmarpc::ClientContext;
using rdmarpc::TensorBuffer;

class Service final : public E2E::Service {
 public:
  rdmarpc::Status Echo(rdmarpc::ServerContext* ctx, const EchoRequest& req,
                       EchoResponse* resp) override {
    ++echo_calls;
    resp->set_note(req.note());
    if (req.note() == "thread") {
      std::lock_guard<std::mutex> lock(mu);
      handler_thread = std::this_thread::get_id();
    }
    if (req.fail_code() == 2) {  // a request without a tensor, answered
      // with a tensor of `note` bytes (Pattern(bytes, 7))
      std::vector<uint8_t> bytes = Pattern(std::stoull(req.note()), 7);
      RDMARPC_ASSIGN_OR_RETURN(TensorBuffer out,
                               TensorBuffer::Allocate(bytes.size()));
      std::memcpy(out.data(), bytes.data(), bytes.size());
      return ctx->tensors().Set(resp->mutable_tensor(), rdmarpc::DTYPE_U8,
                                {static_cast<int64_t>(bytes.size())},
                                std::move(out));
    }
    if (!req.has_tensor()) return absl::OkStatus();
    RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorView in,
                             ctx->tensors().Get(req.tensor()));
    const auto* p = static_cast<const uint8_t*>(in.data());
    if (req.fail_code() == 1) {  // checksum instead of echo
      uint64_t sum = 0;
      for (size_t i = 0; i < in.size(); i += 4096) sum += p[i] * (i + 1);
      resp->set_note(std::to_string(sum));
      return absl::OkStatus();
    }
    if (req.fail_code() == 3) {  // counts the non-zero bytes, no echo
      std::lock_guard<std::mutex> lock(mu);
      nonzero_bytes.push_back(in.size() - std::count(p, p + in.size(), 0));
      return absl::OkStatus();
    }
    return ctx->tensors().Set(resp->mutable_tensor(), in);
  }
  rdmarpc::Status Slow(rdmarpc::ServerContext*, const EchoRequest& req,
                       EchoResponse* resp) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(req.sleep_ms()));
    resp->set_note(req.note());
    return absl::OkStatus();
  }
  std::atomic<int> echo_calls{0};
  std::mutex mu;
  std::vector<size_t> nonzero_bytes;  // guarded by mu
  std::thread::id handler_thread;     // of the last "thread" echo; mu
};

// Handlers run on the engine thread (the default), or with
// `inline_handlers` false on `workers` worker threads.
std::unique_ptr<rdmarpc::Server> StartServer(Service* service, int* port,
                                             uint32_t receives = 64,
                                             int workers = 8,
                                             bool inline_handlers = true) {
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", port)
                    .RegisterService(service)
                    .SetNumWorkers(workers)
                    .SetRdmaReceives(receives)
                    .SetRunHandlersInline(inline_handlers)
                    .BuildAndStart();
  EXPECT_TRUE(server.ok()) << server.status();
  return server.ok() ? std::move(*server) : nullptr;
}

std::shared_ptr<rdmarpc::Channel> RdmaChannel(
    int port, rdmarpc::ChannelOptions options = {}) {
  options.policy = rdmarpc::TransportPolicy::kRdma;
  // Generous: these tests are about calls, not connect speed, and 32
  // simultaneous connects take seconds in a TCG VM under TSan.
  options.rdma_connect_timeout = std::chrono::seconds(60);
  return rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port), options);
}

// Binds `size` bytes at `data` (borrowed) to req.tensor as u8.
rdmarpc::Status BindBytes(ClientContext* ctx, EchoRequest* req,
                          const uint8_t* data, size_t size) {
  return ctx->tensors().Set(req->mutable_tensor(), rdmarpc::DTYPE_U8,
                            {static_cast<int64_t>(size)},
                            TensorBuffer::Borrow(data, size));
}

// One echo with a `size`-byte tensor; true when it came back byte-exact
// over RDMA.
bool EchoOnce(E2E::Stub* stub, size_t size, uint32_t seed) {
  std::vector<uint8_t> bytes = Pattern(size, seed);
  ClientContext ctx;
  EchoRequest req;
  req.set_note(std::to_string(seed));
  if (!BindBytes(&ctx, &req, bytes.data(), size).ok()) {
    return false;
  }
  EchoResponse resp;
  rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
  if (!s.ok()) {
    ADD_FAILURE() << s;
    return false;
  }
  auto out = ctx.tensors().Get(resp.tensor());
  return out.ok() && resp.note() == std::to_string(seed) &&
         ctx.stats().transport == rdmarpc::TransportKind::kRdma &&
         out->size() == size &&
         std::memcmp(out->data(), bytes.data(), size) == 0;
}

// Connects `stub` over `channel` with one call (seed 1) while new
// connections spread over as many engines as a process may have: each
// then finds an engine without connections, whatever other tests left
// closing, so the client's and the server's connections get one each.
bool ConnectOnEnginesOfTheirOwn(E2E::Stub* stub) {
  rdmarpc::rdma::Engine::SetPollersForTesting(
      rdmarpc::rdma::Engine::kMaxPollers);
  const bool connected = EchoOnce(stub, 64, 1);
  rdmarpc::rdma::Engine::SetPollersForTesting(0);
  return connected;
}

// Whether the fault point `held` was armed (and takes it), within 60 s: a
// thread held by HoldWhileArmed arms it once it waits.
bool WaitUntilArmed(const char* held) {
  for (int i = 0; i < 60000; ++i) {
    if (rdmarpc::internal::fault::Take(held).has_value()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  return false;
}

// 8 threads make 8 echoes each, call i of a thread with size_of(i) bytes;
// how many came back byte-exact over RDMA.
int EchoFromEightThreads(E2E::Stub* stub, size_t (*size_of)(int i),
                         uint32_t first_seed) {
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < 8; ++i) {
        if (EchoOnce(stub, size_of(i), first_seed + t * 8 + i)) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  return ok.load();
}

TEST(RdmaTransport, TwoHundredFiftySixCallsInFlightOnOneConnection) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  constexpr int kCalls = 256;
  struct Call {
    ClientContext ctx;
    EchoRequest req;
    EchoResponse resp;
    std::vector<uint8_t> bytes;
    std::promise<rdmarpc::Status> done;
  };
  std::vector<std::unique_ptr<Call>> calls;
  for (int i = 0; i < kCalls; ++i) {
    auto c = std::make_unique<Call>();
    // Alternate inline-sized and written tensors.
    c->bytes = Pattern(i % 2 == 0 ? 100 + i : (64 << 10) + i, i);
    ASSERT_TRUE(
        BindBytes(&c->ctx, &c->req, c->bytes.data(), c->bytes.size()).ok());
    calls.push_back(std::move(c));
  }
  for (auto& c : calls) {
    Call* raw = c.get();
    stub->Echo(&raw->ctx, raw->req, &raw->resp,
               [raw](rdmarpc::Status s) { raw->done.set_value(s); });
  }
  int ok = 0;
  for (auto& c : calls) {
    rdmarpc::Status s = c->done.get_future().get();
    EXPECT_TRUE(s.ok()) << s;
    auto out = c->ctx.tensors().Get(c->resp.tensor());
    if (s.ok() && out.ok() && out->size() == c->bytes.size() &&
        std::memcmp(out->data(), c->bytes.data(), c->bytes.size()) == 0 &&
        c->ctx.stats().transport == rdmarpc::TransportKind::kRdma) {
      ++ok;
    }
  }
  EXPECT_EQ(ok, kCalls);
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_EQ(stats.rdma.rfind("ready: ", 0), 0u) << stats.rdma;
  EXPECT_GT(stats.rdma_writes_posted, 0u);
}

// Inline handlers run on the completion engine and respond at once: the
// endpoint must not hold its lock across the handler (it did, and the first
// call deadlocked).
TEST(RdmaTransport, InlineHandlersServeSentAndWrittenTensors) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  // In the SEND, then written into a grant (dispatched when the write lands).
  EXPECT_TRUE(EchoOnce(stub.get(), 100, 1));
  EXPECT_TRUE(EchoOnce(stub.get(), (1 << 20) + 3, 2));
  EXPECT_EQ(
      EchoFromEightThreads(
          stub.get(), [](int i) -> size_t { return i % 2 ? 70000 : 200; }, 100),
      64);
  EXPECT_EQ(service.echo_calls.load(), 66);
}

// Echoes 70000 bytes (written both ways) until a call makes no landing
// registration (`registrations` returns the counts of both ends): the
// landing arena's segment is registered where these calls land (aside,
// after the first landing there). False when that took over two minutes
// or an echo failed.
template <typename Registrations>
bool EchoUntilLandingsInTheArena(E2E::Stub* stub, Registrations registrations) {
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::minutes(2);
  for (uint32_t seed = 1; std::chrono::steady_clock::now() < give_up; ++seed) {
    const auto before = registrations();
    if (!EchoOnce(stub, 70000, seed)) return false;
    if (registrations() == before) return true;
  }
  return false;
}

// Small written tensors land in the pre-registered landing arena, granted
// through memory windows with no registration of their own, once a
// connection has registered the arena's segment (aside, after its first
// landing there): both ways, byte-exact, with calls in flight that hold
// windows at once.
TEST(RdmaTransport, SmallTensorsLandInTheArenaThroughWindows) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  auto registrations = [&] {
    return std::make_pair(channel->transport_stats().rdma_landing_registrations,
                          server->rdma_stats().landing_registrations);
  };
  // The segment's registration is work off the engine: wait for it.
  ASSERT_TRUE(EchoUntilLandingsInTheArena(stub.get(), registrations))
      << channel->transport_stats().ToString();
  const uint64_t client_before =
      channel->transport_stats().rdma_landing_windows;
  const uint64_t server_before = server->rdma_stats().landing_windows;
  const auto registrations_before = registrations();
  // Over the inline threshold (24 KiB), under the arena's 1 MiB per call.
  EXPECT_EQ(EchoFromEightThreads(
                stub.get(),
                [](int i) -> size_t { return 40000 + 4099 * size_t(i); }, 1000),
            64);
  // 8 callers hold at most 8 of a connection's 32 windows per side: every
  // one of these calls had one.
  EXPECT_EQ(channel->transport_stats().rdma_landing_windows - client_before,
            64u);
  EXPECT_EQ(server->rdma_stats().landing_windows - server_before, 64u);
  EXPECT_EQ(registrations(), registrations_before);
}

// Connections that share their group's protection domain share its
// registration of the landing arena too: once the first connection's
// landings come from the arena, a new connection's first call lands there
// through windows on both sides, with no registration of its own, and no
// segment is registered again.
TEST(RdmaTransport, ConnectionsOfADomainRegisterTheArenaOnce) {
  rdmarpc::rdma::Engine::SetPollersForTesting(1);
  absl::Cleanup pollers_again = [] {
    rdmarpc::rdma::Engine::SetPollersForTesting(0);
  };
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  constexpr int kChannels = 4;
  std::vector<std::shared_ptr<rdmarpc::Channel>> channels;
  std::vector<std::unique_ptr<E2E::Stub>> stubs;
  for (int i = 0; i < kChannels; ++i) {
    channels.push_back(RdmaChannel(port));
    stubs.push_back(E2E::NewStub(channels.back()));
  }
  auto registrations = [&](int i) {
    return std::make_pair(
        channels[i]->transport_stats().rdma_landing_registrations,
        server->rdma_stats().landing_registrations);
  };
  ASSERT_TRUE(EchoUntilLandingsInTheArena(stubs[0].get(), [&] {
    return registrations(0);
  })) << channels[0]->transport_stats().ToString();
  if (server->rdma_stats().connections_in_shared_domains == 0) {
    GTEST_SKIP() << "connections here have protection domains of their own "
                    "(no type-2 memory windows, a GPU, or "
                    "RDMARPC_RDMA_SHARED_DOMAINS=0)";
  }
  const uint64_t segments_before = rdmarpc::rdma::ArenaRegions::MadeInProcess();
  for (int i = 1; i < kChannels; ++i) {
    const auto before = registrations(i);
    ASSERT_TRUE(EchoOnce(stubs[i].get(), 70000, static_cast<uint32_t>(i)));
    EXPECT_EQ(registrations(i), before) << "channel " << i;
  }
  EXPECT_EQ(rdmarpc::rdma::ArenaRegions::MadeInProcess(), segments_before);
  EXPECT_EQ(server->rdma_stats().connections_in_shared_domains,
            static_cast<uint64_t>(kChannels));
}

// Landings of 1 MiB and more come from the landing arena too. Here the
// arena's room so far is held, so the calls' landings are placed in a
// segment it grew by, which each connection registers aside on first use;
// from then on such calls are granted through windows by the polling
// thread on both sides, with no registration of their own (the
// registration thread's fault points stay untaken), byte-exact.
TEST(RdmaTransport, LargeTensorsLandInAGrownArenaSegmentThroughWindows) {
  namespace fault = rdmarpc::internal::fault;
  rdmarpc::rdma::LandingArena* arena = rdmarpc::rdma::LandingArena::Get();
  ASSERT_NE(arena, nullptr);
  constexpr size_t kMiB = size_t{1} << 20;
  const int segments_before = arena->segments();
  std::vector<rdmarpc::TensorBuffer> held;
  while (arena->segments() == segments_before) {
    auto block = arena->Allocate(kMiB);
    ASSERT_TRUE(block.has_value()) << "the arena cannot grow";
    held.push_back(*std::move(block));
  }
  held.pop_back();  // the grown segment stays free for the calls
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  auto windows = [&] {
    return std::make_pair(channel->transport_stats().rdma_landing_windows,
                          server->rdma_stats().landing_windows);
  };
  auto registrations = [&] {
    return std::make_pair(channel->transport_stats().rdma_landing_registrations,
                          server->rdma_stats().landing_registrations);
  };
  // Each side registers the new segment aside after its first landing
  // there: those calls register their landing themselves (aside too).
  uint32_t seed = 1;
  bool in_arena = false;
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::minutes(2);
  while (!in_arena && std::chrono::steady_clock::now() < give_up) {
    const auto before = registrations();
    ASSERT_TRUE(EchoOnce(stub.get(), kMiB + 4099, seed++));
    in_arena = registrations() == before;
    if (!in_arena) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(in_arena);
  // Armed once: a landing sent aside to be registered would take them.
  fault::Arm("rdma.client.hold_registration", 1);
  fault::Arm("rdma.server.hold_registration", 1);
  const auto before = windows();
  for (int i = 0; i < 8; ++i) {
    ASSERT_TRUE(EchoOnce(stub.get(), kMiB + 977 * size_t(i), seed++));
  }
  EXPECT_EQ(windows().first - before.first, 8u);
  EXPECT_EQ(windows().second - before.second, 8u);
  EXPECT_TRUE(fault::Take("rdma.client.hold_registration").has_value());
  EXPECT_TRUE(fault::Take("rdma.server.hold_registration").has_value());
  EXPECT_FALSE(fault::Take("rdma.client.registration_held").has_value());
  EXPECT_FALSE(fault::Take("rdma.server.registration_held").has_value());
  EXPECT_GT(arena->segments(), segments_before);
}

bool AllDevicesAreSoftware();

// Connections made while it lives have `windows` landing windows each.
class LandingWindowsForTesting {
 public:
  explicit LandingWindowsForTesting(uint32_t windows) {
    rdmarpc::rdma::Connection::SetLandingWindowsForTesting(windows);
  }
  ~LandingWindowsForTesting() {
    rdmarpc::rdma::Connection::SetLandingWindowsForTesting(0);
  }
};

// An echo started with a callback: with `request_bytes` bytes of
// Pattern(request_bytes, seed) echoed, or with none and answered with
// `response_bytes` of Pattern(response_bytes, 7), into `landing` when
// given.
struct EchoInFlight {
  EchoInFlight(E2E::Stub* stub, size_t request_bytes, size_t response_bytes,
               uint8_t* landing = nullptr, uint32_t seed = 5)
      : size(request_bytes > 0 ? request_bytes : response_bytes),
        bytes(Pattern(size, request_bytes > 0 ? seed : 7)) {
    if (request_bytes > 0) {
      EXPECT_TRUE(BindBytes(&ctx, &req, bytes.data(), size).ok());
    } else {
      req.set_fail_code(2);
      req.set_note(std::to_string(size));
    }
    if (landing != nullptr) {
      ctx.SetResponseTensorBuffer(0, TensorBuffer::Borrow(landing, size));
    }
    stub->Echo(&ctx, req, &resp,
               [this](rdmarpc::Status s) { done.set_value(std::move(s)); });
  }
  // The callback uses this object: a test that fails early still waits
  // (and gives up on the binary after two minutes).
  ~EchoInFlight() {
    if (answer.valid() &&
        answer.wait_for(std::chrono::minutes(2)) != std::future_status::ready) {
      std::cerr << "an echo never answered\n";
      std::abort();
    }
  }
  // Waits for the answer: true when it came back byte-exact over RDMA
  // (into `landing`, when given).
  bool Answered(uint8_t* landing = nullptr) {
    if (answer.wait_for(std::chrono::seconds(120)) !=
        std::future_status::ready) {
      ADD_FAILURE() << "no answer";
      return false;
    }
    rdmarpc::Status s = answer.get();
    EXPECT_TRUE(s.ok()) << s;
    auto out = ctx.tensors().Get(resp.tensor());
    return s.ok() && out.ok() && out->size() == size &&
           ctx.stats().transport == rdmarpc::TransportKind::kRdma &&
           (landing == nullptr || out->data() == landing) &&
           std::memcmp(out->data(), bytes.data(), size) == 0;
  }

  const size_t size;
  const std::vector<uint8_t> bytes;
  ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  std::promise<rdmarpc::Status> done;
  std::future<rdmarpc::Status> answer = done.get_future();
};

// A channel whose progress watch never takes these tests' held calls for
// a stuck path (a held registration is no backlog the server names).
std::shared_ptr<rdmarpc::Channel> PatientRdmaChannel(int port) {
  rdmarpc::ChannelOptions options;
  options.rdma_peer_timeout = std::chrono::seconds(120);
  return RdmaChannel(port, options);
}

// Waits up to a minute for `count()` to reach `want`.
bool WaitForCount(const std::function<uint64_t()>& count, uint64_t want) {
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (count() < want && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return count() == want;
}

// Calls until one lands in the arena through its window alone (no
// registration of its own, as `registrations` counts): a connection
// registers the arena's segment aside after its first landing there.
void CallUntilTheArenaIsRegistered(
    const std::function<void()>& call,
    const std::function<uint64_t()>& registrations) {
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::minutes(2);
  bool in_arena = false;
  while (!in_arena && std::chrono::steady_clock::now() < give_up) {
    const uint64_t before = registrations();
    call();
    in_arena = registrations() == before;
    if (!in_arena) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(in_arena);
}

// A response's grant that finds every window of its connection held waits
// for one to end rather than registering its landing for remote write.
// The connection has one window here: a large response into the caller's
// buffer holds it while its registration is held aside (fault point); a
// small response into the landing arena waits, then lands through it with
// no registration of its own.
TEST(RdmaTransport, AResponseWaitsForAWindowWhileTheOnlyOneIsHeld) {
  LandingWindowsForTesting one_window(1);
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = PatientRdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  constexpr size_t kSmall = 64 << 10;
  constexpr size_t kLarge = 2 << 20;
  auto registrations = [&] {
    return channel->transport_stats().rdma_landing_registrations;
  };
  ASSERT_NO_FATAL_FAILURE(CallUntilTheArenaIsRegistered(
      [&] { EXPECT_TRUE(EchoInFlight(stub.get(), 0, kSmall).Answered()); },
      registrations));
  rdmarpc::internal::fault::Arm("rdma.client.hold_registration");
  std::vector<uint8_t> landing(kLarge);
  EchoInFlight large(stub.get(), 0, kLarge, landing.data());
  // Before `large` waits for its answer, if an assertion returns early.
  absl::Cleanup disarm = [] {
    rdmarpc::internal::fault::Disarm("rdma.client.hold_registration");
  };
  ASSERT_TRUE(WaitUntilArmed("rdma.client.registration_held"));
  EchoInFlight small(stub.get(), 0, kSmall);
  EXPECT_TRUE(WaitForCount(
      [&] { return channel->transport_stats().rdma_landing_window_waits; }, 1));
  const uint64_t before = registrations();
  std::move(disarm).Invoke();
  EXPECT_TRUE(large.Answered(landing.data()));
  EXPECT_TRUE(small.Answered());
  // The caller's buffer's registration; the small response took none.
  EXPECT_EQ(registrations() - before, 1u);
  EXPECT_EQ(channel->transport_stats().rdma_landing_window_waits, 1u);
}

// The same on the server: a large request whose bytes wait for the
// process's poster thread (held, fault point; software devices only)
// holds the server connection's one window, and a small request's grant
// waits for it.
TEST(RdmaTransport, ARequestWaitsForAWindowWhileTheOnlyOneIsHeld) {
  if (!AllDevicesAreSoftware()) {
    GTEST_SKIP() << "only software devices post large writes aside";
  }
  LandingWindowsForTesting one_window(1);
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto stub = E2E::NewStub(PatientRdmaChannel(port));
  // Over the inline threshold, under the 64 KiB from which writes are
  // posted aside; the large one over it, under the 1 MiB from which
  // landings are registered aside.
  constexpr size_t kSmall = 30000;
  constexpr size_t kLarge = 512 << 10;
  ASSERT_NO_FATAL_FAILURE(CallUntilTheArenaIsRegistered(
      [&] { EXPECT_TRUE(EchoOnce(stub.get(), kSmall, 1)); },
      [&] { return server->rdma_stats().landing_registrations; }));
  const uint64_t registrations = server->rdma_stats().landing_registrations;
  rdmarpc::internal::fault::Arm("rdma.post_aside.hold");
  EchoInFlight large(stub.get(), kLarge, 0, nullptr, 2);
  // Before `large` waits for its answer, if an assertion returns early.
  absl::Cleanup disarm = [] {
    rdmarpc::internal::fault::Disarm("rdma.post_aside.hold");
  };
  ASSERT_TRUE(WaitUntilArmed("rdma.post_aside.held"));
  EchoInFlight small(stub.get(), kSmall, 0, nullptr, 3);
  EXPECT_TRUE(WaitForCount(
      [&] { return server->rdma_stats().landing_window_waits; }, 1));
  std::move(disarm).Invoke();
  EXPECT_TRUE(large.Answered());
  EXPECT_TRUE(small.Answered());
  EXPECT_EQ(server->rdma_stats().landing_window_waits, 1u);
  // Both landed through the arena's window alone.
  EXPECT_EQ(server->rdma_stats().landing_registrations, registrations);
}

// A handler that blocks on the engine is counted, so it can be found.
TEST(RdmaTransport, InlineHandlerThatBlocksIsCountedAsAStall) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto stub = E2E::NewStub(RdmaChannel(port));
  EXPECT_EQ(server->handler_stats().inline_stalls, 0u);
  ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  req.set_sleep_ms(20);
  ASSERT_TRUE(stub->Slow(&ctx, req, &resp).ok());
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  EXPECT_EQ(server->handler_stats().inline_stalls, 1u);
}

TEST(RdmaTransport, ThirtyTwoConnectionsToOneServer) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  constexpr int kChannels = 32;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kChannels; ++t) {
    threads.emplace_back([&, t] {
      auto channel = RdmaChannel(port);
      auto stub = E2E::NewStub(channel);
      for (int i = 0; i < 5; ++i) {
        if (EchoOnce(stub.get(), i % 2 ? 50000 : 300, t * 10 + i)) ++ok;
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kChannels * 5);
  EXPECT_GE(server->rdma_stats().connections_accepted,
            static_cast<uint64_t>(kChannels));
}

std::string ThreadName() {
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

// By default (run_callbacks_inline) a callback runs on the completion
// engine: it may chain calls with CallAsync, a blocking call there is
// refused (it would wait for its own thread), and the channel may be
// dropped there.
TEST(RdmaTransport, CallbacksRunOnTheCompletionThreadByDefault) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 1));  // connected over RDMA

  struct Outcome {
    std::string first_thread, chained_thread;
    rdmarpc::Status first, blocking, chained;
  };
  Outcome out;
  std::promise<void> done;
  ClientContext ctx, blocking_ctx, chained_ctx;
  EchoRequest req;
  EchoResponse resp, blocking_resp, chained_resp;
  req.set_note("inline");
  stub->Echo(&ctx, req, &resp, [&](rdmarpc::Status s) {
    out.first_thread = ThreadName();
    out.first = s;
    out.blocking = stub->Echo(&blocking_ctx, req, &blocking_resp);
    stub->Echo(&chained_ctx, req, &chained_resp, [&](rdmarpc::Status c) {
      out.chained_thread = ThreadName();
      out.chained = c;
      done.set_value();
    });
  });
  done.get_future().wait();
  EXPECT_TRUE(out.first.ok()) << out.first;
  EXPECT_EQ(out.first_thread, "rdmarpc-engine");
  EXPECT_EQ(out.blocking.code(), rdmarpc::StatusCode::kFailedPrecondition)
      << out.blocking;
  EXPECT_TRUE(out.chained.ok()) << out.chained;
  EXPECT_EQ(out.chained_thread, "rdmarpc-engine");
  EXPECT_EQ(chained_ctx.stats().transport, rdmarpc::TransportKind::kRdma);

  // The last reference to the channel goes with the callback, on the
  // engine: its teardown must not wait there for the engine itself.
  std::promise<void> dropped;
  {
    ClientContext last_ctx;
    EchoResponse last_resp;
    stub.reset();
    rdmarpc::Channel* raw = channel.get();
    raw->CallAsync("/rdmarpc_test.E2E/Echo", &last_ctx, req, &last_resp,
                   [keep = std::move(channel), &dropped](rdmarpc::Status) {
                     dropped.set_value();
                   });
    dropped.get_future().wait();
  }
  // The engine still serves other connections.
  auto other = E2E::NewStub(RdmaChannel(port));
  EXPECT_TRUE(EchoOnce(other.get(), 64, 2));
}

// With more than one poller (RDMARPC_RDMA_POLLERS), a client and a server
// in one process are polled by two engines: the server's inline handler
// and the client's inline callback run on two engine threads, in parallel.
TEST(RdmaTransport, ConnectionsSpreadOverThePollers) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto stub = E2E::NewStub(RdmaChannel(port));
  ASSERT_TRUE(ConnectOnEnginesOfTheirOwn(stub.get()));

  ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  req.set_note("thread");
  std::promise<std::pair<std::thread::id, std::string>> callback;
  stub->Echo(&ctx, req, &resp, [&](rdmarpc::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    callback.set_value({std::this_thread::get_id(), ThreadName()});
  });
  auto [callback_thread, callback_name] = callback.get_future().get();
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  EXPECT_EQ(callback_name, "rdmarpc-engine");
  std::lock_guard<std::mutex> lock(service.mu);
  EXPECT_NE(service.handler_thread, std::thread::id());
  EXPECT_NE(service.handler_thread, callback_thread)
      << "the client's and the server's connection share an engine";
}

// A connection added while the engine is on its way to sleep (a pass that
// found nothing, its periodic look at epoll still ahead) is polled: that
// look must not swallow the wake-up that announced it. (It did: a fresh
// channel's first call then went unheard until something else woke the
// engine, in CI for the whole 60 s peer timeout.) The engine is held in
// such a pass (fault point) while a second channel connects.
TEST(RdmaTransport, AConnectionAddedAsTheEngineGoesToSleepIsPolled) {
  namespace fault = rdmarpc::internal::fault;
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto first = E2E::NewStub(RdmaChannel(port));
  ASSERT_TRUE(EchoOnce(first.get(), 64, 1));
  // A long spin keeps the engine passing over its idle connections after
  // the next call, so the hold catches it in such a pass with nothing
  // pending (pending work would send it round again, past the bug).
  rdmarpc::internal::SetSpinForTesting(std::chrono::seconds(30));
  ASSERT_TRUE(EchoOnce(first.get(), 64, 2));
  fault::Arm("rdma.engine.hold_idle_pass");
  const bool held = WaitUntilArmed("rdma.engine.idle_pass_held");
  // Released, the pass goes to sleep at once.
  rdmarpc::internal::SetSpinForTesting(std::chrono::microseconds(0));

  auto second_channel = RdmaChannel(port);
  auto second = E2E::NewStub(second_channel);
  ClientContext ctx;
  ctx.set_timeout(std::chrono::seconds(30));
  EchoRequest req;
  req.set_note("second");
  EchoResponse resp;
  std::future<rdmarpc::Status> done = second->EchoFuture(&ctx, req, &resp);
  for (int i = 0; i < 60000 && second_channel->transport_stats().health !=
                                   rdmarpc::RdmaHealth::kReady;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  const rdmarpc::RdmaHealth health = second_channel->transport_stats().health;
  fault::Disarm("rdma.engine.hold_idle_pass");
  ASSERT_TRUE(held) << "the engine never passed idly while the hold was armed";
  ASSERT_EQ(health, rdmarpc::RdmaHealth::kReady)
      << second_channel->transport_stats().ToString();
  rdmarpc::Status s = done.get();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.note(), "second");
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma)
      << ctx.stats().transport_reason;
}

// A caller blocked in Channel::Call takes its connection's (shared) queue from
// the engine while it spins and polls it itself: its response completes on its
// own thread. The spin is made long enough to catch every response on a
// slow (sanitized, emulated) machine; a caller preempted right after
// posting may still leave its response to the engine, hence "most".
TEST(RdmaTransport, BlockingCallersPollTheirOwnQueue) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 0));  // connected over RDMA
  uint64_t before = channel->transport_stats().rdma_caller_polls;
  rdmarpc::internal::SetSpinForTesting(std::chrono::seconds(5));
  for (int i = 0; i < 100; ++i) {
    ASSERT_TRUE(EchoOnce(stub.get(), i % 2 == 0 ? 64 : 256 << 10, i));
  }
  rdmarpc::internal::SetSpinForTesting(std::chrono::microseconds(0));
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_EQ(stats.calls_rdma, 101u);
  EXPECT_GE(stats.rdma_caller_polls - before, 50u) << stats.ToString();
}

// A thread that makes blocking calls one after another polls for each
// response itself, so the client's engine, asleep between the calls, never
// arms the client's queue: nothing wakes it. Calls that no caller polls
// for (a callback's, a future's) still complete: starting one wakes the
// engine, which arms the queue if the response does not come during its
// spin. The client's connection gets an engine of its own; the spin is
// long enough for any round trip here, and the pauses longer.
TEST(RdmaTransport, BlockingCallsLeaveTheClientsQueueUnarmed) {
  using std::chrono::milliseconds;
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  ASSERT_TRUE(ConnectOnEnginesOfTheirOwn(stub.get()));
  rdmarpc::internal::SetSpinForTesting(milliseconds(200));
  absl::Cleanup spin_again = [] {
    rdmarpc::internal::SetSpinForTesting(std::chrono::microseconds(0));
  };
  std::this_thread::sleep_for(milliseconds(300));
  const uint64_t arms = channel->transport_stats().rdma_queue_arms;
  for (int i = 0; i < 4; ++i) {
    ASSERT_TRUE(EchoOnce(stub.get(), 64, 2 + i));
    std::this_thread::sleep_for(milliseconds(300));
  }
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_EQ(stats.rdma_queue_arms - arms, 0u) << stats.ToString();

  // The engine sleeps with the queue unarmed: a callback call, then a
  // future, each after a pause.
  ClientContext ctx;
  EchoRequest req;
  req.set_note("callback");
  EchoResponse resp;
  std::promise<rdmarpc::Status> done;
  stub->Echo(&ctx, req, &resp, [&](rdmarpc::Status s) { done.set_value(s); });
  auto callback = done.get_future();
  ASSERT_EQ(callback.wait_for(std::chrono::seconds(30)),
            std::future_status::ready);
  rdmarpc::Status s = callback.get();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.note(), "callback");
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  std::this_thread::sleep_for(milliseconds(300));
  ClientContext future_ctx;
  req.set_note("future");
  EchoResponse future_resp;
  auto future = stub->EchoFuture(&future_ctx, req, &future_resp);
  ASSERT_EQ(future.wait_for(std::chrono::seconds(30)),
            std::future_status::ready);
  s = future.get();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(future_resp.note(), "future");
  EXPECT_EQ(future_ctx.stats().transport, rdmarpc::TransportKind::kRdma);
}

// A caller blocked on one channel polls the completion queue it shares
// with the engine's other client connections, and so finds another
// channel's responses too: a user's inline callback of that channel then
// runs on the callback thread, not on the blocked caller (which may hold
// a lock the callback takes). The caller's spin is made to outlast its
// slow call, so it holds the queue when the other channel's response
// comes.
TEST(RdmaTransport, ABlockedCallerHandsAnotherChannelsCallbackOn) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port, /*receives=*/64, /*workers=*/8,
                            /*inline_handlers=*/false);
  ASSERT_NE(server, nullptr);
  auto blocked = E2E::NewStub(RdmaChannel(port));
  auto other = E2E::NewStub(RdmaChannel(port));
  ASSERT_TRUE(EchoOnce(blocked.get(), 64, 1));
  ASSERT_TRUE(EchoOnce(other.get(), 64, 2));

  rdmarpc::internal::SetSpinForTesting(std::chrono::seconds(30));
  std::promise<std::thread::id> blocked_thread;
  std::atomic<bool> slow_done{false};
  std::thread slow([&] {
    blocked_thread.set_value(std::this_thread::get_id());
    ClientContext ctx;
    EchoRequest req;
    req.set_sleep_ms(2000);
    EchoResponse resp;
    rdmarpc::Status s = blocked->Slow(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s;
    slow_done = true;
  });
  const std::thread::id blocked_id = blocked_thread.get_future().get();
  std::this_thread::sleep_for(std::chrono::milliseconds(300));

  ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  req.set_note("other");
  std::promise<std::pair<std::thread::id, std::string>> callback;
  other->Echo(&ctx, req, &resp, [&](rdmarpc::Status s) {
    EXPECT_TRUE(s.ok()) << s;
    callback.set_value({std::this_thread::get_id(), ThreadName()});
  });
  auto [callback_thread, callback_name] = callback.get_future().get();
  const bool still_blocked = !slow_done.load();
  slow.join();
  rdmarpc::internal::SetSpinForTesting(std::chrono::microseconds(0));
  ASSERT_TRUE(still_blocked) << "the slow call ended before the other one";
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  EXPECT_NE(callback_thread, blocked_id);
  EXPECT_EQ(callback_name, "rdmarpc-done");
}

// With run_callbacks_inline false, callbacks run on the runtime's callback
// thread, where they may block.
TEST(RdmaTransport, CallbacksRunOnTheCallbackThreadWhenAsked) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  rdmarpc::ChannelOptions options;
  options.run_callbacks_inline = false;
  auto stub = E2E::NewStub(RdmaChannel(port, options));
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 1));
  std::promise<std::string> thread;
  std::promise<rdmarpc::Status> blocking;
  ClientContext ctx, blocking_ctx;
  EchoRequest req;
  EchoResponse resp, blocking_resp;
  stub->Echo(&ctx, req, &resp, [&](rdmarpc::Status) {
    thread.set_value(ThreadName());
    blocking.set_value(stub->Echo(&blocking_ctx, req, &blocking_resp));
  });
  EXPECT_EQ(thread.get_future().get(), "rdmarpc-done");
  rdmarpc::Status s = blocking.get_future().get();
  EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(blocking_ctx.stats().transport, rdmarpc::TransportKind::kRdma);
}

// Every RDMA response gives its round trip to the spin, whichever API made
// the call: a process that only chains callback calls would otherwise spin
// 50 us at most and sleep between calls on a slow wire.
TEST(RdmaTransport, EveryApiFeedsTheSpinWithItsRoundTrips) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto stub = E2E::NewStub(RdmaChannel(port));
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 1));  // connected over RDMA
  const uint64_t before = rdmarpc::internal::RoundTripsSeenForTesting();
  for (int i = 0; i < 3; ++i) {
    ClientContext ctx;
    EchoRequest req;
    EchoResponse resp;
    std::promise<rdmarpc::Status> done;
    stub->Echo(&ctx, req, &resp, [&](rdmarpc::Status s) { done.set_value(s); });
    rdmarpc::Status s = done.get_future().get();
    ASSERT_TRUE(s.ok()) << s;
    ASSERT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  }
  ClientContext future_ctx;
  EchoRequest req;
  EchoResponse resp;
  rdmarpc::Status s = stub->EchoFuture(&future_ctx, req, &resp).get();
  ASSERT_TRUE(s.ok()) << s;
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 2));
  EXPECT_EQ(rdmarpc::internal::RoundTripsSeenForTesting() - before, 5u);
}

// A call cancelled after the channel looked (it was not cancelled yet) and
// before its RDMA endpoint attached its canceller ends CANCELLED as the
// attach finds it, unsent: the server never runs it, and the connection
// goes on.
TEST(RdmaTransport, ACallCancelledAsItStartsIsNeverSent) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto stub = E2E::NewStub(RdmaChannel(port));
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 1));
  const int ran_before = service.echo_calls.load();
  namespace fault = rdmarpc::internal::fault;
  fault::Arm("rdma.client.hold_start");
  ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  std::promise<rdmarpc::Status> done;
  // Start runs on the thread that makes the call, which the point holds.
  std::thread caller([&] {
    stub->Echo(&ctx, req, &resp, [&](rdmarpc::Status s) { done.set_value(s); });
  });
  // No early return before the join.
  const bool held = WaitUntilArmed("rdma.client.start_held");
  if (held) ctx.TryCancel();
  fault::Disarm("rdma.client.hold_start");
  rdmarpc::Status s = done.get_future().get();
  caller.join();
  ASSERT_TRUE(held);
  EXPECT_EQ(s.code(), rdmarpc::StatusCode::kCancelled) << s;
  EXPECT_NE(s.message().find("cancelled before start"), std::string::npos) << s;
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 2));
  EXPECT_EQ(service.echo_calls.load() - ran_before, 1);
}

// A server learns its clients' pace from the gaps its connections spend
// idle: each request that finds its connection with no call in flight is
// one sample, so a process that only serves spins across them too.
TEST(RdmaTransport, EachRequestToAnIdleConnectionFeedsTheSpin) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto stub = E2E::NewStub(RdmaChannel(port));
  // The connection's first request follows no idle gap.
  const uint64_t first = rdmarpc::internal::IdleGapsSeenForTesting();
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 1));
  EXPECT_EQ(rdmarpc::internal::IdleGapsSeenForTesting() - first, 0u);
  // The server forgets an inline response's call in the same locked step
  // that sends the response, and the next request waits for that lock:
  // each finds the connection idle.
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(EchoOnce(stub.get(), 64, 2 + i));
  EXPECT_EQ(rdmarpc::internal::IdleGapsSeenForTesting() - first, 4u);
}

// An inline callback that holds the completion thread shows in the
// channel's stats.
TEST(RdmaTransport, ACallbackThatHoldsTheCompletionThreadIsCounted) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 1));
  std::promise<void> ran;
  ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  stub->Echo(&ctx, req, &resp, [&](rdmarpc::Status) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ran.set_value();
  });
  ran.get_future().wait();
  // Counted once the callback returns, just after it set the promise.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (channel->transport_stats().rdma_callback_stalls == 0 &&
         std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_GE(stats.rdma_callback_stalls, 1u) << stats.ToString();
  EXPECT_NE(stats.ToString().find("callback stalls: "), std::string::npos)
      << stats.ToString();
}

// An idle channel's watcher sleeps until the next call: no timer wakes it
// (32 idle channels must cost a server's host next to nothing).
TEST(RdmaTransport, AnIdleChannelsWatcherSleepsUntilTheNextCall) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 1));
  auto wakeups = [&] { return channel->transport_stats().rdma_watch_wakeups; };
  // The watcher rests a second after the last call; until then it wakes
  // every 50 ms, so two equal readings 1.5 s apart mean it rests.
  uint64_t before = wakeups();
  bool rested = false;
  for (int i = 0; i < 20 && !rested; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    uint64_t now = wakeups();
    rested = now == before;
    before = now;
  }
  ASSERT_TRUE(rested) << channel->transport_stats().ToString();
  std::this_thread::sleep_for(std::chrono::seconds(2));
  EXPECT_EQ(wakeups(), before) << "a resting watcher woke without a call";
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 2));
  // The call wrote the watcher's eventfd; it counts once it has run.
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (wakeups() == before && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_GT(wakeups(), before) << "the call did not wake the watcher";
}

// The server's call log drops a record once its window has passed, with
// no other call to make it look: its sweeper wakes for the record's expiry
// (the window, the re-send grace, and a second to go in batches) and
// sleeps otherwise.
TEST(RdmaTransport, TheCallLogDropsARecordAfterItsWindowWithoutNewCalls) {
  Service service;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .SetCallLogWindow(std::chrono::seconds(2))
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  ASSERT_TRUE(EchoOnce(stub.get(), 64, 1));
  // Admitted before its handler ran, kept at least the window and the
  // re-send grace (CallLog::kResendGrace) beyond it.
  EXPECT_EQ((*server)->call_log_stats().calls_logged, 1u);
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while ((*server)->call_log_stats().calls_logged != 0 &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ((*server)->call_log_stats().calls_logged, 0u)
      << "the record outlived its 2 s window by over 25 s";
}

// SetCallLogMaxRecords bounds the log: past it the oldest settled records
// go although their window (an hour here) has not passed.
TEST(RdmaTransport, TheCallLogHoldsAtMostItsMaxRecords) {
  Service service;
  int port = 0;
  constexpr uint64_t kMaxRecords = 1024;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .SetCallLogWindow(std::chrono::hours(1))
                    .SetCallLogMaxRecords(kMaxRecords)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  for (uint32_t i = 0; i < kMaxRecords + 100; ++i) {
    ASSERT_TRUE(EchoOnce(stub.get(), 64, i)) << i;
  }
  // Each call makes room for itself before it is logged. A record whose
  // response was not yet reported sent when its turn to go came stays
  // until the sweeper finds it settled.
  auto logged = [&] { return (*server)->call_log_stats().calls_logged; };
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (logged() > kMaxRecords && std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(logged(), kMaxRecords);
}

TEST(RdmaTransport, CreditsRunOutUnderASlowHandlerAndCallsWait) {
  Service service;
  int port = 0;
  // Four receives and two workers: 64 calls must queue for credits.
  auto server = StartServer(&service, &port, /*receives=*/4, /*workers=*/2);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  constexpr int kCalls = 64;
  std::vector<std::future<rdmarpc::Status>> results;
  std::vector<std::unique_ptr<ClientContext>> contexts;
  std::vector<EchoRequest> requests(kCalls);
  std::vector<EchoResponse> responses(kCalls);
  for (int i = 0; i < kCalls; ++i) {
    contexts.push_back(std::make_unique<ClientContext>());
    requests[i].set_sleep_ms(20);
    requests[i].set_note(std::to_string(i));
  }
  for (int i = 0; i < kCalls; ++i) {
    results.push_back(
        stub->SlowFuture(contexts[i].get(), requests[i], &responses[i]));
  }
  for (int i = 0; i < kCalls; ++i) {
    rdmarpc::Status s = results[i].get();
    EXPECT_TRUE(s.ok()) << i << ": " << s;
    EXPECT_EQ(responses[i].note(), std::to_string(i));
    EXPECT_EQ(contexts[i]->stats().transport, rdmarpc::TransportKind::kRdma);
  }
  rdmarpc::ChannelTransportStats stats = channel->transport_stats();
  EXPECT_GT(stats.rdma_waits_for_credit, 0u);
  EXPECT_EQ(stats.rdma.rfind("ready: ", 0), 0u) << stats.rdma;
}

// Arms fault point `hold`, starts an echo of `size` bytes on `large` (with
// `response_only`, a request without a tensor answered with `size` bytes),
// and once the thread it holds has armed `held`, makes `small_calls` calls
// on `small` (of 200 and `small_bytes` bytes), which must finish while the
// large one does not; then lets it go and checks its answer.
void SmallCallsGoOnWhileALargeOneIsHeld(
    E2E::Stub* large, E2E::Stub* small, size_t size, size_t small_bytes,
    const char* hold, const char* held, bool response_only = false,
    int small_calls = 20,
    std::chrono::milliseconds hold_past = std::chrono::milliseconds(0)) {
  rdmarpc::internal::fault::Arm(hold);
  std::vector<uint8_t> bytes = Pattern(size, 7);
  ClientContext ctx;
  EchoRequest req;
  if (response_only) {
    req.set_fail_code(2);
    req.set_note(std::to_string(size));
  } else {
    ASSERT_TRUE(BindBytes(&ctx, &req, bytes.data(), size).ok());
  }
  EchoResponse resp;
  std::promise<rdmarpc::Status> large_done;
  large->Echo(&ctx, req, &resp,
              [&](rdmarpc::Status s) { large_done.set_value(std::move(s)); });
  EXPECT_TRUE(WaitUntilArmed(held)) << held << " never armed";
  for (int i = 0; i < small_calls; ++i) {
    EXPECT_TRUE(EchoOnce(small, i % 2 ? small_bytes : 200, 10 + i));
  }
  std::future<rdmarpc::Status> done = large_done.get_future();
  // Held past its channel's peer timeout, the large call must still not
  // count as stuck: it waits for our own process, not for the path.
  std::this_thread::sleep_for(hold_past);
  EXPECT_EQ(done.wait_for(std::chrono::seconds(0)), std::future_status::timeout)
      << "the large call finished while " << hold << " was armed";
  rdmarpc::internal::fault::Disarm(hold);
  ASSERT_EQ(done.wait_for(std::chrono::seconds(120)),
            std::future_status::ready);
  rdmarpc::Status s = done.get();
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  auto out = ctx.tensors().Get(resp.tensor());
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), size);
  EXPECT_EQ(std::memcmp(out->data(), bytes.data(), size), 0);
}

// Registering a large request's landing memory pins every page: it runs
// aside, so calls on other connections go on meanwhile. The registration is
// held (fault point) until they are done.
TEST(RdmaTransport, CallsOnOtherConnectionsGoOnWhileALargeRequestRegisters) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto large_stub = E2E::NewStub(RdmaChannel(port));
  auto small_stub = E2E::NewStub(RdmaChannel(port));
  ASSERT_TRUE(EchoOnce(small_stub.get(), 100, 1));
  SmallCallsGoOnWhileALargeOneIsHeld(
      large_stub.get(), small_stub.get(), size_t{4} << 20, 70000,
      "rdma.server.hold_registration", "rdma.server.registration_held");
}

// An inline handler runs on the engine: registering its large response
// there would hold every connection, so it is registered aside. The
// registration is held (fault point) while another connection's calls go
// on. The request is small: a large one lands aside, and its handler then
// runs on the registration thread, not the engine.
TEST(RdmaTransport, CallsOnOtherConnectionsGoOnWhileALargeResponseRegisters) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto large_stub = E2E::NewStub(RdmaChannel(port));
  auto small_stub = E2E::NewStub(RdmaChannel(port));
  ASSERT_TRUE(EchoOnce(small_stub.get(), 100, 1));
  SmallCallsGoOnWhileALargeOneIsHeld(large_stub.get(), small_stub.get(),
                                     size_t{4} << 20, 30000,
                                     "rdma.server.hold_response_registration",
                                     "rdma.server.response_registration_held",
                                     /*response_only=*/true);
}

// Whether every RDMA device here is a software one (rxe, siw): only there
// are large writes posted aside.
bool AllDevicesAreSoftware() {
  int count = 0;
  ibv_device** list = ibv_get_device_list(&count);
  bool all = list != nullptr && count > 0;
  for (int i = 0; all && i < count; ++i) {
    ibv_context* ctx = ibv_open_device(list[i]);
    all = ctx != nullptr && rdmarpc::rdma::IsSoftwareDevice(ctx);
    if (ctx != nullptr) ibv_close_device(ctx);
  }
  if (list != nullptr) ibv_free_device_list(list);
  return all;
}

// Writes posted aside (ConnectionConfig::post_aside_bytes): only software
// devices post them so.
class PostAside : public ::testing::Test {
 protected:
  // Channels that would call a call stuck after 2 s without progress; the
  // tests hold the poster for 5. (At 1 s a busy CI host's VM once stalled
  // long enough for a call to look stuck before its grant came.)
  static constexpr std::chrono::milliseconds kPeerTimeout{2000};
  static constexpr std::chrono::milliseconds kHoldPast{5000};

  static std::shared_ptr<rdmarpc::Channel> Channel(int port) {
    rdmarpc::ChannelOptions options;
    options.rdma_peer_timeout = kPeerTimeout;
    return RdmaChannel(port, options);
  }

  void SetUp() override {
    if (!AllDevicesAreSoftware()) {
      GTEST_SKIP() << "a NIC's post only rings a doorbell: nothing is posted "
                      "aside";
    }
    server_ = StartServer(&service_, &port_);
    ASSERT_NE(server_, nullptr);
  }

  Service service_;
  int port_ = 0;
  std::unique_ptr<rdmarpc::Server> server_;
};

// A software device's post moves a write's bytes before it returns: large
// writes are posted by the poster thread, so calls on other connections go
// on meanwhile. The poster is held (fault point) until they are done.
TEST_F(PostAside, CallsOnOtherConnectionsGoOnWhileALargeWriteIsPosted) {
  auto large_channel = Channel(port_);
  auto large_stub = E2E::NewStub(large_channel);
  auto small_stub = E2E::NewStub(Channel(port_));
  ASSERT_TRUE(EchoOnce(large_stub.get(), 100, 1));
  ASSERT_TRUE(EchoOnce(small_stub.get(), 100, 1));
  // 512 KiB: under the 1 MiB at which landing memory is registered aside,
  // over the 64 KiB at which writes are posted aside; the small calls'
  // writes stay under it.
  SmallCallsGoOnWhileALargeOneIsHeld(
      large_stub.get(), small_stub.get(), size_t{512} << 10, 30000,
      "rdma.post_aside.hold", "rdma.post_aside.held", /*response_only=*/false,
      /*small_calls=*/20, kHoldPast);
  EXPECT_EQ(large_channel->transport_stats().rdma_writes_posted_aside, 1u);
}

// Frames posted after a write that waits for the poster complete before
// it: more of them than the send queue is deep must not reuse the write's
// bookkeeping slot (they did, and the connection closed with an internal
// error).
TEST_F(PostAside, ManyCallsOnTheSameConnectionGoOnWhileItsLargeWriteWaits) {
  auto channel = Channel(port_);
  auto stub = E2E::NewStub(channel);
  ASSERT_TRUE(EchoOnce(stub.get(), 100, 1));
  // 300 calls send 300 requests: more than the 256 send queue slots.
  SmallCallsGoOnWhileALargeOneIsHeld(
      stub.get(), stub.get(), size_t{512} << 10, 300, "rdma.post_aside.hold",
      "rdma.post_aside.held", /*response_only=*/false, /*small_calls=*/300,
      kHoldPast);
  EXPECT_EQ(channel->transport_stats().rdma_writes_posted_aside, 1u);
}

// The same for a response: the server's pong names a call whose response
// write waits for the poster, so the client does not count it as stuck.
TEST_F(PostAside, AResponseWaitingForThePosterIsNotAStall) {
  auto large_stub = E2E::NewStub(Channel(port_));
  auto small_stub = E2E::NewStub(Channel(port_));
  ASSERT_TRUE(EchoOnce(large_stub.get(), 100, 1));
  ASSERT_TRUE(EchoOnce(small_stub.get(), 100, 1));
  SmallCallsGoOnWhileALargeOneIsHeld(
      large_stub.get(), small_stub.get(), size_t{512} << 10, 100,
      "rdma.post_aside.hold", "rdma.post_aside.held", /*response_only=*/true,
      /*small_calls=*/20, kHoldPast);
}

TEST(RdmaTransport, OneGibibyteTensor) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto stub = E2E::NewStub(RdmaChannel(port));
  const size_t size = size_t{1} << 30;
  std::unique_ptr<uint8_t[]> bytes(new uint8_t[size]);
  uint64_t expected = 0;
  for (size_t i = 0; i < size; i += 4096) {
    bytes[i] = static_cast<uint8_t>(i >> 12);
    expected += bytes[i] * (i + 1);
  }
  ClientContext ctx;
  EchoRequest req;
  req.set_fail_code(1);  // checksum
  ASSERT_TRUE(BindBytes(&ctx, &req, bytes.get(), size).ok());
  EchoResponse resp;
  rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.note(), std::to_string(expected));
  EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
  EXPECT_EQ(ctx.stats().tensor_bytes_sent, size);
  EXPECT_EQ(ctx.stats().cpu_copied_bytes, 0u);
}

TEST(RdmaTransport, WritesSplitAtTheMaximumMessageSize) {
  // Connections made from here on split writes at 1 MiB.
  setenv("RDMARPC_RDMA_MAX_WRITE_BYTES", "1048576", 1);
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto channel = RdmaChannel(port);
  auto stub = E2E::NewStub(channel);
  EXPECT_TRUE(EchoOnce(stub.get(), (64 << 20) + 3, 5));
  unsetenv("RDMARPC_RDMA_MAX_WRITE_BYTES");
  // 64 MiB + 3 bytes in 1 MiB pieces: 65 writes (the response's pieces
  // are the server's).
  EXPECT_EQ(channel->transport_stats().rdma_writes_posted, 65u);
}

TEST(RdmaTransport, RegisteredMemoryIsSentAndReceivedWithoutCpuCopies) {
  Service service;
  int port = 0;
  auto server = StartServer(&service, &port);
  ASSERT_NE(server, nullptr);
  auto stub = E2E::NewStub(RdmaChannel(port));
  std::vector<uint8_t> bytes = Pattern(1 << 20, 9);
  std::vector<uint8_t> landing(1 << 20);
  ASSERT_TRUE(rdmarpc::RegisterMemoryForRdma(bytes.data(), bytes.size()).ok());
  for (int round = 0; round < 2; ++round) {  // the second hits the cache
    ClientContext ctx;
    ctx.SetResponseTensorBuffer(
        0, TensorBuffer::Borrow(landing.data(), landing.size()));
    EchoRequest req;
    ASSERT_TRUE(BindBytes(&ctx, &req, bytes.data(), bytes.size()).ok());
    EchoResponse resp;
    ASSERT_TRUE(stub->Echo(&ctx, req, &resp).ok());
    auto out = ctx.tensors().Get(resp.tensor());
    ASSERT_TRUE(out.ok());
    EXPECT_EQ(out->data(), landing.data());  // landed in the given buffer
    EXPECT_EQ(0, std::memcmp(landing.data(), bytes.data(), bytes.size()));
    EXPECT_EQ(ctx.stats().transport, rdmarpc::TransportKind::kRdma);
    EXPECT_EQ(ctx.stats().tensor_bytes_sent, bytes.size());
    EXPECT_EQ(ctx.stats().tensor_bytes_received, bytes.size());
    EXPECT_EQ(ctx.stats().cpu_copied_bytes, 0u);
    std::memset(landing.data(), 0, landing.size());
  }
  EXPECT_TRUE(rdmarpc::UnregisterMemoryForRdma(bytes.data()).ok());
  EXPECT_EQ(rdmarpc::UnregisterMemoryForRdma(bytes.data()).code(),
            absl::StatusCode::kNotFound);
}

// A handler for a hand-driven connection: keeps every frame it receives.
class RecordingHandler final : public rdmarpc::rdma::Connection::Handler {
 public:
  RecordingHandler() = default;
  // `on_frame` also sees each frame, on the thread that polls.
  explicit RecordingHandler(
      std::function<void(const rdmarpc::rdma::FrameView&)> on_frame)
      : on_frame_(std::move(on_frame)) {}

  rdmarpc::Status OnFrame(const rdmarpc::rdma::FrameView& frame) override {
    if (on_frame_) on_frame_(frame);
    std::lock_guard<std::mutex> lock(mu_);
    frames_.push_back({frame.type, std::string(frame.head)});
    cv_.notify_all();
    return absl::OkStatus();
  }
  rdmarpc::Status OnWriteLanded(uint32_t) override { return absl::OkStatus(); }
  void OnClosed(const rdmarpc::Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = why;
    cv_.notify_all();
  }
  // The connection whose frames this records. A client connection's group
  // is watched only while something awaits there, so the waits below
  // await as a blocking caller does: counted, with the engine woken.
  void Watch(std::weak_ptr<rdmarpc::rdma::Connection> conn) {
    conn_ = std::move(conn);
  }
  // The next frame's head, or "" after 10 s. It waits a while before it
  // counts as awaiting, so a reply the engine catches while it spins arms
  // nothing.
  std::pair<rdmarpc::rdma::FrameType, std::string> Next() {
    std::unique_lock<std::mutex> lock(mu_);
    const auto arrived = [&] { return !frames_.empty(); };
    if (!cv_.wait_for(lock, std::chrono::milliseconds(200), arrived)) {
      Awaiting awaiting(conn_.lock());
      cv_.wait_for(lock, std::chrono::seconds(10), arrived);
    }
    if (frames_.empty()) return {rdmarpc::rdma::FrameType::kCredit, ""};
    auto f = frames_.front();
    frames_.pop_front();
    return f;
  }
  bool WaitClosed() {
    Awaiting awaiting(conn_.lock());
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, std::chrono::seconds(10),
                        [&] { return !closed_.ok(); });
  }

 private:
  class Awaiting {
   public:
    explicit Awaiting(std::shared_ptr<rdmarpc::rdma::Connection> conn)
        : conn_(std::move(conn)) {
      if (conn_ == nullptr) return;
      conn_->group()->AddAwaited();
      conn_->group()->WakeEngineIfUnwatched();
    }
    ~Awaiting() {
      if (conn_ != nullptr) conn_->group()->RemoveAwaited();
    }
    Awaiting(const Awaiting&) = delete;
    Awaiting& operator=(const Awaiting&) = delete;

   private:
    std::shared_ptr<rdmarpc::rdma::Connection> conn_;
  };

  std::weak_ptr<rdmarpc::rdma::Connection> conn_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<rdmarpc::rdma::FrameType, std::string>> frames_;
  rdmarpc::Status closed_;
  std::function<void(const rdmarpc::rdma::FrameView&)> on_frame_;
};

// A hand-built Echo request whose message declares one u8 tensor of 4096
// bytes; the caller adds the tensor's part. `message` receives part 0.
rdmarpc::rdma::RequestHead EchoHead(uint64_t call_id, std::string* message,
                                    int fail_code = 0) {
  EchoRequest msg;
  msg.mutable_tensor()->set_dtype(rdmarpc::DTYPE_U8);
  msg.mutable_tensor()->add_shape(4096);
  msg.set_fail_code(fail_code);
  *message = msg.SerializeAsString();
  rdmarpc::rdma::RequestHead head;
  head.call_id = call_id;
  head.method = "/rdmarpc_test.E2E/Echo";
  head.parts.emplace_back().size = message->size();
  return head;
}

class ForgedPeerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    server_ = StartServer(&service_, &port_);
    ASSERT_NE(server_, nullptr);
    grpc_ = std::make_unique<rdmarpc::grpc_transport::GrpcClientTransport>(
        "127.0.0.1:" + std::to_string(port_), rdmarpc::ChannelOptions());
  }

  rdmarpc::rdma::HelloResponse Hello() {
    rdmarpc::rdma::HelloRequest req;
    req.set_version(rdmarpc::rdma::kWireVersion);
    auto bytes =
        grpc_->UnaryBytes(rdmarpc::rdma::kHelloMethod, req.SerializeAsString(),
                          std::chrono::seconds(5));
    EXPECT_TRUE(bytes.ok()) << bytes.status();
    rdmarpc::rdma::HelloResponse resp;
    EXPECT_TRUE(bytes.ok() && resp.ParseFromString(*bytes));
    return resp;
  }

  rdmarpc::StatusOr<std::shared_ptr<rdmarpc::rdma::Connection>> Connect(
      const rdmarpc::rdma::HelloResponse& hello, const std::string& token,
      std::shared_ptr<RecordingHandler> handler) {
    rdmarpc::rdma::ConnectionConfig config;
    config.peer_receives = hello.receives();
    config.peer_first_receives = hello.first_receives();
    // As the client transport starts its peer.
    config.first_receives = rdmarpc::rdma::FirstReceives(config.receives);
    config.peer_receive_bytes = hello.receive_bytes();
    auto conn = rdmarpc::rdma::ConnectToServer(
        hello.cm_address(), static_cast<uint16_t>(hello.cm_port()), token,
        config, handler,
        std::chrono::steady_clock::now() + std::chrono::seconds(5));
    if (conn.ok()) handler->Watch(*conn);
    return conn;
  }

  // `count` more connections, each with a handler of its own; false (with
  // the failure reported) if one could not connect.
  bool ConnectMany(
      int count, std::vector<std::shared_ptr<RecordingHandler>>* handlers,
      std::vector<std::shared_ptr<rdmarpc::rdma::Connection>>* conns) {
    for (int i = 0; i < count; ++i) {
      rdmarpc::rdma::HelloResponse hello = Hello();
      handlers->push_back(std::make_shared<RecordingHandler>());
      auto conn = Connect(hello, hello.token(), handlers->back());
      if (!conn.ok()) {
        ADD_FAILURE() << conn.status();
        return false;
      }
      conns->push_back(*conn);
    }
    return true;
  }

  // Sends Echo request `id` whose 4096-byte tensor is to be written
  // (fail_code 1: answered with a checksum, nothing written back) and
  // returns the server's grant for it.
  static rdmarpc::StatusOr<rdmarpc::rdma::Grant> RequestWrittenEcho(
      rdmarpc::rdma::Connection& conn, RecordingHandler& handler, uint64_t id,
      int fail_code = 0) {
    std::string message;
    rdmarpc::rdma::RequestHead head = EchoHead(id, &message, fail_code);
    rdmarpc::rdma::Part& part = head.parts.emplace_back();
    part.out_of_band = true;
    part.size = 4096;
    std::span<const uint8_t> inline_part(
        reinterpret_cast<const uint8_t*>(message.data()), message.size());
    RDMARPC_RETURN_IF_ERROR(conn.SendFrame(rdmarpc::rdma::FrameType::kRequest,
                                           &head, std::span(&inline_part, 1)));
    auto [type, grant_head] = handler.Next();
    rdmarpc::rdma::Grant grant;
    if (type != rdmarpc::rdma::FrameType::kGrant ||
        !grant.ParseFromString(grant_head) || grant.regions_size() != 1) {
      return absl::InternalError("no grant of one region came back");
    }
    return grant;
  }

  // Writes `length` bytes of `source` (registered as `mr`) at `offset` into
  // the grant's region. A forged write fails with a remote access error; once
  // in a CI run (soft-RoCE) it neither completed nor was retried and the
  // server saw nothing for 250 s: a raw connection has no progress watch
  // (a channel's would close it), so after 30 s this closes it, and the
  // write must fail all the same.
  static rdmarpc::Status WriteIntoGrant(
      rdmarpc::rdma::Connection& conn, const rdmarpc::rdma::MemoryRegion& mr,
      const void* source, const rdmarpc::rdma::Grant& grant, uint64_t offset,
      std::optional<uint32_t> immediate, uint32_t length = 4096) {
    auto written = std::make_shared<std::promise<rdmarpc::Status>>();
    RDMARPC_RETURN_IF_ERROR(
        conn.Write({.local = source,
                    .lkey = mr->lkey,
                    .remote_addr = grant.regions(0).addr() + offset,
                    .rkey = grant.regions(0).rkey(),
                    .length = length,
                    .immediate = immediate,
                    .on_piece = nullptr},
                   [written](rdmarpc::Status s) { written->set_value(s); }));
    auto result = written->get_future();
    if (result.wait_for(std::chrono::seconds(30)) !=
        std::future_status::ready) {
      std::cout << "note: the device did not complete the write in 30 s; "
                   "closing the connection\n";
      conn.Close(absl::CancelledError("the test gave up on the write"));
    }
    return result.get();
  }

  // A hand-driven connection, with 4096 bytes of 0x5a registered to write.
  struct WritingPeer {
    std::shared_ptr<RecordingHandler> handler =
        std::make_shared<RecordingHandler>();
    std::shared_ptr<rdmarpc::rdma::Connection> conn;
    std::vector<uint8_t> bytes = std::vector<uint8_t>(4096, 0x5a);
    rdmarpc::rdma::MemoryRegion mr;  // last: deregistered first
  };
  void ConnectWritingPeer(WritingPeer* peer) {
    rdmarpc::rdma::HelloResponse hello = Hello();
    auto conn = Connect(hello, hello.token(), peer->handler);
    ASSERT_TRUE(conn.ok()) << conn.status();
    peer->conn = *std::move(conn);
    auto mr = rdmarpc::rdma::RegisterMemory(
        peer->conn->pd(), peer->bytes.data(), peer->bytes.size(), 0);
    ASSERT_TRUE(mr.ok()) << mr.status();
    peer->mr = *std::move(mr);
  }

  // A normal client still gets served.
  void ExpectServerStillServes() {
    auto stub = E2E::NewStub(RdmaChannel(port_));
    EXPECT_TRUE(EchoOnce(stub.get(), 100000, 77));
  }

  Service service_;
  int port_ = 0;
  std::unique_ptr<rdmarpc::Server> server_;
  std::unique_ptr<rdmarpc::grpc_transport::GrpcClientTransport> grpc_;
};

TEST_F(ForgedPeerTest, ConnectWithoutAValidTokenIsRefusedAndCounted) {
  rdmarpc::rdma::HelloResponse hello = Hello();
  ASSERT_TRUE(hello.unavailable_reason().empty()) << hello.unavailable_reason();
  auto forged = Connect(hello, std::string(16, 'x'),
                        std::make_shared<RecordingHandler>());
  EXPECT_FALSE(forged.ok());
  EXPECT_NE(forged.status().message().find("REJECTED"), std::string::npos)
      << forged.status();
  // A real token works once; replaying it is refused.
  auto first =
      Connect(hello, hello.token(), std::make_shared<RecordingHandler>());
  EXPECT_TRUE(first.ok()) << first.status();
  auto replay =
      Connect(hello, hello.token(), std::make_shared<RecordingHandler>());
  EXPECT_FALSE(replay.ok());
  EXPECT_EQ(server_->rdma_stats().connects_refused, 2u);
  if (first.ok()) (*first)->Close(absl::CancelledError("test done"));
  ExpectServerStillServes();
}

TEST_F(ForgedPeerTest, WriteOutsideTheGrantFailsOnlyThatConnection) {
  rdmarpc::rdma::HelloResponse hello = Hello();
  auto handler = std::make_shared<RecordingHandler>();
  auto conn = Connect(hello, hello.token(), handler);
  ASSERT_TRUE(conn.ok()) << conn.status();
  auto grant = RequestWrittenEcho(**conn, *handler, 1);
  ASSERT_TRUE(grant.ok()) << grant.status();
  // Write past the end of the granted region.
  std::vector<uint8_t> bytes(4096, 0xab);
  auto mr = rdmarpc::rdma::RegisterMemory((*conn)->pd(), bytes.data(),
                                          bytes.size(), 0);
  ASSERT_TRUE(mr.ok());
  EXPECT_FALSE(
      WriteIntoGrant(**conn, *mr, bytes.data(), *grant, 4096, grant->grant_id())
          .ok());
  EXPECT_TRUE(handler->WaitClosed());
  EXPECT_EQ(service_.echo_calls.load(), 0);
  ExpectServerStillServes();
}

// A grant through a memory window ends with its call: writing through it
// again afterwards fails on the device, and only that connection closes.
TEST_F(ForgedPeerTest, AWindowGrantEndsWithItsCall) {
  WritingPeer peer;
  ASSERT_NO_FATAL_FAILURE(ConnectWritingPeer(&peer));
  // Calls whose tensor is written, answered with a checksum, until one was
  // granted through a window (from the first, over a registration of its
  // own while the arena's segment registers aside).
  rdmarpc::rdma::Grant grant;
  int calls = 0;
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::minutes(2);
  for (uint64_t id = 1; std::chrono::steady_clock::now() < give_up; ++id) {
    const uint64_t windows_before = server_->rdma_stats().landing_windows;
    auto granted =
        RequestWrittenEcho(*peer.conn, *peer.handler, id, /*fail_code=*/1);
    ASSERT_TRUE(granted.ok()) << granted.status();
    grant = *granted;
    ASSERT_TRUE(WriteIntoGrant(*peer.conn, peer.mr, peer.bytes.data(), grant, 0,
                               grant.grant_id())
                    .ok());
    ASSERT_EQ(peer.handler->Next().first, rdmarpc::rdma::FrameType::kResponse);
    ++calls;
    if (server_->rdma_stats().landing_windows > windows_before) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_GT(server_->rdma_stats().landing_windows, 0u);
  EXPECT_EQ(service_.echo_calls.load(), calls);
  // The call was answered, and its window invalidated before its handler
  // ran: the same region and key take no more bytes.
  EXPECT_FALSE(WriteIntoGrant(*peer.conn, peer.mr, peer.bytes.data(), grant, 0,
                              std::nullopt)
                   .ok());
  EXPECT_TRUE(peer.handler->WaitClosed());
  EXPECT_EQ(service_.echo_calls.load(), calls);
  ExpectServerStillServes();
}

// Landing memory is used again, by calls from any peer: a peer that writes
// less than its grant and announces it done must find the rest zero, not
// what an earlier call left there. Every way of granting: a registration
// for remote write (as on a device without windows), a window over a
// registration of its own (the first calls with windows, while the arena's
// segment registers aside) and a window into the arena.
TEST_F(ForgedPeerTest, BytesAPeerDidNotWriteReadAsZero) {
  namespace fault = rdmarpc::internal::fault;
  // Remote-write registrations only in a domain of the connection's own.
  rdmarpc::rdma::SetSharedDomainsForTesting(false);
  absl::Cleanup shared_again = [] {
    rdmarpc::rdma::SetSharedDomainsForTesting(true);
  };
  WritingPeer peer;
  ASSERT_NO_FATAL_FAILURE(ConnectWritingPeer(&peer));
  // Whole writes and 64-byte ones take turns, each byte 0x5a; the handler
  // counts the non-zero bytes it sees. 2 pairs without windows, then pairs
  // until 8 landed in the arena with no registration of their own.
  std::vector<size_t> expected;
  int pairs_in_arena = 0;
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::minutes(2);
  fault::Arm("rdma.no_landing_windows");
  struct DisarmOnReturn {
    ~DisarmOnReturn() { fault::Disarm("rdma.no_landing_windows"); }
  } disarm_on_return;
  for (uint64_t id = 1; pairs_in_arena < 8; id += 2) {
    ASSERT_LT(std::chrono::steady_clock::now(), give_up);
    if (id == 5) fault::Disarm("rdma.no_landing_windows");
    const rdmarpc::RdmaServerStats before = server_->rdma_stats();
    for (uint32_t length : {4096u, 64u}) {
      auto grant =
          RequestWrittenEcho(*peer.conn, *peer.handler, id + (length == 64),
                             /*fail_code=*/3);
      ASSERT_TRUE(grant.ok()) << grant.status();
      ASSERT_TRUE(WriteIntoGrant(*peer.conn, peer.mr, peer.bytes.data(), *grant,
                                 0, grant->grant_id(), length)
                      .ok());
      ASSERT_EQ(peer.handler->Next().first,
                rdmarpc::rdma::FrameType::kResponse);
      expected.push_back(length);
    }
    const rdmarpc::RdmaServerStats after = server_->rdma_stats();
    if (id < 5) {
      EXPECT_EQ(after.landing_windows, before.landing_windows);
    } else if (pairs_in_arena > 0 ||
               after.landing_registrations == before.landing_registrations) {
      ++pairs_in_arena;
    }
  }
  std::lock_guard<std::mutex> lock(service_.mu);
  EXPECT_EQ(service_.nonzero_bytes, expected);
  peer.conn->Close(absl::CancelledError("test done"));
}

// The connections of a completion group share a protection domain, so a
// grant made on one (a window bound to its queue pair) must still be
// useless on another: peer B writes through peer A's grant and fails,
// closing only B's connection; A's own write then lands and is answered.
TEST_F(ForgedPeerTest, AGrantIsUselessOnAnotherConnectionOfItsDomain) {
  // One engine, so that both connections of each side join one group.
  rdmarpc::rdma::Engine::SetPollersForTesting(1);
  absl::Cleanup pollers_again = [] {
    rdmarpc::rdma::Engine::SetPollersForTesting(0);
  };
  WritingPeer a;
  WritingPeer b;
  ASSERT_NO_FATAL_FAILURE(ConnectWritingPeer(&a));
  ASSERT_NO_FATAL_FAILURE(ConnectWritingPeer(&b));
  if (!a.conn->shares_domain()) {
    GTEST_SKIP() << "connections here have a protection domain each (a "
                    "device without type-2 windows, a GPU, or "
                    "RDMARPC_RDMA_SHARED_DOMAINS=0)";
  }
  EXPECT_EQ(a.conn->pd(), b.conn->pd());
  EXPECT_EQ(server_->rdma_stats().connections_in_shared_domains, 2u);
  auto grant = RequestWrittenEcho(*a.conn, *a.handler, 1, /*fail_code=*/1);
  ASSERT_TRUE(grant.ok()) << grant.status();
  EXPECT_FALSE(WriteIntoGrant(*b.conn, b.mr, b.bytes.data(), *grant, 0,
                              grant->grant_id())
                   .ok());
  EXPECT_TRUE(b.handler->WaitClosed());
  ASSERT_TRUE(WriteIntoGrant(*a.conn, a.mr, a.bytes.data(), *grant, 0,
                             grant->grant_id())
                  .ok());
  EXPECT_EQ(a.handler->Next().first, rdmarpc::rdma::FrameType::kResponse);
  EXPECT_EQ(service_.echo_calls.load(), 1);
  a.conn->Close(absl::CancelledError("test done"));
}

// A peer starts with the other side's first receives and is granted more
// when it runs low: pings sent at once, more than the first receives, all
// get their pongs, and the client's allotment of the server's receives
// grew (backed by the server's shared receive queue where it has one).
TEST_F(ForgedPeerTest, APeerThatRunsLowOnCreditsIsGrantedMore) {
  using rdmarpc::rdma::FrameType;
  using rdmarpc::rdma::kFirstReceives;
  rdmarpc::rdma::HelloResponse hello = Hello();
  ASSERT_EQ(hello.first_receives(), kFirstReceives);
  auto handler = std::make_shared<RecordingHandler>();
  auto conn = Connect(hello, hello.token(), handler);
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_EQ((*conn)->allotments().ours, kFirstReceives);
  constexpr uint64_t kPings = 3 * kFirstReceives;
  rdmarpc::rdma::Ping ping;
  for (uint64_t i = 1; i <= kPings; ++i) {
    ping.set_sequence(i);
    ASSERT_TRUE((*conn)->SendFrame(FrameType::kPing, &ping).ok());
  }
  for (uint64_t i = 1; i <= kPings; ++i) {
    ASSERT_EQ(handler->Next().first, FrameType::kPong) << "pong " << i;
  }
  EXPECT_GT((*conn)->counters().waits_for_credit, 0u);
  const uint32_t granted = (*conn)->allotments().ours;
  EXPECT_GT(granted, kFirstReceives);
  EXPECT_LE(granted, hello.receives());
  const rdmarpc::RdmaServerStats stats = server_->rdma_stats();
  EXPECT_EQ(stats.connections_with_shared_receives,
            stats.connections_in_shared_domains);
  EXPECT_EQ(stats.protocol_errors, 0u);
  (*conn)->Close(absl::CancelledError("test done"));
  EXPECT_TRUE(handler->WaitClosed());
}

// The connections of a completion group back their peers' first receives
// from one pool: 8 connections take 8 x 16 receive buffers (plus at most
// a chunk of spare), not 8 x 64, and each still gets its answers.
TEST_F(ForgedPeerTest, ConnectionsOfAGroupShareOnePoolOfReceives) {
  using rdmarpc::rdma::CompletionGroup;
  using rdmarpc::rdma::kFirstReceives;
  rdmarpc::rdma::Engine::SetPollersForTesting(1);
  absl::Cleanup pollers_again = [] {
    rdmarpc::rdma::Engine::SetPollersForTesting(0);
  };
  constexpr uint32_t kConnections = 8;
  std::vector<std::shared_ptr<RecordingHandler>> handlers;
  std::vector<std::shared_ptr<rdmarpc::rdma::Connection>> conns;
  uint32_t receives = 0;
  for (uint32_t i = 0; i < kConnections; ++i) {
    rdmarpc::rdma::HelloResponse hello = Hello();
    receives = hello.receives();
    handlers.push_back(std::make_shared<RecordingHandler>());
    auto conn = Connect(hello, hello.token(), handlers.back());
    ASSERT_TRUE(conn.ok()) << conn.status();
    conns.push_back(*conn);
  }
  if (!conns[0]->shares_receives()) {
    GTEST_SKIP() << "connections here have receives of their own (no "
                    "shared protection domain, or "
                    "RDMARPC_RDMA_SHARED_RECEIVES=0)";
  }
  const uint32_t buffers = conns[0]->shared_receive_buffers();
  EXPECT_GE(buffers, kConnections * kFirstReceives);
  EXPECT_LE(buffers, kConnections * kFirstReceives +
                         CompletionGroup::kSharedChunkReceives);
  EXPECT_LT(buffers, kConnections * receives);
  EXPECT_EQ(server_->rdma_stats().connections_with_shared_receives,
            kConnections);
  rdmarpc::rdma::Ping ping;
  for (uint32_t i = 0; i < kConnections; ++i) {
    EXPECT_TRUE(conns[i]->shares_receives());
    EXPECT_EQ(conns[i]->shared_receive_buffers(), buffers);
    ping.set_sequence(i + 1);
    ASSERT_TRUE(
        conns[i]->SendFrame(rdmarpc::rdma::FrameType::kPing, &ping).ok());
    EXPECT_EQ(handlers[i]->Next().first, rdmarpc::rdma::FrameType::kPong);
  }
  const uint64_t timed_out_before =
      rdmarpc::rdma::Connection::LastSharedReceiveWaitsTimedOut();
  for (auto& conn : conns) conn->Close(absl::CancelledError("test done"));
  for (auto& handler : handlers) EXPECT_TRUE(handler->WaitClosed());
  // A close on a hardware device waits for its queue pair's last shared
  // receive, which the device reports; one on a software device needs no
  // wait. Either way none runs out.
  EXPECT_EQ(rdmarpc::rdma::Connection::LastSharedReceiveWaitsTimedOut(),
            timed_out_before);
}

// When the pool has no spare receives (4 connections take a chunk's 64 as
// their first receives), a peer that asks for more is granted them once
// the pool grew aside: rounds of pings until its allotment grows.
TEST_F(ForgedPeerTest, APoolWithoutSpareGrowsForGrants) {
  using rdmarpc::rdma::FrameType;
  using rdmarpc::rdma::kFirstReceives;
  rdmarpc::rdma::Engine::SetPollersForTesting(1);
  absl::Cleanup pollers_again = [] {
    rdmarpc::rdma::Engine::SetPollersForTesting(0);
  };
  std::vector<std::shared_ptr<RecordingHandler>> handlers;
  std::vector<std::shared_ptr<rdmarpc::rdma::Connection>> conns;
  ASSERT_TRUE(ConnectMany(4, &handlers, &conns));
  if (server_->rdma_stats().connections_with_shared_receives != 4) {
    GTEST_SKIP() << "the server's connections have receives of their own";
  }
  rdmarpc::rdma::Ping ping;
  uint64_t sequence = 0;
  for (int round = 0;
       round < 50 && conns[0]->allotments().ours == kFirstReceives; ++round) {
    for (uint32_t i = 0; i < 3 * kFirstReceives; ++i) {
      ping.set_sequence(++sequence);
      ASSERT_TRUE(conns[0]->SendFrame(FrameType::kPing, &ping).ok());
    }
    for (uint32_t i = 0; i < 3 * kFirstReceives; ++i) {
      ASSERT_EQ(handlers[0]->Next().first, FrameType::kPong);
    }
  }
  EXPECT_GT(conns[0]->allotments().ours, kFirstReceives);
  EXPECT_EQ(server_->rdma_stats().protocol_errors, 0u);
  // Another connection sends a ping: the buffers its group lends, or its
  // first chunk where it lends none, are enough.
  ping.set_sequence(++sequence);
  ASSERT_TRUE(conns[1]->SendFrame(FrameType::kPing, &ping).ok());
  ASSERT_EQ(handlers[1]->Next().first, FrameType::kPong);
  EXPECT_EQ(
      conns[1]->send_buffers_made(),
      conns[1]->send_pool() != nullptr ? 0u : rdmarpc::rdma::kSendChunkBuffers);
  for (auto& conn : conns) conn->Close(absl::CancelledError("test done"));
  for (auto& handler : handlers) EXPECT_TRUE(handler->WaitClosed());
}

// A connection starts with a chunk of send buffers (or borrows its
// group's) and registers more aside when frames find none free: rounds of
// pings, more than a chunk at once, until it has more than a chunk of its
// own (the frames wait meanwhile, and all are answered).
TEST_F(ForgedPeerTest, SendBuffersGrowWhenFramesFindNoneFree) {
  using rdmarpc::rdma::FrameType;
  using rdmarpc::rdma::kSendChunkBuffers;
  rdmarpc::rdma::HelloResponse hello = Hello();
  auto handler = std::make_shared<RecordingHandler>();
  auto conn = Connect(hello, hello.token(), handler);
  ASSERT_TRUE(conn.ok()) << conn.status();
  EXPECT_EQ((*conn)->send_buffers_made(),
            (*conn)->send_pool() != nullptr ? 0u : kSendChunkBuffers);
  rdmarpc::rdma::Ping ping;
  uint64_t sequence = 0;
  for (int round = 0;
       round < 50 && (*conn)->send_buffers_made() <= kSendChunkBuffers;
       ++round) {
    for (uint32_t i = 0; i < 3 * kSendChunkBuffers; ++i) {
      ping.set_sequence(++sequence);
      ASSERT_TRUE((*conn)->SendFrame(FrameType::kPing, &ping).ok());
    }
    for (uint32_t i = 0; i < 3 * kSendChunkBuffers; ++i) {
      ASSERT_EQ(handler->Next().first, FrameType::kPong);
    }
  }
  EXPECT_GT((*conn)->send_buffers_made(), kSendChunkBuffers);
  EXPECT_LE((*conn)->send_buffers_made(), hello.receives());
  (*conn)->Close(absl::CancelledError("test done"));
  EXPECT_TRUE(handler->WaitClosed());
}

// Connections of one group that send little borrow its send buffers and
// register none of their own: each borrowed frame is signaled, so every
// buffer is back in the pool once the frames completed. A connection that
// sent kBorrowedFramesBeforeOwn frames through the pool registers its own
// chunk and borrows no more.
TEST_F(ForgedPeerTest, QuietConnectionsBorrowTheirGroupsSendBuffers) {
  using rdmarpc::rdma::FrameType;
  using rdmarpc::rdma::kBorrowedFramesBeforeOwn;
  using rdmarpc::rdma::kSendChunkBuffers;
  rdmarpc::rdma::Engine::SetPollersForTesting(1);
  absl::Cleanup pollers_again = [] {
    rdmarpc::rdma::Engine::SetPollersForTesting(0);
  };
  constexpr int kConnections = 4;
  std::vector<std::shared_ptr<RecordingHandler>> handlers;
  std::vector<std::shared_ptr<rdmarpc::rdma::Connection>> conns;
  ASSERT_TRUE(ConnectMany(kConnections, &handlers, &conns));
  absl::Cleanup close_all = [&] {
    for (auto& conn : conns) conn->Close(absl::CancelledError("test done"));
    for (auto& handler : handlers) EXPECT_TRUE(handler->WaitClosed());
  };
  rdmarpc::rdma::SendPool* pool = conns[0]->send_pool();
  // Rounds of 8 pings, with credit frames and late completions beside
  // them, fit a pool of a chunk's size; a smaller one could run dry.
  if (pool == nullptr || pool->buffers() < kSendChunkBuffers) {
    GTEST_SKIP() << "no send pool of " << kSendChunkBuffers
                 << " buffers lent here (protection domains per connection, "
                    "RDMARPC_RDMA_SEND_POOL_BUFFERS, or larger frames)";
  }
  rdmarpc::rdma::Ping ping;
  uint64_t sequence = 0;
  // Pings in rounds of `count`, each round answered before the next.
  auto pings = [&](int i, uint64_t count) {
    for (uint64_t sent = 0; sent < count;) {
      const uint64_t round = std::min<uint64_t>(8, count - sent);
      for (uint64_t k = 0; k < round; ++k) {
        ping.set_sequence(++sequence);
        if (!conns[i]->SendFrame(FrameType::kPing, &ping).ok()) return false;
      }
      for (uint64_t k = 0; k < round; ++k) {
        if (handlers[i]->Next().first != FrameType::kPong) return false;
      }
      sent += round;
    }
    return true;
  };
  // Send completions may come after the pongs: wait for the count.
  auto all_back = [&] {
    const auto give_up =
        std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (pool->free_buffers() != pool->buffers() &&
           std::chrono::steady_clock::now() < give_up) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    return pool->free_buffers() == pool->buffers();
  };
  for (int i = 0; i < kConnections; ++i) {
    EXPECT_EQ(conns[i]->send_pool(), pool) << "connection " << i;
    ASSERT_TRUE(pings(i, 5)) << "connection " << i;
    EXPECT_EQ(conns[i]->send_buffers_made(), 0u) << "connection " << i;
    EXPECT_GE(conns[i]->borrowed_frames(), 5u) << "connection " << i;
  }
  EXPECT_TRUE(all_back()) << pool->free_buffers() << " of " << pool->buffers();
  // One gets busy: its own chunk is registered aside, then it borrows no
  // more.
  ASSERT_TRUE(pings(0, kBorrowedFramesBeforeOwn));
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (conns[0]->send_buffers_made() == 0 &&
         std::chrono::steady_clock::now() < give_up) {
    ASSERT_TRUE(pings(0, 1));
  }
  EXPECT_GE(conns[0]->send_buffers_made(), kSendChunkBuffers);
  const uint64_t borrowed = conns[0]->borrowed_frames();
  EXPECT_GE(borrowed, kBorrowedFramesBeforeOwn);
  ASSERT_TRUE(pings(0, 2 * kSendChunkBuffers));
  EXPECT_EQ(conns[0]->borrowed_frames(), borrowed);
  EXPECT_EQ(conns[1]->send_buffers_made(), 0u);
  EXPECT_TRUE(all_back()) << pool->free_buffers() << " of " << pool->buffers();
  // A connection that fails with borrowed frames in flight gives them back
  // too (their error completions, or its close once its queue pair is
  // gone); the others keep the group, and so the pool, alive.
  for (int k = 0; k < 8; ++k) {
    ping.set_sequence(++sequence);
    ASSERT_TRUE(conns[2]->SendFrame(FrameType::kPing, &ping).ok());
  }
  ASSERT_TRUE(conns[2]->InjectQueuePairError().ok());
  // A frame posted now completes in error if none did, which closes it.
  ping.set_sequence(++sequence);
  (void)conns[2]->SendFrame(FrameType::kPing, &ping);
  EXPECT_TRUE(handlers[2]->WaitClosed());
  EXPECT_TRUE(all_back()) << pool->free_buffers() << " of " << pool->buffers();
  EXPECT_EQ(conns[2]->send_buffers_made(), 0u);
}

TEST_F(ForgedPeerTest, UnsignaledFramesCompleteOnceFlushed) {
  // Frames in buffers borrowed from a group's pool are all signaled.
  rdmarpc::rdma::SetSendPoolsForTesting(false);
  // A queue of its own: an arm another test's connection left on a shared
  // one would raise an event for the flush's completion and hide a flush
  // that nothing watches.
  rdmarpc::rdma::CompletionGroup::SetMaxMembersForTesting(1);
  absl::Cleanup restore = [] {
    rdmarpc::rdma::SetSendPoolsForTesting(true);
    rdmarpc::rdma::CompletionGroup::SetMaxMembersForTesting(0);
    rdmarpc::internal::SetSpinForTesting(std::chrono::microseconds(0));
  };
  rdmarpc::rdma::HelloResponse hello = Hello();
  // Shared with the handler, which a connection left open by a failed
  // assertion outlives this test with.
  auto pongs = std::make_shared<std::atomic<int>>(0);
  auto handler = std::make_shared<RecordingHandler>(
      [pongs](const rdmarpc::rdma::FrameView& frame) {
        if (frame.type == rdmarpc::rdma::FrameType::kPong) ++*pongs;
      });
  auto conn = Connect(hello, hello.token(), handler);
  ASSERT_TRUE(conn.ok()) << conn.status();
  rdmarpc::rdma::Ping ping;
  for (uint64_t i = 1; i <= 3; ++i) {
    ping.set_sequence(i);
    ASSERT_TRUE(
        (*conn)->SendFrame(rdmarpc::rdma::FrameType::kPing, &ping).ok());
  }
  // This thread polls for the pongs as a blocking caller does, so the
  // engine arms nothing meanwhile, and nothing awaits once it gives the
  // queue back. The pongs' completions come after every arm before them
  // (the connection's set-up): none is left to raise an event later.
  const auto give_up =
      std::chrono::steady_clock::now() + std::chrono::seconds(10);
  bool took = false;
  while (!(took = (*conn)->TakeForCaller()) &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::yield();
  }
  ASSERT_TRUE(took);
  while (pongs->load() < 3 && std::chrono::steady_clock::now() < give_up) {
    (void)(*conn)->PollTaken();
  }
  (*conn)->GiveBack();
  ASSERT_EQ(pongs->load(), 3);
  // No `sent`: none of them asked for a completion of its own.
  EXPECT_EQ((*conn)->counters().frames_unsignaled, 3u);
  // The engine, woken by a spent arm's event if there was one, goes back
  // to sleep with the queue unarmed after a short spin.
  rdmarpc::internal::SetSpinForTesting(std::chrono::microseconds(50));
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  while (!(*conn)->group()->unarmed() &&
         std::chrono::steady_clock::now() < give_up) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  ASSERT_TRUE((*conn)->group()->unarmed());
  // Nothing signaled follows them, so they stay outstanding until Busy()
  // posts the zero-length write whose completion covers them; the engine
  // asleep must be woken to poll it.
  bool busy = true;
  for (int i = 0; i < 10000 && (busy = (*conn)->Busy()); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_FALSE(busy);
  EXPECT_EQ((*conn)->counters().flush_writes, 1u);
  (*conn)->Close(absl::CancelledError("test done"));
  EXPECT_TRUE(handler->WaitClosed());
  ExpectServerStillServes();
}

// A flush write that cannot be posted means a broken queue pair: the
// connection closes, which fails what its unsignaled frames still owe.
TEST_F(ForgedPeerTest, AFlushWriteThatCannotBePostedClosesTheConnection) {
  namespace fault = rdmarpc::internal::fault;
  // Frames in buffers borrowed from a group's pool are all signaled.
  rdmarpc::rdma::SetSendPoolsForTesting(false);
  absl::Cleanup lend_again = [] {
    rdmarpc::rdma::SetSendPoolsForTesting(true);
  };
  rdmarpc::rdma::HelloResponse hello = Hello();
  auto handler = std::make_shared<RecordingHandler>();
  auto conn = Connect(hello, hello.token(), handler);
  ASSERT_TRUE(conn.ok()) << conn.status();
  rdmarpc::rdma::Ping ping;
  ping.set_sequence(1);
  ASSERT_TRUE((*conn)->SendFrame(rdmarpc::rdma::FrameType::kPing, &ping).ok());
  EXPECT_EQ(handler->Next().first, rdmarpc::rdma::FrameType::kPong);
  EXPECT_EQ((*conn)->counters().frames_unsignaled, 1u);
  fault::Arm("rdma.flush_write_post_error", 1);
  (void)(*conn)->Busy();
  EXPECT_FALSE(fault::Take("rdma.flush_write_post_error").has_value());
  EXPECT_TRUE(handler->WaitClosed());
  EXPECT_EQ((*conn)->close_trigger(), "post error");
  EXPECT_EQ((*conn)->counters().flush_writes, 0u);
  ExpectServerStillServes();
}

TEST_F(ForgedPeerTest, SentOfAnUnsignaledFrameRunsWhenTheEngineGoesQuiet) {
  // Frames in buffers borrowed from a group's pool are all signaled.
  rdmarpc::rdma::SetSendPoolsForTesting(false);
  absl::Cleanup lend_again = [] {
    rdmarpc::rdma::SetSendPoolsForTesting(true);
  };
  rdmarpc::rdma::HelloResponse hello = Hello();
  std::atomic<rdmarpc::rdma::Connection*> raw{nullptr};
  std::promise<rdmarpc::Status> sent;
  std::atomic<bool> replied{false};
  // The first pong is answered from the polling thread, with a `sent`:
  // that frame may go unsignaled, and the engine must flush it before it
  // sleeps, or `sent` never runs.
  auto handler = std::make_shared<RecordingHandler>(
      [&](const rdmarpc::rdma::FrameView& frame) {
        if (frame.type != rdmarpc::rdma::FrameType::kPong ||
            replied.exchange(true)) {
          return;
        }
        rdmarpc::rdma::Ping again;
        again.set_sequence(2);
        rdmarpc::Status queued = raw.load()->SendFrame(
            rdmarpc::rdma::FrameType::kPing, &again, {},
            [&](rdmarpc::Status s) { sent.set_value(s); });
        if (!queued.ok()) sent.set_value(queued);
      });
  auto conn = Connect(hello, hello.token(), handler);
  ASSERT_TRUE(conn.ok()) << conn.status();
  raw.store(conn->get());
  rdmarpc::rdma::Ping ping;
  ping.set_sequence(1);
  ASSERT_TRUE((*conn)->SendFrame(rdmarpc::rdma::FrameType::kPing, &ping).ok());
  auto result = sent.get_future();
  ASSERT_EQ(result.wait_for(std::chrono::seconds(10)),
            std::future_status::ready);
  EXPECT_TRUE(result.get().ok());
  auto counters = (*conn)->counters();
  EXPECT_EQ(counters.frames_unsignaled, 2u);
  EXPECT_GE(counters.flush_writes, 1u);
  (*conn)->Close(absl::CancelledError("test done"));
  EXPECT_TRUE(handler->WaitClosed());
}

TEST_F(ForgedPeerTest, MalformedFrameClosesOnlyThatConnection) {
  rdmarpc::rdma::HelloResponse hello = Hello();
  auto handler = std::make_shared<RecordingHandler>();
  auto conn = Connect(hello, hello.token(), handler);
  ASSERT_TRUE(conn.ok()) << conn.status();
  // A grant the server never asked for: the client broke the protocol.
  rdmarpc::rdma::Grant grant;
  grant.set_call_id(42);
  grant.set_grant_id(1);
  auto* r = grant.add_regions();
  r->set_addr(4096);
  r->set_rkey(1);
  r->set_length(16);
  ASSERT_TRUE(
      (*conn)->SendFrame(rdmarpc::rdma::FrameType::kGrant, &grant).ok());
  // (This hand-driven peer watches no CM events, so it does not see the
  // server's disconnect; the server's count says it happened.)
  for (int i = 0; i < 100 && server_->rdma_stats().protocol_errors == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_EQ(server_->rdma_stats().protocol_errors, 1u);
  ExpectServerStillServes();
}

TEST_F(ForgedPeerTest, DescriptorThatDisagreesWithTheMessageFailsTheCall) {
  rdmarpc::rdma::HelloResponse hello = Hello();
  auto handler = std::make_shared<RecordingHandler>();
  auto conn = Connect(hello, hello.token(), handler);
  ASSERT_TRUE(conn.ok()) << conn.status();
  // The message says 4096 bytes of u8; the part says 10, inline.
  std::string message;
  rdmarpc::rdma::RequestHead head = EchoHead(7, &message);
  std::string ten(10, 'z');
  head.parts.emplace_back().size = ten.size();
  std::span<const uint8_t> parts[] = {
      {reinterpret_cast<const uint8_t*>(message.data()), message.size()},
      {reinterpret_cast<const uint8_t*>(ten.data()), ten.size()}};
  ASSERT_TRUE((*conn)
                  ->SendFrame(rdmarpc::rdma::FrameType::kRequest, &head, parts)
                  .ok());
  auto [type, response_head] = handler->Next();
  ASSERT_EQ(type, rdmarpc::rdma::FrameType::kResponse);
  rdmarpc::rdma::ResponseHead response;
  const rdmarpc::rdma::FrameView frame{rdmarpc::rdma::FrameType::kResponse, 0,
                                       false, response_head, ""};
  ASSERT_TRUE(rdmarpc::rdma::ParseResponse(frame, {}, &response).ok());
  EXPECT_EQ(response.code,
            static_cast<int>(absl::StatusCode::kInvalidArgument));
  EXPECT_NE(response.message.find("4096"), std::string::npos)
      << response.message;
  EXPECT_EQ(service_.echo_calls.load(), 0);
  (*conn)->Close(absl::CancelledError("test done"));
  ExpectServerStillServes();
}

// The connections of one engine on one device share its completion queue,
// each completion reaching the connection that posted it: a connection
// that closes leaves the others working, and the one that takes its slot
// after it holds another key (a completion the closed one left behind
// cannot reach it). When a group is full, the next connection starts
// another.
TEST_F(ForgedPeerTest, ConnectionsShareACompletionQueuePerEngineAndDevice) {
  struct Peer {
    std::shared_ptr<RecordingHandler> handler =
        std::make_shared<RecordingHandler>();
    std::shared_ptr<rdmarpc::rdma::Connection> conn;
  };
  auto connect = [&](Peer* peer) {
    rdmarpc::rdma::HelloResponse hello = Hello();  // a token per connection
    auto conn = Connect(hello, hello.token(), peer->handler);
    ASSERT_TRUE(conn.ok()) << conn.status();
    peer->conn = *std::move(conn);
  };
  Peer a, b;
  ASSERT_NO_FATAL_FAILURE(connect(&a));
  ASSERT_NO_FATAL_FAILURE(connect(&b));
  EXPECT_EQ(a.conn->cq(), b.conn->cq());
  EXPECT_NE(a.conn->member_key(), b.conn->member_key());
  ASSERT_TRUE(RequestWrittenEcho(*a.conn, *a.handler, 1).ok());

  const uint32_t closed_key = a.conn->member_key();
  a.conn->Close(absl::CancelledError("test: the first connection closes"));
  ASSERT_TRUE(a.handler->WaitClosed());
  // Its slot is free once the engine, too, dropped it.
  std::weak_ptr<rdmarpc::rdma::Connection> gone = a.conn;
  a.conn.reset();
  for (int i = 0; i < 1000 && !gone.expired(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_TRUE(gone.expired());
  Peer c;
  ASSERT_NO_FATAL_FAILURE(connect(&c));
  EXPECT_EQ(c.conn->cq(), b.conn->cq());
  constexpr uint32_t kSlotMask =
      rdmarpc::rdma::CompletionGroup::kMaxMembers - 1;
  EXPECT_EQ(c.conn->member_key() & kSlotMask, closed_key & kSlotMask)
      << "the freed slot is taken first";
  EXPECT_NE(c.conn->member_key(), closed_key);
  ASSERT_TRUE(RequestWrittenEcho(*b.conn, *b.handler, 2).ok());
  ASSERT_TRUE(RequestWrittenEcho(*c.conn, *c.handler, 3).ok());

  // Every group counts as full from here on.
  rdmarpc::rdma::CompletionGroup::SetMaxMembersForTesting(1);
  Peer d, e;
  connect(&d);
  connect(&e);
  rdmarpc::rdma::CompletionGroup::SetMaxMembersForTesting(0);
  ASSERT_TRUE(d.conn && e.conn);
  EXPECT_NE(d.conn->cq(), e.conn->cq());
  EXPECT_NE(d.conn->cq(), b.conn->cq());
  ASSERT_TRUE(RequestWrittenEcho(*d.conn, *d.handler, 4).ok());
  ASSERT_TRUE(RequestWrittenEcho(*e.conn, *e.handler, 5).ok());
  EXPECT_EQ(service_.echo_calls.load(), 0);
  for (Peer* peer : {&b, &c, &d, &e}) {
    peer->conn->Close(absl::CancelledError("test done"));
    EXPECT_TRUE(peer->handler->WaitClosed());
  }
  ExpectServerStillServes();
}

// The engine's handling of device async events, fed synthetic events: a QP
// fatal event closes the connection of that QP only; a device fatal event
// closes every connection on the device, and channels fall back to gRPC.
TEST_F(ForgedPeerTest, QpFatalEventClosesOnlyThatConnection) {
  rdmarpc::rdma::HelloResponse hello = Hello();
  auto conn =
      Connect(hello, hello.token(), std::make_shared<RecordingHandler>());
  ASSERT_TRUE(conn.ok()) << conn.status();
  rdmarpc::rdma::Connection& c = **conn;
  ibv_async_event event{};
  event.event_type = IBV_EVENT_QP_FATAL;
  event.element.qp = c.cm_id()->qp;
  rdmarpc::rdma::Engine::HandleAsyncEvent(c.cm_id()->verbs, event);
  for (int i = 0; i < 200 && !c.closed(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_TRUE(c.closed());
  EXPECT_EQ(c.close_trigger(), "QP fatal event");
  ExpectServerStillServes();
}

TEST_F(ForgedPeerTest, DeviceFatalEventMakesChannelsFallBackThenProbeBack) {
  rdmarpc::ChannelOptions options;
  options.rdma_probe_initial_backoff = std::chrono::milliseconds(50);
  auto channel =
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port_), options);
  auto stub = E2E::NewStub(channel);
  ASSERT_TRUE(EchoOnce(stub.get(), 4096, 1));
  rdmarpc::rdma::HelloResponse hello = Hello();
  auto conn =
      Connect(hello, hello.token(), std::make_shared<RecordingHandler>());
  ASSERT_TRUE(conn.ok()) << conn.status();
  ibv_async_event event{};
  event.event_type = IBV_EVENT_DEVICE_FATAL;
  event.element.port_num = 1;
  rdmarpc::rdma::Engine::HandleAsyncEvent((*conn)->cm_id()->verbs, event);
  auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  rdmarpc::ChannelTransportStats stats;
  do {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    stats = channel->transport_stats();
  } while (stats.switches < 2 && std::chrono::steady_clock::now() < until);
  // Down (the device is not really dead, so the probe succeeds) and back.
  // Client and server share the device here: the client's connection may
  // hear the server's end close (its disconnect) before the event closes it.
  EXPECT_TRUE(stats.last_trigger == "device fatal event" ||
              stats.last_trigger == "server disconnected")
      << stats.ToString();
  EXPECT_EQ(stats.health, rdmarpc::RdmaHealth::kReady) << stats.ToString();
  EXPECT_EQ(stats.switches, 2u) << stats.ToString();
  EXPECT_TRUE((*conn)->closed());
  EXPECT_TRUE(EchoOnce(stub.get(), 4096, 2));  // over RDMA again
}
}  // namespace
}  // namespace rdmarpc_test
