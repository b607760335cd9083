// Picks, per call, the transport that carries it: a fast transport
// connected at run time (RDMA) or the always-available fallback (gRPC),
// following the channel's policy and the fast path's health. It knows the
// transports only through runtime/transport.h, so it is tested against
// fakes (tests/runtime/transport_router_test.cc).
//
//   TransportRouter router(options, client_id, grpc.get(),
//                          [&](FastPathHooks hooks) {
//                            return rdma::RdmaClientTransport::Connect(
//                                grpc.get(), channel_options, hooks);
//                          });
//   router.Route(std::move(call));   // done runs exactly once
//
// Health (docs/design.md has the diagram): the first call starts a
// background thread that connects; calls wait for the outcome. A
// connected fast path carries calls until it is lost; then calls go to the
// fallback, calls in flight come back through the hooks with `resend`
// set, and the thread probes with exponential backoff and jitter until a
// connect succeeds. A connect that says there is no fast path at all ends
// it for the router's life.
//
// Ownership: `fallback` is borrowed and must outlive the router; the
// router owns the fast transports it connects and destroys them on its
// thread (never inside their own callbacks).
#ifndef RDMARPC_RUNTIME_TRANSPORT_ROUTER_H_
#define RDMARPC_RUNTIME_TRANSPORT_ROUTER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "rdmarpc/channel_options.h"
#include "runtime/transport.h"

namespace rdmarpc::internal {

class TransportRouter {
 public:
  using Connector = std::function<FastConnectResult(FastPathHooks hooks)>;

  TransportRouter(const ChannelOptions& options, uint64_t client_id,
                  ClientTransport* fallback, Connector connect);
  // Stops probing; calls still on the fast path fail with UNAVAILABLE (not
  // re-sent: the channel is going away).
  ~TransportRouter();
  TransportRouter(const TransportRouter&) = delete;
  TransportRouter& operator=(const TransportRouter&) = delete;

  // Hands `call` to the transport the policy and the health pick, and
  // returns which one took it (kNone: it waits for the first connect).
  TransportKind Route(ClientCall call);

  ChannelTransportStats stats();

 private:
  // Sends `call` over the fallback (or fails it under policy rdma); `why`
  // goes in its stats and, should the fallback fail too, in its status.
  void SendOverFallback(ClientCall call, std::string why);
  // The background thread: the first connect, then probes while degraded.
  void Loop();
  FastConnectResult Connect();
  // Makes a connected `transport` the fast path (kReady), unless it was
  // lost already: then it is retired and its health returned. Requires mu_.
  Status AdoptLocked(std::shared_ptr<FastTransport> transport);
  // Runs on the transport's thread when its connection broke; `transport`
  // names it once Connect returned (read under mu_).
  void OnLost(const std::atomic<const FastTransport*>& transport,
              const Status& why, const std::string& trigger);
  // rdma-ready -> degraded. Requires mu_.
  void MarkLostLocked(const Status& why, const std::string& trigger);
  // A call that waits for the fast path under policy 'rdma'
  // (ClientContext::set_wait_for_ready) while it is down: sent when a probe
  // brings it back, failed at the call's deadline, on TryCancel, or when
  // the router goes.
  class ParkedCanceller;
  struct ParkedCall {
    ClientCall call;
    uint64_t ticket = 0;
    std::optional<std::chrono::steady_clock::time_point> deadline;
    std::shared_ptr<ParkedCanceller> canceller;
  };
  // Parks `call`; false (and `call` untouched) if it was cancelled first.
  // Requires mu_.
  bool ParkLocked(ClientCall& call);
  // Takes the parked call `ticket` out, if still parked (TryCancel).
  std::optional<ClientCall> UnparkForCancel(uint64_t ticket);
  // Parked calls whose deadline passed, taken out. Requires mu_.
  std::vector<ParkedCall> TakeExpiredLocked(
      std::chrono::steady_clock::time_point now);
  // Calls taken out of the parking: their cancellers let go of the router.
  // Not under mu_ (a TryCancel may be waiting for it).
  static void Unparked(std::vector<ParkedCall>& calls);
  // Unparked, then completed with `status`. Not under mu_.
  static void FailParked(std::vector<ParkedCall> calls, const Status& status);

  // A fast path lost sooner than this after it became ready keeps the
  // probe backoff growing (ChannelOptions::rdma_probe_max_backoff).
  static constexpr std::chrono::seconds kShortLived{10};

  const ChannelOptions options_;
  const uint64_t client_id_;
  ClientTransport* const fallback_;
  const Connector connect_;

  std::mutex mu_;
  std::condition_variable cv_;
  RdmaHealth health_ = RdmaHealth::kNotTried;
  std::string reason_;  // why the fast path is not used (degraded, grpc-only)
  std::shared_ptr<FastTransport> fast_;
  // Route's way to a ready fast path without mu_: kFastReady is set while
  // health_ is kReady (fast_ set); a Route counts itself a reader (the bits
  // above) only while it is set, in one step, and then copies fast_.
  // fast_ changes only after UnpublishFastLocked cleared the bit and
  // waited for the readers (each holds on only while it copies).
  static constexpr uint32_t kFastReady = 1;
  static constexpr uint32_t kRouteReader = 2;
  std::atomic<uint32_t> fast_state_{0};
  void PublishFastLocked() { fast_state_.fetch_or(kFastReady); }
  void UnpublishFastLocked();
  // Lost transports, destroyed by the background thread.
  std::vector<std::shared_ptr<FastTransport>> retired_;
  std::vector<ClientCall> waiting_;  // while kConnecting
  std::vector<ParkedCall> parked_;
  uint64_t next_ticket_ = 1;
  ChannelTransportStats counts_;  // switches, triggers, probes
  // The wait before the next probe, and when the fast path last became
  // ready (a connection lost soon after keeps the backoff growing).
  std::chrono::milliseconds probe_backoff_;
  std::chrono::steady_clock::time_point ready_since_;
  std::atomic<uint64_t> calls_fast_{0};
  std::atomic<uint64_t> calls_fallback_{0};
  std::atomic<uint64_t> calls_resent_{0};
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace rdmarpc::internal

#endif  // RDMARPC_RUNTIME_TRANSPORT_ROUTER_H_
