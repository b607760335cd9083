// rdmarpc/channel.h: a client's connection to one server.
//
// A Channel picks, per call, the transport that carries it, according to its
// TransportPolicy and the health of its RDMA connection, and records the
// choice and the reason in the call's CallStats. Generated stubs call it;
// users create it and pass it to `Service::NewStub`.
//
// RDMA health (policy auto or rdma; docs/design.md has the diagram):
//   connecting -> rdma-ready: the handshake and connect worked;
//   connecting -> grpc-only:  this host or the server has no RDMA at all;
//   connecting, rdma-ready -> degraded: the connect failed, or the
//     connection broke (completion error, QP/port/device event, device
//     removed, server silent on RDMA). Calls go over gRPC while a
//     background probe retries RDMA with exponential backoff and jitter;
//   degraded -> rdma-ready: a probe connected; new calls use RDMA again.
// Calls in flight when the connection broke are re-sent over gRPC with the
// same call id; the server runs each at most once (its call log), and a
// call that cannot complete either way fails with UNAVAILABLE naming both
// attempts. Every callback runs exactly once.
//
//   auto channel = rdmarpc::CreateChannel("10.0.0.7:50051");
//   auto stub = demo::Inference::NewStub(channel);
//
// A Channel is thread-safe; share one between threads and stubs.
#ifndef RDMARPC_CHANNEL_H_
#define RDMARPC_CHANNEL_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <string>
#include <string_view>

#include "google/protobuf/message.h"
#include "rdmarpc/channel_interface.h"
#include "rdmarpc/channel_options.h"
#include "rdmarpc/client_context.h"
#include "rdmarpc/status.h"

namespace rdmarpc {

namespace internal {
class ClientTransport;
class TransportRouter;
}  // namespace internal

class Channel final : public ChannelInterface {
 public:
  ~Channel() override;
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  const std::string& target() const { return target_; }
  const ChannelOptions& options() const { return options_; }

  // Calls `method` ("/package.Service/Method"). The request, response,
  // context and the buffers bound in ctx->tensors() are borrowed until the
  // call completes: `done` runs exactly once, on a runtime thread, after
  // which the response (and ctx->tensors().Get() on its tensors) is ready.
  void CallAsync(std::string_view method, ClientContext* ctx,
                 const google::protobuf::Message& request,
                 google::protobuf::Message* response,
                 std::function<void(Status)> done) override;

  // Blocking form of CallAsync.
  Status Call(std::string_view method, ClientContext* ctx,
              const google::protobuf::Message& request,
              google::protobuf::Message* response) override;

  ChannelTransportStats transport_stats();

  // Future form of CallAsync: the future becomes ready when the call
  // completes. The borrowed objects must outlive that moment.
  std::future<Status> CallFuture(std::string_view method, ClientContext* ctx,
                                 const google::protobuf::Message& request,
                                 google::protobuf::Message* response) override;

 private:
  friend std::shared_ptr<Channel> CreateChannel(std::string target,
                                                ChannelOptions options);
  Channel(std::string target, ChannelOptions options);
  // Hands `call` to the transport the policy and the RDMA health pick,
  // and returns which one took it (kNone: not started, or waiting for the
  // first connect). CallAsync's body; `done_runs_inline`,
  // `caller_drives` and `done_only_wakes`: see internal::ClientCall.
  TransportKind StartCall(std::string_view method, ClientContext* ctx,
                          const google::protobuf::Message& request,
                          google::protobuf::Message* response,
                          std::function<void(Status)> done,
                          bool done_runs_inline, bool caller_drives = false,
                          bool done_only_wakes = false);
  std::string target_;
  // OK, or why target_ (or the options) cannot be used: every call fails
  // with it.
  Status target_error_;
  ChannelOptions options_;
  std::atomic<uint64_t> next_call_id_{1};
  std::unique_ptr<internal::ClientTransport> grpc_;
  std::unique_ptr<internal::TransportRouter> router_;
};

// Creates a channel to `target` ("host:port", "[v6]:port", "unix:path").
// Connecting is lazy: errors surface on the first call. A malformed target
// (no port, a port out of range, empty) fails every call with
// INVALID_ARGUMENT naming what is wrong.
std::shared_ptr<Channel> CreateChannel(std::string target,
                                       ChannelOptions options = {});

}  // namespace rdmarpc

#endif  // RDMARPC_CHANNEL_H_
