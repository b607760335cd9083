// The end-to-end suite. Written once; each transport instantiates it
// (see e2e_grpc.cc).
#include <condition_variable>
#include <functional>
#include <future>
#include <iostream>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "e2e_fixture.h"
#include "test_pki.h"

namespace rdmarpc_test {
namespace {

using rdmarpc::ClientContext;
using rdmarpc::TensorBuffer;

TEST_P(E2ETest, EveryDTypeRoundTripsByteExact) {
  const rdmarpc::DType dtypes[] = {rdmarpc::DTYPE_F32,  rdmarpc::DTYPE_F16,
                                   rdmarpc::DTYPE_BF16, rdmarpc::DTYPE_F64,
                                   rdmarpc::DTYPE_I8,   rdmarpc::DTYPE_U8,
                                   rdmarpc::DTYPE_I16,  rdmarpc::DTYPE_I32,
                                   rdmarpc::DTYPE_I64,  rdmarpc::DTYPE_BOOL};
  for (rdmarpc::DType dtype : dtypes) {
    SCOPED_TRACE(rdmarpc::DTypeName(dtype));
    const std::vector<int64_t> shape = {3, 5, 7};
    std::vector<uint8_t> bytes =
        Pattern(105 * rdmarpc::DTypeSize(dtype), static_cast<uint32_t>(dtype));
    if (dtype == rdmarpc::DTYPE_BOOL) {
      for (auto& b : bytes) b &= 1;
    }
    ClientContext ctx;
    EchoRequest req;
    ASSERT_TRUE(ctx.tensors()
                    .Set(req.mutable_tensor(), dtype, shape,
                         TensorBuffer::Borrow(bytes.data(), bytes.size()))
                    .ok());
    EchoResponse resp;
    rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    auto out = ctx.tensors().Get(resp.tensor());
    ASSERT_TRUE(out.ok()) << out.status();
    EXPECT_EQ(out->dtype(), dtype);
    EXPECT_EQ(out->shape(), shape);
    ASSERT_EQ(out->size(), bytes.size());
    EXPECT_EQ(0, std::memcmp(out->data(), bytes.data(), bytes.size()));
    EXPECT_EQ(ctx.stats().transport, GetParam().expected);
  }
}

// A request of one small message whose response is large: over gRPC the
// request goes out in the batch that reads the response's first message,
// and the rest of the response is read after it (one chunk, then several).
TEST_P(E2ETest, SmallRequestGetsALargeResponse) {
  for (int64_t size : {int64_t{16 << 10} + 1, int64_t{3 << 20} + 5}) {
    SCOPED_TRACE(size);
    ClientContext ctx;
    ctx.set_timeout(
        std::chrono::seconds(60));  // a missed read fails, not hangs
    EchoRequest req;
    req.set_reply_bytes(size);
    EchoResponse resp;
    rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    auto out = ctx.tensors().Get(resp.tensor());
    ASSERT_TRUE(out.ok()) << out.status();
    const std::vector<uint8_t> expected = Pattern(size, 7);
    ASSERT_EQ(out->size(), expected.size());
    EXPECT_EQ(0, std::memcmp(out->data(), expected.data(), expected.size()));
    EXPECT_EQ(ctx.stats().transport, GetParam().expected);
  }
}

TEST_P(E2ETest, SizesAcrossGrpcAndProtobufLimitsRoundTrip) {
  for (size_t size : {size_t{0}, size_t{1}, size_t{4096}, size_t{5} << 20,
                      size_t{64} << 20}) {
    SCOPED_TRACE(size);
    std::vector<uint8_t> bytes = Pattern(size, static_cast<uint32_t>(size));
    ClientContext ctx;
    EchoRequest req;
    req.set_note("sized");
    ASSERT_TRUE(ctx.tensors()
                    .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8,
                         {static_cast<int64_t>(size)},
                         TensorBuffer::Borrow(bytes.data(), bytes.size()))
                    .ok());
    EchoResponse resp;
    rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
    ASSERT_TRUE(s.ok()) << s;
    EXPECT_EQ(resp.note(), "sized");
    auto out = ctx.tensors().Get(resp.tensor());
    ASSERT_TRUE(out.ok()) << out.status();
    ASSERT_EQ(out->size(), size);
    EXPECT_TRUE(size == 0 || std::memcmp(out->data(), bytes.data(), size) == 0);
    EXPECT_EQ(ctx.stats().tensor_bytes_sent, size);
    EXPECT_EQ(ctx.stats().tensor_bytes_received, size);
    EXPECT_EQ(ctx.stats().transport, GetParam().expected);
    EXPECT_FALSE(ctx.stats().transport_reason.empty());
  }
}

TEST_P(E2ETest, ProtobufStyleInlineTensorIsAccepted) {
  ClientContext ctx;
  EchoRequest req;
  req.mutable_tensor()->set_dtype(rdmarpc::DTYPE_I32);
  req.mutable_tensor()->add_shape(2);
  req.mutable_tensor()->set_data(std::string("\1\0\0\0\2\0\0\0", 8));
  EchoResponse resp;
  rdmarpc::Status echoed = stub_->Echo(&ctx, req, &resp);
  ASSERT_TRUE(echoed.ok()) << echoed;
  auto out = ctx.tensors().Get(resp.tensor());
  ASSERT_TRUE(out.ok()) << out.status();
  ASSERT_EQ(out->size(), 8u);
  EXPECT_EQ(out->host_data<int32_t>()[1], 2);
}

TEST_P(E2ETest, HandlerErrorStatusReachesClient) {
  ClientContext ctx;
  EchoRequest req;
  req.set_fail_code(static_cast<int>(absl::StatusCode::kFailedPrecondition));
  req.set_fail_message("the model is not loaded");
  EchoResponse resp;
  rdmarpc::Status s = stub_->Fail(&ctx, req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ(s.message(), "the model is not loaded");
}

TEST_P(E2ETest, UnknownAndUnimplementedMethodsGiveUnimplemented) {
  EchoRequest req;
  EchoResponse resp;
  ClientContext c1;
  rdmarpc::Status s =
      channel_->Call("/rdmarpc_test.E2E/NoSuchMethod", &c1, req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
  ClientContext c2;
  s = stub_->Missing(&c2, req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnimplemented) << s;
}

TEST_P(E2ETest, DeadlineGivesDeadlineExceeded) {
  ClientContext ctx;
  ctx.set_timeout(std::chrono::milliseconds(300));
  EchoRequest req;
  req.set_sleep_ms(10000);
  EchoResponse resp;
  auto start = std::chrono::steady_clock::now();
  rdmarpc::Status s = stub_->Slow(&ctx, req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kDeadlineExceeded) << s;
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(5));
  // A handler that started learns it too and stops early (under heavy load
  // the call may expire before a worker picks it up; then none started).
  for (int i = 0; i < 500 && service_.slow_saw_cancel.load() !=
                                 service_.slow_started.load();
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(service_.slow_saw_cancel.load(), service_.slow_started.load());
}

TEST_P(E2ETest, HandlerIsNotStartedPastItsDeadline) {
  // Every worker busy: a call with a short deadline queues behind them
  // (Slow is marked blocking, so it runs on the workers).
  constexpr int kWorkers = 8;  // the fixture's SetNumWorkers
  std::vector<std::unique_ptr<ClientContext>> contexts;
  std::vector<EchoRequest> requests(kWorkers);
  std::vector<EchoResponse> responses(kWorkers);
  std::vector<std::promise<rdmarpc::Status>> done(kWorkers);
  for (int i = 0; i < kWorkers; ++i) {
    contexts.push_back(std::make_unique<ClientContext>());
    requests[i].set_sleep_ms(1500);
    stub_->Slow(contexts[i].get(), requests[i], &responses[i],
                [&done, i](rdmarpc::Status s) { done[i].set_value(s); });
  }
  for (int i = 0; i < 6000 && service_.slow_started.load() < kWorkers; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(service_.slow_started.load(), kWorkers);
  ClientContext ctx;
  ctx.set_timeout(std::chrono::milliseconds(100));
  EchoRequest req;  // no sleep: it would end at once if it ran
  EchoResponse resp;
  EXPECT_EQ(stub_->Slow(&ctx, req, &resp).code(),
            absl::StatusCode::kDeadlineExceeded);
  for (auto& d : done) EXPECT_TRUE(d.get_future().get().ok());
  // The queued call reaches a worker once the slow ones end: it must not
  // run (it may also have been cancelled by the client before then).
  auto skipped = [&] {
    rdmarpc::HandlerStats h = server_->handler_stats();
    return h.not_started_past_deadline + h.not_started_cancelled;
  };
  for (int i = 0; i < 1000 && skipped() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(skipped(), 1u);
  EXPECT_EQ(service_.slow_started.load(), kWorkers);
  EXPECT_EQ(server_->handler_stats().started, uint64_t{kWorkers});
}

TEST_P(E2ETest, ClientCancellationGivesCancelledOnce) {
  ClientContext ctx;
  EchoRequest req;
  req.set_sleep_ms(10000);
  EchoResponse resp;
  std::atomic<int> callbacks{0};
  std::promise<rdmarpc::Status> result;
  stub_->Slow(&ctx, req, &resp, [&](rdmarpc::Status s) {
    if (callbacks.fetch_add(1) == 0) result.set_value(s);
  });
  for (int i = 0; i < 500 && service_.slow_started.load() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ctx.TryCancel();
  auto future = result.get_future();
  ASSERT_EQ(future.wait_for(std::chrono::seconds(10)),
            std::future_status::ready);
  EXPECT_EQ(future.get().code(), absl::StatusCode::kCancelled);
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  EXPECT_EQ(callbacks.load(), 1);
}

// Cancelling one of two calls in flight on the same connection ends that
// call only (over RDMA the connection's one canceller serves both).
TEST_P(E2ETest, CancellingOneCallLeavesItsNeighbourRunning) {
  ClientContext kept_ctx, cancelled_ctx;
  EchoRequest kept_req, cancelled_req;
  kept_req.set_sleep_ms(1500);
  cancelled_req.set_sleep_ms(20000);
  EchoResponse kept_resp, cancelled_resp;
  std::promise<rdmarpc::Status> kept, cancelled;
  stub_->Slow(&kept_ctx, kept_req, &kept_resp,
              [&](rdmarpc::Status s) { kept.set_value(s); });
  stub_->Slow(&cancelled_ctx, cancelled_req, &cancelled_resp,
              [&](rdmarpc::Status s) { cancelled.set_value(s); });
  for (int i = 0; i < 6000 && service_.slow_started.load() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(service_.slow_started.load(), 2);
  cancelled_ctx.TryCancel();
  EXPECT_EQ(cancelled.get_future().get().code(), absl::StatusCode::kCancelled);
  rdmarpc::Status kept_status = kept.get_future().get();
  EXPECT_TRUE(kept_status.ok()) << kept_status;
  EXPECT_EQ(kept_resp.note(), "slept");
  EXPECT_EQ(kept_ctx.stats().transport, GetParam().expected);
  EXPECT_EQ(cancelled_ctx.stats().transport, GetParam().expected);
}

// A blocking call is driven on its caller's thread (over gRPC through a
// completion queue of its own): cancelling it from another thread ends it.
TEST_P(E2ETest, BlockingCallCancelledFromAnotherThreadGivesCancelled) {
  ClientContext ctx;
  EchoRequest req;
  req.set_sleep_ms(10000);
  EchoResponse resp;
  // Cancels once the handler runs (a loaded machine may take seconds to
  // connect and deliver the call; 60 s bound a hang).
  std::thread canceller([&] {
    for (int i = 0; i < 6000 && service_.slow_started.load() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ctx.TryCancel();
  });
  rdmarpc::Status status = stub_->Slow(&ctx, req, &resp);
  canceller.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  EXPECT_EQ(service_.slow_started.load(), 1);
}

// With handlers inline, a method marked blocking runs on the worker pool:
// a slow one is no stall there, while unmarked it is counted as one, and
// after 8 stalls (in more than 1 of 16 calls) it moves to the workers.
TEST_P(E2ETest, InlineServerRunsMethodsMarkedBlockingOnItsWorkers) {
  constexpr uint64_t kStallsToMove = 8;  // server.cc
  for (bool marked : {true, false}) {
    E2EService service;
    int port = 0;
    rdmarpc::ServerBuilder builder;
    builder.AddListeningPort("127.0.0.1:0", &port)
        .RegisterService(&service)
        .SetRunHandlersInline(true);
    if (marked) builder.SetMethodBlocking("/rdmarpc_test.E2E/Slow");
    auto server = builder.BuildAndStart();
    ASSERT_TRUE(server.ok()) << server.status();
    rdmarpc::ChannelOptions options = PatientChannelOptions(GetParam().policy);
    auto stub = E2E::NewStub(
        rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port), options));
    EchoRequest req;
    req.set_sleep_ms(20);
    EchoResponse resp;
    for (uint64_t i = 1; i <= kStallsToMove + 1; ++i) {
      ClientContext ctx;
      ASSERT_TRUE(stub->Slow(&ctx, req, &resp).ok());
      EXPECT_EQ(ctx.stats().transport, GetParam().expected);
      rdmarpc::HandlerStats stats = (*server)->handler_stats();
      EXPECT_EQ(stats.started, i);
      // Unmarked: one stall per call until the method moved.
      EXPECT_EQ(stats.inline_stalls, marked ? 0 : std::min(i, kStallsToMove))
          << "marked: " << marked << ", call " << i;
      EXPECT_EQ(stats.moved_to_workers, !marked && i >= kStallsToMove ? 1u : 0u)
          << "marked: " << marked << ", call " << i;
    }
  }
}

// Serves `service` with the builder's defaults (handlers inline) and makes
// a stub on a channel with `policy` to it.
void ServeWithDefaults(rdmarpc::Service* service,
                       rdmarpc::TransportPolicy policy,
                       std::unique_ptr<rdmarpc::Server>* server,
                       std::unique_ptr<E2E::Stub>* stub) {
  int port = 0;
  auto started = rdmarpc::ServerBuilder()
                     .AddListeningPort("127.0.0.1:0", &port)
                     .RegisterService(service)
                     .BuildAndStart();
  ASSERT_TRUE(started.ok()) << started.status();
  *server = std::move(*started);
  *stub = E2E::NewStub(rdmarpc::CreateChannel(
      "127.0.0.1:" + std::to_string(port), PatientChannelOptions(policy)));
}

// Handlers run inline by default. One that blocks until its own call is
// cancelled still sees the cancel: over RDMA the watchdog hands the engine
// (which delivers the cancel) to another thread.
TEST_P(E2ETest, InlineHandlerWaitingForItsCancelSeesIt) {
  E2EService service;
  std::unique_ptr<rdmarpc::Server> server;
  std::unique_ptr<E2E::Stub> stub;
  ASSERT_NO_FATAL_FAILURE(
      ServeWithDefaults(&service, GetParam().policy, &server, &stub));
  EchoRequest req;
  EchoResponse resp;
  ClientContext warm;  // the connection is up before the slow call
  ASSERT_TRUE(stub->Echo(&warm, req, &resp).ok());
  EXPECT_EQ(warm.stats().transport, GetParam().expected);

  const uint64_t stalls_before = server->handler_stats().inline_stalls;
  // Over gRPC: the port's watchdog stops looking after two looks (100 ms
  // apart) that saw no event; the event that blocks must wake it.
  std::this_thread::sleep_for(std::chrono::milliseconds(300));

  ClientContext ctx;
  req.set_sleep_ms(120000);
  std::thread canceller([&] {
    for (int i = 0; i < 6000 && service.slow_started.load() == 0; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    // The handler then holds its thread past the 1 ms stall line.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    ctx.TryCancel();
  });
  rdmarpc::Status status = stub->Slow(&ctx, req, &resp);
  canceller.join();
  EXPECT_EQ(status.code(), absl::StatusCode::kCancelled) << status;
  // A cancelled call ends on the client at once; the server counts the
  // stall only when the handler returns, after it saw the cancel.
  for (int i = 0;
       i < 6000 && server->handler_stats().inline_stalls == stalls_before;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(service.slow_saw_cancel.load(), 1);
  EXPECT_GT(server->handler_stats().inline_stalls, stalls_before);
  // The server goes on serving calls inline.
  ClientContext after;
  req.set_sleep_ms(0);
  EXPECT_TRUE(stub->Echo(&after, req, &resp).ok());
}

// A "Quit" method: a handler that shuts its own server down. Shutdown
// cannot wait for the handler's own call there, so it returns at once and
// finishes on a thread of its own; with a grace period the call itself
// still ends OK. Handlers inline (the default) and on the workers.
TEST_P(E2ETest, AHandlerMayShutItsOwnServerDown) {
  class Quitting final : public E2E::Service {
   public:
    rdmarpc::Status Echo(rdmarpc::ServerContext*, const EchoRequest& req,
                         EchoResponse* resp) override {
      if (req.note() == "quit") {
        server->Shutdown(std::chrono::system_clock::now() +
                         std::chrono::seconds(60));
        shutdown_returned.store(true);
      }
      resp->set_note(req.note());
      return absl::OkStatus();
    }
    rdmarpc::Server* server = nullptr;
    std::atomic<bool> shutdown_returned{false};
  };
  for (bool inline_handlers : {true, false}) {
    SCOPED_TRACE(inline_handlers ? "inline handlers" : "worker pool");
    Quitting service;
    int port = 0;
    auto started = rdmarpc::ServerBuilder()
                       .AddListeningPort("127.0.0.1:0", &port)
                       .RegisterService(&service)
                       .SetRunHandlersInline(inline_handlers)
                       .BuildAndStart();
    ASSERT_TRUE(started.ok()) << started.status();
    std::unique_ptr<rdmarpc::Server> server = std::move(*started);
    service.server = server.get();
    auto stub = E2E::NewStub(
        rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                               PatientChannelOptions(GetParam().policy)));
    EchoRequest req;
    EchoResponse resp;
    ClientContext warm;
    ASSERT_TRUE(stub->Echo(&warm, req, &resp).ok());
    EXPECT_EQ(warm.stats().transport, GetParam().expected);

    ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() +
                     std::chrono::seconds(60));
    req.set_note("quit");
    rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
    EXPECT_TRUE(s.ok()) << s;
    EXPECT_EQ(ctx.stats().transport, GetParam().expected);
    EXPECT_EQ(resp.note(), "quit");
    EXPECT_TRUE(service.shutdown_returned.load());
    server->Wait();  // returns: the shutdown finished on its own thread
    ClientContext after;
    after.set_deadline(std::chrono::system_clock::now() +
                       std::chrono::seconds(10));
    req.set_note("after");
    EXPECT_FALSE(stub->Echo(&after, req, &resp).ok());
    server.reset();  // joins the shutdown's thread
  }
}

// The stats may be read while the server shuts down (from another
// thread), and afterwards they say what the server did.
TEST_P(E2ETest, StatsStayReadableThroughShutdown) {
  int port = 0;
  E2EService service;
  auto started = rdmarpc::ServerBuilder()
                     .AddListeningPort("127.0.0.1:0", &port)
                     .RegisterService(&service)
                     .BuildAndStart();
  ASSERT_TRUE(started.ok()) << started.status();
  std::unique_ptr<rdmarpc::Server> server = std::move(*started);
  auto stub = E2E::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                             PatientChannelOptions(GetParam().policy)));
  constexpr int kCalls = 3;
  for (int i = 0; i < kCalls; ++i) {
    ClientContext ctx;
    EchoRequest req;
    EchoResponse resp;
    ASSERT_TRUE(stub->Echo(&ctx, req, &resp).ok());
    EXPECT_EQ(ctx.stats().transport, GetParam().expected);
  }
  const uint64_t handled = server->handler_stats().started;
  EXPECT_GE(handled, uint64_t{kCalls});
  std::atomic<bool> stop{false};
  std::atomic<int> reads{0};
  std::thread reader([&] {
    while (!stop.load()) {
      (void)server->handler_stats();
      (void)server->call_log_stats();
      reads.fetch_add(1);
    }
  });
  while (reads.load() == 0) std::this_thread::yield();
  server->Shutdown();
  stop.store(true);
  reader.join();
  EXPECT_EQ(server->handler_stats().started, handled);
}

// A handler run inline may make a blocking call (here to the fixture's
// server), through the blocking stub or a future it waits for: over RDMA
// the engine goes on on another thread meanwhile, and on every transport
// the method runs on the workers from then on.
TEST_P(E2ETest, InlineHandlerMayMakeABlockingCall) {
  class Forwarding final : public E2E::Service {
   public:
    Forwarding(E2E::Stub* next, bool by_future)
        : next_(next), by_future_(by_future) {}
    rdmarpc::Status Echo(rdmarpc::ServerContext*, const EchoRequest& req,
                         EchoResponse* resp) override {
      ClientContext ctx;
      rdmarpc::Status s = by_future_ ? next_->EchoFuture(&ctx, req, resp).get()
                                     : next_->Echo(&ctx, req, resp);
      resp->set_note(resp->note() + "|via " +
                     rdmarpc::TransportName(ctx.stats().transport));
      return s;
    }

   private:
    E2E::Stub* next_;
    bool by_future_;
  };
  for (bool by_future : {false, true}) {
    SCOPED_TRACE(by_future ? "future" : "blocking stub");
    Forwarding forwarding(stub_.get(), by_future);
    std::unique_ptr<rdmarpc::Server> server;
    std::unique_ptr<E2E::Stub> stub;
    ASSERT_NO_FATAL_FAILURE(
        ServeWithDefaults(&forwarding, GetParam().policy, &server, &stub));
    for (int i = 0; i < 3; ++i) {
      ClientContext ctx;
      EchoRequest req;
      req.set_note("n" + std::to_string(i));
      EchoResponse resp;
      rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
      ASSERT_TRUE(s.ok()) << s;
      EXPECT_EQ(ctx.stats().transport, GetParam().expected);
      EXPECT_EQ(resp.note(),
                req.note() + "|via " +
                    std::string(rdmarpc::TransportName(GetParam().expected)));
    }
    // The first call blocked in its handler, which moved the method to the
    // workers at once (over RDMA it also handed the engine on; the
    // watchdog's hand-off, 10-20 ms later, would not have moved it).
    EXPECT_EQ(server->handler_stats().moved_to_workers, 1u);
  }
}

// Handlers on the workers that call their own server: two chains three
// deep, six handlers waiting at once on two workers. The pool starts
// threads while its threads wait in those calls; with a fixed pool the
// deepest calls would wait for a worker until their deadlines.
TEST_P(E2ETest, WorkerHandlersMayCallTheirOwnServerBeyondThePoolSize) {
  SelfCallingService service;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .SetRunHandlersInline(false)
                    .SetNumWorkers(2)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  auto stub = E2E::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port),
                             PatientChannelOptions(GetParam().policy)));
  service.self = stub.get();
  auto call = [&](const std::string& note) {
    return EchoNoteOrError(stub.get(), note);
  };
  auto first = std::async(std::launch::async, call, "abc");
  auto second = std::async(std::launch::async, call, "xyz");
  EXPECT_EQ(first.get(), "abc|end");
  EXPECT_EQ(second.get(), "xyz|end");
  (*server)->Shutdown();
}

TEST_P(E2ETest, MarkingAnUnknownMethodBlockingIsRefused) {
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service_)
                    .SetMethodBlocking("/rdmarpc_test.E2E/NoSuch")
                    .BuildAndStart();
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("NoSuch"), std::string::npos)
      << server.status();
}

TEST_P(E2ETest, CancelBeforeStartFailsWithoutSending) {
  ClientContext ctx;
  ctx.TryCancel();
  EchoRequest req;
  EchoResponse resp;
  EXPECT_EQ(stub_->Echo(&ctx, req, &resp).code(), absl::StatusCode::kCancelled);
  EXPECT_EQ(service_.echo_calls.load(), 0);
}

TEST_P(E2ETest, ReusedContextIsRejected) {
  ClientContext ctx;
  EchoRequest req;
  EchoResponse resp;
  rdmarpc::Status first = stub_->Echo(&ctx, req, &resp);
  ASSERT_TRUE(first.ok()) << first;
  EXPECT_EQ(stub_->Echo(&ctx, req, &resp).code(),
            absl::StatusCode::kFailedPrecondition);
}

TEST_P(E2ETest, ServerShutdownWithCallsInFlightRunsEveryCallbackOnce) {
  constexpr int kCalls = 8;
  struct Call {
    ClientContext ctx;
    EchoRequest req;
    EchoResponse resp;
    std::atomic<int> callbacks{0};
    rdmarpc::Status status;
  };
  std::vector<std::unique_ptr<Call>> calls;
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  for (int i = 0; i < kCalls; ++i) {
    auto c = std::make_unique<Call>();
    c->req.set_sleep_ms(30000);
    Call* raw = c.get();
    stub_->Slow(&raw->ctx, raw->req, &raw->resp, [&, raw](rdmarpc::Status s) {
      raw->status = s;
      raw->callbacks.fetch_add(1);
      std::lock_guard<std::mutex> lock(mu);
      ++done;
      cv.notify_all();
    });
    calls.push_back(std::move(c));
  }
  for (int i = 0; i < 6000 && service_.slow_started.load() < kCalls; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  server_->Shutdown(std::chrono::system_clock::now() +
                    std::chrono::milliseconds(100));
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20),
                            [&] { return done == kCalls; }));
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  for (const auto& c : calls) {
    EXPECT_EQ(c->callbacks.load(), 1);
    EXPECT_FALSE(c->status.ok());
  }
  // A call after shutdown fails cleanly too.
  ClientContext ctx;
  ctx.set_timeout(std::chrono::seconds(2));
  EchoRequest req;
  EchoResponse resp;
  EXPECT_FALSE(stub_->Echo(&ctx, req, &resp).ok());
}

TEST_P(E2ETest, SixtyFourConcurrentCallers) {
  constexpr int kThreads = 64;
  constexpr int kCallsEach = 10;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kCallsEach; ++i) {
        std::vector<uint8_t> bytes = Pattern(1000 + t * 37 + i, t * 100 + i);
        ClientContext ctx;
        EchoRequest req;
        req.set_note(std::to_string(t));
        if (!ctx.tensors()
                 .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8,
                      {static_cast<int64_t>(bytes.size())},
                      TensorBuffer::Borrow(bytes.data(), bytes.size()))
                 .ok()) {
          continue;
        }
        EchoResponse resp;
        if (!stub_->Echo(&ctx, req, &resp).ok()) continue;
        auto out = ctx.tensors().Get(resp.tensor());
        if (out.ok() && resp.note() == std::to_string(t) &&
            out->size() == bytes.size() &&
            std::memcmp(out->data(), bytes.data(), bytes.size()) == 0) {
          ++ok;
        }
      }
    });
  }
  for (auto& t : threads) t.join();
  EXPECT_EQ(ok.load(), kThreads * kCallsEach);
}

// The client drops its channel the moment the last of many concurrent
// calls completes, while the server may still be finishing those calls:
// the server must not touch a call it has let go. Each round keeps 64
// calls in flight for 2 s (each completion issues the next), then drops
// the channel as the last one completes. Before the fix (the gRPC server
// unlocked a reactor's mutex after handing the reactor to OnDone), about
// one run in eight crashed here.
TEST_P(E2ETest, ChannelDroppedAsSoonAsManyConcurrentCallsComplete) {
  constexpr int kRounds = 2;
  constexpr int kInFlight = 64;
  for (int round = 0; round < kRounds; ++round) {
    rdmarpc::ChannelOptions options = PatientChannelOptions(GetParam().policy);
    auto stub = E2E::NewStub(
        rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port_), options));
    struct Loop {
      std::mutex mu;
      std::condition_variable cv;
      int running = 0;
      int failed = 0;
    };
    auto loop = std::make_shared<Loop>();
    auto until =
        std::chrono::steady_clock::now() + std::chrono::milliseconds(2000);
    std::function<void()> issue = [&, loop] {
      {
        std::lock_guard<std::mutex> lock(loop->mu);
        ++loop->running;
      }
      auto ctx = std::make_shared<ClientContext>();
      auto req = std::make_shared<EchoRequest>();
      auto resp = std::make_shared<EchoResponse>();
      req->set_note("x");  // a reply without a tensor: one message back
      stub->Echo(ctx.get(), *req, resp.get(),
                 [&, loop, ctx, req, resp](rdmarpc::Status s) {
                   if (std::chrono::steady_clock::now() < until) issue();
                   std::lock_guard<std::mutex> lock(loop->mu);
                   if (!s.ok()) ++loop->failed;
                   if (--loop->running == 0) loop->cv.notify_all();
                 });
    };
    for (int i = 0; i < kInFlight; ++i) issue();
    std::unique_lock<std::mutex> lock(loop->mu);
    loop->cv.wait(lock, [&] { return loop->running == 0; });
    EXPECT_EQ(loop->failed, 0);
    lock.unlock();
    stub.reset();  // the channel goes with its stub, at once
  }
  // The server still serves.
  ClientContext ctx;
  EchoRequest req;
  req.set_note("after");
  EchoResponse resp;
  rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.note(), "after");
}

TEST_P(E2ETest, CallbackAndFutureFormsComplete) {
  std::vector<uint8_t> bytes = Pattern(4096, 7);
  ClientContext c1;
  EchoRequest req;
  ASSERT_TRUE(c1.tensors()
                  .Set(req.mutable_tensor(), rdmarpc::DTYPE_U8, {4096},
                       TensorBuffer::Borrow(bytes.data(), bytes.size()))
                  .ok());
  EchoResponse r1;
  std::promise<rdmarpc::Status> p;
  stub_->Echo(&c1, req, &r1, [&](rdmarpc::Status s) { p.set_value(s); });
  ASSERT_TRUE(p.get_future().get().ok());
  EXPECT_EQ(c1.tensors().Get(r1.tensor())->size(), 4096u);

  ClientContext c2;
  EchoRequest req2;
  ASSERT_TRUE(c2.tensors()
                  .Set(req2.mutable_tensor(), rdmarpc::DTYPE_U8, {4096},
                       TensorBuffer::Borrow(bytes.data(), bytes.size()))
                  .ok());
  EchoResponse r2;
  std::future<rdmarpc::Status> f = stub_->EchoFuture(&c2, req2, &r2);
  ASSERT_TRUE(f.get().ok());
  auto out = c2.tensors().Get(r2.tensor());
  ASSERT_TRUE(out.ok());
  EXPECT_EQ(0, std::memcmp(out->data(), bytes.data(), bytes.size()));
}

TEST_P(E2ETest, MetadataReachesHandler) {
  ClientContext ctx;
  ctx.AddMetadata("x-echo", "from-client");
  EchoRequest req;
  req.set_note("n");
  EchoResponse resp;
  rdmarpc::Status echoed = stub_->Echo(&ctx, req, &resp);
  ASSERT_TRUE(echoed.ok()) << echoed;
  EXPECT_EQ(resp.note(), "n|from-client");
}

TEST_P(E2ETest, ServerMetadataReachesTheClient) {
  ClientContext ctx;
  ctx.AddMetadata("x-send-initial", "x-served-by=replica-3");
  ctx.AddMetadata("x-send-trailing", "x-cost=17");
  ctx.AddMetadata("x-send-trailing", "x-cost=18");
  const std::string binary("\0\x01\xfe\n=", 5);
  ctx.AddMetadata("x-send-trailing-bin", "x-digest-bin=" + binary);
  EchoRequest req;
  req.set_note("n");
  EchoResponse resp;
  rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
  ASSERT_TRUE(s.ok()) << s;
  EXPECT_EQ(resp.note(), "n");  // no refusal
  EXPECT_EQ(ctx.stats().transport, GetParam().expected);
  using Map = std::multimap<std::string, std::string>;
  EXPECT_EQ(ctx.GetServerInitialMetadata(),
            (Map{{"x-served-by", "replica-3"}}));
  EXPECT_EQ(
      ctx.GetServerTrailingMetadata(),
      (Map{{"x-cost", "17"}, {"x-cost", "18"}, {"x-digest-bin", binary}}));
}

TEST_P(E2ETest, AnErrorCarriesTheHandlersMetadata) {
  ClientContext ctx;
  ctx.AddMetadata("x-send-trailing", "x-retry-after-ms=250");
  EchoRequest req;
  req.set_fail_code(static_cast<int>(absl::StatusCode::kUnavailable));
  req.set_fail_message("overloaded");
  EchoResponse resp;
  rdmarpc::Status s = stub_->Fail(&ctx, req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable) << s;
  EXPECT_EQ(
      ctx.GetServerTrailingMetadata(),
      (std::multimap<std::string, std::string>{{"x-retry-after-ms", "250"}}));
  EXPECT_TRUE(ctx.GetServerInitialMetadata().empty());
}

// Metadata up to the limits both ways, with an error message as long as
// the RDMA wire takes: it all arrives (the message may be cut, never the
// call).
TEST_P(E2ETest, MetadataAtTheLimitsArrivesWithALongError) {
  ClientContext ctx;
  const std::string value(1000, 'v');
  for (int i = 0; i < 15; ++i) {
    ctx.AddMetadata("x-send-trailing", "k" + std::to_string(i) + "=" + value);
  }
  EchoRequest req;
  req.set_fail_code(static_cast<int>(absl::StatusCode::kUnavailable));
  req.set_fail_message("overloaded" + std::string(16000, '.'));
  EchoResponse resp;
  rdmarpc::Status s = stub_->Fail(&ctx, req, &resp);
  EXPECT_EQ(s.code(), absl::StatusCode::kUnavailable)
      << s.message().substr(0, 300);
  EXPECT_EQ(s.message().substr(0, 10), "overloaded")
      << s.message().substr(0, 200);
  ASSERT_EQ(ctx.GetServerTrailingMetadata().size(), 15u);
  for (const auto& [k, v] : ctx.GetServerTrailingMetadata()) {
    EXPECT_EQ(v, value) << k;
  }
}

TEST_P(E2ETest, MetadataTheRulesRefuseIsNamed) {
  // On the client: the call fails before it is sent, naming the entry.
  struct Bad {
    std::string key, value;
    absl::StatusCode code;
    std::string says;
  };
  const std::vector<Bad> bad = {
      {"X-Upper", "v", absl::StatusCode::kInvalidArgument, "X-Upper"},
      {"grpc-timeout", "1S", absl::StatusCode::kInvalidArgument, "reserved"},
      {"x-text", "line\nbreak", absl::StatusCode::kInvalidArgument, "-bin"},
      {"x-big", std::string(17 << 10, 'a'),
       absl::StatusCode::kResourceExhausted, "16384"},
  };
  for (const Bad& b : bad) {
    ClientContext ctx;
    ctx.AddMetadata(b.key, b.value);
    EchoRequest req;
    EchoResponse resp;
    rdmarpc::Status s = stub_->Echo(&ctx, req, &resp);
    EXPECT_EQ(s.code(), b.code) << b.key << ": " << s;
    EXPECT_NE(s.message().find(b.says), std::string_view::npos) << s;
  }
  EXPECT_EQ(service_.echo_calls.load(), 0);
  // On the server: the handler is told, and the entry is not sent.
  ClientContext ctx;
  ctx.AddMetadata("x-send-trailing", "Bad Key=v");
  ctx.AddMetadata("x-send-initial", "rdmarpc-mine=v");
  EchoRequest req;
  EchoResponse resp;
  rdmarpc::Status echoed = stub_->Echo(&ctx, req, &resp);
  ASSERT_TRUE(echoed.ok()) << echoed;
  EXPECT_NE(resp.note().find("trailing Bad Key: INVALID_ARGUMENT"),
            std::string::npos)
      << resp.note();
  EXPECT_NE(resp.note().find("initial rdmarpc-mine: INVALID_ARGUMENT"),
            std::string::npos)
      << resp.note();
  EXPECT_TRUE(ctx.GetServerTrailingMetadata().empty());
  EXPECT_TRUE(ctx.GetServerInitialMetadata().empty());
}

TEST_P(E2ETest, BadTensorDescriptionIsRejectedBeforeSending) {
  ClientContext ctx;
  EchoRequest req;
  std::vector<uint8_t> bytes(10);
  rdmarpc::Status s =
      ctx.tensors().Set(req.mutable_tensor(), rdmarpc::DTYPE_F32, {3},
                        TensorBuffer::Borrow(bytes.data(), bytes.size()));
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  // A field changed after Set() fails the call, not the process.
  ClientContext ctx2;
  EchoRequest req2;
  ASSERT_TRUE(ctx2.tensors()
                  .Set(req2.mutable_tensor(), rdmarpc::DTYPE_U8, {10},
                       TensorBuffer::Borrow(bytes.data(), bytes.size()))
                  .ok());
  req2.mutable_tensor()->add_shape(2);
  EchoResponse resp;
  EXPECT_EQ(stub_->Echo(&ctx2, req2, &resp).code(),
            absl::StatusCode::kInvalidArgument);
}

TEST_P(E2ETest, MalformedListeningAddressIsRefusedWithTheReason) {
  const std::pair<const char*, const char*> cases[] = {
      {"nohost", "no port"},
      {":notaport", "no host"},
      {"", "empty"},
      {"127.0.0.1:99999", "out of range"},
      {"::1:5000", "brackets"},
  };
  for (const auto& [address, reason] : cases) {
    E2EService service;
    auto server = rdmarpc::ServerBuilder()
                      .AddListeningPort(address)
                      .RegisterService(&service)
                      .BuildAndStart();
    ASSERT_FALSE(server.ok()) << address;
    EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument)
        << server.status();
    EXPECT_NE(server.status().message().find(reason), std::string::npos)
        << server.status();
  }
}

TEST_P(E2ETest, MalformedTargetFailsEachCallWithTheReason) {
  const std::pair<const char*, const char*> cases[] = {
      {"", "empty"},
      {"127.0.0.1:99999", "out of range"},
      {"127.0.0.1:0", "out of range"},
      {"nohost", "no port"},
  };
  for (const auto& [target, reason] : cases) {
    auto stub = E2E::NewStub(rdmarpc::CreateChannel(target));
    ClientContext ctx;
    EchoRequest req;
    EchoResponse resp;
    rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << target << s;
    EXPECT_NE(s.message().find(reason), std::string::npos) << s;
  }
}

// SO_REUSEPORT is off unless asked for: a second server on a port in use
// fails instead of silently taking half its connections.
TEST_P(E2ETest, PortInUseIsRefusedUnlessReuseIsAskedFor) {
  E2EService service;
  auto second = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:" + std::to_string(port_))
                    .RegisterService(&service)
                    .EnableRdma(false)
                    .BuildAndStart();
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), absl::StatusCode::kUnavailable);
  EXPECT_NE(second.status().message().find("in use"), std::string::npos)
      << second.status();
  EXPECT_NE(second.status().message().find("SetPortReuse"), std::string::npos)
      << second.status();
  // Two servers that both ask for it share a port.
  int shared = 0;
  auto first = rdmarpc::ServerBuilder()
                   .AddListeningPort("127.0.0.1:0", &shared)
                   .RegisterService(&service)
                   .EnableRdma(false)
                   .SetPortReuse(true)
                   .BuildAndStart();
  ASSERT_TRUE(first.ok()) << first.status();
  E2EService other;
  auto sharing = rdmarpc::ServerBuilder()
                     .AddListeningPort("127.0.0.1:" + std::to_string(shared))
                     .RegisterService(&other)
                     .EnableRdma(false)
                     .SetPortReuse(true)
                     .BuildAndStart();
  EXPECT_TRUE(sharing.ok()) << sharing.status();
}

// A connection with SetMaxCallsPerConnection calls running gets
// RESOURCE_EXHAUSTED naming the limit for one more; once they end, calls go
// through again.
TEST_P(E2ETest, CallsOverTheConnectionLimitFailNamingIt) {
  E2EService service;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .SetNumWorkers(8)
                    .SetMethodBlocking("/rdmarpc_test.E2E/Slow")
                    .SetMaxCallsPerConnection(2)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  rdmarpc::ChannelOptions options = PatientChannelOptions(GetParam().policy);
  auto stub = E2E::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port), options));
  EchoRequest req;
  EchoResponse resp;
  {
    ClientContext warm;  // the connection is up before the count starts
    ASSERT_TRUE(stub->Echo(&warm, req, &resp).ok());
    EXPECT_EQ(warm.stats().transport, GetParam().expected);
  }

  ClientContext slow_ctx[2];
  EchoRequest slow_req;
  slow_req.set_sleep_ms(60000);
  EchoResponse slow_resp[2];
  std::promise<rdmarpc::Status> slow_done[2];
  for (int i = 0; i < 2; ++i) {
    stub->Slow(
        &slow_ctx[i], slow_req, &slow_resp[i],
        [&slow_done, i](rdmarpc::Status s) { slow_done[i].set_value(s); });
  }
  for (int i = 0; i < 6000 && service.slow_started.load() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(service.slow_started.load(), 2);

  ClientContext over;
  rdmarpc::Status refused = stub->Echo(&over, req, &resp);
  EXPECT_EQ(refused.code(), absl::StatusCode::kResourceExhausted) << refused;
  EXPECT_NE(refused.message().find("at most 2 calls at once per connection"),
            std::string_view::npos)
      << refused;
  EXPECT_NE(refused.message().find("SetMaxCallsPerConnection"),
            std::string_view::npos)
      << refused;
  EXPECT_EQ((*server)->handler_stats().over_connection_limit, 1u);
  EXPECT_EQ(service.echo_calls.load(), 1);  // the warm-up only

  for (auto& ctx : slow_ctx) ctx.TryCancel();
  for (auto& done : slow_done) {
    EXPECT_EQ(done.get_future().get().code(), absl::StatusCode::kCancelled);
  }
  // The cancelled handlers return within a poll of IsCancelled (2 ms); the
  // count drops when they do.
  rdmarpc::Status again;
  for (int i = 0; i < 500; ++i) {
    ClientContext ctx;
    again = stub->Echo(&ctx, req, &resp);
    if (again.code() != absl::StatusCode::kResourceExhausted) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_TRUE(again.ok()) << again;
}

// One Echo on a new channel to `port` with `tls`; its status and transport.
std::pair<rdmarpc::Status, rdmarpc::TransportKind> EchoOverTls(
    int port, rdmarpc::TransportPolicy policy,
    std::optional<rdmarpc::TlsChannelCredentials> tls) {
  // Which transport carries the call is what these tests check: a TSan
  // build in the TCG VM must not lose RDMA to slowness (CI once saw the
  // server accept the connection and the call still go over gRPC).
  rdmarpc::ChannelOptions options = PatientChannelOptions(policy);
  options.tls = std::move(tls);
  auto stub = E2E::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port), options));
  ClientContext ctx;
  ctx.set_timeout(std::chrono::seconds(20));
  EchoRequest req;
  req.set_note("tls");
  EchoResponse resp;
  rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
  if (s.ok()) {
    std::cout << "EchoOverTls: " << ctx.stats().ToString() << "\n";
  }
  return {s, ctx.stats().transport};
}

// Serves `service` over TLS with the test CA's server certificate; mutual:
// only to clients with a certificate that CA signed.
rdmarpc::StatusOr<std::unique_ptr<rdmarpc::Server>> StartTlsServer(
    E2EService* service, int* port, bool mutual) {
  const TestPki& pki = GetTestPki();
  rdmarpc::TlsServerCredentials tls;
  tls.cert_chain_pem = pki.server_cert;
  tls.private_key_pem = pki.server_key;
  if (mutual) {
    tls.client_ca_pem = pki.ca_cert;
    tls.require_client_cert = true;
  }
  return rdmarpc::ServerBuilder()
      .AddListeningPort("127.0.0.1:0", port)
      .RegisterService(service)
      .UseTls(tls)
      .BuildAndStart();
}

rdmarpc::TlsChannelCredentials TrustingTheTestCa(bool with_client_cert) {
  const TestPki& pki = GetTestPki();
  rdmarpc::TlsChannelCredentials tls;
  tls.root_certs_pem = pki.ca_cert;
  tls.server_name_override = "rdmarpc.test";
  if (with_client_cert) {
    tls.cert_chain_pem = pki.client_cert;
    tls.private_key_pem = pki.client_key;
  }
  return tls;
}

// Mutual TLS: a client with a certificate the server's CA signed is served
// (over RDMA where the suite expects it); one with no certificate, one
// signed by another CA, one that does not trust the server, and a
// plaintext one are all refused, and none of them obtains an RDMA
// connection, since the token comes only through the TLS port.
TEST_P(E2ETest, MutualTlsServesOnlyAuthenticatedClients) {
  const TestPki& pki = GetTestPki();
  ASSERT_TRUE(pki.error.empty()) << pki.error;
  E2EService service;
  int port = 0;
  auto server = StartTlsServer(&service, &port, /*mutual=*/true);
  ASSERT_TRUE(server.ok()) << server.status();
  const rdmarpc::TransportPolicy policy = GetParam().policy;

  auto [served, transport] =
      EchoOverTls(port, policy, TrustingTheTestCa(/*with_client_cert=*/true));
  EXPECT_TRUE(served.ok()) << served;
  EXPECT_EQ(transport, GetParam().expected);
  const uint64_t accepted = (*server)->rdma_stats().connections_accepted;
  EXPECT_EQ(accepted,
            GetParam().expected == rdmarpc::TransportKind::kRdma ? 1u : 0u);

  rdmarpc::TlsChannelCredentials stranger =
      TrustingTheTestCa(/*with_client_cert=*/false);
  stranger.cert_chain_pem = pki.stranger_cert;
  stranger.private_key_pem = pki.stranger_key;
  rdmarpc::TlsChannelCredentials distrusting = TrustingTheTestCa(true);
  distrusting.root_certs_pem = pki.stranger_ca_cert;
  for (const auto& [what, tls] :
       std::vector<std::pair<std::string,
                             std::optional<rdmarpc::TlsChannelCredentials>>>{
           {"no client certificate", TrustingTheTestCa(false)},
           {"a certificate from another CA", stranger},
           {"a client that does not trust the server", distrusting},
           {"plaintext", std::nullopt}}) {
    auto [refused, unused] = EchoOverTls(port, policy, tls);
    EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable)
        << what << ": " << refused;
  }
  EXPECT_EQ(service.echo_calls.load(), 1);
  EXPECT_EQ((*server)->rdma_stats().connections_accepted, accepted);
}

// Server-only TLS: any client that trusts the server's CA is served; a
// plaintext client is not.
TEST_P(E2ETest, TlsServerServesClientsThatTrustIt) {
  const TestPki& pki = GetTestPki();
  ASSERT_TRUE(pki.error.empty()) << pki.error;
  E2EService service;
  int port = 0;
  auto server = StartTlsServer(&service, &port, /*mutual=*/false);
  ASSERT_TRUE(server.ok()) << server.status();
  auto [served, transport] =
      EchoOverTls(port, GetParam().policy, TrustingTheTestCa(false));
  EXPECT_TRUE(served.ok()) << served;
  EXPECT_EQ(transport, GetParam().expected);
  auto [refused, unused] = EchoOverTls(port, GetParam().policy, std::nullopt);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnavailable) << refused;
}

TEST_P(E2ETest, IncompleteTlsSettingsAreRefusedWithTheReason) {
  E2EService service;
  rdmarpc::TlsServerCredentials incomplete;
  incomplete.cert_chain_pem = "x";
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0")
                    .RegisterService(&service)
                    .UseTls(incomplete)
                    .BuildAndStart();
  ASSERT_FALSE(server.ok());
  EXPECT_EQ(server.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(server.status().message().find("private_key_pem"),
            std::string_view::npos)
      << server.status();

  rdmarpc::TlsChannelCredentials half;
  half.cert_chain_pem = "x";
  auto [refused, unused] = EchoOverTls(port_, GetParam().policy, half);
  EXPECT_EQ(refused.code(), absl::StatusCode::kInvalidArgument) << refused;
  EXPECT_NE(refused.message().find("both or neither"), std::string_view::npos)
      << refused;
}

// Adds "x-echo: <tag>" (the service appends it to the note), or refuses;
// records what it saw.
class TaggingInterceptor final : public rdmarpc::ClientInterceptor {
 public:
  explicit TaggingInterceptor(std::string tag, bool refuse = false)
      : tag_(std::move(tag)), refuse_(refuse) {}
  rdmarpc::Status BeforeCall(std::string_view method, ClientContext* ctx,
                             const google::protobuf::Message&) override {
    ++before;
    if (refuse_) return absl::PermissionDeniedError("refused by " + tag_);
    ctx->AddMetadata("x-echo", tag_);
    return absl::OkStatus();
  }
  void AfterCall(std::string_view method, ClientContext* ctx,
                 rdmarpc::Status* status) override {
    ++after;
    last_code = status->code();
    last_transport = ctx->stats().transport;
    last_method = std::string(method);
  }
  std::atomic<int> before{0}, after{0};
  std::atomic<absl::StatusCode> last_code{absl::StatusCode::kUnknown};
  std::atomic<rdmarpc::TransportKind> last_transport{
      rdmarpc::TransportKind::kNone};
  std::string last_method;  // read after the call completed

 private:
  std::string tag_;
  bool refuse_;
};

// Client interceptors run in order before the call and in reverse after
// it, once per call in every form; one that refuses stops the call before
// it is sent, and only those before it see the outcome.
TEST_P(E2ETest, ClientInterceptorsWrapEveryCallOnce) {
  auto one = std::make_shared<TaggingInterceptor>("one");
  auto two = std::make_shared<TaggingInterceptor>("two");
  rdmarpc::ChannelOptions options = PatientChannelOptions(GetParam().policy);
  options.interceptors = {one, two};
  auto stub = E2E::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port_), options));
  EchoRequest req;
  req.set_note("n");
  EchoResponse resp;
  ClientContext blocking;
  ASSERT_TRUE(stub->Echo(&blocking, req, &resp).ok());
  EXPECT_EQ(resp.note(), "n|one|two");
  EXPECT_EQ(one->after.load(), 1);
  EXPECT_EQ(two->after.load(), 1);
  EXPECT_EQ(one->last_transport.load(), GetParam().expected);
  EXPECT_EQ(one->last_method, "/rdmarpc_test.E2E/Echo");

  ClientContext async;
  std::promise<rdmarpc::Status> done;
  stub->Echo(&async, req, &resp,
             [&done](rdmarpc::Status s) { done.set_value(s); });
  EXPECT_TRUE(done.get_future().get().ok());
  EXPECT_EQ(one->after.load(), 2);
  EXPECT_EQ(two->after.load(), 2);

  auto first = std::make_shared<TaggingInterceptor>("first");
  auto refuser = std::make_shared<TaggingInterceptor>("gate", true);
  auto never = std::make_shared<TaggingInterceptor>("never");
  options.interceptors = {first, refuser, never};
  auto gated = E2E::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port_), options));
  const int served = service_.echo_calls.load();
  ClientContext refused_ctx;
  rdmarpc::Status refused = gated->Echo(&refused_ctx, req, &resp);
  EXPECT_EQ(refused.code(), absl::StatusCode::kPermissionDenied) << refused;
  EXPECT_EQ(refused.message(), "refused by gate");
  EXPECT_EQ(first->after.load(), 1);
  EXPECT_EQ(first->last_code.load(), absl::StatusCode::kPermissionDenied);
  EXPECT_EQ(refuser->after.load(), 0);
  EXPECT_EQ(never->before.load(), 0);
  EXPECT_EQ(service_.echo_calls.load(), served);
}

// Lets a call through only with "authorization: letmein".
class TokenGate final : public rdmarpc::ServerInterceptor {
 public:
  rdmarpc::Status BeforeHandler(rdmarpc::ServerContext* ctx,
                                const google::protobuf::Message&) override {
    ++before;
    auto token = ctx->client_metadata().find("authorization");
    if (token == ctx->client_metadata().end() || token->second != "letmein") {
      return absl::UnauthenticatedError("no valid token for " + ctx->method());
    }
    return absl::OkStatus();
  }
  void AfterHandler(rdmarpc::ServerContext*, rdmarpc::Status*) override {
    ++after;
  }
  std::atomic<int> before{0}, after{0};
};

// Sees every outcome and rewrites the message of failures.
class Auditor final : public rdmarpc::ServerInterceptor {
 public:
  void AfterHandler(rdmarpc::ServerContext* ctx,
                    rdmarpc::Status* status) override {
    ++after;
    if (!status->ok()) {
      *status = rdmarpc::Status(status->code(),
                                "audited: " + std::string(status->message()));
    }
  }
  std::atomic<int> after{0};
};

// Server interceptors gate the handler, see its outcome and may rewrite it,
// over every transport.
TEST_P(E2ETest, ServerInterceptorsGateHandlersAndSeeOutcomes) {
  auto auditor = std::make_shared<Auditor>();
  auto gate = std::make_shared<TokenGate>();
  E2EService service;
  int port = 0;
  auto server = rdmarpc::ServerBuilder()
                    .AddListeningPort("127.0.0.1:0", &port)
                    .RegisterService(&service)
                    .AddInterceptor(auditor)
                    .AddInterceptor(gate)
                    .BuildAndStart();
  ASSERT_TRUE(server.ok()) << server.status();
  rdmarpc::ChannelOptions options = PatientChannelOptions(GetParam().policy);
  auto stub = E2E::NewStub(
      rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port), options));
  EchoRequest req;
  EchoResponse resp;

  ClientContext anonymous;
  rdmarpc::Status refused = stub->Echo(&anonymous, req, &resp);
  EXPECT_EQ(refused.code(), absl::StatusCode::kUnauthenticated) << refused;
  EXPECT_EQ(refused.message(),
            "audited: no valid token for /rdmarpc_test.E2E/Echo");
  EXPECT_EQ(service.echo_calls.load(), 0);
  EXPECT_EQ(gate->after.load(), 0);  // it refused: no AfterHandler
  EXPECT_EQ(auditor->after.load(), 1);

  ClientContext with_token;
  with_token.AddMetadata("authorization", "letmein");
  ASSERT_TRUE(stub->Echo(&with_token, req, &resp).ok());
  EXPECT_EQ(with_token.stats().transport, GetParam().expected);
  EXPECT_EQ(service.echo_calls.load(), 1);
  EXPECT_EQ(gate->after.load(), 1);

  ClientContext failing;
  failing.AddMetadata("authorization", "letmein");
  EchoRequest fail_req;
  fail_req.set_fail_code(static_cast<int>(absl::StatusCode::kNotFound));
  fail_req.set_fail_message("gone");
  rdmarpc::Status failed = stub->Fail(&failing, fail_req, &resp);
  EXPECT_EQ(failed.code(), absl::StatusCode::kNotFound) << failed;
  EXPECT_EQ(failed.message(), "audited: gone");
  EXPECT_EQ(auditor->after.load(), 3);
  EXPECT_EQ(gate->before.load(), 3);
}

}  // namespace
}  // namespace rdmarpc_test
