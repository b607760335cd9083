// The end-to-end suite over the gRPC transport: forced, and chosen by the
// default 'auto' policy in a build without RDMA.
#include <grpcpp/create_channel.h>
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/health_check_service_interface.h>
#include <grpcpp/security/credentials.h>
#include <netinet/in.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
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
    const std::string target = VacatedTarget();
    ASSERT_FALSE(target.empty());
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

// A listener whose connections the kernel completes but nobody ever
// answers: TCP connects, HTTP/2's handshake never ends.
class SilentListener {
 public:
  SilentListener() {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    if (fd_ < 0 || bind(fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        listen(fd_, 16) != 0 ||
        getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
      return;
    }
    port_ = ntohs(addr.sin_port);
  }
  ~SilentListener() {
    if (fd_ >= 0) close(fd_);
  }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// The channel's gRPC connect attempt ends after
// grpc_connect_attempt_timeout: the call fails UNAVAILABLE then, well
// before its deadline. Under the default (5 s) it would still be waiting
// when the deadline ends it with DEADLINE_EXCEEDED.
TEST(GrpcConnectAttempt, EndsAfterItsTimeout) {
  SilentListener silent;
  ASSERT_NE(silent.port(), 0) << "no listening socket";
  rdmarpc::ChannelOptions options;
  options.policy = rdmarpc::TransportPolicy::kGrpc;
  options.grpc_connect_attempt_timeout = std::chrono::milliseconds(200);
  auto stub = E2E::NewStub(rdmarpc::CreateChannel(
      "127.0.0.1:" + std::to_string(silent.port()), options));
  rdmarpc::ClientContext ctx;
  ctx.set_timeout(std::chrono::seconds(4));
  EchoRequest req;
  EchoResponse resp;
  rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
}

// The names of this process's threads.
std::vector<std::string> ThreadNames() {
  std::vector<std::string> names;
  for (const auto& entry :
       std::filesystem::directory_iterator("/proc/self/task")) {
    std::ifstream comm(entry.path() / "comm");
    std::string name;
    std::getline(comm, name);
    names.push_back(name);
  }
  return names;
}

// The gRPC port runs on one thread by default, and handlers run inline on
// it. A handler that blocks on something only that thread could deliver
// (here: calls into its own server, two calls three deep at once, each
// level waiting for the next) is not fatal: the port's watchdog sees every
// thread held by one event and starts another. The first blocking call
// moved the method to the worker pool (4 threads), so the second pair
// runs there, six handlers waiting at once: the pool starts threads while
// its threads wait in calls.
TEST(GrpcPortThreads, InlineHandlersThatCallTheirOwnServerFinish) {
  SelfCallingService service;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .SetNumWorkers(4)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = E2E::NewStub(rdmarpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port),
      PatientChannelOptions(rdmarpc::TransportPolicy::kGrpc)));
  service.self = stub.get();
  auto call = [&](const std::string& note) {
    return EchoNoteOrError(stub.get(), note);
  };
  for (bool on_workers : {false, true}) {
    SCOPED_TRACE(on_workers ? "on the workers" : "inline");
    if (on_workers) {
      ASSERT_EQ((*server)->handler_stats().moved_to_workers, 1u);
    }
    auto first = std::async(std::launch::async, call, "abc");
    auto second = std::async(std::launch::async, call, "xyz");
    EXPECT_EQ(first.get(), "abc|end");
    EXPECT_EQ(second.get(), "xyz|end");
  }
  // Before the stub goes: a handler still waiting must not call through it.
  (*server)->Shutdown();
}

// SetCallLogWindow: under a second or over a day is refused, naming it.
TEST(CallLogWindow, TheBuilderRefusesAWindowOutsideItsRange) {
  E2EService service;
  int port = 0;
  for (auto window :
       {std::chrono::milliseconds(-5), std::chrono::milliseconds(0),
        std::chrono::milliseconds(999),
        std::chrono::duration_cast<std::chrono::milliseconds>(
            std::chrono::hours(24) + std::chrono::milliseconds(1)),
        std::chrono::milliseconds::max()}) {
    auto refused = rdmarpc::ServerBuilder()
                       .AddListeningPort("127.0.0.1:0", &port)
                       .RegisterService(&service)
                       .SetCallLogWindow(window)
                       .BuildAndStart();
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
        << window.count() << " ms";
    EXPECT_NE(refused.status().message().find("SetCallLogWindow"),
              std::string_view::npos)
        << refused.status();
  }
}

// SetCallLogMaxRecords: under 1024 or over 2^24 is refused, naming it.
TEST(CallLogMaxRecords, TheBuilderRefusesALimitOutsideItsRange) {
  E2EService service;
  int port = 0;
  for (size_t records : {size_t{0}, size_t{1023}, (size_t{1} << 24) + 1}) {
    auto refused = rdmarpc::ServerBuilder()
                       .AddListeningPort("127.0.0.1:0", &port)
                       .RegisterService(&service)
                       .SetCallLogMaxRecords(records)
                       .BuildAndStart();
    EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument)
        << records;
    EXPECT_NE(refused.status().message().find("SetCallLogMaxRecords"),
              std::string_view::npos)
        << refused.status();
  }
  auto taken = rdmarpc::ServerBuilder()
                   .AddListeningPort("127.0.0.1:0", &port)
                   .RegisterService(&service)
                   .SetCallLogMaxRecords(1024)
                   .BuildAndStart();
  ASSERT_TRUE(taken.ok()) << taken.status();
  (*taken)->Shutdown();
}

// SetGrpcThreads: that many threads poll the port; over 64 is refused.
TEST(GrpcPortThreads, TheBuilderSetsHowManyThreadsPollThePort) {
  E2EService service;
  int port = 0;
  auto refused = rdmarpc::ServerBuilder()
                     .AddListeningPort("127.0.0.1:0", &port)
                     .RegisterService(&service)
                     .SetGrpcThreads(65)
                     .BuildAndStart();
  EXPECT_EQ(refused.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("SetGrpcThreads(65)"),
            std::string_view::npos)
      << refused.status();
  for (int threads : {1, 3}) {
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort("127.0.0.1:0", &port)
                      .RegisterService(&service)
                      .SetGrpcThreads(threads)
                      .BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    std::vector<std::string> names = ThreadNames();
    EXPECT_EQ(std::count(names.begin(), names.end(), "rdmarpc-grpc"), threads);
  }
}

// The health service's messages, encoded by hand: HealthCheckRequest{service
// = 1} and HealthCheckResponse{status = 1} (1 SERVING, 2 NOT_SERVING, 3
// SERVICE_UNKNOWN).
grpc::ByteBuffer HealthRequest(const std::string& service) {
  std::string request;
  if (!service.empty()) {
    request.push_back('\x0a');
    request.push_back(static_cast<char>(service.size()));
    request += service;
  }
  grpc::Slice slice(request);
  return grpc::ByteBuffer(&slice, 1);
}

// The status in a HealthCheckResponse: an absent field is 0 (UNKNOWN), else
// 0x08 <varint>; -2 for anything else.
int HealthStatusIn(const grpc::ByteBuffer& response) {
  std::vector<grpc::Slice> slices;
  std::string bytes;
  if (response.Dump(&slices).ok()) {
    for (const auto& s : slices) {
      bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
    }
  }
  if (bytes.empty()) return 0;
  return bytes.size() == 2 && bytes[0] == 0x08 ? bytes[1] : -2;
}

// grpc.health.v1.Health/Check over a plain gRPC channel.
struct HealthAnswer {
  grpc::StatusCode code;
  int status = 0;
};

HealthAnswer CheckHealth(int port, const std::string& service) {
  auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                     grpc::InsecureChannelCredentials());
  grpc::GenericStub stub(channel);
  grpc::ByteBuffer request_buffer = HealthRequest(service);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(30));
  grpc::CompletionQueue cq;
  auto call = stub.PrepareUnaryCall(&ctx, "/grpc.health.v1.Health/Check",
                                    request_buffer, &cq);
  call->StartCall();
  grpc::ByteBuffer response;
  grpc::Status status;
  call->Finish(&response, &status, reinterpret_cast<void*>(1));
  void* tag = nullptr;
  bool ok = false;
  EXPECT_TRUE(cq.Next(&tag, &ok));
  cq.Shutdown();
  while (cq.Next(&tag, &ok)) {
  }
  HealthAnswer answer{status.error_code()};
  if (status.ok()) answer.status = HealthStatusIn(response);
  return answer;
}

// The health service reports the server and each service SERVING, follows
// Server::SetServingStatus, and says NOT_FOUND for a service it lacks.
TEST(HealthService, ReportsEachServiceAndFollowsSetServingStatus) {
  E2EService service;
  int port = 0;
  auto server = StartE2EServer(&service, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string name = "rdmarpc_test.E2E";

  EXPECT_EQ(CheckHealth(port, "").status, 1);
  EXPECT_EQ(CheckHealth(port, name).status, 1);
  EXPECT_EQ(CheckHealth(port, "no.Such").code, grpc::StatusCode::NOT_FOUND);

  ASSERT_TRUE((*server)->SetServingStatus(name, false).ok());
  EXPECT_EQ(CheckHealth(port, name).status, 2);
  ASSERT_TRUE((*server)->SetServingStatus(name, true).ok());
  EXPECT_EQ(CheckHealth(port, name).status, 1);
  // "" drains the whole server.
  ASSERT_TRUE((*server)->SetServingStatus("", false).ok());
  EXPECT_EQ(CheckHealth(port, "").status, 2);
  EXPECT_EQ(CheckHealth(port, name).status, 2);

  rdmarpc::Status unknown = (*server)->SetServingStatus("no.Such", false);
  EXPECT_EQ(unknown.code(), absl::StatusCode::kNotFound) << unknown;
  EXPECT_NE(unknown.message().find("no.Such"), std::string_view::npos)
      << unknown;

  (*server)->Shutdown();
  EXPECT_EQ((*server)->SetServingStatus(name, true).code(),
            absl::StatusCode::kFailedPrecondition);
}

// A grpc.health.v1.Health/Watch stream over a plain gRPC channel, read one
// answer at a time.
class HealthWatch {
 public:
  HealthWatch(int port, const std::string& service)
      : channel_(grpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                                     grpc::InsecureChannelCredentials())),
        stub_(channel_) {
    ctx_.set_deadline(std::chrono::system_clock::now() +
                      std::chrono::seconds(60));
    call_ = stub_.PrepareCall(&ctx_, "/grpc.health.v1.Health/Watch", &cq_);
    call_->StartCall(this);
    EXPECT_TRUE(Wait());
    call_->WriteLast(HealthRequest(service), grpc::WriteOptions(), this);
    EXPECT_TRUE(Wait());
  }
  ~HealthWatch() {
    ctx_.TryCancel();
    if (!finished_) (void)Finish();
    cq_.Shutdown();
    void* tag = nullptr;
    bool ok = false;
    while (cq_.Next(&tag, &ok)) {
    }
  }

  // The next status the server sent (0 UNKNOWN, 1 SERVING, 2 NOT_SERVING,
  // 3 SERVICE_UNKNOWN), or -1 once the stream has ended.
  int Next() {
    grpc::ByteBuffer buffer;
    call_->Read(&buffer, this);
    return Wait() ? HealthStatusIn(buffer) : -1;
  }
  grpc::Status Finish() {
    grpc::Status status;
    call_->Finish(&status, this);
    EXPECT_TRUE(Wait());
    finished_ = true;
    return status;
  }
  void Cancel() { ctx_.TryCancel(); }

 private:
  bool Wait() {
    void* tag = nullptr;
    bool ok = false;
    EXPECT_TRUE(cq_.Next(&tag, &ok));
    return ok;
  }

  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub stub_;
  grpc::ClientContext ctx_;
  grpc::CompletionQueue cq_;
  std::unique_ptr<grpc::GenericClientAsyncReaderWriter> call_;
  bool finished_ = false;
};

// Watch: the status at once, then each change; SERVICE_UNKNOWN for a
// service the server lacks; at shutdown NOT_SERVING and the stream's end,
// so that a shutdown with a long grace period does not wait for watchers.
TEST(HealthService, WatchHearsEachChangeAndTheServersShutdown) {
  E2EService service;
  int port = 0;
  auto server = StartE2EServer(&service, &port);
  ASSERT_TRUE(server.ok()) << server.status();
  const std::string name = "rdmarpc_test.E2E";
  HealthWatch watch(port, name);
  HealthWatch unknown(port, "no.Such");
  HealthWatch whole(port, "");
  EXPECT_EQ(watch.Next(), 1);
  EXPECT_EQ(unknown.Next(), 3);
  EXPECT_EQ(whole.Next(), 1);
  ASSERT_TRUE((*server)->SetServingStatus(name, false).ok());
  EXPECT_EQ(watch.Next(), 2);
  ASSERT_TRUE((*server)->SetServingStatus(name, true).ok());
  EXPECT_EQ(watch.Next(), 1);

  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::hours(1));
  EXPECT_EQ(watch.Next(), 2);
  EXPECT_EQ(watch.Next(), -1);
  EXPECT_EQ(watch.Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_EQ(whole.Next(), 2);
  EXPECT_EQ(whole.Next(), -1);
  EXPECT_EQ(unknown.Next(), 2);  // every watcher hears NOT_SERVING, as in gRPC
  EXPECT_EQ(unknown.Next(), -1);
  EXPECT_EQ(unknown.Finish().error_code(), grpc::StatusCode::UNAVAILABLE);
}

// A watch its client cancels ends on the server: a shutdown with a long
// grace period returns. Health and reflection are answered on the
// transport's own queue: no gRPC callback service runs, so none of gRPC
// 1.51's callback-queue threads ("nexting_thread") poll the port beside
// the transport's threads (each such poller adds futex wake-ups to every
// call).
TEST(HealthService, ACancelledWatchEndsAndNoCallbackThreadsRun) {
  E2EService service;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .EnableReflection(true)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  HealthWatch watch(port, "");
  EXPECT_EQ(watch.Next(), 1);
  for (const std::string& name : ThreadNames()) {
    EXPECT_NE(name, "nexting_thread");
  }
  watch.Cancel();
  EXPECT_EQ(watch.Next(), -1);
  EXPECT_EQ(watch.Finish().error_code(), grpc::StatusCode::CANCELLED);
  (*server)->Shutdown(std::chrono::system_clock::now() + std::chrono::hours(1));
}

TEST(HealthService, OffWhenTheBuilderSaysSo) {
  E2EService service;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .SetHealthService(false)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  EXPECT_EQ(CheckHealth(port, "").code, grpc::StatusCode::UNIMPLEMENTED);
  rdmarpc::Status s = (*server)->SetServingStatus("", false);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
  // A server built afterwards in the same process still gets one. The
  // program's own setting of gRPC's process-wide health switch is left as
  // it was, and a server built while it is on answers with its own health
  // service, which SetServingStatus reaches (gRPC's would take the paths).
  grpc::EnableDefaultHealthCheckService(true);
  E2EService other_service;
  int other_port = 0;
  auto other = StartE2EServer(&other_service, &other_port);
  EXPECT_TRUE(grpc::DefaultHealthCheckServiceEnabled());
  grpc::EnableDefaultHealthCheckService(false);
  ASSERT_TRUE(other.ok()) << other.status();
  EXPECT_EQ(CheckHealth(other_port, "").status, 1);
  ASSERT_TRUE((*other)->SetServingStatus("", false).ok());
  EXPECT_EQ(CheckHealth(other_port, "").status, 2);
}

}  // namespace
}  // namespace rdmarpc_test
