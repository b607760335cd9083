#include "runtime/transport_router.h"

#include <pthread.h>

#include <algorithm>
#include <random>
#include <utility>

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
    fast = std::move(fast_);
    retired.swap(retired_);
  }
  fast.reset();
  retired.clear();
}

FastConnectResult TransportRouter::Connect() {
  FastPathHooks hooks;
  hooks.client_id = client_id_;
  hooks.reroute = [this](ClientCall call, std::string why) {
    SendOverFallback(std::move(call), std::move(why));
  };
  // The transport is not known yet when the hook is made; it names itself
  // through the connection it lost.
  auto self = std::make_shared<const FastTransport*>(nullptr);
  hooks.lost = [this, self](const Status& why, const std::string& trigger) {
    OnLost(*self, why, trigger);
  };
  FastConnectResult connected = connect_(std::move(hooks));
  *self = connected.transport.get();
  return connected;
}

void TransportRouter::OnLost(const FastTransport* transport, const Status& why,
                             const std::string& trigger) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fast_ == nullptr || fast_.get() != transport) return;
  MarkLostLocked(why, trigger);
}

void TransportRouter::MarkLostLocked(const Status& why,
                                     const std::string& trigger) {
  // Not destroyed here: this may run on the engine thread, inside the
  // transport's close; the background thread drops it.
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
        fast_ = std::move(connected.transport);
        health_ = RdmaHealth::kReady;
        ready_since_ = std::chrono::steady_clock::now();
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
    auto wait = std::chrono::milliseconds(
        static_cast<int64_t>(probe_backoff_.count() * jitter(random)));
    if (cv_.wait_for(lock, wait, [this] { return stopping_; })) return;
    lock.unlock();
    FastConnectResult connected = Connect();
    lock.lock();
    ++counts_.probes;
    if (!connected.transport) {
      counts_.last_probe_error = std::string(connected.error.message());
      probe_backoff_ =
          std::min(probe_backoff_ * 2, options_.rdma_probe_max_backoff);
      continue;
    }
    if (stopping_) {
      retired_.push_back(std::move(connected.transport));
      continue;
    }
    fast_ = std::move(connected.transport);
    health_ = RdmaHealth::kReady;
    ready_since_ = std::chrono::steady_clock::now();
    ++counts_.switches;
    reason_.clear();
  }
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
    stats.rdma_waits_for_credit = c.waits_for_credit;
    stats.rdma_frames_unsignaled = c.frames_unsignaled;
    stats.rdma_flush_writes = c.flush_writes;
    stats.rdma_watch_wakeups = c.watch_wakeups;
    stats.rdma_caller_polls = c.caller_polls;
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

TransportKind TransportRouter::Route(ClientCall call) {
  // Calls that wait for RDMA or go over it complete on other threads, and
  // may be re-sent from those.
  const bool caller_drives = std::exchange(call.caller_drives, false);
  std::shared_ptr<FastTransport> fast;
  std::string why;
  {
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
          // Lost before the transport could name itself to OnLost.
          MarkLostLocked(health, "connection lost");
        }
        [[fallthrough]];
      case RdmaHealth::kDegraded:
        why = absl::StrCat(reason_, "; RDMA is being probed");
        break;
      case RdmaHealth::kGrpcOnly:
        why = reason_;
        break;
    }
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
