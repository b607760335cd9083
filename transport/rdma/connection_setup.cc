#include "transport/rdma/connection_setup.h"

#include <arpa/inet.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/fault_injection.h"
#include "transport/rdma/engine.h"

namespace rdmarpc::rdma {
namespace {

constexpr uint32_t kConnectMagic = 0x31435252;  // "RRC1"
constexpr size_t kConnectDataBytes = 32;
// On a software device, writes of this size and more are posted aside
// (ConnectionConfig::post_aside_bytes): the post of 64 KiB takes about as
// long as a small call's round trip there.
constexpr uint64_t kPostAsideBytes = 64 << 10;

// SetSharedDomainsForTesting.
std::atomic<bool> shared_domains_for_testing{true};
// SetSendPoolsForTesting.
std::atomic<bool> send_pools_for_testing{true};

void PutU32(std::string* out, size_t at, uint32_t v) {
  for (int i = 0; i < 4; ++i) (*out)[at + i] = static_cast<char>(v >> (8 * i));
}

uint32_t GetU32(std::string_view in, size_t at) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) {
    v |= uint32_t{static_cast<uint8_t>(in[at + i])} << (8 * i);
  }
  return v;
}

}  // namespace

void SetSharedDomainsForTesting(bool shared) {
  shared_domains_for_testing.store(shared);
}

void SetSendPoolsForTesting(bool lend) { send_pools_for_testing.store(lend); }

std::string EncodeConnectData(const ConnectData& data) {
  std::string out(kConnectDataBytes, '\0');
  PutU32(&out, 0, kConnectMagic);
  out[4] = static_cast<char>(kWireVersion);
  out[6] = static_cast<char>(data.first_receives);
  out[7] = static_cast<char>(data.first_receives >> 8);
  std::memcpy(out.data() + 8, data.token.data(),
              std::min(data.token.size(), kTokenBytes));
  PutU32(&out, 24, data.receives);
  PutU32(&out, 28, data.receive_bytes);
  return out;
}

Status CheckReceives(uint32_t receives, uint32_t receive_bytes,
                     const char* whose, uint32_t first_receives) {
  if (receives < 4 || receives > 4096 || receive_bytes < 1024 ||
      receive_bytes > (1 << 24)) {
    return absl::InvalidArgumentError(absl::StrCat(
        whose, ": ", receives, " control receives of ", receive_bytes,
        " bytes; want 4..4096 receives of 1024..16777216 bytes"));
  }
  if (first_receives != 0 &&
      (first_receives < 4 || first_receives > receives)) {
    return absl::InvalidArgumentError(
        absl::StrCat(whose, ": ", first_receives, " first receives of ",
                     receives, "; want 4..", receives));
  }
  return absl::OkStatus();
}

StatusOr<ConnectData> DecodeConnectData(std::string_view bytes) {
  if (bytes.size() < kConnectDataBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("connect request carries ", bytes.size(),
                     " bytes of private data, need ", kConnectDataBytes));
  }
  if (GetU32(bytes, 0) != kConnectMagic) {
    return absl::InvalidArgumentError("connect request is not from rdmarpc");
  }
  if (static_cast<uint8_t>(bytes[4]) != kWireVersion) {
    return absl::InvalidArgumentError(absl::StrCat(
        "connect request speaks wire version ", static_cast<uint8_t>(bytes[4]),
        ", this side ", kWireVersion));
  }
  ConnectData data;
  data.token.assign(bytes.data() + 8, kTokenBytes);
  data.receives = GetU32(bytes, 24);
  data.receive_bytes = GetU32(bytes, 28);
  data.first_receives = static_cast<uint8_t>(bytes[6]) |
                        uint32_t{static_cast<uint8_t>(bytes[7])} << 8;
  return data;
}

StatusOr<ConnectionResources> BuildResources(SharedEventChannel events, CmId id,
                                             ConnectionConfig* config,
                                             bool serves) {
  ConnectionResources r;
  r.events = std::move(events);
  r.id = std::move(id);
  ibv_context* device = r.id->verbs;
  if (device == nullptr) {
    return absl::FailedPreconditionError("CM id has no RDMA device yet");
  }
  ibv_port_attr port{};
  if (ibv_query_port(device, r.id->port_num, &port) == 0 &&
      port.max_msg_sz > 0) {
    config->max_write_bytes =
        std::min<uint64_t>(config->max_write_bytes, port.max_msg_sz);
  }
  if (IsSoftwareDevice(device)) config->post_aside_bytes = kPostAsideBytes;
  if (const char* env = std::getenv("RDMARPC_RDMA_POST_ASIDE_BYTES");
      env != nullptr && *env != '\0') {
    config->post_aside_bytes = std::strtoull(env, nullptr, 10);
  }
  if (const char* env = std::getenv("RDMARPC_RDMA_SIGNAL_INTERVAL");
      env != nullptr && *env != '\0') {
    config->signal_interval =
        static_cast<uint32_t>(std::strtoul(env, nullptr, 10));
  }
  if (const char* env = std::getenv("RDMARPC_RDMA_MAX_WRITE_BYTES");
      env != nullptr && *env != '\0') {
    uint64_t limit = std::strtoull(env, nullptr, 10);
    if (limit > 0) {
      config->max_write_bytes = std::min(config->max_write_bytes, limit);
    }
  }
  const uint32_t cq_entries =
      config->send_queue_slots + kWindowWorkRequests + config->receives;
  RDMARPC_ASSIGN_OR_RETURN(r.group, Engine::Join(device, serves, cq_entries));
  r.pd = shared_domains_for_testing.load() ? r.group.group()->pd() : nullptr;
  if (r.pd == nullptr) {
    RDMARPC_ASSIGN_OR_RETURN(r.own_pd, AllocatePd(device));
    r.pd = r.own_pd.get();
  }
  if (r.own_pd == nullptr) {
    // Only the first receives are backed at once; the peer's grants come
    // from the pool's spare.
    r.srq = r.group.TakeSharedReceives(config->receive_bytes,
                                       config->first_receives == 0
                                           ? config->receives
                                           : config->first_receives);
  }
  if (r.srq == nullptr) {
    size_t receive_total = size_t{config->receives} * config->receive_bytes;
    r.receive_buffers = std::make_unique<uint8_t[]>(receive_total);
    RDMARPC_ASSIGN_OR_RETURN(
        r.receive_mr, RegisterMemory(r.pd, r.receive_buffers.get(),
                                     receive_total, IBV_ACCESS_LOCAL_WRITE));
  }
  // Frames borrow the group's send buffers to begin with where it lends
  // them; otherwise the first chunk is the connection's own. Either way
  // the connection registers more as frames need them.
  if (r.own_pd == nullptr && send_pools_for_testing.load()) {
    r.send_pool = r.group.TakeSendPool(config->peer_receive_bytes);
  }
  if (r.send_pool == nullptr) {
    size_t send_total = size_t{FirstSendBuffers(config->peer_receives)} *
                        config->peer_receive_bytes;
    r.send_buffers = std::make_unique<uint8_t[]>(send_total);
    RDMARPC_ASSIGN_OR_RETURN(
        r.send_mr, RegisterMemory(r.pd, r.send_buffers.get(), send_total, 0));
  }
  QpCaps caps;
  caps.max_send_wr = config->send_queue_slots + kWindowWorkRequests;
  caps.max_recv_wr = config->receives;
  caps.srq = r.srq;
  RDMARPC_ASSIGN_OR_RETURN(r.qp,
                           CreateRcQp(r.id.get(), r.pd, r.group.cq(), caps));
  return r;
}

StatusOr<std::shared_ptr<Connection>> ConnectToServer(
    const std::string& address, uint16_t port, const std::string& token,
    ConnectionConfig config, std::shared_ptr<Connection::Handler> handler,
    std::chrono::steady_clock::time_point deadline) {
  RDMARPC_ASSIGN_OR_RETURN(EventChannel events, CreateEventChannel());
  RDMARPC_ASSIGN_OR_RETURN(CmId id, CreateCmId(events.get()));
  sockaddr_in dst{};
  dst.sin_family = AF_INET;
  dst.sin_port = htons(port);
  if (inet_pton(AF_INET, address.c_str(), &dst.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("server's RDMA address '", address, "' is not IPv4"));
  }
  // One budget for every step: each wait gets what the earlier ones left.
  auto left = [deadline] {
    return std::max(std::chrono::milliseconds(1),
                    std::chrono::duration_cast<std::chrono::milliseconds>(
                        deadline - std::chrono::steady_clock::now()));
  };
  // Fault injection: address resolution fails with the armed errno.
  if (auto err = internal::fault::kEnabled
                     ? internal::fault::Take("rdma.client.resolve_errno")
                     : std::nullopt) {
    return VerbsError(absl::StrCat("rdma_resolve_addr ", address),
                      static_cast<int>(*err));
  }
  if (rdma_resolve_addr(id.get(), nullptr, reinterpret_cast<sockaddr*>(&dst),
                        static_cast<int>(left().count())) != 0) {
    return VerbsError(absl::StrCat("rdma_resolve_addr ", address), errno);
  }
  RDMARPC_RETURN_IF_ERROR(
      WaitCmEvent(events.get(), RDMA_CM_EVENT_ADDR_RESOLVED, left()).status());
  if (rdma_resolve_route(id.get(), static_cast<int>(left().count())) != 0) {
    return VerbsError(absl::StrCat("rdma_resolve_route ", address), errno);
  }
  RDMARPC_RETURN_IF_ERROR(
      WaitCmEvent(events.get(), RDMA_CM_EVENT_ROUTE_RESOLVED, left()).status());
  rdma_event_channel* channel = events.get();
  rdma_cm_id* raw_id = id.get();
  RDMARPC_ASSIGN_OR_RETURN(
      ConnectionResources resources,
      BuildResources(std::move(events), std::move(id), &config,
                     /*serves=*/false));
  RDMARPC_ASSIGN_OR_RETURN(
      std::shared_ptr<Connection> conn,
      Connection::Create(std::move(resources), config, std::move(handler)));
  std::string data = EncodeConnectData(
      {token, config.receives,
       config.first_receives == 0 ? config.receives : config.first_receives,
       config.receive_bytes});
  rdma_conn_param param{};
  param.private_data = data.data();
  param.private_data_len = static_cast<uint8_t>(data.size());
  param.retry_count = 7;
  // No receiver-not-ready retries: credits guarantee a posted receive, and
  // an RNR would be a bug that must surface, not a stall.
  param.rnr_retry_count = 0;
  if (rdma_connect(raw_id, &param) != 0) {
    return VerbsError(absl::StrCat("rdma_connect ", address, ":", port), errno);
  }
  auto established = WaitCmEvent(channel, RDMA_CM_EVENT_ESTABLISHED, left());
  if (!established.ok()) {
    // DEADLINE_EXCEEDED stays so: the caller tells a timeout from a refusal.
    absl::StatusCode code =
        established.status().code() == absl::StatusCode::kDeadlineExceeded
            ? absl::StatusCode::kDeadlineExceeded
            : absl::StatusCode::kUnavailable;
    return absl::Status(
        code, absl::StrCat("RDMA connect to ", address, ":", port,
                           " failed: ", established.status().message()));
  }
  RDMARPC_RETURN_IF_ERROR(Engine::Add(conn));
  return conn;
}

}  // namespace rdmarpc::rdma
