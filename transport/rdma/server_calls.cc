#include "transport/rdma/server_calls.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "absl/cleanup/cleanup.h"
#include "absl/strings/str_cat.h"
#include "runtime/coarse_clock.h"
#include "runtime/completion.h"
#include "runtime/fault_injection.h"
#include "runtime/request_arena.h"
#include "runtime/spin.h"
#include "transport/rdma/payload.h"

namespace rdmarpc::rdma {

using google::protobuf::Message;

namespace {

// The handler's metadata, into the response head it goes out with (views
// into `state`, which must outlive the head).
void AddResponseMetadata(const internal::ServerCallState& state,
                         ResponseHead* head) {
  for (const auto& [k, v] : state.initial_metadata) {
    head->initial_metadata.push_back({k, v});
  }
  for (const auto& [k, v] : state.trailing_metadata) {
    head->trailing_metadata.push_back({k, v});
  }
}

}  // namespace

struct ServerRecord {
  enum class Stage {
    kRegistering,       // waiting for windows, or large landing memory
                        // being registered aside
    kAwaitRequestData,  // landing memory granted, client writing
    kEndingGrant,       // written; windows invalidated, large landing
                        // regions deregistered aside
    kRunning,           // handler queued or running
    kAwaitResponseGrant,
    kWritingResponse,
  };
  Stage stage = Stage::kAwaitRequestData;
  std::shared_ptr<internal::ServerCallState> state;
  std::shared_ptr<google::protobuf::Message> request;
  IncomingPayload in;
  LandingReservation landing;
  bool landing_aside = false;  // registered and deregistered aside
  uint32_t grant_id = 0;
  std::shared_ptr<google::protobuf::Message> response;
  OutgoingPayload out;
  std::vector<LocalMemory> sources;
  int writes_pending = 0;
  Status write_error;  // of a response write
  // A response write moved since the last pong: the pong names the call,
  // so the client's progress watch sees a slow transfer that moves.
  bool moved_since_pong = false;
};

ServerEndpoint::ServerEndpoint(internal::Dispatcher* dispatcher,
                               std::shared_ptr<ServerShared> shared,
                               uint64_t threshold, GpuRdmaMode gpu_mode,
                               std::string peer, uint64_t client_id)
    : dispatcher_(dispatcher),
      shared_(std::move(shared)),
      inline_threshold_(threshold),
      gpu_mode_(gpu_mode),
      peer_(std::make_shared<const std::string>(std::move(peer))),
      client_id_(client_id) {}

ServerEndpoint::~ServerEndpoint() = default;

void ServerEndpoint::Attach(std::shared_ptr<Connection> conn) {
  std::lock_guard<std::mutex> lock(mu_);
  conn_ = std::move(conn);
  cache_ = RegistrationCache::Create(conn_->pd());
  attached_ = conn_;
}

std::shared_ptr<Connection> ServerEndpoint::connection() {
  std::lock_guard<std::mutex> lock(mu_);
  return conn_;
}

void ServerEndpoint::Abandon(const Status& why) {
  if (std::shared_ptr<Connection> conn = connection()) {
    conn->Close(why, "client re-sent a call");
  }
}

void ServerEndpoint::CancelAll() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [id, r] : calls_) r->state->cancelled.store(true);
}

Status ServerEndpoint::OnFrame(const FrameView& frame) {
  // Fault injection: a server that stops answering on RDMA while its gRPC
  // port still does.
  if (RDMARPC_FAULT("rdma.server.ignore_frames")) return absl::OkStatus();
  switch (frame.type) {
    case FrameType::kPing: {
      RDMARPC_ASSIGN_OR_RETURN(Ping ping, ParsePing(frame));
      std::lock_guard<std::mutex> lock(mu_);
      if (closed_) return absl::OkStatus();
      // Tells the client which of its calls are busy here, not stuck.
      ping.clear_running_call_ids();
      // A write waiting for the process's poster thread is our backlog,
      // not a stuck path: responses being written count as moving then.
      const auto now = internal::CoarseSteadyNow();
      const bool poster_backlog = conn_->NotStillBefore(now) == now;
      for (const auto& [id, r] : calls_) {
        if (ping.running_call_ids_size() >= kMaxRunningInPong) break;
        const bool writing_moved =
            r->stage == ServerRecord::Stage::kWritingResponse &&
            (std::exchange(r->moved_since_pong, false) || poster_backlog);
        if (r->stage == ServerRecord::Stage::kRunning ||
            r->stage == ServerRecord::Stage::kRegistering ||
            r->stage == ServerRecord::Stage::kEndingGrant || writing_moved) {
          ping.add_running_call_ids(id);
        }
      }
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
  grants_.Forget(it->second->grant_id);
  std::unique_ptr<ServerRecord> record = std::move(it->second);
  calls_.erase(it);
  spare_record_.Give(std::move(record));
  if (calls_.empty()) went_idle_ticks_ = internal::SpinClock::Get().Now();
}

void ServerEndpoint::FailLocked(uint64_t call_id, const Status& status,
                                bool not_executed,
                                const internal::ServerCallState* answered) {
  ResponseHead head;
  head.call_id = call_id;
  head.code = static_cast<int>(status.code());
  head.not_executed = not_executed;
  if (answered != nullptr) AddResponseMetadata(*answered, &head);
  // The message is cut to what the peer takes, and to what still fits in
  // one frame beside the metadata.
  const size_t used = kPreambleBytes + FrameHead(&head).bytes();
  const size_t fits =
      conn_->max_frame_bytes() > used ? conn_->max_frame_bytes() - used : 0;
  head.message =
      std::string_view(status.message().data(), status.message().size())
          .substr(0, std::min(limits_.max_status_message_bytes, fits));
  auto it = calls_.find(call_id);
  std::function<void(Status)> sent;
  if (it != calls_.end() && it->second->state && it->second->state->logged) {
    sent = SettleWhenSent(it->second->state, status, nullptr);
  }
  // On an error SendFrame leaves `sent` as it was.
  if (!conn_->SendFrame(FrameType::kResponse, &head, {}, std::move(sent))
           .ok() &&
      sent) {
    sent(absl::UnavailableError("RDMA connection closed"));
  }
  ForgetLocked(call_id);
}

std::function<void(Status)> ServerEndpoint::SettleWhenSent(
    std::shared_ptr<internal::ServerCallState> state, Status status,
    std::shared_ptr<Message> response) {
  return [dispatcher = dispatcher_, state = std::move(state),
          status = std::move(status),
          response = std::move(response)](Status sent) mutable {
    if (sent.ok()) return dispatcher->Delivered(*state);
    dispatcher->Undelivered(std::move(state), std::move(status),
                            std::move(response));
  };
}

Status ServerEndpoint::OnRequest(const FrameView& frame) {
  ReadyCalls ready;
  Status s = AdmitRequest(frame, &ready);
  Execute(ready);
  return s;
}

Status ServerEndpoint::OnWriteLanded(uint32_t immediate) {
  Status s = LandWrite(immediate);
  ExecuteReady();
  return s;
}

void ServerEndpoint::ExecuteReady() {
  ReadyCalls ready;
  {
    std::lock_guard<std::mutex> lock(mu_);
    ready.swap(ready_);
  }
  Execute(ready);
}

void ServerEndpoint::Execute(ReadyCalls& ready) {
  for (ReadyCall& c : ready) {
    dispatcher_->Execute(std::move(c.state), std::move(c.request),
                         std::move(c.done));
  }
}

Status ServerEndpoint::AdmitRequest(const FrameView& frame, ReadyCalls* ready) {
  RequestHead head;
  RDMARPC_RETURN_IF_ERROR(ParseRequest(frame, limits_, &head));
  std::lock_guard<std::mutex> lock(mu_);
  // Declared after the lock, so it runs before the lock is released.
  absl::Cleanup take_ready = [&] { ready->swap(ready_); };
  if (closed_) return absl::OkStatus();
  if (went_idle_ticks_ != 0) {
    // How long this connection stayed idle: what the engine's spin must
    // outlast to catch a client calling back to back.
    internal::RecordIdleGap(internal::SpinClock::Get().Now() -
                            went_idle_ticks_);
    went_idle_ticks_ = 0;
  }
  uint64_t call_id = head.call_id;
  if (calls_.contains(call_id)) {
    return absl::InvalidArgumentError(
        absl::StrCat("call id ", call_id, " is already in flight"));
  }
  std::unique_ptr<ServerRecord> record = spare_record_.Take();
  ServerRecord& r = *record;
  calls_.emplace(call_id, std::move(record));
  const internal::ServerMethod* method = dispatcher_->Find(head.method);
  if (method == nullptr) {
    FailLocked(call_id,
               absl::UnimplementedError(absl::StrCat(
                   "method ",
                   absl::string_view(head.method.data(), head.method.size()),
                   " is not served by this server")));
    return absl::OkStatus();
  }
  r.state =
      std::make_shared<internal::ServerCallState>(method, TransportKind::kRdma);
  r.state->peer = peer_;
  r.state->connection_calls = calls_running_;
  r.state->call_id = call_id;
  r.state->client_id = client_id_;
  r.state->response_path = weak_from_this();
  if (head.timeout_us > 0) {
    r.state->deadline = std::chrono::system_clock::now() +
                        std::chrono::microseconds(head.timeout_us);
  }
  for (const MetadataView& m : head.metadata) {
    r.state->client_metadata.emplace(m.key, m.value);
  }
  Status received = ReceivePayload(
      head.parts, frame.inline_bytes, dispatcher_->max_request_tensor_bytes(),
      {}, method->placement, method->descriptor.request_prototype,
      {conn_->pd(), gpu_mode_}, &r.in);
  if (!received.ok()) {
    FailLocked(call_id, received);
    return absl::OkStatus();
  }
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
    auto held = shared_->landing->Reserve(landing_bytes);
    if (!held.ok()) {
      FailLocked(call_id, held.status(), /*not_executed=*/true);
      return absl::OkStatus();
    }
    r.landing = *std::move(held);
  }
  if (r.in.landing.empty()) {
    DispatchLocked(call_id);
    return absl::OkStatus();
  }
  // The windows for its landings first: when other grants hold them, it
  // waits for theirs to end (GrantWithWindows).
  const bool reserved = ReserveLandingWindows(&r.in, conn_.get(), [&] {
    return Connection::WindowsReady(
        [self = weak_from_this(), call_id, state = r.state](
            Status ready, Connection::WindowGrants windows) {
          if (auto endpoint = self.lock()) {
            endpoint->GrantWithWindows(call_id, state, std::move(ready),
                                       std::move(windows));
          }
        });
  });
  if (!reserved) {
    r.stage = ServerRecord::Stage::kRegistering;
    shared_->landing_window_waits.fetch_add(1, std::memory_order_relaxed);
    return absl::OkStatus();
  }
  GrantReservedLocked(call_id);
  return absl::OkStatus();
}

void ServerEndpoint::GrantWithWindows(
    uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state,
    Status ready, Connection::WindowGrants windows) {
  std::lock_guard<std::mutex> lock(mu_);
  ServerRecord* r = FindAtStageLocked(
      call_id, state, static_cast<int>(ServerRecord::Stage::kRegistering));
  // Cancelled or closed meanwhile: the windows go back.
  if (r == nullptr) return;
  if (!ready.ok()) {
    return FailLocked(call_id, std::move(ready), /*not_executed=*/true);
  }
  r->in.windows = std::move(windows);
  GrantReservedLocked(call_id);
}

void ServerEndpoint::GrantReservedLocked(uint64_t call_id) {
  ServerRecord& r = *calls_.at(call_id);
  uint64_t landing_bytes = 0;
  for (const TensorBuffer& b : r.in.landing) landing_bytes += b.size();
  // A window over the arena's block grants a landing of any size at the
  // cost of a posted bind.
  if (landing_bytes >= kRegisterAsideBytes &&
      !GrantThroughWindow(&r.in, conn_.get())) {
    // Pinning its pages would hold the engine, and so every connection it
    // polls: registered aside, and granted from there.
    r.landing_aside = true;
    r.stage = ServerRecord::Stage::kRegistering;
    RunAside([self = shared_from_this(), call_id, state = r.state,
              in = std::make_shared<IncomingPayload>(std::move(r.in)),
              conn = conn_] {
      // Fault injection: a test holds the registration thread here.
      internal::fault::HoldWhileArmed("rdma.server.hold_registration",
                                      "rdma.server.registration_held");
      Status registered = RegisterLandingMemory(in.get(), conn.get());
      self->GrantRegistered(call_id, state, std::move(*in),
                            std::move(registered));
    });
    return;
  }
  Status registered = RegisterLandingMemory(&r.in, conn_.get());
  if (!registered.ok()) {
    // Nothing ran: the client may carry the call over gRPC instead.
    FailLocked(call_id, registered, /*not_executed=*/true);
    return;
  }
  GrantLocked(call_id);
}

void ServerEndpoint::GrantLocked(uint64_t call_id) {
  ServerRecord& r = *calls_.at(call_id);
  shared_->landing_windows.fetch_add(r.in.windows.size(),
                                     std::memory_order_relaxed);
  shared_->landing_registrations.fetch_add(r.in.registrations,
                                           std::memory_order_relaxed);
  Grant grant = grants_.Issue(call_id, r.in);
  r.grant_id = grant.grant_id();
  r.stage = ServerRecord::Stage::kAwaitRequestData;
  Status granted = conn_->SendFrame(FrameType::kGrant, &grant);
  // Not run: the client carries the call over gRPC (or, on a closing
  // connection, re-sends it).
  if (!granted.ok()) FailLocked(call_id, granted, /*not_executed=*/true);
}

ServerRecord* ServerEndpoint::FindAtStageLocked(
    uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state,
    int stage) {
  auto it = calls_.find(call_id);
  if (closed_ || it == calls_.end() || it->second->state != state ||
      static_cast<int>(it->second->stage) != stage) {
    return nullptr;
  }
  return it->second.get();
}

void ServerEndpoint::GrantRegistered(
    uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state,
    IncomingPayload in, Status registered) {
  std::lock_guard<std::mutex> lock(mu_);
  ServerRecord* r = FindAtStageLocked(
      call_id, state, static_cast<int>(ServerRecord::Stage::kRegistering));
  // Cancelled or closed meanwhile: `in` and its registrations go here.
  if (r == nullptr) return;
  r->in = std::move(in);
  if (!registered.ok()) {
    return FailLocked(call_id, registered, /*not_executed=*/true);
  }
  GrantLocked(call_id);
}

void ServerEndpoint::DispatchAfterGrant(
    uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (FindAtStageLocked(
            call_id, state,
            static_cast<int>(ServerRecord::Stage::kEndingGrant)) == nullptr) {
      return;
    }
    // Its windows ended: regions registered aside go there next.
    if (DeregisterAsideLocked(call_id)) return;
    DispatchLocked(call_id);
  }
  ExecuteReady();
}

bool ServerEndpoint::DeregisterAsideLocked(uint64_t call_id) {
  ServerRecord& r = *calls_.at(call_id);
  if (!r.landing_aside || !HoldsLandingRegions(r.in)) return false;
  // Unpinning its pages would hold the engine: deregistered aside,
  // dispatched from there.
  RunAside([self = shared_from_this(), call_id, state = r.state,
            mrs = std::make_shared<std::vector<MemoryRegion>>(
                std::move(r.in.landing_mrs)),
            conn = conn_] {
    mrs->clear();
    self->DispatchAfterGrant(call_id, state);
  });
  return true;
}

Status ServerEndpoint::LandWrite(uint32_t immediate) {
  std::lock_guard<std::mutex> lock(mu_);
  RDMARPC_ASSIGN_OR_RETURN(uint64_t call_id, grants_.Redeem(immediate));
  ServerRecord& r = *calls_.at(call_id);
  r.grant_id = 0;
  if (r.stage != ServerRecord::Stage::kAwaitRequestData) {
    return absl::InvalidArgumentError("write landed for a running call");
  }
  // The grant ends before the handler reads the bytes: its windows once
  // their invalidations completed (on this thread, later), or now if the
  // connection is closing; then its regions.
  r.stage = ServerRecord::Stage::kEndingGrant;
  // `this` outlives it: the connection holds its handler until after the
  // last continuation (and it is small enough for no allocation).
  if (EndLandingWindows(&r.in, [this, call_id](Status) {
        std::shared_ptr<internal::ServerCallState> state;
        {
          std::lock_guard<std::mutex> lock(mu_);
          auto it = calls_.find(call_id);
          if (it == calls_.end()) return;
          state = it->second->state;
        }
        DispatchAfterGrant(call_id, state);
      })) {
    return absl::OkStatus();
  }
  if (DeregisterAsideLocked(call_id)) return absl::OkStatus();
  DispatchLocked(call_id);
  return absl::OkStatus();
}

void ServerEndpoint::DispatchLocked(uint64_t call_id) {
  ServerRecord& r = *calls_.at(call_id);
  r.request = internal::RequestArena::New(
      *r.state->method().descriptor.request_prototype);
  auto accepted = FinishPayload(
      &r.in, r.request.get(), r.state->method().placement,
      dispatcher_->max_request_tensor_bytes(), r.request, &r.state->tensors,
      /*consumer=*/nullptr);
  if (!accepted.ok()) return FailLocked(call_id, accepted.status());
  r.stage = ServerRecord::Stage::kRunning;
  shared_->handlers_running.fetch_add(1);
  ready_.push_back(
      {r.state, r.request,
       [self = shared_from_this(), call_id, state = r.state](
           Status s, std::shared_ptr<Message> response) {
         self->Respond(call_id, state, std::move(s), std::move(response));
         if (self->shared_->handlers_running.fetch_sub(1) == 1 &&
             self->shared_->shutdown_waits.load()) {
           // A shutdown waits for 0 under mu: notified under it too, so it
           // cannot miss this between its look and its wait.
           std::lock_guard<std::mutex> shared_lock(self->shared_->mu);
           self->shared_->cv.notify_all();
         }
       }});
}

ServerRecord* ServerEndpoint::RespondableLocked(
    uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state,
    Status* status, std::shared_ptr<Message>* response) {
  auto it = calls_.find(call_id);
  if (closed_ || it == calls_.end() || it->second->state != state) {
    // Disconnected (or cancelled): a logged call's outcome waits for the
    // client's re-send.
    if (state->logged) {
      dispatcher_->Undelivered(state, std::move(*status), std::move(*response));
    }
    return nullptr;
  }
  if (state->deadline && std::chrono::system_clock::now() > *state->deadline) {
    FailLocked(call_id,
               absl::DeadlineExceededError(
                   "deadline passed before the handler finished"),
               false, state.get());
    return nullptr;
  }
  if (!status->ok()) {
    FailLocked(call_id, *status, false, state.get());
    return nullptr;
  }
  if (state->cancelled.load()) {
    FailLocked(call_id, absl::CancelledError("call cancelled"), false,
               state.get());
    return nullptr;
  }
  return it->second.get();
}

void ServerEndpoint::Respond(
    uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state,
    Status status, std::shared_ptr<Message> response) {
  // The response is planned without mu_; RegisterAndSend decides under it
  // whether the call still takes it.
  std::shared_ptr<Connection> conn;
  if (status.ok() && !state->cancelled.load()) conn = attached_.lock();
  if (conn == nullptr) {
    // A failed or cancelled handler, or a connection gone: the call is
    // settled now, with no response planned.
    std::lock_guard<std::mutex> lock(mu_);
    if (RespondableLocked(call_id, state, &status, &response) == nullptr) {
      return;
    }
    conn = conn_;  // not reached: an open connection's conn_ keeps it
  }
  // Never replaced after Attach (a close only clears it).
  std::shared_ptr<RegistrationCache> cache = cache_;
  ResponseHead head;
  head.call_id = call_id;
  AddResponseMetadata(*state, &head);
  size_t base = kPreambleBytes + FrameHead(&head).bytes();
  size_t room =
      conn->max_frame_bytes() > base ? conn->max_frame_bytes() - base : 0;
  auto out =
      PlanPayload(*response, state->tensors, room, inline_threshold_,
                  {conn->pd(), gpu_mode_}, state->cuda_stream, &head.parts);
  Status planned = out.ok()
                       ? CheckGrantFits(out->out_of_band.size(),
                                        conn->receive_bytes(), "the response")
                       : absl::InternalError(absl::StrCat(
                             "handler built a response RDMA cannot send: ",
                             out.status().message()));
  if (!planned.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    if (RespondableLocked(call_id, state, &status, &response) != nullptr) {
      FailLocked(call_id, planned, false, state.get());
    }
    return;
  }
  if (out->tensor_bytes >= kRegisterAsideBytes && internal::OnPollerThread()) {
    // An inline handler's large response: pinning its pages would hold
    // the engine, and so every connection it polls. Registered aside, and
    // sent from there; the call counts as running meanwhile. (The head's
    // views point into `state`, which goes along.)
    RunAside([self = shared_from_this(), call_id, state, conn, cache,
              head = std::make_shared<ResponseHead>(std::move(head)),
              out = std::make_shared<OutgoingPayload>(*std::move(out)),
              response = std::move(response)]() mutable {
      // Fault injection: a test holds the registration thread here.
      internal::fault::HoldWhileArmed("rdma.server.hold_response_registration",
                                      "rdma.server.response_registration_held");
      self->RegisterAndSend(call_id, state, conn, cache, *head, std::move(*out),
                            std::move(response));
    });
    return;
  }
  RegisterAndSend(call_id, state, conn, cache, head, *std::move(out),
                  std::move(response));
}

void ServerEndpoint::RegisterAndSend(
    uint64_t call_id, const std::shared_ptr<internal::ServerCallState>& state,
    const std::shared_ptr<Connection>& conn,
    const std::shared_ptr<RegistrationCache>& cache, const ResponseHead& head,
    OutgoingPayload out, std::shared_ptr<Message> response) {
  // Off the lock: pinning the pages of an unregistered source takes time
  // in proportion to its size, and frames of this connection need mu_.
  auto sources = RegisterSources(out, cache.get(), conn->pd());
  std::lock_guard<std::mutex> lock(mu_);
  Status status;
  ServerRecord* found = RespondableLocked(call_id, state, &status, &response);
  if (found == nullptr) {
    // A closed connection has cleared the cache: what this registration
    // added to it goes now, while `conn` keeps the protection domain.
    if (closed_) cache->Clear();
    return;
  }
  if (!sources.ok()) {
    return FailLocked(call_id, sources.status(), false, state.get());
  }
  ServerRecord& r = *found;
  r.sources = *std::move(sources);
  r.out = std::move(out);
  std::function<void(Status)> sent;
  if (r.sources.empty()) {
    // Inline only: delivered once the frame is acknowledged.
    if (state->logged) {
      sent = SettleWhenSent(state, absl::OkStatus(), std::move(response));
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
  // Fault injection: the response frame is lost on a path that drops
  // packets; whether it arrived stays open until the connection closes.
  if (RDMARPC_FAULT("rdma.server.lose_response")) {
    if (sent) lost_sends_.push_back(std::move(sent));
    if (r.sources.empty()) return ForgetLocked(call_id);
    r.stage = ServerRecord::Stage::kAwaitResponseGrant;
    return;
  }
  // On an error SendFrame leaves `sent` as it was.
  Status queued =
      conn_->SendFrame(FrameType::kResponse, &head, r.out.inline_parts,
                       std::move(sent), r.out.message_part);
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
    rec.moved_since_pong = true;
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
  auto moved = [weak = std::weak_ptr<ServerEndpoint>(shared_from_this()),
                call_id] {
    auto self = weak.lock();
    if (!self) return;
    std::lock_guard<std::mutex> lock(self->mu_);
    auto it = self->calls_.find(call_id);
    if (it != self->calls_.end()) it->second->moved_since_pong = true;
  };
  RDMARPC_ASSIGN_OR_RETURN(
      r.writes_pending,
      WriteGrantedParts(frame, r.out, r.sources, conn_, on_written, moved));
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
  if (r.stage == ServerRecord::Stage::kRegistering ||
      r.stage == ServerRecord::Stage::kAwaitRequestData ||
      r.stage == ServerRecord::Stage::kEndingGrant ||
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
    // With a client id, the client re-sends its calls over gRPC: a running
    // handler goes on, and a response it could not take (or take whole)
    // is kept for the re-send; writes still in flight find no call and
    // report nothing. Decided by the connection, not by the call's
    // `logged`: a dispatched call is logged by whichever thread runs
    // Execute, maybe after this, and cancelling it would answer its
    // re-send CANCELLED.
    const bool resent = client_id_ != 0;
    for (auto& [id, r] : calls_) {
      if (!r->state) continue;
      if (resent && (r->stage == ServerRecord::Stage::kAwaitResponseGrant ||
                     r->stage == ServerRecord::Stage::kWritingResponse)) {
        dispatcher_->Undelivered(r->state, absl::OkStatus(),
                                 std::move(r->response));
      } else if (resent && r->stage == ServerRecord::Stage::kRunning) {
        running.push_back(r->state);
      } else {
        r->state->cancelled.store(true);
      }
    }
    for (auto& sent : lost_sends_) {
      sent(absl::UnavailableError("RDMA connection closed"));
    }
    lost_sends_.clear();
    calls_.clear();
    grants_.Clear();
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

}  // namespace rdmarpc::rdma
