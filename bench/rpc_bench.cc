// rpc_bench: the benchmark driver. One experiment per run, one CSV row per
// result on stdout:
//   experiment,system,transport,param,metric,value,unit
//
//   rpc_bench latency     SYSTEM SIZES...   sequential calls (callback API):
//                                           p50/p99/p999 us, CPU and heap
//                                           allocations per call
//   rpc_bench blocking    SYSTEM SIZES...   the same with blocking stubs
//   rpc_bench throughput  SYSTEM SIZES...   sequential calls: MB/s, CPU s/GB
//   rpc_bench inflight    SYSTEM DEPTHS...  64 B calls, DEPTH in flight on one
//                                           channel: calls/s, p50/p99 us
//   rpc_bench pipelined   SYSTEM SIZES...   calls of SIZE bytes, 16 in flight
//                                           on one channel: MB/s, calls/s
//   rpc_bench connections SYSTEM COUNTS...  64 B calls, one in flight on each
//                                           of COUNT channels: calls/s
//   rpc_bench idle        SYSTEM COUNTS...  COUNT channels connected and at
//                                           rest (seconds from the last call
//                                           until they are), no calls for
//                                           5 s: CPU % of a core,
//                                           and MiB pinned (VmPin), then
//                                           again after a 64 KiB call on
//                                           each
//   rpc_bench crowded     SYSTEM COUNTS...  64 B blocking calls on one
//                                           channel while COUNT others to
//                                           the same server stay connected
//                                           and idle (COUNTS ascending):
//                                           p50/p99 us, CPU per call
//   rpc_bench interference SYSTEM BYTES...  64 B calls on one connection,
//                                           alone and while another moves
//                                           BYTES back to back: p50/p99 us
//   rpc_bench fanout      SYSTEM SERVERS... one 16 MiB tensor to each of
//                                           SERVERS servers at once: MB/s
//   rpc_bench threshold   rdma SIZES...     round trip p50 with the tensor
//                                           in the SEND and by RDMA WRITE
//                                           (what sets the inline threshold)
//   rpc_bench serve       SYSTEM            only the server: prints "port N"
//                                           and serves until stdin closes
//
// RDMARPC_BENCH_SERVER_PORT=N makes the experiments call the server of
// `rpc_bench serve` on port N, in its own process, instead of starting
// servers in this one (one server: not for fanout). CPU and allocations
// per call then count the client's end only.
//
// RDMARPC_BENCH_UNDER_VALGRIND=1 gives the gRPC connect and the RDMA
// handshake minutes, turns the peer timeout off and counts an inline
// handler as a stall only past 1 s (RDMARPC_INLINE_STALL_US), for counting
// instructions under callgrind.
//
// RDMARPC_BENCH_CALLS=N makes latency, blocking, throughput and crowded
// make exactly N calls per size (per count) after the warm-up, untimed (for
// counting what N calls cost: reading the clock around each call would add
// two system calls per call in a VM whose clock source traps); their
// latency rows then read 0.
//
// RDMARPC_BENCH_RELEASE_MUTEXES=1 turns Abseil's debug deadlock detector
// off from the start, as rdmarpc's gRPC transports do: for stock gRPC on
// the same terms (transport/grpc/release_mutexes.h).
//
// SYSTEM: rdma (rdmarpc, policy rdma, the server's handlers on its worker
// pool: SetRunHandlersInline(false)), grpc (rdmarpc's gRPC fallback, policy
// grpc, the same), rdma-inline and grpc-inline (the same with handlers run
// inline, the server's default), rdma-pollers2-inline (rdma-inline with
// RDMARPC_RDMA_POLLERS=2: the client's and the server's connections on two
// engines), rdma-own-receives (rdma with RDMARPC_RDMA_SHARED_RECEIVES=0:
// each connection posts all its receives, as before shared receive
// queues), rdma-own-sends (rdma with RDMARPC_RDMA_SEND_POOL_BUFFERS=0: each
// connection registers its first send buffers at once, as before send
// pools) or stock
// (stock gRPC with grpc_cpp_plugin stubs, message limits raised: stock gRPC
// refuses messages over 4 MB otherwise). Client and servers run in this process
// over loopback (RDMA: the local device). CPU seconds are this process's
// user+system time (getrusage), so they include both ends.
#include <grpcpp/grpcpp.h>
#include <sys/resource.h>
#if defined(__x86_64__)
#include <x86intrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "e2e_test.rdmarpc.pb.h"
#include "rdmarpc/rdmarpc.h"
#include "stock.grpc.pb.h"

// Heap allocations of the whole process (both ends of every call, and
// every library's), counted by interposing malloc; glibc's own entry points
// do the work. operator new allocates through malloc.
std::atomic<uint64_t> g_allocations{0};

extern "C" {
void* __libc_malloc(size_t size);
void* __libc_calloc(size_t count, size_t size);
void* __libc_realloc(void* ptr, size_t size);

void* malloc(size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_malloc(size);
}
void* calloc(size_t count, size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_calloc(count, size);
}
void* realloc(void* ptr, size_t size) {
  g_allocations.fetch_add(1, std::memory_order_relaxed);
  return __libc_realloc(ptr, size);
}
}

namespace {

using Clock = std::chrono::steady_clock;

// Calls are timed by the cycle counter where there is one, as perftest
// times its iterations. In the soft-RoCE VM the clock source (hpet) is not
// readable from user space: each steady_clock read is a system call and an
// emulated device read, which ib_send_lat's timing does not pay, two per
// call (the library itself reads it 0.1 times per call: strace -c). Ticks
// become microseconds at the rate seen since the process started: over a
// run of 0.2 s or more, its error is far below what the rows show.
uint64_t CycleTicks() {
#if defined(__x86_64__)
  return __rdtsc();
#else
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             Clock::now().time_since_epoch())
      .count();
#endif
}

struct TickOrigin {
  Clock::time_point time;
  uint64_t ticks;
};
const TickOrigin g_tick_origin{Clock::now(), CycleTicks()};

// Tick counts into microseconds, in place.
void TicksToMicros(std::vector<double>* ticks) {
  const double us = std::chrono::duration<double, std::micro>(
                        Clock::now() - g_tick_origin.time)
                        .count();
  const double per_tick =
      us / static_cast<double>(CycleTicks() - g_tick_origin.ticks);
  for (double& t : *ticks) t *= per_tick;
}

// One client of one server: a call carries `bytes` request bytes and gets a
// small response; `done(ok)` runs once. CallBlocking uses each system's
// blocking stub, as a user of blocking calls would.
class Target {
 public:
  virtual ~Target() = default;
  virtual void Call(size_t bytes, std::function<void(bool)> done) = 0;
  virtual bool CallBlocking(size_t bytes) = 0;
  // Times the channel's RDMA watcher woke (0 for systems without one).
  virtual uint64_t WatcherWakeups() const { return 0; }
};

// The bytes every request sends (read-only, shared by all calls).
const std::vector<uint8_t>& Payload(size_t bytes) {
  static std::vector<uint8_t> data;
  if (data.size() < bytes) {
    if (!data.empty()) {
      (void)rdmarpc::UnregisterMemoryForRdma(data.data());
    }
    data.assign(bytes, 0x5a);
    // Registered once, as perftest registers its buffer once.
    (void)rdmarpc::RegisterMemoryForRdma(data.data(), data.size());
  }
  return data;
}

class Sink final : public rdmarpc_test::E2E::Service {
 public:
  rdmarpc::Status Echo(rdmarpc::ServerContext*,
                       const rdmarpc_test::EchoRequest& req,
                       rdmarpc_test::EchoResponse* resp) override {
    resp->set_note(req.note());
    return absl::OkStatus();
  }
};

class RdmarpcServer {
 public:
  // `inline_handlers`: run the handler on the thread that received the call
  // (ServerBuilder::SetRunHandlersInline, the default) instead of a worker.
  explicit RdmarpcServer(bool inline_handlers) {
    // Under valgrind every handler takes over 1 ms: stalls would move the
    // method to the workers. (Read when the server starts.)
    const char* slow = std::getenv("RDMARPC_BENCH_UNDER_VALGRIND");
    if (slow != nullptr && *slow == '1') {
      setenv("RDMARPC_INLINE_STALL_US", "1000000", /*overwrite=*/0);
    }
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort("127.0.0.1:0", &port_)
                      .RegisterService(&sink_)
                      .SetTensorPlacement(rdmarpc::Device::Host())
                      .SetRunHandlersInline(inline_handlers)
                      .BuildAndStart();
    if (!server.ok()) {
      std::fprintf(stderr, "server: %s\n", server.status().ToString().c_str());
      std::exit(1);
    }
    server_ = *std::move(server);
  }
  int port() const { return port_; }

 private:
  Sink sink_;
  int port_ = 0;
  std::unique_ptr<rdmarpc::Server> server_;
};

class RdmarpcTarget final : public Target {
 public:
  // `inline_threshold` 0: the server's.
  RdmarpcTarget(int port, rdmarpc::TransportPolicy policy,
                uint64_t inline_threshold = 0) {
    rdmarpc::ChannelOptions options;
    options.policy = policy;
    options.rdma_inline_threshold = inline_threshold;
    // Under valgrind (instruction counts) everything runs tens of times
    // slower: the handshake needs longer and a slow server is not a dead one.
    const char* slow = std::getenv("RDMARPC_BENCH_UNDER_VALGRIND");
    if (slow != nullptr && *slow == '1') {
      options.rdma_connect_timeout = std::chrono::minutes(2);
      options.grpc_connect_attempt_timeout = std::chrono::minutes(2);
      options.rdma_peer_timeout = std::chrono::milliseconds(0);
    }
    // RDMARPC_BENCH_CALLBACKS_INLINE=0: callbacks on the runtime's callback
    // thread instead of the completion engine (the default).
    const char* cb_inline = std::getenv("RDMARPC_BENCH_CALLBACKS_INLINE");
    options.run_callbacks_inline = cb_inline == nullptr || *cb_inline != '0';
    expected_ = policy == rdmarpc::TransportPolicy::kRdma
                    ? rdmarpc::TransportKind::kRdma
                    : rdmarpc::TransportKind::kGrpc;
    channel_ =
        rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port), options);
    stub_ = rdmarpc_test::E2E::NewStub(channel_);
  }

  uint64_t WatcherWakeups() const override {
    return channel_->transport_stats().rdma_watch_wakeups;
  }

  bool CallBlocking(size_t bytes) override {
    rdmarpc::ClientContext ctx;
    rdmarpc_test::EchoRequest req;
    rdmarpc_test::EchoResponse resp;
    SetTensor(&ctx, &req, bytes);
    rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
    return Check(s, ctx);
  }

  void Call(size_t bytes, std::function<void(bool)> done) override {
    struct State {
      rdmarpc::ClientContext ctx;
      rdmarpc_test::EchoRequest req;
      rdmarpc_test::EchoResponse resp;
    };
    auto state = std::make_shared<State>();
    SetTensor(&state->ctx, &state->req, bytes);
    stub_->Echo(&state->ctx, state->req, &state->resp,
                [this, state, done = std::move(done)](rdmarpc::Status s) {
                  done(Check(s, state->ctx));
                });
  }

 private:
  static void SetTensor(rdmarpc::ClientContext* ctx,
                        rdmarpc_test::EchoRequest* req, size_t bytes) {
    if (bytes == 0) return;
    const auto& data = Payload(bytes);
    (void)ctx->tensors().Set(req->mutable_tensor(), rdmarpc::DTYPE_U8,
                             {static_cast<int64_t>(bytes)},
                             rdmarpc::TensorBuffer::Borrow(data.data(), bytes));
  }

  bool Check(const rdmarpc::Status& s, const rdmarpc::ClientContext& ctx) {
    bool ok = s.ok() && ctx.stats().transport == expected_;
    if (!ok) {
      std::fprintf(stderr, "call failed or rerouted: %s (%s)\n",
                   s.ToString().c_str(), ctx.stats().ToString().c_str());
    }
    return ok;
  }

  rdmarpc::TransportKind expected_;
  std::shared_ptr<rdmarpc::Channel> channel_;
  std::unique_ptr<rdmarpc_test::E2E::Stub> stub_;
};

class StockService final : public rdmarpc_bench::Stock::Service {
  grpc::Status Echo(grpc::ServerContext*, const rdmarpc_bench::Blob* req,
                    rdmarpc_bench::Blob* resp) override {
    resp->set_note(req->note());
    return grpc::Status::OK;
  }
};

class StockServer {
 public:
  StockServer() {
    grpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", grpc::InsecureServerCredentials(),
                             &port_);
    builder.SetMaxReceiveMessageSize(-1);
    builder.SetMaxSendMessageSize(-1);
    builder.RegisterService(&service_);
    server_ = builder.BuildAndStart();
    if (!server_) {
      std::fprintf(stderr, "stock gRPC server did not start\n");
      std::exit(1);
    }
  }
  ~StockServer() { server_->Shutdown(); }
  int port() const { return port_; }

 private:
  StockService service_;
  int port_ = 0;
  std::unique_ptr<grpc::Server> server_;
};

class StockTarget final : public Target {
 public:
  explicit StockTarget(int port, int channel_index) {
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(-1);
    args.SetMaxSendMessageSize(-1);
    // A connection of its own per channel, as rdmarpc channels have.
    args.SetInt("rdmarpc_bench.channel", channel_index);
    stub_ = rdmarpc_bench::Stock::NewStub(
        grpc::CreateCustomChannel("127.0.0.1:" + std::to_string(port),
                                  grpc::InsecureChannelCredentials(), args));
  }
  // The stub and its channel are kept until the process ends, for the
  // reason at the end of main: the experiments that drop their targets
  // between points (connections, fanout) aborted there twice (2026-11-26).
  ~StockTarget() override { (void)stub_.release(); }

  bool CallBlocking(size_t bytes) override {
    grpc::ClientContext ctx;
    rdmarpc_bench::Blob req;
    rdmarpc_bench::Blob resp;
    const auto& data = Payload(bytes);
    req.set_data(data.data(), bytes);
    grpc::Status s = stub_->Echo(&ctx, req, &resp);
    if (!s.ok()) {
      std::fprintf(stderr, "stock call failed: %s\n",
                   s.error_message().c_str());
    }
    return s.ok();
  }

  void Call(size_t bytes, std::function<void(bool)> done) override {
    struct State {
      grpc::ClientContext ctx;
      rdmarpc_bench::Blob req;
      rdmarpc_bench::Blob resp;
    };
    auto state = std::make_shared<State>();
    const auto& data = Payload(bytes);
    state->req.set_data(data.data(), bytes);
    stub_->async()->Echo(&state->ctx, &state->req, &state->resp,
                         [state, done = std::move(done)](grpc::Status s) {
                           if (!s.ok()) {
                             std::fprintf(stderr, "stock call failed: %s\n",
                                          s.error_message().c_str());
                           }
                           done(s.ok());
                         });
  }

 private:
  std::unique_ptr<rdmarpc_bench::Stock::Stub> stub_;
};

// Servers and clients of one system.
struct System {
  std::string name;
  std::vector<std::unique_ptr<RdmarpcServer>> rdmarpc_servers;
  std::vector<std::unique_ptr<StockServer>> stock_servers;

  int StartServer() {
    // Another process's server (rpc_bench serve), as a deployment has.
    if (const char* port = std::getenv("RDMARPC_BENCH_SERVER_PORT")) {
      return std::atoi(port);
    }
    if (name == "stock") {
      stock_servers.push_back(std::make_unique<StockServer>());
      return stock_servers.back()->port();
    }
    rdmarpc_servers.push_back(
        std::make_unique<RdmarpcServer>(name.ends_with("-inline")));
    return rdmarpc_servers.back()->port();
  }

  std::unique_ptr<Target> Connect(int port, int index) {
    if (name == "stock") return std::make_unique<StockTarget>(port, index);
    return std::make_unique<RdmarpcTarget>(
        port, name.starts_with("rdma") ? rdmarpc::TransportPolicy::kRdma
                                       : rdmarpc::TransportPolicy::kGrpc);
  }
};

double CpuSeconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return u.ru_utime.tv_sec + u.ru_stime.tv_sec +
         (u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

// This process's pinned memory (VmPin: registered memory regions), MiB;
// -1 where the kernel does not say.
double PinnedMib() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmPin:", 0) == 0) {
      return std::strtod(line.c_str() + 6, nullptr) / 1024;
    }
  }
  return -1;
}

double Pct(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * v.size()))];
}

std::string g_experiment, g_system;

void Row(const std::string& param, const char* metric, double value,
         const char* unit) {
  std::printf("%s,%s,%s,%s,%.3f,%s\n", g_experiment.c_str(), g_system.c_str(),
              param.c_str(), metric, value, unit);
  std::fflush(stdout);
}

void Fail(const char* what) {
  std::fprintf(stderr, "rpc_bench: %s failed\n", what);
  std::exit(1);
}

// One asynchronous call (each system's callback API), waited for.
bool CallAndWait(Target* t, size_t bytes) {
  std::mutex mu;
  std::condition_variable cv;
  bool finished = false, ok = false;
  t->Call(bytes, [&](bool result) {
    std::lock_guard<std::mutex> lock(mu);
    ok = result;
    finished = true;
    cv.notify_one();
  });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return finished; });
  return ok;
}

// RDMARPC_BENCH_CALLS, or 0 when unset: that many calls, untimed.
int FixedCalls() {
  const char* fixed = std::getenv("RDMARPC_BENCH_CALLS");
  return fixed != nullptr ? std::atoi(fixed) : 0;
}

// Calls of `bytes` until `min_calls` and `min_seconds` are both reached:
// blocking calls, or asynchronous ones waited for one at a time.
std::vector<double> Sequential(Target* t, size_t bytes, int min_calls,
                               double min_seconds, double* seconds,
                               bool blocking, bool timed) {
  // Two large calls: a landing block goes back to the server's landing
  // arena only once it is cleared (aside), and by then the next call has
  // landed in another, so a stream of large calls settles on two blocks;
  // the first call that needs the second maps and registers it.
  const int warm_up = bytes >= (1 << 20) ? 2 : 10;
  for (int i = 0; i < warm_up; ++i) {
    if (!t->CallBlocking(bytes)) Fail("warm-up call");
  }
  std::vector<double> us;
  us.reserve(min_calls);
  auto start = Clock::now();
  while (static_cast<int>(us.size()) < min_calls ||
         std::chrono::duration<double>(Clock::now() - start).count() <
             min_seconds) {
    if (!timed) {
      if (!(blocking ? t->CallBlocking(bytes) : CallAndWait(t, bytes))) {
        Fail("call");
      }
      us.push_back(0);
      continue;
    }
    const uint64_t t0 = CycleTicks();
    if (!(blocking ? t->CallBlocking(bytes) : CallAndWait(t, bytes))) {
      Fail("call");
    }
    us.push_back(static_cast<double>(CycleTicks() - t0));
  }
  *seconds = std::chrono::duration<double>(Clock::now() - start).count();
  if (timed) TicksToMicros(&us);
  return us;
}

// Keeps `depth` calls in flight on each target for `seconds`; returns the
// latency of each call in microseconds.
std::vector<double> ClosedLoop(std::vector<std::unique_ptr<Target>>& targets,
                               int depth, size_t bytes, double seconds,
                               uint64_t* calls) {
  std::mutex mu;
  std::condition_variable cv;
  std::vector<double> us;
  int running = 0;  // guarded by mu
  std::atomic<bool> stop{false};
  std::function<void(Target*)> issue = [&](Target* t) {
    const uint64_t t0 = CycleTicks();
    {
      std::lock_guard<std::mutex> lock(mu);
      ++running;
    }
    t->Call(bytes, [&, t, t0](bool ok) {
      if (!ok) Fail("call");
      if (!stop.load()) issue(t);
      std::lock_guard<std::mutex> lock(mu);
      us.push_back(static_cast<double>(CycleTicks() - t0));
      if (--running == 0) cv.notify_all();
    });
  };
  for (auto& t : targets) {
    for (int i = 0; i < depth; ++i) issue(t.get());
  }
  std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  stop.store(true);
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return running == 0; });
  *calls = us.size();
  TicksToMicros(&us);
  return us;
}

}  // namespace

int main(int argc, char** argv) {
  const bool serve = argc == 3 && std::string_view(argv[1]) == "serve";
  if (argc < 4 && !serve) {
    std::fprintf(stderr,
                 "usage: %s latency|blocking|throughput|pipelined|inflight|"
                 "connections|idle|serve|"
                 "interference|fanout|threshold "
                 "rdma|grpc|rdma-inline|grpc-inline|rdma-pollers2-inline|"
                 "rdma-own-receives|rdma-own-sends|stock "
                 "VALUES...\n",
                 argv[0]);
    return 2;
  }
  g_experiment = argv[1];
  g_system = argv[2];
  std::vector<uint64_t> values;
  for (int i = 3; i < argc; ++i)
    values.push_back(std::strtoull(argv[i], nullptr, 10));
  System sys{g_system, {}, {}};
  if (g_system != "rdma" && g_system != "grpc" && g_system != "stock" &&
      g_system != "rdma-inline" && g_system != "grpc-inline" &&
      g_system != "rdma-pollers2-inline" && g_system != "rdma-own-receives" &&
      g_system != "rdma-own-sends") {
    Fail("unknown system");
  }
  if (const char* release = std::getenv("RDMARPC_BENCH_RELEASE_MUTEXES");
      release != nullptr && std::string_view(release) == "1") {
    absl::SetMutexDeadlockDetectionMode(absl::OnDeadlockCycle::kIgnore);
  }
  // Read when the first connection starts an engine.
  if (g_system == "rdma-pollers2-inline")
    setenv("RDMARPC_RDMA_POLLERS", "2", 1);
  if (g_system == "rdma-own-receives")
    setenv("RDMARPC_RDMA_SHARED_RECEIVES", "0", 1);
  if (g_system == "rdma-own-sends")
    setenv("RDMARPC_RDMA_SEND_POOL_BUFFERS", "0", 1);
  if (serve) {
    // Only the server, until stdin closes.
    std::printf("port %d\n", sys.StartServer());
    std::fflush(stdout);
    while (std::getchar() != EOF) {
    }
    return 0;
  }
  if (g_experiment == "latency" || g_experiment == "blocking" ||
      g_experiment == "throughput") {
    auto target = sys.Connect(sys.StartServer(), 0);
    for (uint64_t bytes : values) {
      std::string param = std::to_string(bytes);
      double cpu0 = CpuSeconds();
      uint64_t allocations0 = g_allocations.load();
      double seconds = 0;
      bool small = g_experiment != "throughput";
      // RDMARPC_BENCH_CALLS=N: exactly N calls (after the warm-up), for
      // counting what N calls cost (bench/experiments.sh's system calls).
      const int fixed = FixedCalls();
      int min_calls = small ? 2000 : 3;
      double min_seconds = small ? 1.0 : 2.0;
      if (fixed > 0) {
        min_calls = fixed;
        min_seconds = 0;
      }
      auto us = Sequential(target.get(), bytes, min_calls, min_seconds,
                           &seconds, g_experiment == "blocking",
                           /*timed=*/fixed == 0);
      double cpu = CpuSeconds() - cpu0;
      double allocations =
          static_cast<double>(g_allocations.load() - allocations0);
      if (small) {
        Row(param, "p50", Pct(us, 0.50), "us");
        Row(param, "p99", Pct(us, 0.99), "us");
        Row(param, "p999", Pct(us, 0.999), "us");
        Row(param, "cpu_per_million_calls", cpu / us.size() * 1e6, "s");
        Row(param, "allocations_per_call", allocations / us.size(), "n");
      } else {
        double moved = static_cast<double>(bytes) * us.size();
        Row(param, "throughput", moved / seconds / 1e6, "MB/s");
        Row(param, "cpu_per_gb", cpu / (moved / 1e9), "s");
      }
    }
  } else if (g_experiment == "inflight" || g_experiment == "connections") {
    int port = sys.StartServer();
    for (uint64_t v : values) {
      std::vector<std::unique_ptr<Target>> targets;
      int depth = 1;
      if (g_experiment == "inflight") {
        targets.push_back(sys.Connect(port, 0));
        depth = static_cast<int>(v);
      } else {
        for (uint64_t c = 0; c < v; ++c) {
          targets.push_back(sys.Connect(port, static_cast<int>(c)));
        }
      }
      for (auto& t : targets) {
        if (!t->CallBlocking(64)) Fail("warm-up call");
      }
      uint64_t calls = 0;
      double cpu0 = CpuSeconds();
      auto us = ClosedLoop(targets, depth, 64, 2.0, &calls);
      double cpu = CpuSeconds() - cpu0;
      std::string param = std::to_string(v);
      Row(param, "calls_per_s", calls / 2.0, "1/s");
      Row(param, "p50", Pct(us, 0.50), "us");
      Row(param, "p99", Pct(us, 0.99), "us");
      Row(param, "cpu_per_million_calls", cpu / calls * 1e6, "s");
    }
  } else if (g_experiment == "pipelined") {
    // Tensor throughput with calls overlapping, as a data mover keeps them.
    constexpr int kDepth = 16;
    constexpr double kSeconds = 3.0;
    std::vector<std::unique_ptr<Target>> targets;
    targets.push_back(sys.Connect(sys.StartServer(), 0));
    for (uint64_t bytes : values) {
      if (!targets[0]->CallBlocking(bytes)) Fail("warm-up call");
      uint64_t calls = 0;
      ClosedLoop(targets, kDepth, bytes, kSeconds, &calls);
      std::string param = std::to_string(bytes);
      Row(param, "throughput", double(bytes) * calls / kSeconds / 1e6, "MB/s");
      Row(param, "calls_per_s", calls / kSeconds, "1/s");
    }
  } else if (g_experiment == "idle") {
    // Both ends' CPU (this process) while COUNT connected channels make no
    // calls: what pollers, monitors and timers cost at rest.
    int port = sys.StartServer();
    for (uint64_t count : values) {
      std::vector<std::unique_ptr<Target>> targets;
      for (uint64_t c = 0; c < count; ++c) {
        targets.push_back(sys.Connect(port, static_cast<int>(c)));
        if (!targets.back()->CallBlocking(64)) Fail("warm-up call");
      }
      // Idle means at rest: the engines' spins have ended (1 s), and each
      // channel's RDMA watcher, which wakes every 50 ms for a second after
      // its channel's last call, sleeps until the next call. The watchers
      // rest once their wake-up counts stand still for longer than five
      // such periods.
      const auto last_call = std::chrono::steady_clock::now();
      std::this_thread::sleep_for(std::chrono::seconds(1));
      auto watcher_wakeups = [&targets] {
        uint64_t sum = 0;
        for (const auto& t : targets) sum += t->WatcherWakeups();
        return sum;
      };
      for (uint64_t seen = watcher_wakeups();;) {
        std::this_thread::sleep_for(std::chrono::milliseconds(300));
        const uint64_t now = watcher_wakeups();
        if (now == seen) break;
        if (std::chrono::steady_clock::now() - last_call >
            std::chrono::seconds(30)) {
          Fail("idle: the channels' RDMA watchers did not rest in 30 s");
        }
        seen = now;
      }
      Row(std::to_string(count), "rest_s",
          std::chrono::duration<double>(std::chrono::steady_clock::now() -
                                        last_call)
              .count(),
          "s");
      const double seconds = 5;
      double cpu0 = CpuSeconds();
      std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
      double cpu = CpuSeconds() - cpu0;
      Row(std::to_string(count), "cpu_percent", cpu / seconds * 100, "%");
      // Control buffers and receive pools of both ends (no call here
      // lands a tensor, so no landing memory is registered).
      Row(std::to_string(count), "pinned_mib", PinnedMib(), "MiB");
      // Then a 64 KiB echo on each (written both ways, so it lands in the
      // landing arena on both ends), and once more after the arena's
      // registrations made aside had time to finish: the arena's pinning
      // joins the figure (once per protection domain, or per connection).
      for (int round = 0; round < 2; ++round) {
        for (auto& t : targets) {
          if (!t->CallBlocking(65536)) Fail("64 KiB call");
        }
        std::this_thread::sleep_for(std::chrono::seconds(1));
      }
      Row(std::to_string(count), "pinned_mib_landed", PinnedMib(), "MiB");
    }
  } else if (g_experiment == "crowded") {
    // What other connections cost a busy one when they are there but make
    // no calls: each pass of a poller covers them (their completion
    // queues, or the one they share).
    int port = sys.StartServer();
    auto active = sys.Connect(port, 0);
    std::vector<std::unique_ptr<Target>> idle;
    const int fixed = FixedCalls();
    for (uint64_t count : values) {
      if (count < idle.size()) Fail("crowded: COUNTS must ascend");
      while (idle.size() < count) {
        idle.push_back(sys.Connect(port, static_cast<int>(idle.size()) + 1));
        if (!idle.back()->CallBlocking(64)) Fail("warm-up call");
      }
      double seconds = 0;
      double cpu0 = CpuSeconds();
      auto us = Sequential(active.get(), 64, fixed > 0 ? fixed : 2000,
                           fixed > 0 ? 0 : 1.0, &seconds, /*blocking=*/true,
                           /*timed=*/fixed == 0);
      double cpu = CpuSeconds() - cpu0;
      std::string param = std::to_string(count);
      Row(param, "p50", Pct(us, 0.50), "us");
      Row(param, "p99", Pct(us, 0.99), "us");
      Row(param, "cpu_per_million_calls", cpu / us.size() * 1e6, "s");
    }
  } else if (g_experiment == "interference") {
    // 64 B calls on one connection alone, then while another connection to
    // the same server moves tensors of BYTES back to back.
    int port = sys.StartServer();
    auto small = sys.Connect(port, 0);
    auto large = sys.Connect(port, 1);
    if (!small->CallBlocking(64) || !large->CallBlocking(64)) {
      Fail("warm-up call");
    }
    for (uint64_t bytes : values) {
      (void)Payload(bytes);  // sized before two threads read it
      double seconds = 0;
      auto idle = Sequential(small.get(), 64, 1000, 0.5, &seconds, true, true);
      std::atomic<bool> stop{false};
      std::atomic<int> large_calls{0};
      std::thread mover([&] {
        while (!stop.load()) {
          if (!large->CallBlocking(bytes)) Fail("large call");
          large_calls.fetch_add(1);
        }
      });
      // Measured from the first large call's start until two have ended.
      std::vector<double> loaded;
      while (large_calls.load() < 2 || loaded.size() < 1000) {
        const uint64_t t0 = CycleTicks();
        if (!small->CallBlocking(64)) Fail("call");
        loaded.push_back(static_cast<double>(CycleTicks() - t0));
      }
      stop.store(true);
      mover.join();
      TicksToMicros(&loaded);
      std::string param = std::to_string(bytes);
      Row(param, "idle_p50", Pct(idle, 0.50), "us");
      Row(param, "idle_p99", Pct(idle, 0.99), "us");
      Row(param, "loaded_p50", Pct(loaded, 0.50), "us");
      Row(param, "loaded_p99", Pct(loaded, 0.99), "us");
      Row(param, "loaded_max", Pct(loaded, 1.0), "us");
      Row(param, "loaded_calls", static_cast<double>(loaded.size()), "calls");
      Row(param, "large_calls", large_calls.load(), "calls");
    }
  } else if (g_experiment == "fanout") {
    const size_t bytes = size_t{16} << 20;
    for (uint64_t n : values) {
      System fan{g_system, {}, {}};
      std::vector<std::unique_ptr<Target>> targets;
      for (uint64_t i = 0; i < n; ++i) {
        targets.push_back(fan.Connect(fan.StartServer(), static_cast<int>(i)));
        if (!targets.back()->CallBlocking(bytes)) Fail("warm-up call");
      }
      const int rounds = 8;
      auto start = Clock::now();
      for (int r = 0; r < rounds; ++r) {
        uint64_t left = n;  // guarded by mu
        std::mutex mu;
        std::condition_variable cv;
        for (auto& t : targets) {
          t->Call(bytes, [&](bool ok) {
            if (!ok) Fail("call");
            std::lock_guard<std::mutex> lock(mu);
            if (--left == 0) cv.notify_all();
          });
        }
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return left == 0; });
      }
      double s = std::chrono::duration<double>(Clock::now() - start).count();
      std::string param = std::to_string(n);
      Row(param, "round_ms", s / rounds * 1e3, "ms");
      Row(param, "throughput", double(bytes) * n * rounds / s / 1e6, "MB/s");
    }
  } else if (g_experiment == "threshold" && g_system == "rdma") {
    int port = sys.StartServer();
    RdmarpcTarget in_frame(port, rdmarpc::TransportPolicy::kRdma,
                           uint64_t{1} << 20);
    RdmarpcTarget written(port, rdmarpc::TransportPolicy::kRdma, 1);
    for (uint64_t bytes : values) {
      double seconds = 0;
      std::string param = std::to_string(bytes);
      Row(param, "inline_p50",
          Pct(Sequential(&in_frame, bytes, 300, 0.2, &seconds, false, true),
              0.5),
          "us");
      Row(param, "written_p50",
          Pct(Sequential(&written, bytes, 300, 0.2, &seconds, false, true),
              0.5),
          "us");
    }
  } else {
    Fail("unknown experiment");
  }
  // No teardown: gRPC 1.51 can abort ("ref_counted.h: prior > 0") when a
  // stock callback call's last reference to its channel goes on gRPC's
  // thread after main dropped the stub; the rows are out already.
  std::fflush(stdout);
  std::_Exit(0);
}
