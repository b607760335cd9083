// The end-to-end suite's fixture: a real server and channel per transport.
// A transport joins the suite by adding a TransportCase to its
// INSTANTIATE_TEST_SUITE_P list; the tests do not change.
#ifndef RDMARPC_TESTS_E2E_E2E_FIXTURE_H_
#define RDMARPC_TESTS_E2E_E2E_FIXTURE_H_

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "e2e_test.rdmarpc.pb.h"
#include "rdmarpc/rdmarpc.h"

namespace rdmarpc_test {

struct TransportCase {
  std::string name;
  rdmarpc::TransportPolicy policy;
  rdmarpc::TransportKind expected;
};

// Deterministic bytes that differ per position and per seed.
inline std::vector<uint8_t> Pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed * 2654435761u + 1;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = static_cast<uint8_t>(x >> 24);
  }
  return v;
}

inline std::string CaseName(
    const ::testing::TestParamInfo<TransportCase>& info) {
  return info.param.name;
}

// Sends back the response metadata the client asks for: each value of
// "x-send-initial" or "x-send-trailing" (or their "-bin" forms, for binary
// values) is "key=value". Returns, for the note, what adding them said
// ("|initial x: INVALID_ARGUMENT ..." for each refusal).
inline std::string SendRequestedMetadata(rdmarpc::ServerContext* ctx) {
  std::string refusals;
  for (const auto& [k, v] : ctx->client_metadata()) {
    const bool initial = k.starts_with("x-send-initial");
    if (!initial && !k.starts_with("x-send-trailing")) continue;
    const size_t eq = v.find('=');
    std::string key = v.substr(0, eq);
    std::string value = eq == std::string::npos ? "" : v.substr(eq + 1);
    rdmarpc::Status s = initial ? ctx->AddInitialMetadata(key, value)
                                : ctx->AddTrailingMetadata(key, value);
    if (!s.ok()) {
      refusals += "|" + std::string(initial ? "initial " : "trailing ") + key +
                  ": " + s.ToString();
    }
  }
  return refusals;
}

// Echo calls its own server through `self` with the note's first letter
// taken off, and each level puts its letter back: "abc" comes back as
// "abc|end" after three nested calls, each handler waiting for the next.
class SelfCallingService final : public E2E::Service {
 public:
  E2E::Stub* self = nullptr;
  rdmarpc::Status Echo(rdmarpc::ServerContext*, const EchoRequest& req,
                       EchoResponse* resp) override {
    if (req.note().empty()) {
      resp->set_note("|end");
      return absl::OkStatus();
    }
    EchoRequest next;
    next.set_note(req.note().substr(1));
    rdmarpc::ClientContext ctx;
    rdmarpc::Status s = self->Echo(&ctx, next, resp);
    resp->set_note(req.note().substr(0, 1) + resp->note());
    return s;
  }
};

// The note of an Echo with `note` on `stub`, or its error; a call stuck
// fails after 60 s rather than hanging the test.
inline std::string EchoNoteOrError(E2E::Stub* stub, const std::string& note) {
  rdmarpc::ClientContext ctx;
  ctx.set_timeout(std::chrono::seconds(60));
  EchoRequest req;
  req.set_note(note);
  EchoResponse resp;
  rdmarpc::Status s = stub->Echo(&ctx, req, &resp);
  return s.ok() ? resp.note() : s.ToString();
}

class E2EService final : public E2E::Service {
 public:
  rdmarpc::Status Echo(rdmarpc::ServerContext* ctx, const EchoRequest& req,
                       EchoResponse* resp) override {
    ++echo_calls;
    std::string note = req.note();
    for (const auto& [k, v] : ctx->client_metadata()) {
      if (k == "x-echo") note += "|" + v;
    }
    note += SendRequestedMetadata(ctx);
    resp->set_note(note);
    if (req.reply_bytes() > 0) {
      const std::vector<uint8_t> bytes =
          Pattern(static_cast<size_t>(req.reply_bytes()), 7);
      RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorBuffer reply,
                               rdmarpc::TensorBuffer::Allocate(bytes.size()));
      std::memcpy(reply.data(), bytes.data(), bytes.size());
      return ctx->tensors().Set(resp->mutable_tensor(), rdmarpc::DTYPE_U8,
                                {req.reply_bytes()}, std::move(reply));
    }
    if (!req.has_tensor()) return absl::OkStatus();
    RDMARPC_ASSIGN_OR_RETURN(rdmarpc::TensorView in,
                             ctx->tensors().Get(req.tensor()));
    return ctx->tensors().Set(resp->mutable_tensor(), in);
  }

  rdmarpc::Status Fail(rdmarpc::ServerContext* ctx, const EchoRequest& req,
                       EchoResponse*) override {
    SendRequestedMetadata(ctx);
    return rdmarpc::Status(static_cast<absl::StatusCode>(req.fail_code()),
                           req.fail_message());
  }

  rdmarpc::Status Slow(rdmarpc::ServerContext* ctx, const EchoRequest& req,
                       EchoResponse* resp) override {
    ++slow_started;
    auto until = std::chrono::steady_clock::now() +
                 std::chrono::milliseconds(req.sleep_ms());
    while (std::chrono::steady_clock::now() < until) {
      if (ctx->IsCancelled()) {
        ++slow_saw_cancel;
        return absl::CancelledError("handler saw cancellation");
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    resp->set_note("slept");
    return absl::OkStatus();
  }

  std::atomic<int> echo_calls{0};
  std::atomic<int> slow_started{0};
  std::atomic<int> slow_saw_cancel{0};
};

// Serves `service` on a free local port, with 8 workers for Slow (which
// blocks, so it is marked so); the other methods run inline.
inline rdmarpc::StatusOr<std::unique_ptr<rdmarpc::Server>> StartE2EServer(
    E2EService* service, int* port) {
  return rdmarpc::ServerBuilder()
      .AddListeningPort("127.0.0.1:0", port)
      .RegisterService(service)
      .SetNumWorkers(8)
      .SetMethodBlocking("/rdmarpc_test.E2E/Slow")
      .BuildAndStart();
}

// "127.0.0.1:<port>" for a port that was free a moment ago, with nothing
// on it now (a server took it and shut down); empty if none could start.
inline std::string VacatedTarget() {
  E2EService service;
  int port = 0;
  auto server = StartE2EServer(&service, &port);
  if (!server.ok()) return "";
  (*server)->Shutdown();
  return "127.0.0.1:" + std::to_string(port);
}

// Options for a channel whose calls these tests expect on a given
// transport. A loaded machine (a TSan build in the TCG VM) may take seconds
// to connect or to answer, which the default RDMA timers (5 s, 3 s) would
// take for a failed path and move the call to gRPC. The peer timeout stays
// under the server's call log window (30 s), so that a call that does go
// unheard that long is still re-sent, not refused. Tests of those timers
// set their own.
inline rdmarpc::ChannelOptions PatientChannelOptions(
    rdmarpc::TransportPolicy policy) {
  rdmarpc::ChannelOptions options;
  options.policy = policy;
  options.rdma_connect_timeout = std::chrono::seconds(60);
  options.rdma_peer_timeout = std::chrono::seconds(20);
  return options;
}

class E2ETest : public ::testing::TestWithParam<TransportCase> {
 protected:
  void SetUp() override {
    auto server = StartE2EServer(&service_, &port_);
    ASSERT_TRUE(server.ok()) << server.status();
    server_ = std::move(*server);
    channel_ = rdmarpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                      PatientChannelOptions(GetParam().policy));
    stub_ = E2E::NewStub(channel_);
  }

  void TearDown() override {
    if (server_) server_->Shutdown();
  }

  E2EService service_;
  int port_ = 0;
  std::unique_ptr<rdmarpc::Server> server_;
  std::shared_ptr<rdmarpc::Channel> channel_;
  std::unique_ptr<E2E::Stub> stub_;
};

}  // namespace rdmarpc_test

#endif  // RDMARPC_TESTS_E2E_E2E_FIXTURE_H_
