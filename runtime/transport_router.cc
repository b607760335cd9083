#include "runtime/transport_router.h"

#include <pthread.h>

#include <algorithm>
#include <optional>
#include <random>
#include <thread>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "runtime/access.h"

namespace rdmarpc::internal {

TransportRouter::TransportRouter(const ChannelOptions& options,
                                 uint64_t client_id, ClientTransport* fallback,
                                 Connector connect)
    : options_(options),
      client_id_(client_id),
      fallback_(fallback),
      connect_(std::move(connect)),
      probe_backoff_(options_.rdma_probe_initial_backoff) {
  if (options_.policy == TransportPolicy::kGrpc) {
    health_ = RdmaHealth::kGrpcOnly;
    reason_ = "policy 'grpc'";
  }
}

// Cancels a parked call on ClientContext::TryCancel. Once the call leaves
// the parking by another way, Forget() makes it a no-op, so a TryCancel
// that raced with that never reaches a router that is gone.
class TransportRouter::ParkedCanceller final : public CallCanceller {
 public:
  ParkedCanceller(TransportRouter* router, uint64_t ticket)
      : router_(router), ticket_(ticket) {}
  void Cancel(uint64_t /*call_id: one canceller per parking*/) override {
    std::optional<ClientCall> call;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (router_ != nullptr) call = router_->UnparkForCancel(ticket_);
    }
    if (!call) return;
    ClientContextAccess::DetachCanceller(call->ctx);
    auto done = std::move(call->done);
    done(absl::CancelledError("call cancelled while it waited for RDMA"));
  }
  void Forget() {
    std::lock_guard<std::mutex> lock(mu_);
    router_ = nullptr;
  }

 private:
  std::mutex mu_;  // taken before the router's mu_, never after
  TransportRouter* router_;
  const uint64_t ticket_;
};

bool TransportRouter::ParkLocked(ClientCall& call) {
  ParkedCall parked;
  parked.ticket = next_ticket_++;
  if (auto deadline = call.ctx->deadline()) {
    parked.deadline = std::chrono::steady_clock::now() +
                      (*deadline - std::chrono::system_clock::now());
  }
  parked.canceller = std::make_shared<ParkedCanceller>(this, parked.ticket);
  if (!ClientContextAccess::AttachCanceller(call.ctx, parked.canceller,
                                            call.call_id)) {
    return false;
  }
  parked.call = std::move(call);
  parked_.push_back(std::move(parked));
  cv_.notify_all();  // the loop re-reads the earliest deadline
  return true;
}

std::optional<ClientCall> TransportRouter::UnparkForCancel(uint64_t ticket) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = parked_.begin(); it != parked_.end(); ++it) {
    if (it->ticket != ticket) continue;
    ClientCall call = std::move(it->call);
    parked_.erase(it);
    return call;
  }
  return std::nullopt;
}

std::vector<TransportRouter::ParkedCall> TransportRouter::TakeExpiredLocked(
    std::chrono::steady_clock::time_point now) {
  std::vector<ParkedCall> expired;
  std::vector<ParkedCall> waiting;
  for (ParkedCall& p : parked_) {
    (p.deadline && *p.deadline <= now ? expired : waiting)
        .push_back(std::move(p));
  }
  parked_.swap(waiting);
  return expired;
}

void TransportRouter::Unparked(std::vector<ParkedCall>& calls) {
  for (ParkedCall& p : calls) {
    p.canceller->Forget();
    ClientContextAccess::DetachCanceller(p.call.ctx);
  }
}

void TransportRouter::FailParked(std::vector<ParkedCall> calls,
                                 const Status& status) {
  Unparked(calls);
  for (ParkedCall& p : calls) {
    auto done = std::move(p.call.done);
    done(status);
  }
}

TransportRouter::~TransportRouter() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Calls still on the fast path fail with UNAVAILABLE (not re-sent: the
  // channel is going); then the fallback goes.
  std::shared_ptr<FastTransport> fast;
  std::vector<std::shared_ptr<FastTransport>> retired;
  {
    std::lock_guard<std::mutex> lock(mu_);
    UnpublishFastLocked();
    fast = std::move(fast_);
    retired.swap(retired_);
  }
  fast.reset();
  retired.clear();
  std::vector<ParkedCall> parked;
  {
    std::lock_guard<std::mutex> lock(mu_);
    parked.swap(parked_);
  }
  FailParked(std::move(parked),
             absl::UnavailableError(
                 "the channel was destroyed while the call waited for RDMA"));
}

FastConnectResult TransportRouter::Connect() {
  FastPathHooks hooks;
  hooks.client_id = client_id_;
  hooks.reroute = [this](ClientCall call, std::string why) {
    SendOverFallback(std::move(call), std::move(why));
  };
  // The transport is not known yet when the hook is made; it names itself
  // through the connection it lost. Atomic: the connection may be lost on
  // its engine's thread as this one names it. Read under mu_ (OnLost), so
  // either the hook runs before AdoptLocked's look, which then finds the
  // transport unhealthy, or after it, and finds the name stored.
  auto self = std::make_shared<std::atomic<const FastTransport*>>(nullptr);
  hooks.lost = [this, self](const Status& why, const std::string& trigger) {
    OnLost(*self, why, trigger);
  };
  FastConnectResult connected = connect_(std::move(hooks));
  self->store(connected.transport.get(), std::memory_order_release);
  return connected;
}

void TransportRouter::OnLost(const std::atomic<const FastTransport*>& transport,
                             const Status& why, const std::string& trigger) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fast_ == nullptr ||
      fast_.get() != transport.load(std::memory_order_acquire)) {
    return;
  }
  MarkLostLocked(why, trigger);
}

void TransportRouter::MarkLostLocked(const Status& why,
                                     const std::string& trigger) {
  // Not destroyed here: this may run on the engine thread, inside the
  // transport's close; the background thread drops it.
  UnpublishFastLocked();
  retired_.push_back(std::move(fast_));
  health_ = RdmaHealth::kDegraded;
  // A connection that did not last (a path that loses packets lets a probe
  // through now and then, a port that flaps) earns no quick return: the
  // channel would bounce back onto the path and stall its calls again.
  if (std::chrono::steady_clock::now() - ready_since_ < kShortLived) {
    probe_backoff_ =
        std::min(probe_backoff_ * 2, options_.rdma_probe_max_backoff);
  } else {
    probe_backoff_ = options_.rdma_probe_initial_backoff;
  }
  ++counts_.switches;
  counts_.last_trigger = trigger;
  counts_.last_error = std::string(why.message());
  reason_ =
      absl::StrCat("RDMA connection lost: ", trigger, " (", why.message(), ")");
  cv_.notify_all();
}

void TransportRouter::Loop() {
  std::mt19937_64 random(client_id_);
  std::unique_lock<std::mutex> lock(mu_);
  while (true) {
    if (!retired_.empty()) {
      auto retired = std::move(retired_);
      retired_.clear();
      lock.unlock();
      retired.clear();  // waits for their calls to be re-sent
      lock.lock();
      continue;
    }
    if (stopping_ && health_ != RdmaHealth::kConnecting) return;
    if (health_ == RdmaHealth::kConnecting) {
      lock.unlock();
      FastConnectResult connected = Connect();
      lock.lock();
      if (connected.transport) {
        if (Status lost = AdoptLocked(std::move(connected.transport));
            !lost.ok()) {
          reason_ = absl::StrCat("RDMA connection lost as it connected (",
                                 lost.message(), ")");
          health_ = RdmaHealth::kDegraded;
          counts_.last_trigger = "connection lost";
          counts_.last_error = std::string(lost.message());
        }
      } else {
        reason_ = std::string(connected.error.message());
        // No RDMA on a side is not going to change; anything else might.
        if (connected.no_fast_path) {
          health_ = RdmaHealth::kGrpcOnly;
        } else {
          health_ = RdmaHealth::kDegraded;
          counts_.last_trigger = "connect failed";
          counts_.last_error = reason_;
        }
      }
      std::vector<ClientCall> waiting;
      waiting.swap(waiting_);
      lock.unlock();
      for (auto& call : waiting) (void)Route(std::move(call));
      lock.lock();
      continue;
    }
    if (health_ != RdmaHealth::kDegraded) {
      cv_.wait(lock, [this] {
        return stopping_ || health_ == RdmaHealth::kDegraded ||
               !retired_.empty();
      });
      continue;
    }
    std::uniform_real_distribution<double> jitter(0.75, 1.25);
    const auto probe_at = std::chrono::steady_clock::now() +
                          std::chrono::milliseconds(static_cast<int64_t>(
                              probe_backoff_.count() * jitter(random)));
    // Until the probe, parked calls fail as their deadlines pass.
    while (!stopping_) {
      auto until = probe_at;
      for (const ParkedCall& p : parked_) {
        if (p.deadline && *p.deadline < until) until = *p.deadline;
      }
      const uint64_t parked_before = next_ticket_;
      cv_.wait_until(lock, until, [&] {
        return stopping_ || next_ticket_ != parked_before;
      });
      const auto now = std::chrono::steady_clock::now();
      if (std::vector<ParkedCall> expired = TakeExpiredLocked(now);
          !expired.empty()) {
        Status late = absl::DeadlineExceededError(
            absl::StrCat("deadline passed while the call waited for RDMA "
                         "(policy 'rdma', wait_for_ready): ",
                         reason_));
        lock.unlock();
        FailParked(std::move(expired), late);
        lock.lock();
      }
      if (now >= probe_at) break;
    }
    if (stopping_) return;
    lock.unlock();
    FastConnectResult connected = Connect();
    lock.lock();
    ++counts_.probes;
    if (connected.transport && stopping_) {
      retired_.push_back(std::move(connected.transport));
      continue;
    }
    Status failed = connected.error;
    if (connected.transport) {
      if (Status lost = AdoptLocked(std::move(connected.transport));
          !lost.ok()) {
        failed = absl::UnavailableError(absl::StrCat(
            "connection lost as it connected (", lost.message(), ")"));
      }
    }
    if (health_ != RdmaHealth::kReady) {
      counts_.last_probe_error = std::string(failed.message());
      probe_backoff_ =
          std::min(probe_backoff_ * 2, options_.rdma_probe_max_backoff);
      continue;
    }
    ++counts_.switches;
    reason_.clear();
    // Calls that waited for this go now.
    std::vector<ParkedCall> parked;
    parked.swap(parked_);
    lock.unlock();
    Unparked(parked);
    for (ParkedCall& p : parked) (void)Route(std::move(p.call));
    lock.lock();
  }
}

Status TransportRouter::AdoptLocked(std::shared_ptr<FastTransport> transport) {
  // Asked under mu_, after Connect named the transport to its hook, which
  // reads the name under mu_: a loss whose hook runs after this look finds
  // it published; one whose hook ran before set the health this reads.
  if (Status health = transport->health(); !health.ok()) {
    retired_.push_back(std::move(transport));
    return health;
  }
  fast_ = std::move(transport);
  health_ = RdmaHealth::kReady;
  PublishFastLocked();
  ready_since_ = std::chrono::steady_clock::now();
  return absl::OkStatus();
}

ChannelTransportStats TransportRouter::stats() {
  ChannelTransportStats stats;
  std::shared_ptr<FastTransport> fast;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stats = counts_;
    stats.health = health_;
    stats.probe_backoff = probe_backoff_;
    fast = fast_;
    switch (health_) {
      case RdmaHealth::kNotTried:
        stats.rdma = "not tried yet";
        break;
      case RdmaHealth::kConnecting:
        stats.rdma = "connecting";
        break;
      case RdmaHealth::kReady:
        stats.rdma = absl::StrCat("ready: ", fast_->description());
        break;
      case RdmaHealth::kDegraded:
      case RdmaHealth::kGrpcOnly:
        stats.rdma = reason_;
        break;
    }
  }
  stats.calls_rdma = calls_fast_.load();
  stats.calls_grpc = calls_fallback_.load();
  stats.calls_resent = calls_resent_.load();
  if (fast) {
    FastPathCounters c = fast->counters();
    stats.rdma_frames_sent = c.frames_sent;
    stats.rdma_frames_received = c.frames_received;
    stats.rdma_writes_posted = c.writes_posted;
    stats.rdma_writes_posted_aside = c.writes_posted_aside;
    stats.rdma_credit_frames_sent = c.credit_frames_sent;
    stats.rdma_credits_granted = c.credits_granted;
    stats.rdma_waits_for_credit = c.waits_for_credit;
    stats.rdma_frames_unsignaled = c.frames_unsignaled;
    stats.rdma_flush_writes = c.flush_writes;
    stats.rdma_landing_windows = c.landing_windows;
    stats.rdma_landing_registrations = c.landing_registrations;
    stats.rdma_landing_window_waits = c.landing_window_waits;
    stats.rdma_watch_wakeups = c.watch_wakeups;
    stats.rdma_caller_polls = c.caller_polls;
    stats.rdma_queue_arms = c.queue_arms;
    stats.rdma_callback_stalls = c.callback_stalls;
  }
  return stats;
}

void TransportRouter::SendOverFallback(ClientCall call, std::string why) {
  CallStats* stats = ClientContextAccess::mutable_stats(call.ctx);
  const bool resend = call.resend.has_value();
  if (options_.policy == TransportPolicy::kRdma) {
    stats->transport_reason = why;
    auto done = std::move(call.done);
    done(absl::UnavailableError(
        absl::StrCat("call ", call.method,
                     resend ? " failed: policy 'rdma' and "
                            : " not sent: policy 'rdma' and ",
                     why, resend ? " (it may have run on the server)" : "")));
    return;
  }
  stats->transport = TransportKind::kGrpc;
  ++calls_fallback_;
  if (options_.policy == TransportPolicy::kGrpc) {
    stats->transport_reason = why;
  } else {
    if (resend) ++calls_resent_;
    stats->transport_reason =
        absl::StrCat("policy 'auto': ", why, "; gRPC carries the call");
    // A call that fails on gRPC too says what was tried.
    call.done = [done = std::move(call.done), why,
                 resend](Status status) mutable {
      if (status.code() == StatusCode::kUnavailable) {
        status = absl::UnavailableError(absl::StrCat(
            status.message(),
            resend ? " [tried RDMA first: " : " [RDMA not used: ", why,
            "; then gRPC]"));
      }
      done(std::move(status));
    };
  }
  fallback_->Start(std::move(call));
}

void TransportRouter::UnpublishFastLocked() {
  fast_state_.fetch_and(~kFastReady);
  while (fast_state_.load() >= kRouteReader) std::this_thread::yield();
}

TransportKind TransportRouter::Route(ClientCall call) {
  // Calls that wait for RDMA or go over it complete on other threads, and
  // may be re-sent from those.
  const bool caller_drives = std::exchange(call.caller_drives, false);
  std::shared_ptr<FastTransport> fast;
  // The common case, ready: no lock (see fast_state_). A transport that
  // says it is lost goes the locked way, which marks it so.
  // Counted only while the bit is set, so an unpublish waits only for the
  // readers already inside.
  uint32_t state = fast_state_.load();
  while ((state & kFastReady) != 0 &&
         !fast_state_.compare_exchange_weak(state, state + kRouteReader)) {
  }
  if ((state & kFastReady) != 0) {
    fast = fast_;
    fast_state_.fetch_sub(kRouteReader);
  }
  if (fast != nullptr && !fast->health().ok()) fast.reset();
  std::string why;
  bool cancelled = false;
  if (fast == nullptr) {
    std::lock_guard<std::mutex> lock(mu_);
    switch (health_) {
      case RdmaHealth::kNotTried:
        health_ = RdmaHealth::kConnecting;
        thread_ = std::thread([this] { Loop(); });
        pthread_setname_np(thread_.native_handle(), "rdmarpc-probe");
        [[fallthrough]];
      case RdmaHealth::kConnecting:
        waiting_.push_back(std::move(call));
        return TransportKind::kNone;
      case RdmaHealth::kReady:
        if (Status health = fast_->health(); health.ok()) {
          fast = fast_;
          break;
        } else {
          // Lost, and its hook (OnLost, waiting for mu_) has not said so.
          MarkLostLocked(health, "connection lost");
        }
        [[fallthrough]];
      case RdmaHealth::kDegraded:
        if (options_.policy == TransportPolicy::kRdma && !call.resend &&
            call.ctx->wait_for_ready()) {
          if (ParkLocked(call)) return TransportKind::kNone;
          cancelled = true;
          break;
        }
        why = absl::StrCat(reason_, "; RDMA is being probed");
        break;
      case RdmaHealth::kGrpcOnly:
        why = reason_;
        break;
    }
  }
  if (cancelled) {
    auto done = std::move(call.done);
    done(absl::CancelledError("call cancelled before start"));
    return TransportKind::kNone;
  }
  if (!fast) {
    call.caller_drives = caller_drives;
    SendOverFallback(std::move(call), std::move(why));
    return TransportKind::kGrpc;
  }
  ++calls_fast_;
  ClientContextAccess::mutable_stats(call.ctx)->transport =
      TransportKind::kRdma;
  call.caller_drives = caller_drives;
  fast->Start(std::move(call));
  return TransportKind::kRdma;
}

}  // namespace rdmarpc::internal
