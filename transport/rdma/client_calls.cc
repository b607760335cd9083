#include "transport/rdma/client_calls.h"

#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <thread>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/access.h"
#include "runtime/coarse_clock.h"
#include "runtime/completion.h"
#include "runtime/fault_injection.h"
#include "runtime/spin.h"
#include "transport/rdma/payload.h"

namespace rdmarpc::rdma {

using Clock = std::chrono::system_clock;

// A call between Start and its completion.
struct ClientRecord {
  enum class Stage {
    kAwaitGrant,           // request written once the server grants memory
    kAwaitResponse,        // request delivered (or being written)
    kRegisteringResponse,  // waiting for windows, or large response
                           // landing registered aside
    kAwaitResponseData,    // response memory granted, server writing
    kEndingGrant,          // written; windows invalidated, large landing
                           // regions deregistered aside
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
  bool landing_aside = false;  // registered and deregistered aside
  // At kRegisteringResponse: waiting for windows the connection's other
  // grants hold, so it moves when they do.
  bool awaiting_windows = false;
  uint32_t grant_id = 0;
  uint64_t received_bytes = 0;
  uint64_t response_copied = 0;
  std::optional<Clock::time_point> deadline;
  std::chrono::steady_clock::time_point sent_at;
  // SpinClock time the request was posted: its response's round trip
  // sizes the spins of the process's engines and blocking callers.
  uint64_t posted_ticks = 0;
  // For the progress watch: when the call last moved (sent, a frame for it
  // came, a write of it completed, the server said its handler runs), and
  // how long its bytes in flight may take beyond the peer timeout.
  std::chrono::steady_clock::time_point moved_at;
  std::chrono::steady_clock::duration in_flight_allowance{};
};

namespace {

// The slowest rate a healthy path moves a call's written bytes at: soft-RoCE
// under emulation moves several hundred MB/s. Slower than this, a transfer
// counts as stalled once the peer timeout is spent as well.
constexpr uint64_t kSlowestBytesPerSecond = uint64_t{64} << 20;

std::chrono::steady_clock::duration AllowanceFor(uint64_t bytes) {
  return std::chrono::duration_cast<std::chrono::steady_clock::duration>(
      std::chrono::duration<double>(static_cast<double>(bytes) /
                                    kSlowestBytesPerSecond));
}

uint64_t OutOfBandBytes(const Parts& parts) {
  uint64_t bytes = 0;
  for (const Part& p : parts) {
    if (p.out_of_band) bytes += p.size;
  }
  return bytes;
}

// The endpoint's one canceller, attached to each of its calls: a context
// may hold it past the endpoint's end (a TryCancel racing the call's end).
class RdmaCanceller final : public internal::CallCanceller {
 public:
  explicit RdmaCanceller(std::weak_ptr<ClientEndpoint> endpoint)
      : endpoint_(std::move(endpoint)) {}
  void Cancel(uint64_t call_id) override {
    if (auto ep = endpoint_.lock()) {
      ep->Cancel(call_id, absl::CancelledError("call cancelled by the client"));
    }
  }

 private:
  std::weak_ptr<ClientEndpoint> endpoint_;
};

}  // namespace

ClientEndpoint::ClientEndpoint(internal::FastPathHooks hooks,
                               uint64_t server_instance,
                               uint64_t inline_threshold, GpuRdmaMode gpu_mode,
                               std::string description)
    : hooks_(std::move(hooks)),
      server_instance_(server_instance),
      inline_threshold_(inline_threshold),
      gpu_mode_(gpu_mode),
      description_(std::move(description)) {}

ClientEndpoint::~ClientEndpoint() = default;

void ClientEndpoint::Attach(std::shared_ptr<Connection> conn) {
  canceller_ = std::make_shared<RdmaCanceller>(weak_from_this());
  std::lock_guard<std::mutex> lock(mu_);
  conn_ = std::move(conn);
  group_ = conn_->group()->shared_from_this();
  cache_ = RegistrationCache::Create(conn_->pd());
  attached_ = conn_.get();
}

Status ClientEndpoint::health() const {
  // Asked before every call: no lock while the connection is up.
  if (!lost_.load(std::memory_order_acquire)) return absl::OkStatus();
  std::lock_guard<std::mutex> lock(mu_);
  return closed_;
}

ClientEndpoint::ProgressWatch ClientEndpoint::WatchProgress(
    std::chrono::steady_clock::time_point now,
    std::chrono::milliseconds peer_timeout,
    std::chrono::steady_clock::time_point not_still_before) const {
  ProgressWatch watch;
  std::lock_guard<std::mutex> lock(mu_);
  watch.outstanding = calls_.size();
  watch.last_pong = last_pong_;
  std::chrono::steady_clock::duration worst{};
  std::chrono::steady_clock::time_point newest{};
  for (const auto& [id, r] : calls_) newest = std::max(newest, r->moved_at);
  for (const auto& [id, r] : calls_) {
    const auto moved = r->awaiting_windows ? newest : r->moved_at;
    auto quiet =
        now - std::max(moved, not_still_before) - r->in_flight_allowance;
    if (quiet >= peer_timeout / 3) watch.ping_needed = true;
    if (quiet >= peer_timeout && quiet > worst) {
      worst = quiet;
      watch.stalled_call = id;
      watch.stalled_since = r->moved_at;
    }
  }
  return watch;
}

void ClientEndpoint::BeginShutdown() {
  std::lock_guard<std::mutex> lock(mu_);
  shutting_down_ = true;
}

void ClientEndpoint::WaitClosed() {
  std::unique_lock<std::mutex> lock(mu_);
  closed_cv_.wait(lock, [this] { return on_closed_done_; });
}

namespace {

std::multimap<std::string, std::string> MetadataMap(
    const MetadataViews& entries) {
  std::multimap<std::string, std::string> map;
  for (const MetadataView& m : entries) map.emplace(m.key, m.value);
  return map;
}

}  // namespace

void ClientEndpoint::Start(internal::ClientCall call) {
  ClientContext* ctx = call.ctx;
  // Views into `call` (then the record it moves into) and `ctx`, which
  // outlive the send below.
  RequestHead head;
  head.call_id = call.call_id;
  head.method = call.method;
  if (ctx->deadline()) {
    auto left = std::chrono::duration_cast<std::chrono::microseconds>(
        *ctx->deadline() - Clock::now());
    head.timeout_us = std::max<int64_t>(1, left.count());
  }
  for (const auto& [k, v] : ctx->metadata()) {
    head.metadata.push_back({k, v});
  }
  if (lost_.load(std::memory_order_acquire)) {
    std::string why =
        absl::StrCat("RDMA connection lost (", health().message(), ")");
    return hooks_.reroute(std::move(call), why);
  }
  // A close from here on fails the frame's send below, which reroutes.
  Connection* conn = attached_;
  RegistrationCache* cache = cache_.get();
  size_t base = kPreambleBytes + FrameHead(&head).bytes();
  size_t room =
      conn->max_frame_bytes() > base ? conn->max_frame_bytes() - base : 0;
  auto payload =
      PlanPayload(*call.request, ctx->tensors(), room, inline_threshold_,
                  {conn->pd(), gpu_mode_}, ctx->cuda_stream(), &head.parts);
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
  if (fits.ok() && head.parts.size() > WireLimits{}.max_parts) {
    fits = absl::ResourceExhaustedError(absl::StrCat(
        "the request has ", head.parts.size(), " parts; RDMA takes at most ",
        WireLimits{}.max_parts, " per call"));
  }
  if (!fits.ok()) {
    return hooks_.reroute(std::move(call), std::string(fits.message()));
  }
  std::unique_ptr<ClientRecord> record = spare_record_.Take();
  auto sources = RegisterSources(*payload, cache, conn->pd());
  if (!sources.ok()) {
    return hooks_.reroute(std::move(call),
                          absl::StrCat("RDMA ", sources.status().message()));
  }
  record->sources = *std::move(sources);
  record->out = *std::move(payload);
  record->stage = record->sources.empty() ? ClientRecord::Stage::kAwaitResponse
                                          : ClientRecord::Stage::kAwaitGrant;
  record->deadline = ctx->deadline();
  const auto sent_at = internal::CoarseSteadyNow();
  record->sent_at = sent_at;
  record->moved_at = sent_at;
  record->posted_ticks = internal::SpinClock::Get().Now();
  // Written parts wait for the server to allocate and register landing
  // memory for them, which takes time in proportion to their size.
  record->in_flight_allowance = AllowanceFor(record->out.tensor_bytes);
  CallStats* stats = internal::ClientContextAccess::mutable_stats(ctx);
  stats->transport = TransportKind::kRdma;
  stats->tensor_bytes_sent = record->out.tensor_bytes;
  stats->gpu_rdma_mode = record->out.gpu_mode;
  stats->gpu_rdma_reason = record->out.gpu_reason;
  uint64_t call_id = call.call_id;
  // calls_ owns the record from here; mu_ keeps it while the frame goes.
  const ClientRecord* sending = record.get();
  record->call = std::move(call);
  // Fault injection: a test holds the call here to cancel it before its
  // canceller is attached.
  internal::fault::HoldWhileArmed("rdma.client.hold_start",
                                  "rdma.client.start_held");
  Outcomes outcomes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    calls_.emplace(call_id, std::move(record));
    // Through conn_, as FinishLocked takes it back (null once closed).
    if (conn_) conn_->calls_waiting.fetch_add(1);
    // Before the post: the group's engine, asleep, watches for it only if
    // it awaits (RdmaClientTransport::Start, Channel::Call).
    group_->AddAwaited();
    // Attached with the call in calls_, under mu_, which Cancel takes: a
    // cancel that does not find its call came after the call ended.
    if (!internal::ClientContextAccess::AttachCanceller(ctx, canceller_,
                                                        call_id)) {
      FinishLocked(call_id, absl::CancelledError("call cancelled before start"),
                   &outcomes);
    } else {
      head.method = sending->call.method;  // `call` has moved there
      Status sent =
          conn->SendFrame(FrameType::kRequest, &head, sending->out.inline_parts,
                          nullptr, sending->out.message_part);
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
  Outcomes outcomes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(call_id);
    // Not found: the call ended before this cancel came (Start puts a call
    // in calls_ before its canceller is attached).
    if (!closed_.ok() || it == calls_.end()) return;
    ClientRecord& r = *it->second;
    if (r.stage == ClientRecord::Stage::kAwaitResponseData ||
        r.stage == ClientRecord::Stage::kEndingGrant) {
      // The server may write into this call's memory until its grant
      // ends: finish when it has.
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
                                  Outcomes* outcomes, Outcome::Next next) {
  auto it = calls_.find(call_id);
  if (it == calls_.end()) return;
  ClientRecord& r = *it->second;
  if (r.writes_pending > 0) {
    if (!r.deferred) r.deferred = std::move(status);
    return;
  }
  grants_.Forget(r.grant_id);
  if (conn_) conn_->calls_waiting.fetch_sub(1);
  group_->RemoveAwaited();
  outcomes->push_back({std::move(it->second), std::move(status), next});
  calls_.erase(it);
}

void ClientEndpoint::Complete(Outcomes outcomes) {
  if (outcomes.empty()) return;
  // Registrations in the records belong to the connection's protection
  // domain, which must outlive them. A small call's record holds none.
  std::shared_ptr<Connection> keep;
  for (const Outcome& o : outcomes) {
    const ClientRecord& r = *o.record;
    if (!r.sources.empty() || !r.out.out_of_band.empty() ||
        !r.in.landing.empty()) {
      std::lock_guard<std::mutex> lock(mu_);
      keep = conn_;
      break;
    }
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
    const bool run_inline =
        r.call.done_runs_inline &&
        (r.call.done_only_wakes || !Connection::PolledForAnotherCaller());
    std::function<void(Status)> done = std::move(r.call.done);
    // Back before the callback: a caller it wakes starts its next call at
    // once, and that call's record takes this one's memory.
    spare_record_.Give(std::move(o.record));
    if (run_inline) {
      // A callback that blocks here holds up every connection this thread
      // polls: counted, so that it shows (rdma_callback_stalls).
      const internal::SpinClock& clock = internal::SpinClock::Get();
      const uint64_t began = clock.Now();
      done(std::move(o.status));
      if (clock.Now() - began >=
          clock.Ticks(internal::kCompletionThreadStall)) {
        callback_stalls_.fetch_add(1, std::memory_order_relaxed);
      }
      continue;
    }
    internal::RunOnCallbackThread(
        [done = std::move(done), status = std::move(o.status)] {
          done(status);
        });
  }
  outcomes.clear();
}

Status ClientEndpoint::OnFrame(const FrameView& frame) {
  Outcomes outcomes;
  Status s;
  switch (frame.type) {
    case FrameType::kGrant:
      s = OnGrant(frame, &outcomes);
      break;
    case FrameType::kResponse:
      s = OnResponse(frame, &outcomes);
      break;
    case FrameType::kPong:
      s = OnPong(frame);
      break;
    default:
      s = absl::InvalidArgumentError(absl::StrCat(
          "a server sent frame type ", static_cast<int>(frame.type)));
  }
  Complete(std::move(outcomes));
  return s;
}

Status ClientEndpoint::OnPong(const FrameView& frame) {
  RDMARPC_ASSIGN_OR_RETURN(Ping pong, ParsePing(frame));
  const auto now = internal::CoarseSteadyNow();
  std::lock_guard<std::mutex> lock(mu_);
  last_pong_ = now;
  for (uint64_t id : pong.running_call_ids()) {
    auto it = calls_.find(id);
    if (it != calls_.end()) it->second->moved_at = now;
  }
  return absl::OkStatus();
}

Status ClientEndpoint::OnGrant(const FrameView& frame, Outcomes* outcomes) {
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
    Outcomes done;
    {
      std::lock_guard<std::mutex> lock(ep->mu_);
      auto it = ep->calls_.find(call_id);
      if (it == ep->calls_.end()) return;
      ClientRecord& rec = *it->second;
      // A failed write means the connection failed: OnClosed follows and
      // re-sends the call, so the error itself decides nothing here.
      --rec.writes_pending;
      rec.moved_at = internal::CoarseSteadyNow();
      if (rec.writes_pending == 0) rec.in_flight_allowance = {};
      if (rec.writes_pending == 0 && rec.deferred) {
        ep->FinishLocked(call_id, *rec.deferred, &done);
      }
    }
    ep->Complete(std::move(done));
  };
  // A large part moves piece by piece: each piece is progress.
  auto moved = [weak = std::weak_ptr<ClientEndpoint>(shared_from_this()),
                call_id] {
    auto ep = weak.lock();
    if (!ep) return;
    std::lock_guard<std::mutex> lock(ep->mu_);
    auto it = ep->calls_.find(call_id);
    if (it != ep->calls_.end()) {
      it->second->moved_at = internal::CoarseSteadyNow();
    }
  };
  RDMARPC_ASSIGN_OR_RETURN(
      r.writes_pending,
      WriteGrantedParts(frame, r.out, r.sources, conn_, on_written, moved));
  r.stage = ClientRecord::Stage::kAwaitResponse;
  r.moved_at = internal::CoarseSteadyNow();
  r.in_flight_allowance = AllowanceFor(r.out.tensor_bytes);
  return absl::OkStatus();
}

Status ClientEndpoint::OnResponse(const FrameView& frame, Outcomes* outcomes) {
  ResponseHead head;
  RDMARPC_RETURN_IF_ERROR(ParseResponse(frame, limits_, &head));
  std::lock_guard<std::mutex> lock(mu_);
  auto it = calls_.find(head.call_id);
  if (it == calls_.end()) {
    // Cancelled meanwhile: a server waiting for a grant must hear it.
    for (const Part& p : head.parts) {
      if (p.out_of_band) {
        SendCancelLocked(head.call_id);
        break;
      }
    }
    return absl::OkStatus();
  }
  ClientRecord& r = *it->second;
  if (r.stage == ClientRecord::Stage::kRegisteringResponse ||
      r.stage == ClientRecord::Stage::kAwaitResponseData ||
      r.stage == ClientRecord::Stage::kEndingGrant) {
    return absl::InvalidArgumentError(
        absl::StrCat("second response for call ", head.call_id));
  }
  // Every call's round trip, callback or blocking: a process that only
  // chains callback calls needs its engines to spin across them as well.
  internal::RecordRoundTrip(internal::SpinClock::Get().Now() - r.posted_ticks);
  r.moved_at = internal::CoarseSteadyNow();
  r.in_flight_allowance = AllowanceFor(OutOfBandBytes(head.parts));
  // The caller reads them only once the call completed; a re-send over
  // gRPC replaces them.
  internal::ClientContextAccess::SetServerMetadata(
      r.call.ctx, MetadataMap(head.initial_metadata),
      MetadataMap(head.trailing_metadata));
  if (head.code != 0) {
    bool not_sent =
        r.stage == ClientRecord::Stage::kAwaitGrant && head.not_executed;
    FinishLocked(
        head.call_id,
        Status(static_cast<StatusCode>(head.code),
               absl::string_view(head.message.data(), head.message.size())),
        outcomes,
        not_sent ? Outcome::Next::kReroute : Outcome::Next::kComplete);
    return absl::OkStatus();
  }
  if (r.stage == ClientRecord::Stage::kAwaitGrant) {
    return absl::InvalidArgumentError(absl::StrCat(
        "response for call ", head.call_id, " before its request arrived"));
  }
  // Decided (cancelled, say) while its request's bytes still leave: the
  // server heard the cancel and forgot the call, so a grant would break
  // the protocol. The call finishes once the writes have.
  if (r.deferred.has_value()) return absl::OkStatus();
  ClientContext* ctx = r.call.ctx;
  const uint64_t call_id = head.call_id;
  Status received = ReceivePayload(
      head.parts, frame.inline_bytes, r.call.max_response_tensor_bytes,
      ctx->response_tensor_buffers(), ctx->response_placement(), nullptr,
      {conn_->pd(), gpu_mode_}, &r.in);
  const bool server_waits =
      std::any_of(head.parts.begin(), head.parts.end(),
                  [](const Part& p) { return p.out_of_band; });
  if (!received.ok()) {
    FailResponseLocked(call_id, std::move(received), server_waits, outcomes);
    return absl::OkStatus();
  }
  // The windows for its landings first: when other grants hold them, it
  // waits for theirs to end (GrantWithWindows).
  const bool reserved = ReserveLandingWindows(&r.in, conn_.get(), [&] {
    return Connection::WindowsReady(
        [self = weak_from_this(), call_id](Status ready,
                                           Connection::WindowGrants windows) {
          if (auto endpoint = self.lock()) {
            endpoint->GrantWithWindows(call_id, std::move(ready),
                                       std::move(windows));
          }
        });
  });
  if (!reserved) {
    r.stage = ClientRecord::Stage::kRegisteringResponse;
    r.awaiting_windows = true;
    return absl::OkStatus();
  }
  GrantReservedLocked(call_id, server_waits, outcomes);
  return absl::OkStatus();
}

void ClientEndpoint::GrantWithWindows(uint64_t call_id, Status ready,
                                      Connection::WindowGrants windows) {
  Outcomes outcomes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(call_id);
    // Cancelled, expired or closed meanwhile: the windows go back. A
    // closed connection's calls are OnClosed's to re-send.
    // Decided (a cancel, say) while its request's bytes still leave:
    // granting now would follow the cancel the server has heard.
    if (!closed_.ok() || it == calls_.end() || !ready.ok() ||
        it->second->stage != ClientRecord::Stage::kRegisteringResponse ||
        it->second->deferred.has_value()) {
      return;
    }
    it->second->awaiting_windows = false;
    it->second->in.windows = std::move(windows);
    GrantReservedLocked(call_id, /*server_waits=*/true, &outcomes);
  }
  Complete(std::move(outcomes));
}

void ClientEndpoint::GrantReservedLocked(uint64_t call_id, bool server_waits,
                                         Outcomes* outcomes) {
  ClientRecord& r = *calls_.at(call_id);
  uint64_t landing_bytes = 0;
  for (const TensorBuffer& b : r.in.landing) landing_bytes += b.size();
  // A window over the arena's block grants a landing of any size at the
  // cost of a posted bind.
  if (landing_bytes >= kRegisterAsideBytes &&
      !GrantThroughWindow(&r.in, conn_.get())) {
    // Pinning its pages would hold the engine, and so every connection it
    // polls: registered aside, and granted from there (GrantRegistered
    // gives the payload back).
    r.landing_aside = true;
    r.stage = ClientRecord::Stage::kRegisteringResponse;
    RunAside([self = shared_from_this(), call_id,
              in = std::make_shared<IncomingPayload>(std::exchange(r.in, {})),
              conn = conn_] {
      // Fault injection: a test holds the registration thread here.
      internal::fault::HoldWhileArmed("rdma.client.hold_registration",
                                      "rdma.client.registration_held");
      Status registered = RegisterLandingMemory(in.get(), conn.get());
      self->GrantRegistered(call_id, std::move(*in), std::move(registered));
    });
    return;
  }
  Status registered = RegisterLandingMemory(&r.in, conn_.get());
  // A window's bind fails on a closing connection: as for the grant's
  // send, OnClosed re-sends the call (the server keeps the response).
  if (!registered.ok() && conn_->closed()) return;
  if (!registered.ok()) {
    FailResponseLocked(call_id, registered, server_waits, outcomes);
    return;
  }
  GrantResponseLocked(call_id, outcomes);
}

void ClientEndpoint::FailResponseLocked(uint64_t call_id, Status why,
                                        bool server_waits, Outcomes* outcomes) {
  // A server waiting for a grant for the written parts must hear that the
  // call is over.
  if (server_waits) SendCancelLocked(call_id);
  FinishLocked(call_id, std::move(why), outcomes);
}

void ClientEndpoint::GrantRegistered(uint64_t call_id, IncomingPayload in,
                                     Status registered) {
  Outcomes outcomes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(call_id);
    // Cancelled, expired or closed meanwhile (or decided while its
    // request's bytes still leave): `in` and its registrations go here.
    if (!closed_.ok() || it == calls_.end() ||
        it->second->stage != ClientRecord::Stage::kRegisteringResponse ||
        it->second->deferred.has_value()) {
      return;
    }
    it->second->stage = ClientRecord::Stage::kAwaitResponse;
    if (!registered.ok() && conn_->closed()) {
      // Left to OnClosed, which re-sends it (see OnResponse).
    } else if (!registered.ok()) {
      FailResponseLocked(call_id, std::move(registered),
                         /*server_waits=*/true, &outcomes);
    } else {
      it->second->in = std::move(in);
      GrantResponseLocked(call_id, &outcomes);
    }
  }
  Complete(std::move(outcomes));
}

void ClientEndpoint::GrantResponseLocked(uint64_t call_id, Outcomes* outcomes) {
  ClientRecord& r = *calls_.at(call_id);
  ClientContext* ctx = r.call.ctx;
  if (!r.in.gpu_mode.empty()) {
    internal::ClientContextAccess::mutable_stats(ctx)->gpu_rdma_mode =
        r.in.gpu_mode;
    internal::ClientContextAccess::mutable_stats(ctx)->gpu_rdma_reason =
        r.in.gpu_reason;
  }
  if (r.in.landing.empty()) {
    FinishLocked(call_id, AcceptResponse(r), outcomes);
    return;
  }
  landing_registrations_.fetch_add(r.in.registrations,
                                   std::memory_order_relaxed);
  Grant grant = grants_.Issue(call_id, r.in);
  r.grant_id = grant.grant_id();
  r.stage = ClientRecord::Stage::kAwaitResponseData;
  // Fault injection: the connection starts closing just before the grant
  // goes out, so its send fails.
  if (RDMARPC_FAULT("rdma.client.close_before_grant")) {
    conn_->Close(absl::UnavailableError("fault: closed before the grant"),
                 "fault");
  }
  Status sent = conn_->SendFrame(FrameType::kGrant, &grant);
  if (!sent.ok() && conn_->closed()) {
    // The handler ran and the server keeps its response for a re-send:
    // OnClosed, which the engine runs next, re-sends the call.
    return;
  }
  if (!sent.ok()) {
    // The server would wait for this grant: tell it the call is over.
    SendCancelLocked(call_id);
    r.stage = ClientRecord::Stage::kAwaitResponse;
    FinishLocked(call_id, sent, outcomes);
  }
}

Status ClientEndpoint::OnWriteLanded(uint32_t immediate) {
  Outcomes outcomes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    RDMARPC_ASSIGN_OR_RETURN(uint64_t call_id, grants_.Redeem(immediate));
    ClientRecord& r = *calls_.at(call_id);
    r.grant_id = 0;
    // The grant ends before the caller sees the bytes: its windows once
    // their invalidations completed (on this thread, later), or now if the
    // connection is closing; then its regions.
    r.stage = ClientRecord::Stage::kEndingGrant;
    if (!r.in.windows.empty()) {
      // Fault injection: the connection fails once the response landed,
      // before its windows' invalidations are posted.
      if (RDMARPC_FAULT("rdma.client.close_before_window_ends")) {
        conn_->Close(absl::UnavailableError("fault: closed after landing"),
                     "fault");
      }
      // `this` outlives it: the connection holds its handler until after
      // the last continuation (and it is small enough for no allocation).
      if (EndLandingWindows(
              &r.in, [this, call_id](Status) { FinishLanded(call_id); })) {
        return absl::OkStatus();
      }
    }
    if (DeregisterAsideLocked(call_id)) return absl::OkStatus();
    FinishLandedLocked(call_id, &outcomes);
  }
  Complete(std::move(outcomes));
  return absl::OkStatus();
}

bool ClientEndpoint::DeregisterAsideLocked(uint64_t call_id) {
  ClientRecord& r = *calls_.at(call_id);
  if (!r.landing_aside || !HoldsLandingRegions(r.in)) return false;
  // Unpinning its pages would hold the engine: deregistered aside,
  // finished from there.
  // Fault injection: the connection fails while the landed response's
  // memory is deregistered aside, which ends only once the close began.
  const bool close_first = RDMARPC_FAULT("rdma.client.close_while_landing");
  if (close_first) {
    conn_->Close(absl::UnavailableError("fault: closed while landing"),
                 "fault");
  }
  RunAside([self = shared_from_this(), call_id,
            mrs = std::make_shared<std::vector<MemoryRegion>>(
                std::move(r.in.landing_mrs)),
            conn = conn_, close_first] {
    mrs->clear();
    for (int i = 0; close_first && self->health().ok() && i < 5000; ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    self->FinishLanded(call_id);
  });
  return true;
}

void ClientEndpoint::FinishLandedLocked(uint64_t call_id, Outcomes* outcomes) {
  ClientRecord& r = *calls_.at(call_id);
  Status accepted = AcceptResponse(r);
  Status status = r.deferred ? *r.deferred : accepted;
  r.deferred.reset();
  FinishLocked(call_id, status, outcomes);
}

void ClientEndpoint::FinishLanded(uint64_t call_id) {
  Outcomes outcomes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = calls_.find(call_id);
    // The response landed in full, so it is the call's answer even if the
    // connection closed meanwhile (OnClosed waits for it): the server
    // counts it delivered and would refuse a re-send. Gone: OnClosed gave
    // up waiting and re-sent the call.
    if (it == calls_.end() ||
        it->second->stage != ClientRecord::Stage::kEndingGrant) {
      return;
    }
    // Its windows ended: regions registered aside go there next.
    if (DeregisterAsideLocked(call_id)) return;
    FinishLandedLocked(call_id, &outcomes);
    landed_cv_.notify_all();
  }
  Complete(std::move(outcomes));
}

void ClientEndpoint::OnClosed(const Status& why) {
  Outcomes outcomes;
  std::shared_ptr<Connection> conn;
  bool resend = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closed_ = why;
    lost_.store(true, std::memory_order_release);
    resend = !shutting_down_;
    conn = conn_;
  }
  // The channel stops routing here before the calls come back to it.
  if (resend && hooks_.lost) {
    hooks_.lost(why, conn ? conn->close_trigger() : "connection closed");
  }
  {
    std::unique_lock<std::mutex> lock(mu_);
    // Responses that landed in full are finished by FinishLanded once
    // their landing memory is deregistered aside, not re-sent. Bounded, so
    // a stuck deregistration cannot hold the close: then they are re-sent.
    landed_cv_.wait_for(lock, std::chrono::seconds(10), [this] {
      return std::none_of(calls_.begin(), calls_.end(), [](const auto& c) {
        return c.second->stage == ClientRecord::Stage::kEndingGrant;
      });
    });
    // The queue pair is gone: nothing writes into these calls' memory.
    for (auto& [id, r] : calls_) r->writes_pending = 0;
    auto now = Clock::now();
    // In the order they were made: re-sends go out that way.
    std::vector<uint64_t> ids;
    ids.reserve(calls_.size());
    for (const auto& [id, r] : calls_) ids.push_back(id);
    std::sort(ids.begin(), ids.end());
    for (uint64_t id : ids) {
      ClientRecord& r = *calls_.at(id);
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

}  // namespace rdmarpc::rdma
