// The RDMA server transport: takes RDMA connections from clients that said
// hello on the gRPC port, and serves their calls through the dispatcher.
// This file composes the parts: the listener (listener.h) delivers connect
// requests, the token table (handshake.h) decides them, and each accepted
// connection's calls run in a ServerEndpoint (server_calls.h).
//
// Hello() (served on the gRPC port as /rdmarpc.internal.Rdma/Hello) hands
// out a one-time token with the RDMA endpoint; a CM connect request must
// present an unused, unexpired token or it is refused and counted. Each
// connection then carries calls as in rdma_client.h: the server grants
// landing memory for a request's large tensors, runs the handler once they
// landed, and writes the response's large tensors into what the client
// grants.
//
//   auto rdma = RdmaServerTransport::Start(dispatcher, {});
//   if (!rdma.ok()) serve gRPC only; Hello answers with the reason.
#ifndef RDMARPC_TRANSPORT_RDMA_RDMA_SERVER_H_
#define RDMARPC_TRANSPORT_RDMA_RDMA_SERVER_H_

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "rdmarpc/server.h"
#include "runtime/transport.h"
#include "transport/rdma/connection.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/listener.h"
#include "transport/rdma/verbs.h"

namespace rdmarpc::rdma {

class ServerEndpoint;
struct ServerShared;

// Tensors up to this size go inside the SEND by default; above it, by RDMA
// WRITE after a grant. `bench/rpc_bench threshold` measured the inline
// round trip faster at every size up to 24 KiB, the most that fits the
// default 32 KiB receive buffers (docs/design.md has the figures).
inline constexpr uint64_t kDefaultInlineThreshold = 24 << 10;

struct RdmaServerOptions {
  std::string address;  // empty: the first address with an ACTIVE RDMA port
  uint32_t receives = 64;
  uint32_t receive_bytes = 32 << 10;
  uint64_t inline_threshold = kDefaultInlineThreshold;
  std::chrono::seconds token_lifetime{30};
  // Landing memory granted to requests at once, over all connections. A
  // request that would exceed it is answered `not_executed` and the client
  // sends it over gRPC.
  uint64_t landing_pool_bytes = uint64_t{8} << 30;
  GpuRdmaMode gpu_rdma_mode = GpuRdmaMode::kAuto;
  // Connections held at once; a client over it is told in the handshake
  // and uses gRPC (ServerBuilder::SetMaxRdmaConnections).
  uint32_t max_connections = 256;
};

class RdmaServerTransport final : public internal::ServerTransport {
 public:
  // Listens on `options.address` (port chosen by the CM). FAILED_PRECONDITION
  // when this host has no usable RDMA device.
  static StatusOr<std::unique_ptr<RdmaServerTransport>> Start(
      internal::Dispatcher* dispatcher, const RdmaServerOptions& options);
  ~RdmaServerTransport() override;

  // The handshake: HelloRequest bytes in, HelloResponse bytes out.
  StatusOr<std::string> Hello(const std::string& request);
  // HelloResponse bytes for a server without RDMA.
  static std::string HelloUnavailable(const std::string& reason);
  // Why a client over RdmaServerOptions::max_connections gets no RDMA.
  std::string ConnectionLimitReason() const;

  void Shutdown(std::chrono::system_clock::time_point deadline) override;

  RdmaServerStats stats() const;

 private:
  RdmaServerTransport(internal::Dispatcher* dispatcher,
                      const RdmaServerOptions& options);
  // Accepts or refuses a client's connect (on the listener's thread).
  void OnConnectRequest(const CmEvent& event);
  // Closes the connection of CM id `id`, whose client left.
  void OnConnectionLost(rdma_cm_id* id, rdma_cm_event_type type);

  internal::Dispatcher* dispatcher_;
  RdmaServerOptions options_;
  std::shared_ptr<ServerShared> shared_;
  TokenTable tokens_;
  std::unique_ptr<CmListener> listener_;

  mutable std::mutex mu_;
  std::map<rdma_cm_id*, std::shared_ptr<ServerEndpoint>> endpoints_;
  bool shut_down_ = false;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_RDMA_SERVER_H_
