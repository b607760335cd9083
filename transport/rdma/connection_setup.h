// Setting up RDMA connections: verbs objects, the connect request's private
// data, and the client's connect. The datapath is in connection.h.
//
//   ConnectionConfig config = ...;  // peer sizes from the handshake
//   RDMARPC_ASSIGN_OR_RETURN(
//       std::shared_ptr<Connection> conn,
//       ConnectToServer("198.18.0.1", 41000, token, config, handler,
//                       std::chrono::steady_clock::now() +
//                           std::chrono::seconds(5)));
#ifndef RDMARPC_TRANSPORT_RDMA_CONNECTION_SETUP_H_
#define RDMARPC_TRANSPORT_RDMA_CONNECTION_SETUP_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "rdmarpc/status.h"
#include "transport/rdma/connection.h"

namespace rdmarpc::rdma {

inline constexpr size_t kTokenBytes = 16;

// What the client's CM connect request carries (private data, 32 bytes
// little-endian: magic "RRC1", version, a reserved byte, u16 first
// receives, token, receives, receive bytes).
struct ConnectData {
  std::string token;  // kTokenBytes
  uint32_t receives = 0;
  uint32_t first_receives = 0;  // at most 65535
  uint32_t receive_bytes = 0;
};
std::string EncodeConnectData(const ConnectData& data);

// The control receives either side accepts from the other (and lets a
// server be configured with): 4..4096 receives of 1 KiB..16 MiB each, of
// which 4..receives at first (0: not checked, for a side's own settings).
// INVALID_ARGUMENT naming `whose` and the range otherwise.
[[nodiscard]] Status CheckReceives(uint32_t receives, uint32_t receive_bytes,
                                   const char* whose,
                                   uint32_t first_receives = 0);
// INVALID_ARGUMENT unless `bytes` starts with a well-formed record (the CM
// may pad private data with zeros).
[[nodiscard]] StatusOr<ConnectData> DecodeConnectData(std::string_view bytes);

// Joins a completion group of the engine that will poll `id`'s queue
// pair (Engine::Join; a server's connections, `serves`, and a client's
// join different groups), takes the group's protection domain where it
// has one (else allocates one), and makes the control buffers (registered
// for local access only) and the RC queue pair for `id`, which has a
// device (address resolved, or a connect request). In a shared domain the
// receives come from the group's shared receive queue, which backs the
// first receives (CompletionGroup::Membership::TakeSharedReceives);
// otherwise the connection posts all of its receives itself.
// config.max_write_bytes is lowered to the port's max_msg_sz (and to
// RDMARPC_RDMA_MAX_WRITE_BYTES when set); config.post_aside_bytes is set
// on a software device (RDMARPC_RDMA_POST_ASIDE_BYTES overrides it on any
// device, 0 turning it off).
[[nodiscard]] StatusOr<ConnectionResources> BuildResources(
    SharedEventChannel events, CmId id, ConnectionConfig* config, bool serves);
// Tests: connections built while this is false have a protection domain
// of their own whatever their group offers (so that they may register
// landing memory for remote write).
void SetSharedDomainsForTesting(bool shared);
// Tests: connections built while this is false register their first send
// buffers at once instead of borrowing their group's (so that their frames
// go unsignaled from the first).
void SetSendPoolsForTesting(bool lend);

// The client side: resolves `address`:`port`, builds the connection, sends
// the connect request with `token` and waits for ESTABLISHED, every step
// within what is left until `deadline` (DEADLINE_EXCEEDED past it). The
// returned connection is already added to the engine.
[[nodiscard]] StatusOr<std::shared_ptr<Connection>> ConnectToServer(
    const std::string& address, uint16_t port, const std::string& token,
    ConnectionConfig config, std::shared_ptr<Connection::Handler> handler,
    std::chrono::steady_clock::time_point deadline);

}  // namespace rdmarpc::rdma

#endif  // RDMARPC_TRANSPORT_RDMA_CONNECTION_SETUP_H_
