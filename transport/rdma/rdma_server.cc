#include "transport/rdma/rdma_server.h"

#include <arpa/inet.h>
#include <pthread.h>

#include <cstring>
#include <random>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/fault_injection.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/engine.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/payload.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {

// State the endpoints and the running handlers share with the transport,
// which may be gone by the time a handler returns.
struct ServerShared {
  std::mutex mu;
  std::condition_variable cv;
  int handlers_running = 0;
  int endpoints_open = 0;
  // Handlers still running for connections that closed (their clients
  // re-send over gRPC): cancelled at the shutdown deadline like the rest.
  std::vector<std::weak_ptr<internal::ServerCallState>> detached;
  std::atomic<uint64_t> accepted{0};
  std::atomic<uint64_t> refused{0};
  std::atomic<uint64_t> protocol_errors{0};
  uint64_t landing_pool_bytes = 0;
  std::atomic<uint64_t> landing_in_use{0};
};

namespace {

using google::protobuf::Message;

// Landing memory a request holds against the server's pool.
class LandingReservation {
 public:
  LandingReservation() = default;
  LandingReservation(std::shared_ptr<ServerShared> shared, uint64_t bytes)
      : shared_(std::move(shared)), bytes_(bytes) {}
  LandingReservation(LandingReservation&& o) noexcept
      : shared_(std::move(o.shared_)), bytes_(std::exchange(o.bytes_, 0)) {}
  LandingReservation& operator=(LandingReservation&& o) noexcept {
    Release();
    shared_ = std::move(o.shared_);
    bytes_ = std::exchange(o.bytes_, 0);
    return *this;
  }
  ~LandingReservation() { Release(); }

 private:
  void Release() {
    if (shared_ && bytes_ > 0) shared_->landing_in_use.fetch_sub(bytes_);
    bytes_ = 0;
  }
  std::shared_ptr<ServerShared> shared_;
  uint64_t bytes_ = 0;
};

struct ServerRecord {
  enum class Stage {
    kAwaitRequestData,  // landing memory granted, client writing
    kRunning,           // handler queued or running
    kAwaitResponseGrant,
    kWritingResponse,
  };
  Stage stage = Stage::kAwaitRequestData;
  std::shared_ptr<internal::ServerCallState> state;
  std::shared_ptr<Message> request;
  IncomingPayload in;
  LandingReservation landing;
  uint32_t grant_id = 0;
  std::unique_ptr<Message> response;
  OutgoingPayload out;
  std::vector<LocalMemory> sources;
  int writes_pending = 0;
  Status write_error;  // of a response write
};

}  // namespace

class ServerEndpoint final
    : public Connection::Handler,
      public std::enable_shared_from_this<ServerEndpoint> {
 public:
  ServerEndpoint(internal::Dispatcher* dispatcher,
                 std::shared_ptr<ServerShared> shared, uint64_t threshold,
                 GpuRdmaMode gpu_mode, std::string peer, uint64_t client_id)
      : dispatcher_(dispatcher),
        shared_(std::move(shared)),
        inline_threshold_(threshold),
        gpu_mode_(gpu_mode),
        peer_(std::move(peer)),
        client_id_(client_id) {}

  void Attach(std::shared_ptr<Connection> conn) {
    std::lock_guard<std::mutex> lock(mu_);
    conn_ = std::move(conn);
    cache_ = RegistrationCache::Create(conn_->pd());
  }

  std::shared_ptr<Connection> connection() {
    std::lock_guard<std::mutex> lock(mu_);
    return conn_;
  }

  // Marks every call cancelled (shutdown past its deadline).
  void CancelAll() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [id, r] : calls_) r->state->cancelled.store(true);
  }

  Status OnFrame(const FrameView& frame) override;
  Status OnWriteLanded(uint32_t immediate) override;
  void OnClosed(const Status& why) override;

  void Respond(uint64_t call_id,
               const std::shared_ptr<internal::ServerCallState>& state,
               Status status, std::unique_ptr<Message> response);

 private:
  // OnRequest and OnWriteLanded hand the calls that became ready to the
  // dispatcher once mu_ is released: an inline handler responds at once,
  // which takes mu_.
  Status OnRequest(const FrameView& frame);
  Status AdmitRequest(const FrameView& frame);
  Status LandWrite(uint32_t immediate);
  void ExecuteReady();
  Status OnGrant(const FrameView& frame);
  void OnCancel(uint64_t call_id);
  // Parses the landed request and queues it for ExecuteReady. Requires mu_.
  void DispatchLocked(uint64_t call_id);
  // Sends an error response and forgets the call. Requires mu_.
  void FailLocked(uint64_t call_id, const Status& status,
                  bool not_executed = false);
  // Tells the dispatcher, once `sent` reports, whether the outcome of a
  // logged call reached the client (see call_log.h).
  std::function<void(Status)> SettleWhenSent(
      std::shared_ptr<internal::ServerCallState> state, Status status,
      std::shared_ptr<std::unique_ptr<Message>> response);
  void ForgetLocked(uint64_t call_id);

  internal::Dispatcher* dispatcher_;
  std::shared_ptr<ServerShared> shared_;
  const uint64_t inline_threshold_;
  const GpuRdmaMode gpu_mode_;
  const std::string peer_;
  const uint64_t client_id_;  // from the handshake; 0: calls not logged
  WireLimits limits_;

  std::mutex mu_;
  std::shared_ptr<Connection> conn_;
  std::shared_ptr<RegistrationCache> cache_;
  bool closed_ = false;
  std::map<uint64_t, std::unique_ptr<ServerRecord>> calls_;
  std::map<uint32_t, uint64_t> grants_;
  uint32_t next_grant_id_ = 1;
  struct ReadyCall {
    std::shared_ptr<internal::ServerCallState> state;
    std::shared_ptr<Message> request;
    internal::Dispatcher::Completion done;
  };
  std::vector<ReadyCall> ready_;  // for ExecuteReady
};

Status ServerEndpoint::OnFrame(const FrameView& frame) {
  // Fault injection: a server that stops answering on RDMA while its gRPC
  // port still does.
  if (RDMARPC_FAULT("rdma.server.ignore_frames")) return absl::OkStatus();
  switch (frame.type) {
    case FrameType::kPing: {
      RDMARPC_ASSIGN_OR_RETURN(Ping ping, ParsePing(frame));
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return absl::OkStatus();
      // Fails only on a closing connection, whose close ends the calls.
      Status sent = conn_->SendFrame(FrameType::kPong, &ping);
      return conn_->closed() ? absl::OkStatus() : sent;
    }
    case FrameType::kRequest:
      return OnRequest(frame);
    case FrameType::kGrant:
      return OnGrant(frame);
    case FrameType::kCancel: {
      RDMARPC_ASSIGN_OR_RETURN(rdma::Cancel cancel, ParseCancel(frame));
      OnCancel(cancel.call_id());
      return absl::OkStatus();
    }
    default:
      return absl::InvalidArgumentError(absl::StrCat(
          "a client sent frame type ", static_cast<int>(frame.type)));
  }
}

void ServerEndpoint::ForgetLocked(uint64_t call_id) {
  auto it = calls_.find(call_id);
  if (it == calls_.end()) return;
  if (it->second->grant_id != 0) grants_.erase(it->second->grant_id);
  calls_.erase(it);
}

void ServerEndpoint::FailLocked(uint64_t call_id, const Status& status,
                                bool not_executed) {
  ResponseHead head;
  head.set_call_id(call_id);
  head.set_code(static_cast<int>(status.code()));
  std::string message(status.message());
  if (message.size() > limits_.max_status_message_bytes) {
    message.resize(limits_.max_status_message_bytes);
  }
  head.set_message(message);
  head.set_not_executed(not_executed);
  auto it = calls_.find(call_id);
  std::function<void(Status)> sent;
  if (it != calls_.end() && it->second->state && it->second->state->logged) {
    sent = SettleWhenSent(it->second->state, status, nullptr);
  }
  if (!conn_->SendFrame(FrameType::kResponse, &head, {}, sent).ok() && sent) {
    sent(absl::UnavailableError("RDMA connection closed"));
  }
  ForgetLocked(call_id);
}

std::function<void(Status)> ServerEndpoint::SettleWhenSent(
    std::shared_ptr<internal::ServerCallState> state, Status status,
    std::shared_ptr<std::unique_ptr<Message>> response) {
  return [dispatcher = dispatcher_, state = std::move(state),
          status = std::move(status),
          response = std::move(response)](Status sent) mutable {
    if (sent.ok()) return dispatcher->Delivered(*state);
    dispatcher->Undelivered(std::move(state), std::move(status),
                            response ? std::move(*response) : nullptr);
  };
}

Status ServerEndpoint::OnRequest(const FrameView& frame) {
  Status s = AdmitRequest(frame);
  ExecuteReady();
  return s;
}

Status ServerEndpoint::OnWriteLanded(uint32_t immediate) {
  Status s = LandWrite(immediate);
  ExecuteReady();
  return s;
}

void ServerEndpoint::ExecuteReady() {
  std::vector<ReadyCall> ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready.swap(ready_);
  }
  for (ReadyCall& c : ready) {
    dispatcher_->Execute(std::move(c.state), std::move(c.request),
                         std::move(c.done));
  }
}

Status ServerEndpoint::AdmitRequest(const FrameView& frame) {
  RDMARPC_ASSIGN_OR_RETURN(RequestHead head, ParseRequest(frame, limits_));
  std::lock_guard<std::mutex> lock(mu_);
  if (closed_) return absl::OkStatus();
  uint64_t call_id = head.call_id();
  if (calls_.contains(call_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("call id ", call_id, " is already in flight"));
  }
  auto record = std::make_unique<ServerRecord>();
  ServerRecord& r = *record;
  calls_.emplace(call_id, std::move(record));
  const internal::ServerMethod* method = dispatcher_->Find(head.method());
  if (method == nullptr) {
    FailLocked(call_id,
               absl::UnimplementedError(absl::StrCat(
                   "method ", head.method(), " is not served by this server")));
    return absl::OkStatus();
  }
  r.state =
      std::make_shared<internal::ServerCallState>(method, TransportKind::kRdma);
  r.state->peer = peer_;
  r.state->call_id = call_id;
  r.state->client_id = client_id_;
  if (head.timeout_us() > 0) {
    r.state->deadline = std::chrono::system_clock::now() +
                        std::chrono::microseconds(head.timeout_us());
  }
  for (const Metadata& m : head.metadata()) {
    r.state->client_metadata.emplace(m.key(), m.value());
  }
  auto in = ReceivePayload(
      head.parts(), frame.inline_bytes, dispatcher_->max_request_tensor_bytes(),
      {}, method->placement, method->descriptor.request_prototype,
      {conn_->pd(), gpu_mode_});
  if (!in.ok()) {
    FailLocked(call_id, in.status());
    return absl::OkStatus();
  }
  r.in = *std::move(in);
  // The grant goes to the client's receive buffers: a request it would not
  // fit is carried over gRPC instead.
  Status fits = CheckGrantFits(r.in.landing.size(), conn_->max_frame_bytes(),
                               "the request");
  if (!fits.ok()) {
    FailLocked(call_id, fits, /*not_executed=*/true);
    return absl::OkStatus();
  }
  uint64_t landing_bytes = 0;
  for (const TensorBuffer& b : r.in.landing) landing_bytes += b.size();
  if (landing_bytes > 0) {
    uint64_t before = shared_->landing_in_use.fetch_add(landing_bytes);
    r.landing = LandingReservation(shared_, landing_bytes);
    if (before + landing_bytes > shared_->landing_pool_bytes ||
        RDMARPC_FAULT("rdma.server.landing_pool_exhausted")) {
      FailLocked(
          call_id,
          absl::ResourceExhaustedError(absl::StrCat(
              "the server's RDMA landing pool is exhausted (", before, " of ",
              shared_->landing_pool_bytes,
              " bytes granted; this request needs ", landing_bytes, ")")),
          /*not_executed=*/true);
      return absl::OkStatus();
    }
  }
  Status registered = RegisterLandingMemory(&r.in, conn_->pd());
  if (!registered.ok()) {
    // Nothing ran: the client may carry the call over gRPC instead.
    FailLocked(call_id, registered, /*not_executed=*/true);
    return absl::OkStatus();
  }
  if (r.in.landing.empty()) {
    DispatchLocked(call_id);
    return absl::OkStatus();
  }
  Grant grant;
  grant.set_call_id(call_id);
  r.grant_id = next_grant_id_++;
  if (next_grant_id_ == 0) next_grant_id_ = 1;
  grant.set_grant_id(r.grant_id);
  AddGrantRegions(r.in, &grant);
  grants_[r.grant_id] = call_id;
  r.stage = ServerRecord::Stage::kAwaitRequestData;
  Status granted = conn_->SendFrame(FrameType::kGrant, &grant);
  // Not run: the client carries the call over gRPC (or, on a closing
  // connection, re-sends it).
  if (!granted.ok()) FailLocked(call_id, granted, /*not_executed=*/true);
  return absl::OkStatus();
}

Status ServerEndpoint::LandWrite(uint32_t immediate) {
  std::lock_guard<std::mutex> lock(mu_);
  auto g = grants_.find(immediate);
  if (g == grants_.end()) {
    return absl::InvalidArgumentError(
        absl::StrCat("write landed for unknown grant ", immediate));
  }
  uint64_t call_id = g->second;
  grants_.erase(g);
  ServerRecord& r = *calls_.at(call_id);
  r.grant_id = 0;
  if (r.stage != ServerRecord::Stage::kAwaitRequestData) {
    return absl::InvalidArgumentError("write landed for a running call");
  }
  DispatchLocked(call_id);
  return absl::OkStatus();
}

void ServerEndpoint::DispatchLocked(uint64_t call_id) {
  ServerRecord& r = *calls_.at(call_id);
  r.request.reset(r.state->method().descriptor.request_prototype->New());
  auto accepted = FinishPayload(
      &r.in, r.request.get(), r.state->method().placement,
      dispatcher_->max_request_tensor_bytes(), r.request, &r.state->tensors,
      /*consumer=*/nullptr);
  if (!accepted.ok()) return FailLocked(call_id, accepted.status());
  r.stage = ServerRecord::Stage::kRunning;
  {
    std::lock_guard<std::mutex> shared_lock(shared_->mu);
    ++shared_->handlers_running;
  }
  ready_.push_back(
      {r.state, r.request,
       [self = shared_from_this(), call_id, state = r.state](
           Status s, std::unique_ptr<Message> response) {
         self->Respond(call_id, state, std::move(s), std::move(response));
         std::lock_guard<std::mutex> shared_lock(self->shared_->mu);
         --self->shared_->handlers_running;
         self->shared_->cv.notify_all();
       }});
}

void ServerEndpoint::Respond(
    uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state,
    Status status, std::unique_ptr<Message> response) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(call_id);
  if (closed_ || it == calls_.end() || it->second->state != state) {
    // Disconnected (or cancelled): a logged call's outcome waits for the
    // client's re-send.
    if (state->logged) {
      dispatcher_->Undelivered(state, std::move(status), std::move(response));
    }
    return;
  }
  ServerRecord& r = *it->second;
  if (r.state->deadline &&
      std::chrono::system_clock::now() > *r.state->deadline) {
    return FailLocked(call_id,
                      absl::DeadlineExceededError(
                          "deadline passed before the handler finished"));
  }
  if (!status.ok()) return FailLocked(call_id, status);
  if (r.state->cancelled.load()) {
    return FailLocked(call_id, absl::CancelledError("call cancelled"));
  }
  ResponseHead head;
  head.set_call_id(call_id);
  size_t base = kPreambleBytes + head.ByteSizeLong();
  size_t room =
      conn_->max_frame_bytes() > base ? conn_->max_frame_bytes() - base : 0;
  auto out = PlanPayload(*response, r.state->tensors, room, inline_threshold_,
                         {conn_->pd(), gpu_mode_}, r.state->cuda_stream);
  if (!out.ok()) {
    return FailLocked(
        call_id, absl::InternalError(
                     absl::StrCat("handler built a response RDMA cannot send: ",
                                  out.status().message())));
  }
  // The client's grant for the written parts comes to our receive buffers.
  Status fits = CheckGrantFits(out->out_of_band.size(), conn_->receive_bytes(),
                               "the response");
  if (!fits.ok()) return FailLocked(call_id, fits);
  auto sources = RegisterSources(*out, cache_.get(), conn_->pd());
  if (!sources.ok()) return FailLocked(call_id, sources.status());
  r.sources = *std::move(sources);
  for (Part& p : out->parts) *head.add_parts() = std::move(p);
  out->parts.clear();
  r.out = *std::move(out);
  std::function<void(Status)> sent;
  if (r.sources.empty()) {
    // Inline only: delivered once the frame is acknowledged.
    if (state->logged) {
      sent = SettleWhenSent(
          state, absl::OkStatus(),
          std::make_shared<std::unique_ptr<Message>>(std::move(response)));
    }
  } else {
    // Delivered once the client has taken the written parts (OnGrant), or
    // kept for a re-send when it cannot (here, OnCancel, OnClosed).
    r.response = std::move(response);
  }
  // Fault injection: the connection starts closing just before the
  // response goes out, so its send fails.
  if (RDMARPC_FAULT("rdma.server.close_before_response")) {
    conn_->Close(absl::UnavailableError("fault: closed before the response"),
                 "fault");
  }
  Status queued =
      conn_->SendFrame(FrameType::kResponse, &head, r.out.inline_parts, sent);
  if (!queued.ok()) {
    if (sent) {
      sent(queued);
    } else if (state->logged) {
      dispatcher_->Undelivered(state, absl::OkStatus(), std::move(r.response));
    }
  }
  if (!queued.ok() || r.sources.empty()) {
    ForgetLocked(call_id);
    return;
  }
  r.stage = ServerRecord::Stage::kAwaitResponseGrant;
}

Status ServerEndpoint::OnGrant(const FrameView& frame) {
  RDMARPC_ASSIGN_OR_RETURN(uint64_t call_id, GrantCallId(frame));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(call_id);
  if (it == calls_.end() ||
      it->second->stage != ServerRecord::Stage::kAwaitResponseGrant) {
    return absl::InvalidArgumentError(
        absl::StrCat("grant for call ", call_id, ", which expects none"));
  }
  ServerRecord& r = *it->second;
  auto on_written = [weak = std::weak_ptr<ServerEndpoint>(shared_from_this()),
                     call_id](Status written) {
    auto self = weak.lock();
    if (!self) return;
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->calls_.find(call_id);
    if (it == self->calls_.end()) return;
    ServerRecord& rec = *it->second;
    if (!written.ok()) rec.write_error = written;
    if (--rec.writes_pending > 0) return;
    if (rec.state->logged) {
      if (rec.write_error.ok()) {
        self->dispatcher_->Delivered(*rec.state);
      } else {
        self->dispatcher_->Undelivered(rec.state, absl::OkStatus(),
                                       std::move(rec.response));
      }
    }
    self->ForgetLocked(call_id);
  };
  RDMARPC_ASSIGN_OR_RETURN(
      r.writes_pending,
      WriteGrantedParts(frame, r.out, r.sources, conn_, on_written));
  r.stage = ServerRecord::Stage::kWritingResponse;
  return absl::OkStatus();
}

void ServerEndpoint::OnCancel(uint64_t call_id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(call_id);
  if (it == calls_.end()) return;  // finished already
  ServerRecord& r = *it->second;
  if (r.state) r.state->cancelled.store(true);
  if (r.stage == ServerRecord::Stage::kAwaitResponseGrant && r.state->logged) {
    // A re-send racing the cancel still gets the outcome.
    dispatcher_->Undelivered(r.state, absl::OkStatus(), std::move(r.response));
  }
  if (r.stage == ServerRecord::Stage::kAwaitRequestData ||
      r.stage == ServerRecord::Stage::kAwaitResponseGrant) {
    ForgetLocked(call_id);  // ends the grant, drops the response
  }
}

void ServerEndpoint::OnClosed(const Status&) {
  std::shared_ptr<Connection> conn;
  std::vector<std::weak_ptr<internal::ServerCallState>> running;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = true;
    for (auto& [id, r] : calls_) {
      if (!r->state) continue;
      if (r->state->logged) {
        // The client re-sends it over gRPC: a running handler goes on, and
        // a response it could not take (or take whole) is kept for the
        // re-send; writes still in flight find no call and report nothing.
        if (r->stage == ServerRecord::Stage::kAwaitResponseGrant ||
            r->stage == ServerRecord::Stage::kWritingResponse) {
          dispatcher_->Undelivered(r->state, absl::OkStatus(),
                                   std::move(r->response));
        } else if (r->stage == ServerRecord::Stage::kRunning) {
          running.push_back(r->state);
        }
      } else {
        r->state->cancelled.store(true);
      }
    }
    calls_.clear();
    grants_.clear();
    if (cache_) cache_->Clear();
    conn = std::move(conn_);
  }
  if (conn && conn->broke_protocol()) shared_->protocol_errors.fetch_add(1);
  std::lock_guard<std::mutex> lock(shared_->mu);
  std::erase_if(shared_->detached, [](const auto& w) { return w.expired(); });
  shared_->detached.insert(shared_->detached.end(), running.begin(),
                           running.end());
  --shared_->endpoints_open;
  shared_->cv.notify_all();
}

RdmaServerTransport::RdmaServerTransport(internal::Dispatcher* dispatcher,
                                         const RdmaServerOptions& options)
    : dispatcher_(dispatcher),
      options_(options),
      shared_(std::make_shared<ServerShared>()) {}

StatusOr<std::unique_ptr<RdmaServerTransport>> RdmaServerTransport::Start(
    internal::Dispatcher* dispatcher, const RdmaServerOptions& options) {
  std::unique_ptr<RdmaServerTransport> t(
      new RdmaServerTransport(dispatcher, options));
  t->address_ = options.address;
  if (t->address_.empty()) {
    auto found = FindRdmaIpv4Address();
    if (!found.ok()) {
      return absl::FailedPreconditionError(found.status().message());
    }
    t->address_ = *found;
  }
  t->shared_->landing_pool_bytes = options.landing_pool_bytes;
  RDMARPC_ASSIGN_OR_RETURN(t->events_, CreateEventChannel());
  {
    std::lock_guard<std::mutex> lock(t->mu_);
    RDMARPC_RETURN_IF_ERROR(t->ListenLocked());
  }
  t->cm_thread_ = std::thread([raw = t.get()] { raw->CmLoop(); });
  pthread_setname_np(t->cm_thread_.native_handle(), "rdmarpc-cm");
  return t;
}

Status RdmaServerTransport::ListenLocked() {
  RDMARPC_ASSIGN_OR_RETURN(CmId id, CreateCmId(events_.get()));
  sockaddr_in sin{};
  sin.sin_family = AF_INET;
  if (inet_pton(AF_INET, address_.c_str(), &sin.sin_addr) != 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("RDMA address '", address_, "' is not IPv4"));
  }
  if (rdma_bind_addr(id.get(), reinterpret_cast<sockaddr*>(&sin)) != 0) {
    return VerbsError(absl::StrCat("rdma_bind_addr ", address_), errno);
  }
  if (rdma_listen(id.get(), 128) != 0) return VerbsError("rdma_listen", errno);
  port_ = ntohs(rdma_get_src_port(id.get()));
  if (id->verbs != nullptr) device_ = ibv_get_device_name(id->verbs->device);
  listen_id_ = std::move(id);
  not_listening_.clear();
  return absl::OkStatus();
}

void RdmaServerTransport::DropListener(const std::string& why) {
  std::lock_guard<std::mutex> lock(mu_);
  listen_id_.reset();
  not_listening_ = why;
  tokens_.clear();
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

StatusOr<std::string> RdmaServerTransport::Hello(const std::string& request) {
  RDMARPC_ASSIGN_OR_RETURN(HelloRequest hello, ParseHelloRequest(request));
  static thread_local std::random_device random;
  std::string token(kTokenBytes, '\0');
  for (size_t i = 0; i < kTokenBytes; i += 4) {
    uint32_t v = random();
    std::memcpy(token.data() + i, &v, 4);
  }
  auto now = std::chrono::steady_clock::now();
  HelloResponse response;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return HelloUnavailable("the server is shutting down");
    if (!not_listening_.empty()) return HelloUnavailable(not_listening_);
    for (auto it = tokens_.begin(); it != tokens_.end();) {
      it = it->second.expires < now ? tokens_.erase(it) : std::next(it);
    }
    if (tokens_.size() >= 4096) {
      return absl::ResourceExhaustedError(
          "too many RDMA handshakes waiting for their connect");
    }
    tokens_[token] = Token{now + options_.token_lifetime, hello.client_id()};
    response.set_cm_port(port_);
  }
  response.set_version(kWireVersion);
  response.set_cm_address(address_);
  response.set_server_instance(dispatcher_->server_instance());
  response.set_token(token);
  response.set_receives(options_.receives);
  response.set_receive_bytes(options_.receive_bytes);
  response.set_inline_threshold(options_.inline_threshold);
  return response.SerializeAsString();
}

void RdmaServerTransport::CmLoop() {
  auto next_listen = std::chrono::steady_clock::now();
  while (!stop_.load()) {
    {
      // Listen again once the device is back (rxe re-added, driver reset).
      std::lock_guard<std::mutex> lock(mu_);
      auto now = std::chrono::steady_clock::now();
      if (!not_listening_.empty() && now >= next_listen) {
        ForgetRemovedRdmaDevices();
        Status listened = ListenLocked();
        if (!listened.ok()) {
          not_listening_ = absl::StrCat(
              "the server's RDMA device went away and listening again "
              "failed: ",
              listened.message());
        }
        next_listen = now + std::chrono::milliseconds(200);
      }
    }
    auto event = NextCmEvent(events_.get(), std::chrono::milliseconds(100));
    if (!event.ok()) continue;
    bool listener = false;
    {
      std::lock_guard<std::mutex> lock(mu_);
      listener = listen_id_ && event->id == listen_id_.get();
    }
    switch (event->type) {
      case RDMA_CM_EVENT_CONNECT_REQUEST:
        OnConnectRequest(*event);
        break;
      case RDMA_CM_EVENT_ESTABLISHED:
        shared_->accepted.fetch_add(1);
        break;
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        if (listener) {
          DropListener(
              "the server's RDMA device was removed; it listens again when "
              "the device returns");
          break;
        }
        [[fallthrough]];
      case RDMA_CM_EVENT_DISCONNECTED:
      case RDMA_CM_EVENT_CONNECT_ERROR:
      case RDMA_CM_EVENT_UNREACHABLE: {
        std::shared_ptr<ServerEndpoint> endpoint;
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = endpoints_.find(event->id);
          if (it != endpoints_.end()) {
            endpoint = it->second;
            endpoints_.erase(it);
          }
        }
        if (endpoint) {
          if (auto conn = endpoint->connection()) {
            conn->Close(absl::UnavailableError(absl::StrCat(
                "client left (", rdma_event_str(event->type), ")")));
          }
        }
        break;
      }
      default:
        break;
    }
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
  uint64_t client_id = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = tokens_.find(data->token);
    if (shut_down_ || it == tokens_.end() ||
        it->second.expires < std::chrono::steady_clock::now()) {
      if (it != tokens_.end()) tokens_.erase(it);
      return refuse("no valid token");
    }
    client_id = it->second.client_id;
    tokens_.erase(it);
  }
  if (!CheckReceives(data->receives, data->receive_bytes, "the client").ok()) {
    return refuse("receive sizes out of range");
  }
  ConnectionConfig config;
  config.receives = options_.receives;
  config.receive_bytes = options_.receive_bytes;
  config.peer_receives = data->receives;
  config.peer_receive_bytes = data->receive_bytes;
  char peer_text[INET6_ADDRSTRLEN] = "?";
  sockaddr* dst = rdma_get_peer_addr(event.id);
  if (dst != nullptr && dst->sa_family == AF_INET) {
    inet_ntop(AF_INET, &reinterpret_cast<sockaddr_in*>(dst)->sin_addr,
              peer_text, sizeof(peer_text));
  }
  auto endpoint = std::make_shared<ServerEndpoint>(
      dispatcher_, shared_, options_.inline_threshold, options_.gpu_rdma_mode,
      absl::StrCat("rdma:", peer_text), client_id);
  auto resources = BuildResources(EventChannel(), CmId(event.id), &config);
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
  rdma_conn_param param{};
  param.rnr_retry_count = 0;
  param.retry_count = 7;
  if (auto delay = internal::fault::Take("rdma.server.accept_delay_ms")) {
    std::this_thread::sleep_for(std::chrono::milliseconds(*delay));
  }
  if (rdma_accept(event.id, &param) != 0) {
    (*conn)->Close(VerbsError("rdma_accept", errno));
  }
  {
    std::lock_guard<std::mutex> lock(shared_->mu);
    ++shared_->endpoints_open;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    endpoints_[event.id] = endpoint;
  }
  Status added = Engine::Get().Add(*conn);
  if (!added.ok()) (*conn)->Close(added);
}

void RdmaServerTransport::Shutdown(
    std::chrono::system_clock::time_point deadline) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (shut_down_) return;
    shut_down_ = true;
    tokens_.clear();
  }
  stop_.store(true);
  if (cm_thread_.joinable()) cm_thread_.join();
  auto running = [this] { return shared_->handlers_running == 0; };
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
  {
    std::lock_guard<std::mutex> lock(mu_);
    s.status = not_listening_.empty()
                   ? absl::StrCat("listening on ", address_, ":", port_, " (",
                                  device_, ")")
                   : not_listening_;
  }
  s.connections_accepted = shared_->accepted.load();
  s.connects_refused = shared_->refused.load();
  s.protocol_errors = shared_->protocol_errors.load();
  return s;
}

}  // namespace rdmarpc::rdma
