// The gRPC server transport: every registered method on the gRPC port, both
// as a plain gRPC method (one protobuf message, tensor bytes inline) for
// stock clients and in the lean framing for rdmarpc clients.
#ifndef RDMARPC_TRANSPORT_GRPC_GRPC_SERVER_H_
#define RDMARPC_TRANSPORT_GRPC_GRPC_SERVER_H_

#include <grpcpp/server.h>

#include <chrono>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "rdmarpc/server.h"
#include "runtime/transport.h"
#include "transport/grpc/health.h"
#include "transport/grpc/reflection.h"

namespace rdmarpc::grpc_transport {

class GrpcServerTransport final : public internal::ServerTransport {
 public:
  class Service;  // the serving threads and calls; grpc_server.cc

  // A runtime method served on the gRPC port (the RDMA handshake): request
  // bytes and the caller's address in, response bytes out. Runs on a gRPC
  // thread and must not block.
  using InternalMethod = std::function<StatusOr<std::string>(
      const std::string& peer, const std::string& request)>;

  // How the gRPC server listens; see ServerBuilder.
  struct ListenOptions {
    // Alongside other listeners on the same port (SO_REUSEPORT).
    bool port_reuse = false;
    // TLS on the port; unset: plaintext.
    std::optional<TlsServerCredentials> tls;
    // Keepalive pings allowed this often (0: gRPC's default).
    std::chrono::milliseconds keepalive_permit{0};
    // The services served (full names, "demo.Inference"): the health
    // service reports each, reflection lists them.
    std::vector<std::string> services;
    // grpc.health.v1.Health, every service SERVING until shutdown.
    bool health = true;
    // grpc.reflection.v1 and v1alpha.
    bool reflection = false;
    // Threads polling the port (ServerBuilder::SetGrpcThreads), 1 to
    // kMaxThreads.
    int threads = 1;
  };
  static constexpr int kMaxThreads = 64;

  // Binds `ports` (address, optional out-param for the bound port).
  static StatusOr<std::unique_ptr<GrpcServerTransport>> Start(
      const std::vector<std::pair<std::string, int*>>& ports,
      const ListenOptions& listen, internal::Dispatcher* dispatcher,
      std::map<std::string, InternalMethod> internal_methods = {});

  ~GrpcServerTransport() override;

  void Shutdown(std::chrono::system_clock::time_point deadline) override;

  // What the health service answers for `service` ("" is the whole
  // server). FAILED_PRECONDITION when the server runs no health service.
  Status SetServingStatus(const std::string& service, bool serving);

 private:
  GrpcServerTransport() = default;

  // Both outlive service_ (declared first), whose calls read them.
  std::unique_ptr<HealthStatuses> health_;
  std::unique_ptr<ReflectionAnswerer> reflection_;
  std::unique_ptr<Service> service_;
  std::unique_ptr<grpc::Server> server_;
};

}  // namespace rdmarpc::grpc_transport

#endif  // RDMARPC_TRANSPORT_GRPC_GRPC_SERVER_H_
