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

// Whether a GrpcClientTransport still exists, for calls that outlive it.
struct ChannelLife {
  std::mutex mu;
  bool transport_alive = true;  // guarded by mu
};

class GrpcClientTransport final : public internal::ClientTransport,
                                  public internal::SetupChannel {
 public:
  GrpcClientTransport(const std::string& target, const ChannelOptions& options);
  ~GrpcClientTransport() override;

  void Start(internal::ClientCall call) override;

  // One plain unary call with serialized bytes each way, for the runtime's
  // own methods (the RDMA handshake). Must not run on a gRPC callback
  // thread.
  StatusOr<std::string> UnaryBytes(const std::string& method,
                                   const std::string& request,
                                   std::chrono::milliseconds timeout) override;

 private:
  std::shared_ptr<grpc::Channel> channel_;
  grpc::GenericStub stub_;
  size_t chunk_bytes_;
  std::shared_ptr<ChannelLife> life_ = std::make_shared<ChannelLife>();
};

}  // namespace rdmarpc::grpc_transport

#endif  // RDMARPC_TRANSPORT_GRPC_GRPC_CLIENT_H_
