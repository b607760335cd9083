// The gRPC client transport: carries calls on the server's gRPC port with
// the lean framing (tensor bytes as separate slices, no copy of host memory).
#ifndef RDMARPC_TRANSPORT_GRPC_GRPC_CLIENT_H_
#define RDMARPC_TRANSPORT_GRPC_GRPC_CLIENT_H_

#include <grpcpp/channel.h>
#include <grpcpp/generic/generic_stub.h>

#include <chrono>
#include <memory>
#include <mutex>
#include <string>

#include "rdmarpc/channel_options.h"
#include "runtime/transport.h"

namespace rdmarpc::grpc_transport {

class CallQueue;
class LeanTarget;

class GrpcClientTransport final : public internal::ClientTransport,
                                  public internal::SetupChannel {
 public:
  GrpcClientTransport(const std::string& target, const ChannelOptions& options);
  // Calls still in flight fail with UNAVAILABLE; their callbacks run
  // before it returns or on the runtime's threads. Must not run on this
  // transport's own completion thread (CreateChannel's deleter sees to it).
  ~GrpcClientTransport() override;

  void Start(internal::ClientCall call) override;

  // One plain unary call with serialized bytes each way, for the runtime's
  // own methods (the RDMA handshake). Must not run on a gRPC callback
  // thread.
  StatusOr<std::string> UnaryBytes(const std::string& method,
                                   const std::string& request,
                                   std::chrono::milliseconds timeout) override;

 private:
  // Holds gRPC's library up from before the channel is made (with gRPC's
  // core API) until after it is gone.
  struct GrpcRuntime {
    GrpcRuntime();
    ~GrpcRuntime();
  };

  GrpcRuntime runtime_;
  size_t chunk_bytes_;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<grpc::GenericStub> stub_;
  std::unique_ptr<LeanTarget> target_;
  // Carries the calls that no caller waits on (CallAsync, CallFuture); made
  // with the first of them.
  std::unique_ptr<CallQueue> queue_;
  std::once_flag queue_made_;
};

}  // namespace rdmarpc::grpc_transport

#endif  // RDMARPC_TRANSPORT_GRPC_GRPC_CLIENT_H_
