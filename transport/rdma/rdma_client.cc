#include "transport/rdma/rdma_client.h"

#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "runtime/access.h"
#include "runtime/coarse_clock.h"
#include "runtime/fault_injection.h"
#include "transport/rdma/client_calls.h"
#include "transport/rdma/connection_setup.h"
#include "transport/rdma/engine.h"
#include "transport/rdma/handshake.h"
#include "transport/rdma/wire.h"

namespace rdmarpc::rdma {
namespace {

internal::FastConnectResult NoRdma(absl::string_view why) {
  return {nullptr, absl::FailedPreconditionError(why), /*no_fast_path=*/true};
}

internal::FastConnectResult Failed(absl::string_view why) {
  return {nullptr, absl::UnavailableError(why)};
}

// The connect timeout covers the handshake and the RDMA connect together;
// whichever step it runs out in, the error names the option.
internal::FastConnectResult TimedOut(std::chrono::milliseconds timeout,
                                     absl::string_view step,
                                     absl::string_view detail) {
  return Failed(absl::StrCat(
      "the RDMA connect did not finish within ", timeout.count(),
      " ms (ChannelOptions::rdma_connect_timeout; raise it for a slow or "
      "loaded server): ",
      step, ": ", detail));
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
  const auto timeout = options.rdma_connect_timeout;
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  auto answer =
      setup->UnaryBytes(kHelloMethod, hello.SerializeAsString(), timeout);
  if (!answer.ok()) {
    if (answer.status().code() == StatusCode::kUnimplemented) {
      return NoRdma(
          "the server does not offer RDMA (it has no handshake method)");
    }
    if (answer.status().code() == StatusCode::kDeadlineExceeded) {
      return TimedOut(timeout, "handshake over gRPC",
                      answer.status().message());
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
  config.peer_first_receives = server->first_receives;
  config.first_receives = FirstReceives(config.receives);
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
  auto conn = ConnectToServer(server->cm_address,
                              static_cast<uint16_t>(server->cm_port),
                              server->token, config, t->endpoint_, deadline);
  if (!conn.ok()) {
    if (conn.status().code() == StatusCode::kDeadlineExceeded) {
      return TimedOut(timeout, "RDMA connect", conn.status().message());
    }
    return Failed(conn.status().message());
  }
  t->conn_ = *std::move(conn);
  if (ibv_context* device = t->conn_->cm_id()->verbs) {
    absl::StrAppend(&t->description_, " (", ibv_get_device_name(device->device),
                    ")");
  }
  t->endpoint_->Attach(t->conn_);
  t->wake_fd_ = UniqueFd(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (t->wake_fd_.get() < 0) {
    return Failed(absl::StrCat("eventfd: ", std::strerror(errno)));
  }
  t->monitor_ = std::thread([raw = t.get()] { raw->Monitor(); });
  pthread_setname_np(t->monitor_.native_handle(), "rdmarpc-monitor");
  return {std::move(t), absl::OkStatus()};
}

RdmaClientTransport::~RdmaClientTransport() {
  stop_.store(true);
  if (monitor_.joinable()) {
    WakeMonitor();
    monitor_.join();
  }
  if (!conn_) return;  // Connect failed: no connection, no calls
  endpoint_->BeginShutdown();
  conn_->Close(absl::UnavailableError("the channel was destroyed"),
               "channel destroyed");
  endpoint_->WaitClosed();
}

void RdmaClientTransport::Monitor() {
  using SteadyClock = std::chrono::steady_clock;
  // When the last ping went out (it is answered once anything is heard
  // after it); none while it is the epoch.
  SteadyClock::time_point ping_sent_at;
  uint64_t ping_sequence = 0;
  // When a call was last seen outstanding (or woke the monitor).
  SteadyClock::time_point active_at = internal::CoarseSteadyNow();
  // When the monitor last woke far later than it asked to: this process,
  // or the whole (virtual) machine, did not run meanwhile, so the server
  // may not have either. No call counts as still before then.
  SteadyClock::time_point overslept_at;
  const auto oversleep = std::max<std::chrono::milliseconds>(
      std::chrono::milliseconds(50), peer_timeout_ / 6);
  while (!stop_.load()) {
    std::chrono::milliseconds wait = endpoint_->ExpireDeadlines();
    if (RDMARPC_FAULT("rdma.client.qp_error")) {
      Status injected = conn_->InjectQueuePairError();
      if (!injected.ok()) conn_->Close(injected, "fault injection");
    }
    // A call that RDMA stops moving must not wait forever while the server
    // may still answer over gRPC: a server whose RDMA side went silent, or
    // a path that loses so many packets that retransmission crawls. A call
    // that has not moved for a third of the peer timeout (beyond what its
    // bytes in flight may take) makes the watcher ping; the pong names the
    // calls whose handlers run, which counts as moving. A call that stays
    // still for the whole timeout closes the connection, which re-sends it
    // over gRPC with the same call id.
    size_t outstanding = 0;
    bool counted = false;
    if (peer_timeout_.count() > 0) {
      const auto now = internal::CoarseSteadyNow();
      ClientEndpoint::ProgressWatch watch = endpoint_->WatchProgress(
          now, peer_timeout_,
          std::max({Engine::NotStillBefore(conn_.get(), now),
                    conn_->NotStillBefore(now), overslept_at}));
      outstanding = watch.outstanding;
      counted = true;
      const SteadyClock::time_point heard = conn_->last_heard();
      if (watch.stalled_call != 0 && !conn_->closed()) {
        auto still_ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                            now - watch.stalled_since)
                            .count();
        // Pongs go out only for calls still for a third of the timeout,
        // so one after the call last moved is an answer to its ping.
        if (watch.last_pong <= watch.stalled_since) {
          conn_->Close(
              absl::UnavailableError(absl::StrCat(
                  "the server did not answer on RDMA for ", still_ms,
                  " ms with ", watch.outstanding, " calls outstanding")),
              "server silent on RDMA");
        } else {
          conn_->Close(
              absl::UnavailableError(absl::StrCat(
                  "call ", watch.stalled_call, " made no progress on RDMA for ",
                  still_ms,
                  " ms while the server answered and was not running its "
                  "handler: the RDMA path is stuck or losing packets")),
              "no progress on RDMA");
        }
      } else if (watch.ping_needed &&
                 (heard >= ping_sent_at ||
                  now - ping_sent_at >= peer_timeout_ / 3)) {
        Ping ping;
        ping.set_sequence(++ping_sequence);
        // A ping that cannot be sent is on a closing connection.
        if (conn_->SendFrame(FrameType::kPing, &ping).ok()) {
          ping_sent_at = now;
        }
      }
      if (watch.outstanding > 0) {
        wait = std::min(
            wait, std::max(std::chrono::milliseconds(1), peer_timeout_ / 6));
      }
    }
    // After a second without calls, rest. Only when no call is
    // outstanding after announcing it: a call started before the
    // announcement is seen here, one started after it finds
    // monitor_resting_ set and wakes us. (A channel in use never rests,
    // so its callers never pay for the wake-up.)
    const auto checked_at = internal::CoarseSteadyNow();
    bool resting = false;
    if (!counted) {
      outstanding =
          endpoint_->WatchProgress(checked_at, peer_timeout_).outstanding;
    }
    if (outstanding > 0) {
      active_at = checked_at;
    } else if (checked_at - active_at >= std::chrono::seconds(1)) {
      monitor_resting_.store(true);
      resting =
          endpoint_->WatchProgress(checked_at, peer_timeout_).outstanding == 0;
      if (!resting) monitor_resting_.store(false);
    }
    // Resting, nothing is due until a call starts (which wakes us) or the
    // CM reports the connection gone: an idle channel costs no wake-ups.
    pollfd fds[2] = {{conn_->cm_events()->fd, POLLIN, 0},
                     {wake_fd_.get(), POLLIN, 0}};
    const SteadyClock::time_point wake_by = internal::CoarseSteadyNow() + wait;
    int ready = poll(fds, 2, resting ? -1 : static_cast<int>(wait.count()));
    watch_wakeups_.fetch_add(1, std::memory_order_relaxed);
    if (!resting) {
      const SteadyClock::time_point woke = internal::CoarseSteadyNow();
      if (woke - wake_by >= oversleep) overslept_at = woke;
    }
    monitor_resting_.store(false);
    if (ready > 0 && (fds[1].revents & POLLIN) != 0) {
      uint64_t drained = 0;
      (void)!read(wake_fd_.get(), &drained, sizeof(drained));
      active_at = internal::CoarseSteadyNow();
    }
    if (ready <= 0 || (fds[0].revents & POLLIN) == 0) continue;
    auto event = NextCmEvent(conn_->cm_events(), std::chrono::milliseconds(0));
    if (!event.ok()) continue;
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
  // The caller waits for this call next: it polls the queue itself.
  const bool caller_polls = std::exchange(call.caller_drives, false);
  if (caller_polls) internal::OfferCallerPoll(conn_);
  endpoint_->Start(std::move(call));
  // No caller polls for this one: an engine asleep must watch for it.
  if (!caller_polls) conn_->HandToEngine();
  if (monitor_resting_.exchange(false)) WakeMonitor();
}

void RdmaClientTransport::WakeMonitor() {
  uint64_t one = 1;
  (void)!write(wake_fd_.get(), &one, sizeof(one));
}

Status RdmaClientTransport::health() const { return endpoint_->health(); }

internal::FastPathCounters RdmaClientTransport::counters() const {
  internal::FastPathCounters c = conn_->counters();
  c.watch_wakeups = watch_wakeups_.load(std::memory_order_relaxed);
  c.caller_polls = conn_->caller_polls_found();
  c.queue_arms = conn_->group()->arms();
  c.callback_stalls = endpoint_->callback_stalls();
  c.landing_registrations = endpoint_->landing_registrations();
  return c;
}

}  // namespace rdmarpc::rdma
