// The RDMA client transport: carries a channel's calls over one RDMA
// connection to the server.
//
// Connect() says hello on the server's gRPC port (/rdmarpc.internal.Rdma/
// Hello): the server answers with its RDMA endpoint, a one-time token and
// its buffer sizes, or with why it has no RDMA. The client then connects
// through librdmacm, presenting the token. A call's request goes as a frame
// (wire.h) with small tensors inline; larger ones wait for the server's
// grant and go by RDMA WRITE, the last with the grant id as immediate. The
// response comes back the same way, into memory this side grants: the
// context's response placement or a buffer from SetResponseTensorBuffer.
//
//   RdmaConnectResult rdma = RdmaClientTransport::Connect(setup, options,
//                                                         hooks);
//   if (!rdma.transport) use gRPC, reporting rdma.error.message() (and
//   never probing again when rdma.no_rdma);
//   rdma.transport->Start(std::move(call));
//
// When the connection fails (a completion error, an async event, the
// server silent for ChannelOptions::rdma_peer_timeout, ...) every call in
// flight goes back through `hooks.reroute` with `call.resend` set, so it is
// re-sent over gRPC with its call id and the server runs it at most once;
// then `hooks.lost` tells the channel.
//
// Memory: request and response buffers are borrowed until the call's `done`
// runs, which is never before the device has stopped reading or writing
// them (a cancelled call whose response is being written waits for it). A
// re-sent call borrows them on until its gRPC attempt completes.
#ifndef RDMARPC_TRANSPORT_RDMA_RDMA_CLIENT_H_
#define RDMARPC_TRANSPORT_RDMA_RDMA_CLIENT_H_

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "rdmarpc/channel_options.h"
#include "runtime/transport.h"
#include "transport/rdma/connection.h"

namespace rdmarpc::rdma {

class ClientEndpoint;

inline constexpr char kHelloMethod[] = "/rdmarpc.internal.Rdma/Hello";

// How the transport hands work back to its channel. Both may run on the
// engine thread, never under the transport's locks, and never after the
// transport's destructor returned.
struct RdmaClientHooks {
  uint64_t client_id = 0;  // names this channel's calls to the server
  // Carries a call RDMA cannot: one not sent (a tensor in device memory, a
  // failed registration, `not_executed`), or one in flight when the
  // connection failed (call.resend set). `why` is for the call's stats.
  std::function<void(internal::ClientCall call, std::string why)> reroute;
  // The connection failed: `why` and the trigger in a few words. Runs
  // once, before the connection's calls are rerouted.
  std::function<void(const Status& why, const std::string& trigger)> lost;
};

class RdmaClientTransport;

// What a connect attempt came to: a transport, or why not.
struct RdmaConnectResult {
  std::unique_ptr<RdmaClientTransport> transport;  // null: not connected
  Status error;                                    // why not
  // This host or the server has no RDMA at all (no device, no handshake
  // method, RDMA off, another wire version): trying again will not help.
  // Any other failure (refused, timed out, an address in use) may pass.
  bool no_rdma = false;
};

class RdmaClientTransport final : public internal::ClientTransport {
 public:
  // Handshake (Hello over `setup`, which must outlive the transport) and
  // connect.
  static RdmaConnectResult Connect(internal::SetupChannel* setup,
                                   const ChannelOptions& options,
                                   RdmaClientHooks hooks);
  // Closes the connection and waits until its calls have completed with
  // UNAVAILABLE (not re-sent: the channel is going away).
  ~RdmaClientTransport() override;

  void Start(internal::ClientCall call) override;

  // OK while the connection is up; else why it went down.
  Status health() const;
  // "rxe0 198.18.0.1:41234", for CallStats::transport_reason.
  const std::string& description() const { return description_; }
  Connection::Counters counters() const;

 private:
  RdmaClientTransport() = default;
  // Expires deadlines, watches the connection's CM events, pings a silent
  // server and closes the connection when it stays silent.
  void Monitor();

  std::string description_;
  std::chrono::milliseconds peer_timeout_{0};
  std::shared_ptr<ClientEndpoint> endpoint_;
  std::shared_ptr<Connection> conn_;
  std::atomic<bool> stop_{false};
  std::thread monitor_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_RDMA_CLIENT_H_
