#include "transport/rdma/rdma_server.h"

#include <arpa/inet.h>

#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/fault_injection.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/engine.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/server_calls.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {

RdmaServerTransport::RdmaServerTransport(internal::Dispatcher* dispatcher,
                                         const RdmaServerOptions& options)
    : dispatcher_(dispatcher),
      options_(options),
      shared_(std::make_shared<ServerShared>()),
      tokens_(options.token_lifetime) {
  shared_->landing = std::make_shared<LandingPool>(options.landing_pool_bytes);
}

StatusOr<std::unique_ptr<RdmaServerTransport>> RdmaServerTransport::Start(
    internal::Dispatcher* dispatcher, const RdmaServerOptions& options) {
  std::unique_ptr<RdmaServerTransport> t(
      new RdmaServerTransport(dispatcher, options));
  CmListener::Events events;
  RdmaServerTransport* raw = t.get();
  events.connect_request = [raw](const CmEvent& e) {
    raw->OnConnectRequest(e);
  };
  events.lost = [raw](rdma_cm_id* id, rdma_cm_event_type type) {
    raw->OnConnectionLost(id, type);
  };
  // Tokens name the listener that went away.
  events.dropped = [raw] { raw->tokens_.Clear(); };
  RDMARPC_ASSIGN_OR_RETURN(t->listener_,
                           CmListener::Start(options.address, events));
  return t;
}

RdmaServerTransport::~RdmaServerTransport() {
  Shutdown(std::chrono::system_clock::now());
}

std::string RdmaServerTransport::HelloUnavailable(const std::string& reason) {
  HelloResponse response;
  response.set_version(kWireVersion);
  response.set_unavailable_reason(reason);
  return response.SerializeAsString();
}

std::string RdmaServerTransport::ConnectionLimitReason() const {
  return absl::StrCat(
      "the server holds its limit of ", options_.max_connections,
      " RDMA connections (ServerBuilder::SetMaxRdmaConnections)");
}

StatusOr<std::string> RdmaServerTransport::Hello(const std::string& request) {
  RDMARPC_ASSIGN_OR_RETURN(HelloRequest hello, ParseHelloRequest(request));
  if (auto delay = internal::fault::Take("rdma.server.hello_delay_ms")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(*delay));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return HelloUnavailable("the server is shutting down");
    if (endpoints_.size() >= options_.max_connections) {
      return HelloUnavailable(ConnectionLimitReason());
    }
  }
  std::string not_listening = listener_->not_listening();
  if (!not_listening.empty()) return HelloUnavailable(not_listening);
  RDMARPC_ASSIGN_OR_RETURN(std::string token, tokens_.Issue(hello.client_id()));
  HelloResponse response;
  response.set_version(kWireVersion);
  response.set_cm_address(listener_->address());
  response.set_cm_port(listener_->port());
  response.set_server_instance(dispatcher_->server_instance());
  response.set_token(token);
  response.set_receives(options_.receives);
  response.set_first_receives(FirstReceives(options_.receives));
  response.set_receive_bytes(options_.receive_bytes);
  response.set_inline_threshold(options_.inline_threshold);
  return response.SerializeAsString();
}

void RdmaServerTransport::OnConnectionLost(rdma_cm_id* id,
                                           rdma_cm_event_type type) {
  std::shared_ptr<ServerEndpoint> endpoint;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = endpoints_.find(id);
    if (it == endpoints_.end()) return;
    endpoint = it->second;
    endpoints_.erase(it);
  }
  if (auto conn = endpoint->connection()) {
    conn->Close(absl::UnavailableError(
        absl::StrCat("client left (", rdma_event_str(type), ")")));
  }
}

void RdmaServerTransport::OnConnectRequest(const CmEvent& event) {
  auto refuse = [&](const std::string& why) {
    (void)why;
    shared_->refused.fetch_add(1);
    rdma_reject(event.id, nullptr, 0);
    rdma_destroy_id(event.id);
  };
  auto data = DecodeConnectData(event.private_data);
  if (!data.ok()) return refuse(std::string(data.status().message()));
  if (RDMARPC_FAULT("rdma.server.refuse_connect")) return refuse("fault");
  std::optional<uint64_t> client_id = tokens_.Redeem(data->token);
  bool shut_down = false;
  bool full = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    shut_down = shut_down_;
    // Tokens handed out while the server had room may outnumber it.
    full = endpoints_.size() >= options_.max_connections;
  }
  if (shut_down || !client_id) return refuse("no valid token");
  if (full) return refuse(ConnectionLimitReason());
  if (!CheckReceives(data->receives, data->receive_bytes, "the client",
                     data->first_receives)
           .ok() ||
      data->first_receives == 0) {
    return refuse("receive sizes out of range");
  }
  ConnectionConfig config;
  config.receives = options_.receives;
  config.first_receives = FirstReceives(options_.receives);
  config.receive_bytes = options_.receive_bytes;
  config.peer_receives = data->receives;
  config.peer_first_receives = data->first_receives;
  config.peer_receive_bytes = data->receive_bytes;
  char peer_text[INET6_ADDRSTRLEN] = "?";
  sockaddr* dst = rdma_get_peer_addr(event.id);
  if (dst != nullptr && dst->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(dst)->sin_addr,
              peer_text, sizeof(peer_text));
  }
  auto endpoint = std::make_shared<ServerEndpoint>(
      dispatcher_, shared_, options_.inline_threshold, options_.gpu_rdma_mode,
      absl::StrCat("rdma:", peer_text), *client_id);
  auto resources = BuildResources(listener_->channel(), CmId(event.id), &config,
                                  /*serves=*/true);
  if (!resources.ok()) {
    shared_->refused.fetch_add(1);
    return;  // the id went with the failed resources
  }
  auto conn = Connection::Create(*std::move(resources), config, endpoint);
  if (!conn.ok()) {
    shared_->refused.fetch_add(1);
    return;
  }
  endpoint->Attach(*conn);
  // All before the accept: the engine may serve the connection's first
  // call as soon as the client hears of it (its completions are handled
  // from Create on), before Add and before the listener sees the CM's
  // ESTABLISHED event.
  shared_->accepted.fetch_add(1);
  const bool shares_domain = (*conn)->shares_domain();
  const bool shares_receives = (*conn)->shares_receives();
  if (shares_domain) shared_->accepted_in_shared_domains.fetch_add(1);
  if (shares_receives) shared_->accepted_with_shared_receives.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    ++shared_->endpoints_open;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    endpoints_[event.id] = endpoint;
  }
  rdma_conn_param param{};
  param.rnr_retry_count = 0;
  param.retry_count = 7;
  if (auto delay = internal::fault::Take("rdma.server.accept_delay_ms")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(*delay));
  }
  if (rdma_accept(event.id, &param) != 0) {
    shared_->accepted.fetch_sub(1);
    if (shares_domain) shared_->accepted_in_shared_domains.fetch_sub(1);
    if (shares_receives) {
      shared_->accepted_with_shared_receives.fetch_sub(1);
    }
    (*conn)->Close(VerbsError("rdma_accept", errno));
  }
  Status added = Engine::Add(*conn);
  if (!added.ok()) (*conn)->Close(added);
}

void RdmaServerTransport::Shutdown(
    std::chrono::system_clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    shut_down_ = true;
  }
  tokens_.Clear();
  if (listener_) listener_->Stop();  // null when Start failed
  auto running = [this] { return shared_->handlers_running == 0; };
  shared_->shutdown_waits.store(true);  // before the first look
  {
    std::unique_lock<std::mutex> lock(shared_->mu);
    shared_->cv.wait_until(lock, deadline, running);
  }
  std::vector<std::shared_ptr<ServerEndpoint>> endpoints;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, e] : endpoints_) endpoints.push_back(e);
  }
  for (auto& e : endpoints) e->CancelAll();
  {
    std::unique_lock<std::mutex> lock(shared_->mu);
    for (const auto& weak : shared_->detached) {
      if (auto state = weak.lock()) state->cancelled.store(true);
    }
    shared_->cv.wait(lock, running);
  }
  // Let the last responses leave before the connections go.
  auto flush_until = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  for (auto& e : endpoints) {
    auto conn = e->connection();
    while (conn && conn->Busy() && !conn->closed() &&
           std::chrono::steady_clock::now() < flush_until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    if (conn) conn->Close(absl::UnavailableError("the server shut down"));
  }
  {
    std::unique_lock<std::mutex> lock(shared_->mu);
    shared_->cv.wait_for(lock, std::chrono::seconds(10),
                         [this] { return shared_->endpoints_open == 0; });
  }
  std::lock_guard<std::mutex> lock(mu_);
  endpoints_.clear();
}

RdmaServerStats RdmaServerTransport::stats() const {
  RdmaServerStats s;
  s.status = listener_->status();
  s.connections_accepted = shared_->accepted.load();
  s.connections_in_shared_domains = shared_->accepted_in_shared_domains.load();
  s.connections_with_shared_receives =
      shared_->accepted_with_shared_receives.load();
  s.connects_refused = shared_->refused.load();
  s.protocol_errors = shared_->protocol_errors.load();
  s.landing_windows = shared_->landing_windows.load();
  s.landing_registrations = shared_->landing_registrations.load();
  s.landing_window_waits = shared_->landing_window_waits.load();
  return s;
}

}  // namespace rdmarpc::rdma
