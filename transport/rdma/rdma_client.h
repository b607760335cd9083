// The RDMA client transport: carries a channel's calls over one RDMA
// connection to the server. This file connects (handshake, then rdma_cm)
// and watches the connection (deadlines, CM events, a silent server); the
// calls themselves run in a ClientEndpoint (client_calls.h).
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
//   internal::FastConnectResult rdma =
//       RdmaClientTransport::Connect(setup, options, hooks);
//   if (!rdma.transport) use gRPC, reporting rdma.error.message() (and
//   never probing again when rdma.no_fast_path);
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

class RdmaClientTransport final : public internal::FastTransport {
 public:
  // Handshake (Hello over `setup`, which must outlive the transport) and
  // connect.
  static internal::FastConnectResult Connect(internal::SetupChannel* setup,
                                             const ChannelOptions& options,
                                             internal::FastPathHooks hooks);
  // Closes the connection and waits until its calls have completed with
  // UNAVAILABLE (not re-sent: the channel is going away).
  ~RdmaClientTransport() override;

  void Start(internal::ClientCall call) override;

  Status health() const override;
  const std::string& description() const override { return description_; }
  internal::FastPathCounters counters() const override;

 private:
  RdmaClientTransport() = default;
  // Expires deadlines, watches the connection's CM events and the calls'
  // progress (pings, closes a connection whose calls stopped moving).
  void Monitor();
  void WakeMonitor();

  std::string description_;
  std::chrono::milliseconds peer_timeout_{0};
  std::shared_ptr<ClientEndpoint> endpoint_;
  std::shared_ptr<Connection> conn_;
  std::atomic<bool> stop_{false};
  // A second after its last outstanding call the monitor rests until the
  // next call (or the destructor) wakes it through `wake_fd_`, or a CM
  // event comes: a resting channel costs no wake-up and a busy one no
  // write.
  UniqueFd wake_fd_;
  std::atomic<bool> monitor_resting_{false};
  std::atomic<uint64_t> watch_wakeups_{0};
  std::thread monitor_;
};

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_RDMA_CLIENT_H_
