#include "transport/rdma/rdma_client.h"

#include <pthread.h>

#include <algorithm>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/access.h"
#include "runtime/completion.h"
#include "runtime/fault_injection.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/payload.h"
#include "transport/rdma/registration.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {
namespace {

using Clock = std::chrono::system_clock;

// A call between Start and its completion.
struct ClientRecord {
  enum class Stage {
    kAwaitGrant,         // request written once the server grants memory
    kAwaitResponse,      // request delivered (or being written)
    kAwaitResponseData,  // response memory granted, server writing
  };
  internal::ClientCall call;
  OutgoingPayload out;
  std::vector<LocalMemory> sources;  // one per out-of-band part
  Stage stage = Stage::kAwaitGrant;
  int writes_pending = 0;
  // A result decided while the device still reads or writes this call's
  // memory; delivered once it no longer does.
  std::optional<Status> deferred;
  IncomingPayload in;
  uint32_t grant_id = 0;
  uint64_t received_bytes = 0;
  uint64_t response_copied = 0;
  std::optional<Clock::time_point> deadline;
  std::chrono::steady_clock::time_point sent_at;
};

// What to do with a call once the endpoint's lock is released.
struct Outcome {
  enum class Next {
    kComplete,  // run the callback with `status`
    kReroute,   // nothing reached a handler: gRPC carries it
    kResend,    // the connection failed with it in flight: re-send
  };
  std::unique_ptr<ClientRecord> record;
  Status status;
  Next next = Next::kComplete;
};

}  // namespace

class ClientEndpoint final
    : public Connection::Handler,
      public std::enable_shared_from_this<ClientEndpoint> {
 public:
  ClientEndpoint(internal::FastPathHooks hooks, uint64_t server_instance,
                 uint64_t inline_threshold, GpuRdmaMode gpu_mode,
                 std::string description)
      : hooks_(std::move(hooks)),
        server_instance_(server_instance),
        inline_threshold_(inline_threshold),
        gpu_mode_(gpu_mode),
        description_(std::move(description)) {}

  void Attach(std::shared_ptr<Connection> conn) {
    std::lock_guard<std::mutex> lock(mu_);
    conn_ = std::move(conn);
    cache_ = RegistrationCache::Create(conn_->pd());
  }

  Status health() const {
    std::lock_guard<std::mutex> lock(mu_);
    return closed_;
  }

  // Calls outstanding, and when the last one started (for the silence
  // check).
  size_t outstanding(std::chrono::steady_clock::time_point* last_start) const {
    std::lock_guard<std::mutex> lock(mu_);
    *last_start = last_start_;
    return calls_.size();
  }

  // From now on a closing connection fails its calls instead of re-sending
  // them (the channel is going away).
  void BeginShutdown() {
    std::lock_guard<std::mutex> lock(mu_);
    shutting_down_ = true;
  }
  // Returns once OnClosed has run.
  void WaitClosed() {
    std::unique_lock<std::mutex> lock(mu_);
    closed_cv_.wait(lock, [this] { return on_closed_done_; });
  }

  void Start(internal::ClientCall call);
  void Cancel(uint64_t call_id, Status why);
  // Cancels calls past their deadline; returns how long until the next.
  std::chrono::milliseconds ExpireDeadlines();

  Status OnFrame(const FrameView& frame) override;
  Status OnWriteLanded(uint32_t immediate) override;
  void OnClosed(const Status& why) override;

 private:
  Status OnGrant(const FrameView& frame, std::vector<Outcome>* outcomes);
  Status OnResponse(const FrameView& frame, std::vector<Outcome>* outcomes);
  // Removes the call and queues its completion (or defers it while writes
  // are pending). Requires mu_.
  void FinishLocked(uint64_t call_id, Status status,
                    std::vector<Outcome>* outcomes,
                    Outcome::Next next = Outcome::Next::kComplete);
  void Complete(std::vector<Outcome> outcomes);
  void SendCancelLocked(uint64_t call_id);
  // Once every response part is in: binds the response and its tensors,
  // ordered before the caller's CUDA stream when it named one.
  static Status AcceptResponse(ClientRecord& r);

  const internal::FastPathHooks hooks_;
  const uint64_t server_instance_;
  const uint64_t inline_threshold_;
  const GpuRdmaMode gpu_mode_;
  const std::string description_;
  WireLimits limits_;

  mutable std::mutex mu_;
  std::shared_ptr<Connection> conn_;
  std::shared_ptr<RegistrationCache> cache_;
  Status closed_;
  std::map<uint64_t, std::unique_ptr<ClientRecord>> calls_;
  std::map<uint32_t, uint64_t> grants_;  // grant id -> call id
  std::set<uint64_t> early_cancels_;
  uint32_t next_grant_id_ = 1;
  std::chrono::steady_clock::time_point last_start_;
  bool shutting_down_ = false;
  bool on_closed_done_ = false;
  std::condition_variable closed_cv_;
};

namespace {

class RdmaCanceller final : public internal::CallCanceller {
 public:
  RdmaCanceller(std::weak_ptr<ClientEndpoint> endpoint, uint64_t call_id)
      : endpoint_(std::move(endpoint)), call_id_(call_id) {}
  void Cancel() override {
    if (auto ep = endpoint_.lock()) {
      ep->Cancel(call_id_,
                 absl::CancelledError("call cancelled by the client"));
    }
  }

 private:
  std::weak_ptr<ClientEndpoint> endpoint_;
  uint64_t call_id_;
};

}  // namespace

void ClientEndpoint::Start(internal::ClientCall call) {
  ClientContext* ctx = call.ctx;
  RequestHead head;
  head.set_call_id(call.call_id);
  head.set_method(call.method);
  if (ctx->deadline()) {
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(
        *ctx->deadline() - Clock::now());
    head.set_timeout_us(std::max<int64_t>(1, left.count()));
  }
  for (const auto& [k, v] : ctx->metadata()) {
    Metadata* m = head.add_metadata();
    m->set_key(k);
    m->set_value(v);
  }
  std::shared_ptr<Connection> conn;
  std::shared_ptr<RegistrationCache> cache;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!closed_.ok()) {
      std::string why =
          absl::StrCat("RDMA connection lost (", closed_.message(), ")");
      return hooks_.reroute(std::move(call), why);
    }
    conn = conn_;
    cache = cache_;
  }
  size_t base = kPreambleBytes + head.ByteSizeLong();
  size_t room =
      conn->max_frame_bytes() > base ? conn->max_frame_bytes() - base : 0;
  auto payload =
      PlanPayload(*call.request, ctx->tensors(), room, inline_threshold_,
                  {conn->pd(), gpu_mode_}, ctx->cuda_stream());
  if (!payload.ok()) {
    if (payload.status().code() != StatusCode::kInvalidArgument) {
      // Memory RDMA could not reach (pinned staging exhausted, a CUDA
      // error): gRPC may still carry the call.
      return hooks_.reroute(std::move(call),
                            std::string(payload.status().message()));
    }
    auto done = std::move(call.done);
    return done(payload.status());
  }
  // The server's grant for the written parts comes to our receive buffers,
  // and it takes at most WireLimits::max_parts: gRPC carries a bigger call.
  Status fits = CheckGrantFits(payload->out_of_band.size(),
                               conn->receive_bytes(), "the request");
  if (fits.ok() && payload->parts.size() > WireLimits{}.max_parts) {
    fits = absl::ResourceExhaustedError(absl::StrCat(
        "the request has ", payload->parts.size(),
        " parts; RDMA takes at most ", WireLimits{}.max_parts, " per call"));
  }
  if (!fits.ok()) {
    return hooks_.reroute(std::move(call), std::string(fits.message()));
  }
  auto record = std::make_unique<ClientRecord>();
  auto sources = RegisterSources(*payload, cache.get(), conn->pd());
  if (!sources.ok()) {
    return hooks_.reroute(std::move(call),
                          absl::StrCat("RDMA ", sources.status().message()));
  }
  record->sources = *std::move(sources);
  for (Part& p : payload->parts) *head.add_parts() = std::move(p);
  payload->parts.clear();
  record->out = *std::move(payload);
  record->stage = record->sources.empty() ? ClientRecord::Stage::kAwaitResponse
                                          : ClientRecord::Stage::kAwaitGrant;
  record->deadline = ctx->deadline();
  record->sent_at = std::chrono::steady_clock::now();
  CallStats* stats = internal::ClientContextAccess::mutable_stats(ctx);
  stats->transport = TransportKind::kRdma;
  stats->tensor_bytes_sent = record->out.tensor_bytes;
  stats->gpu_rdma_mode = record->out.gpu_mode;
  stats->gpu_rdma_reason = record->out.gpu_reason;
  uint64_t call_id = call.call_id;
  std::vector<std::span<const uint8_t>> inline_parts = record->out.inline_parts;
  record->call = std::move(call);
  if (!internal::ClientContextAccess::AttachCanceller(
          ctx, std::make_shared<RdmaCanceller>(shared_from_this(), call_id))) {
    auto done = std::move(record->call.done);
    return done(absl::CancelledError("call cancelled before start"));
  }
  std::vector<Outcome> outcomes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    bool cancelled = early_cancels_.erase(call_id) > 0;
    last_start_ = std::chrono::steady_clock::now();
    calls_.emplace(call_id, std::move(record));
    conn->calls_waiting.fetch_add(1);
    if (cancelled) {
      FinishLocked(call_id, absl::CancelledError("call cancelled"), &outcomes);
    } else {
      Status sent = conn->SendFrame(FrameType::kRequest, &head, inline_parts);
      if (!sent.ok()) {
        // Nothing reached the server: gRPC may carry it.
        FinishLocked(call_id, sent, &outcomes, Outcome::Next::kReroute);
      }
    }
  }
  Complete(std::move(outcomes));
}

Status ClientEndpoint::AcceptResponse(ClientRecord& r) {
  ClientContext* ctx = r.call.ctx;
  internal::ConsumerStream consumer{ctx->cuda_stream()};
  auto result =
      FinishPayload(&r.in, r.call.response, ctx->response_placement(),
                    r.call.max_response_tensor_bytes, nullptr, &ctx->tensors(),
                    ctx->has_cuda_stream() ? &consumer : nullptr);
  if (!result.ok()) return result.status();
  r.received_bytes = result->total_bytes;
  r.response_copied = result->cpu_copied_bytes;
  return absl::OkStatus();
}

void ClientEndpoint::SendCancelLocked(uint64_t call_id) {
  rdma::Cancel cancel;
  cancel.set_call_id(call_id);
  // Fails only on a closing connection, whose close ends the call on both
  // sides.
  Status sent = conn_->SendFrame(FrameType::kCancel, &cancel);
  if (!sent.ok() && !conn_->closed()) conn_->Close(sent, "cancel not sent");
}

void ClientEndpoint::Cancel(uint64_t call_id, Status why) {
  std::vector<Outcome> outcomes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(call_id);
    if (!closed_.ok()) return;
    if (it == calls_.end()) {
      // Cancelled between AttachCanceller and the send (or just finished).
      early_cancels_.insert(call_id);
      return;
    }
    ClientRecord& r = *it->second;
    if (r.stage == ClientRecord::Stage::kAwaitResponseData) {
      // The server is writing into this call's memory: finish when done.
      if (!r.deferred) r.deferred = std::move(why);
      return;
    }
    SendCancelLocked(call_id);
    FinishLocked(call_id, std::move(why), &outcomes);
  }
  Complete(std::move(outcomes));
}

std::chrono::milliseconds ClientEndpoint::ExpireDeadlines() {
  auto now = Clock::now();
  auto next = now + std::chrono::milliseconds(50);
  std::vector<uint64_t> expired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& [id, r] : calls_) {
      if (!r->deadline || r->deferred) continue;
      if (*r->deadline <= now) {
        expired.push_back(id);
      } else {
        next = std::min(next, *r->deadline);
      }
    }
  }
  for (uint64_t id : expired) {
    Cancel(id, absl::DeadlineExceededError("deadline exceeded"));
  }
  return std::max(std::chrono::milliseconds(1),
                  std::chrono::duration_cast<std::chrono::milliseconds>(
                      next - Clock::now()));
}

void ClientEndpoint::FinishLocked(uint64_t call_id, Status status,
                                  std::vector<Outcome>* outcomes,
                                  Outcome::Next next) {
  auto it = calls_.find(call_id);
  if (it == calls_.end()) return;
  ClientRecord& r = *it->second;
  if (r.writes_pending > 0) {
    if (!r.deferred) r.deferred = std::move(status);
    return;
  }
  if (r.grant_id != 0) grants_.erase(r.grant_id);
  if (conn_) conn_->calls_waiting.fetch_sub(1);
  outcomes->push_back({std::move(it->second), std::move(status), next});
  calls_.erase(it);
}

void ClientEndpoint::Complete(std::vector<Outcome> outcomes) {
  if (outcomes.empty()) return;
  // Registrations in the records belong to the connection's protection
  // domain, which must outlive them.
  std::shared_ptr<Connection> keep;
  {
    std::lock_guard<std::mutex> lock(mu_);
    keep = conn_;
  }
  for (Outcome& o : outcomes) {
    ClientRecord& r = *o.record;
    ClientContext* ctx = r.call.ctx;
    internal::ClientContextAccess::DetachCanceller(ctx);
    if (o.next == Outcome::Next::kReroute) {
      hooks_.reroute(std::move(r.call), absl::StrCat("RDMA could not send it (",
                                                     o.status.message(), ")"));
      continue;
    }
    if (o.next == Outcome::Next::kResend) {
      r.call.resend = internal::ClientCall::Resend{hooks_.client_id,
                                                   server_instance_, r.sent_at};
      hooks_.reroute(
          std::move(r.call),
          absl::StrCat("RDMA connection lost with the call in "
                       "flight (",
                       o.status.message(), "); re-sent with the same call id"));
      continue;
    }
    CallStats* stats = internal::ClientContextAccess::mutable_stats(ctx);
    stats->tensor_bytes_received = r.received_bytes;
    stats->cpu_copied_bytes += r.out.cpu_copied_bytes + r.response_copied;
    if (r.call.done_runs_inline) {
      r.call.done(std::move(o.status));
      continue;
    }
    internal::RunOnCallbackThread(
        [done = std::move(r.call.done), status = std::move(o.status)] {
          done(status);
        });
  }
  outcomes.clear();
}

Status ClientEndpoint::OnFrame(const FrameView& frame) {
  std::vector<Outcome> outcomes;
  Status s;
  switch (frame.type) {
    case FrameType::kGrant:
      s = OnGrant(frame, &outcomes);
      break;
    case FrameType::kResponse:
      s = OnResponse(frame, &outcomes);
      break;
    case FrameType::kPong:
      s = ParsePing(frame).status();  // hearing it is the point
      break;
    default:
      s = absl::InvalidArgumentError(absl::StrCat(
          "a server sent frame type ", static_cast<int>(frame.type)));
  }
  Complete(std::move(outcomes));
  return s;
}

Status ClientEndpoint::OnGrant(const FrameView& frame,
                               std::vector<Outcome>* outcomes) {
  RDMARPC_ASSIGN_OR_RETURN(uint64_t call_id, GrantCallId(frame));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(call_id);
  if (it == calls_.end()) return absl::OkStatus();  // cancelled meanwhile
  ClientRecord& r = *it->second;
  if (r.stage != ClientRecord::Stage::kAwaitGrant) {
    return absl::InvalidArgumentError(
        absl::StrCat("grant for call ", call_id, ", which expects none"));
  }
  auto on_written = [weak = std::weak_ptr<ClientEndpoint>(shared_from_this()),
                     call_id](Status) {
    auto ep = weak.lock();
    if (!ep) return;
    std::vector<Outcome> done;
    {
      std::lock_guard<std::mutex> lock(ep->mu_);
      auto it = ep->calls_.find(call_id);
      if (it == ep->calls_.end()) return;
      ClientRecord& rec = *it->second;
      // A failed write means the connection failed: OnClosed follows and
      // re-sends the call, so the error itself decides nothing here.
      --rec.writes_pending;
      if (rec.writes_pending == 0 && rec.deferred) {
        ep->FinishLocked(call_id, *rec.deferred, &done);
      }
    }
    ep->Complete(std::move(done));
  };
  RDMARPC_ASSIGN_OR_RETURN(
      r.writes_pending,
      WriteGrantedParts(frame, r.out, r.sources, conn_, on_written));
  r.stage = ClientRecord::Stage::kAwaitResponse;
  return absl::OkStatus();
}

Status ClientEndpoint::OnResponse(const FrameView& frame,
                                  std::vector<Outcome>* outcomes) {
  RDMARPC_ASSIGN_OR_RETURN(ResponseHead head, ParseResponse(frame, limits_));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(head.call_id());
  if (it == calls_.end()) {
    // Cancelled meanwhile: a server waiting for a grant must hear it.
    for (const Part& p : head.parts()) {
      if (p.out_of_band()) {
        SendCancelLocked(head.call_id());
        break;
      }
    }
    return absl::OkStatus();
  }
  ClientRecord& r = *it->second;
  if (r.stage == ClientRecord::Stage::kAwaitResponseData) {
    return absl::InvalidArgumentError(
        absl::StrCat("second response for call ", head.call_id()));
  }
  if (head.code() != 0) {
    bool not_sent =
        r.stage == ClientRecord::Stage::kAwaitGrant && head.not_executed();
    FinishLocked(head.call_id(),
                 Status(static_cast<StatusCode>(head.code()), head.message()),
                 outcomes,
                 not_sent ? Outcome::Next::kReroute : Outcome::Next::kComplete);
    return absl::OkStatus();
  }
  if (r.stage == ClientRecord::Stage::kAwaitGrant) {
    return absl::InvalidArgumentError(absl::StrCat(
        "response for call ", head.call_id(), " before its request arrived"));
  }
  ClientContext* ctx = r.call.ctx;
  auto in = ReceivePayload(
      head.parts(), frame.inline_bytes, r.call.max_response_tensor_bytes,
      ctx->response_tensor_buffers(), ctx->response_placement(), nullptr,
      {conn_->pd(), gpu_mode_});
  if (in.ok()) {
    Status registered = RegisterLandingMemory(&*in, conn_->pd());
    if (!registered.ok()) in = registered;
  }
  if (!in.ok()) {
    for (const Part& p : head.parts()) {
      if (p.out_of_band()) {
        SendCancelLocked(head.call_id());
        break;
      }
    }
    FinishLocked(head.call_id(), in.status(), outcomes);
    return absl::OkStatus();
  }
  r.in = *std::move(in);
  if (!r.in.gpu_mode.empty()) {
    internal::ClientContextAccess::mutable_stats(ctx)->gpu_rdma_mode =
        r.in.gpu_mode;
    internal::ClientContextAccess::mutable_stats(ctx)->gpu_rdma_reason =
        r.in.gpu_reason;
  }
  if (r.in.landing.empty()) {
    FinishLocked(head.call_id(), AcceptResponse(r), outcomes);
    return absl::OkStatus();
  }
  Grant grant;
  grant.set_call_id(head.call_id());
  r.grant_id = next_grant_id_++;
  if (next_grant_id_ == 0) next_grant_id_ = 1;
  grant.set_grant_id(r.grant_id);
  AddGrantRegions(r.in, &grant);
  grants_[r.grant_id] = head.call_id();
  r.stage = ClientRecord::Stage::kAwaitResponseData;
  Status sent = conn_->SendFrame(FrameType::kGrant, &grant);
  if (!sent.ok()) {
    // The server would wait for this grant: tell it the call is over.
    SendCancelLocked(head.call_id());
    r.stage = ClientRecord::Stage::kAwaitResponse;
    FinishLocked(head.call_id(), sent, outcomes);
  }
  return absl::OkStatus();
}

Status ClientEndpoint::OnWriteLanded(uint32_t immediate) {
  std::vector<Outcome> outcomes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto g = grants_.find(immediate);
    if (g == grants_.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("write landed for unknown grant ", immediate));
    }
    uint64_t call_id = g->second;
    ClientRecord& r = *calls_.at(call_id);
    Status accepted = AcceptResponse(r);
    Status status = r.deferred ? *r.deferred : accepted;
    r.deferred.reset();
    FinishLocked(call_id, status, &outcomes);
  }
  Complete(std::move(outcomes));
  return absl::OkStatus();
}

void ClientEndpoint::OnClosed(const Status& why) {
  std::vector<Outcome> outcomes;
  std::shared_ptr<Connection> conn;
  bool resend = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = why;
    resend = !shutting_down_;
    conn = conn_;
  }
  // The channel stops routing here before the calls come back to it.
  if (resend && hooks_.lost) {
    hooks_.lost(why, conn ? conn->close_trigger() : "connection closed");
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    // The queue pair is gone: nothing writes into these calls' memory.
    for (auto& [id, r] : calls_) r->writes_pending = 0;
    auto now = Clock::now();
    while (!calls_.empty()) {
      ClientRecord& r = *calls_.begin()->second;
      uint64_t id = calls_.begin()->first;
      if (r.deferred) {
        Status decided = *r.deferred;  // cancelled or expired already
        FinishLocked(id, decided, &outcomes);
      } else if (r.deadline && *r.deadline <= now) {
        FinishLocked(id, absl::DeadlineExceededError("deadline exceeded"),
                     &outcomes);
      } else {
        FinishLocked(
            id, why, &outcomes,
            resend ? Outcome::Next::kResend : Outcome::Next::kComplete);
      }
    }
  }
  Complete(std::move(outcomes));
  std::lock_guard<std::mutex> lock(mu_);
  if (cache_) cache_->Clear();
  conn_.reset();
  // `conn` (and its protection domain) goes after the registrations.
  on_closed_done_ = true;
  closed_cv_.notify_all();
}

namespace {

internal::FastConnectResult NoRdma(absl::string_view why) {
  return {nullptr, absl::FailedPreconditionError(why), /*no_fast_path=*/true};
}

internal::FastConnectResult Failed(absl::string_view why) {
  return {nullptr, absl::UnavailableError(why)};
}

}  // namespace

internal::FastConnectResult RdmaClientTransport::Connect(
    internal::SetupChannel* setup, const ChannelOptions& options,
    internal::FastPathHooks hooks) {
  ForgetRemovedRdmaDevices();
  auto local = FindRdmaIpv4Address();
  if (!local.ok()) {
    return NoRdma(absl::StrCat("this host has no usable RDMA device: ",
                               local.status().message()));
  }
  HelloRequest hello;
  hello.set_version(kWireVersion);
  hello.set_client_id(hooks.client_id);
  auto answer = setup->UnaryBytes(kHelloMethod, hello.SerializeAsString(),
                                  options.rdma_connect_timeout);
  if (!answer.ok()) {
    if (answer.status().code() == StatusCode::kUnimplemented) {
      return NoRdma(
          "the server does not offer RDMA (it has no handshake method)");
    }
    return Failed(
        absl::StrCat("RDMA handshake failed: ", answer.status().message()));
  }
  bool no_rdma = false;
  StatusOr<HelloAnswer> server = ParseHelloAnswer(*answer, &no_rdma);
  if (!server.ok()) {
    return no_rdma ? NoRdma(server.status().message())
                   : Failed(server.status().message());
  }
  ConnectionConfig config;
  config.peer_receives = server->receives;
  config.peer_receive_bytes = server->receive_bytes;
  uint64_t threshold = server->inline_threshold;
  if (options.rdma_inline_threshold != 0) {
    threshold = options.rdma_inline_threshold;
  }
  std::unique_ptr<RdmaClientTransport> t(new RdmaClientTransport());
  t->description_ = absl::StrCat("RDMA connection to ", server->cm_address, ":",
                                 server->cm_port);
  t->peer_timeout_ = options.rdma_peer_timeout;
  t->endpoint_ = std::make_shared<ClientEndpoint>(
      std::move(hooks), server->server_instance, threshold,
      options.gpu_rdma_mode, t->description_);
  auto conn = ConnectToServer(
      server->cm_address, static_cast<uint16_t>(server->cm_port), server->token,
      config, t->endpoint_, options.rdma_connect_timeout);
  if (!conn.ok()) return Failed(conn.status().message());
  t->conn_ = *std::move(conn);
  if (ibv_context* device = t->conn_->cm_id()->verbs) {
    absl::StrAppend(&t->description_, " (", ibv_get_device_name(device->device),
                    ")");
  }
  t->endpoint_->Attach(t->conn_);
  t->monitor_ = std::thread([raw = t.get()] { raw->Monitor(); });
  pthread_setname_np(t->monitor_.native_handle(), "rdmarpc-monitor");
  return {std::move(t), absl::OkStatus()};
}

RdmaClientTransport::~RdmaClientTransport() {
  stop_.store(true);
  if (monitor_.joinable()) monitor_.join();
  if (!conn_) return;  // Connect failed: no connection, no calls
  endpoint_->BeginShutdown();
  conn_->Close(absl::UnavailableError("the channel was destroyed"),
               "channel destroyed");
  endpoint_->WaitClosed();
}

void RdmaClientTransport::Monitor() {
  using SteadyClock = std::chrono::steady_clock;
  // When the outstanding ping reached the server's receive queue (0: none
  // delivered yet); set by the ping's send continuation.
  auto delivered = std::make_shared<std::atomic<SteadyClock::rep>>(0);
  bool ping_out = false;
  uint64_t ping_sequence = 0;
  while (!stop_.load()) {
    std::chrono::milliseconds wait = endpoint_->ExpireDeadlines();
    if (RDMARPC_FAULT("rdma.client.qp_error")) {
      Status injected = conn_->InjectQueuePairError();
      if (!injected.ok()) conn_->Close(injected, "fault injection");
    }
    // A server that stops answering on RDMA (its gRPC port may still
    // answer) must not hold calls forever. After a third of the timeout
    // without a frame, ping it; a ping that reached it and is not answered
    // within two thirds of the timeout closes the connection. (A ping
    // waits behind writes already posted; its clock starts once it lands.)
    auto now = SteadyClock::now();
    SteadyClock::time_point last_start;
    size_t outstanding = endpoint_->outstanding(&last_start);
    SteadyClock::time_point heard = conn_->last_heard();
    if (ping_out) {
      SteadyClock::time_point landed(SteadyClock::duration(delivered->load()));
      if (delivered->load() != 0 && heard > landed) {
        ping_out = false;  // answered (or any other frame came)
      } else if (delivered->load() != 0 &&
                 now - landed >= peer_timeout_ * 2 / 3 && !conn_->closed()) {
        conn_->Close(absl::UnavailableError(absl::StrCat(
                         "the server did not answer on RDMA for ",
                         std::chrono::duration_cast<std::chrono::milliseconds>(
                             now - std::max(heard, last_start))
                             .count(),
                         " ms with ", outstanding,
                         " calls outstanding (a ping went unanswered)")),
                     "server silent on RDMA");
      }
    } else if (outstanding > 0 && peer_timeout_.count() > 0 &&
               now - std::max(heard, last_start) >= peer_timeout_ / 3) {
      Ping ping;
      ping.set_sequence(++ping_sequence);
      delivered->store(0);
      Status sent =
          conn_->SendFrame(FrameType::kPing, &ping, {}, [delivered](Status s) {
            if (s.ok()) {
              delivered->store(SteadyClock::now().time_since_epoch().count());
            }
          });
      ping_out = sent.ok();
    }
    if (outstanding > 0 && peer_timeout_.count() > 0) {
      wait = std::min(
          wait, std::max(std::chrono::milliseconds(1), peer_timeout_ / 6));
    }
    auto event = NextCmEvent(conn_->cm_events(), wait);
    if (!event.ok()) continue;  // timeout: check again
    switch (event->type) {
      case RDMA_CM_EVENT_DISCONNECTED:
        conn_->Close(
            absl::UnavailableError("the server closed the RDMA connection"),
            "server disconnected");
        break;
      case RDMA_CM_EVENT_DEVICE_REMOVAL:
        conn_->Close(absl::UnavailableError("the RDMA device was removed"),
                     "device removed");
        break;
      default:
        break;
    }
  }
}

void RdmaClientTransport::Start(internal::ClientCall call) {
  internal::ClientContextAccess::mutable_stats(call.ctx)->transport_reason =
      description_;
  endpoint_->Start(std::move(call));
}

Status RdmaClientTransport::health() const { return endpoint_->health(); }

internal::FastPathCounters RdmaClientTransport::counters() const {
  return conn_->counters();
}

}  // namespace rdmarpc::rdma
