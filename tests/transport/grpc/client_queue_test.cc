// The gRPC client's completion thread, which carries calls made with
// CallAsync: every callback runs once when the channel goes with calls in
// flight, on the thread ChannelOptions::run_callbacks_inline asks for, and
// a callback there may chain calls and drop the channel.
#include <gtest/gtest.h>
#include <pthread.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "e2e_fixture.h"

namespace rdmarpc_test {
namespace {

std::string ThreadName() {
  char name[16] = {};
  pthread_getname_np(pthread_self(), name, sizeof(name));
  return name;
}

class ClientQueueTest : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    auto server = StartE2EServer(&service_, &port_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
  }
  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  std::shared_ptr<rdmarpc::Channel> NewChannel() {
    rdmarpc::ChannelOptions options;
    options.policy = rdmarpc::TransportPolicy::kGrpc;
    options.run_callbacks_inline = GetParam();
    return rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                  options);
  }
  std::string CallbackThread() const {
    return GetParam() ? "rdmarpc-grpc-cq" : "rdmarpc-done";
  }

  E2EService service_;
  int port_ = 0;
  std::unique_ptr<rdmarpc::Server> server_;
};

TEST_P(ClientQueueTest, ChannelDroppedWithCallsInFlightRunsEveryCallbackOnce) {
  constexpr int kCalls = 8;
  struct Call {
    rdmarpc::ClientContext ctx;
    EchoRequest req;
    EchoResponse resp;
    int callbacks = 0;  // guarded by mu
    rdmarpc::Status status;
    std::string thread;
  };
  std::vector<Call> calls(kCalls);
  std::mutex mu;
  std::condition_variable cv;
  int done = 0;
  auto stub = E2E::NewStub(NewChannel());
  for (Call& c : calls) {
    c.req.set_sleep_ms(30000);
    stub->Slow(&c.ctx, c.req, &c.resp, [&](rdmarpc::Status s) {
      std::lock_guard<std::mutex> lock(mu);
      ++c.callbacks;
      c.status = s;
      c.thread = ThreadName();
      ++done;
      cv.notify_all();
    });
  }
  for (int i = 0; i < 500 && service_.slow_started.load() < kCalls; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  const auto dropped = std::chrono::steady_clock::now();
  stub.reset();  // the only reference to the channel
  EXPECT_LT(std::chrono::steady_clock::now() - dropped,
            std::chrono::seconds(5));
  std::unique_lock<std::mutex> lock(mu);
  ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(20),
                          [&] { return done == kCalls; }));
  lock.unlock();
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  lock.lock();
  for (const Call& c : calls) {
    EXPECT_EQ(c.callbacks, 1);
    EXPECT_EQ(c.status.code(), absl::StatusCode::kUnavailable) << c.status;
    EXPECT_EQ(c.thread, CallbackThread());
  }
}

// Each callback starts the next call on the same channel; the last one
// drops the channel's last reference on the thread that runs it.
TEST_P(ClientQueueTest, CallbacksChainCallsAndDropTheChannel) {
  constexpr int kChain = 20;
  struct Chain {
    std::shared_ptr<rdmarpc::Channel> channel;
    std::unique_ptr<E2E::Stub> stub;
    int completed = 0;
    int failed = 0;
    std::string thread;
    rdmarpc::Status blocking;
    std::mutex mu;
    std::condition_variable cv;
    bool finished = false;  // guarded by mu
  };
  auto chain = std::make_shared<Chain>();
  chain->channel = NewChannel();
  chain->stub = E2E::NewStub(chain->channel);
  std::function<void()> next = [&] {
    auto ctx = std::make_shared<rdmarpc::ClientContext>();
    auto req = std::make_shared<EchoRequest>();
    auto resp = std::make_shared<EchoResponse>();
    req->set_note("link");
    chain->stub->Echo(
        ctx.get(), *req, resp.get(), [&, ctx, req, resp](rdmarpc::Status s) {
          if (!s.ok() || resp->note() != "link") ++chain->failed;
          chain->thread = ThreadName();
          if (++chain->completed < kChain) return next();
          if (GetParam()) {
            // A blocking call here could wait for this very thread.
            rdmarpc::ClientContext blocking_ctx;
            EchoResponse blocking_resp;
            chain->blocking =
                chain->stub->Echo(&blocking_ctx, *req, &blocking_resp);
          }
          chain->stub.reset();
          chain->channel.reset();
          std::lock_guard<std::mutex> lock(chain->mu);
          chain->finished = true;
          chain->cv.notify_all();
        });
  };
  next();
  std::unique_lock<std::mutex> lock(chain->mu);
  ASSERT_TRUE(chain->cv.wait_for(lock, std::chrono::seconds(30),
                                 [&] { return chain->finished; }));
  EXPECT_EQ(chain->completed, kChain);
  EXPECT_EQ(chain->failed, 0);
  EXPECT_EQ(chain->thread, CallbackThread());
  if (GetParam()) {
    EXPECT_EQ(chain->blocking.code(), absl::StatusCode::kFailedPrecondition)
        << chain->blocking;
  }
}

INSTANTIATE_TEST_SUITE_P(Callbacks, ClientQueueTest, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? std::string("Inline")
                                             : std::string("OnCallbackThread");
                         });

}  // namespace
}  // namespace rdmarpc_test
