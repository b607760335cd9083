// Fault tests (label fault; real RDMA: the soft-RoCE VM or a native port).
//
// Each scenario runs a server in a child process of this binary, four client
// threads streaming Echo calls with tensors of mixed sizes (64 B and 4 KiB go
// inline, 256 KiB and 4 MiB by RDMA WRITE) through one channel with policy
// auto, and breaks RDMA in one way while they run:
//   (a) delete the rxe link, then add it back;
//   (b) set the netdev down, then up;
//   (c) force the client's queue pair into the error state;
//   (d) kill -9 the server process and start it again on the same port;
//   (e) exhaust the server's landing pool (a slow call holds most of it);
//   (f) drop 30% of the RDMA path's packets while gRPC stays healthy.
// Per scenario it counts calls issued, succeeded, failed with a clear status,
// run twice by the server (its handler logs each call id to a file that
// survives the kill), lost (issued without a callback) and callbacks run
// twice, and measures p99 latency of the calls around the switch. It prints
// the table at the end. Required: nothing lost, nothing run twice, no
// corrupt bytes, every failure UNAVAILABLE or DEADLINE_EXCEEDED with a
// message, no failure at all where the server's gRPC port stays up (all
// rows but (d)), and fail-back after (a), (b) and (f): a call started after
// the fault ended succeeds over RDMA.
//
// Must run as root on a host whose only RDMA device is a soft-RoCE link
// named rxe0 (tests/rdma_vm/guest.sh sets that up). Row (f) rewires the
// host's routing rules, so it runs only in the VM.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "e2e_fixture.h"
#include "runtime/fault_injection.h"

extern char** environ;

namespace rdmarpc_test {
namespace {

using Clock = std::chrono::steady_clock;
using rdmarpc::ClientContext;
using rdmarpc::TensorBuffer;
using namespace std::chrono_literals;

constexpr char kEcho[] = "/rdmarpc_test.E2E/Echo";
constexpr char kSlow[] = "/rdmarpc_test.E2E/Slow";
constexpr uint64_t kLandingPool = 64 << 20;

// ---- The server process ----

// Echo logs each call id before it echoes; Slow holds its request (and the
// landing memory under it) for sleep_ms.
class LoggingService final : public E2E::Service {
 public:
  explicit LoggingService(int log_fd) : log_fd_(log_fd) {}
  rdmarpc::Status Echo(rdmarpc::ServerContext* ctx, const EchoRequest& req,
                       EchoResponse* resp) override {
    std::string line = std::to_string(ctx->call_id()) + "\n";
    if (write(log_fd_, line.data(), line.size()) !=
        static_cast<ssize_t>(line.size())) {
      return absl::InternalError("cannot log the call");
    }
    resp->set_note(req.note());
    if (!req.has_tensor()) return absl::OkStatus();
    RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorView in,
                             ctx->tensors().Get(req.tensor()));
    return ctx->tensors().Set(resp->mutable_tensor(), in);
  }
  rdmarpc::Status Slow(rdmarpc::ServerContext*, const EchoRequest& req,
                       EchoResponse* resp) override {
    std::this_thread::sleep_for(std::chrono::milliseconds(req.sleep_ms()));
    resp->set_note("slept");
    return absl::OkStatus();
  }

 private:
  int log_fd_;
};

int Serve(int port, const std::string& log_path,
          const std::string& ready_path) {
  int fd = open(log_path.c_str(), O_WRONLY | O_APPEND | O_CREAT, 0644);
  if (fd < 0) {
    std::perror("open call log");
    return 1;
  }
  LoggingService service(fd);
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:" + std::to_string(port))
                    .RegisterService(&service)
                    .SetNumWorkers(8)
                    .SetRdmaLandingPoolBytes(kLandingPool)
                    .BuildAndStart();
  if (!server.ok()) {
    std::fprintf(stderr, "server: %s\n", server.status().ToString().c_str());
    return 1;
  }
  std::ofstream(ready_path) << (*server)->rdma_stats().status << "\n";
  (*server)->Wait();  // until killed
  return 0;
}

// ---- The test process ----

int FreePort() {
  // Bind-and-release; the child binds it again at once.
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  sin.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  bind(fd, reinterpret_cast<sockaddr*>(&sin), sizeof(sin));
  socklen_t len = sizeof(sin);
  getsockname(fd, reinterpret_cast<sockaddr*>(&sin), &len);
  close(fd);
  return ntohs(sin.sin_port);
}

std::string Shell(const std::string& command) {
  std::string out;
  FILE* p = popen((command + " 2>&1").c_str(), "r");
  if (p == nullptr) return "popen failed";
  char buf[256];
  while (std::fgets(buf, sizeof(buf), p) != nullptr) out += buf;
  int rc = pclose(p);
  if (rc != 0) ADD_FAILURE() << command << " failed (" << rc << "): " << out;
  return out;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

bool WaitForPortActive(std::chrono::milliseconds limit) {
  auto until = Clock::now() + limit;
  while (Clock::now() < until) {
    if (ReadFile("/sys/class/infiniband/rxe0/ports/1/state").find("ACTIVE") !=
        std::string::npos) {
      return true;
    }
    std::this_thread::sleep_for(50ms);
  }
  return false;
}

class ServerProcess {
 public:
  // `rdma_addr`: the address its RDMA listener binds (RDMARPC_RDMA_ADDR);
  // empty: this process's.
  ServerProcess(int port, std::string log, std::string rdma_addr)
      : port_(port), log_(log), rdma_addr_(std::move(rdma_addr)) {}
  ~ServerProcess() { Kill(); }

  bool Start() {
    std::string ready = log_ + ".ready";
    unlink(ready.c_str());
    char exe[4096];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    if (n <= 0) return false;
    exe[n] = '\0';
    std::string port = std::to_string(port_);
    std::vector<char*> argv = {exe,          const_cast<char*>("--serve"),
                               port.data(),  log_.data(),
                               ready.data(), nullptr};
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      if (rdma_addr_.empty() ||
          std::strncmp(*e, "RDMARPC_RDMA_ADDR=", 18) != 0) {
        env_strings.push_back(*e);
      }
    }
    if (!rdma_addr_.empty()) {
      env_strings.push_back("RDMARPC_RDMA_ADDR=" + rdma_addr_);
    }
    std::vector<char*> env;
    for (std::string& e : env_strings) env.push_back(e.data());
    env.push_back(nullptr);
    if (posix_spawn(&pid_, exe, nullptr, nullptr, argv.data(), env.data()) !=
        0) {
      return false;
    }
    auto until = Clock::now() + 30s;
    while (Clock::now() < until) {
      std::string status = ReadFile(ready);
      if (!status.empty()) {
        rdma_status_ = status;
        return true;
      }
      int st = 0;
      if (waitpid(pid_, &st, WNOHANG) == pid_) {
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(20ms);
    }
    return false;
  }

  void Kill() {
    if (pid_ <= 0) return;
    kill(pid_, SIGKILL);
    waitpid(pid_, nullptr, 0);
    pid_ = -1;
  }

  const std::string& rdma_status() const { return rdma_status_; }

 private:
  int port_;
  std::string log_;
  std::string rdma_addr_;
  pid_t pid_ = -1;
  std::string rdma_status_;
};

// One client call, kept alive by its callback until that runs.
struct Call {
  ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  std::vector<uint8_t> bytes;
  std::promise<rdmarpc::Status> result;
  std::atomic<int> callbacks{0};
};

struct Sample {
  Clock::time_point start, end;
  bool ok;
  rdmarpc::TransportKind transport;
};

struct Row {
  std::string name;
  uint64_t issued = 0, succeeded = 0, failed_clear = 0, failed_unclear = 0;
  uint64_t twice = 0, lost = 0, double_callbacks = 0, corrupt = 0;
  double p50_before_ms = 0, p99_switch_ms = 0;
  double failback_s = -1;  // -1: not observed
  uint64_t calls_rdma = 0, calls_grpc = 0, calls_resent = 0;
  std::string trigger;
  std::string note;
  std::string sample_failure;
};

std::vector<Row>& Table() {
  static std::vector<Row> rows;
  return rows;
}

class Load {
 public:
  Load(std::shared_ptr<rdmarpc::Channel> channel,
       std::chrono::milliseconds call_timeout)
      : channel_(std::move(channel)), call_timeout_(call_timeout) {}

  void Start(int threads) {
    for (int i = 0; i < threads; ++i) {
      workers_.emplace_back([this, i] { Worker(i); });
    }
  }
  void Stop() {
    stop_.store(true);
    for (auto& w : workers_) w.join();
  }
  // Calls started from now on carry at most `bytes` (row (e): the load's
  // 4 MiB requests would compete with its hog for the landing pool).
  void CapSize(size_t bytes) { size_cap_.store(bytes); }

  std::vector<Sample> samples() {
    std::lock_guard<std::mutex> lock(mu_);
    return samples_;
  }
  // When the first call started after `t` that went over RDMA and
  // succeeded was started; nullopt while there is none.
  std::optional<Clock::time_point> FirstRdmaCallAfter(Clock::time_point t) {
    std::lock_guard<std::mutex> lock(mu_);
    std::optional<Clock::time_point> first;
    for (const Sample& s : samples_) {
      if (s.ok && s.start > t && s.transport == rdmarpc::TransportKind::kRdma &&
          (!first || s.start < *first)) {
        first = s.start;
      }
    }
    return first;
  }
  void Fill(Row* row) {
    std::lock_guard<std::mutex> lock(mu_);
    row->issued = issued_;
    row->succeeded = succeeded_;
    row->failed_clear = failed_clear_;
    row->failed_unclear = failed_unclear_;
    row->lost = lost_;
    row->double_callbacks = double_callbacks_->load();
    row->corrupt = corrupt_;
    row->sample_failure = sample_failure_;
  }

 private:
  void Worker(int index) {
    static constexpr size_t kSizes[] = {64, 4096, 256 << 10, 4 << 20};
    for (uint32_t n = 0; !stop_.load(); ++n) {
      size_t size = std::min(kSizes[(n + index) % 4], size_cap_.load());
      uint32_t seed = static_cast<uint32_t>(index) * 1000003u + n;
      auto call = std::make_shared<Call>();
      call->bytes = Pattern(size, seed);
      call->req.set_note(std::to_string(seed));
      EXPECT_TRUE(call->ctx.tensors()
                      .Set(call->req.mutable_tensor(), rdmarpc::DTYPE_U8,
                           {static_cast<int64_t>(size)},
                           TensorBuffer::Borrow(call->bytes.data(), size))
                      .ok());
      call->ctx.set_timeout(call_timeout_);
      auto future = call->result.get_future();
      Sample sample;
      sample.start = Clock::now();
      {
        std::lock_guard<std::mutex> lock(mu_);
        ++issued_;
      }
      channel_->CallAsync(kEcho, &call->ctx, call->req, &call->resp,
                          [call, twice = double_callbacks_](rdmarpc::Status s) {
                            if (call->callbacks.fetch_add(1) == 0) {
                              call->result.set_value(std::move(s));
                            } else {
                              twice->fetch_add(1);
                            }
                          });
      if (future.wait_for(60s) != std::future_status::ready) {
        std::lock_guard<std::mutex> lock(mu_);
        ++lost_;
        leaked_.push_back(call);  // its memory stays borrowed
        continue;
      }
      rdmarpc::Status status = future.get();
      sample.end = Clock::now();
      sample.ok = status.ok();
      sample.transport = call->ctx.stats().transport;
      std::lock_guard<std::mutex> lock(mu_);
      samples_.push_back(sample);
      if (status.ok()) {
        auto out = call->ctx.tensors().Get(call->resp.tensor());
        bool same = out.ok() && out->size() == size &&
                    call->resp.note() == call->req.note() &&
                    std::memcmp(out->data(), call->bytes.data(), size) == 0;
        ++succeeded_;
        if (!same) ++corrupt_;
        continue;
      }
      bool clear = (status.code() == absl::StatusCode::kUnavailable ||
                    status.code() == absl::StatusCode::kDeadlineExceeded) &&
                   !status.message().empty();
      ++(clear ? failed_clear_ : failed_unclear_);
      if (sample_failure_.empty() || !clear) {
        sample_failure_ = status.ToString();
      }
    }
  }

  std::shared_ptr<rdmarpc::Channel> channel_;
  const std::chrono::milliseconds call_timeout_;
  std::atomic<bool> stop_{false};
  std::atomic<size_t> size_cap_{SIZE_MAX};
  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::vector<Sample> samples_;
  std::vector<std::shared_ptr<Call>> leaked_;
  // Callbacks that ran a second time (they may run after Stop()).
  std::shared_ptr<std::atomic<uint64_t>> double_callbacks_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  uint64_t issued_ = 0, succeeded_ = 0, failed_clear_ = 0, failed_unclear_ = 0,
           lost_ = 0, corrupt_ = 0;
  std::string sample_failure_;
};

double Percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

uint64_t RunTwice(const std::string& log) {
  std::map<std::string, int> runs;
  std::istringstream in(ReadFile(log));
  std::string id;
  uint64_t twice = 0;
  while (in >> id) {
    if (++runs[id] == 2) ++twice;
  }
  return twice;
}

struct Context {
  ServerProcess* server;
  rdmarpc::Channel* channel;
  Load* load;
  std::string netdev;
  std::string note;  // for the table
};

class FaultTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (geteuid() != 0) GTEST_SKIP() << "needs root (rdma link, ip link)";
    netdev_ = ReadFile("/sys/class/infiniband/rxe0/ports/1/gid_attrs/ndevs/0");
    netdev_.erase(netdev_.find_last_not_of(" \n") + 1);
    if (netdev_.empty()) GTEST_SKIP() << "no soft-RoCE link rxe0";
  }
  void TearDown() override { rdmarpc::internal::fault::DisarmAll(); }

  struct Setting {
    // Wait for a call started after `inject` returned to succeed over RDMA
    // (up to 30 s). Not the channel's health: a connection made while the
    // fault lasted may read ready and still die a moment later.
    bool expect_failback = false;
    // The server's gRPC port stays up: a call RDMA cannot finish must be
    // re-sent over gRPC, so no call may fail at all.
    bool server_reachable = true;
    std::string server_rdma_addr;  // empty: RDMARPC_RDMA_ADDR as set
    std::chrono::milliseconds call_timeout = 30s;

    static Setting FailsBack() {
      Setting s;
      s.expect_failback = true;
      return s;
    }
    static Setting ServerUnreachable() {
      Setting s;
      s.server_reachable = false;
      return s;
    }
  };

  // Runs the load, calls `inject` after a steady second and a half, and
  // checks the outcome against `setting`.
  void Scenario(const std::string& name,
                const std::function<void(Context&)>& inject,
                const Setting& setting) {
    const bool expect_failback = setting.expect_failback;
    Row row;
    row.name = name;
    std::string log = "/tmp/rdmarpc_fault_" + std::to_string(getpid()) + "_" +
                      std::to_string(Table().size()) + ".log";
    unlink(log.c_str());
    int port = FreePort();
    ServerProcess server(port, log, setting.server_rdma_addr);
    ASSERT_TRUE(server.Start()) << "server did not start";
    ASSERT_EQ(server.rdma_status().rfind("listening", 0), 0u)
        << server.rdma_status();

    rdmarpc::ChannelOptions options;
    options.rdma_peer_timeout = 1500ms;
    options.rdma_probe_initial_backoff = 100ms;
    options.rdma_probe_max_backoff = 1000ms;
    options.rdma_connect_timeout = 3000ms;
    auto channel =
        rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port), options);
    // Warm up until calls go over RDMA.
    bool on_rdma = false;
    for (int i = 0; i < 100 && !on_rdma; ++i) {
      ClientContext ctx;
      EchoRequest req;
      EchoResponse resp;
      on_rdma = channel->Call(kEcho, &ctx, req, &resp).ok() &&
                ctx.stats().transport == rdmarpc::TransportKind::kRdma;
    }
    ASSERT_TRUE(on_rdma) << channel->transport_stats().ToString();

    Load load(channel, setting.call_timeout);
    load.Start(4);
    std::this_thread::sleep_for(1500ms);
    Context context{&server, channel.get(), &load, netdev_, ""};
    auto fault_at = Clock::now();
    inject(context);
    row.note = context.note;
    auto restored_at = Clock::now();
    auto settled = restored_at + 2s;
    if (expect_failback) {
      auto until = restored_at + 30s;
      std::optional<Clock::time_point> back;
      while (!(back = load.FirstRdmaCallAfter(restored_at)) &&
             Clock::now() < until) {
        std::this_thread::sleep_for(20ms);
      }
      if (back) {
        row.failback_s =
            std::chrono::duration<double>(*back - restored_at).count();
        settled = *back;
      }
    }
    std::this_thread::sleep_for(1500ms);
    load.Stop();

    rdmarpc::ChannelTransportStats stats = channel->transport_stats();
    load.Fill(&row);
    row.calls_rdma = stats.calls_rdma;
    row.calls_grpc = stats.calls_grpc;
    row.calls_resent = stats.calls_resent;
    row.trigger = stats.last_trigger;
    std::vector<double> before, during;
    for (const Sample& s : load.samples()) {
      double ms =
          std::chrono::duration<double, std::milli>(s.end - s.start).count();
      if (s.end < fault_at) before.push_back(ms);
      if (s.end >= fault_at && s.start <= settled) during.push_back(ms);
    }
    row.p50_before_ms = Percentile(before, 0.5);
    row.p99_switch_ms = Percentile(during, 0.99);
    server.Kill();
    row.twice = RunTwice(log);
    unlink(log.c_str());
    Table().push_back(row);

    std::printf(
        "fault %s: issued %lu ok %lu failed %lu (unclear %lu) twice "
        "%lu lost %lu, p99 during switch %.1f ms, fail-back %.2f s, "
        "trigger '%s', calls rdma/grpc/resent %lu/%lu/%lu\n%s\n",
        name.c_str(), row.issued, row.succeeded, row.failed_clear,
        row.failed_unclear, row.twice, row.lost, row.p99_switch_ms,
        row.failback_s, row.trigger.c_str(), row.calls_rdma, row.calls_grpc,
        row.calls_resent, stats.ToString().c_str());
    if (!row.sample_failure.empty()) {
      std::printf("  a failure: %s\n", row.sample_failure.c_str());
    }
    EXPECT_GT(row.succeeded, 0u);
    EXPECT_EQ(row.lost, 0u);
    EXPECT_EQ(row.twice, 0u);
    EXPECT_EQ(row.double_callbacks, 0u);
    EXPECT_EQ(row.corrupt, 0u);
    EXPECT_EQ(row.failed_unclear, 0u) << row.sample_failure;
    if (setting.server_reachable) {
      EXPECT_EQ(row.failed_clear, 0u) << row.sample_failure;
    }
    if (expect_failback) {
      EXPECT_GE(row.failback_s, 0)
          << "no call went over RDMA again within 30 s: " << stats.ToString();
    }
  }

  std::string netdev_;
};

TEST_F(FaultTest, A_DeleteRxeLink) {
  Scenario(
      "(a) delete the rxe link",
      [](Context& c) {
        Shell("rdma link delete rxe0");
        std::this_thread::sleep_for(2s);
        Shell("rdma link add rxe0 type rxe netdev " + c.netdev);
        EXPECT_TRUE(WaitForPortActive(10s));
      },
      Setting::FailsBack());
}

// rxe's connection manager does not survive a netdev flap under a live
// connection: afterwards no rdma_cm connect completes on that device, with
// or without rdmarpc (rping across the flap, then ucmatose, shows the same;
// docs/design.md). So after the link is up again and probes had 3 s to
// fail back, the rxe link is re-created, as an operator would; the row says
// whether fail-back happened before that.
TEST_F(FaultTest, B_NetdevDownThenUp) {
  Scenario(
      "(b) netdev down, then up",
      [](Context& c) {
        Shell("ip link set " + c.netdev + " down");
        std::this_thread::sleep_for(2s);
        Shell("ip link set " + c.netdev + " up");
        EXPECT_TRUE(WaitForPortActive(10s));
        auto until = Clock::now() + 3s;
        while (Clock::now() < until && c.channel->transport_stats().health !=
                                           rdmarpc::RdmaHealth::kReady) {
          std::this_thread::sleep_for(20ms);
        }
        if (c.channel->transport_stats().health ==
            rdmarpc::RdmaHealth::kReady) {
          c.note = "back on RDMA after the link came up";
          return;
        }
        c.note =
            "not back within 3 s of the link coming up (rxe CM stuck); "
            "rxe link re-created";
        Shell("rdma link delete rxe0");
        Shell("rdma link add rxe0 type rxe netdev " + c.netdev);
        EXPECT_TRUE(WaitForPortActive(10s));
      },
      Setting::FailsBack());
}

TEST_F(FaultTest, C_QueuePairError) {
  Scenario(
      "(c) QP forced into error",
      [](Context&) {
        rdmarpc::internal::fault::Arm("rdma.client.qp_error", 1);
        std::this_thread::sleep_for(500ms);
      },
      Setting());
}

TEST_F(FaultTest, D_KillAndRestartServer) {
  Scenario(
      "(d) kill -9 and restart the server",
      [](Context& c) {
        c.server->Kill();
        std::this_thread::sleep_for(1s);
        EXPECT_TRUE(c.server->Start());
      },
      Setting::ServerUnreachable());
}

TEST_F(FaultTest, E_LandingPoolExhausted) {
  Scenario(
      "(e) landing pool exhausted",
      [](Context& c) {
        // A slow call holds 62 of the pool's 64 MiB for two seconds; while
        // it runs, a 4 MiB request of ours cannot land and goes over gRPC.
        // The load keeps to 256 KiB meanwhile (4 threads hold at most 1 MiB
        // of the pool), or its 4 MiB requests would keep the slow call out
        // as often as the machine's speed decides. The slow call may still
        // find one of them in flight: then it went over gRPC and is tried
        // again.
        c.load->CapSize(256 << 10);
        std::vector<uint8_t> hog(62 << 20, 1);
        std::vector<uint8_t> probe(4 << 20, 2);
        bool held = false;
        bool probe_fell_back = false;
        for (int attempt = 0; attempt < 20 && !held; ++attempt) {
          ClientContext ctx;
          EchoRequest req;
          EchoResponse resp;
          req.set_sleep_ms(2000);
          ASSERT_TRUE(ctx.tensors()
                          .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8,
                               {static_cast<int64_t>(hog.size())},
                               TensorBuffer::Borrow(hog.data(), hog.size()))
                          .ok());
          std::promise<rdmarpc::Status> hog_done;
          auto hog_result = hog_done.get_future();
          c.channel->CallAsync(
              kSlow, &ctx, req, &resp,
              [&hog_done](rdmarpc::Status s) { hog_done.set_value(s); });
          bool fell_back = false;
          while (hog_result.wait_for(0s) != std::future_status::ready) {
            ClientContext probe_ctx;
            EchoRequest probe_req;
            EchoResponse probe_resp;
            ASSERT_TRUE(
                probe_ctx.tensors()
                    .Set(probe_req.mutable_tensor(), rdmarpc::DTYPE_U8,
                         {static_cast<int64_t>(probe.size())},
                         TensorBuffer::Borrow(probe.data(), probe.size()))
                    .ok());
            rdmarpc::Status s =
                c.channel->Call(kEcho, &probe_ctx, probe_req, &probe_resp);
            EXPECT_TRUE(s.ok()) << s;
            fell_back = fell_back || probe_ctx.stats().transport ==
                                         rdmarpc::TransportKind::kGrpc;
          }
          rdmarpc::Status s = hog_result.get();
          EXPECT_TRUE(s.ok()) << s;
          held = ctx.stats().transport == rdmarpc::TransportKind::kRdma;
          probe_fell_back = held && fell_back;
        }
        c.load->CapSize(SIZE_MAX);
        EXPECT_TRUE(held) << "the slow call never got the landing pool";
        EXPECT_TRUE(probe_fell_back)
            << "a 4 MiB request did not fall back while the pool was held";
        c.note = "4 MiB requests answered not_executed, re-sent over gRPC";
      },
      Setting());
}

// Row (f)'s path: a veth pair with a soft-RoCE link on each end, the
// server's on lossy_s (198.19.0.1), the client's on lossy_c (198.19.0.2).
// Both addresses are local, which the kernel would route over lo (rxe then
// never sees its own netdev): rules ahead of the local table send this
// host's packets to each address out of the other end of the pair, and
// static neighbours spare the ARP that a local source address would fail.
// gRPC keeps 127.0.0.1, so only RDMA crosses the pair.
constexpr char kLossyServerAddr[] = "198.19.0.1";

// Row (f)'s deadline: the 8 s calls once missed, stretched where the
// sanitizers make everything (gRPC included) several times slower.
#ifdef RDMARPC_SANITIZED
constexpr auto kLossyDeadline = std::chrono::seconds(24);
#else
constexpr auto kLossyDeadline = std::chrono::seconds(8);
#endif
constexpr const char* kLossyDevs[] = {"lossy_s", "lossy_c"};

bool SetUpLossyPath() {
  if (access("/sys/class/net/lossy_s", F_OK) == 0) return true;
  Shell(
      "set -e\n"
      "ip link add lossy_s type veth peer name lossy_c\n"
      "ip addr add 198.19.0.1/24 dev lossy_s\n"
      "ip addr add 198.19.0.2/24 dev lossy_c\n"
      "ip link set lossy_s up\n"
      "ip link set lossy_c up\n"
      "for d in all lossy_s lossy_c; do\n"
      "  sysctl -qw net.ipv4.conf.$d.accept_local=1 "
      "net.ipv4.conf.$d.rp_filter=0\n"
      "done\n"
      "ip neigh replace 198.19.0.1 dev lossy_c nud permanent lladdr "
      "$(cat /sys/class/net/lossy_s/address)\n"
      "ip neigh replace 198.19.0.2 dev lossy_s nud permanent lladdr "
      "$(cat /sys/class/net/lossy_c/address)\n"
      "ip route add 198.19.0.1 dev lossy_c src 198.19.0.2 table 100\n"
      "ip route add 198.19.0.2 dev lossy_s src 198.19.0.1 table 101\n"
      "ip rule add pref 10 to 198.19.0.1 iif lo lookup 100\n"
      "ip rule add pref 11 to 198.19.0.2 iif lo lookup 101\n"
      "ip rule add pref 100 lookup local\n"
      "ip rule del pref 0\n"
      "rdma link add rxe_lossy_s type rxe netdev lossy_s\n"
      "rdma link add rxe_lossy_c type rxe netdev lossy_c\n");
  for (const char* link : {"rxe_lossy_s", "rxe_lossy_c"}) {
    auto until = Clock::now() + 10s;
    std::string state =
        std::string("/sys/class/infiniband/") + link + "/ports/1/state";
    while (ReadFile(state).find("ACTIVE") == std::string::npos) {
      if (Clock::now() > until) return false;
      std::this_thread::sleep_for(50ms);
    }
  }
  return true;
}

// Drops `percent`% of the RoCE packets (UDP 4791) leaving either end of
// the pair; 0 removes the loss.
void SetRdmaLoss(int percent) {
  for (const char* dev : kLossyDevs) {
    std::string d = dev;
    if (percent == 0) {
      Shell("tc qdisc del dev " + d + " root");
      continue;
    }
    Shell("tc qdisc add dev " + d + " root handle 1: prio && " +
          "tc qdisc add dev " + d + " parent 1:3 handle 30: netem loss " +
          std::to_string(percent) + "% && " + "tc filter add dev " + d +
          " parent 1:0 protocol ip u32 match ip protocol 17 0xff "
          "match ip dport 4791 0xffff flowid 1:3");
  }
}

// A path that loses packets but still delivers some must not stall calls:
// those that make no progress are re-sent over gRPC well within their
// 8 s deadline (it was 11.7 s once, with every caller stuck).
TEST_F(FaultTest, F_LossyRdmaPath) {
  if (std::getenv("RDMARPC_RDMA_VM_GUEST") == nullptr) {
    GTEST_SKIP() << "rewires the routing rules of the host: runs only in the "
                    "soft-RoCE VM (tests/rdma_vm/run.sh)";
  }
  ASSERT_TRUE(SetUpLossyPath()) << "the veth pair's rxe links never came up";
  Setting setting = Setting::FailsBack();
  setting.server_rdma_addr = kLossyServerAddr;
  setting.call_timeout = kLossyDeadline;
  Scenario(
      "(f) 30% loss on the RDMA path",
      [](Context& c) {
        uint64_t switches_before = c.channel->transport_stats().switches;
        SetRdmaLoss(30);
        std::this_thread::sleep_for(6s);
        SetRdmaLoss(0);
        // Staying on RDMA meant calls of 7.7 s while gRPC answered at once.
        EXPECT_GT(c.channel->transport_stats().switches, switches_before)
            << "the channel stayed on the lossy path";
        c.note = "calls without progress re-sent over gRPC";
      },
      setting);
}

// librdmacm (rdma-core 44) re-reads the device list only while some device
// exists: were rxe0 the only one, it would never close its handle on the
// deleted link, and rxe (which cannot disassociate a process from a
// device) would make the deletion wait for this process to exit. A spare
// link, unused by the tests, keeps the list non-empty.
class SpareLinkAndTable : public ::testing::Environment {
 public:
  void SetUp() override {
    if (geteuid() != 0 || access("/sys/class/infiniband/rxe0", F_OK) != 0 ||
        access("/sys/class/infiniband/rxe_spare", F_OK) == 0 ||
        std::getenv("RDMARPC_FAULT_NO_SPARE") != nullptr) {
      return;
    }
    Shell(
        "ip link add rxe_spare_nd type dummy && ip link set rxe_spare_nd up "
        "&& rdma link add rxe_spare type rxe netdev rxe_spare_nd");
  }
  // The spare stays: this process holds it open until it exits (rxe again),
  // so deleting it here would wait forever. The VM is thrown away after.
  void TearDown() override { PrintTable(); }

 private:
  void PrintTable() {
    if (Table().empty()) return;
    std::printf(
        "\n| scenario | issued | succeeded | failed (clear status) | run "
        "twice | lost | p50 before (ms) | p99 during switch (ms) | "
        "fail-back (s) | calls rdma / grpc / re-sent | trigger | note |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (const Row& r : Table()) {
      std::string failback =
          r.failback_s < 0 ? "-" : std::to_string(r.failback_s).substr(0, 4);
      std::printf(
          "| %s | %lu | %lu | %lu | %lu | %lu | %.1f | %.1f | %s | "
          "%lu / %lu / %lu | %s | %s |\n",
          r.name.c_str(), r.issued, r.succeeded,
          r.failed_clear + r.failed_unclear, r.twice, r.lost, r.p50_before_ms,
          r.p99_switch_ms, failback.c_str(), r.calls_rdma, r.calls_grpc,
          r.calls_resent, r.trigger.empty() ? "-" : r.trigger.c_str(),
          r.note.empty() ? "-" : r.note.c_str());
    }
    std::fflush(stdout);
  }
};

}  // namespace
}  // namespace rdmarpc_test

int main(int argc, char** argv) {
  if (argc == 5 && std::string(argv[1]) == "--serve") {
    return rdmarpc_test::Serve(std::atoi(argv[2]), argv[3], argv[4]);
  }
  ::testing::InitGoogleTest(&argc, argv);
  ::testing::AddGlobalTestEnvironment(new rdmarpc_test::SpareLinkAndTable());
  return RUN_ALL_TESTS();
}
